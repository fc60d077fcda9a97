"""``bench/server_mix.py``, the soak with a long-running server's traffic, run for a few requests against the demo
model: every kind of request (Wyoming too) is made and counted, voices are replaced between batches, and nothing
fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.repo_scripts import load_script

SCRIPT = "bench/server_mix.py"


def test_every_kind_meets_every_text_and_the_voices_take_turns() -> None:
    mix = load_script(SCRIPT)
    n = len(mix.KINDS) * len(mix.TEXTS)
    actions = [mix.action(i, 3) for i in range(n)]
    assert {(a.kind, a.text) for a in actions} == {(k, t) for k in mix.KINDS for t in mix.TEXTS}
    assert [a.voice for a in actions[:4]] == ["mix-0", "mix-1", "mix-2", "mix-0"]


def test_a_short_mix_against_a_real_server(tmp_path: Path) -> None:
    pytest.importorskip("wyoming")
    mix = load_script(SCRIPT)
    out = tmp_path / "mix.json"
    log = tmp_path / "server.log"
    result = mix.main(["--requests", "15", "--every", "5", "--voices", "2", "--wyoming", "--json", str(out),
                       "--log", str(log), "--", "--max-audio-seconds", "30"])  # fmt: skip
    assert json.loads(out.read_text()) == result
    assert result["kinds"] == ["stream", "whole", "text_ws", "drop", "wyoming"]
    assert result["failures"] == [] and sum(result["outcomes"].values()) == 15, result["outcomes"]  # 4, 9, 14: Wyoming
    by_kind = result["outcomes_by_kind"]
    assert {k: sum(v.values()) for k, v in by_kind.items()} == {k: 3 for k in result["kinds"]}
    assert set(by_kind["drop"]) <= {"dropped", "no_speech"}  # requests 3, 8 and 13 hang up mid-stream
    assert all(set(v) <= {"ok", "audio_too_long", "no_speech"} for k, v in by_kind.items() if k != "drop")
    assert sum(v.get("ok", 0) for v in by_kind.values()) >= 6  # random weights: most requests speak
    assert [p["requests"] for p in result["curve"]] == [5, 10, 15] and result["voices_replaced"] == 3
    assert all(p["rss_mb"] > 50 and p["peak_mb"] >= p["rss_mb"] and p["prompt_cache_mb"] >= 0 for p in result["curve"])
    assert result["serve_args"] == ["--max-audio-seconds", "30"] and log.exists()
