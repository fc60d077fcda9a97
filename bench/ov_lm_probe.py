"""The LM on OpenVINO's own LLM form (stateful model, KV cache as model state, NNCF int8/int4 weights) against the
ONNX Runtime graphs: decode speed at 1 and 4 rows, and greedy-token agreement on random-weight prompts.

    python bench/ov_lm_probe.py prepare --fixture FULL_FIXTURE --work WORK
    python bench/ov_lm_probe.py speed --work WORK [--forms ort-int8w,ov-int8,...] [--rows 1,4] [--steps 64]
    python bench/ov_lm_probe.py agree --work WORK [--prompts 3] [--steps 100]
    python bench/ov_lm_probe.py profile --work WORK --forms ov-int8 [--steps 30]

``prepare`` reads the reference LM of a CosyVoice2 or Fun-CosyVoice3 fixture directory (``cosyvoice-cpu fixture
--size full``) and writes into WORK: ``fp32/`` (the family's LM graph, its ``export_lm``), ``int8w/`` and ``int4/``
(the ``export --quant`` recipes: ``MatMulNBits`` 8 or 4 bits, block 32, ``accuracy_level`` 4), and
``ov/lm_int8.ov.xml`` / ``ov/lm_int4.ov.xml`` (:mod:`cosyvoice_cpu.export.lm.openvino_stateful`), all from the same
weights. Takes minutes.

Forms ``rt-ov-int8`` / ``rt-ov-int4`` run the same OpenVINO models through the runtime's ``LMSession`` (what an
engine with the LM planned on OpenVINO runs).

``speed``: each form prefills a 166-position random prompt (the bench's prompt length) on every row, then decodes
``--steps`` greedy steps; with several forms they are alternated step by step in one process (the load hits all of
them alike), then each form runs alone (``--alone``, the default: alternating 0.3-0.4 GB graphs evicts each
other's weights from the L3). Prints the median and lower-quartile ms per step, tokens/s (rows / median step),
``speedup_vs_first`` (the first form's median step over this form's, in the same run) and the prompt's prefill
time (every row's; the first call of a fresh compile for OpenVINO, so it includes its first-shape setup).

``agree``: 1 row, ``--prompts`` random prompts. Each form decodes greedily on its own (free run: steps equal to
``ort-int8w``'s, first divergence), and is fed the fp32 graph's greedy tokens (teacher-forced: argmax agreement with
fp32 and with ``ort-int8w``, mean KL to fp32). Random weights make the distributions flat, so argmax flips more
easily than on a trained checkpoint.

``profile``: OpenVINO's per-node counters over ``--steps`` decode steps of each OpenVINO form: the step's median and
the six node types / kernels that took longest (ms per step, summed over nodes; the sum can exceed the step).

Forms: ``ort-fp32``, ``ort-int8w``, ``ort-int4`` (the runtime's ``LMSession``, 2 threads); ``ov-int8``, ``ov-int4``
(OpenVINO at its default inference precision: bf16 where the CPU has it) and ``ov-int8-f32``, ``ov-int4-f32``
(``INFERENCE_PRECISION_HINT`` and ``KV_CACHE_PRECISION`` f32; the defaults on a CPU with AVX-512 BF16 are
bf16 and u8). ``--ov-config KEY=VALUE,...`` adds OpenVINO compile properties. ``+dqN`` after an OpenVINO form's
name sets its ``DYNAMIC_QUANTIZATION_GROUP_SIZE`` to N (``ov-int4-f32+dq128``): the activations of its compressed
products quantized to int8 in groups of N, taken only where the products' input is f32 (OpenVINO's default is 32;
0 turns it off), so several group sizes can be alternated in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

PROMPT = 166
TABLES = ("lm_text_embedding.npy", "lm_speech_embedding.npy", "lm_special_embedding.npy")
ORT_FORMS = {"ort-fp32": "fp32", "ort-int8w": "int8w", "ort-int4": "int4"}
RT_FORMS = {"rt-ov-int8": "int8", "rt-ov-int4": "int4"}
OV_FORMS = {
    "ov-int8": "int8",
    "ov-int4": "int4",
    "ov-int8-f32": "int8",
    "ov-int4-f32": "int4",
}


def prepare(fixture: Path, work: Path) -> None:
    from cosyvoice_cpu.export.lm.openvino_stateful import export_stateful_lm
    from cosyvoice_cpu.export.quantize import quantize_nbits
    from cosyvoice_cpu.lm_files import MIN_ROWS_KEY
    from cosyvoice_cpu.workshop.parts import detect_family, export_family, load_reference

    family = export_family(detect_family(fixture))
    if not family.stateful_lm:  # CosyVoice-300M's LM is another network, with no OpenVINO LLM form
        raise SystemExit(f"{fixture} is a {family.facts.name} fixture; the probe takes CosyVoice2 or Fun-CosyVoice3")
    source = work / "fixture.txt"  # every form in WORK comes from one fixture's weights
    if source.exists() and source.read_text() != str(fixture.resolve()):
        raise SystemExit(f"{work} holds the forms of {source.read_text()}; give another --work")
    lm = load_reference(fixture, stages=("lm",)).lm.eval()
    work.mkdir(parents=True, exist_ok=True)
    source.write_text(str(fixture.resolve()))
    t0 = time.perf_counter()
    if not (work / "attrs.json").exists():
        # the family's LM graph module writes the graph, its tables and its attrs
        graphs = next(p for p in family.plans if p.ref == "lm").graphs()
        (lm_artifact,) = graphs.export_lm(lm, work / "fp32", max_len=2048)
        (work / "attrs.json").write_text(json.dumps(lm_artifact.attrs))  # written last: the fp32 form is whole
        print(f"fp32 graph {time.perf_counter() - t0:.0f} s", flush=True)
    for name, bits in (("int8w", 8), ("int4", 4)):
        if not (work / name / "lm.onnx").exists():
            (work / name).mkdir(exist_ok=True)
            meta = {MIN_ROWS_KEY: "2"} if bits == 4 else None
            quantize_nbits(work / "fp32" / "lm.onnx", work / name / "lm.onnx", bits, 32, 4, metadata=meta)
            for table in TABLES:
                (work / name / table).unlink(missing_ok=True)
                (work / name / table).symlink_to(work / "fp32" / table)
            print(f"{name} graph done at {time.perf_counter() - t0:.0f} s", flush=True)
    for weights in ("int8", "int4"):
        if not (work / "ov" / f"lm_{weights}.ov.xml").exists():
            t1 = time.perf_counter()
            export_stateful_lm(lm, work / "ov", weights=weights, file=f"lm_{weights}.ov.xml")
            print(f"OpenVINO stateful {weights}: {time.perf_counter() - t1:.0f} s", flush=True)


class Prompts:
    """Random CosyVoice2 / Fun-CosyVoice3 prompts [sos, text, task_id, speech] from the exported embedding tables."""

    def __init__(self, work: Path, attrs: dict) -> None:
        from cosyvoice_cpu.lm.kv_spec import LMSpec
        from cosyvoice_cpu.lm.row_table import open_table

        self.attrs = attrs
        self.rows = LMSpec.from_attrs(attrs).speech_rows  # ids that can be fed back (v3's head is wider)
        self.text = open_table(work / "fp32" / TABLES[0])
        self.speech = open_table(work / "fp32" / TABLES[1])
        self.special = np.load(work / "fp32" / TABLES[2])

    def make(self, seed: int, length: int = PROMPT) -> np.ndarray:
        rng = np.random.default_rng(seed)
        n_text = length // 4
        text = np.sort(rng.integers(0, self.attrs["text_vocab"], n_text))  # sorted: pread in order
        speech = rng.integers(0, self.attrs["speech_token_size"], length - 2 - n_text)
        rows = [self.special[:1], self.text[text], self.special[1:2], self.speech[np.sort(speech)]]
        return np.concatenate([np.asarray(r, np.float32) for r in rows])

    def pick(self, logp: np.ndarray) -> list[int]:
        """Each row's greedy token among the ids that can be fed back."""
        return logp[:, : self.rows].argmax(-1).tolist()

    def embed(self, tokens: list[int]) -> np.ndarray:
        order = np.argsort(tokens)
        out = np.empty((len(tokens), self.speech.shape[1]), np.float32)
        out[order] = self.speech[np.asarray(tokens)[order]]
        return out


def ort_form(work: Path, name: str, attrs: dict, threads: int):
    """A form run through the runtime's ``LMSession``: the ONNX graphs (``ort-*``) or, on OpenVINO, the stateful
    graphs (``rt-ov-*``: the runtime's :mod:`cosyvoice_cpu.lm.state_graph`, with its masks and row bookkeeping)."""
    from cosyvoice_cpu.backends.base import SessionConfig
    from cosyvoice_cpu.export.lm.agreement import SessionForm
    from cosyvoice_cpu.lm.session import LMSession

    if name in RT_FORMS:
        tables = dict(zip(("text", "speech", "special"), [work / "fp32" / t for t in TABLES]))
        graph = work / "ov" / f"lm_{RT_FORMS[name]}.ov.xml"
        return SessionForm(LMSession(graph, tables, attrs, SessionConfig(threads=threads, backend="openvino")))
    return SessionForm(LMSession.from_dir(work / ORT_FORMS[name], attrs, threads=threads))


def is_ov_form(name: str) -> bool:
    """An OpenVINO form's name, with or without a ``+dqN`` suffix."""
    return name.partition("+dq")[0] in OV_FORMS


def ov_form(work: Path, name: str, threads: int, extra: dict, embed):
    """The package's :class:`OvStatefulForm` with its compile time and precision properties (``compile_s``,
    ``props``)."""
    from cosyvoice_cpu.export.lm.agreement import OvStatefulForm

    name, plus, dq = name.partition("+dq")
    if plus and not dq.isdigit():
        raise SystemExit(f"{name}+dq{dq}: the group size after +dq must be a number (0 turns the path off)")
    config = dict(extra)
    if dq:
        config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = dq
    if name.endswith("-f32"):
        config.update(INFERENCE_PRECISION_HINT="f32", KV_CACHE_PRECISION="f32")
    t0 = time.perf_counter()
    form = OvStatefulForm(work / "ov" / f"lm_{OV_FORMS[name]}.ov.xml", embed, threads, config)
    form.compile_s = time.perf_counter() - t0
    form.props = {
        k: str(form.compiled.get_property(k))
        for k in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE")
    }
    return form


def open_forms(args: argparse.Namespace, names: list[str], prompts: Prompts) -> dict:
    attrs = json.loads((args.work / "attrs.json").read_text())
    extra = dict(kv.split("=", 1) for kv in args.ov_config.split(",") if kv)
    forms = {}
    for name in names:
        if name in ORT_FORMS or name in RT_FORMS:
            forms[name] = ort_form(args.work, name, attrs, args.threads)
        elif is_ov_form(name):
            forms[name] = ov_form(args.work, name, args.threads, extra, prompts.embed)
            print(f"{name}: compiled in {forms[name].compile_s:.1f} s, {forms[name].props}", flush=True)
        else:
            known = ", ".join([*ORT_FORMS, *RT_FORMS, *OV_FORMS])
            raise SystemExit(f"unknown form {name}; choose from {known} (OpenVINO forms also as FORM+dqN)")
    return forms


def speed(args: argparse.Namespace, names: list[str], prompts: Prompts, label: str) -> list[dict]:
    forms = open_forms(args, names, prompts)
    rows = []
    for b in [int(r) for r in args.rows.split(",")]:
        ps = [prompts.make(100 + i) for i in range(b)]
        toks, prefill = {}, {}
        for n, f in forms.items():
            t0 = time.perf_counter()
            toks[n] = prompts.pick(f.start(ps))
            prefill[n] = time.perf_counter() - t0
        times: dict[str, list[float]] = {n: [] for n in forms}
        for _ in range(args.steps):
            for n, f in forms.items():
                t0 = time.perf_counter()
                logp = f.step(toks[n])
                times[n].append(time.perf_counter() - t0)
                toks[n] = prompts.pick(logp)
        base = statistics.median(times[names[0]][3:])
        for n in forms:
            ms = statistics.median(times[n][3:]) * 1e3
            p25 = float(np.percentile(times[n][3:], 25)) * 1e3
            row = {"run": label, "form": n, "rows": b, "ms_per_step": round(ms, 2), "p25_ms": round(p25, 2)}
            row.update(tokens_s=round(b * 1e3 / ms, 1), speedup_vs_first=round(base * 1e3 / ms, 2))
            row["prefill_s"] = round(prefill[n], 3)  # all rows (ORT: one at a time; OpenVINO: one batch), cold
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def agree(args: argparse.Namespace, names: list[str], prompts: Prompts) -> None:
    from cosyvoice_cpu.export.lm.agreement import forced as forced_logp
    from cosyvoice_cpu.export.lm.agreement import greedy
    from cosyvoice_cpu.export.lm.common import kl_rows

    names = ["ort-fp32", "ort-int8w", *[n for n in names if n not in ("ort-fp32", "ort-int8w")]]
    forms = open_forms(args, names, prompts)
    stats: dict[str, dict[str, list]] = {
        n: {"free": [], "diverge": [], "tf_fp32": [], "tf_int8w": [], "kl": []} for n in forms
    }
    for seed in range(args.prompts):
        p = [prompts.make(seed)]
        free: dict[str, list[int]] = {}
        for n, f in forms.items():  # free run
            free[n] = greedy(f, p[0], args.steps, prompts.rows)
        # teacher-forced on fp32's greedy tokens
        forced = {n: forced_logp(f, p[0], free["ort-fp32"]) for n, f in forms.items()}
        for n in forms:
            same = np.array(free[n]) == np.array(free["ort-int8w"])
            s = stats[n]
            s["free"].append(float(same.mean()))
            s["diverge"].append(int(np.argmin(same)) if not same.all() else len(same))
            s["tf_fp32"].append(float(np.mean(forced[n].argmax(-1) == forced["ort-fp32"].argmax(-1))))
            s["tf_int8w"].append(float(np.mean(forced[n].argmax(-1) == forced["ort-int8w"].argmax(-1))))
            s["kl"].append(float(np.mean(kl_rows(forced["ort-fp32"], forced[n]))))
    for n, s in stats.items():
        row = {
            "form": n,
            "prompts": args.prompts,
            "steps": args.steps,
            "free_run_equal_to_ort_int8w": round(float(np.mean(s["free"])), 3),
            "first_divergence": s["diverge"],
            "teacher_forced_agree_fp32": round(float(np.mean(s["tf_fp32"])), 3),
            "teacher_forced_agree_ort_int8w": round(float(np.mean(s["tf_int8w"])), 3),
            "mean_kl_to_fp32": float(np.mean(s["kl"])),
        }
        print(json.dumps(row), flush=True)


def profile(args: argparse.Namespace, names: list[str], prompts: Prompts) -> None:
    """OpenVINO's per-node counters (``PERF_COUNT``) over decode steps, summed per node type and kernel."""
    from collections import Counter

    args.ov_config = ",".join([args.ov_config, "PERF_COUNT=YES"]).strip(",")
    for name, form in open_forms(args, names, prompts).items():
        for b in [int(r) for r in args.rows.split(",")]:
            toks = prompts.pick(form.start([prompts.make(100 + i) for i in range(b)]))
            spent: Counter = Counter()
            steps = []
            for k in range(args.steps):
                t0 = time.perf_counter()
                toks = prompts.pick(form.step(toks))
                steps.append(time.perf_counter() - t0)
                if k >= 3:
                    for node in form.request.profiling_info:
                        spent[(node.node_type, node.exec_type)] += node.real_time.total_seconds()
            n = args.steps - 3
            top = {f"{t} {e}": round(v / n * 1e3, 2) for (t, e), v in spent.most_common(6)}
            step_ms = round(statistics.median(steps[3:]) * 1e3, 2)
            print(json.dumps({"form": name, "rows": b, "step_ms": step_ms, "node_ms": top}), flush=True)


def machine() -> str:
    flags = set()
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
    load = os.getloadavg()[0]
    return f"{model}; {os.cpu_count()} CPUs; flags {' '.join(f for f in wanted if f in flags)}; load {load:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("prepare", "speed", "agree", "profile", "one"))
    ap.add_argument("--fixture", type=Path)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--forms", default="ort-int8w,ort-int4,ov-int8,ov-int4")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ov-config", default="", help="extra OpenVINO compile properties, KEY=VALUE,...")
    ap.add_argument("--no-alone", dest="alone", action="store_false", help="skip the one-form-per-process runs")
    args = ap.parse_args()
    if args.what == "prepare":
        if args.fixture is None:
            raise SystemExit("prepare needs --fixture (a full-size fixture directory)")
        return prepare(args.fixture, args.work)
    names = [n for n in args.forms.split(",") if n]
    print(machine(), flush=True)
    attrs = json.loads((args.work / "attrs.json").read_text())
    prompts = Prompts(args.work, attrs)
    if args.what == "agree":
        return agree(args, names, prompts)
    if args.what == "profile":
        return profile(args, [n for n in names if is_ov_form(n)], prompts)
    if args.what == "one":  # one form in this process (called by speed --alone)
        speed(args, names, prompts, "alone")
        return
    speed(args, names, prompts, "alternated")
    if args.alone and len(names) > 1:
        for n in names:  # each form in a process of its own
            cmd = [
                os.sys.executable,
                __file__,
                "one",
                "--work",
                str(args.work),
                "--forms",
                n,
                "--rows",
                args.rows,
                "--steps",
                str(args.steps),
                "--threads",
                str(args.threads),
                "--ov-config",
                args.ov_config,
            ]
            subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
