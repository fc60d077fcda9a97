"""CosyVoice-300M (base, -SFT, -Instruct): the LM takes a text-encoder graph and the voice's x-vector; the flow
draws fresh noise per call; streaming is the official overlapping-window scheme.

Its tokens come at 50 Hz, so the stream's window hops are twice the configured token counts (the same seconds of
audio): the first hop ``max(overlap + 1, 2 * first_chunk_tokens)``, doubling up to ``2 * chunk_tokens`` (the
official ``stream_scale_factor`` 2; the official default is a fixed 100-token hop). Windows are vocoded and joined
over 20 mel frames (the official ``mel_cache_len``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.facts import FamilyFacts, facts
from cosyvoice_cpu.families.base import Family, Stages
from cosyvoice_cpu.flow.base import FlowStage
from cosyvoice_cpu.flow.cosyvoice import CosyVoiceFlow
from cosyvoice_cpu.flow.cosyvoice_stream import CosyVoiceFlowStream
from cosyvoice_cpu.lm.generate import SpeechTokenGenerator
from cosyvoice_cpu.lm.prompt import TextEncoder
from cosyvoice_cpu.lm.session import LMSession
from cosyvoice_cpu.lm_files import TEXT_ENCODER_FILE
from cosyvoice_cpu.sentence import Piece, Sentence, stream_pieces
from cosyvoice_cpu.vocoder.overlap_stream import VocoderStream

VOCODER_OVERLAP = 20  # the official CosyVoice-300M mel_cache_len


class CosyVoice(Family):
    """v1: the causal Conformer text encoder before the LM, the length-regulated flow, overlapping windows."""

    facts: ClassVar[FamilyFacts] = facts("cosyvoice")
    flow_stage: ClassVar[type[FlowStage]] = CosyVoiceFlow

    def load_lm(self, model_dir: Path, session: LMSession, sessions: SessionConfig) -> SpeechTokenGenerator:
        """The generator with the text-encoder graph (``lm_text_encoder.onnx``) that prepares its prompt."""
        dims = (session.spec.text_dim, session.spec.hidden)
        encoder = TextEncoder(model_dir / TEXT_ENCODER_FILE, dims, sessions)
        return SpeechTokenGenerator.from_manifest(session, self.manifest, encoder)

    def speak_stream(self, s: Sentence, stages: Stages) -> Iterator[Piece]:
        voice, config, stage = s.voice, s.config, stages.flow
        if not isinstance(stage, CosyVoiceFlow):
            raise ConfigError(f"CosyVoice-300M streams on its own flow stage, not {type(stage).__name__}")
        overlap = stage.settings.overlap_tokens
        first = max(overlap + 1, 2 * config.first_chunk_tokens)
        flow = CosyVoiceFlowStream(
            stage,
            voice.speech_tokens,
            voice.mel,
            voice.embedding,
            config.flow_steps,
            config.cfg_rate,
            rng=s.rng,
            hop=first,
            max_hop=max(first, 2 * config.chunk_tokens),
        )
        vocoder = VocoderStream(stages.vocoder, s.rng, overlap_frames=VOCODER_OVERLAP)
        return stream_pieces(s, flow, vocoder)
