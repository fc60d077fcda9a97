"""The LM's embedding tables are read row by row (``row_table``): the same rows as ``np.load``, nothing mapped."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from cosyvoice_cpu.errors import ModelDirError
from cosyvoice_cpu.hardware.pages import file_mappings
from cosyvoice_cpu.lm.row_table import RowTable, open_table
from cosyvoice_cpu.lm.session import LMSession
from cosyvoice_cpu.lm_files import EMBEDDING_FILES

pread = pytest.mark.skipif(not hasattr(os, "preadv"), reason="os.preadv is POSIX-only (elsewhere: a memory map)")


@pread
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rows_equal_np_load_and_nothing_is_mapped(tmp_path: Path, dtype: type) -> None:
    table = np.random.default_rng(0).standard_normal((5000, 96)).astype(dtype)
    path = tmp_path / "t.npy"
    np.save(path, table)
    rows = open_table(path)
    assert isinstance(rows, RowTable) and len(rows) == 5000 and rows.shape == (5000, 96) and rows.dtype == dtype
    ids = np.random.default_rng(1).integers(0, 5000, 3000)
    ids[:3] = [0, 4999, 0]  # first, last, repeated
    got = rows[ids]
    assert got.dtype == dtype and np.array_equal(got, table[ids])
    assert rows[np.array([], np.int64)].shape == (0, 96)
    assert file_mappings(path) == []  # a memory map would have made ~64 KB resident per distinct row
    rows.close()


@pread
def test_bad_tables_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.npy"
    np.save(path, np.zeros((100, 8), np.float32))
    data = path.read_bytes()
    path.write_bytes(data[:-40])
    with pytest.raises(ValueError, match="truncated"):
        RowTable(path)
    np.save(path, np.zeros((4, 8, 2), np.float32))
    with pytest.raises(ValueError, match="2-D"):
        RowTable(path)
    np.save(path, np.asfortranarray(np.zeros((4, 8), np.float32)))
    with pytest.raises(ValueError, match="Fortran"):
        RowTable(path)
    path.write_bytes(b"not a numpy file at all")
    with pytest.raises(ValueError):
        RowTable(path)


def test_the_lm_reads_its_tables_without_mapping_them(tmp_path: Path) -> None:
    from cosyvoice_cpu.cli.speech import DEMO_MODEL
    from cosyvoice_cpu.manifest import Manifest

    attrs = Manifest.load(DEMO_MODEL).graphs["lm"].attrs
    lm = LMSession.from_dir(DEMO_MODEL, attrs, threads=1)
    text = np.load(DEMO_MODEL / EMBEDDING_FILES["text"])
    ids = np.arange(len(text))[::-7]
    assert np.array_equal(lm.embed_text(ids), text[ids].astype(np.float32))
    speech = np.load(DEMO_MODEL / EMBEDDING_FILES["speech"])
    assert np.array_equal(lm.embed_speech([0, len(speech) - 1]), speech[[0, -1]].astype(np.float32))
    if hasattr(os, "preadv"):
        assert file_mappings(DEMO_MODEL / EMBEDDING_FILES["text"]) == []
        assert file_mappings(DEMO_MODEL / EMBEDDING_FILES["speech"]) == []
    truncated = tmp_path / "text.npy"
    truncated.write_bytes((DEMO_MODEL / EMBEDDING_FILES["text"]).read_bytes()[:-1000])
    tables = {k: DEMO_MODEL / v for k, v in EMBEDDING_FILES.items()} | {"text": truncated}
    with pytest.raises(ModelDirError, match="text embedding table"):
        LMSession(DEMO_MODEL / "lm.onnx", tables, attrs, threads=1)
