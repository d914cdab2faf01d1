"""Values the queue core hands out: runs, leases, and the outcomes of fenced writes.

A fenced write returns `Written` or `Fenced`. `Fenced` is an ordinary value, not an exception
(ADR-0004 decision 4): losing a lease is an expected outcome, and the caller must branch on it
where continuing would be wrong. The only thing to do with it is stop, and record `run.fenced`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from sqlalchemy import RowMapping

from app.vocabulary.classes import PriorityClass

JSON = Any


@dataclass(frozen=True)
class Lease:
    """A worker's hold on a run: the fencing token every later write asserts."""

    run_id: UUID
    epoch: int
    owner: str

    @property
    def key(self) -> tuple[UUID, int]:
        """What names one execution of a run: a process may hold a stale and a fresh
        execution of the same run at once, so the run id alone never does."""
        return (self.run_id, self.epoch)


@dataclass(frozen=True)
class Written:
    """The fenced write committed; `seq` is the sequence number of the event it wrote."""

    seq: int


@dataclass(frozen=True)
class Fenced:
    """The fence held no row: the run was reclaimed, cancelled or finished. Stop."""

    lease: Lease


WriteOutcome = Written | Fenced


@dataclass(frozen=True)
class HoldEnd:
    """How a worker's hold on a run ends (the store's `end_holds`): its lease, the outcome
    (succeeded, failed, waiting, released, capacity, retry, or the sweeper's expired) and what
    goes with it (the result, the failure, the question and its checkpoint, the reason)."""

    lease: Lease
    outcome: str
    value: Any = None
    step: int | None = None
    state: Any = None

    @classmethod
    def succeeded(cls, lease: Lease, result: Any) -> HoldEnd:
        return cls(lease, "succeeded", result)

    @classmethod
    def failed(cls, lease: Lease, failure: Any) -> HoldEnd:
        """A permanent failure: never requeued, whatever attempts remain."""
        return cls(lease, "failed", failure)

    @classmethod
    def waiting(cls, lease: Lease, question: Any, *, step: int, state: Any) -> HoldEnd:
        return cls(lease, "waiting", question, step, state)

    @classmethod
    def released(cls, lease: Lease, reason: str) -> HoldEnd:
        """A graceful release (drain): requeued at once, the attempt given back."""
        return cls(lease, "released", {"reason": reason})

    @classmethod
    def capacity(cls, lease: Lease, reason: str, *, until: datetime, endpoint: str) -> HoldEnd:
        """A wait for model capacity (docs/model-budgets.md): requeued for `until`, when the
        endpoint's budget will have room, the attempt given back, like a graceful release."""
        return cls(
            lease,
            "capacity",
            {"reason": reason, "until": until.isoformat(), "endpoint": endpoint},
        )

    @classmethod
    def retry(cls, lease: Lease, reason: str) -> HoldEnd:
        """Transient retries ran out: requeued with backoff, or dead-lettered on the last."""
        return cls(lease, "retry", {"reason": reason})


RUN_ID_PREFIX = 8
"""How many leading characters of a run id a notification names a run by (runs.sql bounds
every payload; listeners match these prefixes)."""

UNKNOWN_OUTCOME = (
    "The outcome of this call is unknown: it started, but the worker running it stopped before "
    "recording a result. It may or may not have taken effect; it will not be repeated."
)
"""What the model is told of an unsafe call that started and recorded no outcome (ADR-0004
decision 8): by recovery on the next attempt, or by the sweeper when it dead-letters the run."""


class UndecodableRun(ValueError):
    """A run row the code cannot turn into a `Run` (a time out of every range)."""

    def __init__(self, run_id: object, reason: str) -> None:
        super().__init__(f"run {run_id} cannot be decoded: {reason}")
        self.run_id = run_id
        self.reason = reason


@dataclass(frozen=True)
class Run:
    """A snapshot of one run row."""

    id: UUID
    tenant_id: str
    principal: str
    session_id: UUID | None
    session_run_no: int | None  # the run's number within its session (None: sessionless)
    status: str
    priority: int
    agent: str
    input: JSON
    question: JSON
    result: JSON
    failure: JSON
    attempts: int
    max_attempts: int
    scheduled_for: datetime | None
    lease_epoch: int
    lease_owner: str | None
    lease_expires_at: datetime | None
    last_event_seq: int
    inputs_count: int
    resubmitted_from: UUID | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    dismissed_at: datetime | None
    schedule_id: UUID | None  # set on a schedule's ticks (app/queue/scheduling.py)
    fire_at: datetime | None  # the tick's fire time; a catch-up run keeps its first missed one
    # The W3C trace context the run's work joins (app/observability/tracing.py); internal, not
    # part of the run's document.
    traceparent: str | None = None
    # Its deadline to start (docs/start-deadlines.md): queued and never claimed then, it ends
    # cancelled ('expired'). None: no deadline.
    start_before: datetime | None = None
    # The approval policy its turn gave (docs/approvals.md; migration 0025), or None.
    approval: JSON = None

    @property
    def approval_request(self) -> JSON:
        """The tool call this run waits to have approved (docs/approvals.md), or None."""
        question = self.question
        if self.status == "waiting_for_user" and isinstance(question, dict):
            return question.get("approval_request")
        return None

    @property
    def priority_class(self) -> PriorityClass:
        return PriorityClass.of(self.priority)

    @property
    def eligible_at(self) -> datetime:
        return self.scheduled_for or self.created_at

    @classmethod
    def from_row(cls, row: RowMapping | Mapping[str, Any]) -> Run:
        """The run of a row; `UndecodableRun` when a time is not a real instant (the driver
        turns PostgreSQL's infinities into naive `datetime.max` and `datetime.min`)."""
        # A row read before migration 0025 (or by a statement that names its columns) has no
        # approval policy.
        values: dict[str, Any] = {
            name: row.get(name) if name in _OPTIONAL_FIELDS else row[name] for name in _RUN_FIELDS
        }
        for name in _TIME_FIELDS:
            value = values[name]
            if value is not None and (not isinstance(value, datetime) or value.tzinfo is None):
                raise UndecodableRun(row.get("id"), f"{name} is not a time: {value!r}")
        return cls(**values)

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> Run:
        """The run from its row as PostgreSQL's `to_jsonb` spelled it (ids and times as
        strings; times in the session's zone, brought back to UTC as the driver gives them)."""
        # An answer stored before a column existed (migration 0005) spells no value for it.
        values: dict[str, Any] = {
            name: row.get(name) if name in _LATER_FIELDS | _OPTIONAL_FIELDS else row[name]
            for name in _RUN_FIELDS
        }
        for name in _UUID_FIELDS:
            if values[name] is not None:
                values[name] = UUID(values[name])
        for name in _TIME_FIELDS:
            if values[name] is not None:
                values[name] = datetime.fromisoformat(values[name]).astimezone(UTC)
        return cls(**values)

    def to_document(self) -> dict[str, JSON]:
        """The run as clients see it (GET /runs/{id}), JSON-ready; idempotent replays return
        the document stored with the first response."""
        return {
            "id": str(self.id),
            "session_id": str(self.session_id) if self.session_id else None,
            "session_run_no": self.session_run_no,
            "status": self.status,
            "class": self.priority_class.value,
            "priority": self.priority,
            "agent": self.agent,
            "input": self.input,
            "attempts": self.attempts,
            "max_attempts": self.max_attempts,
            "scheduled_for": _iso(self.scheduled_for),
            "question": self.question if self.status == "waiting_for_user" else None,
            "approval_request": self.approval_request,
            "result": self.result,
            "failure": self.failure,
            "resubmitted_from": str(self.resubmitted_from) if self.resubmitted_from else None,
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
            "dismissed_at": _iso(self.dismissed_at),
            "schedule_id": str(self.schedule_id) if self.schedule_id else None,
            "fire_at": _iso(self.fire_at),
            "start_before": _iso(self.start_before),
        }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


_RUN_FIELDS = [f for f in Run.__dataclass_fields__]
_LATER_FIELDS = frozenset({"session_run_no", "traceparent", "start_before"})
_OPTIONAL_FIELDS = frozenset({"approval"})
_UUID_FIELDS = ("id", "session_id", "resubmitted_from", "schedule_id")
_TIME_FIELDS = (
    "scheduled_for",
    "fire_at",
    "lease_expires_at",
    "created_at",
    "updated_at",
    "started_at",
    "finished_at",
    "dismissed_at",
    "start_before",
)


@dataclass(frozen=True)
class ClaimedRun:
    """A run just claimed, with the lease its holder must present on every write."""

    run: Run
    lease: Lease


@dataclass(frozen=True)
class NewRun:
    """What enqueue needs to create a run."""

    tenant_id: str
    principal: str
    agent: str
    input: JSON
    priority: int = PriorityClass.INTERACTIVE.base
    session_id: UUID | None = None
    scheduled_for: datetime | None = None
    max_attempts: int | None = None
    resubmitted_from: UUID | None = None
    actor: str | None = None  # the key that submitted it, recorded in run.created
    traceparent: str | None = None  # the trace its work joins (a valid W3C traceparent)
    start_before: datetime | None = None  # its deadline to start (None: none)
    # Or its deadline as seconds after it becomes eligible, counted on the database's clock
    # as `turnstile_submit` counts a submission's (ignored when start_before is given).
    start_within: float | None = None


@dataclass(frozen=True)
class SweepReport:
    requeued: int = 0
    failed: int = 0


@dataclass(frozen=True)
class CancelOutcome:
    """`changed` is False when the run was already cancelled (a no-op)."""

    run: Run
    changed: bool


@dataclass(frozen=True)
class Event:
    seq: int
    type: str
    epoch: int
    data: JSON
    created_at: datetime


@dataclass(frozen=True)
class SessionProgress:
    """Where a session stream's current run stands (reads.sql: watch_session_events)."""

    run_id: UUID
    run_no: int
    status: str
    last_event_seq: int
    scheduled_for: datetime | None
    has_next: bool


@dataclass(frozen=True)
class RunProgress:
    """Where a run stands, as an event stream rechecks it."""

    status: str
    last_event_seq: int
    scheduled_for: datetime | None


@dataclass(frozen=True)
class Checkpoint:
    event_seq: int
    epoch: int
    step: int
    state: JSON


@dataclass(frozen=True)
class JournalEntry:
    event_seq: int
    epoch: int
    step: int
    entry: str
    tool: str
    idempotency_class: str
    idempotency_key: str | None
    args: JSON
    outcome_status: str | None
    outcome: JSON


@dataclass(frozen=True)
class ToolCall:
    """What `tool_started` records before a tool runs."""

    step: int
    tool: str
    idempotency_class: str
    idempotency_key: str | None = None
    args: JSON = field(default=None)


@dataclass(frozen=True)
class TranscriptEntry:
    """One entry of a session's conversation (`session_transcript`), ordered by (run_no, seq).

    role/kind: user/input (the turn that created the run), user/answer (an answer delivered to
    it), assistant/question, assistant/final, tool/tool_call (`tool` holds name, step, args,
    status; `content` the outcome), system/failed and system/cancelled (the run's end)."""

    run_no: int
    seq: int
    run_id: UUID
    role: str
    kind: str
    content: JSON
    tool: JSON
    created_at: datetime

    @classmethod
    def from_row(cls, row: RowMapping) -> TranscriptEntry:
        return cls(**{name: row[name] for name in cls.__dataclass_fields__})

    def to_json(self) -> dict[str, JSON]:
        """JSON-ready (the API's item, and what agents receive as history)."""
        document: dict[str, JSON] = {
            "run_no": self.run_no,
            "seq": self.seq,
            "run_id": str(self.run_id),
            "role": self.role,
            "kind": self.kind,
            "content": self.content,
            "created_at": _iso(self.created_at),
        }
        if self.tool is not None:
            document["tool"] = self.tool
        return document


MIN_SUBMIT_RATE = 1 / 86_400
"""The least submission rate a limit may set: one a day. A rate stored below it (before the
bound, e.g. 1e-300) counts as it here, so `Retry-After` stays within a day instead of a number
of 300 digits that no header or document should carry."""


@dataclass(frozen=True)
class SubmitAllowance:
    """A tenant's submission rate limit and its bucket: `rate` tokens a second up to `burst`,
    `tokens` in the bucket (after the submission that reported it, or as found)."""

    rate: float
    burst: int
    tokens: float

    @property
    def remaining(self) -> int:
        """Whole submissions the bucket allows now."""
        return max(0, math.floor(self.tokens))

    @property
    def next_token_seconds(self) -> int | None:
        """Seconds until the bucket holds one more whole token (None when it is full), rounded
        up: `Retry-After` for a refused submission, the RateLimit field's `t`."""
        if self.tokens >= self.burst:
            return None
        missing = self.remaining + 1 - self.tokens
        return max(1, math.ceil(missing / max(self.rate, MIN_SUBMIT_RATE) - 1e-9))

    @property
    def window_seconds(self) -> int:
        """How long an empty bucket takes to fill (at least 1 s): the policy's window, over
        which `burst` submissions are allowed."""
        return max(1, math.ceil(self.burst / max(self.rate, MIN_SUBMIT_RATE)))

    @classmethod
    def of(
        cls, rate: float | None, burst: int | None, tokens: float | None
    ) -> SubmitAllowance | None:
        if rate is None or burst is None or tokens is None:
            return None
        return cls(rate=float(rate), burst=int(burst), tokens=float(tokens))
