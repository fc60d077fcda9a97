"""The same seeds give the same audio, bit for bit, across refactors: hashes of the engine's output on the tiny
models of every family (whole sentences, streamed, instruct, speed) and the packaged demo model.

The hashes were recorded before the package was reorganised (the family seam, packages per stage) and pin its
behaviour. Float results depend on the kernels ONNX Runtime picks for the CPU, so they are kept per machine kind
(ORT version + the CPU features that change kernels); on a kind with no record the test skips and says how to
record one (``COSYVOICE_PIN_RECORD=1 python -m pytest tests/export/test_pinned_audio.py`` on a commit whose
audio is known good). A record is never rewritten silently: a changed hash fails.

The engine runs each flow-estimator call as one (``split_rows=False``), as when the records were made:
the split form (the default since 2026-12-07) gives each CFG row its own int8 activation scale, so other bits on
every machine kind, and only this machine's kind could be recorded again then. The split form is held to the
one-call form's quality instead (``tests/export/test_streaming.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyvoice_cpu.config import EngineConfig, SynthesisConfig
from cosyvoice_cpu.engine import Engine

PINS = Path(__file__).parents[1] / "golden" / "pinned_audio.json"
TEXT = "Hello world. How are you today?"
# (case name, synthesis config, instruct)
CASES = (
    ("whole", SynthesisConfig(seed=1, flow_steps=4, min_tokens=30), None),
    (
        "stream",
        SynthesisConfig(seed=2, flow_steps=4, min_tokens=30, stream=True, first_chunk_tokens=5, chunk_tokens=10),
        None,
    ),
    ("instruct", SynthesisConfig(seed=3, flow_steps=4, min_tokens=30), "Speak slowly."),
    ("speed", SynthesisConfig(seed=4, flow_steps=4, min_tokens=30, speed=1.5), None),
)


def machine_kind() -> str:
    """ORT's version, the CPU's vendor and the features its kernels dispatch on: results are bitwise stable within
    one kind. The vendor counts: an Intel Xeon without AMX and a Zen 5 show the same features (AVX-VNNI, AVX-512
    BF16) but gave different audio (2026-12-07)."""
    import onnxruntime as ort

    from cosyvoice_cpu.hardware.cpu import read_cpuinfo

    cpu = read_cpuinfo()
    flags, vendor = (cpu.flags, cpu.vendor) if cpu is not None else (frozenset(), "")
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    return f"ort{ort.__version__}:{vendor}:" + ",".join(f for f in wanted if f in flags)


def _prompt_wav(path: Path) -> Path:
    t = np.arange(3 * 16000) / 16000
    wave = 0.3 * np.sin(2 * np.pi * 180 * t * (1 + 0.04 * np.sin(2 * np.pi * 3 * t)))
    sf.write(path, wave.astype(np.float32), 16000)
    return path


def _digest(wave: np.ndarray) -> str:
    return f"{len(wave)}:{hashlib.sha256(np.ascontiguousarray(wave, np.float32).tobytes()).hexdigest()[:20]}"


def _hashes(model_dir: Path, prompt: Path) -> dict[str, str]:
    engine = Engine.load(model_dir, EngineConfig(threads=2, split_rows=False))
    try:
        voice = engine.make_voice(prompt, "Good morning everyone.", name="pin")
        return {
            name: _digest(engine.synthesize_wav(TEXT, voice, cfg, instruct=instruct)) for name, cfg, instruct in CASES
        }
    finally:
        engine.close()


@pytest.fixture(scope="module")
def prompt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _prompt_wav(tmp_path_factory.mktemp("pin") / "prompt.wav")


@pytest.mark.parametrize("model", ["demo", "cosyvoice2", "cosyvoice", "cosyvoice3"])
def test_the_same_seeds_give_the_same_audio(model: str, prompt: Path, request: pytest.FixtureRequest) -> None:
    if model == "demo":
        import cosyvoice_cpu

        model_dir = Path(cosyvoice_cpu.__file__).parent / "demo_model"
    else:
        fixture = {
            "cosyvoice2": "tiny_export_dir",
            "cosyvoice": "tiny_v1_export_dir",
            "cosyvoice3": "tiny_v3_export_dir",
        }
        model_dir = request.getfixturevalue(fixture[model])
    got = _hashes(model_dir, prompt)
    kind = machine_kind()
    pins = json.loads(PINS.read_text()) if PINS.is_file() else {}
    recorded = pins.get(kind, {}).get(model)
    if recorded is None:
        if os.environ.get("COSYVOICE_PIN_RECORD") == "1":
            pins.setdefault(kind, {})[model] = got
            PINS.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
            return
        pytest.skip(f"no pinned audio for {model} on machine kind {kind}; record with COSYVOICE_PIN_RECORD=1")
    assert got == recorded, f"{model}: the audio changed (machine kind {kind})"
