"""Read an official CosyVoice ``*.yaml`` as plain data, without executing it.

The released yamls are HyperPyYAML: ``!new:pkg.Class`` builds an object, ``!name:pkg.func`` binds a function,
``!apply:f [args]`` calls one and ``!ref <key>`` points at another entry (optionally inside a small arithmetic
expression such as ``!ref <token_frame_rate> * <token_mel_ratio>``). Loading it with HyperPyYAML imports and
runs the official code; we only need the numbers. This module parses the same file with a safe YAML loader,
turns every tagged node into a :class:`Tagged` record and resolves ``!ref`` against the top-level keys.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cosyvoice_cpu.errors import ModelDirError

_REF = re.compile(r"<([A-Za-z_][A-Za-z0-9_.]*)>")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.USub: operator.neg,
}


@dataclass
class Tagged:
    """A ``!new:``/``!name:``/``!apply:`` node: ``kind`` is new|name|apply, ``target`` the dotted path."""

    kind: str
    target: str
    args: Any = field(default_factory=dict)

    @property
    def class_name(self) -> str:
        return self.target.rsplit(".", 1)[-1]

    def get(self, key: str, default: Any = None) -> Any:
        return self.args.get(key, default) if isinstance(self.args, dict) else default

    def __getitem__(self, key: str) -> Any:
        if not isinstance(self.args, dict) or key not in self.args:
            raise KeyError(f"{self.target} has no argument {key!r}")
        return self.args[key]


@dataclass
class _Ref:
    expr: str


class _Loader(yaml.SafeLoader):
    pass


def _multi(kind: str):
    def construct(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Tagged:
        if isinstance(node, yaml.MappingNode):
            args: Any = loader.construct_mapping(node, deep=True)
        elif isinstance(node, yaml.SequenceNode):
            args = loader.construct_sequence(node, deep=True)
        else:
            value = loader.construct_scalar(node)
            args = {} if value in ("", None) else value
        return Tagged(kind, suffix, args)

    return construct


def _ref(loader: yaml.SafeLoader, node: yaml.Node) -> _Ref:
    return _Ref(str(loader.construct_scalar(node)))


for _kind in ("new", "name", "apply"):
    _Loader.add_multi_constructor(f"!{_kind}:", _multi(_kind))
_Loader.add_constructor("!ref", _ref)
# HyperPyYAML's yaml resolver reads 1e-06 as a float; PyYAML's YAML 1.1 resolver needs a dot.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$"),
    list("-+0123456789"),
)


def _eval_arith(expr: str) -> Any:
    tree = ast.parse(expr, mode="eval")

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression {expr!r}")

    return ev(tree)


def _resolve(value: Any, top: dict[str, Any], stack: tuple[str, ...]) -> Any:
    if isinstance(value, _Ref):
        names = _REF.findall(value.expr)
        if len(names) == 1 and value.expr.strip() == f"<{names[0]}>":
            return _lookup(names[0], top, stack)
        text = _REF.sub(lambda m: repr(_lookup(m.group(1), top, stack)), value.expr)
        return _eval_arith(text)
    if isinstance(value, Tagged):
        return Tagged(value.kind, value.target, _resolve(value.args, top, stack))
    if isinstance(value, dict):
        return {k: _resolve(v, top, stack) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, top, stack) for v in value]
    return value


def _lookup(name: str, top: dict[str, Any], stack: tuple[str, ...]) -> Any:
    if name in stack:
        raise ValueError(f"circular !ref through {' -> '.join(stack + (name,))}")
    if name not in top:
        raise ValueError(f"!ref <{name}> names no top-level entry")
    return _resolve(top[name], top, stack + (name,))


def load_yaml_data(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parse an official CosyVoice yaml into plain data with every ``!ref`` resolved.

    Args:
        path: the ``cosyvoice*.yaml`` file.
        overrides: top-level values to replace before resolution (as HyperPyYAML's ``overrides``).
    Returns:
        A dict of top-level keys; tagged nodes become :class:`Tagged`.
    Raises:
        ModelDirError: the file is missing or is not a readable CosyVoice yaml.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ModelDirError(f"{path} not found: the model directory must contain its official yaml") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ModelDirError(f"{path} cannot be read as UTF-8 text ({e}); re-download the model directory") from e
    try:
        raw = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ModelDirError(f"{path} is not valid YAML ({e}); re-download the model directory") from e
    if not isinstance(raw, dict):
        raise ModelDirError(f"{path} does not hold a mapping of model entries; is it a CosyVoice yaml?")
    raw.update(overrides or {})
    try:
        return {k: _resolve(v, raw, (k,)) for k, v in raw.items()}
    except ValueError as e:
        raise ModelDirError(f"{path}: {e}") from e
