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
- A call the budget cannot take now is **booked** (migration 0028): its request and tokens are
  taken at once, the buckets going below zero, and its run comes back at its own turn, when
  the booking becomes its reservation; later calls wait behind it (no herd, no turn taken
  from a run that waited). An interactive call takes the turn of an async booking not yet
  due. Settlements giving tokens back bring every booking forward (the budget's
  `token_advance`).
- A reservation whose run lost its lease (a crash, a sweep) or that outlived
  `reservation_seconds` gives its tokens back at the endpoint's next reservation.
- A tenant may be given limits of its own on an endpoint, requests and tokens a minute
  (`ModelBudgets.set_tenant_budget`, migration 0030; on every endpoint with endpoint None):
  two buckets of the tenant's, taken by its calls before the endpoint's. A call its tenant's
  buckets cannot take is booked on them alone, its run given back until its turn there, so
  a tenant over its limit holds nothing of the endpoint's and takes no other tenant's turn.
  Every tenant's use of every endpoint is counted (`TenantHold`).
- `pause` (a provider's 429 with Retry-After) stops every process's reservations for the
  endpoint until then. `observe` (its rate-limit headers, `ProviderLimits`) makes the
  budget's effective rate never above the provider's limits, and its buckets never above
  what the provider says remains.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import RowMapping

from app.queue.core import Queue
from app.queue.errors import InvalidLimitsError
from app.queue.tenant_limits import KEEP, MAX_INT, Keep
from app.store import budget_rows
from app.vocabulary.names import InvalidNameError, tenant_name
from app.vocabulary.records import JSON, Fenced, Lease

MAX_ENDPOINT_LENGTH = 300
"""An endpoint's key is a base URL and a model name, or a name: a longer one is a mistake."""
CHARS_PER_TOKEN = 4
"""The estimate's rule of thumb: about four characters of English text a token (OpenAI's own
guidance). The request's whole body is counted (messages, tool schemas, JSON syntax), so the
estimate errs high; the provider's reported usage replaces it at settlement."""
BOOKING_GRACE_SECONDS = 60.0
"""How long a booking waits for its run past the time the run was told to come back: a run
later than that (cancelled, or its workers busy) gives its turn back, and books again."""
WAKE_BATCH = 50
"""The most runs one settlement makes eligible early (the next settlement takes the rest)."""
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
    reservation is held at most, and the share interactive calls have to themselves
    (TURNSTILE_MODEL_RPM, TURNSTILE_MODEL_TPM, TURNSTILE_MODEL_RESERVATION_SECONDS,
    TURNSTILE_MODEL_INTERACTIVE_SHARE)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    reservation_seconds: float = 300.0
    # The share of a minute's budget an async or maintenance call must leave in the buckets
    # for interactive calls (TURNSTILE_MODEL_INTERACTIVE_SHARE; docs/model-budgets.md).
    interactive_share: float = 0.0
    # How long a process trusts that an endpoint has no limit for a tenant before it asks
    # again (`ModelBudgets`' unlimited path); 0: it asks at every call.
    unlimited_trust_seconds: float = 1.0


EVERY_ENDPOINT = ""
"""The endpoint key of a tenant's limits on every endpoint (no endpoint's key is empty)."""


@dataclass(frozen=True)
class Reservation:
    """A model call's hold on its endpoint's budget, until `settle`: `tokens` of the
    endpoint's, and `tenant_tokens` of its tenant's (None: nothing of its tenant's). `id` None:
    a call to an endpoint with no limit for its tenant, which holds nothing (`ModelBudgets`'
    unlimited path) and is only counted."""

    id: UUID | None
    endpoint: str
    tokens: int
    tenant_id: str | None = None
    tenant_tokens: int | None = None


@dataclass
class _Unlimited:
    """What this process knows of one endpoint for one tenant: whether a call takes nothing
    from any budget there (`free`), until when it trusts that (time.monotonic()), and the calls
    and tokens it settled there that the rows do not count yet."""

    free: bool = False
    until: float = 0.0
    requests: int = 0
    tokens: int = 0


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
            "booked": "its turn is booked",
            "tokens": "its tokens a minute are spent",
            "interactive_share": "what is left of its minute is held for interactive calls",
            "tenant_requests": "the tenant's requests a minute on it are spent",
            "tenant_tokens": "the tenant's tokens a minute on it are spent",
            "tenant_booked": "its turn within the tenant's limit is booked",
        }.get(self.short_of, self.short_of)
        return f"waiting for capacity on {self.endpoint}: {what}"


@dataclass(frozen=True)
class TenantModelLimits:
    """A tenant's own limits on one endpoint, or on every endpoint (`endpoint` EVERY_ENDPOINT):
    requests and tokens a minute (None: none of its own there)."""

    tenant_id: str
    endpoint: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    requests_used: int = 0
    tokens_used: int = 0
    waits: int = 0
    updated_at: datetime | None = None

    def to_document(self) -> dict[str, JSON]:
        return {
            "endpoint": self.endpoint or None,
            "requests_per_minute": self.requests_per_minute,
            "tokens_per_minute": self.tokens_per_minute,
            "requests_used": self.requests_used,
            "tokens_used": self.tokens_used,
            "waits": self.waits,
            "updated_at": None if self.updated_at is None else self.updated_at.isoformat(),
        }

    @classmethod
    def from_row(cls, row: RowMapping | Mapping[str, Any]) -> TenantModelLimits:
        return cls(
            tenant_id=row["tenant_id"],
            endpoint=row["endpoint"],
            requests_per_minute=row["requests_per_minute"],
            tokens_per_minute=row["tokens_per_minute"],
            requests_used=int(row.get("requests_used") or 0),
            tokens_used=int(row.get("tokens_used") or 0),
            waits=int(row.get("waits") or 0),
            updated_at=row.get("updated_at"),
        )


@dataclass(frozen=True)
class TenantHold:
    """One tenant on one endpoint: what its calls hold of the budget now (in flight, booked
    on the endpoint, booked on its own limit), what they used (settled), how often its own
    limit made one wait, and its limits there (its own on the endpoint, else its own on every
    endpoint; None: none of its own, the endpoint's budget alone)."""

    tenant_id: str
    reservations: int = 0
    reserved_tokens: int = 0
    booked: int = 0
    booked_tokens: int = 0
    tenant_booked: int = 0
    tenant_booked_tokens: int = 0
    requests_used: int = 0
    tokens_used: int = 0
    waits: int = 0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def to_document(self) -> dict[str, JSON]:
        return {
            "tenant_id": self.tenant_id,
            "reservations": self.reservations,
            "reserved_tokens": self.reserved_tokens,
            "booked": self.booked,
            "booked_tokens": self.booked_tokens,
            "tenant_booked": self.tenant_booked,
            "tenant_booked_tokens": self.tenant_booked_tokens,
            "requests_used": self.requests_used,
            "tokens_used": self.tokens_used,
            "waits": self.waits,
            "limits": {
                "requests_per_minute": self.requests_per_minute,
                "tokens_per_minute": self.tokens_per_minute,
            },
        }

    @classmethod
    def from_row(cls, row: RowMapping | Mapping[str, Any]) -> TenantHold:
        return cls(
            tenant_id=row["tenant_id"],
            reservations=int(row["reservations"]),
            reserved_tokens=int(row["reserved_tokens"]),
            booked=int(row["booked"]),
            booked_tokens=int(row["booked_tokens"]),
            tenant_booked=int(row["tenant_booked"]),
            tenant_booked_tokens=int(row["tenant_booked_tokens"]),
            requests_used=int(row["requests_used"]),
            tokens_used=int(row["tokens_used"]),
            waits=int(row["tenant_waits"]),
            requests_per_minute=_first(
                row["requests_per_minute"], row["every_requests_per_minute"]
            ),
            tokens_per_minute=_first(row["tokens_per_minute"], row["every_tokens_per_minute"]),
        )


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
    provider_rpm: int | None = None
    provider_tpm: int | None = None
    booked: int = 0
    booked_tokens: int = 0
    tenants: tuple[TenantHold, ...] = ()

    def to_document(self, defaults: BudgetDefaults) -> dict[str, JSON]:
        """JSON-ready: the overrides, what applies (null: unlimited) and the figures."""
        return {
            "endpoint": self.endpoint,
            "overrides": {
                "requests_per_minute": self.requests_per_minute,
                "tokens_per_minute": self.tokens_per_minute,
            },
            "effective": {
                "requests_per_minute": _least(
                    _first(self.requests_per_minute, defaults.requests_per_minute),
                    self.provider_rpm,
                ),
                "tokens_per_minute": _least(
                    _first(self.tokens_per_minute, defaults.tokens_per_minute), self.provider_tpm
                ),
            },
            "provider": {
                "requests_per_minute": self.provider_rpm,
                "tokens_per_minute": self.provider_tpm,
            },
            "paused_until": None if self.paused_until is None else self.paused_until.isoformat(),
            "requests_used": self.requests_used,
            "tokens_used": self.tokens_used,
            "waits": self.waits,
            "pauses": self.pauses,
            "reservations": self.reservations,
            "reserved_tokens": self.reserved_tokens,
            "booked": self.booked,
            "booked_tokens": self.booked_tokens,
            "tenants": [t.to_document() for t in self.tenants],
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
            provider_rpm=row.get("provider_rpm"),
            provider_tpm=row.get("provider_tpm"),
            booked=int(row.get("booked") or 0),
            booked_tokens=int(row.get("booked_tokens") or 0),
        )


def _first(override: int | None, default: int | None) -> int | None:
    return override if override is not None else default


def _least(a: int | None, b: int | None) -> int | None:
    """The lower of two limits, None being no limit (as SQL's least ignores a NULL)."""
    return b if a is None else a if b is None else min(a, b)


@dataclass(frozen=True)
class ProviderLimits:
    """What a provider's rate-limit headers said with an answer (None: not said): its limits
    a minute, and what remains of them now."""

    limit_requests: int | None = None
    limit_tokens: int | None = None
    remaining_requests: float | None = None
    remaining_tokens: float | None = None

    def said(self) -> bool:
        return any(
            v is not None
            for v in (
                self.limit_requests,
                self.limit_tokens,
                self.remaining_requests,
                self.remaining_tokens,
            )
        )


class ModelBudgets:
    """The endpoints' budgets and reservations, on the queue's engine and clock."""

    def __init__(self, queue: Queue, defaults: BudgetDefaults | None = None) -> None:
        self.queue = queue
        self.defaults = defaults or BudgetDefaults()
        # (endpoint, tenant) -> what this process knows of it (the unlimited path, `reserve`).
        self._known: dict[tuple[str, str], _Unlimited] = {}
        self._asking: dict[tuple[str, str], asyncio.Lock] = {}

    # --- the admin's ------------------------------------------------------------------------
    async def get_budget(self, endpoint: str) -> ModelBudget:
        """The endpoint's overrides and figures (all None and 0 when it was never used)."""
        endpoint = check_endpoint(endpoint)
        rows = await budget_rows.figures(self.queue.engine, endpoint)
        return ModelBudget.from_row(rows[0]) if rows else ModelBudget(endpoint)

    async def budgets(self) -> list[ModelBudget]:
        """Every endpoint that has a budget row (used, or given an override), by key, with
        what each tenant's calls hold of it now."""
        holds: dict[str, list[TenantHold]] = {}
        for row in await budget_rows.tenant_figures(self.queue.engine):
            holds.setdefault(row["endpoint"], []).append(TenantHold.from_row(row))
        return [
            replace(budget, tenants=tuple(holds.get(budget.endpoint, ())))
            for budget in (
                ModelBudget.from_row(row)
                for row in await budget_rows.figures(self.queue.engine, None)
            )
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

    async def tenant_budgets(self, tenant_id: str) -> list[TenantModelLimits]:
        """The tenant's limits and totals on each endpoint it has a row of (its limits on
        every endpoint first, endpoint EVERY_ENDPOINT), by endpoint."""
        tenant_id = check_tenant(tenant_id)
        rows = await budget_rows.tenant_limits(self.queue.engine, tenant_id)
        return [TenantModelLimits.from_row(row) for row in rows]

    async def set_tenant_budget(
        self,
        tenant_id: str,
        endpoint: str | None,
        *,
        requests_per_minute: int | Keep | None = KEEP,
        tokens_per_minute: int | Keep | None = KEEP,
    ) -> TenantModelLimits:
        """Validate and upsert a tenant's limits on an endpoint (None: on every endpoint, where
        it has none of its own on the endpoint); None returns a value to that (or to no limit
        of the tenant's), KEEP leaves it. Every process's next reservation sees it.
        InvalidLimitsError names the first bad field."""
        tenant_id = check_tenant(tenant_id)
        key = EVERY_ENDPOINT if endpoint is None else check_endpoint(endpoint)
        for name, value in (
            ("requests_per_minute", requests_per_minute),
            ("tokens_per_minute", tokens_per_minute),
        ):
            if not isinstance(value, Keep) and value is not None:
                check_per_minute(name, value)
        row = await budget_rows.upsert_tenant_budget(
            self.queue.engine,
            {
                "endpoint": key,
                "tenant_id": tenant_id,
                "now": self.queue.clock(),
                "requests_per_minute": (
                    None if isinstance(requests_per_minute, Keep) else requests_per_minute
                ),
                "keep_rpm": isinstance(requests_per_minute, Keep),
                "tokens_per_minute": (
                    None if isinstance(tokens_per_minute, Keep) else tokens_per_minute
                ),
                "keep_tpm": isinstance(tokens_per_minute, Keep),
            },
        )
        return TenantModelLimits.from_row(row)

    # --- a model call's ---------------------------------------------------------------------
    async def reserve(
        self, lease: Lease, endpoint: str, tokens: int, *, tenant_id: str | None = None
    ) -> Reservation | CapacityShort | Fenced:
        """Take one request and `tokens` from the endpoint's budget for the run holding
        `lease`, in one short fenced transaction; or, when the endpoint has no limit for the
        run's tenant (`tenant_id`) and is not paused, hold nothing (the unlimited path)."""
        if tenant_id is not None and await self._unlimited(endpoint, tenant_id):
            return Reservation(id=None, endpoint=endpoint, tokens=0, tenant_id=tenant_id)
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
                "interactive_share": self.defaults.interactive_share,
                "booking_grace": BOOKING_GRACE_SECONDS,
                "now": self.queue.clock(),
            },
        )
        if row is None:
            return Fenced(lease)
        if row["granted"]:
            return Reservation(
                id=row["reservation_id"],
                endpoint=endpoint,
                tokens=int(row["tokens"]),
                tenant_id=row["tenant_id"],
                tenant_tokens=row["tenant_tokens"],
            )
        return CapacityShort(
            endpoint=endpoint,
            short_of=str(row["short_of"]),
            wait_seconds=float(row["wait_seconds"]),
            ready_at=row["ready_at"],
        )

    async def _unlimited(self, endpoint: str, tenant_id: str) -> bool:
        """Whether a call of the tenant to the endpoint takes nothing from any budget: no budget
        (the endpoint's own, the defaults, or the provider's stated limits), no pause,
        and no limit of the tenant's there. Every reservation of a limited endpoint
        takes its row's lock, so every process's calls to it take turns; an unlimited
        endpoint's calls need none of that. This process asks the database
        (`model_budget_free`, which also adds the calls and tokens it settled there
        since) at most once per `unlimited_trust_seconds` (1 s) per endpoint and
        tenant, and trusts the answer meanwhile: a budget an admin sets, a tenant's
        limit, the provider's stated limits or another process's 429 pause apply to its
        calls within that time (its own 429 or provider headers at once: `pause` and
        `observe` forget what it knew)."""
        if self.defaults.requests_per_minute is not None or (
            self.defaults.tokens_per_minute is not None
        ):
            return False  # every endpoint has a budget
        key = (endpoint, tenant_id)
        known = self._known.get(key)
        if known is not None and known.until > time.monotonic():
            return known.free
        async with self._asking.setdefault(key, asyncio.Lock()):
            known = self._known.setdefault(key, _Unlimited())
            if known.until > time.monotonic():
                return known.free  # another call of this process asked meanwhile
            requests, tokens = known.requests, known.tokens
            free = await budget_rows.free(
                self.queue.engine,
                {
                    "endpoint": endpoint,
                    "tenant_id": tenant_id,
                    "requests": requests,
                    "tokens": tokens,
                    "now": self.queue.clock(),
                },
            )
            known.requests -= requests  # counted now; what settled meanwhile stays to add
            known.tokens -= tokens
            known.free = free
            known.until = time.monotonic() + self.defaults.unlimited_trust_seconds
            return free

    def _forget(self, endpoint: str) -> None:
        """This process learned the endpoint may be limited now (a pause, the provider's
        headers): its next calls ask again."""
        for key, known in self._known.items():
            if key[0] == endpoint:
                known.until = 0.0

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """The call is over: its reservation replaced by the tokens the provider reported.
        A call of the unlimited path is only counted, with this process's next question."""
        if reservation.id is None:
            assert reservation.tenant_id is not None
            known = self._known.setdefault(
                (reservation.endpoint, reservation.tenant_id), _Unlimited()
            )
            known.requests += 1
            known.tokens += max(0, min(int(used_tokens), MAX_INT))
            return
        await budget_rows.settle(
            self.queue.engine,
            {
                "reservation_id": reservation.id,
                "endpoint": reservation.endpoint,
                "tenant_id": reservation.tenant_id,
                "used_tokens": max(0, min(int(used_tokens), MAX_INT)),
                "default_tpm": self.defaults.tokens_per_minute,
                "now": self.queue.clock(),
            },
        )
        await self.wake(reservation.endpoint)

    async def wake(self, endpoint: str) -> None:
        """Make the runs of bookings that came due early (tokens given back) eligible now."""
        await budget_rows.wake(
            self.queue.engine,
            {
                "endpoint": endpoint,
                "limit": WAKE_BATCH,
                "booking_grace": BOOKING_GRACE_SECONDS,
                "now": self.queue.clock(),
            },
        )

    async def observe(self, endpoint: str, limits: ProviderLimits) -> None:
        """The provider's rate-limit headers, for every process: its limits become the
        budget's ceiling, what it says remains lowers the buckets to it."""
        if not limits.said():
            return
        self._forget(endpoint)
        await budget_rows.observe(
            self.queue.engine,
            {
                "endpoint": endpoint,
                "limit_requests": _bounded(limits.limit_requests),
                "limit_tokens": _bounded(limits.limit_tokens),
                "remaining_requests": limits.remaining_requests,
                "remaining_tokens": limits.remaining_tokens,
                "default_rpm": self.defaults.requests_per_minute,
                "default_tpm": self.defaults.tokens_per_minute,
                "now": self.queue.clock(),
            },
        )

    async def pause(self, endpoint: str, seconds: float) -> datetime:
        """Stop every process's reservations for the endpoint for `seconds` (a provider's
        Retry-After, at most MAX_PAUSE_SECONDS); when the pause ends."""
        seconds = min(max(float(seconds), 0.0), MAX_PAUSE_SECONDS)
        self._forget(endpoint)
        row = await budget_rows.pause(
            self.queue.engine,
            {"endpoint": endpoint, "seconds": seconds, "now": self.queue.clock()},
        )
        paused_until: datetime = row["paused_until"]
        return paused_until


def _bounded(limit: int | None) -> int | None:
    return None if limit is None or limit < 1 else min(limit, MAX_INT)


def check_endpoint(endpoint: object) -> str:
    if not isinstance(endpoint, str) or not endpoint.strip():
        raise InvalidLimitsError("endpoint", "must be a non-empty string")
    if len(endpoint) > MAX_ENDPOINT_LENGTH:
        raise InvalidLimitsError("endpoint", f"must be at most {MAX_ENDPOINT_LENGTH} characters")
    if any(ch.isspace() or not ch.isprintable() for ch in endpoint):
        raise InvalidLimitsError("endpoint", "must not contain spaces or control characters")
    return endpoint


def check_tenant(tenant_id: object) -> str:
    """The tenant's normalised name (app/vocabulary/names.py), or InvalidLimitsError."""
    if not isinstance(tenant_id, str):
        raise InvalidLimitsError("tenant", "must be a string")
    try:
        return tenant_name(tenant_id)
    except InvalidNameError as exc:
        raise InvalidLimitsError("tenant", exc.reason) from None


def check_per_minute(name: str, value: object) -> None:
    # bool is an int to Python, never a budget to a person.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidLimitsError(name, "must be a whole number")
    if not 1 <= value <= MAX_INT:
        raise InvalidLimitsError(name, f"must be between 1 and {MAX_INT}")
