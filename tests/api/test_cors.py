"""CORS (TURNSTILE_CORS_ORIGINS) against the real app on loopback: off by default (no header at
all); with origins set, preflights answered for what our clients send (the key, Idempotency-Key,
Last-Event-ID), refused for other origins, no credentials ever allowed, and every answer a page
may read (a new run, a replay, a problem, a 413) carrying the headers its script needs exposed.
A real browser on another loopback origin: tests/clients/test_typescript_client.py."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from tests.support.api import Api, running_api

PAGE = "http://127.0.0.1:5173"


def preflight(method: str, origin: str, headers: str) -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": headers,
    }


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine) -> AsyncIterator[Api]:
    async with running_api(
        database_url,
        engine,
        cors_origins=f"{PAGE}, https://chat.example.com",
        submit_rate_per_second=100,
        max_body_bytes=2048,
    ) as running:
        yield running


async def test_no_cors_header_without_origins(database_url: str, engine: AsyncEngine) -> None:
    async with running_api(database_url, engine) as api:
        client = await api.client()
        answer = await client.post("/sessions", headers={"Origin": PAGE})
        assert answer.status_code == 201
        assert not [h for h in answer.headers if h.startswith("access-control-")]
        refused = await client.options(
            "/sessions", headers=preflight("POST", PAGE, "authorization")
        )
        assert refused.status_code == 405
        assert "access-control-allow-origin" not in refused.headers


async def test_preflights_allow_what_the_clients_send(api: Api) -> None:
    async with httpx.AsyncClient(base_url=api.base) as client:
        asked = "authorization,content-type,idempotency-key,last-event-id,if-none-match"
        answer = await client.options(
            "/sessions/00000000-0000-0000-0000-000000000000/turns",
            headers=preflight("POST", PAGE, asked),
        )
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == PAGE
        assert "POST" in answer.headers["access-control-allow-methods"]
        # The policies of a session change by PATCH (setMultitask, setApproval).
        patched = await client.options(
            "/sessions/00000000-0000-0000-0000-000000000000",
            headers=preflight("PATCH", PAGE, "authorization,content-type"),
        )
        assert patched.status_code == 200, patched.text
        assert "PATCH" in patched.headers["access-control-allow-methods"]
        allowed = {
            h.strip().lower() for h in answer.headers["access-control-allow-headers"].split(",")
        }
        assert set(asked.split(",")) <= allowed
        assert "access-control-allow-credentials" not in answer.headers
        assert answer.headers["access-control-max-age"] == "600"
        assert "origin" in answer.headers["vary"].lower()

        # Another origin, or a header we do not take, is refused; and no origin is echoed.
        other = await client.options(
            "/sessions", headers=preflight("POST", "http://127.0.0.1:5174", "authorization")
        )
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers
        odd = await client.options("/sessions", headers=preflight("POST", PAGE, "x-secret"))
        assert odd.status_code == 400


async def test_answers_expose_the_headers_a_page_reads(api: Api) -> None:
    client = await api.client()
    origin = {"Origin": PAGE}
    session = (await client.post("/sessions", headers=origin)).json()["id"]
    turn = {"Idempotency-Key": "turn-1", **origin}
    body = {"input": {"script": [{"final": "ok"}]}}
    first = await client.post(f"/sessions/{session}/turns", json=body, headers=turn)
    replayed = await client.post(f"/sessions/{session}/turns", json=body, headers=turn)
    assert first.status_code == replayed.status_code == 202
    for answer in (first, replayed):
        assert answer.headers["access-control-allow-origin"] == PAGE
        assert "access-control-allow-credentials" not in answer.headers
        exposed = {h.strip() for h in answer.headers["access-control-expose-headers"].split(",")}
        assert {
            "Location", "Idempotent-Replayed", "RateLimit", "RateLimit-Policy", "Retry-After",
            "ETag",
        } <= exposed  # fmt: skip
    assert replayed.headers["idempotent-replayed"] == "true"
    assert "ratelimit" in first.headers

    # Errors are readable too: a problem from the handlers, and the body limit's 413.
    missing = await client.get("/runs/00000000-0000-0000-0000-000000000000", headers=origin)
    assert missing.status_code == 404
    assert missing.headers["access-control-allow-origin"] == PAGE
    too_big = await client.post(
        "/runs", content=b'{"input": "' + b"x" * 4096 + b'"}', headers=origin
    )
    assert too_big.status_code == 413
    assert too_big.headers["access-control-allow-origin"] == PAGE
    # A page of another origin gets its answer (the server cannot know), but no CORS header,
    # so the browser keeps it from the script.
    stranger = await client.post("/sessions", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in stranger.headers


def test_origins_are_read_as_browsers_write_them() -> None:
    settings = Settings(cors_origins="HTTPS://Chat.Example.com:443/, http://127.0.0.1:5173,,")
    assert settings.cors_origin_list == ("https://chat.example.com", "http://127.0.0.1:5173")
    assert Settings(cors_origins="http://[::1]:80").cors_origin_list == ("http://[::1]",)
    assert Settings(cors_origins=" * ").cors_origin_list == ("*",)
    assert Settings().cors_origin_list == ()


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("127.0.0.1:5173", "'127.0.0.1:5173' is not an origin: write scheme://host[:port]"),
        ("https://chat.example.com/app", "is not an origin"),
        ("ftp://files.example.com", "is not an origin"),
        ("http://a:99999", "is not an origin"),
        ("http://user@a", "is not an origin"),
        ("*, https://chat.example.com", "'*' allows every origin: give it alone"),
    ],
)
def test_what_is_not_an_origin_is_refused(value: str, says: str) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(cors_origins=value)
    assert says in str(refused.value)
