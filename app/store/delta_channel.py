"""The live deltas' own connection (docs/adr/0007-live-output-deltas.md): the publisher's hold
on a dedicated asyncpg connection in autocommit (each statement its own transaction), never one
of the engine's pooled connections, so sending a delta shares nothing with the fenced writes of
the runs it reports. Its statements are app/store/sql/deltas.sql; the payloads it sends are
packed by app/vocabulary/live_deltas.py.
"""

from __future__ import annotations

import asyncpg

from app.store.database import positional
from app.store.engine import plain_url


class DeltaChannel:
    """A dedicated autocommit connection that sends delta payloads and reads the cluster's
    notification queue usage."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self._publish, _ = positional("publish_deltas")
        self._usage, _ = positional("notification_queue_usage")

    @classmethod
    async def connect(cls, url: str, *, application_name: str) -> DeltaChannel:
        conn = await asyncpg.connect(
            plain_url(url), timeout=10, server_settings={"application_name": application_name}
        )
        return cls(conn)

    async def send(self, payload: str) -> None:
        await self.conn.execute(self._publish, payload, timeout=5)

    async def usage(self) -> float:
        return float(await self.conn.fetchval(self._usage, timeout=5))

    @property
    def closed(self) -> bool:
        return bool(self.conn.is_closed())

    async def close(self) -> None:
        if not self.conn.is_closed():
            await self.conn.close(timeout=2)
