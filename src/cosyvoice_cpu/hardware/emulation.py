"""Running this runtime under qemu's user-mode emulation of another CPU: the command lines, and an arm64 root.

``qemu-x86_64 -cpu Denverton python ...`` runs the same x86-64 Python with ``cpuid`` answering as an Atom C3000
(SSE4.2, no AVX), so NumPy and ONNX Runtime take the kernels that CPU would get. ``qemu-aarch64 -L ROOT
ROOT/usr/bin/python3.11 ...`` runs an arm64 Python (Debian's, unpacked in ROOT) on arm64 wheels.

Speed under emulation means nothing (qemu's TCG is 10-200x slower than the host), and a clean run is weak proof that
no newer instruction ran (this note said until 2026-12-07 that TCG translates AVX2 under ``-cpu Denverton``; that
day qemu 7.2.22, Debian 12, refused AVX2 and FMA under ``-cpu Denverton`` and ``-cpu IvyBridge``: SIGILL, a scratch
program). What it does prove is the dispatch: the kernels chosen from ``cpuid``/hwcaps and their numerics.

NumPy's OpenBLAS (``scipy_openblas``) did not take its kernels from the emulated ``cpuid`` on a Zen 5 host: it named
its core "Haswell" under every model, and NumPy's import (a sanity ``dot``) died of SIGILL under ``-cpu Denverton``
(2026-12-07, qemu 7.2, NumPy 2.4.5 and 2.4.6). :func:`x86_argv` sets ``OPENBLAS_CORETYPE`` to the core such a CPU
gets (:data:`X86_OPENBLAS`). The runtime makes no BLAS call; NumPy's own kernels still follow ``cpuid``.

qemu 7.2's ``qemu-aarch64`` shows the guest the host's ``/proc/cpuinfo``; ONNX Runtime's cpuinfo library reads it
at import, finds no ARM processor in an x86 file and crashes (SIGSEGV). qemu resolves the guest's paths under its
``-L`` root first, so :func:`write_arm_cpuinfo` puts an arm64 ``proc/cpuinfo`` in the root.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

logger = logging.getLogger(__name__)

# the emulated x86 CPUs the platform tests use: the guide's gateway Atom and the 2013 Xeon (no AVX2), and Haswell
# (AVX2 + FMA without VNNI: ORT's u8s8 GEMM on it sums pairs of products in int16, which saturates)
X86_MODELS = {
    "Denverton": "Atom C3000: SSE4.2, no AVX",
    "IvyBridge": "Xeon E5 v2: AVX, no AVX2/FMA",
    "Haswell-v4": "AVX2 + FMA, no AVX-512/VNNI",
}
# OpenBLAS's core for each (OPENBLAS_CORETYPE): what it detects on such a CPU (module docstring)
X86_OPENBLAS = {"Denverton": "NEHALEM", "IvyBridge": "SANDYBRIDGE", "Haswell-v4": "HASWELL"}
# arm64 cores qemu 7.2 emulates, with the /proc/cpuinfo a real one shows (part number, Features)
_ARM_BASE = "fp asimd evtstrm aes pmull sha1 sha2 crc32"
ARM_MODELS = {
    "cortex-a76": ("0xd0b", f"{_ARM_BASE} atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"),  # Pi 5, RK3588
    "cortex-a72": ("0xd08", f"{_ARM_BASE} cpuid"),  # Raspberry Pi 4: NEON without the dot product
}


# the runtime's dependencies, as wheels for the arm64 Python (pinned to the versions installed here, so that both
# sides of a comparison run the same ONNX Runtime)
ARM_WHEELS = ("numpy", "onnxruntime", "pyyaml", "soundfile", "soxr", "tokenizers")
ARM_PACKAGES = ("python3", "libstdc++6")  # Debian packages of the arm64 root, with their dependencies
ARM_PLATFORMS = ("manylinux2014_aarch64", "manylinux_2_28_aarch64")


def qemu(arch: str) -> str | None:
    """Path of ``qemu-<arch>`` (Debian's ``qemu-user``), or None when it is not installed."""
    return shutil.which(f"qemu-{arch}")


def x86_argv(cpu: str, python: str, args: list[str]) -> list[str]:
    """The command that runs ``python args...`` with ``cpuid`` answering as the x86 CPU model ``cpu`` (and OpenBLAS
    on that CPU's core, :data:`X86_OPENBLAS`; a model without one keeps OpenBLAS's own choice)."""
    binary = qemu("x86_64")
    if binary is None:
        raise FileNotFoundError("qemu-x86_64 is not installed (Debian: apt-get install qemu-user)")
    core = ["-E", f"OPENBLAS_CORETYPE={X86_OPENBLAS[cpu]}"] if cpu in X86_OPENBLAS else []
    return [binary, "-cpu", cpu, *core, python, *args]


def arm_argv(cpu: str, root: Path, args: list[str], python: str = "usr/bin/python3.11") -> list[str]:
    """The command that runs ``ROOT/python args...`` (an arm64 Python unpacked in ``root``) as the arm64 core
    ``cpu``."""
    binary = qemu("aarch64")
    if binary is None:
        raise FileNotFoundError("qemu-aarch64 is not installed (Debian: apt-get install qemu-user)")
    return [binary, "-cpu", cpu, "-L", str(root), str(root / python), *args]


def arm_cpuinfo(cpu: str, cores: int = 2) -> str:
    """A /proc/cpuinfo as the arm64 core ``cpu`` (a key of :data:`ARM_MODELS`) shows it, ``cores`` times."""
    part, features = ARM_MODELS[cpu]
    block = (
        "processor\t: {i}\nBogoMIPS\t: 50.00\nFeatures\t: {features}\nCPU implementer\t: 0x41\n"
        "CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: {part}\nCPU revision\t: 0\n\n"
    )
    return "".join(block.format(i=i, features=features, part=part) for i in range(cores))


def write_arm_cpuinfo(root: Path, cpu: str) -> Path:
    """Write ``root/proc/cpuinfo`` for ``cpu`` (see the module docstring); returns its path."""
    path = root / "proc" / "cpuinfo"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(arm_cpuinfo(cpu))
    return path


def _pinned(name: str) -> str:
    try:
        return f"{name}=={version(name)}"
    except PackageNotFoundError:
        return name


def arm_python(root: Path) -> str:
    """The arm64 Python of ``root`` relative to it, e.g. ``usr/bin/python3.11``."""
    found = sorted(p for p in (root / "usr" / "bin").glob("python3.*") if p.name[len("python3.") :].isdigit())
    if not found:
        raise FileNotFoundError(f"no usr/bin/python3.N in {root}")
    return str(found[-1].relative_to(root))


def build_arm_root(dest: Path, suite: str = "bookworm") -> tuple[Path, Path, str]:
    """An arm64 Python from Debian's packages in ``dest/root`` (mmdebstrap's extract variant: unpacked, no
    maintainer script run, so no emulation needed to build it) and the runtime's aarch64 wheels in ``dest/site``
    (``pip install --target`` for the manylinux aarch64 platforms). Returns (root, site, python relative to root).
    Needs ``mmdebstrap`` and network access to Debian's archive and PyPI."""
    root, site = dest / "root", dest / "site"
    if not (root / "usr" / "bin").is_dir():
        if shutil.which("mmdebstrap") is None:
            raise FileNotFoundError("mmdebstrap is not installed (Debian: apt-get install mmdebstrap)")
        cmd = ["mmdebstrap", "--quiet", "--variant=extract", "--architectures=arm64"]
        subprocess.run([*cmd, f"--include={','.join(ARM_PACKAGES)}", suite, str(root)], check=True)
    python = arm_python(root)
    if not (site / "onnxruntime").is_dir():
        platforms = [f"--platform={p}" for p in ARM_PLATFORMS]
        py_version = python.rsplit("python", 1)[1]
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(site), *platforms]
        pip += ["--python-version", py_version, "--implementation", "cp", "--only-binary=:all:"]
        subprocess.run([*pip, *(_pinned(n) for n in ARM_WHEELS)], check=True)
    return root, site, python
