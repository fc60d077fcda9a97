"""Parity of our CosyVoice2 flow reference (``cosyvoice_cpu.reference.flow.cosyvoice2``) with the official code.

The official ``CausalMaskedDiffWithXvec`` is built directly with a tiny config (the encoder width stays 512:
the official ``PreLookaheadLayer`` and ``Upsample1D`` hard-code 512 channels), every parameter is perturbed
so nothing sits at an init identity, and its ``state_dict`` is loaded into ours with ``strict=True``.
Errors are relative: ``max|ours - official| / max|official|``.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.reference.flow.cfm import NOISE_FRAMES, official_fixed_noise
from cosyvoice_cpu.reference.flow.cosyvoice2 import Flow, FlowConfig, FlowEncoderConfig, FlowEstimatorConfig
from cosyvoice_cpu.reference.yamlconf import load_yaml_data
from tests.parity.official import official, rel_err

pytestmark = pytest.mark.parity

# Measured on CPU fp32 (torch 2.13, 2 threads), relative error over the runs:
ENCODER_RTOL = 1e-5  # mu after encoder_proj: 2.3e-7 .. 2.9e-7 (full/chunk, final/non-final); spks: 0
ESTIMATOR_RTOL = 1e-6  # 0 (bitwise equal), full and chunk masks, batch 2 with a padded row
CFM_RTOL = 1e-6  # 0 (bitwise equal) given the same mu: fixed and injected noise, both masks, 4 steps/cfg 0.3
INFERENCE_RTOL = 1e-5  # 3.6e-7 .. 5.8e-7 (the encoder's rounding carried through 10 Euler steps)

N_PROMPT, N_TOKENS = 20, 30  # 50 tokens = 2 encoder chunks of 25; 100 frames = 2 decoder chunks of 50


def _official_flow() -> torch.nn.Module:
    flow_mod = official("cosyvoice.flow.flow")
    enc_mod = official("cosyvoice.transformer.upsample_encoder")
    cfm_mod = official("cosyvoice.flow.flow_matching")
    dec_mod = official("cosyvoice.flow.decoder")
    from omegaconf import DictConfig

    encoder = enc_mod.UpsampleConformerEncoder(
        input_size=512,
        output_size=512,
        attention_heads=2,
        linear_units=128,
        num_blocks=2,
        dropout_rate=0.1,
        positional_dropout_rate=0.1,
        attention_dropout_rate=0.1,
        normalize_before=True,
        input_layer="linear",
        pos_enc_layer_type="rel_pos_espnet",
        selfattention_layer_type="rel_selfattn",
        use_cnn_module=False,
        macaron_style=False,
        use_dynamic_chunk=True,
        static_chunk_size=25,
    )
    estimator = dec_mod.CausalConditionalDecoder(
        in_channels=320,
        out_channels=80,
        channels=[64],
        dropout=0.0,
        attention_head_dim=32,
        n_blocks=1,
        num_mid_blocks=2,
        num_heads=2,
        act_fn="gelu",
        static_chunk_size=50,
        num_decoding_left_chunks=-1,
    )
    cfm_params = DictConfig(
        {
            "sigma_min": 1e-06,
            "solver": "euler",
            "t_scheduler": "cosine",
            "training_cfg_rate": 0.2,
            "inference_cfg_rate": 0.7,
            "reg_loss_type": "l1",
        }
    )
    decoder = cfm_mod.CausalConditionalCFM(
        in_channels=240, cfm_params=cfm_params, n_spks=1, spk_emb_dim=80, estimator=estimator
    )
    flow = flow_mod.CausalMaskedDiffWithXvec(
        input_size=512,
        output_size=80,
        spk_embed_dim=192,
        output_type="mel",
        vocab_size=6561,
        input_frame_rate=25,
        only_mask_loss=True,
        token_mel_ratio=2,
        pre_lookahead_len=3,
        encoder=encoder,
        decoder=decoder,
    )
    torch.manual_seed(1234)
    with torch.no_grad():
        for p in flow.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return flow.eval()


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, Flow]:
    off = _official_flow()
    cfg = FlowConfig(
        encoder=FlowEncoderConfig(attention_heads=2, linear_units=128, num_blocks=2),
        estimator=FlowEstimatorConfig(channels=(64,), attention_head_dim=32, n_blocks=1, num_mid_blocks=2, num_heads=2),
    )
    ours = Flow(cfg)
    ours.load_state_dict(off.state_dict(), strict=True)
    return off, ours.eval()


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "token": torch.randint(0, 6561, (1, N_TOKENS), generator=g),
        "token_len": torch.tensor([N_TOKENS]),
        "prompt_token": torch.randint(0, 6561, (1, N_PROMPT), generator=g),
        "prompt_token_len": torch.tensor([N_PROMPT]),
        "prompt_feat": torch.randn(1, 2 * N_PROMPT, 80, generator=g),
        "prompt_feat_len": torch.tensor([2 * N_PROMPT]),
        "embedding": torch.randn(1, 192, generator=g),
    }


def _official_mu(off, inp, streaming: bool, finalize: bool) -> torch.Tensor:
    """The encoder half of the official ``inference``, step by step: (1, 80, T_mel)."""
    token = torch.cat([inp["prompt_token"], inp["token"]], dim=1)
    token_len = inp["prompt_token_len"] + inp["token_len"]
    xs = off.input_embedding(token.clamp(min=0))
    if finalize:
        h, _ = off.encoder(xs, token_len, streaming=streaming)
    else:
        h, _ = off.encoder(xs[:, :-3], token_len, context=xs[:, -3:], streaming=streaming)
    return off.encoder_proj(h).transpose(1, 2)


@pytest.mark.parametrize(("streaming", "finalize"), [(False, True), (True, True), (False, False), (True, False)])
@torch.inference_mode()
def test_encoder(models, inputs, streaming: bool, finalize: bool) -> None:
    off, ours = models
    ref = _official_mu(off, inputs, streaming, finalize)
    c = ours.encode(
        inputs["token"],
        inputs["token_len"],
        inputs["prompt_token"],
        inputs["prompt_token_len"],
        inputs["prompt_feat"],
        inputs["embedding"],
        finalize=finalize,
        streaming=streaming,
    )
    assert rel_err(c.mu, ref) <= ENCODER_RTOL
    assert c.mel_len1 == 2 * N_PROMPT and c.mel_len2 == 2 * N_TOKENS - (0 if finalize else 6)
    spks_ref = off.spk_embed_affine_layer(F.normalize(inputs["embedding"], dim=1))
    assert rel_err(c.spks, spks_ref) <= ENCODER_RTOL


@torch.inference_mode()
def test_streaming_mask_changes_encoder(models, inputs) -> None:
    """Guard against a vacuous test: the chunk mask must actually change the output."""
    off, _ = models
    assert rel_err(_official_mu(off, inputs, True, True), _official_mu(off, inputs, False, True)) > 1e-3


@pytest.mark.parametrize("streaming", [False, True])
@torch.inference_mode()
def test_estimator(models, streaming: bool) -> None:
    off, ours = models
    g = torch.Generator().manual_seed(11)
    b, size = 2, 120
    x, mu, cond = (torch.randn(b, 80, size, generator=g) for _ in range(3))
    spks, t = torch.randn(b, 80, generator=g), torch.rand(b, generator=g)
    mask = torch.ones(b, 1, size)
    mask[1, :, size - 17 :] = 0  # a padded row
    ref = off.decoder.estimator(x, mask, mu, t, spks, cond, streaming=streaming)
    got = ours.decoder.estimator(x, mask, mu, t, spks, cond, streaming=streaming)
    assert rel_err(got, ref) <= ESTIMATOR_RTOL
    assert float(got[1, :, size - 17 :].abs().max()) == 0.0  # padded frames are zero
    other = off.decoder.estimator(x, mask, mu, t, spks, cond, streaming=not streaming)
    assert rel_err(other, ref) > 1e-3  # the chunk mask matters at T=120 > 50


def test_fixed_noise_is_official(models) -> None:
    off, _ = models
    assert torch.equal(official_fixed_noise(), off.decoder.rand_noise)
    assert official_fixed_noise(37).shape == (1, 80, 37) and NOISE_FRAMES == 15000


@pytest.mark.parametrize(("streaming", "injected"), [(False, False), (True, False), (False, True), (True, True)])
@torch.inference_mode()
def test_cfm(models, inputs, streaming: bool, injected: bool) -> None:
    off, ours = models
    c = ours.encode(
        *(inputs[k] for k in ("token", "token_len", "prompt_token", "prompt_token_len")),
        inputs["prompt_feat"],
        inputs["embedding"],
        streaming=streaming,
    )
    saved = off.decoder.rand_noise
    noise = None
    if injected:
        noise = torch.randn(1, 80, c.mu.size(2), generator=torch.Generator().manual_seed(3))
        off.decoder.rand_noise = noise
    try:
        ref, _ = off.decoder(c.mu.clone(), c.mask, n_timesteps=10, spks=c.spks, cond=c.cond, streaming=streaming)
    finally:
        off.decoder.rand_noise = saved
    got = ours.decoder(c.mu, c.mask, c.spks, c.cond, streaming=streaming, noise=noise)
    assert rel_err(got, ref) <= CFM_RTOL


@torch.inference_mode()
def test_cfm_steps_and_rate(models, inputs) -> None:
    off, ours = models
    c = ours.encode(
        *(inputs[k] for k in ("token", "token_len", "prompt_token", "prompt_token_len")),
        inputs["prompt_feat"],
        inputs["embedding"],
    )
    off.decoder.inference_cfg_rate = 0.3
    try:
        ref, _ = off.decoder(c.mu.clone(), c.mask, n_timesteps=4, spks=c.spks, cond=c.cond)
    finally:
        off.decoder.inference_cfg_rate = 0.7
    got = ours.decoder(c.mu, c.mask, c.spks, c.cond, n_timesteps=4, cfg_rate=0.3)
    assert rel_err(got, ref) <= CFM_RTOL


@pytest.mark.parametrize(("streaming", "finalize"), [(False, True), (True, True), (True, False)])
def test_inference(models, inputs, streaming: bool, finalize: bool) -> None:
    off, ours = models
    args = [
        inputs[k]
        for k in (
            "token",
            "token_len",
            "prompt_token",
            "prompt_token_len",
            "prompt_feat",
            "prompt_feat_len",
            "embedding",
        )
    ]
    ref, _ = off.inference(*args, streaming=streaming, finalize=finalize)
    got, cache = ours.inference(*args, streaming=streaming, finalize=finalize)
    assert cache is None
    assert got.shape == (1, 80, 2 * N_TOKENS - (0 if finalize else 6))
    assert rel_err(got, ref) <= INFERENCE_RTOL


FLOW_YAML = """
spk_embed_dim: 192
token_frame_rate: 25
token_mel_ratio: 2
flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: 512
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: 512
        attention_heads: 8
        linear_units: 2048
        num_blocks: 6
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: 512
        use_cnn_module: False
        macaron_style: False
        use_dynamic_chunk: True
        static_chunk_size: !ref <token_frame_rate>
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: 320
            out_channels: 80
            channels: [256]
            dropout: 0.0
            attention_head_dim: 64
            n_blocks: 4
            num_mid_blocks: 12
            num_heads: 8
            act_fn: 'gelu'
            static_chunk_size: !ref <token_frame_rate> * <token_mel_ratio>
            num_decoding_left_chunks: 2
"""


def test_config_from_yaml(tmp_path) -> None:
    path = tmp_path / "cosyvoice2.yaml"
    path.write_text(textwrap.dedent(FLOW_YAML), encoding="utf-8")
    cfg = FlowConfig.from_yaml(load_yaml_data(path)["flow"])
    expected = FlowConfig()
    expected.estimator.num_decoding_left_chunks = 2  # as this yaml says (the official mask ignores it)
    assert cfg == expected
    assert cfg.cfm.sigma_min == 1e-6 and cfg.estimator.static_chunk_size == 50
    # Without static_chunk_size the official encoder defaults to 0 (streaming = full attention): honoured.
    no_chunk = FLOW_YAML.replace("        static_chunk_size: !ref <token_frame_rate>\n", "")
    path.write_text(textwrap.dedent(no_chunk), encoding="utf-8")
    assert FlowConfig.from_yaml(load_yaml_data(path)["flow"]).encoder.static_chunk_size == 0


def test_config_rejects_bad_values() -> None:
    cfg = FlowConfig()
    cfg.validate()
    cfg.estimator.channels = (256, 256)
    with pytest.raises(ValueError, match=r"estimator\.channels"):
        cfg.validate()
    with pytest.raises(ConfigError, match=r"cfm\.n_timesteps"):
        FlowConfig(cfm=FlowConfig().cfm.__class__(n_timesteps=0)).validate()
    with pytest.raises(ValueError, match=r"encoder\.attention_heads"):
        Flow(FlowConfig(encoder=FlowEncoderConfig(attention_heads=7)))
