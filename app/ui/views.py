"""What the dashboard's pages show, as plain values: a run's timeline read from its events,
a session's transcript entries, the overview's tables, and the parsing of the runs list's
filters, and the overview's charts. No I/O and no HTTP here;
app/ui/routes.py reads the rows and renders these with the templates."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from markupsafe import Markup

from app.queue.reads import ClassDepth, MinuteStats
from app.queue.tenant_limits import TenantDepth
from app.ui.charts import Series, chart
from app.vocabulary import statuses
from app.vocabulary.classes import BAND_WIDTH, PriorityClass
from app.vocabulary.records import Event, TranscriptEntry

CLASSES = [klass.value for klass in PriorityClass]
STATUSES = tuple(status.value for status in statuses.ALL)
ACTIVE = tuple(status.value for status in statuses.ACTIVE)
MAX_FILTER_LENGTH = 200


def compact_json(value: Any, limit: int = 2000) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


def when(value: datetime | None) -> str:
    """A timestamp as operators read it: UTC, to the millisecond."""
    if value is None:
        return ""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


# --- a run's timeline ------------------------------------------------------------------------
@dataclass(frozen=True)
class TimelineEntry:
    seq: int
    at: str
    type: str
    epoch: int
    title: str
    detail: str = ""
    # CSS classes: the kind of event (claim, tool, fence, ...) and "uncertain"/"bad" marks.
    tags: tuple[str, ...] = ()
    data: str = ""
    # The step's duration: the time since the event before it on this page ("" for the first).
    since_previous: str = ""
    # A tool.finished event's call: how long after its tool.started it was recorded.
    took: str = ""


def duration(seconds: float | None) -> str:
    """A duration as an operator reads it: milliseconds under a second, then s, min, h."""
    if seconds is None:
        return ""
    seconds = max(seconds, 0.0)  # an injected clock set back must not print "-3 ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return age(seconds)


def _step(data: Mapping[str, Any]) -> str:
    return f"step {data.get('step')}" if data.get("step") is not None else ""


def timeline(
    events: Sequence[Event],
    inputs: Mapping[int, Mapping[str, Any]],
    hosts: Mapping[str, str] | None = None,
) -> list[TimelineEntry]:
    """One entry per event, worded for an operator. `inputs` maps the event sequence number
    that delivered an input to that input row (its content and principal); `hosts` maps worker
    ids to where they run, given for operator and admin keys only.

    Each entry after the first says how long after the previous event it came (the step's
    duration), and each tool.finished how long after its call's tool.started: the call's
    duration when the same lease holder recorded both, or, when a later attempt recorded it
    (an uncertain outcome after a lost lease), how long after the call started that was."""
    entries: list[TimelineEntry] = []
    previous: Event | None = None
    started: dict[tuple[object, object], Event] = {}  # (step, tool) -> its tool.started
    for event in events:
        entry = _entry(event, inputs, hosts or {})
        d: Mapping[str, Any] = event.data if isinstance(event.data, Mapping) else {}
        took = ""
        if event.type == "tool.started":
            started[(d.get("step"), d.get("tool"))] = event
        elif event.type == "tool.finished":
            call = started.pop((d.get("step"), d.get("tool")), None)
            if call is not None:
                seconds = (event.created_at - call.created_at).total_seconds()
                took = duration(seconds)
                if call.epoch != event.epoch:
                    took += f", recorded at epoch {event.epoch} after the call at {call.epoch}"
        since = (
            duration((event.created_at - previous.created_at).total_seconds())
            if previous is not None
            else ""
        )
        entries.append(replace(entry, since_previous=since, took=took))
        previous = event
    return entries


@dataclass(frozen=True)
class Message:
    """One transcript entry as the session page shows it."""

    run_no: int
    seq: int
    run_id: UUID
    role: str
    kind: str
    who: str  # the label beside the text
    text: str
    at: str
    tags: list[str] = field(default_factory=list)  # CSS classes: the role, uncertain, ended


def message(entry: TranscriptEntry) -> Message:
    content = entry.content
    tags = [entry.role]
    if entry.role == "tool":
        tool = entry.tool if isinstance(entry.tool, dict) else {}
        status = str(tool.get("status"))
        who = f"tool {tool.get('name')} ({status})"
        text = f"{compact_json(tool.get('args'), 300)} → {compact_json(content, 600)}"
        if status == "uncertain":
            tags.append("uncertain")
    elif entry.role == "system":
        who = f"run {entry.kind}"
        ended = content if isinstance(content, dict) else {}
        detail = ended.get("failure") or ended.get("reason")
        text = compact_json(detail, 600) if detail else ""
        tags.append("ended")
    else:
        who = entry.role if entry.kind in ("input", "final") else f"{entry.role} ({entry.kind})"
        text = content if isinstance(content, str) else compact_json(content, 2000)
    return Message(
        run_no=entry.run_no,
        seq=entry.seq,
        run_id=entry.run_id,
        role=entry.role,
        kind=entry.kind,
        who=who,
        text=text,
        at=when(entry.created_at),
        tags=tags,
    )


def worker_owners(events: Iterable[Event]) -> set[str]:
    """The worker ids a run's events name (claims and fenced writes)."""
    return {
        str(e.data["owner"])
        for e in events
        if isinstance(e.data, Mapping) and isinstance(e.data.get("owner"), str)
    }


def worker_label(worker_id: str | None, hosts: Mapping[str, str]) -> str:
    """A worker id, with its host and pid when the viewer may see them."""
    where = hosts.get(str(worker_id))
    return f"{worker_id} ({where})" if where else str(worker_id)


def _entry(
    event: Event, inputs: Mapping[int, Mapping[str, Any]], hosts: Mapping[str, str]
) -> TimelineEntry:
    d: Mapping[str, Any] = event.data if isinstance(event.data, Mapping) else {}
    title = event.type
    detail = ""
    tags: list[str] = [event.type.split(".")[0]]
    match event.type:
        case "run.created":
            klass = PriorityClass.of(int(d.get("priority", 0))).value
            title = f"created ({klass}, agent {d.get('agent')}, by {d.get('principal')})"
            if d.get("resubmitted_from"):
                detail = f"resubmission of {d['resubmitted_from']}"
            if d.get("scheduled_for"):
                detail = f"scheduled for {d['scheduled_for']}"
        case "run.claimed":
            title = f"claimed at epoch {event.epoch}, attempt {d.get('attempt')}"
            detail = (
                f"by {worker_label(d.get('owner'), hosts)}, lease until {d.get('lease_expires_at')}"
            )
            tags.append("claim")
        case "tool.started":
            title = f"tool {d.get('tool')} started, {_step(d)}, {d.get('idempotency_class')}"
            if d.get("idempotency_key"):
                detail = f"idempotency key {d['idempotency_key']}"
            tags.append("tool")
        case "tool.finished":
            status = str(d.get("outcome_status"))
            title = f"tool {d.get('tool')} {status}, {_step(d)}, {d.get('idempotency_class')}"
            detail = compact_json(d.get("outcome"), 300)
            tags.append("tool")
            if status == "uncertain":
                tags.append("uncertain")
                title += " (outcome unknown: not repeated)"
            elif status == "failed":
                tags.append("bad")
        case "run.waiting":
            title = f"asked the user: {compact_json(d.get('question'), 300)}"
            tags.append("question")
        case "run.input_delivered":
            row = inputs.get(event.seq)
            who = d.get("principal")
            title = f"answer {d.get('input_index')} from {who}"
            if row is not None:
                detail = compact_json(row.get("input"), 300)
            tags.append("question")
        case "run.fenced":
            during = d.get("during")
            lost = "heartbeat lost: " if during == "heartbeat" else ""
            title = (
                f"{lost}fenced: a worker at stale epoch {d.get('stale_epoch')} tried to write "
                f"(current epoch {d.get('current_epoch')}, run {d.get('status')})"
            )
            detail = (
                f"worker {worker_label(d.get('owner'), hosts)}, during {during}; "
                "nothing it wrote was kept"
            )
            tags.append("fence")
        case "run.requeued":
            title = f"requeued: {d.get('reason', 'lease expired')} (heartbeats stopped)"
            detail = f"after attempt {d.get('attempts')}, retry at {d.get('retry_at')}"
            tags.append("requeue")
        case "run.released":
            how = "graceful release (drain)" if d.get("graceful") else "early release"
            title = f"{how}, attempts now {d.get('attempts')}"
            detail = str(d.get("reason") or "")
            if d.get("retry_at"):
                detail += f"; retry at {d['retry_at']}"
            tags.append("requeue")
        case "run.succeeded":
            title = "succeeded"
            tags.append("good")
        case "run.failed":
            failure = d.get("failure") or {}
            kind = failure.get("kind") if isinstance(failure, Mapping) else None
            title = f"failed: {kind}"
            if isinstance(failure, Mapping):
                detail = str(failure.get("message", ""))
            tags.append("bad")
        case "run.cancelled":
            title = f"cancelled by {d.get('by')}"
            detail = str(d.get("reason") or "")
        case "run.checkpoint":
            title = f"checkpoint, {_step(d)}"
        case "operator.resubmitted":
            title = f"resubmitted by {d.get('by')}"
            detail = f"as run {d.get('new_run_id')}" if d.get("new_run_id") else ""
            tags.append("operator")
        case "operator.dismissed":
            title = f"dismissed from the dead letter by {d.get('by')}"
            tags.append("operator")
        case _:
            pass
    return TimelineEntry(
        seq=event.seq,
        at=when(event.created_at),
        type=event.type,
        epoch=event.epoch,
        title=title,
        detail=detail,
        tags=tuple(dict.fromkeys(tags)),
        data=pretty_json(event.data),
    )


# --- the overview ----------------------------------------------------------------------------
@dataclass
class ClassRow:
    klass: str
    depth: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ACTIVE, 0))
    oldest_age_seconds: float | None = None
    started: dict[str, int] = field(default_factory=dict)
    finished: dict[str, int] = field(default_factory=dict)
    failed_window: int = 0


def class_rows(
    depth: Mapping[PriorityClass, ClassDepth], throughput: Iterable[Mapping[str, Any]]
) -> list[ClassRow]:
    """The queue's depth per class and the rows of `ui_throughput`, one table row per class."""
    rows = {klass: ClassRow(klass) for klass in CLASSES}
    for klass, entry in depth.items():
        target = rows[klass.value]
        target.depth = {
            "queued": entry.queued,
            "running": entry.running,
            "waiting_for_user": entry.waiting_for_user,
        }
        target.oldest_age_seconds = entry.oldest_eligible_age_seconds
    for row in throughput:
        target = rows[CLASSES[int(row["class_index"])]]
        target.started = {k: int(row[f"started_{k}"]) for k in ("1m", "5m", "window")}
        target.finished = {k: int(row[f"finished_{k}"]) for k in ("1m", "5m", "window")}
        target.failed_window = int(row["failed_window"])
    return list(rows.values())


@dataclass(frozen=True)
class TenantRow:
    """One line of the overview's busiest tenants: `tenant` None sums the rest."""

    tenant: str | None
    running: int
    queued: int
    classes: dict[str, dict[str, int]]  # class -> {"running": n, "queued": n}


def tenant_rows(depth: Iterable[TenantDepth]) -> list[TenantRow]:
    """The busiest tenants, as `Tenants.depth` ordered them (most queued first)."""
    return [
        TenantRow(
            tenant=entry.tenant_id,
            running=entry.running,
            queued=entry.queued,
            classes={
                klass.value: {"running": counts.running, "queued": counts.queued}
                for klass, counts in entry.classes.items()
            },
        )
        for entry in depth
    ]


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def charts(minutes: Sequence[MinuteStats]) -> list[tuple[str, Markup]]:
    """The overview's charts of the last hour, each with its caption: throughput, queue depth,
    claim latency."""
    starts = [m.start for m in minutes]
    drawn = [
        chart(
            "Runs finished per minute",
            "chart-throughput",
            starts,
            [Series("finished", [m.finished for m in minutes], "s0")],
            bars=True,
        ),
        chart(
            "Queue depth (eligible, not yet claimed)",
            "chart-depth",
            starts,
            [Series("queued", [m.depth for m in minutes], "s1")],
        ),
        chart(
            "Claim latency (eligible to first claim)",
            "chart-latency",
            starts,
            [
                Series("median", [m.latency_median for m in minutes], "s2"),
                Series("max", [m.latency_max for m in minutes], "s3"),
            ],
            fmt=lambda seconds: duration(seconds),
        ),
    ]
    captions = (
        "Throughput: runs finished per minute",
        "Queue depth at each minute's end",
        "Claim latency: median, and maximum in red",
    )
    return list(zip(captions, drawn, strict=True))


# --- the runs list's filters -----------------------------------------------------------------
class FilterError(ValueError):
    """A filter value the list cannot use; its message says which and why."""


@dataclass(frozen=True)
class RunFilters:
    status: str | None = None
    klass: str | None = None
    session_id: UUID | None = None
    since: datetime | None = None
    until: datetime | None = None

    def params(self) -> dict[str, Any]:
        band = PriorityClass(self.klass).band if self.klass else None
        return {
            "status": self.status,
            "min_priority": band.start if band else None,
            "max_priority": band.start + BAND_WIDTH - 1 if band else None,
            "session_id": self.session_id,
            "since": self.since,
            "until": self.until,
        }

    def query(self) -> dict[str, str]:
        """The filters as query parameters, for links to further pages."""
        values = {
            "status": self.status or "",
            "class": self.klass or "",
            "session": str(self.session_id) if self.session_id else "",
            "since": _form_time(self.since),
            "until": _form_time(self.until),
        }
        return {k: v for k, v in values.items() if v}


def _form_time(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M") if value else ""


def parse_time(name: str, raw: str) -> datetime:
    """`YYYY-MM-DDTHH:MM[:SS]` (a datetime-local field, read as UTC) or ISO 8601 with offset."""
    try:
        value = datetime.fromisoformat(raw.strip().replace("Z", "+00:00"))
    except ValueError:
        raise FilterError(f"{name}: {raw!r} is not a time like 2030-01-31T09:30 (UTC)") from None
    try:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except OverflowError:
        # 0001-01-01T00:00+14:00 is a time before year 1 in UTC, which Python cannot hold.
        raise FilterError(f"{name}: {raw!r} is out of range once in UTC") from None


def parse_filters(query: Mapping[str, str]) -> RunFilters:
    for name, value in query.items():
        if len(value) > MAX_FILTER_LENGTH:
            raise FilterError(f"{name[:40]}: longer than {MAX_FILTER_LENGTH} characters")
    status = query.get("status", "").strip() or None
    if status is not None and status not in STATUSES:
        raise FilterError(f"status: {status!r} is not one of {', '.join(STATUSES)}")
    klass = query.get("class", "").strip() or None
    if klass is not None and klass not in CLASSES:
        raise FilterError(f"class: {klass!r} is not one of {', '.join(CLASSES)}")
    session = query.get("session", "").strip() or None
    session_id = None
    if session is not None:
        try:
            session_id = UUID(session)
        except ValueError:
            raise FilterError(f"session: {session!r} is not a session id (a UUID)") from None
    since = parse_time("since", query["since"]) if query.get("since", "").strip() else None
    until = parse_time("until", query["until"]) if query.get("until", "").strip() else None
    if since and until and since >= until:
        raise FilterError("since must be earlier than until")
    return RunFilters(status=status, klass=klass, session_id=session_id, since=since, until=until)
