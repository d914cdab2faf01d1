"""Tenants' limits and figures, for the admin surface, the runbook, the dashboard and the
metrics (no HTTP here).

- `TenantLimits`: an admin's overrides of one tenant's limits (`tenant_limits`): at most N
  running runs per class, a queued quota, a submission rate and burst, and its holdings: how
  many schedules and webhook endpoints it may hold and how often one of its schedules may fire
  (app/queue/holdings.py checks them). None, or a class left
  out, means the process default (`LimitDefaults`, from the environment); `effective()` merges
  the two, and None there means no limit.
- `Tenants.set_limits` validates and upserts the overrides in one statement; a change applies
  from the next claim or submission on, in every process.
- A tenant's token bucket (`app.vocabulary.records.SubmitAllowance`) is taken in the submission's
  own statement (`turnstile_submit`, app/store/functions/turnstile_submit.sql); `Submissions`
  reports it.
- `Tenants.depth`: running and queued runs per tenant and class from `tenant_class_totals`, one
  tenant or the busiest N with the rest summed, so nothing here counts runs or grows with the
  number of tenants.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import RowMapping

from app.queue.core import Queue, dump_json
from app.queue.errors import InvalidLimitsError
from app.store import tenant_rows
from app.vocabulary.classes import PriorityClass
from app.vocabulary.names import InvalidNameError, tenant_name
from app.vocabulary.records import JSON, MIN_SUBMIT_RATE

MAX_INT = 2**31 - 1
"""The columns are PostgreSQL integers."""
MIN_RATE = MIN_SUBMIT_RATE
"""Submissions a second: one a day at least. Below it a refused submission's Retry-After would
be astronomically far (1e-300 made one of 300 digits, which broke every answer of the tenant)."""
MAX_RATE = 1_000_000.0
"""Submissions a second: far above anything one tenant's bucket row can serve (each limited
submission holds it to its commit), so a larger value is a typo, not a plan."""
TOP_TENANTS = 20
"""How many tenants the admin's views and the metrics show one by one; the rest are summed."""
MAX_TOP_TENANTS = 200

MAX_COUNTED = 1_000_000
"""At most this many queued runs are counted for the per-tenant figures (one bounded
index-only scan); past it the queued figures are floors."""
"""The most a view may ask for."""

_T = TypeVar("_T")


@dataclass(frozen=True)
class LimitDefaults:
    """The process defaults every tenant without an override gets (None: no limit). The
    concurrency defaults come from TURNSTILE_TENANT_MAX_RUNNING and TURNSTILE_TENANT_MAX_QUEUED,
    the rate from TURNSTILE_SUBMIT_RATE_PER_SECOND and TURNSTILE_SUBMIT_BURST, the holdings
    from TURNSTILE_TENANT_MAX_SCHEDULES, TURNSTILE_TENANT_MAX_WEBHOOK_ENDPOINTS and
    TURNSTILE_SCHEDULE_MIN_INTERVAL_SECONDS."""

    max_running: Mapping[PriorityClass, int] = field(default_factory=dict)
    max_queued: int | None = None
    submit_rate_per_second: float | None = None
    submit_burst: int | None = None
    max_schedules: int | None = None
    max_webhook_endpoints: int | None = None
    min_schedule_interval_seconds: int | None = None


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's overrides; None (or a class not in `max_running`) is the default."""

    max_running: Mapping[PriorityClass, int] = field(default_factory=dict)
    max_queued: int | None = None
    submit_rate_per_second: float | None = None
    submit_burst: int | None = None
    max_schedules: int | None = None
    max_webhook_endpoints: int | None = None
    min_schedule_interval_seconds: int | None = None
    updated_at: datetime | None = None

    def effective(self, defaults: LimitDefaults) -> TenantLimits:
        """The limits that apply: each override, else the default (None: no limit). With a rate
        and no burst anywhere, the burst is one second's worth (at least 1), as in SQL."""
        rate = _first(self.submit_rate_per_second, defaults.submit_rate_per_second)
        burst = _first(self.submit_burst, defaults.submit_burst)
        if rate is not None and burst is None:
            burst = default_burst(rate)
        return TenantLimits(
            max_running={
                klass: value
                for klass in PriorityClass
                if (value := self.max_running.get(klass, defaults.max_running.get(klass)))
                is not None
            },
            max_queued=_first(self.max_queued, defaults.max_queued),
            submit_rate_per_second=rate,
            submit_burst=burst,
            max_schedules=_first(self.max_schedules, defaults.max_schedules),
            max_webhook_endpoints=_first(
                self.max_webhook_endpoints, defaults.max_webhook_endpoints
            ),
            min_schedule_interval_seconds=_first(
                self.min_schedule_interval_seconds, defaults.min_schedule_interval_seconds
            ),
            updated_at=self.updated_at,
        )

    def to_document(self) -> dict[str, JSON]:
        """JSON-ready; every class is listed, null where the class has no value."""
        return {
            "max_running": {klass.value: self.max_running.get(klass) for klass in PriorityClass},
            "max_queued": self.max_queued,
            "submit_rate_per_second": self.submit_rate_per_second,
            "submit_burst": self.submit_burst,
            "max_schedules": self.max_schedules,
            "max_webhook_endpoints": self.max_webhook_endpoints,
            "min_schedule_interval_seconds": self.min_schedule_interval_seconds,
        }

    @classmethod
    def from_row(cls, row: RowMapping | Mapping[str, Any]) -> TenantLimits:
        return cls(
            max_running={PriorityClass(k): int(v) for k, v in (row["max_running"] or {}).items()},
            max_queued=row["max_queued"],
            submit_rate_per_second=row["submit_rate_per_second"],
            submit_burst=row["submit_burst"],
            max_schedules=row["max_schedules"],
            max_webhook_endpoints=row["max_webhook_endpoints"],
            min_schedule_interval_seconds=row["min_schedule_interval_seconds"],
            updated_at=row["updated_at"],
        )


def _first(override: _T | None, default: _T | None) -> _T | None:
    return override if override is not None else default


def default_burst(rate: float) -> int:
    """A rate's burst when none is set: one second's worth, at least one."""
    return max(1, math.ceil(rate))


class Keep:
    """`set_limits`'s marker for "leave this column as it is"."""

    def __repr__(self) -> str:
        return "KEEP"


KEEP = Keep()


@dataclass(frozen=True)
class ClassCounts:
    running: int = 0
    queued: int = 0


@dataclass(frozen=True)
class TenantDepth:
    """A tenant's running and queued runs per class; `tenant_id` None sums every tenant
    beyond the busiest N (`other`)."""

    tenant_id: str | None
    classes: Mapping[PriorityClass, ClassCounts]

    @property
    def running(self) -> int:
        return sum(c.running for c in self.classes.values())

    @property
    def queued(self) -> int:
        return sum(c.queued for c in self.classes.values())


class Tenants:
    """The tenants' limits and figures, on the queue's engine and clock."""

    def __init__(self, queue: Queue, defaults: LimitDefaults | None = None) -> None:
        self.queue = queue
        self.defaults = defaults or LimitDefaults()

    async def get_limits(self, tenant_id: str) -> TenantLimits:
        """The tenant's overrides (all None when it has none)."""
        tenant_id = _check_tenant(tenant_id)
        row = await tenant_rows.limits_row(self.queue.engine, tenant_id)
        return TenantLimits() if row is None else TenantLimits.from_row(row)

    async def set_limits(
        self,
        tenant_id: str,
        *,
        max_running: Mapping[str, int | None] | Keep = KEEP,
        replace_classes: bool = False,
        max_queued: int | Keep | None = KEEP,
        submit_rate_per_second: float | Keep | None = KEEP,
        submit_burst: int | Keep | None = KEEP,
        max_schedules: int | Keep | None = KEEP,
        max_webhook_endpoints: int | Keep | None = KEEP,
        min_schedule_interval_seconds: int | Keep | None = KEEP,
    ) -> TenantLimits:
        """Validate and upsert the tenant's overrides. None returns a value (or a class, in
        `max_running`) to the default; KEEP leaves it as it is. `max_running` names classes to
        change (merged into the current ones), or with `replace_classes` the whole set (a class
        left out returns to the default). InvalidLimitsError names the first bad field."""
        tenant_id = _check_tenant(tenant_id)
        classes = {} if isinstance(max_running, Keep) else _checked_classes(max_running)
        if not isinstance(max_queued, Keep) and max_queued is not None:
            _check_count("max_queued", max_queued, minimum=0)
        if not isinstance(submit_rate_per_second, Keep) and submit_rate_per_second is not None:
            _check_rate(submit_rate_per_second)
        if not isinstance(submit_burst, Keep) and submit_burst is not None:
            _check_count("submit_burst", submit_burst, minimum=1)
        holdings = {
            "max_schedules": (max_schedules, 0),
            "max_webhook_endpoints": (max_webhook_endpoints, 0),
            "min_schedule_interval_seconds": (min_schedule_interval_seconds, 1),
        }
        for name, (value, minimum) in holdings.items():
            if not isinstance(value, Keep) and value is not None:
                _check_count(name, value, minimum=minimum)
        params = {
            "tenant_id": tenant_id,
            "now": self.queue.clock(),
            "max_running": dump_json(classes),
            "replace_classes": replace_classes and not isinstance(max_running, Keep),
            "max_queued": None if isinstance(max_queued, Keep) else max_queued,
            "keep_max_queued": isinstance(max_queued, Keep),
            "submit_rate_per_second": (
                None
                if isinstance(submit_rate_per_second, Keep) or submit_rate_per_second is None
                else float(submit_rate_per_second)
            ),
            "keep_submit_rate": isinstance(submit_rate_per_second, Keep),
            "submit_burst": None if isinstance(submit_burst, Keep) else submit_burst,
            "keep_submit_burst": isinstance(submit_burst, Keep),
            "max_schedules": None if isinstance(max_schedules, Keep) else max_schedules,
            "keep_max_schedules": isinstance(max_schedules, Keep),
            "max_webhook_endpoints": (
                None if isinstance(max_webhook_endpoints, Keep) else max_webhook_endpoints
            ),
            "keep_max_webhook_endpoints": isinstance(max_webhook_endpoints, Keep),
            "min_schedule_interval_seconds": (
                None
                if isinstance(min_schedule_interval_seconds, Keep)
                else min_schedule_interval_seconds
            ),
            "keep_min_schedule_interval": isinstance(min_schedule_interval_seconds, Keep),
        }
        return TenantLimits.from_row(await tenant_rows.upsert_limits(self.queue.engine, params))

    def effective(
        self, limits: TenantLimits, defaults: LimitDefaults | None = None
    ) -> TenantLimits:
        """The limits that apply to a tenant with these overrides."""
        return limits.effective(defaults or self.defaults)

    async def depth(self, *, tenant_id: str | None, top: int = TOP_TENANTS) -> list[TenantDepth]:
        """Running and queued runs per class: of `tenant_id` (an empty list when it has none),
        or of the `top` busiest tenants by queued runs, then one `tenant_id=None` entry summing
        every other tenant with work (only when there is one). Running runs are the count
        rows' (exact); queued runs are counted, at most `MAX_COUNTED` of them (past that the
        queued figures are floors)."""
        if top < 1:
            raise ValueError("top must be at least 1")
        rows = await tenant_rows.depth_rows(
            self.queue.engine, tenant_id=tenant_id, top=top, max_counted=MAX_COUNTED
        )
        classes = list(PriorityClass)
        found: dict[str | None, dict[PriorityClass, ClassCounts]] = {}
        for row in rows:
            entry = found.setdefault(row["tenant_id"], {})
            entry[classes[int(row["band"])]] = ClassCounts(
                running=int(row["running"]), queued=int(row["queued"])
            )
        return [
            TenantDepth(
                tenant_id=tenant,
                classes={klass: per_class.get(klass, ClassCounts()) for klass in PriorityClass},
            )
            for tenant, per_class in found.items()
        ]


def _check_tenant(tenant_id: str) -> str:
    """The tenant's normalised name (app/vocabulary/names.py), or InvalidLimitsError."""
    try:
        return tenant_name(tenant_id)
    except InvalidNameError as exc:
        raise InvalidLimitsError("tenant", exc.reason) from None


def _checked_classes(given: Mapping[str, int | None]) -> dict[str, int | None]:
    known = [klass.value for klass in PriorityClass]
    checked: dict[str, int | None] = {}
    for name, value in given.items():
        if name not in known:
            raise InvalidLimitsError(
                "max_running", f"unknown class {name!r} (known: {', '.join(known)})"
            )
        if value is not None:
            _check_count(f"max_running.{name}", value, minimum=0)
        checked[name] = value
    return checked


def _check_count(name: str, value: object, *, minimum: int) -> None:
    # bool is an int to Python, never a count to a person.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidLimitsError(name, "must be a whole number")
    if not minimum <= value <= MAX_INT:
        raise InvalidLimitsError(name, f"must be between {minimum} and {MAX_INT}")


def _check_rate(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidLimitsError("submit_rate_per_second", "must be a number")
    if not math.isfinite(value) or not MIN_RATE <= value <= MAX_RATE:
        raise InvalidLimitsError(
            "submit_rate_per_second",
            f"must be from {MIN_RATE:.9g} (one a day) to {MAX_RATE:g} submissions a second",
        )
