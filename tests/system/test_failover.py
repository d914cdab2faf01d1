"""A real failover under load (issue 36): nothing acknowledged is lost, nothing is done twice.

A pg_auto_failover cluster of the test's own (tests/support/ha_cluster.py: a monitor, a primary
and its synchronous standby on loopback ports) serves `turnstile serve --no-workers` and two
`turnstile worker` processes, all on the multi-host URL (`host1:port1,host2:port2` with
`target_session_attrs=read-write`). Clients submit a mixed load over HTTP: sessionless runs
with and without `Idempotency-Key` (some making unsafe and keyed calls to a counting server),
conversations whose turns ask the user and are answered, and keyless turns. Mid-load the
primary is lost whole (its pg_autoctl and its postmaster SIGKILLed), the standby is promoted,
the lost node rejoins as the standby; then the same again the other way (the fail-back).

Checks: every submission answered 2xx exists, and every run the database holds is one a client
was told about, or a keyless submission whose answer was a 5xx (its outcome unknown to the
client, never a second run); every run ends terminal once; no unsafe call reached the server
twice; every unsafe call left without an outcome is `uncertain`; the shared invariants (one
terminal event per run, epochs, counts) hold; every 5xx is a problem+json with `Retry-After`,
and no request was dropped or hung. The time from each kill until a write succeeds again is
reported (docs/reliability.md gives the figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import httpx
import pytest
from sqlalchemy import text

from app.config import Settings
from app.security.api_keys import create_key
from app.store.embedded import free_port
from app.store.engine import create_engine
from app.store.migrate import upgrade
from tests.support.chaos import (
    REPORTS,
    TERMINAL,
    Client,
    Fleet,
    Ledger,
    counting_server,
    examine,
    report,
    session_script,
    sessionless_script,
)
from tests.support.ha_cluster import AutoFailoverCluster, start_cluster
from tests.support.invariants import check_all_runs
from tests.support.processes import turnstile
from tests.support.waiting import eventually

# A lease that rides out a failover: a worker's heartbeats fail while no primary answers, and
# a lease shorter than the failover (plus a heartbeat) would self-fence every run in flight.
# docs/deployment.md, "Failover", gives the rule.
FAILOVER_ENV = {
    "TURNSTILE_LEASE_SECONDS": "30",
    "TURNSTILE_HEARTBEAT_SECONDS": "3",
    "TURNSTILE_SWEEP_INTERVAL_SECONDS": "1",
    "TURNSTILE_POLL_INTERVAL_SECONDS": "1",
    "TURNSTILE_RETRY_BACKOFF_BASE_SECONDS": "0.1",
    "TURNSTILE_RETRY_BACKOFF_MAX_SECONDS": "1",
    "TURNSTILE_MAX_ATTEMPTS": "10",
    "TURNSTILE_DRAIN_GRACE_SECONDS": "5",
    "TURNSTILE_HTTP_ALLOWED_HOSTS": "127.0.0.1",
    "TURNSTILE_HTTP_TIMEOUT_SECONDS": "5",
    "TURNSTILE_SLOTS": "interactive:3,async:4,maintenance:1",
    "TURNSTILE_DB_POOL_SIZE": "6",
}
SESSIONS = 6
TURNS = 3
BETWEEN_FAULTS = 60  # submissions accepted before each kill
# Failovers in one run: a failover and its fail-back by default; more for a soak, e.g.
# `TURNSTILE_FAILOVERS=20 pytest tests/system/test_failover.py` (each about 15 s).
FAILOVERS = max(2, int(os.environ.get("TURNSTILE_FAILOVERS", "2")))


@dataclass
class Watch:
    """Every answer the API gave: the 5xx inspected, the writes timed."""

    server_errors: list[tuple[int, str, str | None, str]] = field(default_factory=list)
    dropped: int = 0  # transport errors: a dropped connection or a request that hung
    writes: list[tuple[float, float, int]] = field(default_factory=list)  # sent, answered, status

    async def on_response(self, response: httpx.Response) -> None:
        if response.status_code >= 500:
            await response.aread()
            try:
                kind = str(response.json().get("type", ""))
            except ValueError:
                kind = "(not JSON)"
            self.server_errors.append(
                (
                    response.status_code,
                    response.headers.get("content-type", ""),
                    response.headers.get("retry-after"),
                    kind,
                )
            )

    def recovered_after(self, moment: float) -> float | None:
        """Seconds from `moment` until a write sent after it was answered 2xx."""
        done = [
            answered for sent, answered, status in self.writes if sent > moment and status < 300
        ]
        return min(done) - moment if done else None


class CountingTransport(httpx.AsyncBaseTransport):
    """The real transport, counting the requests that got no answer at all."""

    def __init__(self, watch: Watch) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.watch = watch

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        sent = time.monotonic()
        try:
            response = await self.inner.handle_async_request(request)
        except httpx.TransportError:
            self.watch.dropped += 1
            raise
        if request.method == "POST":
            self.watch.writes.append((sent, time.monotonic(), response.status_code))
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def watched_client(base: str, key: str, ledger: Ledger, watch: Watch) -> Client:
    client = Client(base, key, ledger)
    client.http = httpx.AsyncClient(
        base_url=base,
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
        transport=CountingTransport(watch),
        event_hooks={"response": [watch.on_response]},
    )
    return client


class Load:
    """The clients: keyed and keyless submissions, conversations, keyless turns."""

    def __init__(self, client: Client, counter: str, ledger: Ledger) -> None:
        self.client = client
        self.counter = counter
        self.ledger = ledger
        self.unknown: set[str] = set()  # keyless submissions answered 5xx: outcome unknown
        self.submitted = 0

    async def keyless(self, path: str, tag: str, body: dict[str, Any]) -> None:
        """Once, without a key: a client that cannot retry safely takes a 5xx as unknown."""
        try:
            response = await self.client.http.post(path, json=body)
        except httpx.TransportError:  # counted by the transport; the outcome is unknown
            self.unknown.add(tag)
            return
        if response.status_code == 202:
            self.ledger.accept(tag, UUID(response.json()["id"]))
        else:
            assert response.status_code >= 500, (response.status_code, response.text)
            self.unknown.add(tag)

    async def sessionless(self, stop: asyncio.Event, concurrency: int = 6) -> None:
        indexes = itertools.count()

        async def submitter() -> None:
            while not stop.is_set():
                i = next(indexes)
                self.submitted += 1
                tag = f"r{i}"
                body = {
                    "input": {"tag": tag, "script": sessionless_script(i, self.counter, tag)},
                    "priority": "interactive" if i % 4 == 0 else "async",
                }
                if i % 3 == 0:
                    await self.keyless("/runs", tag, body)
                    continue
                response = await self.client.post("/runs", body, tag)
                assert response.status_code == 202, (response.status_code, response.text)
                self.ledger.accept(tag, UUID(response.json()["id"]))

        await asyncio.gather(*(submitter() for _ in range(concurrency)))

    async def conversation(self, s: int, stop: asyncio.Event) -> None:
        response = await self.client.post("/sessions", {}, f"session-{s}")
        assert response.status_code == 201, response.text
        session = response.json()["id"]
        for turn in itertools.count():
            if turn >= TURNS and stop.is_set():
                return
            tag = f"s{s}t{turn}"
            body = {"input": {"tag": tag, "script": session_script(s, turn, self.counter, tag)}}
            response = await self.client.post(f"/sessions/{session}/turns", body, tag)
            assert response.status_code == 202, (response.status_code, response.text)
            run_id = UUID(response.json()["id"])
            self.ledger.accept(tag, run_id)
            seen = response.json()["status"]
            answered = 0
            while True:
                run = (await self.client.get(f"/runs/{run_id}", wait=30, status=seen)).json()
                seen = run["status"]
                if seen in TERMINAL:
                    break
                if seen == "waiting_for_user":
                    answered += 1
                    answer = {"input": f"account {answered} for {tag}"}
                    key = f"{tag}-answer-{answered}"
                    response = await self.client.post(f"/sessions/{session}/turns", answer, key)
                    assert response.status_code == 202, (response.status_code, response.text)
                    self.ledger.answers += 1

    async def keyless_turns(self, stop: asyncio.Event) -> None:
        """One keyless turn per new session, until stopped."""
        for n in itertools.count():
            if stop.is_set():
                return
            response = await self.client.post("/sessions", {}, f"keyless-session-{n}")
            assert response.status_code == 201, response.text
            tag = f"k{n}"
            body = {"input": {"tag": tag, "script": [{"call": "echo", "args": {}}, {"final": n}]}}
            await self.keyless(f"/sessions/{response.json()['id']}/turns", tag, body)
            await asyncio.sleep(0.05)  # a user's pace, not a flood


@dataclass
class Failover:
    victim: str
    successor: str
    killed: float = 0.0
    promoted_after: float = 0.0
    writes_after: float = 0.0
    rejoined_after: float = 0.0


async def probe_readiness(base: str, stop: asyncio.Event, seen: list[tuple[float, int]]) -> None:
    """/readyz every 0.2 s, as a load balancer would: (when, status)."""
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        while not stop.is_set():
            try:
                status = (await client.get("/readyz")).status_code
            except httpx.TransportError:
                status = 0
            seen.append((time.monotonic(), status))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)


async def lose_the_primary(
    cluster: AutoFailoverCluster, ledger: Ledger, watch: Watch, plan: Failover
) -> None:
    victim = next(n for n in cluster.nodes if n.name == plan.victim)
    killed = plan.killed = time.monotonic()
    await asyncio.to_thread(cluster.kill, victim)
    await asyncio.to_thread(cluster.wait_promoted, plan.successor)
    plan.promoted_after = time.monotonic() - killed

    async def writes_again() -> float | None:
        return watch.recovered_after(killed)

    plan.writes_after = await eventually(writes_again, within=120, what="a write to succeed")
    await asyncio.to_thread(cluster.restart, victim)
    await asyncio.to_thread(cluster.wait_for, plan.successor)
    plan.rejoined_after = time.monotonic() - killed


@pytest.mark.timeout(600 + 60 * FAILOVERS)
async def test_failover_under_load_loses_nothing_and_repeats_no_unsafe_effect() -> None:
    started = time.monotonic()
    cluster = await start_cluster()
    url = cluster.url()
    engine = create_engine(Settings(), url)
    ledger, watch = Ledger(), Watch()
    plans = [
        Failover("node1", "node2") if n % 2 == 0 else Failover("node2", "node1")
        for n in range(FAILOVERS)
    ]
    try:
        await asyncio.to_thread(upgrade, url)
        key = (await create_key(engine, tenant_id="acme", principal="svc")).secret
        env = {"DATABASE_URL": url, **FAILOVER_ENV}
        async with AsyncExitStack() as stack:
            counter = await stack.enter_async_context(counting_server())
            port = free_port()
            serve = await stack.enter_async_context(
                turnstile(
                    "serve", "--no-workers", "--port", str(port), ready=b"Uvicorn running", env=env
                )
            )
            fleet = Fleet(env, stack)
            for _ in range(2):
                await fleet.start_worker()
            client = watched_client(f"http://127.0.0.1:{port}", key, ledger, watch)
            stack.push_async_callback(client.aclose)
            load = Load(client, counter.base, ledger)
            stop = asyncio.Event()

            async def faults() -> None:
                try:
                    for plan in plans:
                        base = len(ledger.accepted)

                        async def busy(base: int = base) -> bool:
                            return len(ledger.accepted) >= base + BETWEEN_FAULTS

                        await eventually(busy, within=120, what="submissions before a failover")
                        await lose_the_primary(cluster, ledger, watch, plan)
                    final = len(ledger.accepted)

                    async def more() -> bool:
                        return len(ledger.accepted) >= final + BETWEEN_FAULTS

                    await eventually(more, within=120, what="submissions after the fail-back")
                finally:
                    stop.set()

            readiness: list[tuple[float, int]] = []
            await asyncio.gather(
                faults(),
                probe_readiness(f"http://127.0.0.1:{port}", stop, readiness),
                load.sessionless(stop),
                load.keyless_turns(stop),
                *(load.conversation(s, stop) for s in range(SESSIONS)),
            )
            # A keyless submission answered 5xx may have committed: its run is then one the
            # client could find, and must run once like any other (never a second one).
            async with engine.connect() as conn:
                rows = (
                    await conn.execute(
                        text(
                            "SELECT id, input->>'tag' AS tag FROM runs "
                            "WHERE input->>'tag' = ANY(:tags)"
                        ),
                        {"tags": sorted(load.unknown)},
                    )
                ).all()
            created_anyway = len(rows)
            for row in rows:
                ledger.accept(row.tag, row.id)
            accepted = [str(run_id) for run_id in ledger.accepted.values()]

            async def all_terminal() -> bool:
                async with engine.connect() as conn:
                    n = (
                        await conn.execute(
                            text(
                                "SELECT count(*) FROM runs WHERE id = ANY(CAST(:ids AS uuid[])) "
                                "AND status = ANY(:statuses)"
                            ),
                            {"ids": accepted, "statuses": list(TERMINAL)},
                        )
                    ).scalar_one()
                return int(n) == len(accepted)

            await eventually(all_terminal, within=180, what="every accepted run to finish")
            hits = await counter.hits()
            self_fenced = fleet.log_count(b"self-fenced")
            listen_lost = fleet.log_count(b"LISTEN connection lost") + serve.log.count(
                b"LISTEN connection lost"
            )
        # serve and the workers drained on SIGTERM and exited 0 (checked by `turnstile()`).
        shutdown_failed = serve.log.count(b"Application shutdown failed")
        found = await examine(engine, ledger, hits)
        checked = await check_all_runs(engine)
    finally:
        await engine.dispose()
        await asyncio.to_thread(cluster.stop)

    by_kind: dict[str, int] = {}
    for status, _ctype, _retry, kind in watch.server_errors:
        name = f"{status} {kind.rsplit('/', 1)[-1]}"
        by_kind[name] = by_kind.get(name, 0) + 1
    REPORTS.append(
        report(
            f"Failover under load ({time.monotonic() - started:.0f} s)",
            {
                "submissions accepted": len(ledger.accepted),
                "keyless answered 5xx / their run created anyway": (
                    f"{len(load.unknown)} / {created_anyway}"
                ),
                "statuses": dict(found.statuses),
                **{
                    f"failover {n + 1} ({p.victim} lost): promoted / writes again / rejoined (s)": (
                        f"{p.promoted_after:.1f} / {p.writes_after:.1f} / {p.rejoined_after:.1f}"
                    )
                    for n, p in enumerate(plans)
                },
                "5xx answers": by_kind or 0,
                "dropped or hung requests": watch.dropped,
                "/readyz 503 after writes were answered again": sum(
                    1
                    for when, status in readiness
                    if status != 200
                    and any(
                        p.killed + p.writes_after + 1 < when < p.killed + p.rejoined_after
                        for p in plans
                    )
                ),
                "/readyz answers 503 / 200": (
                    f"{sum(s == 503 for _, s in readiness)} / {sum(s == 200 for _, s in readiness)}"
                ),
                "client retries / replays": f"{ledger.retries} / {ledger.replayed}",
                "requeued / released / fenced / self-fenced": (
                    f"{found.requeued} / {found.released} / {found.fenced} / {self_fenced}"
                ),
                "LISTEN reconnections logged": listen_lost,
                "unsafe calls / uncertain / ambiguous": (
                    f"{found.unsafe_calls} / {found.uncertain} / {found.ambiguous}"
                ),
                "duplicate unsafe effects": found.duplicate_unsafe_effects,
                "invariant-checked runs": checked,
            },
        )
    )
    assert found.problems == [], found.problems[:20]
    assert found.duplicate_unsafe_effects == 0
    assert checked == len(ledger.accepted)
    # Every 5xx is a problem+json with Retry-After: a client knows to come back.
    bad = [e for e in watch.server_errors if e[1] != "application/problem+json" or not e[2]]
    assert bad == [], bad[:10]
    assert all(e[0] == 503 for e in watch.server_errors), watch.server_errors[:10]
    assert watch.dropped == 0
    assert shutdown_failed == 0
    assert all(p.writes_after > 0 for p in plans)
    # The readiness probe said not-ready while no primary answered, and ready again after.
    for plan in plans:
        outage = [
            status
            for when, status in readiness
            if plan.killed < when < plan.killed + plan.promoted_after
        ]
        assert 503 in outage, (plan, outage)
        assert 0 not in outage, (plan, outage)
    assert readiness[-1][1] == 200, readiness[-5:]
