"""JSON responses rendered with orjson: the API's documents (runs, sessions, problems) are
plain dicts of strings, numbers, lists and nested JSON, which orjson renders several times
faster than the standard library's encoder, on every request of the hot paths.

orjson renders integers of 64 bits at most. The API refuses larger numbers in what it stores
(app/api/schemas.py, `storable_json`), but a run may still hold one: stored before that check,
or in an agent's result or a tool's answer, where jsonb gives `1e308` back as a 309-digit
integer. Such a document is rendered by the standard library instead, exactly, so no stored run
is ever unrenderable.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from fastapi.responses import JSONResponse


class FastJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        # Non-string keys would be a bug in a document: orjson refuses them (as the API should).
        try:
            return orjson.dumps(content)
        except TypeError as exc:
            if "64-bit" not in str(exc):
                raise
        return json.dumps(
            content, ensure_ascii=False, allow_nan=False, separators=(",", ":")
        ).encode()
