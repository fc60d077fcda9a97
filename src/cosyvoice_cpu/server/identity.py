"""Which replica answered: :class:`ReplicaInfo` (``/health``'s replica fields) and the ``X-Replica`` header.

Every response of the server carries ``X-Replica`` (plain ASGI middleware, outermost, so errors made by the other
middleware carry it too), and ``/health`` says which replica answered, its pid and how many replicas serve the
app. A plain server is replica ``<hostname>`` of 1 (a container's or pod's name behind a load balancer); under
Ray Serve (:mod:`cosyvoice_cpu.server.replicas`) the id is Serve's replica tag and the count is Serve's.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cosyvoice_cpu.jsontypes import JsonObject

if TYPE_CHECKING:
    from starlette.types import ASGIApp

logger = logging.getLogger(__name__)

REPLICA_HEADER = "X-Replica"


def _one() -> int | None:
    return 1


@dataclass
class ReplicaInfo:
    """This process as a replica: its id (``X-Replica``), pid, and a callable giving the replica count."""

    id: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    count: Callable[[], int | None] = _one

    def health(self) -> JsonObject:
        """The fields ``/health`` adds (the count is None when it cannot be had)."""
        try:
            replicas = self.count()
        except Exception as e:  # a count that cannot be had never breaks /health
            logger.debug("replica count failed: %s", e)
            replicas = None
        return {"replica": self.id, "pid": self.pid, "replicas": replicas}


class ReplicaHeaderMiddleware:
    """Plain ASGI: every HTTP response gets ``X-Replica: <id>``."""

    def __init__(self, app: ASGIApp, info: ReplicaInfo) -> None:
        self.app, self.value = app, info.id.encode("latin-1", "replace")

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-replica", self.value)]}
            await send(message)

        await self.app(scope, receive, tagged)
