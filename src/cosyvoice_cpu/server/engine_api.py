"""What the servers ask of an engine: :class:`SpeechEngine`, the public face both the
:class:`~cosyvoice_cpu.engine.Engine` and the ``--unload-after``
:class:`~cosyvoice_cpu.server.unload.UnloadingEngine` give. The HTTP routes, the text stream WebSocket and the
Wyoming server use these names only: no private attribute, no ``hasattr``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from cosyvoice_cpu.audio.io import AudioSource

if TYPE_CHECKING:
    from cosyvoice_cpu.config import AudioChunk, SynthesisConfig
    from cosyvoice_cpu.engine import Timings
    from cosyvoice_cpu.families.base import LMPrompt
    from cosyvoice_cpu.flow.prompt_caches import PromptCaches
    from cosyvoice_cpu.lm.scheduler import LMScheduler
    from cosyvoice_cpu.manifest import Manifest
    from cosyvoice_cpu.voices.voice import Voice

PromptAudio = AudioSource  # a path, bytes, a binary file object, or (samples, sample_rate)


class SpokenTextStream(Protocol):
    """An open text stream: ``feed`` text as it is written, ``close`` at its end (or ``cancel``), and iterate its
    audio chunks meanwhile (from another thread); the last chunk is empty with ``final`` set."""

    def feed(self, text: str) -> None: ...

    def close(self) -> None: ...

    def cancel(self) -> None: ...

    def __iter__(self) -> Iterator[AudioChunk]: ...


class SpeechEngine(Protocol):
    """The engine as the servers see it (the names and meanings of :class:`~cosyvoice_cpu.engine.Engine`)."""

    @property
    def model_dir(self) -> Path: ...

    @property
    def manifest(self) -> Manifest: ...

    @property
    def sample_rate(self) -> int: ...

    @property
    def token_rate(self) -> float: ...

    @property
    def kv_cache_positions(self) -> int: ...

    @property
    def scheduler(self) -> LMScheduler | None:
        """The LM scheduler whose counters the metrics read (None without one, or while released)."""

    @property
    def prompt_caches(self) -> PromptCaches | None:
        """The voices' streaming caches whose memory the metrics read (None for a family without them, or while
        released)."""

    @property
    def loaded(self) -> bool:
        """Whether the models hold their memory (False while ``--unload-after`` has released them)."""

    def builtin_voices(self) -> dict[str, Voice]: ...

    def make_voice(self, prompt: PromptAudio, prompt_text: str = "", name: str = "voice") -> Voice: ...

    def lm_prompt(self, voice: Voice, instruct: str | None = None, normalize: bool = True) -> LMPrompt: ...

    def segment_cap(
        self, prompt: LMPrompt, max_tokens: int | None = None, minimum: int = 8, ratio: float | None = None
    ) -> int: ...

    def synthesize(
        self,
        text: str | Iterable[str],
        voice: Voice,
        config: SynthesisConfig | None = None,
        instruct: str | None = None,
        timings: Timings | None = None,
        check: Callable[[], None] | None = None,
    ) -> Iterator[AudioChunk]: ...

    def open_text_stream(
        self,
        voice: Voice,
        config: SynthesisConfig | None = None,
        instruct: str | None = None,
        check: Callable[[], None] | None = None,
        timings: Timings | None = None,
    ) -> SpokenTextStream: ...

    def close(self) -> None: ...
