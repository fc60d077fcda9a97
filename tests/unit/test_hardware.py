"""Hardware detection from a fake /proc and /sys: CPU features, cores, cgroup quota and memory, the thread plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from cosyvoice_cpu.cli.main import main
from cosyvoice_cpu.config import EngineConfig
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.hardware import cpu as cpu_module
from cosyvoice_cpu.hardware.cpu import (
    SKIP_CHECK_ENV,
    Hardware,
    UnsupportedCpuError,
    detect,
    read_cpuinfo,
)
from cosyvoice_cpu.hardware.features import floor_problem, kernel_level, speed_expectation
from cosyvoice_cpu.hardware.malloc import (
    arena_env,
    fix_mmap_threshold,
    limit_arenas,
    malloc_free_bytes,
    malloc_heaps,
)
from cosyvoice_cpu.probes.calibrate import probe_kernels


def _cpuinfo(flags: str, sockets: int = 1, cores: int = 2, threads: int = 2, model: str = "Test CPU",
             vendor: str = "GenuineIntel") -> str:  # fmt: skip
    blocks, n = [], 0
    for s in range(sockets):
        for c in range(cores):
            for _ in range(threads):
                blocks.append(f"processor\t: {n}\nvendor_id\t: {vendor}\nmodel name\t: {model}\nphysical id\t: {s}\n"
                              f"core id\t\t: {c}\nflags\t\t: {flags}\n")  # fmt: skip
                n += 1
    return "\n".join(blocks) + "\n"


def _root(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


MEMINFO = "MemTotal:       16384000 kB\nMemFree:         1000 kB\nMemAvailable:    8192000 kB\n"


def test_features_cores_quota_and_memory_of_a_container(tmp_path: Path) -> None:
    root = _root(tmp_path, {
        "proc/cpuinfo": _cpuinfo("fpu sse2 avx avx2 fma avx512f avx512_vnni", sockets=2, cores=4, threads=2),
        "proc/meminfo": MEMINFO,
        "sys/fs/cgroup/cpu.max": "300000 100000\n",
        "sys/fs/cgroup/memory.max": str(4 << 30) + "\n",
    })  # fmt: skip
    hw = detect(root)
    assert (hw.cpu.logical, hw.cpu.physical, hw.cpu.isa) == (16, 8, "avx512-vnni")
    assert hw.quota == 3.0 and hw.usable_cores == 3 and hw.threads() == 3 and hw.threads(leave_for_os=1) == 2
    assert hw.mem_total == 16384000 * 1024 and hw.mem_limit == 4 << 30 and hw.memory_for_us == 4 << 30
    assert any("quota is 3 CPUs" in n for n in hw.notes) and any("memory limit is 4.0 GiB" in n for n in hw.notes)
    hw.check_cpu()  # AVX2 present: fine
    assert not any("VNNI" in n for n in hw.notes)


def test_the_vendor_is_read_and_kept_through_cpuids_features(tmp_path: Path) -> None:
    """``CpuInfo.vendor`` (OpenVINO's compute precision goes by it: ``backends.openvino_precision``), also after
    ``detect`` replaces the flags with cpuid's."""
    root = _root(tmp_path, {"proc/cpuinfo": _cpuinfo("sse2 avx2 fma avx512f avx512_bf16", vendor="AuthenticAMD"),
                            "proc/meminfo": MEMINFO})  # fmt: skip
    merged = detect(root, cpuid={"AVX2": True, "AVX512F": False}).cpu  # cpuid drops AVX-512
    assert (read_cpuinfo(root).vendor, merged.vendor, merged.flags != read_cpuinfo(root).flags) == (
        "AuthenticAMD", "AuthenticAMD", True)  # fmt: skip


def test_a_cpu_without_vnni_is_pointed_to_int4(tmp_path: Path) -> None:
    hw = detect(_root(tmp_path, {"proc/cpuinfo": _cpuinfo("fpu sse2 avx avx2 fma"), "proc/meminfo": MEMINFO}))
    assert hw.cpu.isa == "avx2" and any("no VNNI" in n and "--quant int4" in n for n in hw.notes)


def test_hyperthreads_count_as_half_a_core_and_v1_cgroups_are_read(tmp_path: Path) -> None:
    root = _root(tmp_path, {
        "proc/cpuinfo": _cpuinfo("sse2 avx2 fma", cores=4, threads=2),
        "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
        "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1 "unlimited"
    })  # fmt: skip
    hw = detect(root)
    assert (hw.cpu.logical, hw.cpu.physical, hw.cpu.isa) == (8, 4, "avx2")
    assert hw.quota is None and hw.mem_limit is None and hw.usable_cores == 4
    # cpuinfo numbers processors core by core here (0,1 = core 0; 2,3 = core 1; ...)
    hw.affinity, hw.affinity_set = 4, frozenset({0, 1, 2, 3})  # two cores with both hyper-threads
    assert hw.usable_cores == 2
    hw.affinity_set = frozenset({0, 2, 4, 6})  # one thread of each of four cores (a typical --cpuset-cpus)
    assert hw.usable_cores == 4


# NumPy's __cpu_features__ as qemu-x86_64 -cpu IvyBridge / -cpu Denverton would make it read cpuid
_X86_KEYS = ("SSE", "SSE2", "SSE3", "SSSE3", "SSE41", "SSE42", "POPCNT", "AVX", "F16C", "FMA3", "AVX2", "AVX512F",
             "AVX512VNNI", "AVX512BF16", "ASIMD", "ASIMDDP")  # fmt: skip
IVY_BRIDGE = {k: k in {"SSE", "SSE2", "SSE3", "SSSE3", "SSE41", "SSE42", "POPCNT", "AVX", "F16C"} for k in _X86_KEYS}
DENVERTON = {k: k in {"SSE", "SSE2", "SSE3", "SSSE3", "SSE41", "SSE42", "POPCNT"} for k in _X86_KEYS}
HOST_FLAGS = "fpu sse sse2 pni ssse3 sse4_1 sse4_2 popcnt avx f16c fma avx2 avx512f avx512_vnni avx_vnni amx_int8 lm"


@pytest.mark.parametrize(("name", "flags", "cpuid", "level", "isa"), [
    ("Xeon E5-2680 v2", "fpu sse sse2 pni ssse3 sse4_1 sse4_2 popcnt avx f16c", None, "AVX (no AVX2/FMA)", "avx"),
    ("Atom C3758", "fpu sse sse2 pni ssse3 sse4_1 sse4_2 popcnt", None, "SSE4.1", "sse4"),
    ("qemu IvyBridge", HOST_FLAGS, IVY_BRIDGE, "AVX (no AVX2/FMA)", "avx"),
    ("qemu Denverton", HOST_FLAGS, DENVERTON, "SSE4.1", "sse4"),
])  # fmt: skip
def test_x86_without_avx2_runs_and_is_told_its_kernels(
    tmp_path: Path, name: str, flags: str, cpuid: dict[str, bool] | None, level: str, isa: str
) -> None:
    """No refusal on an AVX-only Ivy Bridge-EP Xeon or an SSE4.2 Atom (issue 40): they run ORT's AVX/SSE kernels.
    Under qemu's user mode cpuinfo is the host's (AVX-512, AMX): cpuid (NumPy's view) decides, and the host's
    AVX-VNNI and AMX, which NumPy does not report, do not leak in."""
    root = _root(tmp_path, {"proc/cpuinfo": _cpuinfo(flags, model=name)})
    hw = detect(root, cpuid=cpuid) if cpuid else detect(root)
    hw.check_cpu()  # the old code raised UnsupportedCpuError here
    assert (hw.cpu.arch, hw.cpu.isa, kernel_level(hw.cpu.arch, hw.cpu.flags)) == ("x86_64", isa, level)
    assert not ({"avx2", "avx_vnni", "amx_int8", "avx512f"} & hw.cpu.flags) and "sse4_2" in hw.cpu.flags
    assert hw.features_from == ("/proc/cpuinfo" if cpuid is None else "cpuid (NumPy)")
    assert ("lm" in hw.cpu.flags) == ("lm" in flags) and not hw.cpu.vnni  # non-vector flags pass through
    said = speed_expectation(hw.cpu.arch, hw.cpu.flags)
    assert ("AVX kernels without FMA" if "avx" in hw.cpu.flags else "SSE kernels") in said and "not measured" in said


def test_cpuid_keeps_what_numpy_does_not_report_only_on_its_base(tmp_path: Path) -> None:
    host = dict(IVY_BRIDGE, AVX2=True, FMA3=True, AVX512F=True, AVX512VNNI=True)
    hw = detect(_root(tmp_path, {"proc/cpuinfo": _cpuinfo(HOST_FLAGS)}), cpuid=host)
    assert {"avx_vnni", "amx_int8", "avx512_vnni"} <= hw.cpu.flags and hw.cpu.isa == "avx512-vnni"
    assert kernel_level("x86_64", hw.cpu.flags) == "AMX (with AVX-512 VNNI)"


RK3588_FEATURES = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop "
                   "asimddp")  # fmt: skip


def _arm_root(tmp_path: Path, features: str, capacities: list[int], key: str = "cpu_capacity") -> Path:
    files = {"proc/cpuinfo": "".join(f"processor\t: {n}\nBogoMIPS\t: 48.00\nFeatures\t: {features}\n"
                                     f"CPU part\t: 0xd0{5 if c < 1000 else 'b'}\n\n"
                                     for n, c in enumerate(capacities))}  # fmt: skip
    for n, c in enumerate(capacities):
        files[f"sys/devices/system/cpu/cpu{n}/{key}"] = f"{c}\n"
    return _root(tmp_path, files)


def test_arm64_features_line_gives_the_neon_kernel_level(tmp_path: Path) -> None:
    hw = detect(_arm_root(tmp_path, RK3588_FEATURES, [1024] * 4))
    hw.check_cpu()
    assert (hw.cpu.arch, hw.cpu.isa, hw.cpu.logical) == ("aarch64", "neon-dot", 4)
    assert kernel_level("aarch64", hw.cpu.flags) == "NEON + dot product (asimddp)"
    assert "dot-product instructions" in speed_expectation("aarch64", hw.cpu.flags)
    # Graviton 3 / Neoverse V1 class: i8mm and bf16 (NumPy does not report them: kept as ASIMD is confirmed)
    cpuid = {"ASIMD": True, "ASIMDDP": True, "ASIMDHP": True, "SVE": True, "AVX2": False, "SSE2": False}
    hw = detect(_arm_root(tmp_path / "v1", RK3588_FEATURES + " sve i8mm bf16", [1024] * 4), cpuid=cpuid)
    assert hw.cpu.isa == "neon-i8mm" and kernel_level("aarch64", hw.cpu.flags) == (
        "NEON + dot product (asimddp) + i8mm + bf16"
    )
    pi3 = detect(_arm_root(tmp_path / "a53", "fp asimd evtstrm crc32 cpuid", [1024] * 4)).cpu
    assert pi3.isa == "neon" and "no dot-product instructions" in speed_expectation("aarch64", pi3.flags)


def test_big_little_threads_on_the_big_cores_only(tmp_path: Path) -> None:
    """RK3588: cpu0-3 Cortex-A55 (capacity 414), cpu4-7 Cortex-A76 (1024): 4 threads, not 8 (or 7)."""
    hw = detect(_arm_root(tmp_path, RK3588_FEATURES, [414] * 4 + [1024] * 4))
    assert hw.threads() == 4 and hw.threads(leave_for_os=1) == 3
    assert hw.usable_cores == 8 and hw.big_cpus == frozenset({4, 5, 6, 7})
    assert "the big cores only, CPUs 4-7 of 0-7 (sysfs relative speeds 1024, 414)" in hw.thread_plan()
    hw.quota = 2.0  # the cgroup quota still caps
    assert hw.threads() == 2
    # no cpu_capacity: the maximum clocks (kHz); a server's few faster-boosting cores are no big.LITTLE
    hybrid = detect(
        _arm_root(tmp_path / "f", RK3588_FEATURES, [1800000] * 2 + [2400000] * 2, "cpufreq/cpuinfo_max_freq")
    )
    assert hybrid.threads() == 2 and hybrid.big_cpus == frozenset({2, 3})
    turbo = detect(
        _arm_root(tmp_path / "t", RK3588_FEATURES, [4600000] * 6 + [4800000] * 2, "cpufreq/cpuinfo_max_freq")
    )
    assert turbo.big_cpus == frozenset() and turbo.threads() == 8 and "usable physical cores" in turbo.thread_plan()


def test_doctor_shows_arm64_kernels_and_the_big_little_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys) -> None:  # fmt: skip
    hw = detect(_arm_root(tmp_path, RK3588_FEATURES, [414] * 4 + [1024] * 4))
    monkeypatch.setattr(cpu_module, "detect", lambda: hw)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "(aarch64): NEON yes, dot product (asimddp) yes, i8mm no, bf16 no" in out
    assert "kernels      NEON + dot product (asimddp) (features from /proc/cpuinfo): onnxruntime runs its NEON" in out
    assert "threads      4 intra-op by default: the big cores only, CPUs 4-7" in out


NUMPY_REFUSAL = "NumPy was built with baseline optimizations: (X86_V2) but your machine doesn't support: (X86_V2)."


def test_only_a_cpu_below_a_wheels_floor_is_refused(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The floor left is NumPy's baseline (its own RuntimeError at import), explained with what to do."""
    monkeypatch.setattr(cpu_module, "numpy_cpu_features", lambda: (None, NUMPY_REFUSAL))
    hw = detect()
    assert hw.floor_error == floor_problem(hw.cpu.arch, NUMPY_REFUSAL) and hw.features_from == "/proc/cpuinfo"
    with pytest.raises(UnsupportedCpuError, match=r"NumPy cannot run on this CPU .*X86_V2.*cpu-baseline=none.*"
                                                  r"COSYVOICE_CPU_SKIP_CPU_CHECK=1 skips"):  # fmt: skip
        hw.check_cpu()
    assert main(["doctor"]) == 1 and "PROBLEM      NumPy cannot run on this CPU" in capsys.readouterr().out
    monkeypatch.setenv(SKIP_CHECK_ENV, "1")
    hw.check_cpu()
    assert floor_problem("x86_64", None) is None


def test_a_sigill_in_the_kernel_probe_becomes_an_explanation() -> None:
    from cosyvoice_cpu.hardware.features import numpy_cpu_features

    here = numpy_cpu_features()[0]
    assert probe_kernels(cpuid=here) == (None, None)  # this machine's wheels run their kernels
    said, note = probe_kernels(code="import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    assert "died of SIGILL (Illegal instruction)" in said and "report it" in said and note is None
    assert "exit 3: boom" in probe_kernels(code="import sys; print('boom', file=sys.stderr); sys.exit(3)")[0]
    # qemu's user mode without binfmt_misc: the parent sees Denverton, the child (run natively) the host
    problem, note = probe_kernels(code="print('AVX AVX2 SSE SSE2 SSE3 SSE41 SSE42 SSSE3 POPCNT')", cpuid=DENVERTON)
    assert problem is None and "it has AVX AVX2; lacks none" in note and "ran the host's kernels" in note


def test_a_kernel_probe_child_that_cannot_start_is_a_note(tmp_path: Path) -> None:
    """An arm64 Python under qemu-aarch64 without binfmt_misc cannot exec another (Exec format error): doctor
    said nothing else and stopped on it; now it is a note and doctor goes on."""
    alien = tmp_path / "python3"
    alien.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(57))  # no interpreter line, not this machine's ELF
    alien.chmod(0o755)
    problem, note = probe_kernels(python=str(alien))
    assert problem is None and "could not start its child process" in note and "did not run" in note


def test_non_x86_and_missing_files_are_not_errors(tmp_path: Path) -> None:
    hw = detect(_root(tmp_path, {"proc/cpuinfo": "processor\t: 0\nFeatures\t: fp asimd\n"}))
    hw.check_cpu()  # ARM cpuinfo: nothing below a floor
    assert read_cpuinfo(tmp_path / "nowhere") is None
    bare = Hardware(None, 2, None, None, None, None)
    bare.check_cpu()
    assert bare.usable_cores == 2 and bare.memory_for_us is None and bare.memory_warning(1 << 30) is None


def test_memory_warnings_suggest_a_recipe_or_a_batch_size() -> None:
    hw = Hardware(None, 2, None, 8 << 30, 1 << 30, None)
    assert "use a smaller recipe (int4)" in hw.memory_warning(2 << 30)
    assert "about 2 concurrent request(s)" in hw.memory_warning(512 << 20)  # 512 + 352 + 128 <= 1024 MB
    assert "about 1 concurrent request(s)" in hw.memory_warning(640 << 20)
    assert Hardware(None, 2, None, 8 << 30, 1400 << 20, None).memory_warning(512 << 20) is None  # room for 4
    roomy = Hardware(None, 2, None, 8 << 30, 8 << 30, 4 << 30)  # the cgroup limit is what counts
    assert roomy.memory_for_us == 4 << 30 and roomy.memory_warning(1 << 30) is None


@pytest.mark.parametrize(("fixture", "family"), [("tiny_export_dir", "cosyvoice2"),
                                                  ("tiny_v3_export_dir", "cosyvoice3")])  # fmt: skip
def test_memory_warnings_weigh_what_an_engine_keeps_in_memory(fixture: str, family: str,
                                                              request: pytest.FixtureRequest) -> None:  # fmt: skip
    """Not the text and speech embedding tables (read row by row), the speech tokenizer, (CosyVoice2 and
    Fun-CosyVoice3, streaming on) the unopened whole-sentence estimator or Fun-CosyVoice3's time graph (opened
    once per Euler schedule, then closed): at full size CosyVoice2 629 of the directory's 1262 MB."""
    from cosyvoice_cpu.manifest import Manifest

    m = Manifest.load(request.getfixturevalue(fixture))
    assert m.family == family
    size = {f.file: f.size for f in m.all_files()}
    whole = sum(size[f.file] for f in m.graphs["flow_estimator"].files())
    tables = size["lm_text_embedding.npy"] + size["lm_speech_embedding.npy"]
    left_out = tables + sum(n for f, n in size.items() if f.startswith(("speech_tokenizer", "flow_time")))
    assert whole > 0 and left_out > tables > size["lm_text_embedding.npy"] > 0
    assert ("flow_time.onnx" in size) == (family == "cosyvoice3")
    assert m.resident_bytes() == sum(size.values()) - left_out - whole
    assert m.resident_bytes(streaming_estimator=False) == sum(size.values()) - left_out


_HEAP_PROBE = """
import sys
import numpy as np
from cosyvoice_cpu.hardware.malloc import fix_mmap_threshold, malloc_free_bytes
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold(1 << 20)
big = np.ones(16 << 18, np.float32)  # 16 MB, mapped; freeing it raises glibc's dynamic threshold to 16 MB
del big
blocks = [np.ones(1 << 20, np.float32) for _ in range(48)]  # 48 x 4 MB
del blocks[:-1]  # the last stays: the heap cannot shrink from its top
print(malloc_free_bytes() >> 20)
"""


def test_a_fixed_mmap_threshold_returns_freed_buffers_to_the_os() -> None:
    """Default glibc keeps 47 freed 4 MB buffers as free heap memory (resident); with the engine's fixed 1 MiB
    threshold they were mappings and are gone."""
    import os
    import subprocess
    import sys

    if malloc_free_bytes() is None:
        pytest.skip("needs glibc >= 2.33")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    held = {mode: int(subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], env=env, capture_output=True,
                                     text=True, check=True).stdout)
            for mode in ("default", "fixed")}  # fmt: skip
    assert held["default"] > 150 and held["fixed"] < 16, held
    with pytest.raises(ConfigError, match="32 MiB"):
        fix_mmap_threshold(64 << 20)
    assert EngineConfig().malloc_mmap_threshold_kb == 1024
    with pytest.raises(ConfigError, match="malloc_mmap_threshold_kb"):
        EngineConfig(malloc_mmap_threshold_kb=-1).validate()


_ARENA_PROBE = """
import sys, threading
import numpy as np
from cosyvoice_cpu.cli.speech import DEMO_MODEL
from cosyvoice_cpu.config import EngineConfig
from cosyvoice_cpu.engine import Engine
from cosyvoice_cpu.hardware.malloc import malloc_heaps
before = malloc_heaps()  # a NumPy build whose threads allocated at import made theirs already
engine = Engine.load(DEMO_MODEL, EngineConfig(threads=1, malloc_arenas=int(sys.argv[1])))
go = threading.Barrier(6)
def churn():  # six new threads allocating at once: glibc gives each new thread a heap of its own
    go.wait()
    for _ in range(3000):
        blocks = [np.ones(256) for _ in range(40)]
        del blocks
threads = [threading.Thread(target=churn) for _ in range(6)]
[t.start() for t in threads]
[t.join() for t in threads]
print(before, malloc_heaps())
engine.close()
"""


def test_an_engine_keeps_the_process_to_few_malloc_heaps() -> None:
    """Loaded with the default config, the engine bounds glibc's heaps: six threads allocating side by side after it
    share 2 heaps, where glibc alone gives them several (``malloc_arenas=0``)."""
    import os
    import subprocess
    import sys

    if malloc_heaps() is None:
        pytest.skip("needs glibc")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    heaps = {n: [int(x) for x in subprocess.run([sys.executable, "-c", _ARENA_PROBE, str(n)], env=env,
                                                capture_output=True, text=True, check=True).stdout.split()]
             for n in (EngineConfig().malloc_arenas, 0)}  # fmt: skip
    (before, limited), (_, unlimited) = heaps[2], heaps[0]
    assert EngineConfig().malloc_arenas == 2 and limited <= max(2, before) < unlimited, heaps
    with pytest.raises(ConfigError, match="1 to 1024"):
        limit_arenas(0)
    with pytest.raises(ConfigError, match="malloc_arenas"):
        EngineConfig(malloc_arenas=-1).validate()


def test_doctor_reports_the_machine_and_a_model(tiny_export_dir: Path, tmp_path: Path, capsys) -> None:
    code = main(["doctor", "-m", str(tiny_export_dir)])
    out = capsys.readouterr().out
    assert code in (0, 1) and "cpu " in out and "threads " in out and "files ok (sha256 checked)" in out
    assert main(["doctor", "-m", str(tmp_path)]) == 1
    assert "PROBLEM      " in capsys.readouterr().out


def test_the_pools_report_reads_numpys_blas_and_says_when_stages_overlap(tmp_path: Path) -> None:
    import numpy  # noqa: F401

    from cosyvoice_cpu.hardware.pools import blas_pool, pool_lines, thread_pools

    found = blas_pool()
    if found is None:
        pytest.skip("NumPy here is not built on OpenBLAS")
    assert "openblas" in found[0].lower() and found[1] >= 1
    none = tmp_path / "maps"
    none.write_text("7f00-7f01 r-xp 00000000 00:00 0 /usr/lib/libc.so.6\n")
    assert blas_pool(none) is None and blas_pool(tmp_path / "missing") is None
    names = [p.name for p in thread_pools(2, 4, max_active=8)]
    assert names[:4] == ["onnxruntime", "openvino", "lm-scheduler", "server"] and names[-1] == "numpy-blas"
    assert "lm-scheduler" not in [p.name for p in thread_pools(2, 0)]
    assert pool_lines(1, 4, cores=2)[-1].startswith("at most 2 threads compute at once")
    assert pool_lines(2, 0, cores=2)[-1].startswith("at most 2 threads compute at once")
    assert "up to 4 computing threads on 2" in pool_lines(2, 4, cores=2)[-1]


def test_doctor_shows_every_pool() -> None:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "cosyvoice_cpu", "doctor"], capture_output=True, text=True, timeout=120)
    pools = [line for line in p.stdout.splitlines() if line.startswith("pools ")]
    assert any("onnxruntime:" in line for line in pools) and any("lm-scheduler:" in line for line in pools), p.stdout


def test_the_heap_limit_for_new_processes_keeps_the_operators_choice() -> None:
    assert arena_env(2, {}) == {"MALLOC_ARENA_MAX": "2"}
    assert arena_env(2, {"MALLOC_ARENA_MAX": "4"}) == {"MALLOC_ARENA_MAX": "4"}
    assert arena_env(0, {}) == {}  # 0: malloc left alone
    with pytest.raises(ConfigError, match="0 to 1024"):
        arena_env(-1, {})
