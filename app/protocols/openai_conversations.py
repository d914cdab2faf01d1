"""The OpenAI Conversations API's objects mapped onto Turnstile's sessions: pure functions, no
HTTP.

A conversation is a session (`conv_<session id, hex>`); a response created in it is a turn of
that session, so its run sees the session's history as every turn does. Its items are the
session's transcript (`GET /sessions/{id}/messages`), read back in the Conversations item
shapes: a run's first input and every answer delivered to it are `user` messages (an answer
given as a `function_call_output` is that item again); a question is an `ask_user`
`function_call`; a wait for a tool call's approval is an `mcp_approval_request` and its
decision an `mcp_approval_response` (approve: false for a rejection; an edit approves); a run's
final text is an `assistant` message; each tool call is a `function_call` with its
`function_call_output`. A failed or cancelled run's end has no item.
A conversation's `metadata` is its session's (at most 16 string pairs, keys of at most 64
characters, values of at most 512, as OpenAI allows: `Metadata`); an update sets the keys it
gives and keeps the others. Items are derived from what runs recorded under their fence, so they
are read-only: a caller adds
items by creating responses in the conversation, and deletes them by deleting the
conversation (app/api/conversation_routes.py refuses the rest, saying so).

Item ids name the transcript entry: `<kind>_<run number in the session>_<seq>`.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from app.protocols.openai_responses import (
    Metadata,
    approval_item,
    approval_request_id,
    call_id,
    final_text,
)
from app.vocabulary.records import JSON, TranscriptEntry

PREFIX = "conv_"


class CreateConversation(BaseModel):
    """The body of `POST /v1/conversations` (and of its update, which has only metadata)."""

    model_config = ConfigDict(extra="ignore")
    items: list[dict[str, JSON]] | None = Field(default=None, max_length=20)
    metadata: Metadata | None = None


def conversation_id(session_id: UUID) -> str:
    return f"{PREFIX}{session_id.hex}"


def session_id_of(conversation: str) -> UUID | None:
    """The session a conversation id names; None for a string that names none (not found)."""
    if not conversation.startswith(PREFIX) or len(conversation) != len(PREFIX) + 32:
        return None
    try:
        return UUID(hex=conversation[len(PREFIX) :])
    except ValueError:
        return None


def conversation_document(
    session_id: UUID, created_at: datetime, metadata: dict[str, str]
) -> dict[str, Any]:
    return {
        "id": conversation_id(session_id),
        "object": "conversation",
        "created_at": int(created_at.timestamp()),
        "metadata": metadata,
    }


def _text(content: JSON) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, dict) and isinstance(content.get("text"), str):
        return str(content["text"])
    return json.dumps(content, ensure_ascii=False)


def _message(item_id: str, role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    part: dict[str, Any] = {"type": kind, "text": text}
    if kind == "output_text":
        part.update(annotations=[], logprobs=[])
    return {
        "type": "message",
        "id": item_id,
        "role": role,
        "status": "completed",
        "content": [part],
    }


def conversation_items(entries: list[TranscriptEntry]) -> list[dict[str, Any]]:
    """The items of a transcript, oldest first (entries in their (run_no, seq) order)."""
    items: list[dict[str, Any]] = []
    inputs: dict[UUID, int] = {}  # the inputs each run has had so far
    for entry in entries:
        where = f"{entry.run_no}_{entry.seq}"
        content = entry.content
        if entry.role == "user":
            inputs[entry.run_id] = inputs.get(entry.run_id, 0) + 1
            answered = content.get("call_id") if isinstance(content, dict) else None
            decision = content.get("approval") if isinstance(content, dict) else None
            if isinstance(decision, dict):
                # The decision answers the request its run showed after the input before.
                reason = decision.get("reason")
                items.append(
                    {
                        "type": "mcp_approval_response",
                        "id": f"mcpa_{where}",
                        "approval_request_id": approval_request_id(
                            entry.run_id, inputs[entry.run_id] - 1
                        ),
                        "approve": decision.get("decision") != "reject",
                        "reason": reason if isinstance(reason, str) else None,
                    }
                )
            elif isinstance(answered, str):
                items.append(
                    {
                        "type": "function_call_output",
                        "id": f"fco_{where}",
                        "call_id": answered,
                        "output": _text(content),
                        "status": "completed",
                    }
                )
            else:
                items.append(_message(f"msg_{where}", "user", _text(content)))
        elif (
            entry.kind == "approval_request"
            and isinstance(content, dict)
            and (isinstance(request := content.get("approval_request"), dict))
        ):
            # Its id is the request's own, which the decision names (OpenAI's item ids).
            items.append(
                approval_item(
                    approval_request_id(entry.run_id, inputs.get(entry.run_id, 0)), request
                )
            )
        elif entry.kind == "question":
            items.append(
                {
                    "type": "function_call",
                    "id": f"fc_{where}",
                    "call_id": call_id(entry.run_id, inputs.get(entry.run_id, 0)),
                    "name": "ask_user",
                    "arguments": json.dumps({"question": content}, ensure_ascii=False),
                    "status": "completed",
                }
            )
        elif entry.kind == "final":
            text = final_text({"final": content})
            if text is not None:
                items.append(_message(f"msg_{where}", "assistant", text))
        elif entry.kind == "tool_call":
            tool = entry.tool if isinstance(entry.tool, dict) else {}
            name = tool.get("name")
            call = f"call_{entry.run_id.hex}_t{tool.get('step')}"
            items.append(
                {
                    "type": "function_call",
                    "id": f"fc_{where}",
                    "call_id": call,
                    "name": name if isinstance(name, str) else "tool",
                    "arguments": json.dumps(tool.get("args"), ensure_ascii=False),
                    "status": "completed",
                }
            )
            items.append(
                {
                    "type": "function_call_output",
                    "id": f"fco_{where}",
                    "call_id": call,
                    "output": _text(content),
                    "status": "completed",
                }
            )
    return items
