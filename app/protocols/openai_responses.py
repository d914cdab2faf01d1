"""The OpenAI Responses API's objects mapped onto Turnstile's runs: pure functions, no HTTP.

A response is a run: a turn of a conversation's session
(app/protocols/openai_conversations.py); or, created with neither `conversation` nor
`previous_response_id`, the first turn of a session of its own (a chain, marked `CHAIN` in its
input, which `previous_response_id` continues); or, with `store: false`, a sessionless run that
nothing continues (`NOT_STORED`). `model` names the Turnstile agent (`openai:<model>`: the
`openai` agent asking that upstream model, carried in the run's input as `upstream_model`); the
run's input is `{"text", "messages", "instructions", "metadata"}` (plus the keys of the
`agent_input` extension, which is how a caller drives an agent such as `scripted` that reads
more than text; an answer's `call_id`), so a read of the run gives back everything its response
document shows. Statuses map as in `STATUS`; a run waiting for the user ends its response
(status `incomplete`) with a `function_call` item named `ask_user` whose arguments carry the
question (a `function_call_output` naming its `call_id` answers it); one waiting for the
approval of a tool call (docs/approvals.md) ends it with an `mcp_approval_request` item naming
the tool and its arguments, which an `mcp_approval_response` naming its id approves or rejects
(OpenAI's own approval items). The output is the run's final text as one `output_text` message.
Usage figures are the run's token counts where its agent recorded them (the `openai` agent
does), zeros otherwise.

The router is app/api/responses_routes.py; errors in OpenAI's shape are rendered there too
(`error_body` below).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from app.vocabulary.records import JSON, Run

PREFIX = "resp_"

# Turnstile run status -> Responses status.
STATUS: dict[str, str] = {
    "queued": "queued",
    "running": "in_progress",
    "succeeded": "completed",
    "failed": "failed",
    "cancelled": "cancelled",
    "waiting_for_user": "incomplete",
}

# OpenAI's bounds on an object's `metadata`: 16 pairs, keys of at most 64 characters, values
# of at most 512 (a response's and a conversation's alike).
MAX_METADATA_PAIRS = 16
Metadata = Annotated[
    dict[
        Annotated[str, StringConstraints(max_length=64)],
        Annotated[str, StringConstraints(max_length=512)],
    ],
    Field(max_length=MAX_METADATA_PAIRS),
]

# The keys of a run's input that say how its response was stored (Turnstile's, not the
# agent's): `CHAIN` marks a response outside any conversation whose run is a turn of a session
# of its own, the chain `previous_response_id` continues; `NOT_STORED` one created with
# `store: false` (a sessionless run, which nothing continues).
CHAIN = "response_chain"
NOT_STORED = "response_not_stored"

# Request fields of the Responses API this step does not implement: refused when set, rather
# than silently ignored, since each would change what the caller gets.
UNSUPPORTED = ("tools", "prompt")


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text", "text"]
    text: str = Field(max_length=1_000_000)


class InputMessage(BaseModel):
    """One item of `input`: a message, a `function_call_output` (the answer to an `ask_user`
    call, naming its `call_id`), or an `mcp_approval_response` (the decision on a tool call
    waiting for approval, naming the request's id); other item types (files, images,
    reasoning) are not spoken yet."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["message", "function_call_output", "mcp_approval_response"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputText] | None = None
    call_id: str | None = Field(default=None, min_length=1, max_length=200)
    output: str | list[InputText] | None = None
    approval_request_id: str | None = Field(default=None, min_length=1, max_length=200)
    approve: bool | None = None
    # The native approval's bound (docs/approvals.md): a rejection's reason reaches the model.
    reason: str | None = Field(default=None, max_length=2000)

    @model_validator(mode="after")
    def complete(self) -> InputMessage:
        if self.type == "message" and (self.role is None or self.content is None):
            raise ValueError("a message item needs its role and content")
        if self.type == "function_call_output" and (self.call_id is None or self.output is None):
            raise ValueError("a function_call_output item needs its call_id and output")
        if self.type == "mcp_approval_response" and (
            self.approval_request_id is None or self.approve is None
        ):
            raise ValueError(
                "an mcp_approval_response item needs its approval_request_id and approve"
            )
        return self


class ConversationRef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = Field(max_length=100)


class CreateResponse(BaseModel):
    """The body of `POST /v1/responses` (the fields this step reads; others are ignored, except
    those in `UNSUPPORTED`, which are refused when set)."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, max_length=200)
    input: str | list[InputMessage]
    instructions: str | None = None
    conversation: Annotated[str, Field(max_length=100)] | ConversationRef | None = None
    previous_response_id: str | None = Field(default=None, max_length=100)
    metadata: Metadata | None = None
    background: bool | None = None
    stream: bool | None = None
    store: bool | None = None
    agent_input: dict[str, JSON] | None = Field(
        default=None,
        description="Turnstile's extension: more keys of the run's input, for agents that "
        "read more than text (the scripted agent's `script`).",
    )


def response_id(run_id: UUID) -> str:
    return f"{PREFIX}{run_id.hex}"


def run_id_of(response: str) -> UUID | None:
    """The run a response id names; None for a string that names none (answered not found)."""
    if not response.startswith(PREFIX) or len(response) != len(PREFIX) + 32:
        return None
    try:
        return UUID(hex=response[len(PREFIX) :])
    except ValueError:
        return None


def text_of(content: str | list[InputText] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part.text for part in content)


def call_id(run_id: UUID, inputs: int) -> str:
    """The `call_id` of the question a run asks after its `inputs`-th input (the ask_user
    `function_call` of its response): the answer that resumes the run names it."""
    return f"call_{run_id.hex}_{inputs}"


def approval_request_id(run_id: UUID, inputs: int) -> str:
    """The id of the `mcp_approval_request` item a run waiting for an approval after its
    `inputs`-th input shows: the `mcp_approval_response` that decides the call names it. Each
    wait has its own (the run's inputs count on), so a decision cannot answer a later one."""
    return f"mcpr_{run_id.hex}_{inputs}"


# The `server_label` of our approval requests: the tools are the Turnstile agent's own, not an
# MCP server's, and OpenAI's item needs a label.
APPROVAL_SERVER_LABEL = "turnstile"


def approval_item(item_id: str, request: dict[str, Any]) -> dict[str, Any]:
    """A run's approval request (docs/approvals.md) as OpenAI's `mcp_approval_request` item."""
    tool = request.get("tool")
    return {
        "type": "mcp_approval_request",
        "id": item_id,
        "server_label": APPROVAL_SERVER_LABEL,
        "name": tool if isinstance(tool, str) else "tool",
        "arguments": json.dumps(request.get("arguments"), ensure_ascii=False),
    }


def call_outputs(body: CreateResponse) -> list[InputMessage]:
    """The input's `function_call_output` items."""
    if isinstance(body.input, str):
        return []
    return [item for item in body.input if item.type == "function_call_output"]


def approval_responses(body: CreateResponse) -> list[InputMessage]:
    """The input's `mcp_approval_response` items."""
    if isinstance(body.input, str):
        return []
    return [item for item in body.input if item.type == "mcp_approval_response"]


def conversation_of(body: CreateResponse) -> str | None:
    if isinstance(body.conversation, ConversationRef):
        return body.conversation.id
    return body.conversation


def unsupported_field(body: CreateResponse) -> str | None:
    """The first field set that this step does not implement, if any."""
    extra = body.model_extra or {}
    for name in UNSUPPORTED:
        if extra.get(name) not in (None, [], {}):
            return name
    return None


def run_input(body: CreateResponse) -> dict[str, JSON]:
    """The run's input: the extension's keys, then the text (the last user message's, or the
    input string; for an answer, its output), every message, the instructions and the
    metadata. An answer (a `function_call_output`) keeps its `call_id`, so the transcript shows
    which question it answers."""
    values: dict[str, JSON] = dict(body.agent_input or {})
    if isinstance(body.input, str):
        text = body.input
        messages: list[JSON] = [{"role": "user", "content": body.input}]
    else:
        said = [m for m in body.input if m.type == "message"]
        messages = [{"role": m.role, "content": text_of(m.content)} for m in said]
        users = [text_of(m.content) for m in said if m.role == "user"]
        text = users[-1] if users else ""
        outputs = call_outputs(body)
        if outputs:
            text = text_of(outputs[-1].output)
            values["call_id"] = outputs[-1].call_id
    values.update(text=text, messages=messages)
    if body.instructions is not None:
        values["instructions"] = body.instructions
    if body.metadata is not None:
        values["metadata"] = dict(body.metadata)
    return values


def final_text(result: JSON) -> str | None:
    """The run's final text: the result's `final` (a string as is; an echoed input's `text`;
    anything else as JSON)."""
    final = result.get("final") if isinstance(result, dict) else result
    if final is None:
        return None
    if isinstance(final, str):
        return final
    if isinstance(final, dict) and isinstance(final.get("text"), str):
        return str(final["text"])
    return json.dumps(final, ensure_ascii=False)


def usage_of(result: JSON) -> dict[str, Any]:
    """Token counts the run's agent recorded (`usage` with chat-completions names), else 0."""
    usage = result.get("usage") if isinstance(result, dict) else None
    counts = usage if isinstance(usage, dict) else {}

    def count(name: str) -> int:
        value = counts.get(name)
        return value if isinstance(value, int) else 0

    prompt, completion = count("prompt_tokens"), count("completion_tokens")
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": count("total_tokens") or prompt + completion,
    }


def _failure_message(failure: JSON) -> str:
    if isinstance(failure, dict):
        for name in ("message", "error", "reason"):
            if isinstance(failure.get(name), str):
                return str(failure[name])
    return json.dumps(failure, ensure_ascii=False)


def message_id(run_id: UUID, epoch: int) -> str:
    """The id of the message item a claim of the run writes: the final one is the last
    claim's, as its stream showed it (a crash's re-run writes an item of its own)."""
    return f"msg_{run_id.hex}_{max(epoch, 1)}"


def output_of(run: Run) -> list[dict[str, Any]]:
    hex_id = run.id.hex
    request = run.approval_request
    if isinstance(request, dict):
        return [approval_item(approval_request_id(run.id, run.inputs_count), request)]
    if run.status == "waiting_for_user":
        return [
            {
                "type": "function_call",
                "id": f"fc_{hex_id}_{run.inputs_count}",
                "call_id": call_id(run.id, run.inputs_count),
                "name": "ask_user",
                "arguments": json.dumps({"question": run.question}, ensure_ascii=False),
                "status": "completed",
            }
        ]
    if run.status != "succeeded":
        return []
    text = final_text(run.result)
    if text is None:
        return []
    return [
        {
            "type": "message",
            "id": message_id(run.id, run.lease_epoch),
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        }
    ]


def response_document(run: Run, *, background: bool | None = None) -> dict[str, Any]:
    """The Response object of a run, as `GET /v1/responses/{id}` answers it."""
    values = run.input if isinstance(run.input, dict) else {}
    instructions = values.get("instructions")
    metadata = values.get("metadata")
    upstream = values.get("upstream_model")
    status = STATUS.get(run.status, "in_progress")
    error = None
    if run.status == "failed":
        error = {"code": "server_error", "message": _failure_message(run.failure)}
    return {
        "id": response_id(run.id),
        "object": "response",
        "created_at": run.created_at.timestamp(),
        "completed_at": run.finished_at.timestamp() if run.finished_at else None,
        "status": status,
        "background": background,
        "error": error,
        "incomplete_details": None,
        "instructions": instructions if isinstance(instructions, str) else None,
        "metadata": metadata if isinstance(metadata, dict) else {},
        "model": f"{run.agent}:{upstream}" if isinstance(upstream, str) else run.agent,
        "output": output_of(run),
        "parallel_tool_calls": False,
        "temperature": None,
        "top_p": None,
        "tool_choice": "auto",
        "tools": [],
        "store": values.get(NOT_STORED) is not True,
        "usage": usage_of(run.result),
        "conversation": (
            {"id": f"conv_{run.session_id.hex}"}
            if run.session_id and values.get(CHAIN) is not True
            else None
        ),
    }


ERROR_TYPES = {
    401: "invalid_request_error",
    403: "permission_error",
    429: "rate_limit_error",
}


def _tag(part: str) -> bool:
    """A location segment that names no field: where it came from, or which member of a union
    pydantic tried (`str`, `list[InputMessage]`)."""
    return part in ("body", "query", "path", "header", "str", "int", "bool") or "[" in part


def error_body(status: int, problem: dict[str, Any]) -> dict[str, Any]:
    """Our problem+json document in OpenAI's error shape: `message` from its detail (or
    title), `code` from its slug, `param` from the deepest error location (for a value that
    matched no member of a union, the member it came nearest to)."""
    slug = str(problem.get("type", "")).rsplit("/", 1)[-1] or None
    message = problem.get("detail") or problem.get("title") or "error"
    param = None
    errors = problem.get("errors")
    if isinstance(errors, list):
        found = [
            ([str(p) for p in e.get("loc") or [] if not _tag(str(p))], e.get("msg"))
            for e in errors
            if isinstance(e, dict)
        ]
        if found:
            loc, msg = max(found, key=lambda f: len(f[0]))
            param = ".".join(loc) or None
            if param and isinstance(msg, str) and len(found) > 1:
                message = f"{param}: {msg}"
    kind = "server_error" if status >= 500 else ERROR_TYPES.get(status, "invalid_request_error")
    code = "invalid_api_key" if status == 401 else (slug.replace("-", "_") if slug else None)
    return {"error": {"message": str(message), "type": kind, "param": param, "code": code}}


# --- the stream's numbering ----------------------------------------------------------------
# A response's stream is one fixed sequence of events, whoever reads it and whenever: a stream
# opened again with `starting_after=N` computes the same sequence and sends only what comes after
# N. So every number is a function of the run's text, never of when a connection heard it:
#
# - 0 is `response.created`, 1 `response.in_progress`;
# - each claim of the run (its epoch) that writes text has its own output item, numbered in its
#   own block from `block_base(epoch)`: the item's `output_item.added`, its `content_part.added`,
#   then one `output_text.delta` per chunk of its text (`chunk_ends`: words, at most
#   `CHUNK_LIMIT` characters), so the n-th chunk has the same number on every connection;
# - a claim abandoned by a crash never gets its text continued: its item is closed
#   (`output_item.done`, status `incomplete`) and the re-run writes into a new item of its own,
#   whose block starts `EPOCH_STRIDE` further on, past any number the abandoned item used (its
#   length was never durable, so the re-run cannot count on it);
# - the last claim's item ends with `output_text.done`, `content_part.done`, `output_item.done`
#   and the response's own end event, numbered on from its last chunk.
#
# Numbers are contiguous from 0 for a run claimed once; a re-run leaves a gap, which the SDK
# does not mind (it orders by the number and resumes after one, nothing more).
EPOCH_STRIDE = 1_000_000_000
FIRST_BLOCK = 2
CHUNK_LIMIT = 64


def block_base(epoch: int) -> int:
    """The number of the first event of the item of claim `epoch` (claims count from 1)."""
    return FIRST_BLOCK + (max(epoch, 1) - 1) * EPOCH_STRIDE


def chunk_ends(text: str, *, whole: bool) -> list[int]:
    """Where the chunks of `text` end, counted from its start: a chunk ends before a word that
    follows white space, or at `CHUNK_LIMIT` characters. A chunk's end is known once the next
    character is (so live text gives the same chunks as the whole); with `whole`, the rest is the
    last chunk."""
    ends: list[int] = []
    begin = 0
    for pos in range(1, len(text)):
        if pos - begin == CHUNK_LIMIT or (text[pos - 1].isspace() and not text[pos].isspace()):
            ends.append(pos)
            begin = pos
    if whole and begin < len(text):
        ends.append(len(text))
    return ends


def input_items(run: Run) -> list[dict[str, Any]]:
    """The items of a response's input (`GET /v1/responses/{id}/input_items`), oldest first:
    the messages it was created with (an answer's `function_call_output` as that item)."""
    values = run.input if isinstance(run.input, dict) else {}
    hex_id = run.id.hex
    items: list[dict[str, Any]] = []
    messages = values.get("messages")
    for number, message in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        text = message.get("content")
        assistant = role == "assistant"
        part: dict[str, Any] = {
            "type": "output_text" if assistant else "input_text",
            "text": text if isinstance(text, str) else json.dumps(text, ensure_ascii=False),
        }
        if assistant:
            part.update(annotations=[], logprobs=[])
        items.append(
            {
                "type": "message",
                "id": f"msg_{hex_id}_in{number}",
                "role": role if isinstance(role, str) else "user",
                "status": "completed",
                "content": [part],
            }
        )
    answered = values.get("call_id")
    if isinstance(answered, str):
        items.append(
            {
                "type": "function_call_output",
                "id": f"fco_{hex_id}_in",
                "call_id": answered,
                "output": str(values.get("text", "")),
                "status": "completed",
            }
        )
    return items


def list_page(
    items: list[dict[str, Any]], *, order: str, after: str | None, limit: int
) -> dict[str, Any]:
    """One page of items as OpenAI's lists are: newest first unless `order` is `asc`, after
    the item `after` names (an unknown one: from the start)."""
    ordered = items if order == "asc" else list(reversed(items))
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after in ids:
            ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(ordered) > limit,
    }
