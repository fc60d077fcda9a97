"""Golden tokens of the OFFICIAL ``inference_bistream`` (text streamed into the LM) on the tiny CosyVoice2 and
Fun-CosyVoice3 fixtures (tests/golden/bistream.npz).

Usage (the official code is not a dependency; extract it outside the repository first):

    mkdir -p /tmp/official && git --git-dir=<mirror of FunAudioLLM/CosyVoice> archive HEAD cosyvoice examples \
        | tar -x -C /tmp/official
    python scripts/make_bistream_golden.py --official /tmp/official

Per family: our fixture writer makes the tiny model directory (deterministic for a seed); the official LM class
(``Qwen2LM`` / ``CosyVoice3LM``) is built from the yaml's ``llm:`` arguments and loads ``llm.pt`` strictly; each
case's text ids are fed as a generator of pieces, draws injected as in scripts/make_v3_golden.py (an inverse CDF at
``numpy default_rng(draw_seed).random()``), and the yielded speech tokens are saved (at most ``MAX_TOKENS``: the
official loop has no length limit, and a random LM may not say EOS soon). tests/parity/test_bistream_golden.py
replays the same pieces and draws through the runtime (an fp32 export of the same fixture).
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

MAX_TOKENS = 200
TRANSCRIPT = "Good morning everyone, welcome to the factory floor."
TEXT = (
    "The alarm on line three is active; please check the pressure valve now. "
    "Then call the supervisor and wait by the door."
)
PIECE_SIZES = (1, 2, 1, 3, 1, 1, 2, 4)  # text ids per piece, cycled: an LLM writing a few tokens at a time
SYSTEM = "You are a helpful assistant.<|endofprompt|>"


def pieces(ids: list[int], sizes: tuple[int, ...]) -> list[list[int]]:
    """``ids`` cut into consecutive pieces of ``sizes`` (cycled)."""
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(ids[i : i + n])
        i, k = i + n, k + 1
    return out


def build_official(family: str, model_dir: Path):
    """(official LM with llm.pt loaded, official tokenizer)."""
    import torch
    from cosyvoice.llm.llm import CosyVoice3LM, Qwen2Encoder, Qwen2LM
    from cosyvoice.tokenizer.tokenizer import get_qwen_tokenizer
    from cosyvoice.utils.common import ras_sampling

    from cosyvoice_cpu.reference.yamlconf import load_yaml_data

    blank = model_dir / "CosyVoice-BlankEN"
    node = load_yaml_data(model_dir / f"{family}.yaml", overrides={"qwen_pretrain_path": str(blank)})["llm"]
    args = {k: v for k, v in node.args.items() if k not in ("llm", "sampling")}
    sampling = functools.partial(ras_sampling, **node.args["sampling"].args)
    cls = CosyVoice3LM if family == "cosyvoice3" else Qwen2LM
    lm = cls(**args, llm=Qwen2Encoder(str(blank)), sampling=sampling)
    lm.load_state_dict(torch.load(model_dir / "llm.pt", map_location="cpu", weights_only=True), strict=True)
    version = "cosyvoice3" if family == "cosyvoice3" else "cosyvoice2"
    return lm.eval(), get_qwen_tokenizer(token_path=str(blank), skip_special_tokens=True, version=version)


def official_bistream(lm, text_pieces, prompt_text, prompt_speech, draw_seed: int) -> tuple[list[int], bool]:
    """(the tokens yielded, whether the official loop raised: a special token other than fill/EOS sampled)."""
    import torch
    from make_v3_golden import injected_draws

    as_t = lambda x: torch.tensor([x], dtype=torch.int32)  # noqa: E731
    pt, ps = as_t(prompt_text), as_t(prompt_speech)
    n = lambda t: torch.tensor([t.shape[1]], dtype=torch.int32)  # noqa: E731
    out: list[int] = []
    with injected_draws(draw_seed), torch.inference_mode():
        gen = lm.inference_bistream((as_t(p) for p in text_pieces), pt, n(pt), ps, n(ps), torch.zeros(0, 192))
        try:
            for token in gen:
                out.append(int(token))
                if len(out) >= MAX_TOKENS:
                    break
        except ValueError:  # 'should not get token ...': the runtime ends the speech there instead
            return out, True
    return out, False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--official", type=Path, required=True, help="extracted official code (holds cosyvoice/)")
    ap.add_argument("--out", type=Path, default=ROOT / "tests/golden/bistream.npz")
    ap.add_argument("--mirror", default="/work/.mirror/FunAudioLLM+CosyVoice/repo", help="git dir, for the commit")
    args = ap.parse_args()
    sys.path.insert(0, str(args.official))
    from cosyvoice_cpu.reference.official import install_torchaudio_stub

    install_torchaudio_stub()
    import cosyvoice
    import torch
    import transformers

    if not Path(cosyvoice.__file__).resolve().is_relative_to(args.official.resolve()):
        raise SystemExit(f"imported cosyvoice from {cosyvoice.__file__}, not from {args.official}")
    from cosyvoice_cpu.workshop.fixture_writer import FixtureSpec, write_fixture

    torch.set_num_threads(1)
    arrays: dict[str, np.ndarray] = {}
    cases: dict[str, dict] = {}
    rng = np.random.default_rng(7)
    for family in ("cosyvoice2", "cosyvoice3"):
        d = write_fixture(FixtureSpec(family, "tiny", 0), Path(tempfile.mkdtemp(prefix="bistream.")) / family)
        lm, tok = build_official(family, d)
        system = SYSTEM if family == "cosyvoice3" else ""
        text = tok.encode(TEXT)
        speech = [int(x) for x in rng.integers(0, 6561, 40)]
        inputs = {
            "zero_shot": (tok.encode(system + TRANSCRIPT), speech, pieces(text, PIECE_SIZES)),
            "cross_lingual": (tok.encode(system) if system else [], [], pieces(text, PIECE_SIZES)),
            "sentences": (tok.encode(system + TRANSCRIPT), speech[:25], pieces(text, (17, 100))),
        }
        for case, (prompt_text, prompt_speech, text_pieces) in inputs.items():
            key = f"{family}_{case}"
            for draw_seed in range(20):  # the first seed whose stream runs past 30 tokens
                tokens, raised = official_bistream(lm, text_pieces, prompt_text, prompt_speech, draw_seed)
                if len(tokens) > 30:
                    break
            arrays[f"{key}_tokens"] = np.array(tokens, np.int64)
            arrays[f"{key}_prompt_text"] = np.array(prompt_text, np.int64)
            arrays[f"{key}_prompt_speech"] = np.array(prompt_speech, np.int64)
            arrays[f"{key}_pieces"] = np.array([i for p in text_pieces for i in p], np.int64)
            arrays[f"{key}_piece_lens"] = np.array([len(p) for p in text_pieces], np.int64)
            cases[key] = {
                "draw_seed": draw_seed,
                "tokens": len(tokens),
                "truncated": len(tokens) >= MAX_TOKENS,
                "raised": raised,
            }
            print(key, cases[key])
    commit = subprocess.run(
        ["git", f"--git-dir={args.mirror}", "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    header = {
        "produced_by": "scripts/make_bistream_golden.py: official Qwen2LM / CosyVoice3LM.inference_bistream on the "
        "tiny fixtures (cosyvoice_cpu.workshop.fixture_writer.write_fixture(FixtureSpec(family, 'tiny', 0)))",
        "official_commit": commit,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "max_tokens": MAX_TOKENS,
        "draws": "Tensor.multinomial -> inverse CDF at numpy default_rng(draw_seed).random()",
        "cases": cases,
    }
    arrays["header"] = np.array(json.dumps(header))
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
