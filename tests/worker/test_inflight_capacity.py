"""In-flight capacity of one worker process: runs awaiting a model hold no database connection
and no queue behind an HTTP client's limit, so every slot has its model call open at once.

A real `turnstile worker` with 300 async slots serves 300 runs of the `openai` agent against a
loopback endpoint that answers nobody until all 300 requests are open together (a barrier, so
the test waits on the requests themselves, never on time). The HTTP client's default limit of
100 connections used to hold the other 200 back, and the pool used to ask for a database
connection per slot. No figure of speed is asserted: `make bench` measures those.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.core import Queue
from tests.support.processes import turnstile
from tests.support.waiting import eventually

RUNS = 300
ANSWER = json.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "model": "fake",
        "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}
        ],
    }
).encode()


class BarrierModel:
    """A chat-completions endpoint (raw HTTP/1.1 on asyncio, thousands of connections) that
    holds every request until `size` of them are open at once, then answers them all."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.open = 0
        self.peak = 0
        self.released = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":", 1)[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                self.open += 1
                self.peak = max(self.peak, self.open)
                if self.open >= self.size:
                    self.released.set()
                await self.released.wait()
                self.open -= 1
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(ANSWER) + ANSWER
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self.handle, "127.0.0.1", 0, backlog=4096)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            server.close()


async def test_every_slot_has_its_model_call_in_flight_at_once(
    database_url: str, engine: AsyncEngine
) -> None:
    model = BarrierModel(RUNS)
    queue = Queue(engine)
    await queue.enqueue_many(
        tenant_id="t",
        principal="p",
        runs=[("openai", {"text": f"question {i}"}, 10, None) for i in range(RUNS)],
    )
    async with model.serving() as base:
        env = {
            "DATABASE_URL": database_url,
            "TURNSTILE_SLOTS": f"interactive:1,async:{RUNS},maintenance:1",
            "TURNSTILE_OPENAI_BASE_URL": base,
            "TURNSTILE_OPENAI_TIMEOUT_SECONDS": "120",
            "TURNSTILE_LEASE_SECONDS": "60",
            "TURNSTILE_HEARTBEAT_SECONDS": "5",
        }
        async with turnstile("worker", ready=b"running slots", env=env):
            await asyncio.wait_for(model.released.wait(), 120)

            async def all_succeeded() -> bool:
                async with engine.connect() as conn:
                    done = await conn.execute(
                        text("SELECT count(*) FROM runs WHERE status = 'succeeded'")
                    )
                    return done.scalar_one() == RUNS

            await eventually(all_succeeded, within=120, what="every run to succeed")
            async with engine.connect() as conn:
                held = (
                    await conn.execute(
                        text(
                            "SELECT count(*) FROM pg_stat_activity "
                            "WHERE datname = current_database() "
                            "AND application_name LIKE 'turnstile worker%'"
                        )
                    )
                ).scalar_one()
    assert model.peak == RUNS
    # Sized for statements, not slots: far fewer connections than runs in flight.
    assert held <= 30
    async with engine.connect() as conn:
        lost = await conn.execute(
            text("SELECT count(*) FROM run_events WHERE type IN ('run.requeued', 'run.fenced')")
        )
        assert lost.scalar_one() == 0
