"""Request and response bodies of the HTTP API. Requests refuse unknown fields."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal
from uuid import UUID

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    StrictFloat,
    StrictInt,
    model_validator,
)

from app.queue.pages import RunsPage, TranscriptPage
from app.queue.tenant_limits import MAX_RATE
from app.vocabulary.classes import PriorityClass
from app.vocabulary.deadlines import MAX_START_WITHIN_SECONDS
from app.vocabulary.records import MIN_SUBMIT_RATE
from app.vocabulary.statuses import RunStatus

NUMBER_BOUND = 2**63
"""Numbers in stored JSON lie within [-NUMBER_BOUND, NUMBER_BOUND), the signed 64-bit range.
jsonb keeps a number's exact decimal value, so `1e308` comes back from PostgreSQL as a 309-digit
integer: beyond what most JSON parsers and renderers handle (orjson's included), which made a
run that no read could render. Larger values travel as strings."""


def storable_json(value: JsonValue) -> JsonValue:
    """Refuse what PostgreSQL's jsonb cannot hold, or could not give back renderable: NUL
    characters, lone surrogates, the non-finite numbers Python's JSON parser accepts (NaN,
    Infinity, 1e400), and numbers beyond 64 bits (`NUMBER_BOUND`)."""

    def check(item: Any, where: str) -> None:
        if isinstance(item, str):
            if "\x00" in item:
                raise ValueError(f"{where}: strings may not contain NUL characters")
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{where}: strings must be valid Unicode") from None
        elif isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{where}: numbers must be finite")
        elif isinstance(item, int | float) and not -NUMBER_BOUND <= item < NUMBER_BOUND:
            raise ValueError(
                f"{where}: numbers must lie within the signed 64-bit range (-2**63 to "
                "2**63 - 1, about 9.22e18); send larger ones as strings"
            )
        elif isinstance(item, dict):
            for key, inner in item.items():
                check(key, where)
                check(inner, f"{where}.{key}")
        elif isinstance(item, list):
            for index, inner in enumerate(item):
                check(inner, f"{where}[{index}]")

    check(value, "input")
    return value


EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(9999, 1, 1, tzinfo=UTC)
"""The range of times the API takes. PostgreSQL's `infinity` and `-infinity` come back from
the driver as Python's naive `datetime.max` and `datetime.min`, and the first and last days of
Python's range are a conversion away from them: a run carrying one could not be decoded after
its claim. Nothing a client means lies outside these bounds."""


def storable_time(value: datetime | None) -> datetime | None:
    """A timestamp within [EARLIEST, LATEST), in UTC."""
    if value is None:
        return None
    try:
        utc = value.astimezone(UTC)
    except OverflowError:
        raise ValueError("the time is out of range once converted to UTC") from None
    if not EARLIEST <= utc < LATEST:
        raise ValueError(
            "the time must be from 1970-01-01T00:00:00Z to before 9999-01-01T00:00:00Z"
        )
    return utc


StorableJson = Annotated[JsonValue, AfterValidator(storable_json)]
RFC3339 = re.compile(
    r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})", re.ASCII
)


def rfc3339_only(value: object) -> object:
    """Times come as RFC 3339 strings only: pydantic would also take a number of seconds since
    1970 (`12` as 1970-01-01T00:00:12Z), which is never what a client meant."""
    if value is None:
        return None
    if not isinstance(value, str) or not RFC3339.fullmatch(value):
        raise ValueError("an RFC 3339 time with its offset, e.g. 2030-01-01T09:00:00Z")
    return value


StorableTime = Annotated[
    AwareDatetime | None, BeforeValidator(rfc3339_only), AfterValidator(storable_time)
]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


ToolName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")]


class ApprovalPolicyBody(Strict):
    """Which tool calls wait for a user's approval (docs/approvals.md): a call whose tool is
    named in `tools` or whose idempotency class is in `classes`. Both empty: none (which
    overrides the session's policy and the process default)."""

    tools: list[ToolName] = Field(default_factory=list, max_length=100)
    classes: list[Literal["safe", "keyed", "unsafe"]] = Field(default_factory=list, max_length=3)

    def to_json(self) -> dict[str, JsonValue]:
        tools: list[JsonValue] = [str(name) for name in sorted(set(self.tools))]
        classes: list[JsonValue] = [str(name) for name in sorted(set(self.classes))]
        return {"tools": tools, "classes": classes}


class ApprovalDecisionBody(Strict):
    """A user's decision on the tool call the session's run waits for (docs/approvals.md)."""

    call_id: str = Field(min_length=1, max_length=200, description="The request's `call_id`.")
    decision: Literal["approve", "reject", "edit"]
    args: dict[str, StorableJson] | None = Field(
        default=None,
        description="edit only: the arguments to run the call with, checked against the "
        "tool's JSON schema (the request's `parameters`).",
    )
    reason: str | None = Field(
        default=None,
        max_length=2000,
        description="Why; a rejection's reason is what the model is told.",
    )

    @model_validator(mode="after")
    def _args_for_edit(self) -> ApprovalDecisionBody:
        if self.decision == "edit" and self.args is None:
            raise ValueError("an edit needs args: the arguments to run the call with")
        if self.decision != "edit" and self.args is not None:
            raise ValueError("args go with decision edit only")
        return self


class TurnRequest(Strict):
    """A user's turn. Fields left out of an answer to a waiting run come from that run."""

    input: StorableJson = Field(
        description="Anything JSON: the turn's content for the agent. Numbers lie within the "
        "signed 64-bit range (larger ones as strings); strings hold no NUL character."
    )
    agent: str | None = Field(
        default=None, min_length=1, max_length=200, description="Default: the service's."
    )
    priority: PriorityClass | None = Field(
        default=None,
        description="interactive (default for turns) or async; maintenance "
        "needs the operator scope.",
    )
    scheduled_for: StorableTime = Field(
        default=None, description="Not claimable before this time (RFC 3339 with offset)."
    )
    start_within: float | None = Field(
        default=None,
        gt=0,
        le=MAX_START_WITHIN_SECONDS,
        allow_inf_nan=False,
        strict=True,
        description="A deadline to start, in seconds after the run becomes eligible (its "
        "`scheduled_for`, else now): a new run still queued then ends `cancelled` with reason "
        "`expired` (docs/start-deadlines.md). Default: the class's "
        "(TURNSTILE_START_WITHIN_<CLASS>), else none. Ignored by an answer to a waiting run.",
    )
    start_before: StorableTime = Field(
        default=None,
        description="The deadline to start as a time (RFC 3339 with offset); not with "
        "`start_within`. A time in the past (beyond a few seconds of clock skew), before "
        "`scheduled_for`, or over 30 days after the run becomes eligible is refused.",
    )

    approval: ApprovalPolicyBody | None = Field(
        default=None,
        description="Which of this run's tool calls wait for a user's approval "
        "(docs/approvals.md). Default: the session's policy, else TURNSTILE_APPROVAL_REQUIRED.",
    )

    @model_validator(mode="after")
    def _one_deadline(self) -> TurnRequest:
        if self.start_within is not None and self.start_before is not None:
            raise ValueError("give start_within or start_before, not both")
        return self


MultitaskPolicy = Literal["reject", "enqueue", "interrupt", "steer"]
MULTITASK_DESCRIPTION = (
    "What a turn does when the session's run is queued or running (docs/turn-control.md): "
    "reject (409 session-busy), enqueue (a pending turn, started when the run ends), interrupt "
    "(the run stops at its next boundary, cancelled with reason `interrupted`, and this turn "
    "starts next), steer (the input goes into the running run, which sees it at its next "
    "decision). A run waiting for the user takes any turn as its answer."
)


class SessionTurnRequest(TurnRequest):
    """A user's turn in a session; or, with `approval` a decision, the answer to the tool call
    the session's run waits to have approved (then with no other field)."""

    input: StorableJson = Field(
        default=None,
        description="Anything JSON: the turn's content for the agent (required, but for an "
        "approval). Numbers lie within the signed 64-bit range (larger ones as strings); "
        "strings hold no NUL character.",
    )
    multitask: MultitaskPolicy | None = Field(
        default=None, description=MULTITASK_DESCRIPTION + " Default: the session's policy."
    )
    approval: ApprovalDecisionBody | ApprovalPolicyBody | None = Field(  # type: ignore[assignment]
        default=None,
        description="A policy (`tools`, `classes`): which of this run's tool calls wait for a "
        "user's approval (default: the session's, else TURNSTILE_APPROVAL_REQUIRED); or a "
        "decision (`call_id`, `decision`, `args`, `reason`) on the call the run waits for "
        "(docs/approvals.md).",
    )

    @model_validator(mode="after")
    def _input_or_decision(self) -> SessionTurnRequest:
        if isinstance(self.approval, ApprovalDecisionBody):
            others = self.model_fields_set - {"approval"}
            if others:
                raise ValueError(
                    f"an approval is a turn of its own: no {', '.join(sorted(others))}"
                )
        elif "input" not in self.model_fields_set:
            raise ValueError("input is required (but for an approval)")
        return self


class SessionRequest(Strict):
    """A new session, or a change to one."""

    multitask: MultitaskPolicy | None = Field(
        default=None, description=MULTITASK_DESCRIPTION + " Default: reject."
    )
    approval: ApprovalPolicyBody | None = Field(
        default=None,
        description="Which tool calls of the session's runs wait for a user's approval "
        "(docs/approvals.md); a turn's own overrides it. Default (or null in a PATCH): "
        "TURNSTILE_APPROVAL_REQUIRED.",
    )


class PendingTurnDocument(BaseModel):
    """A turn waiting for its session's active run (docs/turn-control.md)."""

    id: UUID = Field(description="Also the id of the run it becomes when it starts.")
    kind: Literal["pending_turn"] = "pending_turn"
    session_id: UUID
    policy: Literal["enqueue", "interrupt", "steer"]
    status: Literal["pending", "started", "delivered", "cancelled"]
    position: int | None = Field(description="1 is next; null once it is no longer pending.")
    active_run_id: UUID | None = Field(description="The run that was active when it arrived.")
    run_id: UUID | None = Field(description="The run it became (started) or reached (steered).")
    created_at: datetime
    interrupt_by: datetime | None = Field(
        description="An interrupt's bound: the run is cancelled by then if it has not stopped."
    )
    start_before: datetime | None = Field(
        default=None,
        description="Its deadline to start, which the run it becomes takes: started later, "
        "that run ends `cancelled` with reason `expired`, never claimed "
        "(docs/start-deadlines.md).",
    )


class PendingTurnList(BaseModel):
    pending_turns: list[PendingTurnDocument]


class RunRequest(TurnRequest):
    """A sessionless run for back-end services; `async` by default."""


class RunDocument(BaseModel):
    id: UUID
    session_id: UUID | None
    session_run_no: int | None = Field(
        default=None, description="The run's number within its session (1, 2, ...)."
    )
    status: RunStatus
    class_: PriorityClass = Field(alias="class")
    priority: int
    agent: str
    input: JsonValue
    attempts: int
    max_attempts: int
    scheduled_for: datetime | None
    question: JsonValue = Field(description="The pending question while waiting_for_user.")
    approval_request: JsonValue = Field(
        default=None,
        description="While waiting_for_user for a tool call's approval (docs/approvals.md): "
        "`call_id`, `tool`, `arguments`, `idempotency_class`, `step`, `description`, "
        "`parameters` (the tool's JSON schema).",
    )
    result: JsonValue
    failure: JsonValue = Field(description="Why the run failed (the dead letter).")
    resubmitted_from: UUID | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    dismissed_at: datetime | None
    schedule_id: UUID | None = Field(
        default=None, description="The schedule whose tick this run is (GET /schedules/{id})."
    )
    fire_at: datetime | None = Field(
        default=None, description="The schedule's fire time this run is for."
    )
    start_before: datetime | None = Field(
        default=None,
        description="Its deadline to start: still queued and never claimed then, it ends "
        "`cancelled` with reason `expired` (docs/start-deadlines.md).",
    )
    pending_turn: PendingTurnDocument | None = Field(
        default=None,
        description="Only in the answer to a turn with the steer policy: the steered input, "
        "which the run takes at its next decision (docs/turn-control.md).",
    )
    model_config = ConfigDict(populate_by_name=True)


class SessionDocument(BaseModel):
    id: UUID
    created_at: datetime
    state: Literal["idle", "busy", "waiting_for_user"]
    active_run_id: UUID | None = None
    active_run_status: RunStatus | None = None
    question: JsonValue = None
    multitask: MultitaskPolicy = "reject"
    pending_turns: int = Field(default=0, description="Turns waiting for the active run.")
    approval: JsonValue = Field(
        default=None, description="The session's approval policy (null: the process default)."
    )
    approval_request: JsonValue = Field(
        default=None, description="The tool call its run waits to have approved, if any."
    )


class RunPage(BaseModel):
    runs: list[RunDocument]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page.")


class MessageItem(BaseModel):
    """One entry of a session's transcript, ordered by (run_no, seq)."""

    run_no: int = Field(description="The run's number within the session.")
    seq: int = Field(description="The sequence number of the run's event it comes from.")
    run_id: UUID
    role: Literal["user", "assistant", "tool", "system"]
    kind: Literal[
        "input",
        "answer",
        "question",
        "final",
        "tool_call",
        "failed",
        "cancelled",
        "approval_request",
        "approval",
    ]
    content: JsonValue = Field(
        description="user: the input; assistant: the question or final message; tool: the "
        "outcome; system: the run's end (status, failure or reason)."
    )
    tool: JsonValue = Field(
        default=None, description="tool entries: name, step, args, status, idempotency_class."
    )
    created_at: datetime


class MessagePage(BaseModel):
    items: list[MessageItem]
    next: str | None = Field(description="Pass as `cursor` for the next page; null at the end.")


class EventDocument(BaseModel):
    seq: int
    type: str
    epoch: int
    data: JsonValue
    created_at: datetime


class EventPage(BaseModel):
    events: list[EventDocument]
    last_seq: int = Field(description="Pass as `after` to resume.")
    finished: bool = Field(description="True once the run's terminal event is in the log.")


class ClassDepth(BaseModel):
    queued: int = 0
    running: int = 0
    waiting_for_user: int = 0
    oldest_eligible_age_seconds: float | None = None
    live_slots: int = Field(
        default=0,
        description="Slots of the live worker processes (all tenants share them) that can "
        "claim this class.",
    )
    unserved: bool = Field(
        default=False,
        description="Queued runs and no live slot anywhere: they wait for a worker that serves "
        "this class (docs/adr/0005).",
    )


class TenantClassCounts(BaseModel):
    running: int = 0
    queued: int = 0


class TenantDepth(BaseModel):
    tenant: str | None = Field(
        description="The tenant; null sums every tenant beyond the busiest ones listed."
    )
    running: int
    queued: int
    classes: dict[PriorityClass, TenantClassCounts]


class QueueStats(BaseModel):
    scope: str = Field(description="'tenant:<id>' or 'all' (admin keys).")
    classes: dict[PriorityClass, ClassDepth]
    tenants: list[TenantDepth] = Field(
        default_factory=list,
        description="Running and queued runs per tenant and class. Operator keys: their own "
        "tenant (empty when it has none). Admin keys: the busiest tenants by queued runs (then "
        "running), at most `top`, then one entry with `tenant: null` summing the others.",
    )
    model_budgets: list[ModelBudgetDocument] = Field(
        default_factory=list,
        description="Admin keys: every model endpoint's budget and figures (docs/"
        "model-budgets.md), as GET /model-budgets lists them. Operator keys: empty (a budget is "
        "every tenant's).",
    )


class CancelRequest(Strict):
    """An optional body of a cancel."""

    reason: str | None = Field(
        default=None,
        max_length=500,
        description="Why, for the run's `run.cancelled` event and its webhook (at most 500 "
        "characters).",
    )


class TenantLimitsRequest(Strict):
    """A tenant's limit overrides, replacing the ones it had. A field left out or null, and a
    class left out of `max_running` (or null there), is the service's default."""

    max_running: dict[str, StrictInt | None] = Field(
        default_factory=dict,
        description="At most this many running runs of the tenant per class "
        "(interactive, async, maintenance).",
        examples=[{"interactive": 4, "async": 20}],
    )
    max_queued: StrictInt | None = Field(
        default=None, description="At most this many queued runs (new runs beyond: 429)."
    )
    submit_rate_per_second: StrictFloat | None = Field(
        default=None,
        ge=MIN_SUBMIT_RATE,
        le=MAX_RATE,
        description="Submissions a second, on average (POST /runs and turns; beyond: 429); "
        "from one a day (1/86400) to 1,000,000.",
    )
    submit_burst: StrictInt | None = Field(
        default=None, description="Submissions at once after a pause (the bucket's size)."
    )
    max_schedules: StrictInt | None = Field(
        default=None,
        description="At most this many schedules, paused ones included (one more: 409).",
    )
    max_webhook_endpoints: StrictInt | None = Field(
        default=None, description="At most this many webhook endpoints (one more: 409)."
    )
    min_schedule_interval_seconds: StrictInt | None = Field(
        default=None,
        description="The shortest time between two fire times of one of the tenant's "
        "schedules, at least 1 (a cron expression firing more often: 422).",
    )


class TenantLimitValues(BaseModel):
    max_running: dict[PriorityClass, int | None]
    max_queued: int | None
    submit_rate_per_second: float | None
    submit_burst: int | None
    max_schedules: int | None
    max_webhook_endpoints: int | None
    min_schedule_interval_seconds: int | None


class TenantLimitsDocument(BaseModel):
    tenant: str
    overrides: TenantLimitValues = Field(
        description="What this tenant has of its own; null: the service's default."
    )
    effective: TenantLimitValues = Field(
        description="What applies: the overrides over the defaults; null: no limit."
    )
    updated_at: datetime | None = Field(description="When an admin last set them.")


class StuckRun(BaseModel):
    reason: Literal["lease_expired", "queued_too_long", "waiting_too_long"]
    run: RunDocument


class StuckRuns(BaseModel):
    runs: list[StuckRun]


class ScheduleRequest(Strict):
    """A schedule of sessionless runs: every tick of `cron` in `timezone` queues one run."""

    cron: str = Field(
        min_length=1,
        max_length=200,
        description="Five fields (minute hour day-of-month month day-of-week), or six with "
        "seconds first: `0 3 * * *` is 03:00 every day, `0 */5 * * * *` every five minutes at "
        "second 0. A schedule fires at most once a minute unless its tenant's limits allow more.",
        examples=["0 3 * * *"],
    )
    timezone: str = Field(
        default="UTC",
        min_length=1,
        max_length=64,
        description="An IANA time zone the cron fields are read in (default UTC). A wall time "
        "skipped by daylight saving fires when the gap ends; a repeated one fires once, at its "
        "first occurrence.",
        examples=["Europe/Paris"],
    )
    agent: str | None = Field(
        default=None, min_length=1, max_length=200, description="Default: the service's."
    )
    input: StorableJson = Field(
        description="Anything JSON, as a turn's input: every tick's run gets it."
    )
    class_: PriorityClass = Field(
        default=PriorityClass.ASYNC, alias="class", description="The runs' class (async)."
    )
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ScheduleDocument(BaseModel):
    id: UUID
    state: Literal["active", "paused"]
    cron: str
    timezone: str
    agent: str
    input: JsonValue
    class_: PriorityClass = Field(alias="class")
    priority: int
    principal: str = Field(description="Who created it: its runs are this principal's.")
    paused_at: datetime | None
    created_at: datetime
    updated_at: datetime
    model_config = ConfigDict(populate_by_name=True)


class ScheduleDetailDocument(ScheduleDocument):
    next_fire_times: list[datetime] = Field(
        description="The next fire times, the tick already queued first; none while paused."
    )
    runs: list[RunDocument] = Field(description="Its latest runs, newest fire time first.")


class SchedulePageDocument(BaseModel):
    schedules: list[ScheduleDocument]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page.")


class ScheduleDeleted(BaseModel):
    id: UUID
    deleted: Literal[True] = True
    dropped_runs: int = Field(description="Ticks created ahead and not started, removed with it.")


def run_document(document: dict[str, Any]) -> RunDocument:
    return RunDocument.model_validate(document)


def run_page_document(page: RunsPage) -> RunPage:
    """The API's form of a keyset page of runs (app/queue/pages.py)."""
    return RunPage(
        runs=[run_document(run.to_document()) for run in page.runs], next_cursor=page.next_cursor
    )


def message_page_document(page: TranscriptPage) -> MessagePage:
    """The API's form of a page of a session's transcript (app/queue/pages.py)."""
    return MessagePage(
        items=[MessageItem.model_validate(entry.to_json()) for entry in page.entries],
        next=page.next_cursor,
    )


class ModelBudgetRequest(Strict):
    """A model endpoint's budget overrides, replacing the ones it had: a field left out or null
    is the service's default (TURNSTILE_MODEL_RPM, TURNSTILE_MODEL_TPM; unset: unlimited)."""

    endpoint: str = Field(
        min_length=1,
        max_length=300,
        description="The endpoint's key: the agent's model at its base URL "
        "(`gpt-4o-mini@https://api.openai.com/v1`), or the name TURNSTILE_OPENAI_BUDGET_ENDPOINT "
        "gives it.",
    )
    requests_per_minute: StrictInt | None = Field(
        default=None, ge=1, le=2**31 - 1, description="Requests a minute (null: the default)."
    )
    tokens_per_minute: StrictInt | None = Field(
        default=None,
        ge=1,
        le=2**31 - 1,
        description="Tokens a minute, input and output as the provider counts them (null: the "
        "default).",
    )


class ModelBudgetValues(BaseModel):
    requests_per_minute: int | None
    tokens_per_minute: int | None


class ModelBudgetTenant(BaseModel):
    """One tenant on one endpoint: its holds now, its use, its waits and its limits."""

    tenant_id: str
    reservations: int = Field(description="Its calls in flight now, holding a reservation.")
    reserved_tokens: int = Field(description="The tokens those reservations hold.")
    booked: int = Field(description="Its calls booked on the endpoint, waiting for their turn.")
    booked_tokens: int = Field(description="The tokens those bookings have taken.")
    tenant_booked: int = Field(
        description="Its calls booked on its own limit, waiting for their turn within it."
    )
    tenant_booked_tokens: int = Field(description="The tokens those bookings have taken of it.")
    requests_used: int = Field(description="Its calls settled since its first call there.")
    tokens_used: int = Field(description="The tokens the provider reported for them.")
    waits: int = Field(description="Its calls its own limit made wait (runs given back).")
    limits: ModelBudgetValues = Field(
        description="Its own limits on the endpoint, else its own on every endpoint; null: "
        "none of its own (the endpoint's budget alone)."
    )


class ModelBudgetDocument(BaseModel):
    endpoint: str
    overrides: ModelBudgetValues = Field(description="The endpoint's own; null: the default.")
    effective: ModelBudgetValues = Field(
        description="What applies: the override or default, never above the provider's "
        "stated limits; null: unlimited."
    )
    provider: ModelBudgetValues = Field(
        description="The limits the provider's rate-limit headers last stated (or implied); "
        "null: not stated."
    )
    paused_until: datetime | None = Field(
        description="A provider's 429 paused the endpoint for every process until then."
    )
    requests_used: int = Field(description="Calls settled since the endpoint's first use.")
    tokens_used: int = Field(description="Tokens the provider reported for them.")
    waits: int = Field(description="Reservations refused for want of room (runs given back).")
    pauses: int = Field(description="429s that paused the endpoint.")
    reservations: int = Field(description="Calls in flight now, holding a reservation.")
    reserved_tokens: int = Field(description="The tokens those reservations hold.")
    booked: int = Field(description="Calls booked now, each waiting for its turn.")
    booked_tokens: int = Field(description="The tokens those bookings have taken.")
    tenants: list[ModelBudgetTenant] = Field(
        description="Per tenant that used, holds, waits on or has a limit on the endpoint "
        "(at most 1,000 pairs over every endpoint, the largest first)."
    )
    updated_at: datetime | None


class TenantModelBudgetRequest(Strict):
    """A tenant's own limits on a model endpoint (or on every endpoint), replacing the ones it
    had there: a field left out or null is no limit of its own there (on an endpoint: its
    limits on every endpoint then apply)."""

    endpoint: str | None = Field(
        min_length=1,
        max_length=300,
        description="The endpoint's key (as in PUT /model-budgets), or null: the tenant's "
        "limits on every endpoint where it has none of its own. Required: null is a choice.",
    )
    requests_per_minute: StrictInt | None = Field(
        default=None,
        ge=1,
        le=2**31 - 1,
        description="Requests a minute the tenant may send to the endpoint (null: none).",
    )
    tokens_per_minute: StrictInt | None = Field(
        default=None,
        ge=1,
        le=2**31 - 1,
        description="Tokens a minute the tenant's calls may use of the endpoint (null: none).",
    )


class TenantModelBudget(BaseModel):
    endpoint: str | None = Field(description="The endpoint's key; null: every endpoint.")
    requests_per_minute: int | None
    tokens_per_minute: int | None
    requests_used: int = Field(description="The tenant's calls settled there (0 for null).")
    tokens_used: int = Field(description="The tokens the provider reported for them.")
    waits: int = Field(description="Its calls its limit there made wait.")
    updated_at: datetime | None


class TenantModelBudgetsDocument(BaseModel):
    tenant: str
    budgets: list[TenantModelBudget] = Field(
        description="Its limits on every endpoint (endpoint null) first, then each endpoint it "
        "used or has a limit on, by key."
    )


class ModelBudgetsDocument(BaseModel):
    defaults: ModelBudgetValues
    budgets: list[ModelBudgetDocument]
