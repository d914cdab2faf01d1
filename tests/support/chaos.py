"""The chaos suite's machinery: a fleet of real Turnstile processes that can be SIGKILLed and
replaced, the counting server its runs call, a load generator that submits over HTTP and
retries like a careful client, and the checks run on the database and the server's counts
once the dust settles.

Everything here talks to real processes over loopback and to a real PostgreSQL; nothing is
mocked. Waiting is on rows and process output, never on fixed sleeps; the only sleeps are the
chaos cadence itself and a client's retry backoff.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.store.embedded import free_port
from app.store.tables import ACTIVE_STATUS_SQL
from tests.support.processes import Child, turnstile
from tests.support.waiting import eventually

TERMINAL = ("succeeded", "failed", "cancelled")
# Reports of the chaos tests, printed by conftest at the end of the session so a reader of the
# CI log sees what was proven, not only that it passed.
REPORTS: list[str] = []


# --- the counting server -------------------------------------------------------------------
@dataclass
class CountingServer:
    base: str
    process: asyncio.subprocess.Process

    async def hits(self) -> list[tuple[str, str, str | None]]:
        async with httpx.AsyncClient(base_url=self.base, timeout=30) as client:
            return [tuple(hit) for hit in (await client.get("/__hits")).json()]  # type: ignore[misc]


@asynccontextmanager
async def counting_server() -> AsyncIterator[CountingServer]:
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.support.counting_server", str(port)
    )
    server = CountingServer(f"http://127.0.0.1:{port}", process)
    try:

        async def answers() -> bool:
            try:
                await server.hits()
            except httpx.TransportError:
                return False
            return True

        await eventually(answers, within=30, what="the counting server to answer")
        yield server
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 30)


# --- the fleet -----------------------------------------------------------------------------
@dataclass
class Fleet:
    """The worker processes of one test: started, SIGKILLed at random and replaced."""

    env: dict[str, str]
    stack: AsyncExitStack
    workers: dict[int, Child] = field(default_factory=dict)  # pid -> child, the live ones
    children: list[Child] = field(default_factory=list)  # every worker ever started
    kills: int = 0
    pauses: int = 0
    paused: set[int] = field(default_factory=set)

    async def start_worker(self) -> Child:
        child = await self.stack.enter_async_context(
            turnstile("worker", ready=b"running slots", env=self.env)
        )
        self.workers[child.process.pid] = child
        self.children.append(child)
        return child

    async def pause(self, pid: int, seconds: float) -> None:
        """SIGSTOP a worker for `seconds` (longer than its lease), then SIGCONT it."""
        child = self.workers.get(pid)
        if child is None or child.process.returncode is not None:
            return
        self.paused.add(pid)
        child.process.send_signal(signal.SIGSTOP)
        self.pauses += 1
        try:
            await asyncio.sleep(seconds)  # the freeze itself, not a wait for a condition
        finally:
            self.paused.discard(pid)
            if child.process.returncode is None:
                child.process.send_signal(signal.SIGCONT)

    @asynccontextmanager
    async def frozen(self, pid: int) -> AsyncIterator[None]:
        """SIGSTOP a worker for as long as the block runs (the test waits inside it for what
        must happen meanwhile), then SIGCONT it."""
        child = self.workers[pid]
        self.paused.add(pid)
        child.process.send_signal(signal.SIGSTOP)
        self.pauses += 1
        try:
            yield
        finally:
            self.paused.discard(pid)
            if child.process.returncode is None:
                child.process.send_signal(signal.SIGCONT)

    def log_count(self, needle: bytes) -> int:
        """How many times `needle` appears in the logs of every worker started so far."""
        return sum(child.log.count(needle) for child in self.children)

    async def kill(self, pid: int) -> None:
        child = self.workers.pop(pid)
        child.process.kill()  # SIGKILL: no drain, no release, no last heartbeat
        await child.process.wait()
        self.kills += 1


async def running_pids(engine: AsyncEngine, pids: set[int], poison_only: bool = False) -> list[int]:
    """Live worker processes that hold at least one running run (a poison run, if asked)."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text(
                    "SELECT DISTINCT w.pid FROM runs r JOIN workers w ON w.id = r.lease_owner "
                    "WHERE r.status = 'running' AND w.pid = ANY(:pids) "
                    "AND (NOT :poison_only OR r.input->>'poison' = 'true')"
                ),
                {"pids": list(pids), "poison_only": poison_only},
            )
        ).scalars()
        return list(rows)


async def terminate_backends(engine: AsyncEngine, rng: random.Random, at_most: int) -> int:
    """pg_terminate_backend on a few of the service's connections (its processes name their
    role in application_name; the test's own connections are left alone)."""
    async with engine.connect() as conn:
        candidates = list(
            (
                await conn.execute(
                    text(
                        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                        "AND backend_type = 'client backend' "
                        "AND application_name ~ '^turnstile (serve|worker)'"
                    )
                )
            ).scalars()
        )
        chosen = rng.sample(candidates, k=min(at_most, len(candidates)))
        done = 0
        for pid in chosen:
            done += bool(
                (
                    await conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
                ).scalar_one()
            )
        await conn.commit()
        return done


# --- the load ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    """A turn accepted while its session's run worked, under a multitask policy, as the client
    was answered: a run (`run`: the session was idle, or an interrupted queued run's
    successor), a pending turn (`pending`: enqueue, or interrupt of a running run; its id is the
    run it will become) or a steer (`steer`: `id` is the pending turn, `run_id` the active run
    it was meant for)."""

    tag: str
    session: str
    policy: str
    answer: str  # run, pending, steer
    id: UUID
    run_id: UUID | None = None


@dataclass
class Ledger:
    """What the clients were told: every submission accepted with a 2xx, by its tag."""

    accepted: dict[str, UUID] = field(default_factory=dict)
    turns: dict[str, Turn] = field(default_factory=dict)  # multitask turns, by tag
    retries: int = 0
    replayed: int = 0
    key_reuse_refused: int = 0
    answers: int = 0

    def accept(self, tag: str, run_id: UUID) -> None:
        earlier = self.accepted.setdefault(tag, run_id)
        # One run per idempotency key: every 2xx for the same tag names the same run.
        assert earlier == run_id, f"{tag}: two runs {earlier} and {run_id} for one key"

    def accept_turn(self, turn: Turn) -> None:
        earlier = self.turns.setdefault(turn.tag, turn)
        # A retry with the same key is answered as the first time: the same turn.
        assert earlier == turn, f"{turn.tag}: answered {earlier} and then {turn}"


class Client:
    """An API client that retries like a careful service: the same Idempotency-Key and body
    after a transport error, a timeout, a 5xx or a 409 in-flight answer."""

    def __init__(self, base: str, key: str, ledger: Ledger) -> None:
        self.http = httpx.AsyncClient(
            base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=30
        )
        self.ledger = ledger

    async def post(
        self, path: str, body: dict[str, Any], key: str, *, first_timeout: float | None = None
    ) -> httpx.Response:
        timeout: float | None = first_timeout
        for attempt in range(200):
            try:
                response = await self.http.post(
                    path,
                    json=body,
                    headers={"Idempotency-Key": key},
                    timeout=timeout if timeout is not None else 30,
                )
            except httpx.TransportError:  # includes timeouts: the outcome is unknown, retry
                response = None
            timeout = None
            in_flight = (
                response is not None
                and response.status_code == 409
                and _problem(response) == "idempotency-key-in-flight"
            )
            if response is not None and response.status_code < 500 and not in_flight:
                if response.headers.get("Idempotent-Replayed") == "true":
                    self.ledger.replayed += 1
                return response
            self.ledger.retries += 1
            await asyncio.sleep(min(1.0, 0.02 * 2 ** min(attempt, 6)) * random.random())
        raise AssertionError(f"POST {path} with key {key} never got an answer")

    async def get(self, path: str, **params: Any) -> httpx.Response:
        for attempt in range(200):
            try:
                response = await self.http.get(path, params=params, timeout=60)
                if response.status_code < 500:
                    return response
            except httpx.TransportError:
                pass
            await asyncio.sleep(min(1.0, 0.02 * 2 ** min(attempt, 6)) * random.random())
        raise AssertionError(f"GET {path} never answered")

    async def aclose(self) -> None:
        await self.http.aclose()


def _problem(response: httpx.Response) -> str | None:
    try:
        return str(response.json()["type"]).rsplit("/", 1)[-1]
    except (ValueError, KeyError, TypeError):
        return None


# --- the scripts ---------------------------------------------------------------------------
def effect(base: str, tag: str, step: int, *, keyed: bool) -> dict[str, Any]:
    """A POST to the counting server, unsafe or keyed, addressed by submission and step."""
    kind = "keyed" if keyed else "unsafe"
    call: dict[str, Any] = {
        "call": "http_request",
        "args": {"method": "POST", "url": f"{base}/{kind}/{tag}/{step}", "json": {"tag": tag}},
    }
    if keyed:
        call["idempotency_key"] = True
    return call


def sessionless_script(i: int, base: str, tag: str) -> list[dict[str, Any]]:
    shape = i % 10
    if shape < 4:
        return [{"call": "echo", "args": {"i": i}}, {"final": i}]
    if shape < 6:
        return [{"call": "sleep", "args": {"seconds": 0.05 * (1 + i % 5)}}, {"final": i}]
    if shape == 6:
        return [effect(base, tag, 0, keyed=False), {"final": i}]
    if shape == 7:
        return [effect(base, tag, 0, keyed=True), {"call": "sleep", "args": {"seconds": 0.1}}]
    if shape == 8:
        return [
            {"call": "sleep", "args": {"seconds": 0.2}},
            effect(base, tag, 1, keyed=False),
            effect(base, tag, 2, keyed=True),
            {"final": i},
        ]
    return [{"call": "echo", "args": {"n": n}} for n in range(3)] + [{"final": i}]


def session_script(s: int, turn: int, base: str, tag: str) -> list[dict[str, Any]]:
    """A user's turn: some ask a question and are answered by the next turn."""
    steps: list[dict[str, Any]] = [{"call": "echo", "args": {"turn": turn}}]
    if (s + turn) % 2 == 0:
        steps.append({"ask": f"which account, turn {turn}?"})
    if (s + turn) % 3 == 0:
        steps.append(effect(base, tag, len(steps), keyed=(s % 2 == 0)))
    steps.append({"call": "sleep", "args": {"seconds": 0.05}})
    steps.append({"final": f"turn {turn} of session {s}"})
    return steps


def multitask_script(s: int, turn: int, base: str, tag: str) -> list[dict[str, Any]]:
    """A turn of a session with a multitask policy. The first works a while (the turns that
    follow meet it queued or running); the others are shorter, some with an unsafe call."""
    if turn == 0:
        steps: list[dict[str, Any]] = [
            {"call": "echo", "args": {"turn": 0}},
            {"call": "sleep", "args": {"seconds": 0.3}},
            effect(base, tag, 2, keyed=(s % 2 == 0)),
            {"call": "sleep", "args": {"seconds": 0.3}},
            {"call": "sleep", "args": {"seconds": 0.3}},
        ]
    else:
        steps = [{"call": "sleep", "args": {"seconds": 0.2}}]
        if (s + turn) % 2:
            steps.append(effect(base, tag, 1, keyed=False))
        steps.append({"call": "echo", "args": {"turn": turn}})
    steps.append({"final": f"turn {turn} of session {s}"})
    return steps


# --- the checks ----------------------------------------------------------------------------
@dataclass
class Findings:
    runs: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    requeued: int = 0
    released: int = 0
    fenced: int = 0
    claims: int = 0
    uncertain: int = 0
    ambiguous: int = 0
    unsafe_calls: int = 0
    keyed_calls: int = 0
    duplicate_unsafe_effects: int = 0
    keyed_repeats: int = 0
    dead_lettered_by_attempts: int = 0
    problems: list[str] = field(default_factory=list)


async def examine(
    engine: AsyncEngine, ledger: Ledger, hits: list[tuple[str, str, str | None]]
) -> Findings:
    """Check the end state against what clients were told and what the server saw."""
    found = Findings()
    per_path: dict[str, list[str | None]] = defaultdict(list)
    for method, path, key in hits:
        assert method == "POST", (method, path)
        per_path[path].append(key)

    async with engine.connect() as conn:
        runs = (
            await conn.execute(
                text(
                    "SELECT id, status, input->>'tag' AS tag, attempts, max_attempts, result, "
                    "failure FROM runs"
                )
            )
        ).all()
        events = (
            await conn.execute(text("SELECT type, count(*) AS n FROM run_events GROUP BY type"))
        ).all()
        journal = (
            await conn.execute(
                text(
                    "SELECT run_id, step, entry, epoch, idempotency_class, idempotency_key, "
                    "args->>'url' AS url, outcome_status FROM tool_journal ORDER BY run_id, "
                    "event_seq"
                )
            )
        ).all()

    found.runs = len(runs)
    by_type = {row.type: row.n for row in events}
    found.requeued = by_type.get("run.requeued", 0)
    found.released = by_type.get("run.released", 0)
    found.fenced = by_type.get("run.fenced", 0)
    found.claims = by_type.get("run.claimed", 0)

    def problem(message: str) -> None:
        found.problems.append(message)

    # Nothing lost, nothing doubled: the runs are exactly the accepted submissions.
    by_tag = Counter(row.tag for row in runs)
    for tag, n in by_tag.items():
        if n != 1:
            problem(f"{n} runs carry tag {tag}")
    accepted = {str(run_id) for run_id in ledger.accepted.values()}
    stored = {str(row.id) for row in runs}
    if missing := accepted - stored:
        problem(f"{len(missing)} accepted runs are missing, e.g. {sorted(missing)[:3]}")
    if extra := stored - accepted:
        problem(f"{len(extra)} runs no client was told about, e.g. {sorted(extra)[:3]}")

    results: dict[str, Any] = {}
    for row in runs:
        found.statuses[row.status] += 1
        results[str(row.id)] = row.result
        if row.status not in TERMINAL:
            problem(f"run {row.id} is stuck in {row.status}")
        if row.attempts > row.max_attempts:
            problem(f"run {row.id} ran {row.attempts} times, max {row.max_attempts}")
        if row.status == "failed":
            if not row.failure:
                problem(f"run {row.id} failed without a failure")
            elif row.failure.get("kind") == "lease_expired":
                found.dead_lettered_by_attempts += 1
                if row.attempts != row.max_attempts:
                    problem(f"run {row.id} dead-lettered after {row.attempts} attempts")

    # Per tool invocation (a run and its step): the journal's story against the server's.
    invocations: dict[tuple[str, int], list[Any]] = defaultdict(list)
    for entry in journal:
        invocations[(str(entry.run_id), entry.step)].append(entry)
    for (run_id, step), entries in invocations.items():
        klass = entries[0].idempotency_class
        url = entries[0].url or ""
        path = "/" + url.split("/", 3)[-1] if url.startswith("http") else url
        started = [e for e in entries if e.entry == "started"]
        finished = [e for e in entries if e.entry == "finished"]
        if klass == "unsafe":
            found.unsafe_calls += 1
            n_hits = len(per_path.get(path, []))
            if len(started) > 1:
                problem(f"unsafe {path} was started {len(started)} times")
            if n_hits > 1:
                found.duplicate_unsafe_effects += n_hits - 1
                problem(f"unsafe {path} reached the server {n_hits} times")
            # Ambiguous: started under an epoch that never recorded its outcome.
            finished_epochs = {e.epoch for e in finished}
            ambiguous = any(e.epoch not in finished_epochs for e in started)
            found.ambiguous += ambiguous
            outcome = finished[-1].outcome_status if finished else None
            if outcome == "uncertain":
                found.uncertain += 1
            if ambiguous and finished and outcome != "uncertain":
                problem(f"unsafe {path} had no outcome after a crash, yet recorded {outcome}")
            if outcome == "succeeded" and n_hits != 1:
                problem(f"unsafe {path} recorded success with {n_hits} hits on the server")
            result = results.get(run_id)
            if outcome == "uncertain" and isinstance(result, dict):
                statuses = {o["step"]: o["status"] for o in result.get("tool_outcomes", [])}
                if statuses.get(step) != "uncertain":
                    problem(f"run {run_id}: step {step} uncertain in the journal, not the result")
        elif klass == "keyed":
            found.keyed_calls += 1
            keys = {e.idempotency_key for e in entries}
            seen_keys = set(per_path.get(path, []))
            found.keyed_repeats += max(0, len(per_path.get(path, [])) - 1)
            if len(keys) != 1 or None in keys:
                problem(f"keyed {path} journalled keys {keys}")
            if seen_keys and seen_keys != keys:
                problem(f"keyed {path} reached the server with keys {seen_keys}, journal {keys}")
    return found


def report(title: str, lines: dict[str, object]) -> str:
    width = max(len(k) for k in lines)
    body = "\n".join(f"  {k.ljust(width)}  {v}" for k, v in lines.items())
    return f"{title}\n{body}"


# --- turn control (docs/turn-control.md) ---------------------------------------------------
ACTIVE = ("queued", "running", "waiting_for_user")


async def sessions_with_two_active_runs(engine: AsyncEngine) -> list[str]:
    """Sessions holding more than one non-terminal run right now (there must be none: the
    partial unique index, and every promotion after its run's end)."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                # The unique index's own predicate, so this reads only its (active) rows: it
                # runs every chaos round, while the backlog grows.
                "SELECT session_id FROM runs WHERE session_id IS NOT NULL "
                f"AND {ACTIVE_STATUS_SQL} GROUP BY session_id HAVING count(*) > 1"
            )
        )
        return [str(row) for row in rows.scalars()]


async def work_left(engine: AsyncEngine) -> int:
    """Runs not terminal, and pending turns still pending: what the test is waiting for."""
    async with engine.connect() as conn:
        n = (
            await conn.execute(
                text(
                    "SELECT (SELECT count(*) FROM runs WHERE status <> ALL(:terminal)) "
                    "+ (SELECT count(*) FROM pending_turns WHERE status = 'pending')"
                ),
                {"terminal": list(TERMINAL)},
            )
        ).scalar_one()
    return int(n)


async def describe_work_left(engine: AsyncEngine, sample: int = 15) -> str:
    """What is still unfinished, for a timeout's message: runs by status (with a sample of
    each: tag, attempts, lease owner, when it may run next) and pending turns (with the state
    of the run they wait for)."""
    async with engine.connect() as conn:
        runs = (
            await conn.execute(
                text(
                    "SELECT id, status, input->>'tag' AS tag, attempts, max_attempts, "
                    "lease_owner, lease_expires_at, scheduled_for, session_id, "
                    "(input->>'poison') IS NOT NULL AS poison FROM runs "
                    "WHERE status <> ALL(:terminal) ORDER BY status, created_at"
                ),
                {"terminal": list(TERMINAL)},
            )
        ).all()
        turns = (
            await conn.execute(
                text(
                    "SELECT t.id, t.policy, t.input->>'tag' AS tag, t.interrupt_by, "
                    "t.active_run_id, r.status AS active_status, "
                    "(SELECT a.id FROM runs a WHERE a.session_id = t.session_id "
                    " AND a.status = ANY(:active) LIMIT 1) AS session_active "
                    "FROM pending_turns t LEFT JOIN runs r ON r.id = t.active_run_id "
                    "WHERE t.status = 'pending' ORDER BY t.seq"
                ),
                {"active": list(ACTIVE)},
            )
        ).all()
        now = (await conn.execute(text("SELECT now()"))).scalar_one()
    lines = [f"at {now}: {len(runs)} runs not terminal, {len(turns)} pending turns pending"]
    by_status: dict[str, list[Any]] = defaultdict(list)
    for row in runs:
        by_status[row.status].append(row)
    for status, rows in by_status.items():
        lines.append(f"  {status}: {len(rows)}")
        lines.extend(
            f"    run {r.id} tag={r.tag} poison={r.poison} attempts={r.attempts}/"
            f"{r.max_attempts} owner={r.lease_owner} lease_expires={r.lease_expires_at} "
            f"scheduled_for={r.scheduled_for} session={r.session_id}"
            for r in rows[:sample]
        )
    lines.extend(
        f"  pending turn {t.id} tag={t.tag} policy={t.policy} interrupt_by={t.interrupt_by} "
        f"waits for run {t.active_run_id} ({t.active_status}); session's active run "
        f"{t.session_active}"
        for t in turns[:sample]
    )
    return "\n".join(lines)


async def until_settled(engine: AsyncEngine, *, stall: float, at_most: float, what: str) -> None:
    """Wait until every run is terminal and no pending turn is pending. Bounded by what the
    test caused, not by a guess at the machine's speed: it fails only when nothing finished
    for `stall` seconds (a stuck run or turn), or after `at_most` in all, and then says what
    was still unfinished."""
    began = time.monotonic()
    left = await work_left(engine)
    best, progressed = left, began
    while left:
        now = time.monotonic()
        if left < best:
            best, progressed = left, now
        if now - progressed > stall or now - began > at_most:
            why = (
                f"nothing finished for {stall:.0f}s"
                if now - progressed > stall
                else (f"{at_most:.0f}s in all")
            )
            raise AssertionError(
                f"timed out waiting for {what} ({why}):\n{await describe_work_left(engine)}"
            )
        await asyncio.sleep(0.5)  # a poll of two counts, not a wait for a fixed time
        left = await work_left(engine)


@dataclass
class TurnAccount:
    """Where every multitask turn went (exactly one of these each)."""

    ran: int = 0  # its run ended succeeded or failed
    interrupted: int = 0  # its run was cancelled by a later interrupting turn
    steered: int = 0  # delivered into the run it steered
    became_runs: int = 0
    pending_left: int = 0
    by_policy: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)


async def account_turns(engine: AsyncEngine, ledger: Ledger) -> TurnAccount:
    """Each multitask turn the clients were told of is accounted for exactly once: a run (the
    session was idle, the turn started when the run before it ended, or a steer arrived as the
    run ended), or an input delivered to the run it steered; a run cancelled only as
    `interrupted`. Each turn that became a run is added to the ledger's accepted runs (its id
    is the pending turn's), so `examine` holds every run against a client's answer."""
    account = TurnAccount()
    async with engine.connect() as conn:
        pending = {
            str(row.id): row
            for row in await conn.execute(
                text(
                    "SELECT id, policy, status, run_id, active_run_id, input->>'tag' AS tag "
                    "FROM pending_turns"
                )
            )
        }
        runs = {
            str(row.id): row
            for row in await conn.execute(
                text(
                    "SELECT r.id, r.status, r.session_id, r.input->>'tag' AS tag, "
                    "(SELECT e.data->>'reason' FROM run_events e WHERE e.run_id = r.id "
                    " AND e.type = 'run.cancelled' LIMIT 1) AS reason "
                    "FROM runs r WHERE r.session_id IS NOT NULL"
                )
            )
        }
        inputs: Counter[str] = Counter()
        input_run: dict[str, str] = {}
        for row in await conn.execute(
            text(
                "SELECT run_id, input->>'tag' AS tag FROM run_inputs "
                "WHERE input->>'tag' IS NOT NULL"
            )
        ):
            inputs[row.tag] += 1
            input_run[row.tag] = str(row.run_id)
    account.pending_left = sum(1 for row in pending.values() if row.status == "pending")

    def problem(message: str) -> None:
        account.problems.append(message)

    # An interrupt of a queued run answers with the run its pending turn became: any answer's
    # id may name a pending turn.
    told = {str(t.id) for t in ledger.turns.values()}
    if extra := set(pending) - told:
        # Pending turns of the multitask sessions only: no other load makes them.
        problem(f"{len(extra)} pending turns no client was told about, e.g. {sorted(extra)[:3]}")
    for tag, turn in sorted(ledger.turns.items()):
        account.by_policy[turn.policy] += 1
        row = pending.get(str(turn.id))
        run_id: str | None = None
        if turn.answer == "run":
            run_id = str(turn.id)
        elif row is None:
            problem(f"{tag}: pending turn {turn.id} is missing")
            continue
        elif row.status == "started" and str(row.run_id) == str(turn.id):
            run_id = str(turn.id)
        elif turn.answer == "steer" and row.status == "delivered":
            if str(row.run_id) != str(turn.run_id):
                problem(f"{tag}: steered into {row.run_id}, not the run {turn.run_id} it met")
            if input_run.get(tag) != str(row.run_id):
                problem(f"{tag}: delivered, but not among run {row.run_id}'s inputs")
            if any(r.tag == tag for r in runs.values()):
                problem(f"{tag}: delivered into a run and also a run of its own")
            account.steered += 1
        else:
            problem(f"{tag}: {turn.answer} turn ended {row.status} (run {row.run_id})")
        if inputs[tag] != 1:
            problem(f"{tag}: {inputs[tag]} inputs carry it (one expected)")
        if run_id is None:
            continue
        run = runs.get(run_id)
        if run is None or run.tag != tag:
            problem(f"{tag}: its run {run_id} is missing or carries {run and run.tag}")
            continue
        ledger.accept(tag, UUID(run_id))
        account.became_runs += 1
        if run.status == "cancelled":
            if run.reason != "interrupted":
                problem(f"{tag}: run {run_id} cancelled ({run.reason}), not interrupted")
            account.interrupted += 1
        elif run.status in ("succeeded", "failed"):
            account.ran += 1
        else:
            problem(f"{tag}: run {run_id} is still {run.status}")
    return account
