"""The torch-free text-to-speech engine: a model directory made by ``cosyvoice-cpu export`` -> audio.

    engine = Engine.load("models/cosyvoice2-int8w")
    voice = engine.make_voice("alice.wav", "Transcript of alice.wav.", name="alice")
    for chunk in engine.synthesize("Hello there. How are you?", voice, SynthesisConfig(seed=1)):
        play(chunk.samples, chunk.sample_rate)

The engine is immutable after ``load`` and may be shared by threads: per-request state (KV cache, random
generator, decoded tokens) lives in each ``synthesize`` call. The LM decodes in a background thread
(:mod:`cosyvoice_cpu.scheduler`, ``EngineConfig(lm_batch_rows=N)``, default 4): a streamed request's next tokens
are decoded while the flow renders its current chunk, and the LM steps of up to N concurrent calls run as one
batched call. The thread ends when idle; :meth:`Engine.close` stops it at once. Text is spoken a sentence at a
time, so memory does not grow with the text's length. Modes follow the official frontends:

- zero-shot: a voice with a transcript: the LM sees the transcript and the prompt's speech tokens;
- cross-lingual: a voice without a transcript: the LM gets no prompt, the flow still clones the voice;
- instruct: ``instruct="..."``: the LM sees the instruction + ``<|endofprompt|>`` instead of the transcript.

Per family: CosyVoice-300M's LM also takes the voice's x-vector (not in instruct mode, whose marker is the plain
text ``<endofprompt>``), and its built-in -SFT speakers are voices without a prompt (:meth:`Engine.builtin_voices`);
Fun-CosyVoice3's LM needs ``<|endofprompt|>``, so ``You are a helpful assistant.<|endofprompt|>`` goes before a
transcript (or alone) when it has none, and runs of more than 5 silent tokens never reach its flow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from cosyvoice_cpu.config import DEFAULT_LM_BATCH_ROWS, AudioChunk, EngineConfig, SynthesisConfig
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.hardware import detect, fix_mmap_threshold
from cosyvoice_cpu.scheduler import Hold, LMScheduler

logger = logging.getLogger(__name__)

END_OF_PROMPT = {"cosyvoice2": "<|endofprompt|>", "cosyvoice": "<endofprompt>", "cosyvoice3": "<|endofprompt|>"}
# Fun-CosyVoice3's LM requires <|endofprompt|> in its text; the official examples put this system prompt before it
SYSTEM_PROMPT_V3 = "You are a helpful assistant."
VOICES_DIR = "voices"  # built-in speakers in a model directory (CosyVoice-300M-SFT/-Instruct)
SEGMENT_TOKENS = 80  # text tokens per LM call at most: the official split_paragraph's token_max_n


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
class _Request:
    """Per-call state of one ``synthesize`` (the engine itself holds none)."""

    voice: Any
    config: SynthesisConfig
    prompt_ids: list[int]
    prompt_speech: np.ndarray
    speaker: np.ndarray | None = None  # the LM's x-vector (CosyVoice-300M outside instruct mode)
    draw: Any = None
    sampling: Any = None
    vocoder_rng: np.random.Generator | None = None
    check: Callable[[], None] | None = None  # called at every token; raises to stop the request


class Engine:
    """CosyVoice2, CosyVoice-300M or Fun-CosyVoice3 (the manifest's family) on ONNX Runtime and NumPy. Build it with
    :meth:`load`."""

    def __init__(self, model_dir: Path, manifest: Any, parts: dict[str, Any], threads: int,
                 prompt_cache_mb: int = 1024, lm_batch_rows: int = DEFAULT_LM_BATCH_ROWS,
                 prompt_cache_fp16: bool = False) -> None:  # fmt: skip
        self.model_dir = model_dir
        self.manifest = manifest
        self.tokenizer = parts["tokenizer"]
        self.lm = parts["lm"]
        self.flow = parts["flow"]
        self.vocoder = parts["vocoder"]
        self.frontend = parts["frontend"]
        self.threads = threads
        self.sample_rate = int(manifest.sample_rate)
        self.family = manifest.family
        self.prompt_caches = None
        if self.family != "cosyvoice" and self.flow.can_stream:  # v1 streams whole windows: nothing to cache
            from cosyvoice_cpu.flow_stream import PromptCache
            from cosyvoice_cpu.flow_stream_v3 import PromptCacheV3
            from cosyvoice_cpu.voice_cache import PromptCaches

            kind = PromptCacheV3 if self.family == "cosyvoice3" else PromptCache
            dtype = np.float16 if prompt_cache_fp16 else np.float32
            self.prompt_caches = PromptCaches(self.flow, prompt_cache_mb << 20, kind, dtype)
        self.scheduler = None
        if lm_batch_rows:
            self.scheduler = LMScheduler(self.lm, lm_batch_rows)

    @classmethod
    def load(cls, model_dir: str | Path, config: EngineConfig | None = None) -> Engine:
        """Check the machine, then load every stage of ``model_dir`` (graphs memory-mapped)."""
        config = (config or EngineConfig()).validate()
        hw = detect()
        hw.check_cpu()  # before onnxruntime is imported: no 'Illegal instruction'
        if config.malloc_mmap_threshold_kb and fix_mmap_threshold(config.malloc_mmap_threshold_kb << 10):
            logger.debug("glibc mmap threshold fixed at %d KiB", config.malloc_mmap_threshold_kb)
        threads = config.threads or hw.threads(config.leave_cores)
        from cosyvoice_cpu.flow import FlowStage
        from cosyvoice_cpu.frontend import Frontend
        from cosyvoice_cpu.lm import LMSession
        from cosyvoice_cpu.lm_loop import SpeechTokenGenerator
        from cosyvoice_cpu.manifest import Manifest
        from cosyvoice_cpu.sessions import SessionConfig
        from cosyvoice_cpu.text import TextTokenizer
        from cosyvoice_cpu.vocoder import Vocoder

        t0 = time.perf_counter()
        model_dir = Path(model_dir)
        m = Manifest.load(model_dir, check_hashes=config.verify_hashes)
        sc = SessionConfig(threads=threads, spinning=config.spinning, release_weight_pages=config.release_weight_pages)
        lm_entry = m.graphs["lm"]  # an int4 LM exported before its graph said min_rows=2 still needs it
        session = LMSession.from_dir(model_dir, lm_entry.attrs, threads=sc,
                                     min_rows=2 if lm_entry.precision == "int4" else None)  # fmt: skip
        if m.family == "cosyvoice":
            from cosyvoice_cpu.flow_v1 import FlowStageV1
            from cosyvoice_cpu.lm import TEXT_ENCODER_FILE
            from cosyvoice_cpu.lm_prompt import TextEncoder

            encoder = TextEncoder(model_dir / TEXT_ENCODER_FILE, (session.spec.text_dim, session.spec.hidden), sc)
            lm = SpeechTokenGenerator.from_manifest(session, m, encoder)
            flow = FlowStageV1.from_dir(model_dir, m.flow, sc)
        else:
            from cosyvoice_cpu.flow_v3 import FlowStageV3  # the DiT behind the CosyVoice2 contracts

            lm = SpeechTokenGenerator.from_manifest(session, m)
            stage = FlowStageV3 if m.family == "cosyvoice3" else FlowStage
            flow = stage.from_dir(model_dir, m.flow, threads=sc, streaming=config.streaming_estimator)
            if isinstance(flow, FlowStageV3) and flow.can_stream:  # the DiT's time table for the default steps
                flow.time_table(flow.schedule(flow.settings.n_timesteps))  # now, while little else is in memory
        flow.arena_shrink_frames = config.arena_shrink_frames
        parts = {
            "tokenizer": TextTokenizer.from_dir(model_dir),
            "lm": lm,
            "flow": flow,
            "vocoder": Vocoder.from_dir(model_dir, m.graphs["hift_decode"].attrs, threads=sc,
                                        window_frames=config.vocoder_window_frames),
            "frontend": Frontend(model_dir, m, sc),
        }
        for note in hw.notes:
            logger.info("%s", note)
        for warning in hw.model_warnings(m, config.streaming_estimator):
            logger.warning("%s", warning)
        logger.info("loaded %s (%s, recipe %s) in %.2f s, %d threads", model_dir, m.family, m.recipe["name"],
                    time.perf_counter() - t0, threads)  # fmt: skip
        return cls(model_dir, m, parts, threads, config.prompt_cache_mb, config.lm_batch_rows,
                   config.prompt_cache_fp16)

    def close(self) -> None:
        """Stop the LM scheduler's thread, if any (requests still running end with an error)."""
        if self.scheduler is not None:
            self.scheduler.close()

    # ------------------------------------------------------------------ voices

    def make_voice(self, prompt: Any, prompt_text: str = "", name: str = "voice") -> Any:
        """A :class:`~cosyvoice_cpu.voice.Voice` from prompt audio and its transcript (see ``Frontend``).

        Raises ConfigError (besides the frontend's) when the prompt is too long to leave the LM's KV cache room
        for text: such a voice could never speak, so it is refused now rather than at every request.
        """
        voice = self.frontend.make_voice(prompt, prompt_text, name)
        self._segment_cap(self._lm_prompt(voice, None), minimum=1)
        return voice

    def builtin_voices(self) -> dict[str, Any]:
        """The model directory's built-in speakers (CosyVoice-300M-SFT/-Instruct: ``中文女``, ...), by name."""
        from cosyvoice_cpu.voice import Voice

        directory = self.model_dir / VOICES_DIR
        return {p.stem: Voice.load(p) for p in sorted(directory.glob("*.npz"))} if directory.is_dir() else {}

    # ------------------------------------------------------------------ synthesis

    def _lm_prompt(self, voice: Any, instruct: str | None, normalize: bool = True,
                   ) -> tuple[list[int], np.ndarray, np.ndarray | None]:  # fmt: skip
        """(prompt text ids, prompt speech tokens, speaker x-vector or None) the LM sees, per mode, as the official
        frontends. Only CosyVoice-300M's LM takes the x-vector, and not in instruct mode."""
        speaker = voice.embedding if self.family == "cosyvoice" else None
        marker, v3 = END_OF_PROMPT[self.family], self.family == "cosyvoice3"
        if instruct is not None:
            if not isinstance(instruct, str) or not instruct.strip():
                raise ConfigError("instruct must be a non-empty instruction (e.g. 'Speak happily.') or omitted")
            text = instruct.strip()
            if not text.endswith(marker):  # newer official examples already carry the marker
                text = (f"{SYSTEM_PROMPT_V3} {text}" if v3 and marker not in text else text) + marker
            return self.tokenizer.encode(text), np.zeros(0, np.int32), None
        if voice.prompt_text and not voice.builtin:  # zero-shot: the transcript is normalized like the text
            from cosyvoice_cpu.text import normalize_text

            prompt = normalize_text(voice.prompt_text) if normalize else voice.prompt_text
            if v3 and marker not in prompt:  # as the official examples: system prompt, marker, transcript
                prompt = SYSTEM_PROMPT_V3 + marker + prompt
            return self.tokenizer.encode(prompt), voice.speech_tokens, speaker
        ids = self.tokenizer.encode(SYSTEM_PROMPT_V3 + marker) if v3 else []
        return ids, np.zeros(0, np.int32), speaker  # cross-lingual, or a built-in (SFT) speaker

    def _segment_cap(self, prompt: tuple[list[int], np.ndarray, np.ndarray | None], max_tokens: int | None = None,
                     minimum: int = 8) -> int:  # fmt: skip
        """Text tokens per segment so that the LM prompt (:meth:`_lm_prompt`) + text + the longest speech fits the
        KV cache (at least ``minimum``, else ConfigError)."""
        facts = self.lm.facts
        ids, speech, speaker = prompt
        free = self.lm.session.spec.max_len - (2 + len(ids) + len(speech) + (speaker is not None))
        cap = int(free - max_tokens if max_tokens else free // (1 + facts.max_token_text_ratio))
        if cap < minimum:
            raise ConfigError(
                f"the voice prompt leaves room for only {max(cap, 0)} text tokens in the KV cache (max_len "
                f"{self.lm.session.spec.max_len}); use a shorter prompt or re-export with a larger --max-len"
            )
        return min(SEGMENT_TOKENS, cap)

    def synthesize(
        self,
        text: str,
        voice: Any,
        config: SynthesisConfig | None = None,
        instruct: str | None = None,
        timings: Timings | None = None,
        check: Callable[[], None] | None = None,
    ) -> Iterator[AudioChunk]:
        """Speak ``text`` with ``voice``; yields :class:`AudioChunk` s (``final`` on the last).

        One chunk per sentence, or with ``config.stream`` several per sentence as speech tokens are decoded
        (first after ``first_chunk_tokens`` tokens). Raises ConfigError at once for bad parameters, empty
        text, a voice from another model or streaming on an engine loaded without the chunk estimator.
        ``check`` is called after every speech token and may raise to abandon the request (a server's
        cancellation and timeout); the exception comes out of the iteration.
        """
        config = (config or SynthesisConfig()).validate()
        if config.stream and self.family != "cosyvoice" and self.prompt_caches is None:
            raise ConfigError("stream=True needs the streaming flow estimator: load the engine with "
                              "EngineConfig(streaming_estimator=True)")  # fmt: skip
        from cosyvoice_cpu.voice import Voice

        if not isinstance(voice, Voice):
            raise ConfigError(f"voice must be a Voice (engine.make_voice or Voice.load), got {type(voice).__name__}")
        voice.check_model(self.manifest.family, self.sample_rate)
        prompt = self._lm_prompt(voice, instruct, config.normalize)
        from cosyvoice_cpu.text import prepare

        segments = prepare(text, self.tokenizer, normalize=config.normalize,
                           max_tokens=self._segment_cap(prompt, config.max_tokens))  # fmt: skip
        req = _Request(voice, config, *prompt, check=check)
        return self._run(segments, req, timings or Timings())

    def _run(self, segments: Iterator[Any], req: _Request, t: Timings) -> Iterator[AudioChunk]:
        from cosyvoice_cpu.sampling import RngDraw

        lm_rng, req.vocoder_rng = req.config.rngs()
        req.draw = RngDraw(lm_rng)
        req.sampling = self._sampling(req.config)
        start = time.perf_counter()
        segments = iter(segments)
        seg = next(segments, None)
        produced = 0
        while seg is not None:
            following = next(segments, None)  # cheap look-ahead: the chunk of the last segment is marked final
            speak = self._speak_stream if req.config.stream else self._speak
            spoke = False
            for samples, seg_done in speak(seg.token_ids, req, t):
                spoke = spoke or seg_done
                final = seg_done and following is None
                if not len(samples) and not final:
                    continue
                chunk = AudioChunk(samples, self.sample_rate, final, seg.text, (seg.start, seg.end))
                t.audio += chunk.duration
                if t.first_audio is None and len(samples):
                    t.first_audio = time.perf_counter() - start
                produced += len(samples)
                yield chunk
            if not spoke:
                logger.info("no speech tokens for %r", seg.text)
                if following is None:
                    if not produced:
                        raise ConfigError("the model produced no speech for this text; try other text or another seed")
                    yield AudioChunk(np.zeros(0, np.float32), self.sample_rate, True, seg.text, (seg.start, seg.end))
            seg = following

    def _tokens(self, text_ids: list[int], req: _Request, hold: Hold | None = None,
                ) -> Iterator[int]:  # fmt: skip
        """The sentence's speech tokens, from the LM scheduler when there is one (``hold``: see its submit)."""
        kw = {"draw": req.draw, "sampling": req.sampling, "budget": (req.config.min_tokens, req.config.max_tokens),
              "speaker": req.speaker}
        if self.scheduler is not None:  # decoded in batched steps with every other running request
            tokens = self.scheduler.submit(text_ids, req.prompt_ids, req.prompt_speech, hold=hold, **kw)
        else:
            tokens = self.lm.generate(text_ids, req.prompt_ids, req.prompt_speech, **kw)
        return tokens if req.check is None else _checked(tokens, req.check)

    def _speak(self, text_ids: list[int], req: _Request, t: Timings) -> Iterator[tuple[np.ndarray, bool]]:
        """One sentence in one piece: yields (samples, True) once, or nothing when the LM gives no tokens."""
        t0 = time.perf_counter()
        tokens = list(self._tokens(text_ids, req))
        t1 = time.perf_counter()
        t.lm += t1 - t0
        t.tokens += len(tokens)
        if self.family == "cosyvoice3":  # the official llm_job keeps at most 5 silent tokens in a row for the flow
            from cosyvoice_cpu.silence import drop_long_silences

            tokens = drop_long_silences(tokens)
        if not tokens:
            return
        voice, config = req.voice, req.config
        if self.family == "cosyvoice":  # fresh noise per call, from the request's generator (the official v1)
            mel, _ = self.flow.inference(tokens, voice.speech_tokens, voice.mel, voice.embedding,
                                         n_timesteps=config.flow_steps, cfg_rate=config.cfg_rate,
                                         rng=req.vocoder_rng)  # fmt: skip
        else:
            mel = self.flow.inference(tokens, voice.speech_tokens, voice.mel, voice.embedding,
                                      n_timesteps=config.flow_steps, cfg_rate=config.cfg_rate)  # fmt: skip
        mel = _change_speed(mel, config.speed)
        t2 = time.perf_counter()
        wave, _ = self.vocoder(mel, rng=req.vocoder_rng)
        t.flow += t2 - t1
        t.vocoder += time.perf_counter() - t2
        yield wave[0].astype(np.float32), True

    def _speak_stream(self, text_ids: list[int], req: _Request, t: Timings) -> Iterator[tuple[np.ndarray, bool]]:
        """One sentence in chunks as its tokens are decoded: yields (samples, last piece of the sentence)."""
        from cosyvoice_cpu import engine_stream

        speak = {"cosyvoice": engine_stream.speak_v1, "cosyvoice3": engine_stream.speak_v3}.get(self.family,
                                                                                               engine_stream.speak_v2)
        return speak(self, text_ids, req, t)

    def _sampling(self, config: SynthesisConfig) -> Any:
        base = self.lm.sampling
        changes = {k: v for k in ("top_p", "top_k", "win_size", "tau_r") if (v := getattr(config, k)) is not None}
        return replace(base, **changes) if changes else base

    def synthesize_wav(self, text: str, voice: Any, config: SynthesisConfig | None = None,
                       instruct: str | None = None) -> np.ndarray:  # fmt: skip
        """All of :meth:`synthesize` as one (N,) float32 array at :attr:`sample_rate`."""
        chunks = [c.samples for c in self.synthesize(text, voice, config, instruct)]
        return np.concatenate(chunks).astype(np.float32)


def _checked(tokens: Iterator[int], check: Callable[[], None]) -> Iterator[int]:
    """``tokens`` with ``check()`` after each; whatever way this ends, the source is closed (which frees a
    scheduler row at once instead of decoding for a request nobody reads)."""
    try:
        for token in tokens:
            check()
            yield token
    finally:
        close = getattr(tokens, "close", None)
        if close is not None:
            close()


def _change_speed(mel: np.ndarray, speed: float) -> np.ndarray:
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
