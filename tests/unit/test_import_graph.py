"""The package's import graph: no cycles, no import from a lower floor to a higher one, and the runtime imports
none of the ``[export]`` side.

Every import counts, function-level ones too (a cycle held apart by an import inside a function is still a
cycle), and so do imports under ``if TYPE_CHECKING:``: they do not run, but a reader follows them all the same.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import cosyvoice_cpu

PACKAGE = Path(cosyvoice_cpu.__file__).parent
EXPORT_SIDE = (
    "cosyvoice_cpu.reference",
    "cosyvoice_cpu.export",
    "cosyvoice_cpu.fixtures",
    "cosyvoice_cpu.workshop",
)
PUBLIC: dict[str, str] = cosyvoice_cpu._PUBLIC  # name -> its module: `from cosyvoice_cpu import Engine` imports engine


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in the file, TYPE_CHECKING blocks included)."""
    files = {_module_name(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            if isinstance(node, ast.ImportFrom) and node.module == "cosyvoice_cpu":  # the lazy public names
                targets += [PUBLIC[a.name] for a in node.names if a.name in PUBLIC]
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_the_package_has_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_runtime_imports_nothing_of_the_export_side() -> None:
    """Outside ``reference/``, ``export/`` and ``fixtures/`` only the CLI (``fixture``, ``export``, ``bench``
    commands, behind the [export] extra) may reach into them."""
    graph = import_graph()
    allowed = ("cosyvoice_cpu.cli.", *EXPORT_SIDE)
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() if not m.startswith(allowed)
                 for t in ts if t.startswith(EXPORT_SIDE))  # fmt: skip
    assert not bad, "runtime modules import the export side:\n" + "\n".join(bad)


def _sources() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in PACKAGE.rglob("*.py")}


def _loads_by_name(node: ast.AST) -> bool:
    """``importlib.import_module(...)``, ``import_module(...)`` or ``__import__(...)``."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id in ("import_module", "__import__")
    )


def test_no_module_is_loaded_by_a_string_name() -> None:
    """Plans and loaders reference functions and modules directly (a reader, an IDE and :func:`import_graph`
    follow them); only the package's lazy ``__init__`` (the public API) imports by name."""
    sources = _sources()
    bad = sorted(
        f"{name}:{node.lineno}"
        for name, tree in sources.items()
        if name != "cosyvoice_cpu"
        for node in ast.walk(tree)
        if _loads_by_name(node)
    )
    assert not bad, "modules imported from strings:\n" + "\n".join(bad)
    assert any(_loads_by_name(n) for n in ast.walk(sources["cosyvoice_cpu"]))  # the check sees a real one


def test_no_module_imports_another_modules_private_names() -> None:
    """``from cosyvoice_cpu.x import _name`` couples a module to another's internals: make the name public (or
    move it where both can use it)."""
    bad = sorted(
        f"{name}:{node.lineno}: {a.name}"
        for name, tree in _sources().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cosyvoice_cpu")
        for a in node.names
        if a.name.startswith("_") and not a.name.startswith("__")
    )
    assert not bad, "imports of private names:\n" + "\n".join(bad)


def test_the_facts_table_is_on_the_ground_floor() -> None:
    """``cosyvoice_cpu.facts`` imports nothing of the package but ``errors`` (the manifest, the LM's silence
    filter, voices and the PyTorch side read it: nothing they import may sit above them)."""
    assert import_graph()["cosyvoice_cpu.facts"] <= {"cosyvoice_cpu.errors"}
    assert import_graph()["cosyvoice_cpu.errors"] == set()


# The house's floors, ground first: a module imports only modules of its own floor or lower ones. A name is a
# top-level module or package of cosyvoice_cpu (a package's modules share its floor); the package's own
# ``__init__`` (``__version__``, the lazy public names) is the ground. The torch side (``[export]``) stands above
# the runtime it exports and checks, below the CLI. A new module needs a place here.
FLOORS = (
    ("errors", "jsontypes", "facts", "lm_files", "paths"),
    ("text", "audio", "manifest"),
    ("hardware",),
    ("backends",),
    ("lm", "flow", "vocoder", "voices", "config"),
    ("sentence",),
    ("families",),
    ("engine", "text_stream"),
    ("server", "benchmark", "probes"),
    ("reference",),
    ("fixtures", "export"),
    ("workshop",),
    ("cli", "__main__"),
)


def upward_imports(graph: dict[str, set[str]], floors: tuple[tuple[str, ...], ...]) -> list[str]:
    """``"a -> b"`` for every import from a module to one on a higher floor (modules on no floor are skipped)."""
    level = {name: i for i, names in enumerate(floors) for name in names}

    def floor(module: str) -> int | None:
        parts = module.split(".")
        return 0 if len(parts) == 1 else level.get(parts[1])

    placed = {m: f for m in graph if (f := floor(m)) is not None}
    return sorted(
        f"{m} (floor {placed[m]}) -> {t} (floor {placed[t]})"
        for m, ts in graph.items()
        if m in placed
        for t in ts
        if placed.get(t, 0) > placed[m]
    )


def test_no_module_imports_a_higher_floor() -> None:
    """Function-level and ``TYPE_CHECKING`` imports included: a reader follows them all the same. (So the torch
    side's table of families, ``workshop.parts``, is read only beside it and above: no per-family module knows it.)"""
    graph = import_graph()
    names = {m.split(".")[1] for m in graph if m != "cosyvoice_cpu"}
    placed = {name for names in FLOORS for name in names}
    assert names <= placed, f"modules on no floor (give them one in FLOORS): {sorted(names - placed)}"
    bad = upward_imports(graph, FLOORS)
    assert not bad, "imports that run back up from a lower floor:\n" + "\n".join(bad)
    fake = {"p.a": {"p.b", "p"}, "p.b": {"p.c.x"}, "p.c.x": {"p.a"}, "p": set()}
    assert upward_imports(fake, (("a",), ("b", "c"))) == ["p.a (floor 0) -> p.b (floor 1)"]  # the check sees one


def test_only_the_backends_import_the_inference_libraries() -> None:
    """The runtime reaches ONNX Runtime and OpenVINO through ``backends/`` alone (versions too:
    ``Backend.version``). The export side may use their tools (ORT's quantizers, OpenVINO's graph API)."""
    libraries = ("onnxruntime", "openvino")
    bad = sorted(
        f"{name}:{node.lineno}"
        for name, tree in _sources().items()
        if not name.startswith(("cosyvoice_cpu.backends", *EXPORT_SIDE))
        for node in ast.walk(tree)
        if (isinstance(node, ast.Import) and any(a.name.split(".")[0] in libraries for a in node.names))
        or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in libraries)
    )
    assert not bad, "runtime modules importing an inference library directly:\n" + "\n".join(bad)
    concrete = ("cosyvoice_cpu.backends.onnxruntime", "cosyvoice_cpu.backends.openvino")
    outside = [m for m in import_graph().items() if not m[0].startswith(("cosyvoice_cpu.backends", *EXPORT_SIDE))]
    around = sorted(f"{m} -> {t}" for m, ts in outside for t in ts if t in concrete)
    assert not around, "runtime modules opening graphs around the seam (use backends.registry):\n" + "\n".join(around)


_DOTTED = re.compile(r"cosyvoice_cpu(?:\.[A-Za-z_]\w*)+")


def _stale_references(sources: dict[str, str]) -> list[str]:
    """``cosyvoice_cpu.x.y`` names in ``sources`` (module -> text) that are neither a module nor a name defined at
    the top of the module they start with (a def, class or assignment)."""
    stale = []
    for module, text in sources.items():
        for name in sorted(set(_DOTTED.findall(text))):
            parts = name.split(".")
            if parts[-1] in ("json", "npz", "npy", "onnx", "data", "xml", "bin"):
                continue  # a file name (the manifest's cosyvoice_cpu.json)
            for i in range(len(parts), 0, -1):
                target = ".".join(parts[:i])
                if target in sources:
                    rest = parts[i:] or [""]
                    pattern = rf"^(?:class|def|async def)\s+{re.escape(rest[0])}\b|^{re.escape(rest[0])}\b\s*[:=]"
                    if rest[0] and not re.search(pattern, sources[target], re.M):
                        stale.append(f"{module}: {name}")
                    break
            else:
                stale.append(f"{module}: {name}")
    return stale


def test_runtime_docstrings_name_modules_that_exist() -> None:
    """A docstring or comment of the runtime that names ``cosyvoice_cpu.<module>[.<name>]`` names one that exists
    (the torch side was reorganized once: ``export.lm_graph`` became ``export.lm.cosyvoice2``, and so on)."""
    sources = {_module_name(p): p.read_text() for p in PACKAGE.rglob("*.py")}
    runtime = {m: t for m, t in sources.items() if not m.startswith(EXPORT_SIDE)}
    stale = _stale_references(sources)
    bad = [s for s in stale if s.split(":")[0] in runtime]
    assert not bad, "runtime docstrings naming modules or names that do not exist:\n" + "\n".join(bad)
    fake = {"cosyvoice_cpu.a": "x = 1\ndef f(): ...", "cosyvoice_cpu.b": "see cosyvoice_cpu.a.f, cosyvoice_cpu.a.g"}
    assert _stale_references(fake) == ["cosyvoice_cpu.b: cosyvoice_cpu.a.g"]  # the check sees a stale name
