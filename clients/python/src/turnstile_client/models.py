"""What the client returns: runs, sessions and events as typed, immutable values decoded from
the API's JSON documents (its OpenAPI document, `/openapi.json`, describes them; this package
shares no code with the server, so the client stays light)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, cast
from uuid import UUID

RunStatus = Literal["queued", "running", "waiting_for_user", "succeeded", "failed", "cancelled"]
PriorityClass = Literal["interactive", "async", "maintenance"]
SessionState = Literal["idle", "busy", "waiting_for_user"]

TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
# The statuses a waiter stops at: the run is over, or it needs the user.
SETTLED_STATUSES: frozenset[str] = TERMINAL_STATUSES | {"waiting_for_user"}
# The events that close a run's log: its stream ends after one of them.
TERMINAL_EVENTS: frozenset[str] = frozenset({"run.succeeded", "run.failed", "run.cancelled"})

JSON = Any  # anything JSON: the API keeps inputs, questions and results as the client sent them


def _time(value: object) -> datetime | None:
    return None if value is None else datetime.fromisoformat(str(value))


def _required_time(value: object) -> datetime:
    return datetime.fromisoformat(str(value))


def _uuid(value: object) -> UUID | None:
    return None if value is None else UUID(str(value))


@dataclass(frozen=True)
class Run:
    """A run as `GET /runs/{id}` shows it. `raw` keeps the whole document, fields this client
    does not know yet included."""

    id: UUID
    session_id: UUID | None
    status: RunStatus
    priority_class: PriorityClass
    priority: int
    agent: str
    input: JSON
    attempts: int
    max_attempts: int
    question: JSON
    result: JSON
    failure: JSON
    scheduled_for: datetime | None
    resubmitted_from: UUID | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    dismissed_at: datetime | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    # Its deadline to start (None: none, or a server that predates deadlines).
    start_before: datetime | None = None
    # While waiting_for_user for a tool call's approval: the call (`call_id`, `tool`,
    # `arguments`, `idempotency_class`, `step`, `parameters`); None otherwise.
    approval_request: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        """Succeeded, failed or cancelled: nothing will change it any more."""
        return self.status in TERMINAL_STATUSES

    @property
    def waiting_for_user(self) -> bool:
        """The run asked `question` and waits for the session's next turn (`answer`)."""
        return self.status == "waiting_for_user"

    @classmethod
    def from_document(cls, document: dict[str, Any]) -> Run:
        return cls(
            id=UUID(str(document["id"])),
            session_id=_uuid(document.get("session_id")),
            status=cast(RunStatus, document["status"]),
            priority_class=cast(PriorityClass, document["class"]),
            priority=int(document["priority"]),
            agent=str(document["agent"]),
            input=document.get("input"),
            attempts=int(document["attempts"]),
            max_attempts=int(document["max_attempts"]),
            question=document.get("question"),
            result=document.get("result"),
            failure=document.get("failure"),
            scheduled_for=_time(document.get("scheduled_for")),
            resubmitted_from=_uuid(document.get("resubmitted_from")),
            created_at=_required_time(document["created_at"]),
            updated_at=_required_time(document["updated_at"]),
            started_at=_time(document.get("started_at")),
            finished_at=_time(document.get("finished_at")),
            dismissed_at=_time(document.get("dismissed_at")),
            raw=document,
            start_before=_time(document.get("start_before")),
            approval_request=document.get("approval_request"),
        )


@dataclass(frozen=True)
class Session:
    """A conversation: `idle`, `busy` with its active run, or `waiting_for_user` with the
    question its run asked."""

    id: UUID
    created_at: datetime
    state: SessionState
    active_run_id: UUID | None
    active_run_status: RunStatus | None
    question: JSON
    raw: dict[str, Any] = field(repr=False, compare=False)
    multitask: str = "reject"
    pending_turns: int = 0
    # Its approval policy (None: the server's default) and the call its run waits to have
    # approved, if any.
    approval: dict[str, Any] | None = None
    approval_request: dict[str, Any] | None = None

    @classmethod
    def from_document(cls, document: dict[str, Any]) -> Session:
        return cls(
            id=UUID(str(document["id"])),
            created_at=_required_time(document["created_at"]),
            state=cast(SessionState, document["state"]),
            active_run_id=_uuid(document.get("active_run_id")),
            active_run_status=cast("RunStatus | None", document.get("active_run_status")),
            question=document.get("question"),
            raw=document,
            multitask=str(document.get("multitask", "reject")),
            pending_turns=int(document.get("pending_turns", 0)),
            approval=document.get("approval"),
            approval_request=document.get("approval_request"),
        )


ApprovalPolicy = dict[str, list[str]]
"""Which tool calls wait for a user's approval (the server's docs/approvals.md):
`{"tools": [...names], "classes": [...of safe, keyed, unsafe]}`; `{}`: none."""

MultitaskPolicy = Literal["reject", "enqueue", "interrupt", "steer"]
"""What a turn does when its session's run is queued or running (the server's
docs/turn-control.md): reject (SessionBusyError), enqueue, interrupt, steer."""


@dataclass(frozen=True)
class PendingTurn:
    """A turn waiting for its session's active run (enqueue, or interrupt of a running run):
    `position` 1 is next; once `status` is `started`, `run_id` is the run it became."""

    id: UUID
    session_id: UUID
    policy: str
    status: str  # pending, started, delivered, cancelled
    position: int | None
    active_run_id: UUID | None
    run_id: UUID | None
    created_at: datetime
    raw: dict[str, Any] = field(repr=False, compare=False)
    # Its deadline to start, which the run it becomes takes (None: none).
    start_before: datetime | None = None

    @classmethod
    def from_document(cls, document: dict[str, Any]) -> PendingTurn:
        position = document.get("position")
        return cls(
            id=UUID(str(document["id"])),
            session_id=UUID(str(document["session_id"])),
            policy=str(document["policy"]),
            status=str(document["status"]),
            position=None if position is None else int(position),
            active_run_id=_uuid(document.get("active_run_id")),
            run_id=_uuid(document.get("run_id")),
            created_at=_required_time(document["created_at"]),
            raw=document,
            start_before=_time(document.get("start_before")),
        )


@dataclass(frozen=True)
class Event:
    """One entry of a run's log: `seq` numbers them from 1 without gaps; `epoch` is the claim
    that wrote it (0 before the first claim)."""

    seq: int
    type: str
    epoch: int
    data: JSON
    created_at: datetime
    # On a session's stream: the run it belongs to, and that run's number in the session.
    run_id: UUID | None = None
    run_no: int | None = None

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL_EVENTS

    @property
    def position(self) -> tuple[int, int]:
        """Where the event stands in its session's stream: (run number, sequence number)."""
        return (self.run_no or 0, self.seq)

    @classmethod
    def from_document(cls, document: dict[str, Any]) -> Event:
        return cls(
            seq=int(document["seq"]),
            type=str(document["type"]),
            epoch=int(document["epoch"]),
            data=document.get("data"),
            created_at=_required_time(document["created_at"]),
            run_id=_uuid(document.get("run_id")),
            run_no=int(document["run_no"]) if document.get("run_no") is not None else None,
        )


@dataclass(frozen=True)
class Delta:
    """A piece of the message a run is writing (`message.delta`): never stored, so it may be
    missed; `message.completed` (an `Event`) carries the whole text. `epoch` is the claim that
    wrote it (a re-run after a lost lease writes with a higher one: drop the older partial
    text), `message` counts the messages that claim completed before it, and `offset` says
    where `text` goes in the message (in characters)."""

    run_id: UUID
    epoch: int
    message: int
    offset: int
    text: str

    @classmethod
    def from_document(cls, document: dict[str, Any]) -> Delta:
        return cls(
            run_id=UUID(str(document["run_id"])),
            epoch=int(document["epoch"]),
            message=int(document["message"]),
            offset=int(document["offset"]),
            text=str(document["text"]),
        )


@dataclass
class _Partial:
    epoch: int = 0
    message: int = 0
    text: str = ""


class LiveText:
    """The text of each run's message as it is being written, from a stream's deltas and
    events: feed it every item (`apply`) and show `text(run_id)`.

    The rules a client follows (docs/runtime.md): a delta of an older epoch than the run's
    newest is dropped, and one of a newer epoch (the run was re-run) replaces the partial text;
    a delta places its text at its offset (an offset before the end replaces from there, as a
    retried model call does; one past the end means a delta was missed: it waits for the whole
    text); `message.completed` is the authoritative text and ends the message."""

    def __init__(self) -> None:
        self._runs: dict[UUID, _Partial] = {}

    def text(self, run_id: UUID) -> str:
        partial = self._runs.get(run_id)
        return partial.text if partial else ""

    def apply(self, item: Event | Delta, run_id: UUID | None = None) -> str | None:
        """Take one item of a stream (`run_id`: the run, for a run's own stream, whose events
        do not name it); the run's partial text after it, or the whole text of a message it
        completed."""
        if isinstance(item, Delta):
            partial = self._runs.setdefault(item.run_id, _Partial())
            if (item.epoch, item.message) < (partial.epoch, partial.message):
                return partial.text  # an older claim's or an already completed message
            if (item.epoch, item.message) > (partial.epoch, partial.message):
                partial.epoch, partial.message, partial.text = item.epoch, item.message, ""
            if item.offset <= len(partial.text):
                partial.text = partial.text[: item.offset] + item.text
            return partial.text
        owner = item.run_id or run_id
        if owner is None:
            return None
        partial = self._runs.setdefault(owner, _Partial())
        if item.epoch > partial.epoch:
            partial.epoch, partial.message, partial.text = item.epoch, 0, ""
        if item.type == "message.completed" and isinstance(item.data, dict):
            partial.message = int(item.data.get("message", 0)) + 1
            partial.text = ""
            return str(item.data.get("text", ""))
        if item.terminal:
            self._runs.pop(owner, None)
        return None
