"""Start deadlines (docs/start-deadlines.md): how far off one may be, and the one check of a
deadline against the time it is given, shared by the API's bodies, the settings and the core.

A run's deadline to start is `start_within` seconds after it becomes eligible (its
`scheduled_for`, else its creation) or a time, `start_before`. A deadline in the past by more
than `START_BEFORE_TOLERANCE_SECONDS` is refused (by `turnstile_submit`, which spells the same
bound): a clock a little behind the service's should not turn a run into an error, but a
deadline long gone is a client's mistake.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

MAX_START_WITHIN_SECONDS = 30 * 24 * 3600
"""The furthest a deadline to start may lie after the run becomes eligible (30 days): a run
that may wait longer needs no deadline."""

START_BEFORE_TOLERANCE_SECONDS = 5.0
"""How far in the past a `start_before` may lie (clock skew between a client and the service);
such a run is expired at once, never started."""


def start_deadline_problem(
    *,
    start_within: float | None,
    start_before: datetime | None,
    scheduled_for: datetime | None,
    now: datetime,
) -> tuple[str, str] | None:
    """What is wrong with a run's deadline to start, as (field, message); None when nothing.
    A `start_before` in the past beyond the tolerance is refused by the database, after the
    submission's idempotency key (a late retry of an accepted submission is replayed)."""
    if start_within is not None and start_before is not None:
        return "start_before", "give start_within or start_before, not both"
    if start_within is not None and not (
        math.isfinite(start_within) and 0 < start_within <= MAX_START_WITHIN_SECONDS
    ):
        return (
            "start_within",
            f"must be a number of seconds above 0 and at most {MAX_START_WITHIN_SECONDS}",
        )
    if start_before is None:
        return None
    eligible = max(scheduled_for or now, now)
    if scheduled_for is not None and start_before <= scheduled_for:
        return "start_before", "must be after scheduled_for: the run could never start"
    if start_before > eligible + timedelta(seconds=MAX_START_WITHIN_SECONDS):
        return (
            "start_before",
            f"is more than {MAX_START_WITHIN_SECONDS} seconds after the run becomes eligible",
        )
    return None
