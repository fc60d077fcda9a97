"""``bench/server_load.py latency``, the first audio a voice assistant's user waits for after the server sat idle,
run for a few requests against the demo model."""

from __future__ import annotations

import json
from pathlib import Path

from tests.repo_scripts import load_script

SCRIPT = "bench/server_load.py"


def test_the_quantile_is_a_measured_value_by_nearest_rank() -> None:
    q = load_script(SCRIPT).quantile
    assert q([float(v) for v in range(10, 0, -1)], 0.9) == 9.0
    assert q([3.0], 0.9) == 3.0 and q([2.0, 1.0], 0.5) == 1.0 and q([2.0, 1.0], 1.0) == 2.0


def test_idle_gaps_take_turns_against_a_real_server(tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    result = load_script(SCRIPT).main(["latency", "--requests", "3", "--idle", "0,0.5", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert [row["idle_s"] for row in result["rows"]] == [0.0, 0.5]
    for row in result["rows"]:
        values = row["first_audio_s"]
        assert row["requests"] == len(values) >= 2 and row["requests"] + row["failed"] == 3
        assert all(0 < v < 60 for v in values)
        assert row["p90_first_audio_s"] in values and row["worst_first_audio_s"] == max(values)
        assert min(values) <= row["median_first_audio_s"] <= row["worst_first_audio_s"]
