"""JSON responses rendered with orjson: the API's documents (runs, sessions, problems) are
plain dicts of strings, numbers, lists and nested JSON, which orjson renders several times
faster than the standard library's encoder, on every request of the hot paths."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import JSONResponse


class FastJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        # Non-string keys would be a bug in a document: orjson refuses them (as the API should).
        return orjson.dumps(content)
