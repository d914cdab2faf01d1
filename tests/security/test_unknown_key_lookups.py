"""What a wrong API key costs (issue 40, item 8): every unknown key was a database round trip
(843 transactions for 1,000 random keys). Now a string that cannot be a key (keys are `ts_` and
43 URL-safe base64 characters) is refused before any statement, and a well-formed unknown key
is remembered as unknown for a few seconds, as known keys are remembered as known.

Statements are counted on the API's own engine (a SQLAlchemy event on its connections), so
the figures are exact whatever else the database does.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from app.security.api_keys import KEY_PREFIX, looks_like_key
from tests.support.api import Api, running_api

RANDOM_KEYS = 1_000


@contextmanager
def counted(api: Api) -> Iterator[list[str]]:
    """The statements the API process runs while the block runs."""
    assert api.app is not None
    engine = api.app.state.turnstile.engine.sync_engine
    seen: list[str] = []

    def record(*args: Any) -> None:
        seen.append(str(args[2]))

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


async def _unauthorized(client: httpx.AsyncClient, key: str) -> None:
    response = await client.get("/queue/stats", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 401, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert response.headers["www-authenticate"].startswith("Bearer ")


def test_the_shape_of_a_key() -> None:
    made = KEY_PREFIX + secrets.token_urlsafe(32)
    assert looks_like_key(made)
    for wrong in (
        "",
        "ts_",
        made[:-1],
        made + "A",
        made.replace("ts_", "tz_"),
        made[:-1] + "=",
        made[:-1] + "/",
        made[:-1] + "\u0661",  # a digit of another script
        secrets.token_hex(23),
        "x" * 5_000,
    ):
        assert not looks_like_key(wrong), wrong


async def test_strings_that_cannot_be_keys_cost_no_statement(
    database_url: str, engine: AsyncEngine
) -> None:
    async with (
        running_api(database_url, engine) as api,
        httpx.AsyncClient(base_url=api.base, timeout=30) as client,
    ):
        with counted(api) as statements:
            for _ in range(RANDOM_KEYS):
                await _unauthorized(client, secrets.token_urlsafe(24))
        assert statements == []


async def test_an_unknown_key_costs_one_statement_while_it_is_remembered(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api:
        unknown = KEY_PREFIX + secrets.token_urlsafe(32)
        async with httpx.AsyncClient(base_url=api.base, timeout=30) as client:
            with counted(api) as statements:
                for _ in range(100):
                    await _unauthorized(client, unknown)
            assert len(statements) == 1, statements
            # A real key is still found, and then remembered too.
            key = await api.key("acme", "ops", "operator")
            with counted(api) as statements:
                for _ in range(10):
                    response = await client.get(
                        "/sessions/00000000-0000-0000-0000-000000000000",
                        headers={"Authorization": f"Bearer {key}"},
                    )
                    assert response.status_code == 404
            lookups = [s for s in statements if "api_keys" in s]
            assert len(lookups) == 1, lookups


async def test_the_dashboard_refuses_a_non_key_without_a_statement(
    database_url: str, engine: AsyncEngine
) -> None:
    async with (
        running_api(database_url, engine) as api,
        httpx.AsyncClient(base_url=api.base, timeout=30) as client,
    ):
        with counted(api) as statements:
            response = await client.post("/ui/sign-in", data={"key": "not a key at all"})
        assert response.status_code == 401
        assert "Unknown or revoked API key" in response.text
        assert statements == []
