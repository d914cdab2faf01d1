"""What one HTTP connection may hold the server for, before the app sees a request: a deadline
for each request's line and headers.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but gives a request's head no
deadline: a client that sends its headers a byte at a time (slowloris), or opens a connection
and sends nothing, holds a socket and a file descriptor for as long as it likes. `HeadDeadline`
is uvicorn's httptools protocol with one: from the moment a connection opens, and from the first
byte of every later request on it, the head must be complete within `head_timeout_seconds`, or
the connection is closed. Nothing was handed to the app yet, so there is nothing to answer and
nothing to undo. The body has its own deadline, enforced in the app (app/api/limits.py).

It leans on three things of uvicorn's protocol that have held since 0.30 (tests/
test_http_limits.py checks them end to end): `connection_made`, `data_received` and the
parser's `on_headers_complete` callback, and `cycle`, the request being answered.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("turnstile.api")


def head_deadline_protocol(head_timeout_seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's `http` protocol class, with a deadline of `head_timeout_seconds` per head."""

    class HeadDeadline(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            # Bytes while no request is being answered are a head arriving: from its first byte
            # it has the deadline (the keep-alive timer covered the silence before it).
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()
            super().data_received(data)  # may complete the head: on_headers_complete disarms

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(head_timeout_seconds, self._head_too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                log.debug(
                    "closed a connection whose request head took over %s s",
                    head_timeout_seconds,
                    extra={"client": self.client[0] if self.client else None},
                )
                self.transport.close()

    return HeadDeadline
