"""The torch-free runtime on CPUs this machine is not: x86 without AVX2 (and AVX2 without VNNI) under
``qemu-x86_64 -cpu MODEL``, arm64 cores under ``qemu-aarch64`` with Debian's arm64 Python and aarch64 wheels.

Each emulated CPU runs every graph of the packaged demo model on fixed inputs (probes/graphs.py), held to
the probe's tolerances against the same graphs run natively, and speaks a short sentence with torch blocked.
Emulation proves the kernels chosen from the emulated ``cpuid``/hwcaps and their numerics, not speed, and not
that no newer instruction ran (qemu's TCG translates AVX2 under ``-cpu Denverton`` too; hardware/emulation.py).
``.ci/run`` installs Debian's ``qemu-user`` and ``mmdebstrap`` so that none of this is skipped in CI.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyvoice_cpu.cli.speech import DEMO_MODEL
from cosyvoice_cpu.hardware import emulation
from cosyvoice_cpu.probes.graphs import TOLERANCE, compare, probe_model

SRC = Path(__file__).resolve().parents[2] / "src"
DEMO_RUN = (
    "import sys; sys.modules['torch'] = None\n"
    "from cosyvoice_cpu.cli.main import main\n"
    "raise SystemExit(main(sys.argv[1:]))\n"
)
SENTENCE = ["--text", "Line three.", "--flow-steps", "2", "--threads", "1"]  # 80 tokens, 3.2 s of audio
# what NumPy must read from the emulated cpuid: proof that the child ran as that CPU, not as the host
X86_EXPECT = {"Denverton": ("SSE42", "AVX"), "IvyBridge": ("AVX", "AVX2"), "Haswell-v4": ("FMA3", "AVX512F")}
ARM_EXPECT = {"cortex-a76": ("ASIMDDP", None), "cortex-a72": ("ASIMD", "ASIMDDP")}
# the int8 kernel of MatMulNBits at accuracy level 4 (the LM, the flow encoder) exists only with AVX2 or the arm64
# dot product: without it ONNX Runtime computes in fp32, the LM's logp move by ~1e-3 and the encoder's mu by ~1e-2
# (see probes.graphs.TOLERANCE)
NO_INT8_NBITS_KERNEL = {"Denverton", "IvyBridge", "cortex-a72"}

needs_qemu_x86 = pytest.mark.skipif(
    emulation.qemu("x86_64") is None,
    reason="qemu-x86_64 is not installed (Debian: apt-get install qemu-user; .ci/run installs it)",
)
needs_arm = pytest.mark.skipif(
    emulation.qemu("aarch64") is None or shutil.which("mmdebstrap") is None,
    reason="qemu-aarch64 or mmdebstrap is not installed (Debian: apt-get install qemu-user mmdebstrap; .ci/run "
    "installs both)",
)


@pytest.fixture(scope="module")
def native_probe() -> dict[str, np.ndarray]:
    return probe_model(DEMO_MODEL, threads=1)


@pytest.fixture(scope="module")
def arm_root(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """Debian's arm64 Python and the aarch64 wheels of the installed versions (about 80 MB, ~20 s to fetch)."""
    return emulation.build_arm_root(tmp_path_factory.mktemp("arm64"))


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{argv}: exit {r.returncode}\n{r.stderr[-3000:]}"
    return r


def _check_probe(cpu: str, native: dict[str, np.ndarray], out: Path, expect: tuple[str, str | None]) -> None:
    emulated = dict(np.load(out))
    features = set(emulated["meta/cpu_features"].tolist())
    has, lacks = expect
    assert has in features and lacks not in features, f"{cpu}: the child saw {sorted(features)}"
    diffs = compare(native, emulated)
    assert diffs and all(d.ok for d in diffs), "\n".join(str(d) for d in diffs if not d.ok)
    lm = next(d for d in diffs if d.key == "lm/decode_logp")
    encoder = next(d for d in diffs if d.key == "flow_encoder/mu")  # MatMulNBits at accuracy level 4 too
    if cpu in NO_INT8_NBITS_KERNEL:  # the fp32 fallback was taken: the probe sees kernels, not the host's
        assert 1e-5 < lm.err <= TOLERANCE["lm/decode_logp"], lm
        assert 1e-5 < encoder.err <= TOLERANCE["flow_encoder/mu"], encoder
    else:  # the int8 kernel, as on the host
        assert encoder.err < 1e-5, encoder


def _check_wave(out: Path, stdout: str) -> None:
    wave, sr = sf.read(out, dtype="float32")
    tokens = int(re.search(r"(\d+) tokens,", stdout).group(1))
    assert sr == 24000 and tokens > 0 and len(wave) == tokens * sr // 25, (len(wave), tokens)
    assert np.all(np.isfinite(wave)) and 0.01 < np.abs(wave).max() <= 0.99
    assert np.sqrt(np.mean(wave**2)) > 1e-3, "silent"


@needs_qemu_x86
@pytest.mark.parametrize("cpu", list(emulation.X86_MODELS))
def test_x86_graphs_within_tolerance_and_speech(cpu: str, native_probe: dict[str, np.ndarray], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    probe = ["-m", "cosyvoice_cpu.probes.graphs", str(DEMO_MODEL), str(tmp_path / "probe.npz")]
    _run(emulation.x86_argv(cpu, sys.executable, probe), env)
    _check_probe(cpu, native_probe, tmp_path / "probe.npz", X86_EXPECT[cpu])
    if cpu in NO_INT8_NBITS_KERNEL:  # the non-AVX2 paths speak (Haswell's kernels are the host's numerics already)
        demo = ["-c", DEMO_RUN, "demo", "-o", str(tmp_path / "out.wav"), *SENTENCE]
        r = _run(emulation.x86_argv(cpu, sys.executable, demo), env)
        _check_wave(tmp_path / "out.wav", r.stdout)


@needs_arm
@pytest.mark.parametrize("cpu", list(emulation.ARM_MODELS))
def test_arm64_graphs_within_tolerance_and_speech(
    cpu: str, native_probe: dict[str, np.ndarray], arm_root: tuple[Path, Path, str], tmp_path: Path
) -> None:
    root, site, python = arm_root
    emulation.write_arm_cpuinfo(root, cpu)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": f"{site}:{SRC}"}
    probe = ["-m", "cosyvoice_cpu.probes.graphs", str(DEMO_MODEL), str(tmp_path / "probe.npz")]
    r = _run(emulation.arm_argv(cpu, root, ["-c", "import platform; print(platform.machine())"], python), env)
    assert r.stdout.strip() == "aarch64"
    _run(emulation.arm_argv(cpu, root, probe, python), env)
    _check_probe(cpu, native_probe, tmp_path / "probe.npz", ARM_EXPECT[cpu])
    if cpu == "cortex-a76":  # the Raspberry Pi 5 / RK3588 big core speaks
        demo = ["-c", DEMO_RUN, "demo", "-o", str(tmp_path / "out.wav"), *SENTENCE]
        r = _run(emulation.arm_argv(cpu, root, demo, python), env)
        _check_wave(tmp_path / "out.wav", r.stdout)
