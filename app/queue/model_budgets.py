"""Model capacity as a scheduled resource (issue 39; docs/model-budgets.md): a request and
token budget per model endpoint, kept in PostgreSQL so it is exact across every process, and
the reservations model calls take against it (no HTTP here).

- An endpoint is named by a key: the agent's base URL and model (`endpoint_key`), or a name
  the operator gives. Its budget is requests and tokens a minute: an admin's override
  (`ModelBudgets.set_budget`, the API's `PUT /model-budgets` and `turnstile model-budgets
  set`), else the process default (`BudgetDefaults`: TURNSTILE_MODEL_RPM,
  TURNSTILE_MODEL_TPM); None there too is unlimited.
- Each budget is two token buckets holding at most a minute's worth and refilling at a
  minute's worth a minute (as providers count: continuously, not in fixed windows).
  `reserve` takes one request and the call's estimated tokens before the call is sent
  (`estimate_tokens`: a documented estimate, never a tokenizer), fenced on the run's lease:
  a `Reservation`, or a `CapacityShort` saying when the buckets will have them and why, or
  `Fenced`. `settle` puts the usage the provider reported in the estimate's place.
- A reservation whose run lost its lease (a crash, a sweep) or that outlived
  `reservation_seconds` gives its tokens back at the endpoint's next reservation.
- `pause` (a provider's 429 with Retry-After) stops every process's reservations for the
  endpoint until then.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import RowMapping

from app.queue.core import Queue
from app.queue.errors import InvalidLimitsError
from app.queue.tenant_limits import KEEP, MAX_INT, Keep
from app.store import budget_rows
from app.vocabulary.records import JSON, Fenced, Lease

MAX_ENDPOINT_LENGTH = 300
"""An endpoint's key is a base URL and a model name, or a name: a longer one is a mistake."""
CHARS_PER_TOKEN = 4
"""The estimate's rule of thumb: about four characters of English text a token (OpenAI's own
guidance). The request's whole body is counted (messages, tool schemas, JSON syntax), so the
estimate errs high; the provider's reported usage replaces it at settlement."""
MAX_PAUSE_SECONDS = 3600.0
"""The longest pause a provider's Retry-After may impose (a larger value is taken as this)."""


def endpoint_key(base_url: str, model: str) -> str:
    """An endpoint's budget key: its model at its base URL (`gpt-4o-mini@https://.../v1`)."""
    return f"{model}@{base_url.rstrip('/')}"


def estimate_tokens(request_bytes: int, max_output_tokens: int) -> int:
    """A call's reservation: its request's size over CHARS_PER_TOKEN, rounded up, plus the
    output it may produce (the request's bound)."""
    return math.ceil(request_bytes / CHARS_PER_TOKEN) + max_output_tokens


@dataclass(frozen=True)
class BudgetDefaults:
    """Every endpoint's budget where it has no override (None: unlimited), and how long a
    reservation is held at most (TURNSTILE_MODEL_RPM, TURNSTILE_MODEL_TPM,
    TURNSTILE_MODEL_RESERVATION_SECONDS)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    reservation_seconds: float = 300.0


@dataclass(frozen=True)
class Reservation:
    """A model call's hold on its endpoint's budget, until `settle`."""

    id: UUID
    endpoint: str
    tokens: int


@dataclass(frozen=True)
class CapacityShort:
    """The endpoint's budget cannot take the call now: `short_of` is what it lacks (`requests`,
    `tokens`, or `paused` by the provider), `ready_at` when it will have it."""

    endpoint: str
    short_of: str
    wait_seconds: float
    ready_at: datetime

    def reason(self) -> str:
        what = {
            "paused": "the provider paused it (429)",
            "requests": "its requests a minute are spent",
            "tokens": "its tokens a minute are spent",
        }.get(self.short_of, self.short_of)
        return f"waiting for capacity on {self.endpoint}: {what}"


@dataclass(frozen=True)
class ModelBudget:
    """One endpoint's overrides (None: the default) and figures."""

    endpoint: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    updated_at: datetime | None = None
    paused_until: datetime | None = None
    requests_used: int = 0
    tokens_used: int = 0
    waits: int = 0
    pauses: int = 0
    reservations: int = 0
    reserved_tokens: int = 0

    def to_document(self, defaults: BudgetDefaults) -> dict[str, JSON]:
        """JSON-ready: the overrides, what applies (null: unlimited) and the figures."""
        return {
            "endpoint": self.endpoint,
            "overrides": {
                "requests_per_minute": self.requests_per_minute,
                "tokens_per_minute": self.tokens_per_minute,
            },
            "effective": {
                "requests_per_minute": _first(
                    self.requests_per_minute, defaults.requests_per_minute
                ),
                "tokens_per_minute": _first(self.tokens_per_minute, defaults.tokens_per_minute),
            },
            "paused_until": None if self.paused_until is None else self.paused_until.isoformat(),
            "requests_used": self.requests_used,
            "tokens_used": self.tokens_used,
            "waits": self.waits,
            "pauses": self.pauses,
            "reservations": self.reservations,
            "reserved_tokens": self.reserved_tokens,
            "updated_at": None if self.updated_at is None else self.updated_at.isoformat(),
        }

    @classmethod
    def from_row(cls, row: RowMapping | Mapping[str, Any]) -> ModelBudget:
        return cls(
            endpoint=row["endpoint"],
            requests_per_minute=row["requests_per_minute"],
            tokens_per_minute=row["tokens_per_minute"],
            updated_at=row["updated_at"],
            paused_until=row.get("paused_until"),
            requests_used=int(row.get("requests_used") or 0),
            tokens_used=int(row.get("tokens_used") or 0),
            waits=int(row.get("waits") or 0),
            pauses=int(row.get("pauses") or 0),
            reservations=int(row.get("reservations") or 0),
            reserved_tokens=int(row.get("reserved_tokens") or 0),
        )


def _first(override: int | None, default: int | None) -> int | None:
    return override if override is not None else default


class ModelBudgets:
    """The endpoints' budgets and reservations, on the queue's engine and clock."""

    def __init__(self, queue: Queue, defaults: BudgetDefaults | None = None) -> None:
        self.queue = queue
        self.defaults = defaults or BudgetDefaults()

    # --- the admin's ------------------------------------------------------------------------
    async def get_budget(self, endpoint: str) -> ModelBudget:
        """The endpoint's overrides and figures (all None and 0 when it was never used)."""
        endpoint = check_endpoint(endpoint)
        rows = await budget_rows.figures(self.queue.engine, endpoint)
        return ModelBudget.from_row(rows[0]) if rows else ModelBudget(endpoint)

    async def budgets(self) -> list[ModelBudget]:
        """Every endpoint that has a budget row (used, or given an override), by key."""
        return [
            ModelBudget.from_row(row) for row in await budget_rows.figures(self.queue.engine, None)
        ]

    async def set_budget(
        self,
        endpoint: str,
        *,
        requests_per_minute: int | Keep | None = KEEP,
        tokens_per_minute: int | Keep | None = KEEP,
    ) -> ModelBudget:
        """Validate and upsert the endpoint's overrides; None returns a value to the default,
        KEEP leaves it. Every process's next reservation sees it. InvalidLimitsError names the
        first bad field."""
        endpoint = check_endpoint(endpoint)
        for name, value in (
            ("requests_per_minute", requests_per_minute),
            ("tokens_per_minute", tokens_per_minute),
        ):
            if not isinstance(value, Keep) and value is not None:
                check_per_minute(name, value)
        params = {
            "endpoint": endpoint,
            "now": self.queue.clock(),
            "requests_per_minute": (
                None if isinstance(requests_per_minute, Keep) else requests_per_minute
            ),
            "keep_rpm": isinstance(requests_per_minute, Keep),
            "tokens_per_minute": None if isinstance(tokens_per_minute, Keep) else tokens_per_minute,
            "keep_tpm": isinstance(tokens_per_minute, Keep),
        }
        await budget_rows.upsert_budget(self.queue.engine, params)
        return await self.get_budget(endpoint)

    # --- a model call's ---------------------------------------------------------------------
    async def reserve(
        self, lease: Lease, endpoint: str, tokens: int
    ) -> Reservation | CapacityShort | Fenced:
        """Take one request and `tokens` from the endpoint's budget for the run holding
        `lease`, in one short fenced transaction."""
        row = await budget_rows.reserve(
            self.queue.engine,
            {
                "endpoint": endpoint,
                "run_id": lease.run_id,
                "epoch": lease.epoch,
                "tokens": max(0, min(int(tokens), MAX_INT)),
                "default_rpm": self.defaults.requests_per_minute,
                "default_tpm": self.defaults.tokens_per_minute,
                "hold_seconds": self.defaults.reservation_seconds,
                "now": self.queue.clock(),
            },
        )
        if row is None:
            return Fenced(lease)
        if row["granted"]:
            return Reservation(
                id=row["reservation_id"], endpoint=endpoint, tokens=int(row["tokens"])
            )
        return CapacityShort(
            endpoint=endpoint,
            short_of=str(row["short_of"]),
            wait_seconds=float(row["wait_seconds"]),
            ready_at=row["ready_at"],
        )

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """The call is over: its reservation replaced by the tokens the provider reported."""
        await budget_rows.settle(
            self.queue.engine,
            {
                "reservation_id": reservation.id,
                "endpoint": reservation.endpoint,
                "used_tokens": max(0, min(int(used_tokens), MAX_INT)),
                "default_tpm": self.defaults.tokens_per_minute,
            },
        )

    async def pause(self, endpoint: str, seconds: float) -> datetime:
        """Stop every process's reservations for the endpoint for `seconds` (a provider's
        Retry-After, at most MAX_PAUSE_SECONDS); when the pause ends."""
        seconds = min(max(float(seconds), 0.0), MAX_PAUSE_SECONDS)
        row = await budget_rows.pause(
            self.queue.engine,
            {"endpoint": endpoint, "seconds": seconds, "now": self.queue.clock()},
        )
        paused_until: datetime = row["paused_until"]
        return paused_until


def check_endpoint(endpoint: object) -> str:
    if not isinstance(endpoint, str) or not endpoint.strip():
        raise InvalidLimitsError("endpoint", "must be a non-empty string")
    if len(endpoint) > MAX_ENDPOINT_LENGTH:
        raise InvalidLimitsError("endpoint", f"must be at most {MAX_ENDPOINT_LENGTH} characters")
    if any(ch.isspace() or not ch.isprintable() for ch in endpoint):
        raise InvalidLimitsError("endpoint", "must not contain spaces or control characters")
    return endpoint


def check_per_minute(name: str, value: object) -> None:
    # bool is an int to Python, never a budget to a person.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidLimitsError(name, "must be a whole number")
    if not 1 <= value <= MAX_INT:
        raise InvalidLimitsError(name, f"must be between 1 and {MAX_INT}")
