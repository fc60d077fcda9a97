"""CosyVoice2-0.5B: the chunk-causal UNet flow streamed on cached prompt activations, overlap-joined vocoder chunks."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from cosyvoice_cpu.facts import FamilyFacts, facts
from cosyvoice_cpu.families.common import ChunkedFamily, FlowStreamKind
from cosyvoice_cpu.flow.base import FlowStage
from cosyvoice_cpu.flow.cosyvoice2 import CosyVoice2Flow
from cosyvoice_cpu.flow.cosyvoice2_stream import CosyVoice2FlowStream, CosyVoice2PromptCache
from cosyvoice_cpu.flow.prompt_caches import PromptCacheKind
from cosyvoice_cpu.sentence import AudioStream
from cosyvoice_cpu.vocoder.hift import Vocoder
from cosyvoice_cpu.vocoder.overlap_stream import VocoderStream


class CosyVoice2(ChunkedFamily):
    """Streams chunks of ``first_chunk_tokens`` doubling up to ``chunk_tokens`` through a flow stream on the voice's
    cached prompt activations (:attr:`flow_stream`), vocoded by :meth:`vocoder_stream`."""

    facts: ClassVar[FamilyFacts] = facts("cosyvoice2")
    flow_stage: ClassVar[type[FlowStage]] = CosyVoice2Flow
    prompt_cache: ClassVar[PromptCacheKind | None] = CosyVoice2PromptCache
    flow_stream: ClassVar[FlowStreamKind] = CosyVoice2FlowStream

    def vocoder_stream(self, vocoder: Vocoder, rng: np.random.Generator) -> AudioStream:
        """The vocoder stream of one sentence: chunks joined over 8 mel frames (the official ``mel_cache_len``)."""
        return VocoderStream(vocoder, rng)
