"""Text to waveform with the PyTorch reference: tokenizer -> LM -> flow -> HiFT (non-streaming).

This is the ground-truth pipeline the ONNX runtime is compared against, and what ``cosyvoice-cpu demo`` runs
until the torch-free runtime lands. The prompt (speaker embedding, prompt speech tokens, prompt mel) is given
as arrays here; computing it from audio is the runtime front-end's job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from cosyvoice_cpu.errors import ConfigError, ModelDirError
from cosyvoice_cpu.reference.model_dir import ReferenceModel
from cosyvoice_cpu.reference.sampling import SamplingConfig, torch_draw
from cosyvoice_cpu.reference.tokenizer import QwenTextTokenizer
from cosyvoice_cpu.workshop.parts import PARTS, detect_family, family_parts, load_reference

logger = logging.getLogger(__name__)


@dataclass
class Prompt:
    """A voice: transcript, speech tokens (Ts,), mel (2*Ts, 80) and a 192-d x-vector; all optional."""

    text: str = ""
    speech_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    mel: np.ndarray = field(default_factory=lambda: np.zeros((0, 80), dtype=np.float32))
    embedding: np.ndarray = field(default_factory=lambda: np.zeros(192, dtype=np.float32))


@dataclass
class Synthesis:
    """The result of one utterance with per-stage wall times (seconds)."""

    speech_tokens: list[int]
    mel: np.ndarray  # (80, T_mel)
    wave: np.ndarray  # (N,) float32 in [-1, 1]
    sample_rate: int
    timings: dict[str, float]

    @property
    def duration(self) -> float:
        return len(self.wave) / self.sample_rate


class ReferencePipeline:
    """The reference model of one directory, ready to synthesize."""

    def __init__(self, model: ReferenceModel, tokenizer: QwenTextTokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, model_dir: str | Path) -> ReferencePipeline:
        """Load a CosyVoice2 directory (CosyVoice-300M modules load with :func:`load_reference`, but their
        whisper text tokenizer and this text-to-wave pipeline are not implemented yet)."""
        family = detect_family(model_dir)
        tokenizer = family_parts(family).tokenizer  # None: the family's prompt rules are not implemented here
        if tokenizer is None:
            runs = [name for name, parts in PARTS.items() if parts.tokenizer is not None]
            raise ModelDirError(
                f"{model_dir} is a {family} model; the reference text-to-speech pipeline supports "
                f"{', '.join(runs)} only (its LM, flow and HiFT load with "
                "cosyvoice_cpu.workshop.parts.load_reference)"
            )
        model = load_reference(model_dir)
        return cls(model, tokenizer(model.config.blank_en_dir))

    @property
    def sample_rate(self) -> int:
        return self.model.config.sample_rate

    @torch.inference_mode()
    def synthesize(
        self,
        text: str,
        prompt: Prompt | None = None,
        seed: int = 0,
        n_timesteps: int = 10,
        cfg_rate: float = 0.7,
        sampling: SamplingConfig | None = None,
    ) -> Synthesis:
        """Speak ``text`` in the voice of ``prompt`` (zero-shot if it has a transcript, else cross-lingual).

        ``seed`` drives the LM's sampling draws and the vocoder's source noise; the flow uses the official
        fixed noise.
        """
        if not text.strip():
            raise ConfigError("text is empty: give the text to speak")
        prompt = prompt or Prompt()
        m = self.model
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        text_ids = torch.tensor([self.tokenizer.encode(text)], dtype=torch.long)
        prompt_ids = torch.tensor([self.tokenizer.encode(prompt.text) if prompt.text else []], dtype=torch.long)
        prompt_ids = prompt_ids.view(1, -1)
        prompt_tokens = torch.as_tensor(prompt.speech_tokens, dtype=torch.long).view(1, -1)
        timings["tokenize"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        draw = torch_draw(torch.Generator().manual_seed(seed))
        # cross-lingual: no prompt text -> no prompt speech tokens in the LM either (as the official frontend)
        lm_prompt_tokens = prompt_tokens if prompt.text else prompt_tokens[:, :0]
        tokens = list(m.lm.inference(text_ids, prompt_ids, lm_prompt_tokens, draw=draw, sampling=sampling))
        timings["lm"] = time.perf_counter() - t0
        if not tokens:
            raise ConfigError("the LM produced no speech tokens for this text")

        t0 = time.perf_counter()
        tok = torch.tensor([tokens], dtype=torch.long)
        prompt_mel = torch.as_tensor(prompt.mel, dtype=torch.float32).view(1, -1, 80)
        emb = torch.as_tensor(prompt.embedding, dtype=torch.float32).view(1, -1)
        mel, _ = m.flow.inference(
            tok,
            torch.tensor([tok.shape[1]]),
            prompt_tokens,
            torch.tensor([prompt_tokens.shape[1]]),
            prompt_mel,
            torch.tensor([prompt_mel.shape[1]]),
            emb,
            n_timesteps=n_timesteps,
            cfg_rate=cfg_rate,
        )
        timings["flow"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        wave, _ = m.hift.inference(mel, noise=torch.Generator().manual_seed(seed))
        timings["hift"] = time.perf_counter() - t0
        return Synthesis(tokens, mel[0].numpy(), wave[0].numpy().astype(np.float32), self.sample_rate, timings)


def write_wav(path: str | Path, wave: np.ndarray, sample_rate: int) -> None:
    """Write mono float samples in [-1, 1] as 16-bit PCM WAV (standard library only)."""
    import wave as wavmod

    pcm = (np.clip(wave, -1.0, 1.0) * 32767.0).round().astype("<i2")
    with wavmod.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sample_rate)
        f.writeframes(pcm.tobytes())
