"""The stream recipe CosyVoice2 and Fun-CosyVoice3 share: chunks of ``first_chunk_tokens`` doubling up to
``chunk_tokens``, each rendered by the family's flow stream on the voice's cached prompt activations and vocoded
by the family's vocoder stream."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import ClassVar

import numpy as np
from numpy.typing import ArrayLike

from cosyvoice_cpu.families.base import Family, Stages
from cosyvoice_cpu.flow.base import FlowStage
from cosyvoice_cpu.flow.common import ChunkedStream, ChunkFlowStream
from cosyvoice_cpu.flow.prompt_caches import PromptCache
from cosyvoice_cpu.sentence import AudioStream, Piece, Sentence, stream_pieces
from cosyvoice_cpu.vocoder.hift import Vocoder

# (stage, prompt tokens (T_p,), prompt mel (T_p * ratio, 80), x-vector (192,), steps, cfg rate, context tokens,
# prompt cache or None) -> the sentence's flow stream
FlowStreamKind = Callable[
    [FlowStage, ArrayLike, ArrayLike, ArrayLike, int | None, float | None, int | None, PromptCache | None],
    ChunkFlowStream,
]


class ChunkedFamily(Family):
    """A family that streams token chunks through :attr:`flow_stream` (with the voice's prompt cache from the
    engine's :class:`~cosyvoice_cpu.flow.prompt_caches.PromptCaches`) and :meth:`vocoder_stream`."""

    flow_stream: ClassVar[FlowStreamKind]

    def vocoder_stream(self, vocoder: Vocoder, rng: np.random.Generator) -> AudioStream:
        """The vocoder stream of one sentence."""
        raise NotImplementedError(f"{type(self).__name__} must give its vocoder stream")

    def speak_stream(self, s: Sentence, stages: Stages) -> Iterator[Piece]:
        voice, config = s.voice, s.config
        t0 = time.perf_counter()
        caches = stages.prompt_caches  # None: built for this sentence by the flow stream
        prompt = None if caches is None else caches.get(voice, config.flow_steps, config.cfg_rate, s.caches)
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
        chunks = ChunkedStream(flow, config.first_chunk_tokens, config.chunk_tokens)
        flt = self.token_filter()
        return stream_pieces(s, chunks, self.vocoder_stream(stages.vocoder, s.rng), None if flt is None else flt.push)
