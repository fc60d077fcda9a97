"""The torch-free text-to-speech engine: a model directory made by ``cosyvoice-cpu export`` -> audio.

    engine = Engine.load("models/cosyvoice2-int8w")
    voice = engine.make_voice("alice.wav", "Transcript of alice.wav.", name="alice")
    for chunk in engine.synthesize("Hello there. How are you?", voice, SynthesisConfig(seed=1)):
        play(chunk.samples, chunk.sample_rate)

The engine is immutable after ``load`` and may be shared by threads: per-request state (KV cache, random
generator, decoded tokens) lives in each ``synthesize`` call. The LM decodes in a background thread
(:mod:`cosyvoice_cpu.lm.scheduler`, ``EngineConfig(lm_batch_rows=N)``, default 4): a streamed request's next tokens
are decoded while the flow renders its current chunk, and the LM steps of up to N concurrent calls run as one
batched call. The thread ends when idle; :meth:`Engine.close` stops it at once. Text is spoken a sentence at a
time, so memory does not grow with the text's length. Modes follow the official frontends:

- zero-shot: a voice with a transcript: the LM sees the transcript and the prompt's speech tokens;
- cross-lingual: a voice without a transcript: the LM gets no prompt, the flow still clones the voice;
- instruct: ``instruct="..."``: the LM sees the instruction + ``<|endofprompt|>`` instead of the transcript.

What differs per family (stage loading, the LM's prompt rules, the token filter, the stream recipe) is asked of the
engine's :class:`~cosyvoice_cpu.families.base.Family`; CosyVoice-300M's built-in -SFT speakers are voices without
a prompt (:meth:`Engine.builtin_voices`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from cosyvoice_cpu.audio.io import AudioSource
from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.backends.plan import describe
from cosyvoice_cpu.config import AudioChunk, EngineConfig, SynthesisConfig
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.facts import FamilyFacts
from cosyvoice_cpu.families.base import Family, LMPrompt, Stages
from cosyvoice_cpu.families.registry import family_for
from cosyvoice_cpu.flow.prompt_caches import RequestCaches
from cosyvoice_cpu.hardware.cpu import detect
from cosyvoice_cpu.hardware.malloc import fix_mmap_threshold, limit_arenas
from cosyvoice_cpu.lm.sampling import RngDraw, SamplingConfig
from cosyvoice_cpu.lm.scheduler import LMScheduler
from cosyvoice_cpu.lm.source import SentenceTokens, TokenSource
from cosyvoice_cpu.manifest import VOICES_DIR, Manifest
from cosyvoice_cpu.sentence import Piece, Sentence, Timings
from cosyvoice_cpu.text import TextSegment, prepare
from cosyvoice_cpu.text_stream import TextStream, pump
from cosyvoice_cpu.voices.voice import Voice

logger = logging.getLogger(__name__)

__all__ = ["Engine", "Timings"]

SEGMENT_TOKENS = 80  # text tokens per LM call at most: the official split_paragraph's token_max_n


@dataclass
class _Request:
    """Per-call state of one ``synthesize`` (the engine itself holds none)."""

    voice: Voice
    config: SynthesisConfig
    prompt: LMPrompt
    draw: RngDraw
    sampling: SamplingConfig
    rng: np.random.Generator  # the flow's fresh noise (CosyVoice-300M) and the vocoder's source noise
    check: Callable[[], None] | None = None  # called at every token; raises to stop the request
    caches: RequestCaches = field(default_factory=dict)  # the voice's prompt cache, shared by the sentences


class Engine:
    """CosyVoice2, CosyVoice-300M or Fun-CosyVoice3 (the manifest's family) on ONNX Runtime and NumPy. Build it with
    :meth:`load`.

    Attributes:
        config: the :class:`EngineConfig` it was loaded with (kept, validated).
        family: the model family's :class:`~cosyvoice_cpu.families.base.Family` (``family.name``, ``family.facts``).
        manifest, model_dir, sample_rate, threads: what was loaded, and how.
        tokenizer, lm, flow, vocoder, frontend, prompt_caches: the stages (:class:`Stages`).
        scheduler: the LM's batching thread (None with ``lm_batch_rows=0``).
    """

    def __init__(self, model_dir: Path, family: Family, stages: Stages, config: EngineConfig, threads: int) -> None:
        self.model_dir = model_dir
        self.family = family
        self.manifest: Manifest = family.manifest
        self.config = config
        self.threads = threads
        self.stages = stages
        self.tokenizer = stages.tokenizer
        self.lm = stages.lm
        self.flow = stages.flow
        self.vocoder = stages.vocoder
        self.frontend = stages.frontend
        self.prompt_caches = stages.prompt_caches
        self.sample_rate = int(self.manifest.sample_rate)
        self.scheduler = LMScheduler(self.lm, config.lm_batch_rows) if config.lm_batch_rows else None
        # which backend runs each graph (the flow stage was opened by the same plan: Family.load_flow)
        self.plan = family.backend_plan(config.backend)

    @classmethod
    def load(cls, model_dir: str | Path, config: EngineConfig | None = None) -> Engine:
        """Check the machine, then load every stage of ``model_dir`` (graphs memory-mapped)."""
        config = (config or EngineConfig()).validate()
        hw = detect()
        hw.check_cpu()  # before onnxruntime is imported: no 'Illegal instruction'
        if config.malloc_mmap_threshold_kb and fix_mmap_threshold(config.malloc_mmap_threshold_kb << 10):
            logger.debug("glibc mmap threshold fixed at %d KiB", config.malloc_mmap_threshold_kb)
        if config.malloc_arenas and limit_arenas(config.malloc_arenas):
            logger.debug("glibc malloc limited to %d heaps", config.malloc_arenas)
        threads = config.threads or hw.threads(config.leave_cores)
        t0 = time.perf_counter()
        model_dir = Path(model_dir)
        m = Manifest.load(model_dir, check_hashes=config.verify_hashes)
        family = family_for(m)
        sessions = SessionConfig(
            threads=threads,
            spinning=config.spinning,
            max_shapes=config.compiled_shapes,
            release_weight_pages=config.release_weight_pages,
        )
        stages = family.load(model_dir, config, sessions)
        for note in hw.notes:
            logger.info("%s", note)
        for warning in hw.model_warnings(m, config.streaming_estimator):
            logger.warning("%s", warning)
        logger.info(
            "loaded %s (%s, recipe %s) in %.2f s, %d threads",
            model_dir,
            family.name,
            m.recipe["name"],
            time.perf_counter() - t0,
            threads,
        )
        engine = cls(model_dir, family, stages, config, threads)
        for line in describe(engine.plan):
            logger.info("backend plan: %s", line)
        return engine

    def close(self) -> None:
        """Stop the LM scheduler's thread, if any (requests still running end with an error), and wait for the
        background compile of the flow estimator, if one is running (nothing of the engine runs after close).
        ``with Engine.load(...) as engine:`` closes it on every way out of the block."""
        if self.scheduler is not None:
            self.scheduler.close()
        self.family.wait_warm()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ voices

    def make_voice(self, prompt: AudioSource, prompt_text: str = "", name: str = "voice") -> Voice:
        """A :class:`~cosyvoice_cpu.voices.voice.Voice` from prompt audio and its transcript (see ``Frontend``).

        Raises ConfigError (besides the frontend's) when the prompt is too long to leave the LM's KV cache room
        for text: such a voice could never speak, so it is refused now rather than at every request.
        """
        voice = self.frontend.make_voice(prompt, prompt_text, name)
        self.segment_cap(self.lm_prompt(voice), minimum=1)
        return voice

    def builtin_voices(self) -> dict[str, Voice]:
        """The model directory's built-in speakers (CosyVoice-300M-SFT/-Instruct: ``中文女``, ...), by name."""
        directory = self.model_dir / VOICES_DIR
        return {p.stem: Voice.load(p) for p in sorted(directory.glob("*.npz"))} if directory.is_dir() else {}

    # ------------------------------------------------------------------ synthesis

    def lm_prompt(self, voice: Voice, instruct: str | None = None, normalize: bool = True) -> LMPrompt:
        """(prompt text ids, prompt speech tokens, x-vector or None) the LM sees for ``voice`` in this mode (the
        family's rules: :meth:`~cosyvoice_cpu.families.base.Family.lm_prompt`)."""
        return self.family.lm_prompt(self.tokenizer, voice, instruct, normalize)

    @property
    def facts(self) -> FamilyFacts:
        """The model family's facts (:mod:`cosyvoice_cpu.facts`)."""
        return self.family.facts

    @property
    def fill_token(self) -> int:
        """The LM's fill token (it asks for more text in a text stream); ConfigError for a family without one."""
        if self.facts.fill_offset is None:
            raise ConfigError(f"{self.facts.title} was not trained on a text stream (no fill token)")
        return self.lm.facts.speech_token_size + self.facts.fill_offset

    @property
    def token_rate(self) -> float:
        """Speech tokens per second of audio (the family's: 25, or 50 for CosyVoice-300M)."""
        return float(self.family.facts.token_rate)

    @property
    def loaded(self) -> bool:
        """Always True: this engine holds its models until :meth:`close` (``--unload-after`` wraps it in one that
        releases them, :class:`~cosyvoice_cpu.server.unload.UnloadingEngine`)."""
        return True

    @property
    def kv_cache_positions(self) -> int:
        """Positions of the LM's KV cache (the export's ``--max-len``): prompt, text and speech must fit in it."""
        return int(self.lm.session.spec.max_len)

    def segment_cap(
        self, prompt: LMPrompt, max_tokens: int | None = None, minimum: int = 8, ratio: float | None = None
    ) -> int:
        """Text tokens per LM call so that ``prompt`` (:meth:`lm_prompt`) + text + the longest speech fits the KV
        cache (speech: ``max_tokens``, else ``ratio`` (``SynthesisConfig.forced_token_ratio``) or the model's
        largest ratio times the text); ConfigError when that leaves fewer than ``minimum`` (a prompt or
        instruction too long)."""
        facts = self.lm.facts
        free = self.lm.session.spec.max_len - (
            2 + len(prompt.text_ids) + len(prompt.speech) + (prompt.speaker is not None)
        )
        cap = int(free - max_tokens if max_tokens else free // (1 + (ratio or facts.max_token_text_ratio)))
        if cap < minimum:
            raise ConfigError(
                f"the voice prompt leaves room for only {max(cap, 0)} text tokens in the KV cache (max_len "
                f"{self.lm.session.spec.max_len}); use a shorter prompt or re-export with a larger --max-len"
            )
        return min(SEGMENT_TOKENS, cap)

    def synthesize(
        self,
        text: str | Iterable[str],
        voice: Voice,
        config: SynthesisConfig | None = None,
        instruct: str | None = None,
        timings: Timings | None = None,
        check: Callable[[], None] | None = None,
    ) -> Iterator[AudioChunk]:
        """Speak ``text`` with ``voice``; yields :class:`AudioChunk` s (``final`` on the last).

        ``text`` may be an iterable of pieces (a generator of an LLM's reply, as the official code takes it): it
        is read in a background thread and spoken as it comes (:meth:`open_text_stream`).

        One chunk per sentence, or with ``config.stream`` several per sentence as speech tokens are decoded
        (first after ``first_chunk_tokens`` tokens). Raises ConfigError at once for bad parameters, empty
        text, a voice from another model or streaming on an engine loaded without the chunk estimator.
        ``check`` is called after every speech token and may raise to abandon the request (a server's
        cancellation and timeout); the exception comes out of the iteration.
        """
        if not isinstance(text, str) and isinstance(text, Iterable):  # text as it is written (a generator)
            stream = self.open_text_stream(voice, config, instruct, check, timings)
            return pump(stream, text)
        config = self._checked_request(voice, config)
        prompt = self.lm_prompt(voice, instruct, config.normalize)
        segments = prepare(
            text,
            self.tokenizer,
            normalize=config.normalize,
            max_tokens=self.segment_cap(prompt, config.max_tokens, ratio=config.forced_token_ratio),
        )
        lm_rng, rng = config.rngs()
        req = _Request(voice, config, prompt, RngDraw(lm_rng), self.sampling_for(config), rng, check)
        return self._run(segments, req, timings or Timings())

    def open_text_stream(
        self,
        voice: Voice,
        config: SynthesisConfig | None = None,
        instruct: str | None = None,
        check: Callable[[], None] | None = None,
        timings: Timings | None = None,
    ) -> TextStream:
        """A :class:`~cosyvoice_cpu.text_stream.TextStream` of ``voice``: ``feed(text)`` as it is written,
        ``close()`` at the end, iterate its :class:`AudioChunk` s meanwhile (from another thread). With
        ``config.stream`` CosyVoice2 and Fun-CosyVoice3 start speaking after the first few words (the official
        bi-directional streaming); otherwise each sentence is spoken once complete. Raises ConfigError at once
        as :meth:`synthesize` does."""
        config = self._checked_request(voice, config)
        return TextStream(self, voice, config, instruct, check, timings)

    def _checked_request(self, voice: Voice, config: SynthesisConfig | None) -> SynthesisConfig:
        """The validated config; ConfigError for a voice of another model or streaming without its graph."""
        config = (config or SynthesisConfig()).validate()
        if config.stream:
            self.family.check_stream(self.stages)
        if not isinstance(voice, Voice):
            raise ConfigError(f"voice must be a Voice (engine.make_voice or Voice.load), got {type(voice).__name__}")
        voice.check_model(self.manifest.family, self.sample_rate)
        return config

    def _run(self, segments: Iterator[TextSegment], req: _Request, t: Timings) -> Iterator[AudioChunk]:
        start = time.perf_counter()
        seg = next(segments, None)
        produced = 0
        while seg is not None:
            following = next(segments, None)  # cheap look-ahead: the chunk of the last segment is marked final
            spoke = False
            for samples, seg_done in self._speak(seg.token_ids, req, t):
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

    def _speak(self, text_ids: list[int], req: _Request, t: Timings) -> Iterator[Piece]:
        """One sentence, whole or streamed, by the family's recipe."""
        return self.speak(self.sentence_tokens(text_ids, req), req.voice, req.config, req.rng, t, req.caches)

    def speak(
        self,
        tokens: TokenSource,
        voice: Voice,
        config: SynthesisConfig,
        rng: np.random.Generator,
        t: Timings,
        caches: RequestCaches | None = None,
    ) -> Iterator[Piece]:
        """Speak the speech tokens of ``tokens`` with the family's recipe (streamed with ``config.stream``);
        ``caches``: the request's prompt caches, shared by its sentences (None: this sentence's own)."""
        sentence = Sentence(tokens, voice, config, rng, t, {} if caches is None else caches)
        recipe = self.family.speak_stream if config.stream else self.family.speak_whole
        return recipe(sentence, self.stages)

    def sentence_tokens(self, text_ids: list[int], req: _Request) -> SentenceTokens:
        """The token source of one sentence of ``req``."""
        p, c = req.prompt, req.config
        return SentenceTokens(
            self.lm,
            self.scheduler,
            text_ids,
            p.text_ids,
            p.speech,
            p.speaker,
            req.draw,
            req.sampling,
            c.token_budget(len(text_ids)),
            req.check,
        )

    def sampling_for(self, config: SynthesisConfig) -> SamplingConfig:
        """The LM's sampling settings with the request's overrides (``top_p``, ``top_k``, ``win_size``, ``tau_r``)."""
        base = self.lm.sampling
        changes = {k: v for k in ("top_p", "top_k", "win_size", "tau_r") if (v := getattr(config, k)) is not None}
        return replace(base, **changes) if changes else base

    def synthesize_wav(
        self, text: str, voice: Voice, config: SynthesisConfig | None = None, instruct: str | None = None
    ) -> np.ndarray:
        """All of :meth:`synthesize` as one (N,) float32 array at :attr:`sample_rate`."""
        chunks = [c.samples for c in self.synthesize(text, voice, config, instruct)]
        return np.concatenate(chunks).astype(np.float32)
