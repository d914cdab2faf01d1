"""Cron expressions in IANA time zones (app/queue/cron.py), pure: five and six fields, refused
expressions and zones, and the daylight-saving rules (a skipped wall time fires when the gap
ends; a repeated one fires once, at its first occurrence)."""

from __future__ import annotations

from datetime import UTC, datetime
from itertools import pairwise

import pytest

from app.queue.cron import CronSchedule, InvalidCronError


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


def test_five_fields_fire_on_the_minute() -> None:
    schedule = CronSchedule.parse("*/15 * * * *")
    assert schedule.upcoming(at("2030-01-01T10:07:30+00:00"), 3) == [
        at("2030-01-01T10:15:00+00:00"),
        at("2030-01-01T10:30:00+00:00"),
        at("2030-01-01T10:45:00+00:00"),
    ]


def test_six_fields_take_seconds_first() -> None:
    schedule = CronSchedule.parse("*/2 * * * * *")
    assert schedule.with_seconds
    assert schedule.upcoming(at("2030-01-01T10:00:00.5+00:00"), 3) == [
        at("2030-01-01T10:00:02+00:00"),
        at("2030-01-01T10:00:04+00:00"),
        at("2030-01-01T10:00:06+00:00"),
    ]
    # "At second 30 of minute 5 of every hour", not "minute 30 of hour 5".
    assert CronSchedule.parse("30 5 * * * *").next_after(at("2030-01-01T10:00:00+00:00")) == at(
        "2030-01-01T10:05:30+00:00"
    )


def test_next_after_is_strictly_after() -> None:
    schedule = CronSchedule.parse("0 * * * *")
    assert schedule.next_after(at("2030-01-01T10:00:00+00:00")) == at("2030-01-01T11:00:00+00:00")


def test_the_fields_are_read_in_the_time_zone() -> None:
    schedule = CronSchedule.parse("0 9 * * *", "Asia/Tokyo")
    assert schedule.next_after(at("2029-12-31T12:00:00+00:00")) == at("2030-01-01T09:00:00+09:00")


@pytest.mark.parametrize(
    ("expression", "timezone", "field"),
    [
        ("* * *", "UTC", "cron"),
        ("* * * * * * *", "UTC", "cron"),
        ("61 * * * *", "UTC", "cron"),
        ("@daily", "UTC", "cron"),
        ("0 0 30 2 *", "UTC", "cron"),  # 30 February: never fires
        ("not cron at all", "UTC", "cron"),
        ("* * * * *", "Mars/Olympus_Mons", "timezone"),
        ("* * * * *", "../../etc/passwd", "timezone"),
        ("* * * * *", "", "timezone"),
        ("* * * * *", " UTC", "timezone"),
    ],
)
def test_bad_expressions_and_zones_are_refused_naming_the_field(
    expression: str, timezone: str, field: str
) -> None:
    with pytest.raises(InvalidCronError) as refused:
        CronSchedule.parse(expression, timezone)
    assert refused.value.field == field


# New York, 2026: clocks jump 02:00 -> 03:00 on 8 March and fall 02:00 -> 01:00 on 1 November.
NEW_YORK = "America/New_York"


def test_a_wall_time_in_the_spring_gap_fires_when_the_gap_ends() -> None:
    nightly = CronSchedule.parse("30 2 * * *", NEW_YORK)
    fires = nightly.upcoming(at("2026-03-07T12:00:00+00:00"), 3)
    assert fires == [
        at("2026-03-08T03:00:00-04:00"),  # 02:30 does not exist that day: 03:00, the gap's end
        at("2026-03-09T02:30:00-04:00"),
        at("2026-03-10T02:30:00-04:00"),
    ]


def test_several_wall_times_in_one_gap_fire_once_together() -> None:
    every_20_minutes = CronSchedule.parse("*/20 * * * *", NEW_YORK)
    fires = every_20_minutes.upcoming(at("2026-03-08T01:30:00-05:00"), 4)
    assert fires == [
        at("2026-03-08T01:40:00-05:00"),
        at("2026-03-08T03:00:00-04:00"),  # 02:00, 02:20, 02:40 and 03:00, once
        at("2026-03-08T03:20:00-04:00"),
        at("2026-03-08T03:40:00-04:00"),
    ]


def test_a_repeated_wall_time_fires_once_at_its_first_occurrence() -> None:
    nightly = CronSchedule.parse("30 1 * * *", NEW_YORK)
    fires = nightly.upcoming(at("2026-10-31T12:00:00+00:00"), 2)
    assert fires == [
        at("2026-11-01T01:30:00-04:00"),  # the first 01:30 (daylight time); not the second
        at("2026-11-02T01:30:00-05:00"),
    ]


def test_the_repeated_hour_runs_once_then_is_silent() -> None:
    every_20_minutes = CronSchedule.parse("*/20 * * * *", NEW_YORK)
    fires = every_20_minutes.upcoming(at("2026-11-01T01:30:00-04:00"), 3)
    assert fires == [
        at("2026-11-01T01:40:00-04:00"),
        # 01:00, 01:20, 01:40 of the second pass already fired in the first: next is 02:00.
        at("2026-11-01T02:00:00-05:00"),
        at("2026-11-01T02:20:00-05:00"),
    ]
    # Asked from inside the second pass, the same rule holds.
    assert every_20_minutes.next_after(at("2026-11-01T01:10:00-05:00")) == at(
        "2026-11-01T02:00:00-05:00"
    )


def test_fire_times_always_increase_across_a_year_of_transitions() -> None:
    hourly = CronSchedule.parse("15 * * * *", "Europe/London")
    fires = hourly.upcoming(at("2026-01-01T00:00:00+00:00"), 24 * 365)
    assert all(a < b for a, b in pairwise(fires))
    # Never two fires for one wall time: spring's 01:15 fires at 02:00, autumn's second
    # 01:15 not at all.
    assert len({f.astimezone(hourly.zone).replace(tzinfo=None) for f in fires}) == len(fires)
