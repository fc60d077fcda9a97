"""Weight-file pages ORT no longer reads go back to the kernel (``pages.release_file_pages``), and no data changes."""

from __future__ import annotations

import json
import mmap
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_cpu.hardware.pages import file_mappings, release_file_pages, resident_bytes


def _kernel() -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
    except ValueError:
        return (0,)


def _skip_on_shmem(path: Path) -> None:
    """tmpfs pages are shared memory: without swap the kernel cannot reclaim them, so nothing would be released."""
    where, best, kind = str(path.resolve()) + "/", "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and where.startswith(fields[1].rstrip("/") + "/") and len(fields[1]) > len(best):
            best, kind = fields[1], fields[2]
    if kind == "tmpfs":
        pytest.skip(f"{path} is on tmpfs")


linux_pageout = pytest.mark.skipif(not (sys.platform.startswith("linux") and _kernel() >= (5, 4)
                                        and Path("/proc/self/smaps").exists()),
                                   reason="needs Linux >= 5.4 (MADV_PAGEOUT) and /proc/self/smaps")  # fmt: skip


@linux_pageout
def test_release_drops_clean_pages_and_keeps_every_byte(tmp_path: Path) -> None:
    _skip_on_shmem(tmp_path)
    data = np.arange(2 << 20, dtype=np.float32)  # 8 MB
    path = tmp_path / "w.onnx.data"
    with open(path, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())  # clean page-cache pages, as a model file that was written long ago
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private and writable, as ORT maps weights
    view = np.frombuffer(mapped, np.float32)
    assert view.sum() == data.sum()  # touches every page
    assert resident_bytes(path) > 7.5 * 2**20
    view[5] = -1.0  # one page modified (copy on write; the kernel may unmap the rest of its large folio)
    released = release_file_pages(path)
    assert released > 4 * 2**20
    assert resident_bytes(path) < 2**20  # the modified page stays (there is no swap to put it in) or is swapped
    assert view[5] == -1.0 and np.array_equal(view[6:], data[6:]) and np.array_equal(view[:5], data[:5])
    assert resident_bytes(path) > 7.5 * 2**20  # read again from the file
    del view
    mapped.close()


def test_unmapped_or_missing_files_are_a_no_op(tmp_path: Path) -> None:
    path = tmp_path / "never-mapped.data"
    path.write_bytes(b"\0" * 8192)
    assert file_mappings(path) == [] and release_file_pages(path) == 0
    assert release_file_pages(tmp_path / "missing.data") == 0


def test_mappings_are_read_from_smaps_by_path(tmp_path: Path) -> None:
    target = tmp_path / "dir with space" / "g.onnx.data"
    smaps = tmp_path / "smaps"
    smaps.write_text(
        f"7f0000000000-7f0000003000 rw-p 00000000 fd:01 123   {target}\n"
        "Size:                 12 kB\nRss:                   8 kB\nAnonymous:             0 kB\n"
        "7f0000003000-7f0000004000 rw-p 00000000 00:00 0 \nRss:                   4 kB\n"
        f"7f0000010000-7f0000012000 r--p 00003000 fd:01 123   {target}\nRss:                   0 kB\n"
        "VmFlags: rd mr mw me ac sd\n"
    )  # fmt: skip
    assert file_mappings(target, smaps) == [(0x7F0000000000, 0x7F0000003000, 8192),
                                            (0x7F0000010000, 0x7F0000012000, 0)]  # fmt: skip


K, N = 4096, 512  # 8-bit blocks of 32: 2 MB of weights, 256 KB of block scales

PROBE = """
import json, sys
import numpy as np
from cosyvoice_cpu.hardware.pages import resident_bytes
from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.backends.onnxruntime import make_session

path = sys.argv[1]
s = make_session(path, SessionConfig(threads=1, release_weight_pages=sys.argv[2] == "1"))
after_load = resident_bytes(path + ".data")
k = int(sys.argv[3])
y = s.run(None, {"a": np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)})[0]
print(json.dumps({"after_load": after_load, "after_run": resident_bytes(path + ".data"), "y": y.ravel().tolist()}))
"""


def _matmul_nbits(path: Path) -> Path:
    """One ``MatMulNBits`` as the LM's ``int8w`` recipe writes them (8 bits, blocks of 32, int8 compute), its
    weights and scales in ``<name>.data``."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    b = numpy_helper.from_array(rng.integers(0, 256, (N, K // 32, 32), dtype=np.uint8), "b")
    scales = numpy_helper.from_array((rng.random(N * K // 32, dtype=np.float32) + 0.5) / 128, "scales")
    node = helper.make_node("MatMulNBits", ["a", "b", "scales"], ["y"], domain="com.microsoft", K=K, N=N, bits=8,
                            block_size=32, accuracy_level=4)  # fmt: skip
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", N])],
        [b, scales],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=1024)
    return path


@linux_pageout
def test_packed_weights_leave_their_file_pages_and_the_output_is_the_same(tmp_path: Path) -> None:
    """The LM's ``MatMulNBits`` pack their weights and block scales at load; ORT keeps the scales' pages mapped but
    never reads them again (full-size CosyVoice2: 44 MB). If an ORT upgrade starts reading them at run time,
    ``after_run`` catches it: releasing them would then no longer pay."""
    _skip_on_shmem(tmp_path)
    path = _matmul_nbits(tmp_path / "g.onnx")
    runs = {}
    for release in ("1", "0"):
        r = subprocess.run([sys.executable, "-c", PROBE, str(path), release, str(K)], capture_output=True, text=True,
                           timeout=120)  # fmt: skip
        assert r.returncode == 0, r.stderr
        runs[release] = json.loads(r.stdout.strip().splitlines()[-1])
    assert runs["0"]["after_load"] >= N * K // 32 * 4  # the scales stay resident without the release
    assert runs["1"]["after_load"] == 0 and runs["1"]["after_run"] == 0
    assert runs["1"]["y"] == runs["0"]["y"]
