"""Tools and their idempotency classes.

Each tool declares, per call, how safe it is to repeat:
- `safe`: read-only or idempotent; recovery may simply run it again;
- `keyed`: safe to repeat given the same key; the runtime derives a stable key from the run and
  the step and passes it to the tool, so a repeat carries the same key;
- `unsafe`: repeating may repeat an effect; a call that started with no recorded outcome becomes
  `uncertain` and is never run again.

Errors: `TransientToolError` (timeouts, 5xx, resets) may be retried inside the run, but only
when the call is safe to repeat or provably never reached its target (`sent=False`);
`PermanentToolError` (bad arguments, a refusal) fails the run at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

from app.vocabulary.records import JSON

IdempotencyClass = Literal["safe", "keyed", "unsafe"]


class ToolError(Exception):
    """A tool could not produce an outcome."""


class TransientToolError(ToolError):
    """Worth retrying. `sent` says whether the request may have reached its target."""

    def __init__(self, message: str, *, sent: bool = True) -> None:
        super().__init__(message)
        self.sent = sent


class PermanentToolError(ToolError):
    """Retrying cannot help: bad arguments, a refused destination, an unknown tool."""


@dataclass(frozen=True)
class ToolContext:
    run_id: str
    step: int
    idempotency_key: str | None  # set for keyed calls
    # The run's attempt (from 1) and its attempts in all: a tool whose failure on the last
    # attempt means something more (a failed webhook delivery) can tell.
    attempt: int = 1
    max_attempts: int = 1
    # Appends an event to the run's own stream, fenced on the run's lease like every write of
    # the execution (a lost lease stops the execution instead). None outside a worker.
    emit: Callable[[str, JSON], Awaitable[None]] | None = None


class Tool(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def parameters(self) -> dict[str, JSON]:
        """JSON Schema of the arguments (what a model is shown)."""
        ...

    def idempotency_class(self, args: dict[str, JSON]) -> IdempotencyClass: ...

    async def run(self, args: dict[str, JSON], ctx: ToolContext) -> JSON: ...


class SleepTool:
    name = "sleep"
    description = "Wait for a number of seconds (at most 60), then answer how long it slept."
    parameters: ClassVar[dict[str, JSON]] = {
        "type": "object",
        "properties": {"seconds": {"type": "number", "minimum": 0, "maximum": 60}},
        "required": ["seconds"],
        "additionalProperties": False,
    }

    def idempotency_class(self, args: dict[str, JSON]) -> IdempotencyClass:
        return "safe"

    async def run(self, args: dict[str, JSON], ctx: ToolContext) -> JSON:
        seconds = args.get("seconds")
        if (
            not isinstance(seconds, int | float)
            or isinstance(seconds, bool)
            or not (0 <= seconds <= 60)
        ):
            raise PermanentToolError("sleep needs 'seconds' between 0 and 60")
        await asyncio.sleep(float(seconds))
        return {"slept": float(seconds)}


class EchoTool:
    name = "echo"
    description = "Answer with the arguments it was given."
    parameters: ClassVar[dict[str, JSON]] = {"type": "object", "additionalProperties": True}

    def idempotency_class(self, args: dict[str, JSON]) -> IdempotencyClass:
        return "safe"

    async def run(self, args: dict[str, JSON], ctx: ToolContext) -> JSON:
        return {"echo": args}


def derive_idempotency_key(run_id: str, step: int) -> str:
    """Stable across recoveries: the same run and step always give the same key."""
    return f"turnstile-{run_id}-step-{step}"
