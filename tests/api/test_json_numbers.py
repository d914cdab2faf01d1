"""Numbers beyond 64 bits in JSON (issue 40, item 6).

jsonb keeps a number's exact decimal value, so `1e308` comes back from PostgreSQL as a 309-digit
integer, and `2**80` as itself: numbers the JSON renderer (orjson, 64-bit integers at most)
refused. A run carrying one was committed, then `POST /runs` answered 500 (a retry without an
`Idempotency-Key` made a second run), and every later read of it answered 500. Now:

- the API refuses numbers whose magnitude reaches 2**63 in inputs, before anything is written
  (a retry is refused the same way and makes nothing);
- a stored run that holds one anyway (written before this check, or by an agent or a tool)
  renders everywhere the API shows it.
"""

from __future__ import annotations

import json
from typing import Any
from uuid import UUID

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.api.json_responses import FastJSONResponse
from app.api.schemas import storable_json
from app.vocabulary.records import NewRun
from tests.support.api import running_api

BEYOND = [
    "1.6775841459608994e+172",
    "1e308",
    str(2**80),
    str(2**64),
    str(2**63),
    "-1e20",
    str(-(2**63) - 1),
    "9.3e18",
]
WITHIN = [str(2**63 - 1), str(-(2**63)), "9.2e18", "1e-300", "-0.5", "0"]
WRITTEN = ("runs", "run_events", "run_inputs", "sessions", "idempotency_keys", "schedules")


async def _counts(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        return {
            table: int((await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar_one())
            for table in WRITTEN
        }


def _body(number: str) -> bytes:
    # Written by hand: json.dumps would turn a float literal into Python's spelling of it.
    return f'{{"input": {{"deep": [1, {{"n": {number}}}]}}}}'.encode()


@pytest.mark.parametrize("number", BEYOND)
async def test_a_number_beyond_64_bits_is_refused_before_anything_is_written(
    database_url: str, engine: AsyncEngine, number: str
) -> None:
    async with running_api(database_url, engine) as api:
        client = await api.client("acme", "ops", "operator")
        session = (await client.post("/sessions")).json()["id"]
        before = await _counts(engine)
        for path in ("/runs", f"/sessions/{session}/turns", "/schedules"):
            body = _body(number)
            if path == "/schedules":
                body = body[:-1] + b', "cron": "0 3 * * *"}'
            # The client's retry, without an Idempotency-Key, is refused the same way.
            for _attempt in range(2):
                response = await client.post(
                    path, content=body, headers={"Content-Type": "application/json"}
                )
                assert response.status_code == 422, (path, response.text)
                problem = response.json()
                assert problem["type"] == "/problems/invalid-request"
                assert "input.deep[1].n" in problem["detail"], problem
                assert "64" in problem["detail"], problem
        assert await _counts(engine) == before


@pytest.mark.parametrize("number", WITHIN)
async def test_numbers_within_64_bits_are_taken_and_render(
    database_url: str, engine: AsyncEngine, number: str
) -> None:
    async with running_api(database_url, engine) as api:
        client = await api.client()
        response = await client.post(
            "/runs", content=_body(number), headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 202, response.text
        stored = (await client.get(response.headers["location"])).json()["input"]
        assert stored["deep"][1]["n"] == json.loads(number)


def test_the_check_names_where_the_number_is() -> None:
    with pytest.raises(ValueError, match=r"input\.a\[2\]: numbers must lie within"):
        storable_json({"a": [0, 1, 2**70]})
    with pytest.raises(ValueError, match=r"input\.b"):
        storable_json({"b": -1e19})
    assert storable_json({"a": [2**63 - 1, -(2**63), 1e-300, 1.5]}) is not None


def test_the_renderer_renders_integers_beyond_64_bits_exactly() -> None:
    body = FastJSONResponse({"n": 2**80, "m": [10**308]}).body
    assert json.loads(body) == {"n": 2**80, "m": [10**308]}
    # The fast path stays the fast path: what orjson takes, it renders.
    assert FastJSONResponse({"n": 2**63 - 1}).body == b'{"n":9223372036854775807}'


async def test_a_stored_run_with_a_number_beyond_64_bits_renders_everywhere(
    database_url: str, engine: AsyncEngine
) -> None:
    """As a database written before the check holds it, or as an agent's result can."""
    huge: dict[str, Any] = {"n": 2**80, "f": 10**308}
    async with running_api(database_url, engine) as api:
        client = await api.client("acme", "alice")
        session = (await client.post("/sessions")).json()["id"]
        run = await api.queue.enqueue(
            NewRun(
                tenant_id="acme",
                principal="alice",
                agent="scripted",
                input=huge,
                priority=0,
                session_id=UUID(session),
            )
        )
        async with engine.begin() as conn:
            await conn.execute(
                text("UPDATE runs SET result = CAST(:result AS jsonb) WHERE id = :id"),
                {"result": json.dumps(huge), "id": run.id},
            )
            await conn.execute(
                text(
                    "UPDATE run_events SET data = data || CAST(:extra AS jsonb) WHERE run_id = :id"
                ),
                {"extra": json.dumps(huge), "id": run.id},
            )
        reads = [
            f"/runs/{run.id}",
            f"/runs/{run.id}?wait=0.2&status=queued",
            f"/runs/{run.id}/events",
            f"/sessions/{session}/runs",
            f"/sessions/{session}/messages",
        ]
        for path in reads:
            response = await client.get(path)
            assert response.status_code == 200, (path, response.text)
            assert str(2**80) in response.text, path
        document = (await client.get(f"/runs/{run.id}")).json()
        assert document["input"] == huge
        assert document["result"] == huge
        cancelled = await client.post(f"/runs/{run.id}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["input"] == huge
