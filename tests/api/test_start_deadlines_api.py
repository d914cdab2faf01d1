"""Start deadlines over HTTP (docs/start-deadlines.md): `start_within` and `start_before` on
turns and `POST /runs`, the deadline in `GET /runs/{id}`, the class defaults from the settings,
and every refusal a 422 problem+json that writes nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.api import Api, running_api


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine) -> AsyncIterator[Api]:
    async with running_api(database_url, engine, start_within_interactive=120) as running:
        yield running


def at(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


async def runs(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text("SELECT count(*) FROM runs"))).scalar_one())


async def test_deadlines_on_turns_and_runs_show_in_the_run(api: Api) -> None:
    client = await api.client()
    session = (await client.post("/sessions")).json()["id"]
    # A turn naming none gets its class's default (TURNSTILE_START_WITHIN_INTERACTIVE).
    turn = await client.post(f"/sessions/{session}/turns", json={"input": "hi"})
    assert turn.status_code == 202, turn.text
    doc = turn.json()
    created = datetime.fromisoformat(doc["created_at"])
    assert datetime.fromisoformat(doc["start_before"]) == created + timedelta(seconds=120)
    # A sessionless run is async: no default; its own deadline, read back by GET.
    deadline = at(600)
    posted = await client.post("/runs", json={"input": {}, "start_before": deadline})
    assert posted.status_code == 202, posted.text
    read = (await client.get(f"/runs/{posted.json()['id']}")).json()
    assert datetime.fromisoformat(read["start_before"]) == datetime.fromisoformat(deadline)
    plain = await client.post("/runs", json={"input": {}})
    assert plain.json()["start_before"] is None
    within = await client.post("/runs", json={"input": {}, "start_within": 2.5})
    doc = within.json()
    assert datetime.fromisoformat(doc["start_before"]) == datetime.fromisoformat(
        doc["created_at"]
    ) + timedelta(seconds=2.5)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"start_within": -1}, "start_within"),
        ({"start_within": 0}, "start_within"),
        ({"start_within": 31 * 86400}, "start_within"),
        ({"start_within": "60"}, "start_within"),
        ({"start_within": True}, "start_within"),
        ({"start_within": 5, "start_before": at(60)}, None),
        ({"start_before": at(-3600)}, "start_before"),
        ({"start_before": at(40 * 86400)}, "start_before"),
        ({"start_before": "tomorrow"}, "start_before"),
        ({"start_before": at(60), "scheduled_for": at(120)}, "start_before"),
    ],
)
async def test_bad_deadlines_are_422_and_write_nothing(
    api: Api, body: dict[str, Any], field: str | None
) -> None:
    client = await api.client()
    session = (await client.post("/sessions")).json()["id"]
    for path in ("/runs", f"/sessions/{session}/turns"):
        refused: httpx.Response = await client.post(path, json={"input": {}, **body})
        assert refused.status_code == 422, refused.text
        assert refused.headers["content-type"].startswith("application/problem+json")
        problem = refused.json()
        assert problem["type"] == "/problems/invalid-request"
        if field is not None:
            assert problem["errors"][0]["loc"][:2] == ["body", field], problem
        else:
            assert "not both" in problem["detail"]
    assert await runs(api.engine) == 0


@pytest.mark.parametrize("policy", ["enqueue", "interrupt", "steer"])
async def test_a_turn_naming_a_multitask_policy_keeps_its_deadline_on_an_idle_session(
    api: Api, policy: str
) -> None:
    # A turn's own policy takes the turn-control path even when the session is idle: the run
    # it makes there is the same run, deadline included, as the plain turn's.
    client = await api.client()
    session = (await client.post("/sessions")).json()["id"]
    own = await client.post(
        f"/sessions/{session}/turns",
        json={"input": "hi", "multitask": policy, "start_within": 30},
    )
    assert own.status_code == 202, own.text
    doc = own.json()
    assert datetime.fromisoformat(doc["start_before"]) == datetime.fromisoformat(
        doc["created_at"]
    ) + timedelta(seconds=30)
    await client.post(f"/runs/{doc['id']}/cancel")
    # Naming none, it takes its class's default there too.
    default = await client.post(
        f"/sessions/{session}/turns", json={"input": "again", "multitask": policy}
    )
    assert default.status_code == 202, default.text
    doc = default.json()
    assert datetime.fromisoformat(doc["start_before"]) == datetime.fromisoformat(
        doc["created_at"]
    ) + timedelta(seconds=120)
    await client.post(f"/runs/{doc['id']}/cancel")
    # A deadline past the tolerance is refused there too, writing nothing.
    before = await runs(api.engine)
    late = await client.post(
        f"/sessions/{session}/turns",
        json={"input": "late", "multitask": policy, "start_before": at(-60)},
    )
    assert late.status_code == 422, late.text
    assert late.json()["errors"][0]["loc"][-1] == "start_before"
    assert await runs(api.engine) == before
