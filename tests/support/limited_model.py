"""A fake OpenAI-compatible endpoint that enforces rate limits of its own, as a provider does
(issue 39's measure): requests and tokens a minute, each a bucket holding a minute's worth and
refilling continuously, and a 429 with Retry-After (whole seconds until the bucket has room)
over either. Each call's tokens are its messages' JSON over 4 plus the 2 of its answer, and
the answer reports them as its usage; that is never more than a Turnstile reservation's
estimate (the whole request body over 4, plus the output bound). A `hold` gate keeps requests
waiting (the test releases it), to crash a worker in the middle of a call. `slack` lets the
request bucket go that far below zero: the database refills its buckets at reservation time
and this endpoint at arrival, a few milliseconds later and not always by the same few (a
double grant across processes is a whole request over, far beyond it).

Everything it saw is kept for the test: `served`, `refused` (each with its wall-clock time,
to compare with the database's timestamps on the same machine)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

ANSWER_TOKENS = 2


@dataclass
class _Bucket:
    per_minute: float
    level: float = -1.0
    at: float = field(default_factory=time.monotonic)

    def refill(self) -> float:
        now = time.monotonic()
        if self.level < 0:
            self.level = self.per_minute
        self.level = min(self.per_minute, self.level + (now - self.at) * self.per_minute / 60)
        self.at = now
        return self.level

    def seconds_until(self, amount: float) -> float:
        return max(0.0, (amount - self.level) * 60 / self.per_minute)


@dataclass
class LimitedModel:
    """Answers every chat completion with "ok" while under its limits (None: no limit)."""

    rpm: int | None = None
    tpm: int | None = None
    slack: float = 0.0
    served: list[float] = field(default_factory=list)
    refused: list[float] = field(default_factory=list)
    tokens: int = 0
    hold: asyncio.Event | None = None
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._requests = None if self.rpm is None else _Bucket(self.rpm)
        self._tokens = None if self.tpm is None else _Bucket(self.tpm)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def complete(request: Request) -> Response:
            body = await request.json()
            self.arrived.set()
            if self.hold is not None:
                await self.hold.wait()
            used = math.ceil(len(json.dumps(body["messages"])) / 4) + ANSWER_TOKENS
            waits = []
            if self._requests is not None and self._requests.refill() < 1 - self.slack:
                waits.append(self._requests.seconds_until(1))
            if self._tokens is not None and self._tokens.refill() < used:
                waits.append(self._tokens.seconds_until(used))
            if waits:
                self.refused.append(time.time())
                return JSONResponse(
                    {"error": {"message": "rate limit reached", "type": "rate_limit"}},
                    status_code=429,
                    headers={"Retry-After": str(max(1, math.ceil(max(waits))))},
                )
            if self._requests is not None:
                self._requests.level -= 1
            if self._tokens is not None:
                self._tokens.level -= used
            self.served.append(time.time())
            self.tokens += used
            return JSONResponse(_answer(used))

        return app


def _answer(used: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-limited",
        "model": "limited",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {
            "prompt_tokens": used - ANSWER_TOKENS,
            "completion_tokens": ANSWER_TOKENS,
            "total_tokens": used,
        },
    }
