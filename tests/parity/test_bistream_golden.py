"""The runtime's text-stream LM (:class:`~cosyvoice_cpu.lm.bistream.BistreamRequest`) gives the OFFICIAL
``inference_bistream`` tokens, token for token (tests/golden/bistream.npz, made by scripts/make_bistream_golden.py
with the official code on the same tiny fixtures).

The runtime side is an fp32 export of the fixture (ONNX Runtime), so its log-probs differ from the official PyTorch
ones by float rounding only (~1e-6); with the same uniform draws a token could only differ where a draw falls
within that distance of a CDF boundary, which none of the saved cases does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "bistream.npz"
FAMILIES = ("cosyvoice2", "cosyvoice3")
CASES = ("zero_shot", "cross_lingual", "sentences")


@pytest.fixture(scope="module")
def golden() -> dict:
    z = np.load(GOLDEN, allow_pickle=False)
    out = {k: z[k] for k in z.files}
    out["header"] = json.loads(str(out["header"]))
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def generator(request, tmp_path_factory):
    """(family, the runtime's SpeechTokenGenerator on an fp32 export of the tiny fixture)."""
    from cosyvoice_cpu.engine import Engine
    from cosyvoice_cpu.workshop.exporter import ExportOptions, export_model
    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture

    family = request.param
    root = tmp_path_factory.mktemp(f"bistream-{family}")
    src = write_fixture(FixtureSpec(family, "tiny", 0), root / "fixture")
    export_model(src, root / "fp32", ExportOptions(recipe="fp32", verify=False, max_len=1024))
    with Engine.load(root / "fp32") as engine:
        yield family, engine


@pytest.mark.parametrize("case", CASES)
def test_tokens_equal_the_official_bistream(golden, generator, case) -> None:
    from cosyvoice_cpu.lm.bistream import BistreamRequest
    from cosyvoice_cpu.lm.sampling import RngDraw

    family, engine = generator
    key = f"{family}_{case}"
    info = golden["header"]["cases"][key]
    facts = engine.family.facts
    lm = engine.lm
    req = BistreamRequest(
        lm,
        golden[f"{key}_prompt_text"],
        golden[f"{key}_prompt_speech"],
        facts.mix_ratio,
        lm.facts.speech_token_size + facts.fill_offset,
        draw=RngDraw(info["draw_seed"]),
    )
    ids = golden[f"{key}_pieces"]
    for piece in np.split(ids, np.cumsum(golden[f"{key}_piece_lens"])[:-1]):
        req.feed(piece)
    req.end()
    want = golden[f"{key}_tokens"].tolist()
    got = []
    for token in req:
        got.append(token)
        if len(got) == len(want) and info["truncated"]:
            break
    assert got == want
    if info["raised"]:  # where the official loop raised on a special token, the runtime's speech ended there
        assert req.stop_reason == "unexpected"
