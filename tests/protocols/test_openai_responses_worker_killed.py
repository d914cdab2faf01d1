"""A streamed response whose worker is SIGKILLed mid-text, with real processes (`turnstile serve
--no-workers` and `turnstile worker`) and the official `openai` SDK: the run is claimed again
under a new epoch, the response completes once, and the stream shows no duplicated text (the
abandoned claim's item is closed `incomplete`, the re-run's text is its own item, never
appended to it); the stream read again from the start shows the completed answer once."""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.protocols.openai_responses import EPOCH_STRIDE, block_base, run_id_of
from app.security.api_keys import create_key
from app.store.embedded import free_port
from tests.support.processes import turnstile

ANSWER = "a long answer, said word by word, so that the worker dies before its end " * 2


async def test_a_worker_killed_mid_stream_completes_the_response_once(
    database_url: str, engine: AsyncEngine
) -> None:
    key = (await create_key(engine, tenant_id="acme", principal="alice")).secret
    port = free_port()
    env = {
        "DATABASE_URL": database_url,
        "TURNSTILE_LEASE_SECONDS": "2",
        "TURNSTILE_HEARTBEAT_SECONDS": "0.5",
        "TURNSTILE_SWEEP_INTERVAL_SECONDS": "0.3",
        "TURNSTILE_RETRY_BACKOFF_BASE_SECONDS": "0.1",
        "TURNSTILE_POLL_INTERVAL_SECONDS": "0.5",
    }
    serve = ("serve", "--no-workers", "--port", str(port))
    async with (
        turnstile(*serve, ready=b"Uvicorn running", env=env),
        AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0) as client,
    ):
        events: list[Any] = []
        async with turnstile("worker", ready=b"running slots", env=env) as first:
            stream = await client.responses.create(
                model="scripted",
                input="talk",
                stream=True,
                extra_body={"agent_input": {"script": [{"say": ANSWER, "delay": 0.05}]}},
            )
            async for event in stream:
                events.append(event)
                if sum(e.type == "response.output_text.delta" for e in events) == 3:
                    break
            first.process.kill()  # SIGKILL, mid-text
            await first.process.wait()
        before_kill = events[-1].sequence_number
        async with turnstile("worker", ready=b"running slots", env=env):
            async for event in stream:
                events.append(event)
            response_id = events[0].response.id
            replay = [e async for e in await client.responses.retrieve(response_id, stream=True)]
            # Resumed from where the first claim's text was when its worker died: the re-run's
            # item whole, after that number (the abandoned item was never stored: nothing of it
            # comes again).
            resumed = await client.responses.retrieve(
                response_id, stream=True, starting_after=before_kill
            )
            after_kill = [e async for e in resumed]
            # The SDK's stream helper assembles the same answer from that stream.
            async with client.responses.stream(response_id=response_id) as helper:
                assembled = await helper.get_final_response()
    assert assembled.output_text == ANSWER
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers))  # each once, in order
    kinds = [e.type for e in events]
    assert kinds.count("response.completed") == 1
    assert kinds[-1] == "response.completed"
    final = events[-1].response
    assert final.status == "completed"
    assert final.output_text == ANSWER
    # Two items: the abandoned claim's, closed as it stood, and the re-run's, whole.
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert len(added) == 2
    abandoned, rerun = added
    [closed, done] = [e for e in events if e.type == "response.output_item.done"]
    assert (closed.item.id, closed.item.status) == (abandoned, "incomplete")
    assert done.item.id == rerun
    said = {
        item: "".join(
            e.delta for e in events if e.type == "response.output_text.delta" and e.item_id == item
        )
        for item in added
    }
    assert said[rerun] == ANSWER  # the re-run's text once, not after the abandoned text
    assert ANSWER.startswith(said[abandoned])
    assert said[abandoned] != ANSWER
    assert closed.item.content[0].text == said[abandoned]
    # The re-run's events are numbered in its own block, past any the first claim used.
    epoch = int(rerun.rsplit("_", 1)[1])
    assert epoch >= 2
    added_event = next(
        e for e in events if e.type == "response.output_item.added" and e.item.id == rerun
    )
    assert added_event.sequence_number == block_base(epoch)
    assert block_base(epoch) - block_base(1) >= EPOCH_STRIDE
    assert all(e.sequence_number > before_kill for e in after_kill)
    resumed_deltas = [e.delta for e in after_kill if e.type == "response.output_text.delta"]
    assert "".join(resumed_deltas) == ANSWER
    assert [e.type for e in after_kill][-1] == "response.completed"
    # Read again from the start: the completed answer once, in the re-run's item only.
    replay_deltas = [e.delta for e in replay if e.type == "response.output_text.delta"]
    assert "".join(replay_deltas) == ANSWER
    assert [e.type for e in replay].count("response.completed") == 1
    async with engine.connect() as conn:
        succeeded = await conn.execute(
            text("SELECT count(*) FROM run_events WHERE run_id = :id AND type = 'run.succeeded'"),
            {"id": run_id_of(response_id)},
        )
        assert succeeded.scalar_one() == 1
