"""The Wyoming protocol server (Home Assistant's way to plug in a TTS engine), on the HTTP server's engine.

``cosyvoice-cpu wyoming`` serves it alone; ``serve --wyoming URI`` beside the HTTP API in one process, on the same
:class:`~cosyvoice_cpu.server.state.State`: one engine (one copy of the model, one LM scheduler batching the
requests of both protocols), one admission (``--max-active``/``--max-queue`` count both), one voice store (a voice
uploaded over HTTP is in the next ``describe``). The framing and events are the ``wyoming`` package's (the
``[wyoming]`` extra); the handler of one connection is :mod:`cosyvoice_cpu.server.wyoming_handler`.

What a connection can cost is bounded: an event's JSON data and payload (``data_length``/``payload_length``) are
refused past :attr:`WyomingOptions.max_event_bytes` before they are read, at most ``max_connections`` are open, a
connection idle for ``idle_timeout`` seconds is closed, and syntheses pass the HTTP server's admission, timeout
and audio bound (docs/wyoming.md).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from cosyvoice_cpu.errors import ConfigError, MissingExtraError, need

if TYPE_CHECKING:
    from wyoming.info import Info
    from wyoming.server import AsyncServer
    from zeroconf.asyncio import AsyncZeroconf

    from cosyvoice_cpu.server.state import State
    from cosyvoice_cpu.server.wyoming_handler import CosyVoiceHandler

logger = logging.getLogger(__name__)

SERVICE_TYPE = "_wyoming._tcp.local."  # what Home Assistant's zeroconf discovery browses for
PROGRAM = "cosyvoice-cpu"
ATTRIBUTION = ("FunAudioLLM CosyVoice, on CPU by cosyvoice-cpu", "https://github.com/FunAudioLLM/CosyVoice")


def need_wyoming() -> None:
    """MissingExtraError when the ``wyoming`` package is not installed."""
    try:
        import wyoming  # noqa: F401
    except ImportError as e:
        message = "the Wyoming server needs the [wyoming] extra: pip install 'cosyvoice-cpu[wyoming]'"
        raise MissingExtraError(message) from e


@dataclass
class WyomingOptions:
    """How the Wyoming server behaves (``--wyoming``/``wyoming --uri`` and the flags beside it).

    Attributes:
        uri: ``tcp://HOST:PORT``, ``unix://PATH`` or ``stdio://`` (the ``wyoming`` package's servers).
        samples_per_chunk: samples in one ``audio-chunk`` event (16-bit mono at the model's rate).
        zeroconf: advertise the server over mDNS as ``NAME._wyoming._tcp.local.`` (tcp only); None: not.
        idle_timeout: seconds a connection may send nothing while nothing of it runs, before it is closed.
        max_connections: connections open at once; more get an ``error`` event and are closed.
        max_event_bytes: the largest JSON data or payload one event may announce (0: from the text limit).
    """

    uri: str = "tcp://127.0.0.1:10200"
    samples_per_chunk: int = 1024
    zeroconf: str | None = None
    idle_timeout: float = 60.0
    max_connections: int = 64
    max_event_bytes: int = 0

    def validate(self, max_input_chars: int = 4096) -> WyomingOptions:
        parsed = urlparse(self.uri)
        need(
            parsed.scheme in ("tcp", "unix", "stdio"),
            "Wyoming URI",
            self.uri,
            "tcp://HOST:PORT, unix://PATH or stdio://",
        )
        if parsed.scheme == "tcp":
            try:
                port = parsed.port
            except ValueError:
                port = None
            need(bool(parsed.hostname) and port is not None, "Wyoming URI", self.uri, "tcp://HOST:PORT with a port")
        if self.zeroconf is not None and parsed.scheme != "tcp":
            raise ConfigError(f"--zeroconf advertises a tcp:// server; {self.uri!r} is not one")
        need(64 <= self.samples_per_chunk <= 1 << 20, "samples_per_chunk", self.samples_per_chunk, "64 to 1048576")
        need(0 < self.idle_timeout <= 86_400, "idle_timeout", self.idle_timeout, "above 0, at most 86400 seconds")
        need(1 <= self.max_connections <= 100_000, "max_connections", self.max_connections, "1 to 100000")
        if not self.max_event_bytes:  # the text at 12 bytes a character (JSON escapes), and room for the rest
            self.max_event_bytes = 12 * max_input_chars + (64 << 10)
        need(self.max_event_bytes >= 1024, "max_event_bytes", self.max_event_bytes, "at least 1024")
        return self

    @property
    def scheme(self) -> str:
        return urlparse(self.uri).scheme


class WyomingService:
    """The Wyoming server of one :class:`~cosyvoice_cpu.server.state.State` (the HTTP server's, or one made for it
    alone): starts and stops the ``wyoming`` package's server and the zeroconf advertisement, counts connections,
    and says what the server offers (:meth:`info`)."""

    def __init__(self, state: State, options: WyomingOptions) -> None:
        need_wyoming()
        self.state, self.options = state, options.validate(state.settings.max_input_chars)
        self.connections = 0
        self.handlers: set[CosyVoiceHandler] = set()
        self.server: AsyncServer | None = None
        self.zeroconf: AsyncZeroconf | None = None

    def handler(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> CosyVoiceHandler:
        """The handler of one new connection (the ``wyoming`` server's handler factory)."""
        from cosyvoice_cpu.server.wyoming_handler import CosyVoiceHandler

        return CosyVoiceHandler(self, reader, writer)

    async def start(self) -> None:
        """Listen (tcp/unix: returns at once) and advertise over zeroconf when asked. Inside the running loop, after
        the state's admission exists."""
        from wyoming.server import AsyncServer

        self.server = AsyncServer.from_uri(self.options.uri)
        await self.server.start(self.handler)
        logger.info("Wyoming server on %s", self.options.uri)
        if self.options.zeroconf is not None:
            self.zeroconf = await advertise(self.options.uri, self.options.zeroconf)

    async def run_stdio(self) -> None:
        """Serve one client over stdin/stdout until it closes them, then wait for its running synthesis."""
        from wyoming.server import AsyncServer

        self.server = AsyncServer.from_uri("stdio://")
        handlers: list[CosyVoiceHandler] = []

        def make(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> CosyVoiceHandler:
            handlers.append(self.handler(reader, writer))
            return handlers[-1]

        await self.server.run(make)
        for h in handlers:
            await h.finish()

    async def stop(self) -> None:
        """Stop advertising and listening; every connection is closed and its synthesis cancelled."""
        if self.zeroconf is not None:
            try:
                await self.zeroconf.async_close()
            except Exception as e:  # discovery is a convenience: never let it block the exit
                logger.warning("zeroconf did not close cleanly: %s", e)
            self.zeroconf = None
        for h in list(self.handlers):
            await h.close()
        if self.server is not None:
            await self.server.stop()

    def info(self) -> Info:
        """The ``info`` event's :class:`wyoming.info.Info`: one TTS program with every saved and built-in voice,
        each speaking the family's languages. Reads the voices directory: call it off the event loop."""
        from wyoming.info import Attribution, Info, TtsProgram, TtsVoice

        from cosyvoice_cpu import __version__
        from cosyvoice_cpu.facts import facts

        state = self.state
        fam = facts(state.engine.manifest.family)
        made_by = Attribution(name=ATTRIBUTION[0], url=ATTRIBUTION[1])
        voices = []
        for name in state.voices.names():
            builtin = name in state.voices.builtin
            voices.append(
                TtsVoice(
                    name=name,
                    attribution=made_by,
                    installed=True,
                    description=f"{name} (built-in speaker)" if builtin else name,
                    version=None,
                    languages=list(fam.languages),
                )
            )
        program = TtsProgram(
            name=PROGRAM,
            attribution=made_by,
            installed=True,
            description=f"{fam.title} ({state.model_id}), {state.engine.sample_rate} Hz, on CPU",
            version=__version__,
            voices=voices,
            supports_synthesize_streaming=True,
        )
        return Info(tts=[program])


def _advertised_host(uri: str) -> str | None:
    """The address to advertise for a tcp URI: its host when it is one address, None (the package detects the
    outgoing one) when it is a wildcard or a name."""
    host = urlparse(uri).hostname or ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return None if address.is_unspecified or address.version != 4 else host


async def advertise(uri: str, name: str) -> AsyncZeroconf | None:
    """Register ``NAME._wyoming._tcp.local.`` for the server at ``uri`` with the ``wyoming`` package's zeroconf
    helper (needs ``zeroconf``); returns the AsyncZeroconf to close at stop, or None when it could not bind (the
    server goes on without discovery; Home Assistant can still be given the host and port)."""
    try:
        from wyoming.zeroconf import HomeAssistantZeroconf
    except ImportError as e:
        raise MissingExtraError("--zeroconf needs the zeroconf package: pip install 'cosyvoice-cpu[wyoming]'") from e
    port = urlparse(uri).port
    try:
        helper = HomeAssistantZeroconf(port=port, name=name or None, host=_advertised_host(uri))
        await helper.register_server()
    except OSError as e:
        logger.error("zeroconf: could not advertise %s on this network (%s); add the server by host and port", uri, e)
        return None
    logger.info("zeroconf: advertised %s.%s at %s:%s", helper.name, SERVICE_TYPE, helper.host, port)
    return getattr(helper, "_aiozc", None)


async def serve_alone(state: State, options: WyomingOptions) -> None:
    """``cosyvoice-cpu wyoming``: the Wyoming server on ``state`` until SIGINT/SIGTERM (stdio: until stdin ends)."""
    import signal

    from cosyvoice_cpu.server.speech import Admission

    settings = state.settings
    state.admission = Admission(settings.max_active, settings.max_queue)
    service = WyomingService(state, options)
    try:
        if options.scheme == "stdio":
            await service.run_stdio()
            return
        await service.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        logger.info("stopping the Wyoming server")
    finally:
        state.admission.draining = True
        state.admission.heap_trim.close()
        await service.stop()
        for job in list(state.jobs):
            job.cancel.set()
        state.executor.shutdown(wait=False)
