"""The runtime wall: without torch the package and its CLI import, and torch-only commands say what to install."""

from __future__ import annotations

import json
import subprocess
import sys

BLOCK_TORCH = "import sys; sys.modules['torch'] = None\n"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + code], capture_output=True, text=True, timeout=120)


def test_package_and_cli_import_without_torch() -> None:
    r = _run(
        "import cosyvoice_cpu, cosyvoice_cpu.cli.main, cosyvoice_cpu.errors, cosyvoice_cpu.reference.yamlconf\n"
        "assert 'torch' not in {m for m in sys.modules if sys.modules[m] is not None}\n"
    )
    assert r.returncode == 0, r.stderr


def test_torch_commands_explain_the_missing_extra(tmp_path) -> None:
    r = _run(
        f"from cosyvoice_cpu.cli.main import main; raise SystemExit(main(['fixture', '--out', r'{tmp_path / 'x'}']))"
    )
    assert r.returncode == 2, r.stderr
    assert "[export] extra" in r.stderr and "Traceback" not in r.stderr


RUNTIME_CHAIN = """
import pkgutil, importlib, json
sys.modules["onnx"] = None
import numpy as np
import cosyvoice_cpu
runtime = [m.name for m in pkgutil.walk_packages(cosyvoice_cpu.__path__, "cosyvoice_cpu.")
           if not m.name.startswith(("cosyvoice_cpu.reference", "cosyvoice_cpu.export", "cosyvoice_cpu.fixtures",
                                      "cosyvoice_cpu.workshop"))
           and not m.name.endswith(".__main__")]
for name in runtime:
    importlib.import_module(name)
from cosyvoice_cpu.flow.cosyvoice2 import CosyVoice2Flow
from cosyvoice_cpu.lm.session import LMSession
from cosyvoice_cpu.manifest import Manifest
from cosyvoice_cpu.vocoder.hift import Vocoder
d = sys.argv[1]
m = Manifest.load(d, check_hashes=True)
lm = LMSession.from_dir(d, m.graphs["lm"].attrs)
cache = lm.new_cache(1)
logp = lm.prefill(cache, 0, np.concatenate([lm.special("sos")[None], lm.embed_text([5, 6, 7]),
                                            lm.special("task_id")[None]]))
tokens = []
for _ in range(12):
    tokens.append(int(np.argmax(logp[: m.lm["speech_token_size"]])))
    logp = lm.decode(cache, [0], [tokens[-1]])[0]
flow = CosyVoice2Flow.from_dir(d, m.flow)
rng = np.random.default_rng(0)
mel = flow.inference(tokens, [], np.zeros((0, 80), np.float32), rng.standard_normal(192).astype(np.float32))
voc = Vocoder.from_dir(d, m.graphs["hift_decode"].attrs)
wave, _ = voc(mel, rng=rng)
from cosyvoice_cpu.probes.calibrate import calibrate
calibrate(1, budget_s=0.005, scale=0.02)  # doctor --speed and bench's machine facts
print(json.dumps({"modules": sorted(runtime), "samples": int(wave.shape[-1]),
                  "finite": bool(np.isfinite(wave).all())}))
"""


def test_runtime_runs_an_exported_model_without_torch_or_onnx(tiny_export_dir) -> None:
    """Every runtime module imports, and text ids -> speech tokens -> mel -> wave runs, with torch blocked."""
    r = subprocess.run([sys.executable, "-c", BLOCK_TORCH + RUNTIME_CHAIN, str(tiny_export_dir)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["samples"], out["finite"]) == (11520, True)  # 12 tokens x 2 frames x 480 samples
    stages = {"cosyvoice_cpu.lm.session", "cosyvoice_cpu.flow.cosyvoice2", "cosyvoice_cpu.vocoder.hift",
              "cosyvoice_cpu.manifest", "cosyvoice_cpu.backends.onnxruntime", "cosyvoice_cpu.cli.main"}  # fmt: skip
    assert stages <= set(out["modules"])


V1_ENGINE = """
import json
sys.modules["onnx"] = None
import numpy as np
from cosyvoice_cpu import Engine, SynthesisConfig
engine = Engine.load(sys.argv[1])
voice = engine.builtin_voices()["中文女"]
config = SynthesisConfig(seed=1, min_tokens=100, max_tokens=100)
whole = engine.synthesize_wav("你好。<|en|>Hello.", voice, config)
streamed = engine.synthesize_wav("你好。<|en|>Hello.", voice, SynthesisConfig(seed=1, min_tokens=100, max_tokens=100,
                                                                          stream=True))
print(json.dumps({"whole": len(whole), "streamed": len(streamed), "finite": bool(np.isfinite(streamed).all()),
                  "torch": "torch" in {m for m in sys.modules if sys.modules[m] is not None}}))
"""


def test_cosyvoice_300m_engine_runs_without_torch_or_onnx(tiny_v1_export_dir) -> None:
    """A CosyVoice-300M directory (text-encoder graph, v1 flow, built-in speaker), whole and streamed, torch blocked."""
    r = subprocess.run([sys.executable, "-c", BLOCK_TORCH + V1_ENGINE, str(tiny_v1_export_dir)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # one segment (short sentences are merged) x 100 tokens at 50 Hz -> int(100 / 50 * 22050 / 256) = 172 frames
    assert out["whole"] == 172 * 256 and out["finite"] and not out["torch"]
    assert abs(out["streamed"] - out["whole"]) <= 4 * 256


V3_ENGINE = """
import io, json
sys.modules["onnx"] = None
import numpy as np, soundfile as sf
from cosyvoice_cpu import Engine, SynthesisConfig
engine = Engine.load(sys.argv[1])
buf = io.BytesIO()
sf.write(buf, (0.3 * np.sin(2 * np.pi * 190 * np.arange(48000) / 16000)).astype(np.float32), 16000, format="WAV")
voice = engine.make_voice(buf.getvalue(), "今天天气很好。", "p")
waves = [engine.synthesize_wav("Hello there.", voice, SynthesisConfig(seed=1, min_tokens=60, max_tokens=60,
                                                                     stream=s)) for s in (False, True)]
print(json.dumps({"lengths": [len(w) for w in waves], "finite": bool(all(np.isfinite(w).all() for w in waves)),
                  "torch": "torch" in {m for m in sys.modules if sys.modules[m] is not None}}))
"""


def test_cosyvoice3_engine_runs_without_torch_or_onnx(tiny_v3_export_dir) -> None:
    """A Fun-CosyVoice3 directory (DiT flow and its stream graph, causal HiFT), a voice made, whole and streamed."""
    r = subprocess.run([sys.executable, "-c", BLOCK_TORCH + V3_ENGINE, str(tiny_v3_export_dir)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    whole, streamed = out["lengths"]
    assert whole == streamed and 0 < whole <= 60 * 2 * 480 and out["finite"] and not out["torch"]
