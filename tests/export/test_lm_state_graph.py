"""The LM on a stateful graph (``cosyvoice_cpu.lm.state_graph``, OpenVINO's LLM form) behind ``LMSession``: the same
log-probabilities as the bound ONNX graph for every way the scheduler, the prefix cache and the text streams use a
cache (rows of different lengths, idle rows, rows leaving and joining, long prefills beside other rows, entries read
and written), on the tiny fixture with fp32 weights and f32 inference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cosyvoice_cpu.backends.base import OPENVINO, SessionConfig
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.export.common import rel_err

pytest.importorskip("openvino")

MAX_LEN = 96
RTOL = 1e-4  # f32 inference and an f32 state against ONNX Runtime's fp32 graph


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def lm_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(model directory with lm.onnx and lm.ov.xml of the same fp32 weights, the LM attrs), per Qwen2-LM family."""
    from cosyvoice_cpu.export.lm import cosyvoice2, cosyvoice3
    from cosyvoice_cpu.export.lm.openvino_stateful import export_stateful_lm
    from cosyvoice_cpu.workshop.parts import load_reference

    fixture, export_lm = {
        "cosyvoice2": ("tiny_model_dir", cosyvoice2.export_lm),
        "cosyvoice3": ("tiny_v3_model_dir", cosyvoice3.export_lm),
    }[request.param]
    lm = load_reference(request.getfixturevalue(fixture), stages=("lm",)).lm.eval()
    out = tmp_path_factory.mktemp("lm_state")
    artifacts = export_lm(lm, out, max_len=MAX_LEN)
    export_stateful_lm(lm, out, weights="none")
    return out, next(a for a in artifacts if a.key == "lm").attrs


@pytest.fixture()
def sessions(lm_dir, monkeypatch: pytest.MonkeyPatch):
    """(bound ONNX Runtime session, stateful OpenVINO session) of the same weights."""
    from cosyvoice_cpu.backends import registry
    from cosyvoice_cpu.backends.openvino import OpenVino
    from cosyvoice_cpu.lm.session import LMSession

    monkeypatch.setitem(registry.BACKENDS, OPENVINO, OpenVino(cache_dir="", precision="f32"))
    out, attrs = lm_dir
    bound = LMSession.from_dir(out, attrs, threads=1)
    state = LMSession.from_dir(out, attrs, graph_file="lm.ov.xml", threads=SessionConfig(threads=1, backend=OPENVINO))
    return bound, state


def _prompt(n: int, seed: int, hidden: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, hidden)) * 0.5).astype(np.float32)


def _script(session, plan: list[tuple], rows: int) -> dict[int, list[np.ndarray]]:
    """Run ``plan`` (("prefill", row, embeds) | ("step", rows, tokens) | ("release", row)) on one cache of
    ``rows`` rows; every row's logp in order."""
    cache = session.new_cache(rows)
    out: dict[int, list[np.ndarray]] = {}
    for op, *args in plan:
        if op == "prefill":
            out.setdefault(args[0], []).append(session.prefill(cache, args[0], args[1]))
        elif op == "step":
            for r, logp in zip(args[0], session.decode(cache, args[0], args[1])):
                out.setdefault(r, []).append(logp)
        else:
            cache.release(args[0], 0)
    return out


def _same(a: dict[int, list[np.ndarray]], b: dict[int, list[np.ndarray]]) -> None:
    assert a.keys() == b.keys()
    for r in a:
        assert len(a[r]) == len(b[r])
        for x, y in zip(a[r], b[r]):
            assert rel_err(x, y) < RTOL, (r, [float(rel_err(p, q)) for p, q in zip(a[r], b[r])])


def test_the_stateful_graph_is_opened_as_one(sessions) -> None:
    from cosyvoice_cpu.lm.state_graph import StateCache, StateGraph

    bound, state = sessions
    assert state.session.stateful and not bound.session.stateful
    assert isinstance(state.runner, StateGraph) and isinstance(state.new_cache(2), StateCache)
    assert state.min_rows == 1
    from cosyvoice_cpu.backends.openvino_lm import CHANNEL_WEIGHTS_GROUP

    # f32 (the only input OpenVINO's int8-activation path takes); fp32 weights: the per-channel weights' group
    compiled = list(state.runner.session._compiled.values())
    assert compiled
    for c in compiled:
        assert c.get_property("INFERENCE_PRECISION_HINT").get_type_name() == "f32"
        assert int(c.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == CHANNEL_WEIGHTS_GROUP


@pytest.mark.parametrize("weights", ["none", "int8", "int4", "int4-asym"])
def test_a_stateful_lm_runs_in_f32_with_activations_grouped_like_its_weights(
    lm_dir, weights: str, tmp_path: Path
) -> None:
    """A backend in bf16 (OpenVINO's default on CPUs with AVX-512 BF16 or AMX) still asks for the LM in f32 with an
    f32 cache; its int8 activations in the int4 weights' groups (not their asymmetric form's zero points' 1), or
    OpenVINO's default 32 for per-channel int8 and fp32 weights (docs/backends.md, "The LM on OpenVINO")."""
    import openvino

    from cosyvoice_cpu.backends.openvino import OpenVino
    from cosyvoice_cpu.backends.openvino_lm import CHANNEL_WEIGHTS_GROUP

    out, _ = lm_dir
    backend = OpenVino(cache_dir="", precision="bf16")
    model, path = backend.core().read_model(str(out / "lm.ov.xml")), tmp_path / "lm.ov.xml"
    if weights != "none":
        nncf = pytest.importorskip("nncf")
        mode = {"int8": "INT8_ASYM", "int4": "INT4_SYM", "int4-asym": "INT4_ASYM"}[weights]
        group = {} if weights == "int8" else {"group_size": 16, "ratio": 1.0}
        model = nncf.compress_weights(model, mode=getattr(nncf.CompressWeightsMode, mode), **group)
    openvino.save_model(model, path, compress_to_fp16=False)
    props = backend.open(path, SessionConfig(threads=1))._properties
    assert (props["INFERENCE_PRECISION_HINT"], props["KV_CACHE_PRECISION"]) == ("f32", "f32")
    assert props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == (16 if weights.startswith("int4") else CHANNEL_WEIGHTS_GROUP)


def test_scheduler_traffic_gives_the_bound_graphs_logp(sessions) -> None:
    """Rows join (short and long prefills beside live rows: the side request), sit steps out, leave and come back;
    every row's log-probabilities equal the bound graph's for the same script."""
    bound, state = sessions
    d, rng = bound.spec.hidden, np.random.default_rng(0)
    tok = lambda n: rng.integers(0, bound.spec.speech_vocab - 3, n).tolist()  # noqa: E731
    plan: list[tuple] = [("prefill", 0, _prompt(20, 1, d))]
    plan += [("step", [0], tok(1)) for _ in range(3)]
    plan += [("prefill", 2, _prompt(40, 2, d))]  # long, beside row 0: aside
    plan += [("step", [0, 2], tok(2)) for _ in range(4)]
    plan += [("prefill", 1, _prompt(5, 3, d))]  # short, beside two rows: in the batch
    plan += [("step", [2, 1], tok(2)) for _ in range(3)]  # row 0 idle
    plan += [("release", 0), ("step", [1, 2], tok(2)), ("prefill", 0, _prompt(9, 4, d))]
    plan += [("prefill", 2, _prompt(3, 5, d))]  # more text into a live row (a text stream)
    plan += [("step", [0, 1, 2], tok(3)) for _ in range(3)]
    _same(_script(bound, plan, 3), _script(state, plan, 3))


def test_idle_rows_are_compacted(sessions) -> None:
    """A row that sits out many steps gets a masked position at each; once the long row leaves, the state is
    compacted to the short row's real positions and goes on as the bound graph does."""
    from cosyvoice_cpu.lm.state_graph import PIECE_STEP, SLACK

    bound, state = sessions
    d = bound.spec.hidden
    plan: list[tuple] = [("prefill", 0, _prompt(6, 1, d)), ("prefill", 1, _prompt(4, 2, d))]
    plan += [("step", [0], [7 + k]) for k in range(SLACK + 16)]
    plan += [("release", 0), ("step", [1], [5]), ("step", [1], [6])]
    cache = state.new_cache(2)
    widths = []
    for op, *args in plan:
        if op == "prefill":
            state.prefill(cache, *args)
        elif op == "step":
            state.decode(cache, *args)
        else:
            cache.release(args[0], 0)
        widths.append(cache.mask.shape[1])
    # two prefills of one padded piece each, a position per step; then the short row alone, compacted
    assert max(widths) == 2 * PIECE_STEP + SLACK + 16 and widths[-1] == 6
    _same(_script(bound, plan, 2), _script(state, plan, 2))


def test_entries_read_and_written_go_on_like_the_original(sessions) -> None:
    """read/write (the prefix cache's copy out and in) between caches and rows, with other rows live."""
    _, state = sessions
    d = state.spec.hidden
    a, b = state.new_cache(1), state.new_cache(3)
    state.prefill(a, 0, _prompt(12, 1, d))
    kv = a.read(0, 12)
    assert kv.shape == (2, state.spec.num_layers, state.spec.kv_heads, 12, state.spec.head_dim)
    state.prefill(b, 0, _prompt(7, 2, d))
    b.write(2, kv)
    assert list(b.lengths) == [7, 0, 12]
    np.testing.assert_allclose(b.read(2, 12), kv, rtol=0, atol=1e-6)
    rest = _prompt(4, 3, d)
    assert rel_err(state.prefill(b, 2, rest), state.prefill(a, 0, rest)) < RTOL
    assert rel_err(state.decode(b, [2], [11])[0], state.decode(a, [0], [11])[0]) < RTOL


def test_prefix_cache_split_prefill_matches_one_call(sessions) -> None:
    from cosyvoice_cpu.lm.prefix import PrefixCache

    _, state = sessions
    embeds = _prompt(60, 9, state.spec.hidden)  # the rest beside a live row: aside, after the prefix written
    prefixes = PrefixCache(state)
    whole = state.prefill(state.new_cache(1), 0, embeds)
    for _ in range(2):  # a miss, then a hit
        cache = state.new_cache(2)
        state.prefill(cache, 1, _prompt(8, 3, state.spec.hidden))  # another row live
        prefixes.load(cache, 0, b"voice", embeds[:11])
        assert rel_err(state.prefill(cache, 0, embeds[11:]), whole) < RTOL
    assert (prefixes.hits, prefixes.misses) == (1, 1)


def test_prefill_pieces_cover_the_prompt_in_a_few_sizes() -> None:
    from cosyvoice_cpu.lm.state_graph import PIECE, PIECE_STEP, prefill_pieces

    for n in range(1, 4 * PIECE + 3):
        pieces = prefill_pieces(n)
        assert [a for a, _, _ in pieces] == [0] + [b for _, b, _ in pieces[:-1]] and pieces[-1][1] == n
        sizes = [b - a + pad for a, b, pad in pieces]
        assert all(size % PIECE_STEP == 0 and 0 < size <= PIECE for size in sizes), (n, pieces)
        assert all(pad == 0 for _, _, pad in pieces[:-1]) and pieces[-1][2] < PIECE_STEP
        assert len(pieces) == -(-n // PIECE)  # whole pieces, the padded rest last


def test_prompts_of_every_length_prefill_in_calls_of_a_few_sizes(sessions, monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenVINO keeps memory for every number of positions a call brings: prompts of every length, alone and
    beside a live row (the side request), bring only PIECE / PIECE_STEP sizes, and give the bound graph's
    log-probabilities (padding and pieces change nothing)."""
    from cosyvoice_cpu.backends.openvino import OpenVinoState
    from cosyvoice_cpu.lm.state_graph import PIECE, PIECE_STEP

    bound, state = sessions
    d, sizes = bound.spec.hidden, set()
    run = OpenVinoState.run
    monkeypatch.setattr(
        OpenVinoState, "run", lambda self, f, o: sizes.add(f["inputs_embeds"].shape[1]) or run(self, f, o)
    )
    for n in range(1, MAX_LEN - 10, 3):
        plan: list[tuple] = [
            ("prefill", 1, _prompt(6, n, d)),
            ("prefill", 0, _prompt(n, n, d)),
            ("step", [0, 1], [3, 4]),
        ]
        _same(_script(bound, plan, 2), _script(state, plan, 2))
        _same(_script(bound, plan[1:2], 1), _script(state, plan[1:2], 1))
    assert sizes <= {1} | set(range(PIECE_STEP, PIECE + 1, PIECE_STEP)), sorted(sizes)
    assert PIECE in sizes


def test_a_graph_that_gives_nan_after_padding_is_refused_at_load(lm_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    from cosyvoice_cpu.backends import registry
    from cosyvoice_cpu.backends.openvino import OpenVino, OpenVinoState
    from cosyvoice_cpu.errors import ModelDirError
    from cosyvoice_cpu.lm.session import LMSession

    run = OpenVinoState.run
    monkeypatch.setattr(OpenVinoState, "run", lambda self, f, o: [x * np.nan for x in run(self, f, o)])
    monkeypatch.setitem(registry.BACKENDS, OPENVINO, OpenVino(cache_dir="", precision="f32"))
    out, attrs = lm_dir
    with pytest.raises(ModelDirError, match="non-finite log-probabilities after masked padding"):
        LMSession.from_dir(out, attrs, graph_file="lm.ov.xml", threads=SessionConfig(threads=1, backend=OPENVINO))


def test_misuse_is_refused(sessions) -> None:
    bound, state = sessions
    d = state.spec.hidden
    with pytest.raises(ConfigError, match="keeps its cache as its state"):
        state.prefill(bound.new_cache(1), 0, _prompt(3, 1, d))
    with pytest.raises(ConfigError, match="binds its own KV buffers"):
        bound.prefill(state.new_cache(1), 0, _prompt(3, 1, d))
    cache = state.new_cache(1)
    with pytest.raises(ConfigError, match="capacity max_len"):
        state.prefill(cache, 0, _prompt(MAX_LEN + 1, 1, d))
    with pytest.raises(ConfigError, match="out of range"):
        state.decode(cache, [1], [0])
    with pytest.raises(ConfigError, match="cannot read"):
        cache.read(0, 1)


def test_weight_pages_are_given_back_after_the_first_call(lm_dir, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The first call of a compile repacks the weights; the IR's and the cache blob's pages are released then
    (once per compile), not only after the compile."""
    from cosyvoice_cpu.backends import openvino, registry
    from cosyvoice_cpu.lm.session import LMSession

    calls: list[str] = []
    monkeypatch.setattr(openvino, "release_file_pages", lambda p: calls.append(Path(p).name) or 0)
    monkeypatch.setattr(openvino, "release_dir_pages", lambda d: calls.append(f"dir {Path(d).name}") or 0)
    monkeypatch.setitem(registry.BACKENDS, OPENVINO, openvino.OpenVino(cache_dir=tmp_path / "ovc", precision="f32"))
    out, attrs = lm_dir
    session = LMSession.from_dir(out, attrs, graph_file="lm.ov.xml", threads=SessionConfig(threads=1, backend=OPENVINO))
    assert calls == ["lm.ov.bin", "lm.ov.bin", "dir ovc"]  # after the compile; after the warm-up's first call
    cache = session.new_cache(1)
    session.prefill(cache, 0, _prompt(5, 1, session.spec.hidden))
    session.decode(cache, [0], [3])
    assert len(calls) == 3
