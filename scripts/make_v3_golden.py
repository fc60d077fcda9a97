"""Golden arrays of the OFFICIAL Fun-CosyVoice3 LM and tokenizer on the tiny v3 fixture (tests/golden/v3_lm.npz).

Usage (the official code is not a dependency; extract it outside the repository first):

    mkdir -p /tmp/official && git --git-dir=<mirror of FunAudioLLM/CosyVoice> archive HEAD cosyvoice examples \
        | tar -x -C /tmp/official
    python scripts/make_v3_golden.py --official /tmp/official --out tests/golden/v3_lm.npz

Flow: our fixture writer makes the tiny v3 LM files (``cosyvoice3.yaml``, ``CosyVoice-BlankEN/``, ``llm.pt``;
deterministic for a seed) -> the official ``CosyVoice3LM`` is built from the yaml's ``llm:`` arguments
(``Qwen2Encoder`` on the BlankEN directory, ``ras_sampling`` with the yaml's settings) and loads ``llm.pt``
strictly, as ``CosyVoice3Model.load`` does; the tokenizer is the official ``get_qwen_tokenizer(version=
'cosyvoice3')`` -> fixed inputs are run through the official code and only the results are saved: arrays plus a
json ``header`` (how they were made, the official commit). Draws are injected: ``Tensor.multinomial`` is replaced
by an inverse CDF over a seeded NumPy uniform stream, which our reference replays exactly
(tests/parity/test_lm_golden_cosyvoice3.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_STRINGS = [
    "You are a helpful assistant.<|endofprompt|>",
    "Hello, this is a test of the CosyVoice text to speech engine.",
    "今天天气很好，我们一起去公园散步吧。",
    "[breath]Warning:<strong>the</strong> valve [laughter] is open.<|endofsystem|>",
    "Pronounce it [HH][AH0][L][OW1] and [j][ǐ][ǜ] please.",
    "You are a helpful assistant. 请用广东话表达。<|endofprompt|>收到请回复。",
]
ZERO_SHOT = ("You are a helpful assistant.<|endofprompt|>Good morning everyone, welcome to the factory floor.",
             "The alarm on line three is active; please check the pressure valve now.")  # fmt: skip
CROSS_LINGUAL = "You are a helpful assistant.<|endofprompt|>三号生产线温度过高，请立即检查冷却系统。"
SILENT_INPUT = [5, 1, 2, 28, 29, 55, 248, 494, 7, 2241, 2241, 2241, 2241, 2241, 2241, 2241, 9, 1, 1, 1, 1, 1, 3]
N_DECODE_STEPS = 5


@contextlib.contextmanager
def injected_draws(seed: int):
    """Replace ``torch.Tensor.multinomial`` by an inverse CDF over ``default_rng(seed).random()``."""
    import torch

    from cosyvoice_cpu.lm.sampling import inverse_cdf

    rng = np.random.default_rng(seed)
    saved = torch.Tensor.multinomial

    def multinomial(self, num_samples, replacement=False, *, generator=None):
        return torch.tensor([inverse_cdf(self.detach().numpy(), float(rng.random()))])

    torch.Tensor.multinomial = multinomial
    try:
        yield
    finally:
        torch.Tensor.multinomial = saved


def build_official(official: Path, model_dir: Path):
    """(official CosyVoice3LM with llm.pt loaded, official tokenizer, official module of cli/model.py)."""
    sys.path.insert(0, str(official))
    from cosyvoice_cpu.reference.official import install_torchaudio_stub

    install_torchaudio_stub()
    import cosyvoice
    import torch

    if not Path(cosyvoice.__file__).resolve().is_relative_to(official.resolve()):
        raise SystemExit(f"imported cosyvoice from {cosyvoice.__file__}, not from {official}")
    from cosyvoice.cli import model as cli_model
    from cosyvoice.llm.llm import CosyVoice3LM, Qwen2Encoder
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer
    from cosyvoice.utils.common import ras_sampling

    from cosyvoice_cpu.reference.yamlconf import load_yaml_data

    blank = model_dir / "CosyVoice-BlankEN"
    node = load_yaml_data(model_dir / "cosyvoice3.yaml", overrides={"qwen_pretrain_path": str(blank)})["llm"]
    args = {k: v for k, v in node.args.items() if k not in ("llm", "sampling")}
    sampling = functools.partial(ras_sampling, **node.args["sampling"].args)
    lm = CosyVoice3LM(**args, llm=Qwen2Encoder(str(blank)), sampling=sampling)
    lm.load_state_dict(torch.load(model_dir / "llm.pt", map_location="cpu", weights_only=True), strict=True)
    tokenizer = get_qwen_tokenizer(token_path=str(blank), skip_special_tokens=True, version="cosyvoice3")
    return lm.eval(), tokenizer, cli_model


def official_lm_input(lm, text, prompt_text, prompt_speech):
    """The official ``inference`` up to the decode loop: (lm_input (1, T, D), min_len, max_len)."""
    import torch

    seen = {}

    def spy(lm_input, sampling, min_len, max_len, uuid):
        seen.update(lm_input=lm_input, min_len=min_len, max_len=max_len)
        return iter(())

    lm.inference_wrapper = spy
    try:
        n = lambda t: torch.tensor([t.shape[1]], dtype=torch.int32)  # noqa: E731
        list(lm.inference(text, n(text), prompt_text, n(prompt_text), prompt_speech, n(prompt_speech),
                          torch.zeros(0, 192)))  # fmt: skip
    finally:
        del lm.inference_wrapper
    return seen["lm_input"], seen["min_len"], seen["max_len"]


def official_logps(lm, lm_input, steps):
    """Log-probs after the prefill and after feeding each of ``steps``, via ``forward_one_step`` -> (1+K, S+200)."""
    import torch

    n = lm_input.shape[1]
    with torch.inference_mode():
        hidden, cache = lm.llm.forward_one_step(lm_input, masks=torch.tril(torch.ones(1, n, n)).bool(), cache=None)
        out = [lm.llm_decoder(hidden[:, -1]).log_softmax(-1)[0]]
        for tok in steps:
            n += 1
            x = lm.speech_embedding.weight[tok].view(1, 1, -1)
            hidden, cache = lm.llm.forward_one_step(x, masks=torch.tril(torch.ones(1, n, n)).bool(), cache=cache)
            out.append(lm.llm_decoder(hidden[:, -1]).log_softmax(-1)[0])
    return torch.stack(out).numpy().astype(np.float32)


def official_decode(lm, text, prompt_text, prompt_speech, draw_seed):
    import torch

    n = lambda t: torch.tensor([t.shape[1]], dtype=torch.int32)  # noqa: E731
    with injected_draws(draw_seed):
        gen = lm.inference(text, n(text), prompt_text, n(prompt_text), prompt_speech, n(prompt_speech),
                           torch.zeros(0, 192))  # fmt: skip
        return [int(t) for t in gen]


def official_silent_filter(cli_model, tokens):
    """The official ``CosyVoice3Model.llm_job`` on an LM that yields ``tokens``: what reaches the flow."""
    import torch

    m = cli_model.CosyVoice3Model.__new__(cli_model.CosyVoice3Model)
    m.device, m.fp16, m.llm_context = torch.device("cpu"), False, contextlib.nullcontext()
    m.silent_tokens = [1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323]  # as CosyVoice3Model.__init__ sets
    m.tts_speech_token_dict, m.llm_end_dict = {"u": []}, {}

    class FakeLM:
        def inference(self, **_):
            yield from tokens

    m.llm = FakeLM()
    empty = torch.zeros(1, 0, dtype=torch.int32)
    m.llm_job(empty, empty, empty, torch.zeros(0, 192), "u")
    return m.tts_speech_token_dict["u"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--official", type=Path, required=True, help="extracted official code (holds cosyvoice/)")
    ap.add_argument("--out", type=Path, default=ROOT / "tests/golden/v3_lm.npz")
    ap.add_argument("--seed", type=int, default=0, help="fixture seed")
    ap.add_argument("--mirror", default="/work/.mirror/FunAudioLLM+CosyVoice/repo", help="git dir, for the commit")
    args = ap.parse_args()

    import torch
    import transformers

    from cosyvoice_cpu.fixtures.weights.cosyvoice3 import write_cosyvoice3_lm_files

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="v3golden."))
    write_cosyvoice3_lm_files(tmp, "tiny", args.seed)
    lm, tok, cli_model = build_official(args.official, tmp)
    arrays: dict[str, np.ndarray] = {}

    specials = tok.special_tokens["additional_special_tokens"]
    arrays["special_ids"] = np.array(tok.tokenizer.convert_tokens_to_ids(specials), dtype=np.int64)
    ids = [tok.encode(s) for s in TOKENIZER_STRINGS]
    arrays["tokenizer_ids"] = np.array([i for x in ids for i in x], dtype=np.int64)
    arrays["tokenizer_lens"] = np.array([len(x) for x in ids], dtype=np.int64)

    rng = np.random.default_rng(1234)
    as_t = lambda x: torch.tensor([x], dtype=torch.int32)  # noqa: E731
    prompt_text, text = as_t(tok.encode(ZERO_SHOT[0])), as_t(tok.encode(ZERO_SHOT[1]))
    prompt_speech = as_t(rng.integers(0, 6561, 12).tolist())
    lm_input, min_len, max_len = official_lm_input(lm, text, prompt_text, prompt_speech)
    steps = [int(x) for x in rng.integers(0, 6561, N_DECODE_STEPS)]
    arrays.update(zs_prompt_text=prompt_text[0].numpy(), zs_text=text[0].numpy(),
                  zs_prompt_speech=prompt_speech[0].numpy(), zs_embeds=lm_input[0].numpy(),
                  zs_steps=np.array(steps), zs_logp=official_logps(lm, lm_input, steps))  # fmt: skip

    cl_text, none = as_t(tok.encode(CROSS_LINGUAL)), torch.zeros(1, 0, dtype=torch.int32)
    arrays["cl_text"] = cl_text[0].numpy()
    decodes = {}
    for case, (t, pt, ps) in {"zs": (text, prompt_text, prompt_speech), "cl": (cl_text, none, none)}.items():
        lengths = {}
        for draw_seed in range(40):  # keep the first two seeds whose decode runs past 15 tokens
            toks = official_decode(lm, t, pt, ps, draw_seed)
            lengths[draw_seed] = len(toks)
            if len(toks) > 15:
                arrays[f"{case}_decode_{len([k for k in decodes if k.startswith(case)])}"] = np.array(toks)
                decodes[f"{case}_{draw_seed}"] = len(toks)
                if sum(k.startswith(case) for k in decodes) == 2:
                    break
        decodes[f"{case}_first_40_lengths"] = lengths
    try:
        list(lm.inference(as_t(tok.encode("no marker")), torch.tensor([2]), none, torch.tensor([0]), none,
                          torch.tensor([0]), torch.zeros(0, 192)))  # fmt: skip
        endofprompt_asserts = False
    except AssertionError:
        endofprompt_asserts = True
    arrays["silent_input"] = np.array(SILENT_INPUT)
    arrays["silent_output"] = np.array(official_silent_filter(cli_model, SILENT_INPUT))

    commit = subprocess.run(["git", f"--git-dir={args.mirror}", "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    header = {
        "produced_by": "scripts/make_v3_golden.py: official cosyvoice.llm.llm.CosyVoice3LM + get_qwen_tokenizer("
        "version='cosyvoice3') on the tiny v3 fixture (fixtures/weights/cosyvoice3.write_cosyvoice3_lm_files)",
        "official_commit": commit,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "fixture": {"size": "tiny", "seed": args.seed},
        "weights_fingerprint": {k: float(v.double().abs().sum()) for k, v in lm.state_dict().items()},
        "tokenizer_strings": TOKENIZER_STRINGS,
        "special_tokens": specials,
        "zero_shot": list(ZERO_SHOT),
        "cross_lingual": CROSS_LINGUAL,
        "zs_min_len": int(min_len),
        "zs_max_len": int(max_len),
        "draws": "Tensor.multinomial -> inverse CDF (cosyvoice_cpu.lm.sampling.inverse_cdf) at "
        "numpy default_rng(draw_seed).random(); <case>_decode_<i> uses draw seed decode_seeds[<case>][i]",
        "decode_seeds": {
            c: [int(k.split("_")[1]) for k in decodes if k.startswith(c + "_") and "first" not in k]
            for c in ("zs", "cl")
        },
        "decode_info": decodes,
        "endofprompt_asserts": endofprompt_asserts,
    }
    arrays["header"] = np.array(json.dumps(header, ensure_ascii=False))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e3:.0f} kB): decodes {decodes}")


if __name__ == "__main__":
    main()
