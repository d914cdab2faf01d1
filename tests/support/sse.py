"""Reading Server-Sent Events as a test client does: each event with its type, id and data."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class Item:
    event: str
    id: str | None
    data: dict[str, Any]


async def sse(response: httpx.Response) -> AsyncIterator[Item]:
    """The events of an SSE response, as they come (comments, such as keep-alives, skipped)."""
    event: str = "message"
    event_id: str | None = None
    data: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                yield Item(event, event_id, json.loads("\n".join(data)))
            event, event_id, data = "message", None, []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "id":
                event_id = value
            elif name == "data":
                data.append(value)
