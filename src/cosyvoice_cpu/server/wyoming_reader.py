"""Reading a Wyoming connection: :class:`BoundedReader` refuses an event's announced data or payload length past the
server's limit before reading it; :func:`linger` ends a connection the server refused in order, so the client reads
the ``error`` it was sent.

A socket closed with input still unread sends a reset instead of an orderly end. A client that sent a refused event
with a payload behind it (or anything after an event the server answered with an error) has unread bytes on the
server's side, and its asyncio reader raises the reset before handing over the error line it had already received:
it never learns why. Lingering half-closes the connection (the client sees the error, then the end) and reads and
drops what the client still sends, for at most :data:`LINGER_SECONDS` and :data:`LINGER_BYTES`, before the close.
"""

from __future__ import annotations

import asyncio

LINGER_SECONDS = 2.0  # the longest a refused client's remaining input is read and dropped before the close
LINGER_BYTES = 16 << 20  # ... and the most bytes


class BoundedReader:
    """The connection's StreamReader as ``async_read_event`` uses it, refusing data or payload lengths over
    ``limit`` (bytes) before reading them; remembers why it stopped (:meth:`problem`)."""

    def __init__(self, reader: asyncio.StreamReader, limit: int) -> None:
        self.reader, self.limit = reader, limit
        self.line = b""
        self.refused: str | None = None

    async def readline(self) -> bytes:
        try:
            self.line = await self.reader.readline()
        except ValueError:  # the header line ran past the reader's buffer limit (64 KiB)
            self.refused = "an event header line longer than 64 KiB"
            raise
        return self.line

    async def readexactly(self, n: int) -> bytes:
        if not isinstance(n, int) or n > self.limit:
            self.refused = f"an event announcing {n!r} bytes of data or payload (this server takes {self.limit})"
            raise ValueError(self.refused)
        return await self.reader.readexactly(n)

    def problem(self) -> str | None:
        """Why the last read gave no event although the connection did not end cleanly (None: it ended)."""
        if self.refused:
            return self.refused
        if self.line:
            return f"a malformed event header: {self.line[:120]!r}"
        return None


async def linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Half-close ``writer`` and read and drop ``reader``'s input until the client ends it, :data:`LINGER_SECONDS`
    pass or :data:`LINGER_BYTES` were dropped (module docstring). The caller closes the connection afterwards; a
    connection already closing, or a reader another coroutine waits on, is left as it is."""
    if writer.is_closing():
        return
    loop = asyncio.get_running_loop()
    deadline, dropped = loop.time() + LINGER_SECONDS, 0
    try:
        if writer.can_write_eof():
            writer.write_eof()
        while dropped < LINGER_BYTES and (left := deadline - loop.time()) > 0:
            chunk = await asyncio.wait_for(reader.read(1 << 16), left)
            if not chunk:
                break
            dropped += len(chunk)
    except (TimeoutError, asyncio.TimeoutError, ConnectionError, OSError, RuntimeError):
        pass  # the client went quiet or away, or another read is pending: close as it is
