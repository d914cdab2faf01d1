"""Cron expressions in IANA time zones: validation, and a schedule's fire times as UTC instants.

An expression has five fields (minute hour day-of-month month day-of-week) or six, with seconds
first (`*/2 * * * * *`: every two seconds); croniter parses and iterates it. Iteration runs on
the zone's wall clock, and each wall time is then placed on the time line by the rules below,
so a daily 02:30 job stays at 02:30 local time across daylight-saving changes:

- A wall time that does not exist (the spring-forward gap, e.g. 02:30 on a day the clocks jump
  from 02:00 to 03:00) fires at the first instant after the gap (03:00 local). Several wall
  times in one gap (a job every minute) fire once, together, at that instant.
- A wall time that happens twice (the fall-back repeat, e.g. 01:30 when the clocks go from
  02:00 back to 01:00) fires once, at its first occurrence. A job every minute therefore runs
  through the first pass of the repeated hour and is silent during the second.

Pure functions of their inputs (no clock, no database): the queue's schedule service gives
them the database's time.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, CroniterError, croniter

MAX_EXPRESSION_LENGTH = 200
MAX_TIMEZONE_LENGTH = 64
GAP_SAMPLES = 128
"""Fire times `shortest_gap` looks at (a few milliseconds of iteration)."""


class InvalidCronError(ValueError):
    """A cron expression or time zone this service refuses; `field` names which."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _zone(name: str) -> ZoneInfo:
    if not name or len(name) > MAX_TIMEZONE_LENGTH or name != name.strip():
        raise InvalidCronError("timezone", f"not an IANA time zone: {name!r}")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        # ValueError: a path-like key ("../x"); OSError: a key naming a directory.
        raise InvalidCronError("timezone", f"not an IANA time zone: {name!r}") from None


@dataclass(frozen=True)
class CronSchedule:
    """A validated cron expression in a time zone; build it with `CronSchedule.parse`."""

    expression: str
    timezone: str
    zone: ZoneInfo
    with_seconds: bool

    @classmethod
    def parse(cls, expression: str, timezone: str = "UTC") -> CronSchedule:
        """The schedule, or InvalidCronError naming the field at fault. An expression that
        can never fire (30 February) is refused too."""
        zone = _zone(timezone)
        fields = expression.split()
        if len(expression) > MAX_EXPRESSION_LENGTH or len(fields) not in (5, 6):
            raise InvalidCronError(
                "cron", "five fields (minute hour day month weekday), or six with seconds first"
            )
        normalized = " ".join(fields)
        with_seconds = len(fields) == 6
        if not croniter.is_valid(normalized, second_at_beginning=with_seconds):
            raise InvalidCronError("cron", f"not a valid cron expression: {expression!r}")
        schedule = cls(normalized, timezone, zone, with_seconds)
        try:
            schedule.next_after(datetime(2000, 1, 1, tzinfo=UTC))
        except CroniterBadDateError:
            raise InvalidCronError("cron", f"{expression!r} never fires") from None
        except CroniterError as exc:
            raise InvalidCronError("cron", str(exc)) from None
        return schedule

    def next_after(self, instant: datetime) -> datetime:
        """The first fire time strictly after `instant` (an aware datetime), in UTC."""
        wall = instant.astimezone(self.zone).replace(tzinfo=None)
        times = croniter(self.expression, wall, second_at_beginning=self.with_seconds)
        while True:
            candidate: datetime = times.get_next(datetime)
            fire = self.place(candidate)
            # Strictly later: skips wall times of a repeated hour already fired in its first
            # pass, and a gap's wall times once the gap's end has fired.
            if fire > instant:
                return fire

    def upcoming(self, after: datetime, count: int) -> list[datetime]:
        """The next `count` fire times after `after`."""
        times: list[datetime] = []
        for _ in range(count):
            after = self.next_after(after)
            times.append(after)
        return times

    def shortest_gap(
        self, after: datetime, *, below: timedelta | None = None, samples: int = GAP_SAMPLES
    ) -> timedelta | None:
        """The shortest time between two consecutive fire times among the first `samples`
        after `after` (None when it fires fewer than twice); with `below`, the first gap
        shorter than that as soon as one shows. An expression is a product of its fields'
        sets, so its shortest gap shows within the first cycles of its finest field with more
        than one value (at most 60 fire times each), crossings into the next minute or hour
        included. One iterator for all of them: a new one per fire time would parse again."""
        wall = after.astimezone(self.zone).replace(tzinfo=None)
        times = croniter(self.expression, wall, second_at_beginning=self.with_seconds)
        shortest: timedelta | None = None
        previous: datetime | None = None
        for _ in range(samples):
            try:
                fire = self.place(times.get_next(datetime))
            except CroniterBadDateError:  # no further fire time (a year field ran out)
                break
            if previous is not None and fire > previous:
                # Equal instants (several wall times of one DST gap) fire once: no gap.
                gap = fire - previous
                shortest = gap if shortest is None else min(shortest, gap)
                if below is not None and shortest < below:
                    break
            if previous is None or fire > previous:
                previous = fire
        return shortest

    def place(self, wall: datetime) -> datetime:
        """A naive wall time of the zone as a UTC instant, by the module's DST rules."""
        first = wall.replace(tzinfo=self.zone, fold=0).astimezone(UTC)
        if first.astimezone(self.zone).replace(tzinfo=None) == wall:
            return first  # exists; fold=0 is its first occurrence when it repeats
        return self._gap_end(wall)

    def _gap_end(self, wall: datetime) -> datetime:
        """The first instant whose wall time is past `wall`, a time inside a gap: the
        transition at the gap's end. Transitions fall on whole seconds, so a binary search over
        seconds between the wall time read with the earlier and the later offset finds it."""
        low = int(wall.replace(tzinfo=self.zone, fold=1).astimezone(UTC).timestamp())
        high = int(wall.replace(tzinfo=self.zone, fold=0).astimezone(UTC).timestamp()) + 1
        low, high = min(low, high), max(low, high)
        while low < high:
            middle = (low + high) // 2
            local = datetime.fromtimestamp(middle, UTC).astimezone(self.zone)
            if local.replace(tzinfo=None) > wall:
                high = middle
            else:
                low = middle + 1
        return datetime.fromtimestamp(low, UTC)
