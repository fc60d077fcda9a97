"""The family seam of the runtime: one small class per model family, built once from the manifest's family.

The engine asks its :class:`Family` for everything that differs between families and never tests a family's
name (the shape sherpa-onnx uses in ``OfflineTtsImpl::Create``):

- :meth:`Family.load`: the stages of an exported directory (:class:`Stages`), each given what it needs from the
  engine's config at construction;
- :meth:`Family.lm_prompt`: the LM's prompt rules per mode (markers, system prompt, x-vector use), from the
  family's facts (:mod:`cosyvoice_cpu.facts`);
- :meth:`Family.keep_tokens` / :meth:`Family.token_filter`: which decoded speech tokens reach the flow;
- :attr:`Family.prompt_cache`: the kind of per-voice prompt cache the streamed flow keeps (or None);
- :meth:`Family.speak_stream`: the stream recipe (whole sentences share :func:`~cosyvoice_cpu.sentence.speak_whole`).

Adding a family means one subclass of :class:`Family` in a module of its own (plus its stage classes where its
graphs differ) and one row of facts; CosyVoice2 and Fun-CosyVoice3 share the chunked stream recipe
(:class:`~cosyvoice_cpu.families.common.ChunkedFamily`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, NamedTuple

import numpy as np

from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.backends.plan import GraphPlan, plan_backends
from cosyvoice_cpu.config import EngineConfig
from cosyvoice_cpu.errors import ConfigError
from cosyvoice_cpu.facts import FamilyFacts
from cosyvoice_cpu.flow.base import FlowStage
from cosyvoice_cpu.flow.graphs import ShapedGraph
from cosyvoice_cpu.flow.prompt_caches import PromptCacheKind, PromptCaches
from cosyvoice_cpu.lm.generate import SpeechTokenGenerator
from cosyvoice_cpu.lm.session import LMSession
from cosyvoice_cpu.lm.silence import SilentRunFilter
from cosyvoice_cpu.manifest import Manifest
from cosyvoice_cpu.sentence import Piece, Sentence, speak_whole
from cosyvoice_cpu.text import TextTokenizer, normalize_text
from cosyvoice_cpu.vocoder.hift import Vocoder
from cosyvoice_cpu.voices.frontend import Frontend
from cosyvoice_cpu.voices.voice import Voice

logger = logging.getLogger(__name__)


def _warm(flow: FlowStage) -> None:
    """:meth:`FlowStage.warm` in a background thread: a failure is logged (the first sentence then compiles, or
    raises the same error where it can be reported)."""
    try:
        flow.warm()
    except Exception as e:  # a thread's error would otherwise be lost
        logger.warning("compiling the flow estimator ahead of use failed (%s); the first sentence will try again", e)


class LMPrompt(NamedTuple):
    """What the LM sees before the text: prompt text ids, prompt speech tokens (T,) int32 and the x-vector
    (192,) float32 or None."""

    text_ids: list[int]
    speech: np.ndarray
    speaker: np.ndarray | None


@dataclass
class Stages:
    """The loaded stages of one model directory (shared by every request of an engine)."""

    tokenizer: TextTokenizer
    lm: SpeechTokenGenerator
    flow: FlowStage
    vocoder: Vocoder
    frontend: Frontend
    prompt_caches: PromptCaches | None = None  # per-voice streamed-flow caches (families that keep them)


class Family:
    """What one model family does differently. Build it with :func:`cosyvoice_cpu.families.registry.family_for`.

    Subclasses set :attr:`facts` and :attr:`flow_stage`, and override the hooks whose default does not fit.
    """

    facts: ClassVar[FamilyFacts]
    flow_stage: ClassVar[type[FlowStage]]
    prompt_cache: ClassVar[PromptCacheKind | None] = None  # the streamed flow's per-voice cache

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._plans: dict[str, dict[str, GraphPlan]] = {}
        self.warming: threading.Thread | None = None  # the background compile of the flow estimator, if any

    def backend_plan(self, choice: str) -> dict[str, GraphPlan]:
        """The directory's per-graph backend plan for ``choice`` (made once: the stages and the engine's
        report see the same plan; :func:`~cosyvoice_cpu.backends.plan.plan_backends`)."""
        if choice not in self._plans:
            self._plans[choice] = plan_backends(self.manifest.graphs, choice, family=self.manifest.family)
        return self._plans[choice]

    def wait_warm(self) -> None:
        """Wait for the background compile of the flow estimator that :meth:`load` started, if any."""
        if self.warming is not None:
            self.warming.join()

    @property
    def name(self) -> str:
        return self.facts.name

    # ------------------------------------------------------------------ loading

    def load(self, model_dir: Path, config: EngineConfig, sessions: SessionConfig) -> Stages:
        """Every stage of ``model_dir``, in the order that keeps the load's peak memory low (the LM first)."""
        m = self.manifest
        lm_entry, plan = m.graphs["lm"], self.backend_plan(config.backend)["lm"]
        session = LMSession.from_dir(
            model_dir,
            lm_entry.attrs,
            graph_file=m.graphs[plan.key].file.file,
            threads=replace(sessions, backend=plan.backend),
            # an int4 ONNX LM exported before its graph said min_rows=2 still needs it
            min_rows=2 if lm_entry.precision == "int4" and not plan.other_model else None,
        )
        lm = self.load_lm(model_dir, session, sessions)
        flow = self.load_flow(model_dir, config, sessions)
        if flow.whole is not None and config.compile_ahead:
            # compile the OpenVINO estimator while the rest loads and the first text arrives. Not a daemon: the
            # interpreter joins it at exit, so a process that ends during the compile (an exception, Ctrl-C, a
            # command that never closed its engine) does not exit under it (OpenVINO's C++ runtime then aborts:
            # "terminate called without an active exception", or a segmentation fault)
            self.warming = threading.Thread(target=_warm, args=(flow,), name="flow-warm")
            self.warming.start()
        vocoder = Vocoder.from_dir(
            model_dir, m.graphs["hift_decode"].attrs, threads=sessions, window_frames=config.vocoder_window_frames
        )
        stages = Stages(TextTokenizer.from_dir(model_dir), lm, flow, vocoder, Frontend(model_dir, m, sessions))
        if self.prompt_cache is not None and flow.can_stream:
            dtype = np.float16 if config.prompt_cache_fp16 else np.float32
            stages.prompt_caches = PromptCaches(flow, config.prompt_cache_mb << 20, self.prompt_cache, dtype)
        return stages

    def load_lm(self, model_dir: Path, session: LMSession, sessions: SessionConfig) -> SpeechTokenGenerator:
        """The speech-token generator on the LM graph (the manifest's ``lm`` and ``sampling`` facts)."""
        return SpeechTokenGenerator.from_manifest(session, self.manifest)

    def load_flow(self, model_dir: Path, config: EngineConfig, sessions: SessionConfig) -> FlowStage:
        """The flow stage, with the streamed estimator when ``config.streaming_estimator``, and the whole-sentence
        estimator on the backend the plan gives it (:func:`~cosyvoice_cpu.backends.plan.plan_backends`)."""
        plan = self.backend_plan(config.backend)["flow_estimator"]
        whole = None
        if plan.other_model:
            entry = self.manifest.graphs[plan.key]
            whole = ShapedGraph(model_dir / entry.file.file, plan.backend, bool(entry.attrs.get("pad_exact")))
        flow = self.flow_stage.from_dir(
            model_dir,
            self.manifest.flow,
            threads=sessions,
            streaming=config.streaming_estimator,
            arena_shrink_frames=config.arena_shrink_frames,
            whole=whole,
        )
        flow.split_rows = config.split_rows
        return flow

    # ------------------------------------------------------------------ the LM's prompt

    def lm_prompt(
        self,
        tokenizer: TextTokenizer,
        voice: Voice,
        instruct: str | None,
        normalize: bool = True,
    ) -> LMPrompt:
        """What the LM sees per mode, as the official frontends:

        - instruct: the instruction + the end-of-prompt marker (a system prompt first where the family needs
          one and the instruction has no marker); no prompt speech, no x-vector;
        - zero-shot (a voice with a transcript): the transcript (normalized like the text when ``normalize``),
          after ``system prompt + marker`` where the family needs one and the transcript has no marker;
        - cross-lingual or a built-in speaker: ``system prompt + marker`` or nothing.

        The x-vector goes to the LM only in the families whose LM takes it (:attr:`FamilyFacts.lm_speaker`).
        """
        f = self.facts
        speaker = voice.embedding if f.lm_speaker else None
        marker, system = f.end_of_prompt, f.system_prompt
        none = np.zeros(0, np.int32)
        if instruct is not None:
            if not isinstance(instruct, str) or not instruct.strip():
                raise ConfigError("instruct must be a non-empty instruction (e.g. 'Speak happily.') or omitted")
            text = instruct.strip()
            if not text.endswith(marker):  # newer official examples already carry the marker
                text = (f"{system} {text}" if system and marker not in text else text) + marker
            return LMPrompt(tokenizer.encode(text), none, None)
        if voice.prompt_text and not voice.builtin:
            prompt = normalize_text(voice.prompt_text) if normalize else voice.prompt_text
            if system and marker not in prompt:  # as the official examples: system prompt, marker, transcript
                prompt = system + marker + prompt
            return LMPrompt(tokenizer.encode(prompt), voice.speech_tokens, speaker)
        return LMPrompt(tokenizer.encode(system + marker) if system else [], none, speaker)

    # ------------------------------------------------------------------ tokens and streams

    def token_filter(self) -> SilentRunFilter | None:
        """A fresh per-request filter of the tokens the flow sees (long silent runs), or None: all of them."""
        f = self.facts
        return SilentRunFilter(f.silent_tokens, f.max_silent_run) if f.silent_tokens else None

    def keep_tokens(self, tokens: list[int]) -> list[int]:
        """The tokens of a whole sentence that reach the flow."""
        flt = self.token_filter()
        return tokens if flt is None else list(flt.filter(tokens))

    def speak_whole(self, s: Sentence, stages: Stages) -> Iterator[Piece]:
        """One sentence in one piece."""
        return speak_whole(s, stages.flow, stages.vocoder, self.keep_tokens)

    def check_stream(self, stages: Stages) -> None:
        """Raise ConfigError when this engine cannot stream (its stream graph was not loaded)."""
        if self.prompt_cache is not None and stages.prompt_caches is None:
            raise ConfigError(
                "stream=True needs the streaming flow estimator: load the engine with "
                "EngineConfig(streaming_estimator=True)"
            )

    def speak_stream(self, s: Sentence, stages: Stages) -> Iterator[Piece]:
        """One sentence in pieces as its tokens are decoded (the family's stream recipe)."""
        raise NotImplementedError
