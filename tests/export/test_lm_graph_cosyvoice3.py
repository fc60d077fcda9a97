"""The Fun-CosyVoice3 (v3) LM on ONNX Runtime: export, numerics gates, the token loop vs ``CosyVoice3LM.inference``
with the same draws (min-length quirk, stops on any special), the silent-run filter and the tokenizer export."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cosyvoice_cpu.errors import ConfigError, ExportError

MAX_LEN = 256
S = 6561  # speech tokens; sos S, eos S + 1, task_id S + 2; 200 specials in all


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The LM part of the tiny v3 fixture (yaml, CosyVoice-BlankEN, llm.pt), seed 0."""
    from cosyvoice_cpu.fixtures.weights.cosyvoice3 import write_cosyvoice3_lm_files

    d = tmp_path_factory.mktemp("v3") / "tiny-v3-lm"
    write_cosyvoice3_lm_files(d, "tiny", 0)
    return d


@pytest.fixture(scope="module")
def exported(v3_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """(reference CosyVoice3LM, directory with lm.onnx and the tables, GraphArtifact)."""
    from cosyvoice_cpu.export.lm.cosyvoice3 import export_lm
    from cosyvoice_cpu.workshop.parts import load_reference

    lm = load_reference(v3_dir, ("lm",)).lm.eval()
    out = tmp_path_factory.mktemp("v3-lm")
    (artifact,) = export_lm(lm, out, max_len=MAX_LEN)
    return lm, out, artifact


@pytest.fixture(scope="module")
def session(exported):
    from cosyvoice_cpu.lm.session import LMSession

    _, out, artifact = exported
    return LMSession.from_dir(out, artifact.attrs, threads=1)


def test_artifact_tables_and_attrs(exported) -> None:
    import onnx

    lm, out, a = exported
    at = a.attrs
    assert (at["speech_vocab"], at["speech_rows"], at["speech_token_size"]) == (S + 200, S, S)
    assert (at["eos_id"], at["min_len_masked_id"], at["endofprompt_id"]) == (S + 1, S, 151646)
    assert at["stop_ids"] == list(range(S, S + 200))
    assert a.outputs[0].name == "logp" and a.outputs[0].shape == ["batch", S + 200]
    w = lm.speech_embedding.weight.detach().numpy()
    speech = np.load(out / at["embeddings"]["speech"])
    special = np.load(out / at["embeddings"]["special"])
    text = np.load(out / at["embeddings"]["text"], mmap_mode="r")
    assert np.array_equal(speech, w[:S]) and np.array_equal(special, w[[S, S + 2]])  # rows: sos, task_id
    assert text.shape == (151936, 64)
    graph = onnx.load(str(out / a.file), load_external_data=False).graph
    names = {n.name for n in graph.node}
    assert "head" in names and "head.bias_add" not in names  # bias-free head: no Add
    assert graph.name == "cosyvoice3_lm"


def test_export_refuses_other_families(tmp_path: Path) -> None:
    from cosyvoice_cpu.export.lm.cosyvoice3 import export_lm, verify_lm

    v2_like = SimpleNamespace(cfg=SimpleNamespace(), llm_decoder=SimpleNamespace(bias=object()))
    for call in (lambda: export_lm(v2_like, tmp_path), lambda: verify_lm(v2_like, tmp_path)):
        with pytest.raises(ConfigError, match="not a Fun-CosyVoice3 LM"):
            call()


def test_fp32_gates_pass(exported) -> None:
    from cosyvoice_cpu.export.lm.common import FP32_TOLERANCES
    from cosyvoice_cpu.export.lm.cosyvoice3 import compare_lm, verify_lm

    lm, out, _ = exported
    results = verify_lm(lm, out, seed=3)
    assert {r.check for r in results} == set(FP32_TOLERANCES)
    assert all(r.passed for r in results), "\n".join(map(str, results))
    report = compare_lm(lm, out, steps=40)
    assert report["agreement"] == 1.0 and report["max_rel_err"] < 1e-5  # measured 3.3e-7


@pytest.mark.parametrize("precision", ["int8w", "int4", "int8"])
def test_quantized_gates_pass(exported, precision: str) -> None:
    """The recipe's quantizers (as workshop/export_stages.py calls them) on the v3 graph, gated by v3's tolerances."""
    import onnx

    from cosyvoice_cpu.export.lm.cosyvoice3 import QUANT_TOLERANCE, verify_lm
    from cosyvoice_cpu.export.quantize import quantize_int8_dynamic, quantize_nbits

    lm, out, a = exported
    name = f"lm_{precision}.onnx"
    if precision == "int8":
        quantize_int8_dynamic(out / a.file, out / name, reduce_range=True)  # as export_stages.py
    else:
        quantize_nbits(out / a.file, out / name, bits=8 if precision == "int8w" else 4, block_size=32,
                       accuracy_level=4)  # fmt: skip
    ops = [n.op_type for n in onnx.load(str(out / name), load_external_data=False).graph.node]
    assert "MatMul" not in ops  # all 4 per layer and the head
    assert ops.count("MatMulInteger" if precision == "int8" else "MatMulNBits") == 4 * 2 + 1
    results = verify_lm(lm, out, graph_file=name, tolerance=QUANT_TOLERANCE[f"lm:{precision}"])
    assert all(r.passed for r in results), "\n".join(map(str, results))


# ---- the token loop vs CosyVoice3LM.inference ----------------------------------------------------------------


class _Lifted:
    """An LMSession whose log-probabilities get ``lift`` added (the reference gets it on the logits by a hook)."""

    def __init__(self, session, lift: np.ndarray) -> None:
        self._s, self.lift = session, lift

    def __getattr__(self, name: str):
        return getattr(self._s, name)

    def prefill(self, *args):
        return self._s.prefill(*args) + self.lift

    def decode(self, *args):
        return self._s.decode(*args) + self.lift


RNG = np.random.default_rng(0)
TEXT = [int(t) for t in RNG.integers(0, 151643, 6)]  # min_len 12, max_len 120
PROMPT_TEXT = [int(t) for t in RNG.integers(0, 151643, 4)] + [151646, 77]
PROMPT_SPEECH = [int(t) for t in RNG.integers(0, S, 10)]


def _both(lm, session, seed: int, lift_row: int | None = None, lift: float = 0.0, facts: dict | None = None):
    """(runtime tokens, the runtime TokenRequest, reference tokens) for the same prompt and RngDraw(seed) uniforms."""
    from cosyvoice_cpu.export.lm.cosyvoice3 import lm_facts_v3
    from cosyvoice_cpu.lm.generate import LMFacts, SpeechTokenGenerator
    from cosyvoice_cpu.lm.sampling import RngDraw

    add = np.zeros(S + 200, np.float32)
    if lift_row is not None:
        add[lift_row] = lift
    facts = LMFacts.from_manifest({**lm_facts_v3(lm), **(facts or {})})
    gen = SpeechTokenGenerator(_Lifted(session, add), facts, lm.cfg.sampling)
    req = gen.request(TEXT, PROMPT_TEXT, PROMPT_SPEECH, draw=RngDraw(seed))
    ours = list(req)
    draw = RngDraw(seed)
    hook = lm.llm_decoder.register_forward_hook(lambda _m, _i, out: out + torch.from_numpy(add))
    try:
        ref = list(lm.inference(torch.tensor([TEXT]), torch.tensor([PROMPT_TEXT]), torch.tensor([PROMPT_SPEECH]),
                                draw=lambda p: draw(p.numpy()), sampling=lm.cfg.sampling))  # fmt: skip
    finally:
        hook.remove()
    return ours, req, ref


@pytest.mark.parametrize("seed", [0, 2, 5])
def test_tokens_equal_the_reference(exported, session, seed: int) -> None:
    """Random weights put ~3 % of the mass on the 200 specials: these decodes end on non-eos specials (seed 5
    after 7 tokens, below min_len 12: only 6561 is masked there)."""
    from cosyvoice_cpu.lm.sampling import RngDraw
    from cosyvoice_cpu.lm.silence import SilentRunFilter

    lm = exported[0]
    ours, req, ref = _both(lm, session, seed)
    assert ours == ref and len(ours) > 0
    assert req.stop_reason == "stop" and S <= req.stop_token < S + 200 and req.stop_token != S + 1
    f, draw = SilentRunFilter(), RngDraw(seed)
    to_flow = lm.generate(torch.tensor([TEXT]), torch.tensor([PROMPT_TEXT]), torch.tensor([PROMPT_SPEECH]),
                          draw=lambda p: draw(p.numpy()), sampling=lm.cfg.sampling)  # fmt: skip
    assert [t for t in ours if f.push(t)] == to_flow


def test_stop_on_a_non_eos_special_below_min_len(exported, session) -> None:
    ours, req, ref = _both(exported[0], session, seed=1)  # draws 6632 at step 0 (measured)
    assert ours == ref == [] and (req.stop_reason, req.stop_token) == ("stop", 6632)


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_eos_is_drawable_below_min_len(exported, session, seed: int) -> None:
    """The official quirk: below min_len only id 6561 (sos) is masked, so a likely eos (6562) ends decoding early.
    With v2's rule (the eos itself masked) no eos can end it before min_len (another special still can)."""
    lm = exported[0]
    ours, req, ref = _both(lm, session, seed, lift_row=S + 1, lift=11.0)
    assert ours == ref and len(ours) < req.min_len and req.stop_token == S + 1
    v2_rule, req2, _ = _both(lm, session, seed, lift_row=S + 1, lift=11.0, facts={"min_len_masked_id": S + 1})
    assert len(v2_rule) >= req2.min_len or req2.stop_token != S + 1
    assert len(v2_rule) != len(ours)


@pytest.mark.parametrize("seed", [0, 2])
def test_sos_is_masked_until_min_len(exported, session, seed: int) -> None:
    ours, req, ref = _both(exported[0], session, seed, lift_row=S, lift=50.0)
    assert ours == ref and len(ours) == req.min_len and req.stop_token == S


def test_facts_defaults_and_the_endofprompt_rule(exported, session) -> None:
    from cosyvoice_cpu.export.lm.cosyvoice3 import lm_facts_v3
    from cosyvoice_cpu.lm.generate import LMFacts, SpeechTokenGenerator

    v2 = {"speech_token_size": S, "eos_id": S, "stop_ids": [S, S + 1, S + 2], "min_token_text_ratio": 2,
          "max_token_text_ratio": 20}  # fmt: skip
    f2 = LMFacts.from_manifest(v2)
    assert (f2.min_len_masked_id, f2.endofprompt_id) == (S, None)
    assert LMFacts(S, S, (S,), 2.0, 20.0).min_len_masked_id == S
    f3 = LMFacts.from_manifest(lm_facts_v3(exported[0]))
    assert (f3.eos_id, f3.min_len_masked_id, f3.endofprompt_id) == (S + 1, S, 151646)
    gen = SpeechTokenGenerator(session, f3)
    with pytest.raises(ConfigError, match=r"<\|endofprompt\|> \(id 151646\)"):
        gen.request([5, 6, 7], [8, 9])
    assert gen.request([5, 151646, 7]).min_len == 6  # in the text is as good as in the prompt text
    with pytest.raises(ConfigError, match="min-length masked id"):
        SpeechTokenGenerator(session, LMFacts.from_manifest({**lm_facts_v3(exported[0]), "min_len_masked_id": 7000}))
    with pytest.raises(ConfigError, match="speech token ids"):
        session.decode(session.new_cache(1), [0], [S])  # stop ids have no row in the speech table


# ---- silent-token filter and tokenizer ---------------------------------------------------------------------------


def test_silence_filter_equals_the_reference() -> None:
    from cosyvoice_cpu.lm.silence import MAX_SILENT_RUN, SILENT_TOKENS, SilentRunFilter, drop_long_silences
    from cosyvoice_cpu.reference.lm import cosyvoice3 as lm_v3

    assert (SILENT_TOKENS, MAX_SILENT_RUN) == (lm_v3.SILENT_TOKENS, lm_v3.MAX_SILENT_RUN)
    rng = np.random.default_rng(0)
    pool = sorted(SILENT_TOKENS) + [0, 3, 100, 6560]
    for n in (0, 1, 7, 40, 300):
        seq = [int(pool[i]) for i in rng.integers(0, len(pool) if n % 2 else 12, n)]
        want = lm_v3.drop_long_silences(seq)
        assert drop_long_silences(seq) == want
        ours, ref = SilentRunFilter(), lm_v3.SilentRunFilter()
        assert [ours.push(t) for t in seq] == [ref.keep(t) for t in seq]
        assert ours.dropped == len(seq) - len(want)
    seq = [1, 2, 28, 29, 55, 248, 494, 100, 2322, 2322, 9, 2323] + [2242] * 7
    assert drop_long_silences(seq) == [1, 2, 28, 29, 55, 100, 2322, 2322, 9, 2323] + [2242] * 4
    f = SilentRunFilter(max_run=0)
    assert list(f.filter([1, 5, 2])) == [5] and f.dropped == 2
    f.reset()
    assert (f.run, f.dropped) == (0, 0)
    with pytest.raises(ConfigError, match="max_run"):
        SilentRunFilter(max_run=-1)


def test_tokenizer_export_matches_the_reference(v3_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from cosyvoice_cpu.export.tokenizer.cosyvoice3 import export_tokenizer
    from cosyvoice_cpu.reference.tokenizer import COSYVOICE3_SPECIALS, CosyVoice3Tokenizer
    from cosyvoice_cpu.text.tokenizer import TextTokenizer

    blank = v3_dir / "CosyVoice-BlankEN"
    text = export_tokenizer(blank, tmp_path)
    assert text["tokenizer"] == "tokenizer.json" and text["vocab_size"] == 151924
    assert text["special_ids"]["<|endofprompt|>"] == 151646 and text["special_ids"]["<|endoftext|>"] == 151643
    assert len(text["special_ids"]) == 1 + len(COSYVOICE3_SPECIALS)
    ours, ref = TextTokenizer.from_dir(tmp_path), CosyVoice3Tokenizer(blank)
    assert ours.vocab_size == len(ref)
    ours.check_manifest(text["special_ids"])
    strings = [
        "You are a helpful assistant.<|endofprompt|>Hello there, how are you?",
        "[HH][AH0][L][OW1] world [breath] again<|endofsystem|>",
        "收到好友从远方寄来的生日礼物。[j][ǐ][n]",
        "<strong>loud</strong> [laughter] <laughter>ha</laughter> 12 apples, 3.5 kg",
        "".join(COSYVOICE3_SPECIALS),
        "  spaces\tand\nnewlines  ",
    ]
    for s in strings:
        assert ours.encode(s) == ref.encode(s), s
    monkeypatch.setattr("cosyvoice_cpu.reference.lm.cosyvoice3.ENDOFPROMPT_ID", 5)
    with pytest.raises(ExportError, match="hard-codes 5"):
        export_tokenizer(blank, tmp_path / "again")
