"""The Agent2Agent protocol (A2A 1.0) mapped onto Turnstile's sessions and runs: pure
functions, no HTTP, no SQL.

A task is a run, its `id` the run's id; a context is a session, its `contextId` the session's
id. A message with no context starts a session; one naming a context is a turn in it (our
routing of ADR-0004: a new run, the answer to the run waiting for the user, or, while its run
is queued or running, what the session's multitask policy says: a refusal under `reject`, a
pending task under `enqueue` and `interrupt` (`pending_task`: a pending turn, whose run takes
its id), the active task under `steer` (`steered_task`)); one naming a task in
`input-required` is the answer that resumes that same run. The message's id is the
submission's idempotency key (`a2a:<messageId>`, scoped to the tenant and principal as every
`Idempotency-Key` is), so a retried send makes one run.

What the run is given: the text of the message's text parts joined (`text`), the keys of its
data parts that are JSON objects (how a caller drives an agent such as `scripted` that reads
more than text), and `message_id`. The agent is the skill named by the request's
`metadata.skill` (a skill is a Turnstile agent; the service's default agent otherwise).

Statuses map as in `STATE`; a run waiting for the user has its question as the status's
message (a wait for a tool call's approval: a text part saying how to answer, and the request
as a data part `{"approval_request": {...}}`; the answer is a message to the task whose data
part `{"approval": {"call_id", "decision", "args", "reason"}}` decides the call, docs/a2a.md);
a succeeded run has its final text as the `result` artifact. Streams map our run
events (`stream_items`), so a stream resumes from our event sequence without loss.

The JSON shapes are ProtoJSON (camelCase fields, enum names such as `TASK_STATE_WORKING`),
as the specification and the `a2a-sdk` client speak them. The router is app/api/a2a_routes.py.
"""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime
from typing import Any, Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from app.vocabulary.records import JSON, Event, Run

PROTOCOL_VERSION = "1.0"
JSONRPC_BINDING = "JSONRPC"
REST_BINDING = "HTTP+JSON"
KEY_PREFIX = "a2a:"
RESULT_ARTIFACT = "result"
# Turnstile's A2A extension: an unsafe tool call whose outcome is unknown (its run ended, or
# its worker died, while it was in flight) travels as a data part the caller can read.
TOOL_OUTCOMES_EXTENSION = "urn:turnstile:a2a:uncertain-tool-outcomes:v1"
# The extended card's: who the caller is to Turnstile and the limits that apply to it, as the
# extension's params (the card has no other free-form place).
CALLER_EXTENSION = "urn:turnstile:a2a:caller:v1"

# Turnstile run status -> A2A task state.
STATE: dict[str, str] = {
    "queued": "TASK_STATE_SUBMITTED",
    "running": "TASK_STATE_WORKING",
    "waiting_for_user": "TASK_STATE_INPUT_REQUIRED",
    "succeeded": "TASK_STATE_COMPLETED",
    "failed": "TASK_STATE_FAILED",
    "cancelled": "TASK_STATE_CANCELED",
}
# And back, for a state filter (ListTasks); `rejected` has no run: a refused message makes none.
STATUS_OF_STATE = {state: status for status, state in STATE.items()}

# Run event type -> the task state it moves the task to (events not listed move nothing).
EVENT_STATE: dict[str, str] = {
    "run.created": "TASK_STATE_SUBMITTED",
    "run.claimed": "TASK_STATE_WORKING",
    "run.waiting": "TASK_STATE_INPUT_REQUIRED",
    "run.input_delivered": "TASK_STATE_SUBMITTED",
    "run.requeued": "TASK_STATE_SUBMITTED",
    "run.released": "TASK_STATE_SUBMITTED",
    "run.succeeded": "TASK_STATE_COMPLETED",
    "run.failed": "TASK_STATE_FAILED",
    "run.cancelled": "TASK_STATE_CANCELED",
}

# JSON-RPC error codes (A2A 1.0, section 5.4).
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
TASK_NOT_FOUND = -32001
TASK_NOT_CANCELABLE = -32002
PUSH_NOT_SUPPORTED = -32003
UNSUPPORTED_OPERATION = -32004
CONTENT_TYPE_NOT_SUPPORTED = -32005
EXTENDED_CARD_NOT_CONFIGURED = -32007
VERSION_NOT_SUPPORTED = -32009

ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"
BAD_REQUEST = "type.googleapis.com/google.rpc.BadRequest"
DOMAIN = "turnstile"


# The ErrorInfo reason of each code (the specification's, which the SDK's HTTP+JSON client maps
# back to its exceptions), and the HTTP status and google.rpc code the HTTP+JSON binding
# answers it with.
REASONS: dict[int, tuple[str, int, str]] = {
    PARSE_ERROR: ("INVALID_REQUEST", 400, "INVALID_ARGUMENT"),
    INVALID_REQUEST: ("INVALID_REQUEST", 400, "INVALID_ARGUMENT"),
    METHOD_NOT_FOUND: ("METHOD_NOT_FOUND", 404, "NOT_FOUND"),
    INVALID_PARAMS: ("INVALID_PARAMS", 400, "INVALID_ARGUMENT"),
    # Ours are the transient refusals (rate limit, quota, a twin in flight, too many streams):
    # 429 over HTTP+JSON, with Retry-After.
    INTERNAL_ERROR: ("INTERNAL_ERROR", 429, "RESOURCE_EXHAUSTED"),
    TASK_NOT_FOUND: ("TASK_NOT_FOUND", 404, "NOT_FOUND"),
    TASK_NOT_CANCELABLE: ("TASK_NOT_CANCELABLE", 400, "FAILED_PRECONDITION"),
    PUSH_NOT_SUPPORTED: ("PUSH_NOTIFICATION_NOT_SUPPORTED", 400, "FAILED_PRECONDITION"),
    UNSUPPORTED_OPERATION: ("UNSUPPORTED_OPERATION", 400, "FAILED_PRECONDITION"),
    CONTENT_TYPE_NOT_SUPPORTED: ("CONTENT_TYPE_NOT_SUPPORTED", 400, "INVALID_ARGUMENT"),
    EXTENDED_CARD_NOT_CONFIGURED: (
        "EXTENDED_AGENT_CARD_NOT_CONFIGURED",
        400,
        "FAILED_PRECONDITION",
    ),
    VERSION_NOT_SUPPORTED: ("VERSION_NOT_SUPPORTED", 400, "FAILED_PRECONDITION"),
}


class A2AError(Exception):
    """An error in the protocol's shape: a JSON-RPC code, a message, and a google.rpc
    ErrorInfo (the code's reason, string `metadata` with our own finer `turnstileReason`) with
    optional field violations. `http_status` is what the HTTP+JSON binding answers (401 for a
    missing or bad key)."""

    def __init__(
        self,
        code: int,
        message: str,
        reason: str,
        metadata: dict[str, str] | None = None,
        *,
        violations: list[tuple[str, str]] | None = None,
        retry_after: int | None = None,
        http_status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.metadata = metadata or {}
        self.violations = violations or []
        self.retry_after = retry_after
        standard, status, self.rpc_status = REASONS.get(code, REASONS[INVALID_REQUEST])
        self.standard_reason = standard
        self.http_status = http_status or status

    def details(self) -> list[dict[str, Any]]:
        metadata = dict(self.metadata)
        if self.reason != self.standard_reason:
            metadata["turnstileReason"] = self.reason
        data: list[dict[str, Any]] = [
            {
                "@type": ERROR_INFO,
                "reason": self.standard_reason,
                "domain": DOMAIN,
                "metadata": metadata,
            }
        ]
        if self.violations:
            data.append(
                {
                    "@type": BAD_REQUEST,
                    "fieldViolations": [
                        {"field": field, "description": text} for field, text in self.violations
                    ],
                }
            )
        return data

    def error_object(self) -> dict[str, Any]:
        """The JSON-RPC error object."""
        return {"code": self.code, "message": self.message, "data": self.details()}

    def status_object(self) -> dict[str, Any]:
        """The HTTP+JSON binding's error body (a google.rpc.Status)."""
        return {
            "error": {
                "code": self.http_status,
                "status": self.rpc_status,
                "message": self.message,
                "details": self.details(),
            }
        }


def invalid_params(field: str, text: str) -> A2AError:
    return A2AError(
        INVALID_PARAMS, f"{field}: {text}", "INVALID_PARAMS", violations=[(field, text)]
    )


def task_not_found(task_id: str) -> A2AError:
    return A2AError(TASK_NOT_FOUND, f"task {task_id!r} not found", "TASK_NOT_FOUND")


def rpc_error(rpc_id: JSON, error: A2AError) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "error": error.error_object()}


def rpc_result(rpc_id: JSON, result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "result": result}


def pydantic_violations(errors: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Pydantic's errors as (field path, message) pairs, the union members it tried left
    out of the path."""
    found = []
    for error in errors:
        loc = [str(p) for p in error.get("loc", ()) if "[" not in str(p)]
        found.append((".".join(loc) or "params", str(error.get("msg", "invalid"))))
    return found[:20]


# --- requests (the fields this surface reads; unknown ones are ignored, as ProtoJSON parsers
# ignore them) ----------------------------------------------------------------------------------
class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class Part(_Loose):
    text: str | None = Field(default=None, max_length=1_000_000)
    data: JSON = None
    url: str | None = None
    raw: str | None = None
    filename: str | None = None
    media_type: str | None = Field(default=None, alias="mediaType")
    metadata: dict[str, JSON] | None = None


class Message(_Loose):
    message_id: str = Field(alias="messageId", min_length=1, max_length=200)
    context_id: str | None = Field(default=None, alias="contextId", max_length=100)
    task_id: str | None = Field(default=None, alias="taskId", max_length=100)
    role: Literal["ROLE_USER", "ROLE_AGENT"]
    parts: list[Part] = Field(min_length=1, max_length=100)
    metadata: dict[str, JSON] | None = None
    extensions: list[str] | None = None
    reference_task_ids: list[str] | None = Field(default=None, alias="referenceTaskIds")


class SendConfiguration(_Loose):
    accepted_output_modes: list[str] | None = Field(default=None, alias="acceptedOutputModes")
    push_config: dict[str, JSON] | None = Field(default=None, alias="taskPushNotificationConfig")
    history_length: int | None = Field(default=None, alias="historyLength", ge=0, le=1000)
    return_immediately: bool = Field(default=False, alias="returnImmediately")


class SendMessageParams(_Loose):
    tenant: str = ""
    message: Message
    configuration: SendConfiguration | None = None
    metadata: dict[str, JSON] | None = None


class TaskParams(_Loose):
    """GetTask, CancelTask and SubscribeToTask: a task's id (and GetTask's history length)."""

    tenant: str = ""
    id: str = Field(min_length=1, max_length=100)
    history_length: int | None = Field(default=None, alias="historyLength", ge=0, le=1000)
    metadata: dict[str, JSON] | None = None


class ListTasksParams(_Loose):
    """ListTasks: a context and a state to filter by, a page."""

    tenant: str = ""
    context_id: str | None = Field(default=None, alias="contextId", max_length=100)
    status: str | None = Field(default=None, max_length=40)
    page_size: int | None = Field(default=None, alias="pageSize", ge=1, le=100)
    page_token: str | None = Field(default=None, alias="pageToken", max_length=200)
    history_length: int | None = Field(default=None, alias="historyLength", ge=0, le=1000)
    include_artifacts: bool = Field(default=False, alias="includeArtifacts")
    status_timestamp_after: str | None = Field(default=None, alias="statusTimestampAfter")


def status_filter(state: str | None) -> str | None:
    """The run status a ListTasks state filter names (None: any); `rejected` names none."""
    if state in (None, "", "TASK_STATE_UNSPECIFIED"):
        return None
    if state == "TASK_STATE_REJECTED":
        return "rejected"  # matches no run: a refused message makes none
    status = STATUS_OF_STATE.get(str(state))
    if status is None:
        raise invalid_params("status", f"not a task state: {str(state)[:40]!r}")
    return status


class AuthenticationInfo(_Loose):
    """How we authenticate to the receiver: `Authorization: <scheme> <credentials>`."""

    scheme: str = Field(default="", max_length=50, pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]*$")
    credentials: str = Field(default="", max_length=4096, pattern=r"^[\x20-\x7e]*$")


class PushConfigParams(_Loose):
    """CreateTaskPushNotificationConfig (a TaskPushNotificationConfig), and a SendMessage's
    `configuration.taskPushNotificationConfig` (its task id is the message's task)."""

    tenant: str = ""
    id: str = Field(default="", max_length=100)  # ours is given: a client's is not kept
    task_id: str = Field(default="", alias="taskId", max_length=100)
    url: str = Field(min_length=1, max_length=2048)
    token: str = Field(default="", max_length=512, pattern=r"^[\x21-\x7e]*$")
    authentication: AuthenticationInfo | None = None


class PushConfigRef(_Loose):
    """GetTaskPushNotificationConfig and DeleteTaskPushNotificationConfig."""

    tenant: str = ""
    task_id: str = Field(alias="taskId", min_length=1, max_length=100)
    id: str = Field(min_length=1, max_length=100)


class ListPushConfigsParams(_Loose):
    tenant: str = ""
    task_id: str = Field(alias="taskId", min_length=1, max_length=100)
    page_size: int | None = Field(default=None, alias="pageSize", ge=0, le=100)
    page_token: str | None = Field(default=None, alias="pageToken", max_length=100)


def push_secret(token: str, authentication: AuthenticationInfo | None) -> bytes:
    """What a push configuration keeps encrypted: its token (which also keys our Standard
    Webhooks signature) and the authentication to send."""
    auth = authentication or AuthenticationInfo()
    stored = {"token": token, "scheme": auth.scheme, "credentials": auth.credentials}
    return json.dumps(stored, separators=(",", ":")).encode()


def push_config_document(config_id: str, task_id: str, url: str, secret: bytes) -> dict[str, Any]:
    """A TaskPushNotificationConfig as we answer it: the token (the caller's, or the one we
    made), the authentication's scheme but never its credentials."""
    stored = json.loads(secret)
    document: dict[str, Any] = {
        "id": config_id,
        "taskId": task_id,
        "url": url,
        "token": stored.get("token", ""),
    }
    if stored.get("scheme"):
        document["authentication"] = {"scheme": stored["scheme"]}
    return document


# A delivery's event (its body's `type`) -> the task state it reports.
PUSHED_STATE = {
    "run.succeeded": "TASK_STATE_COMPLETED",
    "run.failed": "TASK_STATE_FAILED",
    "run.cancelled": "TASK_STATE_CANCELED",
    "run.waiting": "TASK_STATE_INPUT_REQUIRED",
}


def push_payload(body: JSON) -> dict[str, Any]:
    """The StreamResponse a push notification carries for one delivery (its body as the
    transition wrote it: type, timestamp, data): the task's status update, with the question,
    the failure or the final text as the status's message."""
    envelope = body if isinstance(body, dict) else {}
    given = envelope.get("data")
    data: dict[str, JSON] = given if isinstance(given, dict) else {}
    event = str(envelope.get("type", ""))
    task_id = str(data.get("run_id", ""))
    context_id = str(data.get("session_id") or "")
    stamp = envelope.get("timestamp")
    if isinstance(stamp, str):
        with contextlib.suppress(ValueError):
            stamp = timestamp(datetime.fromisoformat(stamp))
    status: dict[str, Any] = {"state": PUSHED_STATE.get(event, "TASK_STATE_WORKING")}
    if isinstance(stamp, str):
        status["timestamp"] = stamp
    content: JSON = None
    key = ""
    if event == "run.waiting":
        content, key = data.get("question"), "question"
    elif event == "run.failed":
        content, key = _failure_text(data.get("failure")), "failure"
    elif event == "run.succeeded":
        content, key = final_text(data.get("result")), "result"
    if content is not None:
        status["message"] = {
            "messageId": f"{task_id}-push-{key}",
            "contextId": context_id,
            "taskId": task_id,
            "role": "ROLE_AGENT",
            "parts": content_parts(content),
        }
    return {
        "statusUpdate": {
            "taskId": task_id,
            "contextId": context_id,
            "status": status,
            "metadata": {"turnstile": {"event": event, "status": data.get("status")}},
        }
    }


MAX_DEPTH = 64  # nesting a request may have: deeper ones are refused before anything recurses


def too_deep(value: object, limit: int = MAX_DEPTH) -> bool:
    """Whether JSON nests deeper than `limit` (walked without recursion)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def uuid_of(value: str | None) -> UUID | None:
    """The id a task or context id names; None for one that names none (not found)."""
    if value is None:
        return None
    try:
        return UUID(value)
    except ValueError:
        return None


def skill_of(params: SendMessageParams) -> str | None:
    """The agent the request names (`metadata.skill`, else the message's), or None."""
    for metadata in (params.metadata, params.message.metadata):
        if metadata and isinstance(metadata.get("skill"), str):
            return str(metadata["skill"])
    return None


POLICIES = ("reject", "enqueue", "interrupt", "steer")
MULTITASK_KEY = "multitask"


def multitask_of(params: SendMessageParams) -> str | None:
    """The multitask policy the request asks for a busy context (`metadata.multitask`, else
    the message's; docs/turn-control.md), or None: the session's own. A2A has no field for it."""
    for where, metadata in (
        ("metadata", params.metadata),
        ("message.metadata", params.message.metadata),
    ):
        if metadata and MULTITASK_KEY in metadata:
            value = metadata[MULTITASK_KEY]
            if value not in POLICIES:
                raise invalid_params(f"{where}.{MULTITASK_KEY}", f"one of {', '.join(POLICIES)}")
            return str(value)
    return None


def run_input(message: Message) -> dict[str, JSON]:
    """The run's input: the data parts' keys, then the text of the text parts and the message
    id. Files (url or raw parts) are not spoken: ContentTypeNotSupported."""
    values: dict[str, JSON] = {}
    texts: list[str] = []
    for index, part in enumerate(message.parts):
        if part.url is not None or part.raw is not None:
            raise A2AError(
                CONTENT_TYPE_NOT_SUPPORTED,
                f"message.parts[{index}]: file parts are not supported; send text or data",
                "CONTENT_TYPE_NOT_SUPPORTED",
            )
        if part.text is not None:
            texts.append(part.text)
        elif isinstance(part.data, dict):
            values.update(part.data)
        elif part.data is not None:
            values.setdefault("data", [])
            data = values["data"]
            if isinstance(data, list):
                data.append(part.data)
        else:
            raise invalid_params(f"message.parts[{index}]", "a part needs text or data")
    values["text"] = "\n".join(texts)
    values["message_id"] = message.message_id
    return values


def message_fingerprint(params: SendMessageParams) -> dict[str, JSON]:
    """What makes a retried send the same request (its idempotency hash): the message and
    the skill, not the delivery options (blocking, history length)."""
    message = params.message.model_dump(mode="json", by_alias=True, exclude_none=True)
    fingerprint: dict[str, JSON] = {"message": message, "skill": skill_of(params)}
    multitask = multitask_of(params)
    if multitask is not None:  # only when given: the hashes of sends without it stay as they were
        fingerprint["multitask"] = multitask
    return fingerprint


# --- responses ---------------------------------------------------------------------------------
def timestamp(value: datetime) -> str:
    """RFC 3339 in UTC with a `Z`, as ProtoJSON writes a Timestamp."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def text_of(value: JSON) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        return str(value["text"])
    return json.dumps(value, ensure_ascii=False)


def final_text(result: JSON) -> str | None:
    """The run's final text: the result's `final` (a string as is; an echoed input's `text`;
    anything else as JSON)."""
    final = result.get("final") if isinstance(result, dict) else result
    return None if final is None else text_of(final)


def context_of(run: Run) -> str:
    return str(run.session_id) if run.session_id else ""


# The key of a message's data part that carries a decision on a tool call waiting for
# approval (docs/approvals.md): reserved, never part of a run's input.
APPROVAL_KEY = "approval"


def content_parts(content: JSON) -> list[dict[str, Any]]:
    """The parts of an agent's message: text when it is text, else a data part; a question
    that is an approval request gets a text part first saying how to answer it."""
    if isinstance(content, str):
        return [{"text": content}]
    request = content.get("approval_request") if isinstance(content, dict) else None
    if isinstance(request, dict):
        call = json.dumps(str(request.get("call_id")))
        how = (
            f"Approve the {request.get('tool')} call? Reply to this task with a data part "
            f'{{"{APPROVAL_KEY}": {{"call_id": {call}, "decision": "approve"}}}} '
            '(or "reject", with a "reason"; or "edit", with the "args" to run it with).'
        )
        return [{"text": how}, {"data": content}]
    return [{"data": content}]


def approval_of(message: Message) -> tuple[dict[str, JSON], str] | None:
    """A message's decision on a call waiting for approval (its data part's `approval`
    object), with the message's text (a rejection's reason when the decision gives none);
    None when the message carries no decision."""
    for part in message.parts:
        if isinstance(part.data, dict) and APPROVAL_KEY in part.data:
            decision = part.data[APPROVAL_KEY]
            if not isinstance(decision, dict):
                raise invalid_params(
                    "message.parts.data.approval",
                    'an object: {"call_id", "decision": approve|reject|edit, "args", "reason"}',
                )
            text = "\n".join(p.text for p in message.parts if p.text is not None)
            return decision, text
    return None


def agent_message(run: Run, key: str, content: JSON) -> dict[str, Any]:
    """A message of the agent's within the task (`content_parts`)."""
    return {
        "messageId": f"{run.id}-{key}",
        "contextId": context_of(run),
        "taskId": str(run.id),
        "role": "ROLE_AGENT",
        "parts": content_parts(content),
    }


def _failure_text(failure: JSON) -> str:
    if isinstance(failure, dict):
        for name in ("message", "error", "reason"):
            if isinstance(failure.get(name), str):
                return str(failure[name])
    return "the task failed" if failure is None else json.dumps(failure, ensure_ascii=False)


def status_of(run: Run) -> dict[str, Any]:
    status: dict[str, Any] = {
        "state": STATE.get(run.status, "TASK_STATE_WORKING"),
        "timestamp": timestamp(run.updated_at),
    }
    if run.status == "waiting_for_user":
        status["message"] = agent_message(run, f"q{run.inputs_count}", run.question)
    elif run.status == "failed":
        status["message"] = agent_message(run, "failure", _failure_text(run.failure))
    return status


def result_artifact(run: Run) -> dict[str, Any] | None:
    text = final_text(run.result) if run.status == "succeeded" else None
    if text is None:
        return None
    return {"artifactId": RESULT_ARTIFACT, "name": "result", "parts": [{"text": text}]}


def user_message(run: Run) -> dict[str, Any] | None:
    """The message that started the task, as far as the run's input keeps it."""
    values = run.input if isinstance(run.input, dict) else {}
    text = values.get("text")
    message_id = values.get("message_id")
    if not isinstance(text, str):
        return None
    return {
        "messageId": message_id if isinstance(message_id, str) else f"{run.id}-input",
        "contextId": context_of(run),
        "taskId": str(run.id),
        "role": "ROLE_USER",
        "parts": [{"text": text}],
    }


def task_of(
    run: Run, *, history_length: int | None = None, artifacts: bool = True
) -> dict[str, Any]:
    """The Task of a run."""
    task: dict[str, Any] = {
        "id": str(run.id),
        "contextId": context_of(run),
        "status": status_of(run),
    }
    artifact = result_artifact(run)
    if artifacts:
        task["artifacts"] = [artifact] if artifact else []
    if history_length != 0:
        first = user_message(run)
        history = [first] if first else []
        if history_length is not None:
            history = history[-history_length:]
        task["history"] = history
    task["metadata"] = {
        "turnstile": {"status": run.status, "agent": run.agent, "attempts": run.attempts}
    }
    return task


# A pending turn's status -> its task's state while it is no run (a started one is its run, the
# same id; a steer delivered into a run is part of that run's task, not a task of its own).
PENDING_STATE = {"pending": "TASK_STATE_SUBMITTED", "cancelled": "TASK_STATE_CANCELED"}


def pending_task(
    *,
    task_id: UUID,
    context_id: UUID,
    status: str,
    updated_at: datetime,
    input: JSON,
    policy: str,
    position: int | None,
    active_run_id: UUID | None,
    agent: str,
    history_length: int | None = None,
    artifacts: bool = True,
) -> dict[str, Any]:
    """The Task of a turn waiting for its context's active task (a pending turn; the run it
    becomes has the same id): `submitted` while it waits, `canceled` once withdrawn."""
    task: dict[str, Any] = {
        "id": str(task_id),
        "contextId": str(context_id),
        "status": {
            "state": PENDING_STATE.get(status, "TASK_STATE_SUBMITTED"),
            "timestamp": timestamp(updated_at),
        },
    }
    if artifacts:
        task["artifacts"] = []
    if history_length != 0:
        values = input if isinstance(input, dict) else {}
        text = values.get("text")
        message_id = values.get("message_id")
        history: list[dict[str, Any]] = []
        if isinstance(text, str):
            history.append(
                {
                    "messageId": message_id if isinstance(message_id, str) else f"{task_id}-input",
                    "contextId": str(context_id),
                    "taskId": str(task_id),
                    "role": "ROLE_USER",
                    "parts": [{"text": text}],
                }
            )
        task["history"] = history if history_length is None else history[-history_length:]
    task["metadata"] = {
        "turnstile": {
            "status": status,
            "pendingTurn": True,
            "policy": policy,
            "position": position,
            "activeTaskId": None if active_run_id is None else str(active_run_id),
            "agent": agent,
        }
    }
    return task


def steered_task(
    task: dict[str, Any], message: Message, turn_id: UUID, history_length: int | None
) -> dict[str, Any]:
    """The active task a message steered (`steer`): the message at the end of its history,
    and the pending turn it waits as until the run takes it (`metadata.turnstile.steer`; a
    task that ends first leaves it to become the context's next task, with that id)."""
    if history_length != 0:
        sent = {
            "messageId": message.message_id,
            "contextId": task["contextId"],
            "taskId": task["id"],
            "role": "ROLE_USER",
            "parts": [{"text": "\n".join(p.text for p in message.parts if p.text is not None)}],
        }
        history = [*task.get("history", []), sent]
        task["history"] = history if history_length is None else history[-history_length:]
    task.setdefault("metadata", {}).setdefault("turnstile", {})["steer"] = {
        "pendingTurnId": str(turn_id)
    }
    return task


def status_update(run: Run, status: dict[str, Any]) -> dict[str, Any]:
    return {"statusUpdate": {"taskId": str(run.id), "contextId": context_of(run), "status": status}}


def artifact_update(
    run: Run, artifact: dict[str, Any], *, append: bool, last_chunk: bool
) -> dict[str, Any]:
    return {
        "artifactUpdate": {
            "taskId": str(run.id),
            "contextId": context_of(run),
            "artifact": artifact,
            "append": append,
            "lastChunk": last_chunk,
        }
    }


def live_artifact_id(epoch: int, message: int) -> str:
    """The artifact a live message's text goes to: one per message of one claim, so a re-run
    after a crash (a later epoch) writes a new artifact rather than repeating into the old."""
    return f"message-{epoch}-{message}"


def live_piece(run: Run, epoch: int, message: int, text: str, *, first: bool) -> dict[str, Any]:
    """A live text delta as an artifact update, appended to what came before it."""
    artifact = {"artifactId": live_artifact_id(epoch, message), "parts": [{"text": text}]}
    return artifact_update(run, artifact, append=not first, last_chunk=False)


def uncertain_outcome(data: dict[str, Any]) -> dict[str, Any]:
    """The artifact of an unsafe call with an unknown outcome (the extension's data part):
    the tool, its step, and what Turnstile knows of it."""
    step = data.get("step")
    return {
        "artifactId": f"tool-outcome-{step}",
        "name": "uncertain tool outcome",
        "description": "An unsafe tool call that may or may not have taken effect.",
        "parts": [
            {
                "data": {
                    "tool": data.get("tool"),
                    "step": step,
                    "status": "uncertain",
                    "idempotencyClass": data.get("idempotency_class"),
                    "outcome": data.get("outcome"),
                    "by": data.get("by"),
                },
                "mediaType": "application/json",
            }
        ],
        "extensions": [TOOL_OUTCOMES_EXTENSION],
    }


def stream_items(event: Event, run: Run) -> list[dict[str, Any]]:
    """The StreamResponses of one run event. `run` is the run as read after the event (its
    result and question come from it when the event is the run's end or its question).

    A live message's end (`message.completed`) replaces the artifact its deltas built with the
    whole text (`append: false`), so a stream that missed deltas still ends with all of it."""
    data = event.data if isinstance(event.data, dict) else {}
    items: list[dict[str, Any]] = []
    if event.type == "message.completed":
        message = data.get("message", 0)
        artifact: dict[str, Any] = {
            "artifactId": live_artifact_id(event.epoch, message if isinstance(message, int) else 0),
            "parts": [{"text": text_of(data.get("text", ""))}],
        }
        return [artifact_update(run, artifact, append=False, last_chunk=True)]
    if event.type == "tool.finished" and data.get("outcome_status") == "uncertain":
        return [artifact_update(run, uncertain_outcome(data), append=False, last_chunk=True)]
    state = EVENT_STATE.get(event.type)
    if state is None:
        return items
    status: dict[str, Any] = {"state": state, "timestamp": timestamp(event.created_at)}
    if event.type == "run.waiting":
        status["message"] = agent_message(run, f"e{event.seq}", data.get("question"))
    elif event.type == "run.failed":
        status["message"] = agent_message(run, "failure", _failure_text(run.failure))
    elif event.type == "run.succeeded":
        result = result_artifact(run)
        if result is not None:
            items.append(artifact_update(run, result, append=False, last_chunk=True))
    items.append(status_update(run, status))
    return items


# --- the agent card ----------------------------------------------------------------------------
def agent_card(
    base_url: str, agents: frozenset[str], version: str, *, push: bool = True
) -> dict[str, Any]:
    """The public agent card: Turnstile's agents as skills, the JSON-RPC interface, streaming,
    push notifications (`push`: the server can store their tokens, TURNSTILE_SECRET_KEY), the
    extended card (`GetExtendedAgentCard`, a key required), and our bearer API keys as the
    security scheme."""
    skills = [
        {
            "id": name,
            "name": name,
            "description": f"The Turnstile agent {name!r}; choose it with metadata.skill.",
            "tags": ["turnstile"],
            "inputModes": ["text/plain", "application/json"],
            "outputModes": ["text/plain"],
        }
        for name in sorted(agents)
    ]
    return {
        "name": "Turnstile",
        "description": "A durable run queue for AI-agent turns: every task is a durable run "
        "that survives a crashed worker, submitted exactly once per message id.",
        "supportedInterfaces": [
            {
                "url": f"{base_url}/a2a",
                "protocolBinding": JSONRPC_BINDING,
                "protocolVersion": PROTOCOL_VERSION,
            },
            {
                "url": f"{base_url}/a2a/rest",
                "protocolBinding": REST_BINDING,
                "protocolVersion": PROTOCOL_VERSION,
            },
        ],
        "provider": {"organization": "Turnstile", "url": base_url},
        "version": version,
        "documentationUrl": f"{base_url}/docs",
        "capabilities": {
            "streaming": True,
            "pushNotifications": push,
            "extendedAgentCard": True,
            "extensions": [
                {
                    "uri": TOOL_OUTCOMES_EXTENSION,
                    "description": "An unsafe tool call whose outcome is unknown (its run "
                    "ended or its worker died while it was in flight) is streamed as an "
                    "artifact `tool-outcome-<step>` with one data part: tool, step, status "
                    "`uncertain`, idempotencyClass, outcome.",
                    "required": False,
                }
            ],
        },
        "securitySchemes": {
            "bearer": {
                "httpAuthSecurityScheme": {
                    "scheme": "Bearer",
                    "description": "A Turnstile API key (turnstile keys create).",
                },
            }
        },
        "securityRequirements": [{"schemes": {"bearer": {"list": []}}}],
        "defaultInputModes": ["text/plain", "application/json"],
        "defaultOutputModes": ["text/plain"],
        "skills": skills,
    }


def extended_agent_card(
    card: dict[str, Any],
    *,
    tenant: str,
    principal: str,
    scopes: frozenset[str],
    limits: dict[str, JSON],
    running: int,
    queued: int,
) -> dict[str, Any]:
    """The authenticated extended card: the public `card` with what only the caller may see,
    as the params of our caller extension: its tenant, principal and scopes, the tenant's
    limits that apply (`limits`: as `effective` in `GET /tenants/{tenant}/limits`, null for
    no limit) and its running and queued runs now (against `max_running` and `max_queued`)."""
    extended: dict[str, Any] = json.loads(json.dumps(card))  # a deep copy: `card` stays
    extended["description"] += f" This card is for {principal!r} of tenant {tenant!r}."
    extended["capabilities"]["extensions"].append(
        {
            "uri": CALLER_EXTENSION,
            "description": "Who the caller is to Turnstile and the limits that apply to it: "
            "tenant, principal, scopes; limits (null: no limit) and the tenant's runs now.",
            "required": False,
            "params": {
                "tenant": tenant,
                "principal": principal,
                "scopes": sorted(scopes),
                "limits": limits,
                "runs": {"running": running, "queued": queued},
            },
        }
    )
    return extended
