"""Golden arrays of the official Fun-CosyVoice3 flow (DiT) and causal HiFT, for
tests/parity/test_flow_golden_cosyvoice3.py.

    python scripts/make_v3_flow_golden.py --official /tmp/official_flow --out tests/golden/v3_flow.npz

``--official`` is a checkout (or ``git archive``) of FunAudioLLM/CosyVoice holding ``cosyvoice/``; its commit is
read from ``--commit`` or the checkout's git. Needs torch, einops, x-transformers, omegaconf, matcha (the
``token2wav-cosyvoice`` install), scipy. The official code is only *run* here; nothing of it is stored.

What it does: builds the official ``DiT``, ``CausalConditionalCFM``, ``PreLookaheadLayer``,
``CausalMaskedDiffWithDiT``, ``CausalConvRNNF0Predictor`` and ``CausalHiFTGenerator`` with the tiny
configurations below, gives every parameter seeded random values (scaled so activations stay O(1) and the F0
lands in the voiced range), pins the causal HiFT's random tables to small seeded ones, and saves

* ``flow/<key>``, ``hift/<key>``: the state dicts (HiFT with weight norm as parametrizations, like the release);
* ``est/*``: estimator inputs and outputs at batch 2 with a CFG row (zero mu/spks/cond) and a padded row, full
  and chunk-causal masks;
* ``flow_in/*``, ``flow_out/*``: ``inference`` with and without prompt, non-streaming and streaming, and a
  non-final streaming chunk (``finalize=False``), plus the look-ahead layer's ``mu``;
* ``hift_noise/*``: the pinned tables; ``hift_in/*``, ``hift_out/*``: F0, source and wave with ``finalize`` True
  (batch 2) and False;
* ``header``: a JSON string (provenance, versions, configurations as yaml-like nodes, seeds).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

SEED = 1234
NOISE_SEED = 4321
T_EST = 21  # estimator frames (not a multiple of the chunk)

# yaml-like nodes: {"__target__": dotted class, **arguments}; tests turn them into yamlconf.Tagged records
DIT = {
    "__target__": "cosyvoice.flow.DiT.dit.DiT",
    "dim": 32, "depth": 2, "heads": 2, "dim_head": 16, "ff_mult": 2, "mel_dim": 80, "mu_dim": 80,
    "spk_dim": 80, "out_channels": 80, "static_chunk_size": 8, "num_decoding_left_chunks": -1,
}  # fmt: skip
CFM_PARAMS = {
    "sigma_min": 1e-06, "solver": "euler", "t_scheduler": "cosine", "training_cfg_rate": 0.2,
    "inference_cfg_rate": 0.7, "reg_loss_type": "l1",
}  # fmt: skip
FLOW = {
    "__target__": "cosyvoice.flow.flow.CausalMaskedDiffWithDiT",
    "input_size": 80, "output_size": 80, "spk_embed_dim": 192, "output_type": "mel", "vocab_size": 40,
    "input_frame_rate": 25, "only_mask_loss": True, "token_mel_ratio": 2, "pre_lookahead_len": 3,
    "pre_lookahead_layer": {
        "__target__": "cosyvoice.transformer.upsample_encoder.PreLookaheadLayer",
        "in_channels": 80, "channels": 16, "pre_lookahead_len": 3,
    },
    "decoder": {
        "__target__": "cosyvoice.flow.flow_matching.CausalConditionalCFM",
        "in_channels": 240, "n_spks": 1, "spk_emb_dim": 80,
        "cfm_params": {"__target__": "omegaconf.DictConfig", "content": CFM_PARAMS},
        "estimator": DIT,
    },
}  # fmt: skip
HIFT = {
    "__target__": "cosyvoice.hifigan.generator.CausalHiFTGenerator",
    "in_channels": 80, "base_channels": 16, "nb_harmonics": 8, "sampling_rate": 24000, "nsf_alpha": 0.1,
    "nsf_sigma": 0.003, "nsf_voiced_threshold": 10, "upsample_rates": [4, 3], "upsample_kernel_sizes": [8, 5],
    "istft_params": {"n_fft": 16, "hop_len": 4}, "resblock_kernel_sizes": [3, 5],
    "resblock_dilation_sizes": [[1, 3], [1, 3]], "source_resblock_kernel_sizes": [5, 7],
    "source_resblock_dilation_sizes": [[1, 3], [1, 3]], "lrelu_slope": 0.1, "audio_limit": 0.99,
    "conv_pre_look_right": 4,
    "f0_predictor": {
        "__target__": "cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor",
        "num_class": 1, "in_channels": 80, "cond_channels": 16,
    },
}  # fmt: skip
HIFT_FRAMES = 20
F0_BIAS = 120.0  # classifier bias: F0 around 120 Hz, mostly voiced (threshold 10 Hz)
POST_GAIN, POST_LOG_MAG = 0.3, -3.0  # conv_post: keep |wave| well below the 0.99 clamp


def build(node, modules):
    """Instantiate a yaml-like node with the official classes (inner nodes first, like HyperPyYAML)."""
    from omegaconf import DictConfig

    args = {k: build(v, modules) if isinstance(v, dict) and "__target__" in v else v for k, v in node.items()}
    target = args.pop("__target__")
    if target == "omegaconf.DictConfig":
        return DictConfig(args["content"])
    return modules[target](**args)


def randomise(module, gen, scale=1.0) -> None:
    """Seeded values for every parameter: weights ~ N(0, 1/fan_in) * scale, vectors ~ 0.1 N(0, 1); weight-norm
    gains and Snake alphas positive."""
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters():
            draw = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("original0") or name.endswith(".alpha"):
                p.copy_(1.0 + 0.2 * draw.abs())  # weight-norm g / Snake alpha
            elif p.dim() >= 2:
                p.copy_(draw * scale / p[0].numel() ** 0.5)
            else:
                p.copy_(0.1 * draw)


def official_modules(official: Path) -> dict:
    sys.path.insert(0, str(official))
    from cosyvoice_cpu.reference.official import install_torchaudio_stub

    install_torchaudio_stub()
    import cosyvoice

    if not str(Path(cosyvoice.__file__).resolve()).startswith(str(official.resolve())):
        raise SystemExit(f"imported cosyvoice from {cosyvoice.__file__}, not from {official}")
    from cosyvoice.flow.DiT.dit import DiT
    from cosyvoice.flow.flow import CausalMaskedDiffWithDiT
    from cosyvoice.flow.flow_matching import CausalConditionalCFM
    from cosyvoice.hifigan.f0_predictor import CausalConvRNNF0Predictor
    from cosyvoice.hifigan.generator import CausalHiFTGenerator
    from cosyvoice.transformer.upsample_encoder import PreLookaheadLayer

    classes = (DiT, CausalMaskedDiffWithDiT, CausalConditionalCFM, CausalConvRNNF0Predictor, CausalHiFTGenerator,
               PreLookaheadLayer)  # fmt: skip
    return {f"{c.__module__}.{c.__name__}": c for c in classes}


def flow_goldens(flow, gen, out: dict) -> None:
    import torch

    est = flow.decoder.estimator
    # estimator, batch 2: row 0 conditioned, row 1 the CFG row (mu = spks = cond = 0) with the last 4 frames padded
    x = torch.randn(1, 80, T_EST, generator=gen).repeat(2, 1, 1)
    mu = torch.cat([torch.randn(1, 80, T_EST, generator=gen), torch.zeros(1, 80, T_EST)])
    cond = torch.cat([torch.randn(1, 80, T_EST, generator=gen), torch.zeros(1, 80, T_EST)])
    spks = torch.cat([torch.randn(1, 80, generator=gen), torch.zeros(1, 80)])
    mask = torch.ones(2, 1, T_EST)
    mask[1, :, -4:] = 0
    t = torch.tensor([0.3, 0.3])
    est_in = {"x": x, "mask": mask, "mu": mu, "t": t, "spks": spks, "cond": cond}
    out.update({f"est/{k}": v for k, v in est_in.items()})
    for name, streaming in (("full", False), ("chunk", True)):
        out[f"est/out_{name}"] = est(x, mask, mu, t, spks, cond, streaming=streaming)

    token = torch.randint(0, FLOW["vocab_size"], (1, 12), generator=gen, dtype=torch.int32)
    prompt_token = torch.randint(0, FLOW["vocab_size"], (1, 5), generator=gen, dtype=torch.int32)
    prompt_feat = torch.randn(1, 10, 80, generator=gen)
    embedding = torch.randn(1, 192, generator=gen)
    out.update({"flow_in/token": token, "flow_in/prompt_token": prompt_token, "flow_in/prompt_feat": prompt_feat,
                "flow_in/embedding": embedding})  # fmt: skip

    def run(tok, p_tok, p_feat, streaming, finalize):
        n = lambda a: torch.tensor([a.shape[1]], dtype=torch.int32)  # noqa: E731
        mel, _ = flow.inference(tok, n(tok), p_tok, n(p_tok), p_feat, n(p_feat), embedding, streaming, finalize)
        return mel

    no_tok, no_feat = torch.zeros(1, 0, dtype=torch.int32), torch.zeros(1, 0, 80)
    out["flow_out/prompt"] = run(token, prompt_token, prompt_feat, False, True)
    out["flow_out/no_prompt"] = run(token, no_tok, no_feat, False, True)
    out["flow_out/stream_final"] = run(token, prompt_token, prompt_feat, True, True)
    out["flow_out/stream_chunk"] = run(token[:, :7], prompt_token, prompt_feat, True, False)
    with torch.inference_mode():  # mu of the prompt case, from the official layers
        all_tok = torch.cat([prompt_token, token], dim=1)
        h = flow.pre_lookahead_layer(flow.input_embedding(all_tok.long()))
        out["flow_out/mu"] = h.repeat_interleave(2, dim=1).transpose(1, 2)


def hift_goldens(hift, gen, out: dict) -> None:
    import torch

    up = int(np.prod(HIFT["upsample_rates"])) * HIFT["istft_params"]["hop_len"]
    noise_gen = torch.Generator().manual_seed(NOISE_SEED)
    rand_ini = torch.rand(1, 9, generator=noise_gen)
    rand_ini[:, 0] = 0
    sine_waves = torch.rand(1, HIFT_FRAMES * up, 9, generator=noise_gen)
    hift.m_source.l_sin_gen.rand_ini = rand_ini
    hift.m_source.l_sin_gen.sine_waves = sine_waves
    hift.m_source.uv = torch.zeros(1, HIFT_FRAMES * up, 1)  # the unused noise branch
    out["hift_noise/rand_ini"], out["hift_noise/sine_waves"] = rand_ini, sine_waves

    mel = torch.randn(2, 80, HIFT_FRAMES, generator=gen) * 1.5 - 4.0
    out["hift_in/mel"] = mel
    wave, source = hift.inference(mel, finalize=True)
    with torch.inference_mode():
        f0 = hift.f0_predictor(mel.double(), finalize=True)
    out.update({"hift_out/f0": f0, "hift_out/source": source, "hift_out/wave": wave})
    part = mel[:1, :, :16]
    wave_c, source_c = hift.inference(part, finalize=False)
    with torch.inference_mode():
        f0_c = hift.f0_predictor(part.double(), finalize=False)
    out.update({"hift_out/f0_chunk": f0_c, "hift_out/source_chunk": source_c, "hift_out/wave_chunk": wave_c})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--official", type=Path, required=True, help="directory holding the official cosyvoice/")
    parser.add_argument("--out", type=Path, default=Path("tests/golden/v3_flow.npz"))
    parser.add_argument("--commit", default=None, help="official commit (default: git rev-parse in --official)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import torch
    import x_transformers

    torch.set_num_threads(1)
    modules = official_modules(args.official)
    commit = args.commit
    if commit is None:
        r = subprocess.run(["git", "-C", str(args.official), "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = r.stdout.strip() or "unknown"

    flow = build(FLOW, modules).eval()  # CausalConditionalCFM seeds the global RNGs with 0 here
    hift = build(HIFT, modules).eval()
    gen = torch.Generator().manual_seed(SEED)
    randomise(flow, gen)
    randomise(hift, gen)
    with torch.no_grad():
        hift.f0_predictor.classifier.bias.fill_(F0_BIAS)
        hift.conv_post.parametrizations.weight.original0.mul_(POST_GAIN)  # small log-magnitudes: no clipping
        hift.conv_post.bias[: HIFT["istft_params"]["n_fft"] // 2 + 1].fill_(POST_LOG_MAG)
    out: dict = {}
    out.update({f"flow/{k}": v for k, v in flow.state_dict().items()})
    out.update({f"hift/{k}": v for k, v in hift.state_dict().items()})  # before inference casts F0 to float64

    flow_goldens(flow, gen, out)
    hift_goldens(hift, gen, out)

    header = {
        "produced_by": "scripts/make_v3_flow_golden.py (runs the official code; stores only arrays)",
        "official_repo": "FunAudioLLM/CosyVoice",
        "official_commit": commit,
        "torch": torch.__version__,
        "x_transformers": getattr(x_transformers, "__version__", "2.11.24"),
        "seed": SEED,
        "noise_seed": NOISE_SEED,
        "f0_bias": F0_BIAS,
        "conv_post_gain_and_log_magnitude_bias": [POST_GAIN, POST_LOG_MAG],
        "flow": FLOW,
        "hift": HIFT,
        "notes": "flow noise = the official CausalConditionalCFM fixed noise (seed 0, randn(1, 80, 15000)); HiFT "
        "tables pinned to hift_noise/*; estimator row 1 is the CFG row with its last 4 frames padded",
    }
    arrays = {k: (v.detach().numpy() if hasattr(v, "detach") else np.asarray(v)) for k, v in out.items()}
    arrays["header"] = np.array(json.dumps(header))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    logger.info("wrote %s: %d arrays, %.0f kB, official %s", args.out, len(arrays), args.out.stat().st_size / 1e3,
                commit)  # fmt: skip


if __name__ == "__main__":
    main()
