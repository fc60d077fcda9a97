"""One sentence spoken, whole or streamed: what every family shares, given what the sentence needs.

A :class:`Sentence` carries a request's voice, settings, random generator, timings and its speech-token source;
the engine makes one per sentence and hands it to the family (:mod:`cosyvoice_cpu.families`), whose recipe
calls the functions here. Nothing here knows the engine or tests a family's name.

- :func:`speak_whole`: all tokens, then the flow over the sentence, then the vocoder: one piece.
- :func:`stream_pieces`: the loop under every streamed recipe: decode, ask the family's flow stream
  (:class:`~cosyvoice_cpu.flow.base.FlowStream`) for the next window, render, vocode, yield. The LM is held at the
  first piece until its audio exists (on a small machine decoding ahead only takes cores from it).

Every function yields ``(samples (N,) float32, last piece of the sentence)`` and adds stage times to the
sentence's :class:`Timings`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from cosyvoice_cpu.config import SynthesisConfig
from cosyvoice_cpu.flow.base import FlowStage, FlowStream
from cosyvoice_cpu.flow.prompt_caches import RequestCaches
from cosyvoice_cpu.lm.hold import Hold
from cosyvoice_cpu.lm.source import TokenSource
from cosyvoice_cpu.vocoder.hift import Vocoder
from cosyvoice_cpu.voices.voice import Voice

logger = logging.getLogger(__name__)

Piece = tuple[np.ndarray, bool]  # (samples (N,) float32, the sentence's last piece)


class AudioStream(Protocol):
    """One sentence's vocoder stream: ``push(mel (1, 80, T), final)`` -> samples (N,) float32 of that mel."""

    def push(self, mel: np.ndarray, final: bool) -> np.ndarray: ...


@dataclass
class Timings:
    """Seconds spent per stage in one ``synthesize`` call (filled as it runs)."""

    lm: float = 0.0
    flow: float = 0.0
    vocoder: float = 0.0
    tokens: int = 0
    audio: float = 0.0
    first_audio: float | None = None


@dataclass
class Sentence:
    """What speaking one sentence needs.

    Attributes:
        tokens: the sentence's speech-token source (:mod:`cosyvoice_cpu.lm.source`), opened once with a hold (or
            None) that pauses the LM after its count until released (:class:`~cosyvoice_cpu.lm.hold.Hold`).
        voice, config: the request's voice and settings.
        rng: the request's generator for the flow's fresh noise (CosyVoice-300M) and the vocoder's source noise.
        timings: the request's stage times, added to.
        caches: the request's own prompt caches (shared by its sentences; :class:`~cosyvoice_cpu.flow.prompt_caches.
            PromptCaches` fills it).
    """

    tokens: TokenSource
    voice: Voice
    config: SynthesisConfig
    rng: np.random.Generator
    timings: Timings = field(default_factory=Timings)
    caches: RequestCaches = field(default_factory=dict)


def change_speed(mel: np.ndarray, speed: float) -> np.ndarray:
    """Resample the mel (1, 80, T) to int(T / speed) frames, as the official speed option
    (``F.interpolate(mel, size=int(T / speed), mode="linear")``, align_corners False)."""
    if speed == 1.0:
        return mel
    frames = mel.shape[2]
    target = max(1, int(frames / speed))
    pos = np.maximum((np.arange(target) + 0.5) * (frames / target) - 0.5, 0.0)
    lo = np.minimum(np.floor(pos).astype(int), frames - 1)
    hi = np.minimum(lo + 1, frames - 1)
    w = (pos - lo).astype(np.float32)
    return (mel[:, :, lo] * (1 - w) + mel[:, :, hi] * w).astype(np.float32)


def speak_whole(
    s: Sentence, flow: FlowStage, vocoder: Vocoder, keep: Callable[[list[int]], list[int]]
) -> Iterator[Piece]:
    """The sentence in one piece: yields (samples, True) once, or nothing when no token reaches the flow.

    ``keep`` is the family's token filter (tokens the flow sees, from all the LM decoded).
    """
    t = s.timings
    t0 = time.perf_counter()
    tokens = list(s.tokens.open(None))
    t1 = time.perf_counter()
    t.lm += t1 - t0
    t.tokens += len(tokens)
    tokens = keep(tokens)
    if not tokens:
        return
    voice, config = s.voice, s.config
    mel = flow.inference(
        tokens,
        voice.speech_tokens,
        voice.mel,
        voice.embedding,
        n_timesteps=config.flow_steps,
        cfg_rate=config.cfg_rate,
        rng=s.rng,
    )
    mel = change_speed(mel, config.speed)
    t2 = time.perf_counter()
    wave, _ = vocoder(mel, rng=s.rng)
    t.flow += t2 - t1
    t.vocoder += time.perf_counter() - t2
    yield wave[0].astype(np.float32), True


def stream_pieces(
    s: Sentence, flow: FlowStream, vocoder: AudioStream, keep: Callable[[int], bool] | None = None
) -> Iterator[Piece]:
    """The loop every streamed recipe shares: decode speech tokens into a list; whenever ``flow.next_window(n,
    done)`` gives a ``(start, end, final)`` window, vocode ``flow.render(tokens, start, end, final)`` (speed
    applied) and yield it. The LM is held after ``flow.hold_at`` tokens until the first piece's audio exists;
    ``keep`` (or None) says per decoded token whether the flow sees it."""
    t = s.timings
    tokens: list[int] = []

    def piece(a: int, b: int, final: bool) -> np.ndarray:
        t1 = time.perf_counter()
        m = change_speed(flow.render(tokens, a, b, final), s.config.speed)
        t2 = time.perf_counter()
        wave = vocoder.push(m, final)
        t.flow += t2 - t1
        t.vocoder += time.perf_counter() - t2
        return wave.astype(np.float32, copy=False)

    t0 = time.perf_counter()
    first_done = Hold(flow.hold_at)
    decoded = 0
    for token in s.tokens.open(first_done):
        decoded += 1
        if keep is not None and not keep(token):
            continue
        tokens.append(token)
        window = flow.next_window(len(tokens), False)
        if window is not None:
            t.lm += time.perf_counter() - t0
            wave = piece(*window)
            first_done.release()
            yield wave, False
            t0 = time.perf_counter()  # the consumer's time between chunks is not the LM's
    t.lm += time.perf_counter() - t0
    t.tokens += decoded
    window = flow.next_window(len(tokens), True)
    if window is not None and window[1] > window[0]:
        yield piece(*window), True
