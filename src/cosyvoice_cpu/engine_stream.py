"""One sentence streamed in chunks as its speech tokens are decoded, per family (used by ``Engine.synthesize``).

Each function yields ``(samples, last piece of the sentence)`` and records stage times in the request's
:class:`~cosyvoice_cpu.engine.Timings`. The LM is held at the first chunk until that chunk's audio exists (on a
small machine decoding ahead would only take cores from the first audio).

- CosyVoice2 (:func:`speak_v2`): chunk-causal flow on cached activations (:mod:`cosyvoice_cpu.flow_stream`),
  chunks of ``first_chunk_tokens`` doubling up to ``chunk_tokens``.
- Fun-CosyVoice3 (:func:`speak_v3`): the same chunks on the DiT's cached keys/values
  (:mod:`cosyvoice_cpu.flow_stream_v3`), the causal HiFT continued chunk by chunk
  (:mod:`cosyvoice_cpu.vocoder_stream_v3`), long silent-token runs dropped as the official ``llm_job``.
- CosyVoice-300M (:func:`speak_v1`): the official v1 scheme (:mod:`cosyvoice_cpu.flow_stream_v1`): overlapping
  token windows, each run through the whole flow with the noise/mu cache and a 34-frame mel fade. Its tokens come
  at 50 Hz, so the windows' hops are twice the configured token counts (the same seconds of audio): the first
  hop ``max(21, 2 * first_chunk_tokens)``, doubling up to ``2 * chunk_tokens`` (the official ``stream_scale_factor``
  2; the official default is a fixed 100-token hop, 2.4 s of audio before the first chunk).

v1 and v2 join vocoded chunks with :class:`~cosyvoice_cpu.streaming.VocoderStream` (v2: 8 mel frames of overlap,
the official ``mel_cache_len``; v1: 20); v3's causal HiFT needs no join.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from cosyvoice_cpu.scheduler import Hold

logger = logging.getLogger(__name__)

V1_VOCODER_OVERLAP = 20  # the official CosyVoice-300M mel_cache_len


def speak_v2(engine: Any, text_ids: list[int], req: Any, t: Any) -> Iterator[tuple[np.ndarray, bool]]:
    """CosyVoice2: chunks on the streaming estimator with the voice's cached prompt activations, seamless joins."""
    from cosyvoice_cpu.flow_stream import FlowStream
    from cosyvoice_cpu.streaming import VocoderStream

    return _speak_chunks(engine, text_ids, req, t, FlowStream, VocoderStream(engine.vocoder, req.vocoder_rng))


def speak_v3(engine: Any, text_ids: list[int], req: Any, t: Any) -> Iterator[tuple[np.ndarray, bool]]:
    """Fun-CosyVoice3: chunks on the DiT's cached keys/values; the causal HiFT continues each chunk exactly."""
    from cosyvoice_cpu.flow_stream_v3 import FlowStreamV3
    from cosyvoice_cpu.silence import SilentRunFilter
    from cosyvoice_cpu.vocoder_stream_v3 import CausalVocoderStream

    vocoder = CausalVocoderStream(engine.vocoder, rng=req.vocoder_rng)
    return _speak_chunks(engine, text_ids, req, t, FlowStreamV3, vocoder, SilentRunFilter())


def _speak_chunks(engine: Any, text_ids: list[int], req: Any, t: Any, flow_cls: type, vocoder: Any,
                  silence: Any = None) -> Iterator[tuple[np.ndarray, bool]]:  # fmt: skip
    """Chunks of ``first_chunk_tokens`` doubling up to ``chunk_tokens``, each cut once its look-ahead tokens exist;
    ``silence`` (v3) drops long silent runs from what the flow sees."""
    from cosyvoice_cpu.streaming import ChunkPlan

    voice, config = req.voice, req.config
    t0 = time.perf_counter()
    prompt = engine.prompt_caches.get(voice, config.flow_steps, config.cfg_rate)
    flow = flow_cls(engine.flow, voice.speech_tokens, voice.mel, voice.embedding, config.flow_steps,
                    config.cfg_rate, config.context_tokens, prompt)  # fmt: skip
    t.flow += time.perf_counter() - t0
    plan = ChunkPlan(config.first_chunk_tokens, config.chunk_tokens, max(flow.lookahead, 1))
    tokens: list[int] = []

    def cut(n: int, done: bool) -> tuple[int, int, bool] | None:
        if done:
            return plan.offset, n, True
        return (*plan.cut(), False) if plan.ready(n) else None

    def mel(a: int, b: int, final: bool) -> np.ndarray:
        return flow.push(tokens[a:b], None if final else tokens[b : b + flow.lookahead])

    return _stream(engine, text_ids, req, t, tokens, cut, mel, vocoder, plan.first + plan.lookahead, silence)


def speak_v1(engine: Any, text_ids: list[int], req: Any, t: Any) -> Iterator[tuple[np.ndarray, bool]]:
    """CosyVoice-300M: the official overlapping-window stream (fresh noise per window from the request's RNG)."""
    from cosyvoice_cpu.flow_stream_v1 import FlowStreamV1
    from cosyvoice_cpu.streaming import VocoderStream

    voice, config = req.voice, req.config
    overlap = engine.flow.settings.overlap_tokens
    first = max(overlap + 1, 2 * config.first_chunk_tokens)
    flow = FlowStreamV1(engine.flow, voice.speech_tokens, voice.mel, voice.embedding, config.flow_steps,
                        config.cfg_rate, rng=req.vocoder_rng, hop=first,
                        max_hop=max(first, 2 * config.chunk_tokens))  # fmt: skip
    vocoder = VocoderStream(engine.vocoder, req.vocoder_rng, overlap_frames=V1_VOCODER_OVERLAP)
    tokens: list[int] = []

    def mel(a: int, b: int, final: bool) -> np.ndarray:
        return flow.push(tokens[a:b], final)

    return _stream(engine, text_ids, req, t, tokens, flow.next_window, mel, vocoder, flow.window_tokens)


def _stream(engine: Any, text_ids: list[int], req: Any, t: Any, tokens: list[int], cut: Any, mel: Any,
            vocoder: Any, hold_at: int, silence: Any = None) -> Iterator[tuple[np.ndarray, bool]]:  # fmt: skip
    """The loop every family shares: decode speech tokens into ``tokens``; whenever ``cut(n, done)`` gives a
    ``(start, end, final)`` piece, vocode ``mel(start, end, final)`` (speed applied) and yield it. The LM is held
    after ``hold_at`` tokens until the first piece's audio exists; ``silence`` (v3) drops tokens before the flow.
    """
    from cosyvoice_cpu.engine import _change_speed

    def piece(a: int, b: int, final: bool) -> np.ndarray:
        t1 = time.perf_counter()
        m = _change_speed(mel(a, b, final), req.config.speed)
        t2 = time.perf_counter()
        wave = vocoder.push(m, final)
        t.flow += t2 - t1
        t.vocoder += time.perf_counter() - t2
        return wave.astype(np.float32, copy=False)

    t0 = time.perf_counter()
    first_done = Hold(hold_at)
    decoded = 0
    for token in engine._tokens(text_ids, req, hold=first_done):
        decoded += 1
        if silence is not None and not silence.push(token):
            continue
        tokens.append(token)
        window = cut(len(tokens), False)
        if window is not None:
            t.lm += time.perf_counter() - t0
            wave = piece(*window)
            first_done.release()
            yield wave, False
            t0 = time.perf_counter()  # the consumer's time between chunks is not the LM's
    t.lm += time.perf_counter() - t0
    t.tokens += decoded
    window = cut(len(tokens), True)
    if window is not None and window[1] > window[0]:
        yield piece(*window), True
