"""A session's history as a chat model sees it: the transcript entries a run is given
(`RunState.history`) turned into chat-completions messages, and the budget that keeps the
oldest of them out of the request.

Mapping: a user turn (a run's input or an answer) is a `user` message; the assistant's
question or final message an `assistant` message; a tool call an `assistant` message carrying
that one call followed by its `tool` result (an `uncertain` outcome reads "unknown", never
"failed"; an `abandoned` one, a safe or keyed call its run's end left open, says so; a
`rejected` one, refused by the user, carries the refusal and its reason). A tool call's
approval request and its decision send nothing of their own (docs/approvals.md). A run's
failed or cancelled end sends nothing: its user turns stay, and the next
user turn follows them.

Budget: messages are grouped into exchanges, each starting at a user message, so a tool call
and its result always sit in the same exchange. Whole exchanges are dropped, oldest first,
until what is left fits both the message count and the character count; the exchanges kept
are always the newest, contiguous ones.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from app.vocabulary.records import JSON

UNKNOWN_RESULT = (
    "The outcome of this tool call is unknown: it started but its result was never recorded "
    "(the worker stopped). It may or may not have taken effect, and it was not repeated."
)


ABANDONED_RESULT = (
    "This tool call started but its run ended (cancelled or failed) before it finished; it was "
    "not completed here and was not repeated. It is safe to make again if it is still needed."
)


def as_text(value: JSON) -> str:
    """A turn's content as chat text: a `text` field, a string as is, anything else as JSON."""
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        return str(value["text"])
    return value if isinstance(value, str) else json.dumps(value)


def chat_messages(history: Sequence[dict[str, JSON]]) -> list[dict[str, JSON]]:
    """Transcript entries (oldest first) as chat-completions messages."""
    messages: list[dict[str, JSON]] = []
    for entry in history:
        role = entry.get("role")
        if entry.get("kind") in ("approval_request", "approval"):
            continue  # the call's own entry carries what came of it (docs/approvals.md)
        if role == "user":
            messages.append({"role": "user", "content": as_text(entry.get("content"))})
        elif role == "assistant":
            messages.append({"role": "assistant", "content": as_text(entry.get("content"))})
        elif role == "tool":
            tool = entry.get("tool") or {}
            call_id = f"history_{entry.get('run_no')}_{tool.get('step')}"
            status = tool.get("status")
            if status == "uncertain":
                result = json.dumps({"status": "unknown", "message": UNKNOWN_RESULT})
            elif status == "abandoned":
                result = json.dumps({"status": "abandoned", "message": ABANDONED_RESULT})
            elif status == "rejected":
                result = json.dumps({"status": "rejected", "result": entry.get("content")})
            else:
                result = json.dumps({"status": status, "result": entry.get("content")})
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {
                                "name": tool.get("name"),
                                "arguments": json.dumps(tool.get("args") or {}),
                            },
                        }
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
        # system entries (a run's failed or cancelled end) are not sent to the model.
    return messages


def exchanges(messages: Sequence[dict[str, JSON]]) -> list[list[dict[str, JSON]]]:
    """Messages grouped into exchanges, each starting at a user message (the first group may
    start otherwise): no exchange boundary falls between a tool call and its result."""
    grouped: list[list[dict[str, JSON]]] = []
    for message in messages:
        if message.get("role") == "user" or not grouped:
            grouped.append([message])
        else:
            grouped[-1].append(message)
    return grouped


def message_chars(message: dict[str, JSON]) -> int:
    """What a message weighs against the character budget: its content and its tool calls."""
    content = message.get("content")
    size = len(content) if isinstance(content, str) else 0
    if message.get("tool_calls"):
        size += len(json.dumps(message["tool_calls"]))
    return size


def trim_history(
    messages: Sequence[dict[str, JSON]], *, max_messages: int, max_chars: int
) -> list[dict[str, JSON]]:
    """The newest whole exchanges that fit `max_messages` and `max_chars` together; older
    ones are dropped first, and an exchange is kept or dropped whole."""
    kept: list[list[dict[str, JSON]]] = []
    count = chars = 0
    for exchange in reversed(exchanges(messages)):
        size = sum(message_chars(m) for m in exchange)
        if count + len(exchange) > max_messages or chars + size > max_chars:
            break  # and everything older: the history stays contiguous up to now
        kept.append(exchange)
        count += len(exchange)
        chars += size
    return [message for exchange in reversed(kept) for message in exchange]
