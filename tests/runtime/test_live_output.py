"""Live output (issue 23, docs/adr/0007-live-output-deltas.md): deltas on the run's and the
session's Server-Sent Events streams, and the bounds of how they travel.

- The publisher, on a real connection: payloads of at most 4,000 bytes, at most 10
  notifications a second per process, coalesced; a full buffer drops and never blocks; above
  its notification queue usage limit it sends nothing (a real stuck listener fills the queue).
- Real processes (`serve --no-workers`, `turnstile worker`) against a fake streaming model on
  loopback: a worker killed (SIGKILL) mid-stream leads to a re-run whose deltas carry the new
  epoch, and a transcript without the partial message.
- Through the API with its worker pool: deltas arrive before `run.succeeded` and add up to
  `message.completed`; reconnecting with `Last-Event-ID` loses no durable event (run and session
  streams); a stream that stops reading holds no run up; another tenant's or principal's
  session stream answers 404; the client's `session_events` and `LiveText`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any
from uuid import UUID, uuid4

import asyncpg
import httpx
from sqlalchemy.ext.asyncio import AsyncEngine
from turnstile_client import AsyncTurnstile, Delta, Event, LiveText, Turnstile

from app.api.watch import Inbox, LiveWatch
from app.security.api_keys import create_key
from app.store.delta_channel import DeltaChannel
from app.store.embedded import LocalCluster, free_port
from app.store.engine import plain_url
from app.vocabulary.live_deltas import CHANNEL, MAX_PAYLOAD_BYTES, pack, unpack
from app.vocabulary.live_deltas import Delta as WireDelta
from app.worker.deltas import DeltaPublisher
from tests.support.api import running_api
from tests.support.processes import turnstile
from tests.support.servers import running_server
from tests.support.sse import Item, sse
from tests.support.streaming_model import SlowTalker
from tests.support.waiting import eventually

TEXT = 'Streaming, piece by piece: «naïve» "quoted" text\nwith a newline and ünïcödé. '


# --- helpers -----------------------------------------------------------------------------------
def assemble(deltas: list[dict[str, Any]]) -> str:
    """The text deltas make, each placed at its offset; asserts none is missing."""
    text = ""
    for delta in deltas:
        assert delta["offset"] <= len(text), "a delta is missing"
        text = text[: delta["offset"]] + delta["text"]
    return text


def say(text: str = TEXT, **options: Any) -> dict[str, Any]:
    return {"input": {"script": [{"say": text, "pieces": 12, "delay": 0.03, **options}]}}


async def listening(url: str) -> tuple[asyncpg.Connection, list[str]]:
    conn = await asyncpg.connect(plain_url(url))
    heard: list[str] = []
    await conn.add_listener(CHANNEL, lambda *args: heard.append(args[3]))
    return conn, heard


def wire(run: UUID, offset: int, text: str, message: int = 0) -> WireDelta:
    return WireDelta(
        run_id=run, session_id=None, epoch=1, message=message, offset=offset, text=text
    )


def texts(payloads: list[str]) -> dict[UUID, str]:
    out: dict[UUID, str] = {}
    for payload in payloads:
        for delta in unpack(payload):
            current = out.get(delta.run_id, "")
            assert delta.offset == len(current), "pieces arrive in order, none missing"
            out[delta.run_id] = current + delta.text
    return out


# --- the wire format and the publisher ---------------------------------------------------------
def test_a_payload_is_packed_within_its_bound_and_loses_no_character() -> None:
    runs = [uuid4() for _ in range(3)]
    originals = {run: (TEXT * 40)[: 3000 + 700 * i] for i, run in enumerate(runs)}
    pending: list[WireDelta] = []
    for run, text in originals.items():
        for start in range(0, len(text), 37):
            pending.append(wire(run, start, text[start : start + 37]))
    payloads = []
    while pending:
        payload, pending = pack(pending)
        assert len(payload.encode()) <= MAX_PAYLOAD_BYTES
        payloads.append(payload)
    assert texts(payloads) == originals
    # Contiguous pieces are merged: far fewer rows than pieces went in.
    assert sum(len(json.loads(p)["d"]) for p in payloads) < len(payloads) * 3 + 3


async def test_the_publisher_sends_at_most_ten_bounded_notifications_a_second(
    database_url: str,
) -> None:
    conn, heard = await listening(database_url)
    publisher = DeltaPublisher(database_url)
    await publisher.start()
    try:
        runs = [uuid4() for _ in range(20)]
        sent = dict.fromkeys(runs, "")
        for index in range(600):
            run = runs[index % len(runs)]
            piece = f"{index}:" + "x" * 15 + "é"
            assert publisher.offer(wire(run, len(sent[run]), piece))
            sent[run] += piece
            # Other tasks run between pieces, as between a model's chunks: pieces are offered
            # while a notification is being sent too.
            await asyncio.sleep(0)

        async def all_heard() -> bool:
            return texts(heard) == sent

        await eventually(all_heard, within=20, what="every delta")
    finally:
        await publisher.stop()
        await conn.close()
    total = sum(len(t.encode()) for t in sent.values())
    assert len(heard) == publisher.notifications
    assert all(len(payload.encode()) <= MAX_PAYLOAD_BYTES for payload in heard)
    assert publisher.largest_payload <= MAX_PAYLOAD_BYTES
    # Coalesced: 600 deltas in about as many notifications as the bytes need, not 600.
    assert math.ceil(total / MAX_PAYLOAD_BYTES) <= len(heard) < 600 // 20
    # The rate bound: each notification's tick began at least 0.1 s after the previous one.
    starts = list(publisher.send_starts)
    assert len(starts) == len(heard)
    assert all(b - a >= 0.1 - 1e-3 for a, b in itertools.pairwise(starts))
    assert publisher.dropped == {"full": 0, "paused": 0, "disconnected": 0}


class GatedChannel(DeltaChannel):
    """The publisher's real connection, its sends held at a gate: a notification in flight for
    as long as the test wants."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        super().__init__(conn)
        self.gate = asyncio.Event()
        self.sending = asyncio.Event()

    async def send(self, payload: str) -> None:
        self.sending.set()
        await self.gate.wait()
        await super().send(payload)


async def test_pieces_offered_while_a_notification_is_sent_are_not_lost(
    database_url: str,
) -> None:
    conn, heard = await listening(database_url)
    channel = GatedChannel(await asyncpg.connect(plain_url(database_url)))
    publisher = DeltaPublisher(database_url, channel=channel)
    await publisher.start()
    run = uuid4()
    try:
        assert publisher.offer(wire(run, 0, "first "))
        await channel.sending.wait()  # its notification is on its way
        assert publisher.offer(wire(run, 6, "second "))
        assert publisher.offer(wire(run, 13, "third"))
        channel.gate.set()

        async def all_heard() -> bool:
            return texts(heard).get(run) == "first second third"

        await eventually(all_heard, within=10, what="every piece")
    finally:
        await publisher.stop()
        await conn.close()


async def test_a_publisher_that_falls_behind_drops_deltas_and_never_blocks(
    database_url: str,
) -> None:
    conn, heard = await listening(database_url)
    publisher = DeltaPublisher(database_url, max_buffered_chars=1_000)
    await publisher.start()
    run = uuid4()
    try:
        # Offered faster than anything is sent (no await in between): the buffer fills.
        accepted = [publisher.offer(wire(run, 50 * i, "y" * 50)) for i in range(100)]
        assert accepted == [True] * 20 + [False] * 80
        assert publisher.dropped["full"] == 80
        assert await publisher.settle(run, within=10)

        async def first_twenty() -> bool:
            return texts(heard).get(run) == "y" * 1_000

        await eventually(first_twenty, within=10, what="the buffered deltas")
    finally:
        await publisher.stop()
        await conn.close()


async def test_the_publisher_stops_while_the_notification_queue_is_above_its_limit(
    throwaway_cluster: LocalCluster,
) -> None:
    """A listener stuck in a transaction holds the queue's tail: the queue fills, the usage the
    publisher reads rises above its limit (0 here, for a queue of 8 GB), and it stops sending
    until the listener reads again."""
    url = throwaway_cluster.url()
    stuck = await asyncpg.connect(plain_url(url))
    await stuck.execute(f"LISTEN {CHANNEL}")
    transaction = stuck.transaction()
    await transaction.start()
    await stuck.fetchval("SELECT 1")  # holding a snapshot: nothing is delivered to it now
    publisher = DeltaPublisher(url, max_queue_usage=0.0, usage_check_seconds=0.0)
    await publisher.start()
    run = uuid4()
    offset = 0
    try:

        async def paused() -> bool:
            nonlocal offset
            publisher.offer(wire(run, offset, "z" * 3_900))
            offset += 3_900
            await publisher.settle(run, within=5)
            return publisher.paused

        await eventually(paused, within=30, what="the publisher to pause")
        assert publisher.usage > 0
        sent = publisher.notifications
        assert not publisher.offer(wire(run, offset, "dropped"))
        assert publisher.dropped["paused"] >= 1
        await transaction.rollback()  # the listener reads again; the queue empties

        async def resumed() -> bool:
            publisher.offer(wire(run, offset, "again"))
            await publisher.settle(run, within=5)
            return not publisher.paused and publisher.notifications > sent

        await eventually(resumed, within=30, what="the publisher to resume")
    finally:
        await publisher.stop()
        await stuck.close()


def test_a_stream_that_stops_reading_loses_deltas_and_holds_nothing_up() -> None:
    watch = LiveWatch()
    run, session = uuid4(), uuid4()
    with (
        watch.following(run_id=run) as stalled,
        watch.following(session_id=session) as reading,
    ):
        got: list[WireDelta] = []
        for i in range(5_000):
            watch.deliver(
                [WireDelta(run_id=run, session_id=session, epoch=1, message=0, offset=i, text="a")]
            )
            got.extend(reading.take())
        assert len(got) == 5_000
        assert stalled.dropped == 5_000 - Inbox().capacity
        assert len(stalled.take()) == Inbox().capacity
    assert watch.received == 5_000


# --- through the API ---------------------------------------------------------------------------
async def open_session(client: httpx.AsyncClient) -> str:
    return str((await client.post("/sessions")).json()["id"])


async def read_until(
    stream: AsyncIterator[Item], event: str, into: list[Item], count: int = 1
) -> list[Item]:
    seen = 0
    async for item in stream:
        into.append(item)
        if item.event == event:
            seen += 1
            if seen == count:
                return into
    raise AssertionError(f"the stream ended before {event}")


async def test_deltas_arrive_before_the_run_ends_and_add_up_to_the_completed_message(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, workers=True) as api:
        client = await api.client()
        session = await open_session(client)
        items: list[Item] = []
        async with client.stream("GET", f"/sessions/{session}/events") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            stream = sse(response)
            run = (await client.post(f"/sessions/{session}/turns", json=say())).json()["id"]
            await asyncio.wait_for(read_until(stream, "run.succeeded", items), 30)
        kinds = [i.event for i in items]
        deltas = [i.data for i in items if i.event == "message.delta"]
        completed = [i for i in items if i.event == "message.completed"]
        assert deltas
        assert kinds.index("message.delta") < kinds.index("run.succeeded")
        assert len(completed) == 1
        assert kinds.index("message.completed") < kinds.index("run.succeeded")
        assert all(i.id is None for i in items if i.event == "message.delta")
        assert all(d["run_id"] == run and d["message"] == 0 for d in deltas)
        assert {d["epoch"] for d in deltas} == {completed[0].data["epoch"]}
        assert assemble(deltas) == completed[0].data["data"]["text"] == TEXT
        # Durable events carry `<run_no>.<seq>` ids, in order.
        ids = [i.id for i in items if i.id is not None]
        assert ids == [f"1.{seq}" for seq in range(1, len(ids) + 1)]
        # The run's own stream replays the durable events (deltas are never stored).
        async with client.stream(
            "GET", f"/runs/{run}/events", headers={"Accept": "text/event-stream"}
        ) as response:
            replay = [item async for item in sse(response)]
        assert [i.event for i in replay] == [i.event for i in items if i.id is not None]
        assert [i.id for i in replay] == [str(n) for n in range(1, len(replay) + 1)]
        # The transcript has the whole text once, from the run's end.
        transcript = (await client.get(f"/sessions/{session}/messages")).json()["items"]
        assert [m["content"] for m in transcript if m["role"] == "assistant"] == [TEXT]


async def reconnecting(
    client: httpx.AsyncClient,
    path: str,
    last_id: str,
    until: str,
    headers: dict[str, str] | None = None,
) -> list[Item]:
    items: list[Item] = []
    async with client.stream(
        "GET", path, headers={"Last-Event-ID": last_id, **(headers or {})}
    ) as response:
        assert response.status_code == 200
        await asyncio.wait_for(read_until(sse(response), until, items), 30)
    return items


async def test_reconnecting_with_last_event_id_loses_no_durable_event(
    database_url: str, engine: AsyncEngine
) -> None:
    accept = {"Accept": "text/event-stream"}
    script = [
        {"say": "First part. ", "pieces": 3, "delay": 0.02},
        {"call": "sleep", "args": {"seconds": 0.3}},
        {"say": "Second part.", "pieces": 3, "delay": 0.02},
    ]
    async with running_api(database_url, engine, workers=True) as api:
        client = await api.client()
        # A run's stream, left after its first message and resumed.
        run = (await client.post("/runs", json={"input": {"script": script}})).json()["id"]
        before: list[Item] = []
        async with client.stream("GET", f"/runs/{run}/events", headers=accept) as response:
            await asyncio.wait_for(read_until(sse(response), "message.completed", before), 30)
        last = [i.id for i in before if i.id is not None][-1]
        after = await reconnecting(client, f"/runs/{run}/events", last, "run.succeeded", accept)
        durable = [int(i.id) for i in before + after if i.id is not None]
        assert durable == list(range(1, len(durable) + 1))
        texts_ = [i.data["data"]["text"] for i in before + after if i.event == "message.completed"]
        assert texts_ == ["First part. ", "Second part."]

        # A session's stream, left after its first run and resumed after a second turn.
        session = await open_session(client)
        first: list[Item] = []
        async with client.stream("GET", f"/sessions/{session}/events") as response:
            stream = sse(response)
            await client.post(f"/sessions/{session}/turns", json=say("One."))
            await asyncio.wait_for(read_until(stream, "run.succeeded", first), 30)
        await client.post(f"/sessions/{session}/turns", json=say("Two."))
        last = [i.id for i in first if i.id is not None][-1]
        rest = await reconnecting(client, f"/sessions/{session}/events", last, "run.succeeded")
        positions = [tuple(map(int, i.id.split("."))) for i in first + rest if i.id is not None]
        assert positions == sorted(set(positions))
        for run_no in (1, 2):
            seqs = [seq for no, seq in positions if no == run_no]
            assert seqs == list(range(1, len(seqs) + 1))
            assert seqs
        assert [i.data["data"]["text"] for i in first + rest if i.event == "message.completed"] == [
            "One.",
            "Two.",
        ]
        bad = await client.get(f"/sessions/{session}/events", headers={"Last-Event-ID": "7"})
        assert bad.status_code == 422
        assert bad.headers["content-type"].startswith("application/problem+json")


async def test_a_stream_that_stops_reading_does_not_hold_up_runs(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, workers=True) as api:
        client = await api.client()
        session = await open_session(client)
        async with client.stream("GET", f"/sessions/{session}/events") as response:
            assert response.status_code == 200  # and never read again
            long_text = "word " * 4_000
            for _ in range(5):
                run = (
                    await client.post(
                        f"/sessions/{session}/turns",
                        json=say(long_text, pieces=400, delay=0),
                    )
                ).json()["id"]

                async def finished(run: str = run) -> bool:
                    got = (await client.get(f"/runs/{run}")).json()
                    return bool(got["status"] == "succeeded")

                await eventually(finished, within=30, what="the run to finish")


async def test_another_tenants_or_principals_session_stream_is_not_found(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api:
        owner = await api.client("acme", "alice")
        session = await open_session(owner)
        for other in (await api.client("globex", "alice"), await api.client("acme", "bob")):
            response = await other.get(f"/sessions/{session}/events")
            assert response.status_code == 404
            assert response.headers["content-type"].startswith("application/problem+json")
        missing = await owner.get(f"/sessions/{uuid4()}/events")
        assert missing.status_code == 404


async def test_the_client_follows_a_session_and_assembles_its_live_text(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, workers=True) as api:
        key = await api.key()
        async with AsyncTurnstile(api.base, key) as turnstile:
            session = await turnstile.create_session()
            live = LiveText()
            shown: list[str] = []
            completed: list[str] = []
            stream = turnstile.session_events(session)

            async def follow() -> None:
                async for item in stream:
                    if isinstance(item, Delta):
                        shown.append(live.apply(item) or "")
                    else:
                        assert isinstance(item, Event)
                        assert item.run_no == 1
                        whole = live.apply(item)
                        if item.type == "message.completed":
                            completed.append(str(whole))
                        if item.type == "run.succeeded":
                            return

            following = asyncio.create_task(follow())
            await turnstile.submit_turn(session, say()["input"])
            await asyncio.wait_for(following, 30)
            await stream.aclose()
        assert completed == [TEXT]
        assert shown
        assert TEXT.startswith(shown[-1])


async def test_a_worker_killed_mid_stream_is_rerun_under_a_new_epoch(
    database_url: str, engine: AsyncEngine
) -> None:
    talker = SlowTalker("The answer, streamed slowly over a few seconds, is forty-two.", 30, 0.1)
    key = (await create_key(engine, tenant_id="acme", principal="alice")).secret
    port = free_port()
    async with running_server(talker.app()) as model:
        env = {
            "DATABASE_URL": database_url,
            "TURNSTILE_OPENAI_BASE_URL": f"{model}/v1",
            "TURNSTILE_LEASE_SECONDS": "2",
            "TURNSTILE_HEARTBEAT_SECONDS": "0.5",
            "TURNSTILE_SWEEP_INTERVAL_SECONDS": "0.3",
            "TURNSTILE_RETRY_BACKOFF_BASE_SECONDS": "0.1",
            "TURNSTILE_POLL_INTERVAL_SECONDS": "0.5",
        }
        serve = ("serve", "--no-workers", "--port", str(port))
        async with (
            turnstile(*serve, ready=b"Uvicorn running", env=env),
            httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}",
                headers={"Authorization": f"Bearer {key}"},
                timeout=30,
            ) as client,
        ):
            session = await open_session(client)
            items: list[Item] = []
            async with client.stream("GET", f"/sessions/{session}/events") as response:
                stream = sse(response)
                async with turnstile("worker", ready=b"running slots", env=env) as first:
                    turn = {"input": {"text": "What is the answer?"}, "agent": "openai"}
                    accepted = await client.post(f"/sessions/{session}/turns", json=turn)
                    assert accepted.status_code == 202, accepted.text
                    await asyncio.wait_for(read_until(stream, "message.delta", items), 30)
                    first.process.kill()  # SIGKILL, mid-stream
                    await first.process.wait()
                async with turnstile("worker", ready=b"running slots", env=env):
                    await asyncio.wait_for(read_until(stream, "run.succeeded", items), 60)
            transcript = (await client.get(f"/sessions/{session}/messages")).json()["items"]
    deltas = [i.data for i in items if i.event == "message.delta"]
    completed = [i.data for i in items if i.event == "message.completed"]
    assert len(talker.requests) == 2  # the model call was made again
    assert len(completed) == 1
    final_epoch = completed[0]["epoch"]
    assert final_epoch > 1
    assert {d["epoch"] for d in deltas} == {1, final_epoch}
    assert completed[0]["data"]["text"] == talker.text
    assert assemble([d for d in deltas if d["epoch"] == final_epoch]) == talker.text
    # The first claim's partial text is nowhere durable: the transcript has the whole answer.
    assistant = [m["content"] for m in transcript if m["role"] == "assistant"]
    assert assistant == [talker.text]
    assert [m["content"] for m in transcript if m["role"] == "user"] == [
        {"text": "What is the answer?"}
    ]


def test_live_text_follows_the_rules_for_client_authors() -> None:
    run = uuid4()
    live = LiveText()

    def delta(epoch: int, offset: int, text: str, message: int = 0) -> Delta:
        return Delta(run_id=run, epoch=epoch, message=message, offset=offset, text=text)

    def event(type_: str, epoch: int, data: Any = None) -> Event:
        return Event(
            seq=1, type=type_, epoch=epoch, data=data, created_at=datetime.now(UTC), run_id=run
        )

    assert live.apply(delta(1, 0, "Hel")) == "Hel"
    assert live.apply(delta(1, 3, "lo wor")) == "Hello wor"
    assert live.apply(delta(1, 0, "Hi")) == "Hi"  # a retried model call starts again at 0
    assert live.apply(delta(1, 9, "ld")) == "Hi"  # a gap: a delta was missed, wait for the end
    # The worker was lost: the run's next claim writes under epoch 2 and replaces the text.
    assert live.apply(event("run.claimed", 2)) is None
    assert live.text(run) == ""
    assert live.apply(delta(1, 2, " late")) == ""  # the old claim's piece is dropped
    assert live.apply(delta(2, 0, "Hello")) == "Hello"
    whole = live.apply(event("message.completed", 2, {"text": "Hello world.", "message": 0}))
    assert whole == "Hello world."
    assert live.apply(delta(2, 5, " world")) == ""  # that message is complete
    assert live.apply(delta(2, 0, "Next", message=1)) == "Next"


async def test_the_blocking_client_follows_a_session_and_a_run_leaves_deltas_out(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, workers=True) as api:
        key = await api.key()

        def follow() -> tuple[list[str], list[str], list[str]]:
            with Turnstile(api.base, key) as turnstile:
                session = turnstile.create_session()
                run = turnstile.submit_turn(session, say()["input"])
                kinds: list[str] = []
                for item in turnstile.session_events(session):
                    kinds.append("delta" if isinstance(item, Delta) else item.type)
                    if kinds[-1] == "run.succeeded":
                        break
                resumed: list[str] = []
                for item in turnstile.session_events(session, after="1.2"):
                    if isinstance(item, Event):
                        resumed.append(f"{item.run_no}.{item.seq}")
                        if item.type == "run.succeeded":
                            break
                return kinds, [e.type for e in turnstile.events(run)], resumed

        kinds, run_events, resumed = await asyncio.to_thread(follow)
    assert kinds.index("message.completed") < kinds.index("run.succeeded")
    assert run_events == [k for k in kinds if k != "delta"]
    assert resumed == [f"1.{seq}" for seq in range(3, len(run_events) + 1)]


async def test_a_session_stream_takes_a_place_under_the_stream_caps(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine, max_streams_per_key=1) as api:
        client = await api.client()
        session = await open_session(client)
        async with client.stream("GET", f"/sessions/{session}/events") as first:
            assert first.status_code == 200
            second = await client.get(f"/sessions/{session}/events")
            assert second.status_code == 429
            assert second.headers["retry-after"]
            assert second.json()["type"].endswith("too-many-streams")
        # Its place is given back when the client leaves.

        async def place_free() -> bool:
            async with client.stream("GET", f"/sessions/{session}/events") as again:
                return again.status_code == 200

        await eventually(place_free, within=10, what="the place to be given back")


async def test_a_turn_submitted_elsewhere_wakes_the_session_streams_of_this_process(
    database_url: str, engine: AsyncEngine
) -> None:
    """A chat client's one stream is held by one API process while its next turn may go
    through another: the new run's notification names the session (migration 0013), and this
    process's streams of that session look again at once, not at their next idle recheck."""
    from app.queue.core import Queue
    from app.queue.reads import Reads
    from app.queue.submit import RunSpec, Submissions, Submitter
    from app.worker.notifier import Notifier

    queue = Queue(engine)
    session = await Reads(queue).create_session(tenant_id="acme", principal="alice")
    other = await Reads(queue).create_session(tenant_id="acme", principal="alice")
    live = LiveWatch()
    notifier = Notifier(database_url, listen_deltas=True)
    notifier.on_sessions(live.sessions_notified)
    await notifier.start()
    try:
        await asyncio.wait_for(notifier.connected.wait(), 10)
        with (
            live.following(session_id=session.id) as followed,
            live.following(session_id=other.id) as elsewhere,
        ):
            # "Another API process": the core's submission, not this process's route.
            submissions = Submissions(
                queue,
                default_agent="scripted",
                idempotency_ttl_seconds=60,
                idempotency_wait_seconds=1,
                lock_timeout_ms=1000,
            )
            await submissions.submit_turn(
                Submitter("acme", "alice"), session.id, RunSpec(input={"final": "hi"})
            )
            await asyncio.wait_for(followed.ready.wait(), 10)
            assert followed.poked
            assert not elsewhere.poked  # only the session that got a run
    finally:
        await notifier.stop()
