"""The slot layout setting: syntax, and the rule that every class must head a group."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.config import Settings
from app.runtime.outbound import ModelClient
from app.vocabulary.classes import PriorityClass
from app.vocabulary.layout import SlotLayoutError, parse_slots

INTERACTIVE, ASYNC, MAINTENANCE = PriorityClass


def test_default_layout() -> None:
    groups = parse_slots("interactive:4,async:4,maintenance:1")
    assert [(g.classes, g.size) for g in groups] == [
        ((INTERACTIVE,), 4),
        ((ASYNC,), 4),
        ((MAINTENANCE,), 1),
    ]


def test_multi_class_groups_order_by_priority_not_by_writing() -> None:
    groups = parse_slots(" maintenance:1 , async+interactive:2, interactive:1, async:1")
    shared = groups[1]
    assert shared.classes == (INTERACTIVE, ASYNC)
    assert shared.name == "interactive+async"
    assert shared.top_class == INTERACTIVE


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("interactive:4,async:4", "no slot group reserves capacity for maintenance"),
        ("interactive+async:4,maintenance:1", "no slot group reserves capacity for async"),
        ("interactive:4,batch:2", "unknown class 'batch'"),
        ("interactive:0,async:1,maintenance:1", "at least one slot"),
        ("interactive,async:1,maintenance:1", "must look like"),
        ("interactive:x,async:1,maintenance:1", "must look like"),
        ("interactive:²,async:1,maintenance:1", "must look like"),  # isdigit() but not int()
        ("interactive:1,,async:1,maintenance:1", "empty slot group"),
        ("interactive:1,interactive:2,async:1,maintenance:1", "given twice"),
    ],
)
def test_bad_layouts_are_refused(spec: str, message: str) -> None:
    with pytest.raises(SlotLayoutError, match=message):
        parse_slots(spec)


def test_settings_refuse_a_starving_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNSTILE_SLOTS", "interactive:4,async:4")
    with pytest.raises(ValidationError, match="maintenance"):
        Settings()


def test_pool_size_follows_the_statements_in_flight_not_the_slots() -> None:
    settings = Settings(slots="interactive:4,async:4,maintenance:1")
    assert settings.total_slots == 9
    # Per group a completion batch here and a claim loop on the claim engine's connections.
    assert settings.pool_size == 9 + 3 + 2
    assert settings.claim_pool_size == 3
    # Thousands of runs awaiting a model hold no connection: the pool stays small.
    big = Settings(slots="interactive:1,async:2000,maintenance:1")
    assert big.pool_size == 10 + 3 + 2
    assert big.claim_pool_size == 3
    assert Settings(db_pool_size=7).pool_size == 7
    # Behind PgBouncer claims share the pool (nothing is prepared there: app/store/engine.py).
    bounced = Settings(
        slots="interactive:4,async:4,maintenance:1",
        pgbouncer=True,
        listen_database_url="postgresql://turnstile@127.0.0.1:5432/turnstile",
    )
    assert bounced.pool_size == 9 + 2 * 3 + 2


async def test_the_model_client_gives_every_slot_a_connection() -> None:
    client = ModelClient(2000)
    try:
        assert client.session().connector is not None
        assert client.session().connector.limit == 2000
        assert client.session() is client.session()  # one pooled session for every call
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("spec", "served"),
    [
        ("async:32", [ASYNC]),
        ("interactive:2,async:2,async+interactive:2", [INTERACTIVE, ASYNC]),
        ("maintenance:1", [MAINTENANCE]),
        ("interactive:4,async:4,maintenance:1", [INTERACTIVE, ASYNC, MAINTENANCE]),
    ],
)
def test_a_partial_layout_may_leave_classes_out(spec: str, served: list[PriorityClass]) -> None:
    groups = parse_slots(spec, partial=True)
    assert sorted({k for g in groups for k in g.classes}, key=lambda k: k.base) == served
    if len(served) < len(PriorityClass):
        with pytest.raises(SlotLayoutError, match="partial layout"):
            parse_slots(spec)


def test_a_partial_layout_still_reserves_each_class_it_serves() -> None:
    # async would be served only behind interactive here: it could starve in this process.
    with pytest.raises(SlotLayoutError, match="async is served only in groups headed by"):
        parse_slots("interactive+async:4", partial=True)


def test_settings_take_a_partial_layout_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNSTILE_SLOTS", "async:32")
    with pytest.raises(ValidationError, match="TURNSTILE_PARTIAL_LAYOUT"):
        Settings()
    monkeypatch.setenv("TURNSTILE_PARTIAL_LAYOUT", "true")
    settings = Settings()
    assert [g.classes for g in settings.slot_groups] == [(ASYNC,)]
    assert settings.total_slots == 32
