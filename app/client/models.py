"""What the client returns: runs, sessions and events as typed, immutable values decoded from
the API's JSON documents (the server's own models are in app/api/schemas.py; this package does
not import them, so the client stays light)."""

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

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL_EVENTS

    @classmethod
    def from_document(cls, document: dict[str, Any]) -> Event:
        return cls(
            seq=int(document["seq"]),
            type=str(document["type"]),
            epoch=int(document["epoch"]),
            data=document.get("data"),
            created_at=_required_time(document["created_at"]),
        )
