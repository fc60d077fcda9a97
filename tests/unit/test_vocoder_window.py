"""Planning the windows of a long vocoder call (``cosyvoice_cpu.vocoder.windows``) and reading their context."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.vocoder.windows import check_window, context_of, decode_windows, plan


def test_a_call_that_fits_or_has_no_context_is_one_piece() -> None:
    assert plan(500, 500, (16, 16)) == [(0, 500, 0, 500)]
    assert plan(900, 0, (16, 16)) == [(0, 900, 0, 900)]
    assert plan(900, 100, None) == [(0, 900, 0, 900)]


@pytest.mark.parametrize("frames", [501, 1000, 3001, 77])
def test_pieces_cover_the_call_once_in_equal_windows_with_their_context(frames: int) -> None:
    window, context = (500, (16, 12)) if frames > 100 else (20, (3, 2))
    pieces = plan(frames, window, context)
    kept = [b - a for _, _, a, b in pieces]
    assert len(pieces) == -(-frames // window) >= 2 and max(kept) - min(kept) <= 1 and max(kept) <= window
    assert pieces[0][2] == 0 and pieces[-1][3] == frames
    assert all(p[3] == q[2] for p, q in itertools.pairwise(pieces))  # seamless, no overlap in what is kept
    for lo, hi, a, b in pieces:
        assert lo == max(0, a - context[0]) and hi == min(frames, b + context[1])


def test_windows_join_what_each_piece_keeps() -> None:
    """With a 'graph' whose sample depends on its frame and one frame each side, windows give one call's output."""
    up = 4

    def run(mel: np.ndarray, source: np.ndarray) -> np.ndarray:
        x = mel[:, 0, :] + np.pad(mel[:, 0, 1:], ((0, 0), (0, 1))) + np.pad(mel[:, 0, :-1], ((0, 0), (1, 0)))
        return np.repeat(x, up, axis=1) + source[:, 0, :]

    rng = np.random.default_rng(0)
    mel = rng.standard_normal((2, 3, 50), dtype=np.float32)
    source = rng.standard_normal((2, 1, 50 * up), dtype=np.float32)
    whole = run(mel, source)
    np.testing.assert_array_equal(decode_windows(run, mel, source, up, plan(50, 20, (1, 1))), whole)
    assert not np.array_equal(decode_windows(run, mel, source, up, plan(50, 20, (0, 0))), whole)


def test_bad_settings_are_refused() -> None:
    assert check_window(0) == 0 and check_window(20) == 20
    for bad in (5, -1, 2.5, True):
        with pytest.raises(ConfigError, match="window_frames"):
            check_window(bad)  # type: ignore[arg-type]
    assert context_of({}) is None and context_of({"context_frames": None}) is None
    assert context_of({"context_frames": [16, 15]}) == (16, 15)
    for bad in ([16], [-1, 2], "16", [1.5, 2]):
        with pytest.raises(ModelDirError, match="context_frames"):
            context_of({"context_frames": bad})
