"""What every part of the server shares: :class:`ServerSettings` (the ``serve`` flags) and :class:`State` (engine,
settings, voices, metrics, admission, the worker pool), below the routes that use them (``server.app`` builds the app
on them; ``server.routes``, ``server.voice_routes``, ``server.openapi`` and the Wyoming server read them).
"""

from __future__ import annotations

import asyncio
import logging
import time
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from cosyvoice_cpu.config import SynthesisConfig
from cosyvoice_cpu.errors import need
from cosyvoice_cpu.server.identity import ReplicaInfo
from cosyvoice_cpu.server.metrics import Metrics
from cosyvoice_cpu.server.speech import Admission, AudioBound, Job
from cosyvoice_cpu.server.voices import VoiceStore
from cosyvoice_cpu.voices.voice import check_name

if TYPE_CHECKING:
    from cosyvoice_cpu.server.engine_api import SpeechEngine

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    """How the server behaves (``cosyvoice-cpu serve`` flags).

    Attributes:
        voices_dir: saved voices (``NAME.npz``), shared with ``cosyvoice-cpu voice``.
        model_id: the id of the loaded model in ``/v1/models`` (default: the model directory's name).
        api_key: when set, ``/v1/*`` and ``/metrics`` need ``Authorization: Bearer <api_key>``.
        max_active: syntheses run at once (their LM steps are batched); max_queue: more wait, then 429.
        timeout: seconds a synthesis may run before it is stopped (504, or the stream ends).
        max_input_chars, max_instructions_chars, max_prompt_chars: longest ``input``, ``instructions`` and voice
            ``prompt_text``; max_upload_mb: largest voice upload.
        host: the address the server is bound to; allow_hosts: more Host header names served (``*``: any);
            allow_origins: more browser origins that may send writes (``server.guard``).
        default_voice: the saved voice OpenAI's voice names (``alloy``, ...) speak with (None: they are refused).
        body_timeout: seconds a request body may take to arrive after its headers (408 beyond).
        max_audio_seconds, max_audio_per_char: the most audio one request may produce, and per input character
            (``server.speech.AudioBound``; 422 ``audio_too_long`` beyond).
        stream_idle_timeout: seconds a text stream's WebSocket (``/v1/audio/speech/stream``) may go without a
            message from its client while no audio is being sent, before it is closed (code 4408).
        defaults: the synthesis settings a request starts from.
    """

    voices_dir: Path
    model_id: str = ""
    api_key: str | None = None
    max_active: int = 8
    max_queue: int = 32
    timeout: float = 300.0
    max_input_chars: int = 4096
    max_instructions_chars: int = 1000
    max_prompt_chars: int = 1000
    max_upload_mb: float = 20.0
    host: str = "127.0.0.1"
    allow_hosts: tuple[str, ...] = ()
    allow_origins: tuple[str, ...] = ()
    default_voice: str | None = None
    body_timeout: float = 60.0
    max_audio_seconds: float = 1200.0
    max_audio_per_char: float = 0.6
    stream_idle_timeout: float = 30.0
    defaults: SynthesisConfig = field(default_factory=SynthesisConfig)

    @property
    def audio_bound(self) -> AudioBound:
        """The audio one request may produce (``--max-audio-per-char``, ``--max-audio-seconds``)."""
        return AudioBound(per_char_s=self.max_audio_per_char, max_s=self.max_audio_seconds)

    @property
    def max_body_bytes(self) -> int:
        """The largest JSON body taken (413 beyond): room for the text fields at 12 bytes a character (JSON
        escapes of astral characters), at least 2 MiB, so an over-long field gets the 400 that names it."""
        return max(2 << 20, 12 * (self.max_input_chars + self.max_instructions_chars) + (64 << 10))

    @property
    def max_message_bytes(self) -> int:
        """The largest WebSocket message taken (the connection is closed with 1009 beyond, before the rest of it
        is read): a text stream's start message with the longest instructions, or a text piece of the whole
        input, at 12 bytes a character, plus room for the other fields."""
        return (16 << 10) + 12 * (self.max_input_chars + self.max_instructions_chars)

    def validate(self) -> ServerSettings:
        checks = [
            (1 <= self.max_active <= 256, "max_active", "1 to 256"),
            (0 <= self.max_queue <= 10_000, "max_queue", "0 to 10000"),
            (0 < self.timeout <= 86_400, "timeout", "above 0, at most 86400 seconds"),
            (1 <= self.max_input_chars <= 1_000_000, "max_input_chars", "1 to 1000000"),
            (1 <= self.max_instructions_chars <= 100_000, "max_instructions_chars", "1 to 100000"),
            (1 <= self.max_prompt_chars <= 100_000, "max_prompt_chars", "1 to 100000"),
            (0 < self.max_upload_mb <= 1024, "max_upload_mb", "above 0, at most 1024"),
            (0 < self.body_timeout <= 86_400, "body_timeout", "above 0, at most 86400 seconds"),
            (1 <= self.max_audio_seconds <= 86_400, "max_audio_seconds", "1 to 86400 seconds"),
            (0 < self.max_audio_per_char <= 60, "max_audio_per_char", "above 0, at most 60 seconds"),
            (0 < self.stream_idle_timeout <= 86_400, "stream_idle_timeout", "above 0, at most 86400 seconds"),
        ]
        for ok, name, rule in checks:
            need(ok, f"server setting {name}", getattr(self, name), rule)
        if self.default_voice is not None:  # stored as the server stores voice names (server.checks.voice_name)
            self.default_voice = check_name(unicodedata.normalize("NFKC", self.default_voice))
        self.allow_hosts, self.allow_origins = tuple(self.allow_hosts), tuple(self.allow_origins)
        self.defaults.validate()
        return self


class Service(Protocol):
    """Another server on the app's state (the Wyoming server): started and stopped with the app."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class State:
    """What the handlers share: engine, settings, voices, metrics, admission, the worker pool."""

    def __init__(self, engine: SpeechEngine, settings: ServerSettings) -> None:
        self.engine, self.settings = engine, settings
        self.model_id = settings.model_id or Path(engine.model_dir).name
        builtin = engine.builtin_voices()  # CosyVoice-300M-SFT speakers ({} for other models)
        self.voices = VoiceStore(settings.voices_dir, engine.manifest.family, engine.sample_rate, builtin)
        self.metrics = Metrics()
        self.admission: Admission | None = None  # made inside the event loop (lifespan)
        self.executor = ThreadPoolExecutor(settings.max_active, thread_name_prefix="synth")
        self.voice_lock: asyncio.Lock | None = None  # voices are made one at a time (made in the lifespan)
        self.started = time.time()
        self.jobs: set[Job] = set()  # running syntheses, cancelled at shutdown
        self.replica = ReplicaInfo()  # which replica answers (create_app sets it)
        self.services: list[Service] = []  # more servers on this state (Wyoming), started and stopped in the lifespan
        self.text_streams = 0  # open text stream WebSockets (server.text_ws)

    def drop_stale_voice_caches(self) -> int:
        """Drop the engine's streaming caches of voices no longer served; the bytes freed. Called after this
        process deletes or replaces a voice, or is asked to delete one that is gone (a voice deleted through another
        replica is dropped here then, at this replica's next voice change, or by the LRU's budget before that)."""
        caches = self.engine.prompt_caches
        return 0 if caches is None else caches.retain(self.voices.fingerprints())
