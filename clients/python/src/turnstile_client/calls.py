"""The API's routes as request descriptions (`Call`), and what the client needs around them:
naming runs and sessions, the long poll's timing, and the event stream's resume rules."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

import httpx

from turnstile_client.models import JSON, Delta, Event, PendingTurn, Run, Session

USER_AGENT = "turnstile-client"


def default_headers(api_key: str) -> dict[str, str]:
    """The headers every request of either client carries."""
    return {"Authorization": f"Bearer {api_key}", "User-Agent": USER_AGENT}


def checked_base_url(base_url: str) -> str:
    """The API's address, without a trailing slash; a ValueError for one that is not http(s)
    with a host (a typo should fail here, not as a connection error after retries)."""
    url = httpx.URL(base_url)
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"base_url must be an http:// or https:// URL with a host: {base_url!r}")
    return str(url).rstrip("/")


MAX_WAIT_SECONDS = 60.0  # the API's cap on one long poll (app/api/runs.py)
# Above the API's keep-alive comments (every 15 s), so a silent stream is a dead one.
STREAM_READ_TIMEOUT = 45.0

RunRef = Run | UUID | str
SessionRef = Session | UUID | str


@dataclass(frozen=True)
class Call:
    """One request: `retry` says whether repeating it unchanged is safe."""

    method: str
    path: str
    json: Any = None
    params: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None  # None: the client's own
    retry: bool = True


def run_id(run: RunRef) -> str:
    return str(run.id if isinstance(run, Run) else UUID(str(run)))


def session_id(session: SessionRef) -> str:
    return str(session.id if isinstance(session, Session) else UUID(str(session)))


def new_idempotency_key() -> str:
    return f"turnstile-client-{uuid.uuid4()}"


def submission_body(
    input: JSON,
    agent: str | None,
    priority: str | None,
    scheduled_for: datetime | str | None,
    start_within: float | None = None,
    start_before: datetime | str | None = None,
    multitask: str | None = None,
    approval: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A turn's or run's body; fields left out take the server's defaults (or, for an answer,
    the waiting run's values)."""
    body: dict[str, Any] = {"input": input}
    if approval is not None:
        body["approval"] = approval
    if multitask is not None:
        body["multitask"] = multitask
    if agent is not None:
        body["agent"] = agent
    if priority is not None:
        body["priority"] = priority
    if scheduled_for is not None:
        body["scheduled_for"] = _rfc3339("scheduled_for", scheduled_for)
    if start_within is not None and start_before is not None:
        raise ValueError("give start_within or start_before, not both")
    if start_within is not None:
        body["start_within"] = float(start_within)
    if start_before is not None:
        body["start_before"] = _rfc3339("start_before", start_before)
    return body


def _rfc3339(name: str, value: datetime | str) -> str:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError(f"{name} needs a time zone (the API takes RFC 3339)")
        return value.isoformat()
    return value


def create_session(multitask: str | None = None, approval: dict[str, Any] | None = None) -> Call:
    # A retry after a lost answer may leave one unused, empty session behind: harmless, since a
    # session holds nothing until a turn.
    body: dict[str, Any] = {}
    if multitask is not None:
        body["multitask"] = multitask
    if approval is not None:
        body["approval"] = approval
    return Call("POST", "/sessions", json=body or None)


def update_approval(session: SessionRef, approval: dict[str, Any] | None) -> Call:
    # Setting the same policy again is the same change: safe to repeat.
    return Call("PATCH", f"/sessions/{session_id(session)}", json={"approval": approval})


def decide(run: RunRef, decision: dict[str, Any], key: str) -> Call:
    """A decision on the tool call a run waits to have approved (POST /runs/{id}/approval)."""
    return Call(
        "POST", f"/runs/{run_id(run)}/approval", json=decision, headers={"Idempotency-Key": key}
    )


def decision_body(
    run: RunRef,
    call_id: str | None,
    decision: str,
    args: dict[str, Any] | None = None,
    reason: str | None = None,
) -> dict[str, Any]:
    """The decision's body; the call defaults to the one a `Run` shows it waits for."""
    if call_id is None:
        request = run.approval_request if isinstance(run, Run) else None
        if not isinstance(request, dict):
            raise ValueError("name the call_id: this run shows no approval_request")
        call_id = str(request["call_id"])
    body: dict[str, Any] = {"call_id": call_id, "decision": decision}
    if args is not None:
        body["args"] = args
    if reason is not None:
        body["reason"] = reason
    return body


def update_session(session: SessionRef, multitask: str) -> Call:
    # Setting the same policy again is the same change: safe to repeat.
    return Call("PATCH", f"/sessions/{session_id(session)}", json={"multitask": multitask})


PendingTurnRef = PendingTurn | tuple[SessionRef, UUID | str]


def pending_turn_path(turn: PendingTurnRef) -> str:
    if isinstance(turn, PendingTurn):
        return f"/sessions/{turn.session_id}/pending-turns/{turn.id}"
    session, turn_id = turn
    return f"/sessions/{session_id(session)}/pending-turns/{UUID(str(turn_id))}"


def list_pending_turns(session: SessionRef) -> Call:
    return Call("GET", f"/sessions/{session_id(session)}/pending-turns")


def get_pending_turn(turn: PendingTurnRef) -> Call:
    return Call("GET", pending_turn_path(turn))


def cancel_pending_turn(turn: PendingTurnRef) -> Call:
    # A cancelled pending turn answers 200 again, so a retry is safe.
    return Call("POST", pending_turn_path(turn) + "/cancel")


def get_session(session: SessionRef) -> Call:
    return Call("GET", f"/sessions/{session_id(session)}")


def submit_turn(session: SessionRef, body: dict[str, Any], key: str) -> Call:
    return Call(
        "POST",
        f"/sessions/{session_id(session)}/turns",
        json=body,
        headers={"Idempotency-Key": key},
    )


def submit_run(body: dict[str, Any], key: str) -> Call:
    return Call("POST", "/runs", json=body, headers={"Idempotency-Key": key})


def get_run(run: RunRef) -> Call:
    return Call("GET", f"/runs/{run_id(run)}")


def poll_run(run: RunRef, status: str, seconds: float, read_timeout: float) -> Call:
    """A long poll: answers when the run's status is no longer `status`, or after `seconds`."""
    return Call(
        "GET",
        f"/runs/{run_id(run)}",
        params={"wait": f"{seconds:.3f}", "status": status},
        timeout=seconds + read_timeout,
    )


def cancel(run: RunRef, reason: str | None = None) -> Call:
    # Cancelling a cancelled run answers 200 again, so a retry is safe.
    body = None if reason is None else {"reason": reason}
    return Call("POST", f"/runs/{run_id(run)}/cancel", json=body)


def events_path(run: RunRef) -> str:
    return f"/runs/{run_id(run)}/events"


def stream_headers(last_seq: int) -> dict[str, str]:
    headers = {"Accept": "text/event-stream"}
    if last_seq > 0:
        headers["Last-Event-ID"] = str(last_seq)
    return headers


def decode_event(data: str) -> Event:
    return Event.from_document(json.loads(data))


DELTA_EVENT = "message.delta"
# The server's last word on a stream it ends early (its key was revoked): not an event of a
# run. The reconnect that follows gets the API's answer (401), raised as UnauthorizedError.
ENDED_EVENT = "stream.ended"


def session_events_path(session: SessionRef) -> str:
    return f"/sessions/{session_id(session)}/events"


def session_stream_headers(last: tuple[int, int] | None) -> dict[str, str]:
    """A session stream resumes after its last durable event, `<run_no>.<seq>`."""
    headers = {"Accept": "text/event-stream"}
    if last is not None:
        headers["Last-Event-ID"] = f"{last[0]}.{last[1]}"
    return headers


def session_position(event_id: str) -> tuple[int, int]:
    run_no, _, seq = event_id.strip().partition(".")
    return int(run_no), int(seq)


def decode_item(event_type: str, data: str) -> Event | Delta:
    """A stream's item: a live delta, or a durable event."""
    if event_type == DELTA_EVENT:
        return Delta.from_document(json.loads(data))
    return decode_event(data)


def as_run(document: Any) -> Run:
    return Run.from_document(document)


def as_pending_turn(document: Any) -> PendingTurn:
    return PendingTurn.from_document(document)


def as_pending_turns(document: Any) -> list[PendingTurn]:
    return [PendingTurn.from_document(turn) for turn in document["pending_turns"]]


def as_submitted(document: Any) -> Run | PendingTurn:
    """A turn's answer: the run it started or reached, or a pending turn (enqueue, or an
    interrupt of a running run)."""
    if isinstance(document, dict) and document.get("kind") == "pending_turn":
        return PendingTurn.from_document(document)
    return Run.from_document(document)


def as_session(document: Any) -> Session:
    return Session.from_document(document)
