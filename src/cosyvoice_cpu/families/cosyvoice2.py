"""CosyVoice2-0.5B: the chunk-causal UNet flow streamed on cached prompt activations, overlap-joined vocoder chunks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from cosyvoice_cpu.facts import FamilyFacts, facts
from cosyvoice_cpu.families.base import Family, Stages
from cosyvoice_cpu.flow.cosyvoice2 import CosyVoice2Flow
from cosyvoice_cpu.flow.cosyvoice2_stream import CosyVoice2FlowStream, CosyVoice2PromptCache
from cosyvoice_cpu.sentence import Piece, Sentence, speak_chunks
from cosyvoice_cpu.vocoder.hift import Vocoder
from cosyvoice_cpu.vocoder.overlap_stream import VocoderStream


class CosyVoice2(Family):
    """Streams chunks of ``first_chunk_tokens`` doubling up to ``chunk_tokens`` through a flow stream on the voice's
    cached prompt activations (:attr:`flow_stream`), vocoded by :meth:`vocoder_stream`."""

    facts: ClassVar[FamilyFacts] = facts("cosyvoice2")
    flow_stage: ClassVar[type[CosyVoice2Flow]] = CosyVoice2Flow
    prompt_cache: ClassVar[type | None] = CosyVoice2PromptCache
    flow_stream: ClassVar[type] = (
        CosyVoice2FlowStream  # (stage, prompt tokens, mel, x-vector, steps, cfg, context, cache)
    )

    def vocoder_stream(self, vocoder: Vocoder, rng: np.random.Generator) -> Any:
        """The vocoder stream of one sentence: chunks joined over 8 mel frames (the official ``mel_cache_len``)."""
        return VocoderStream(vocoder, rng)

    def speak_stream(self, s: Sentence, stages: Stages) -> Iterator[Piece]:
        voice, config = s.voice, s.config
        t0 = time.perf_counter()
        caches = stages.prompt_caches  # None: built for this sentence by the flow stream
        prompt = None if caches is None else caches.get(voice, config.flow_steps, config.cfg_rate)
        flow = self.flow_stream(
            stages.flow,
            voice.speech_tokens,
            voice.mel,
            voice.embedding,
            config.flow_steps,
            config.cfg_rate,
            config.context_tokens,
            prompt,
        )
        s.timings.flow += time.perf_counter() - t0
        flt = self.token_filter()
        return speak_chunks(s, flow, self.vocoder_stream(stages.vocoder, s.rng), None if flt is None else flt.push)
