"""Turn control on the dashboard over plain HTTP (issue 33 item 5; docs/turn-control.md): a
session's page shows its multitask policy, its pending turns in the order they will start and
its runs with why each cancelled one ended (interrupted, expired, a user's reason); a run's
page shows a cancelled run's reason. Real server, real database, real transitions."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from uuid import UUID

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.vocabulary.classes import PriorityClass
from tests.support.api import Api, running_api
from tests.support.clock import ManualClock


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine, clock: ManualClock) -> AsyncIterator[Api]:
    async with running_api(database_url, engine, clock=clock, interrupt_grace_seconds=5) as running:
        yield running


async def signed_in(api: Api) -> httpx.AsyncClient:
    client = httpx.AsyncClient(base_url=api.base, timeout=30)
    api.clients.append(client)
    response = await client.post("/ui/sign-in", data={"key": await api.key("acme", "alice")})
    assert response.status_code == 303, response.text
    return client


def row(page: str, attribute: str, value: str) -> str:
    """The text of the table row `<tr data-ATTRIBUTE="VALUE">`, tags dropped."""
    found = re.search(rf'<tr data-{attribute}="{value}">(.*?)</tr>', page, re.S)
    assert found is not None, f"no row {attribute}={value}"
    return " ".join(re.sub(r"<[^>]+>", " ", found.group(1)).split())


async def turn(client: httpx.AsyncClient, session: str, body: object) -> dict[str, object]:
    response = await client.post(f"/sessions/{session}/turns", json=body)
    assert response.status_code == 202, response.text
    answer: dict[str, object] = response.json()
    return answer


async def test_a_sessions_page_shows_its_turns_and_why_its_runs_were_cancelled(
    api: Api, clock: ManualClock
) -> None:
    client = await api.client()
    ui = await signed_in(api)
    session = (await client.post("/sessions", json={"multitask": "enqueue"})).json()["id"]
    first = await turn(client, session, {"input": 1})
    await api.queue.claim("test-worker", list(PriorityClass))  # the first run is running
    enqueued = await turn(client, session, {"input": 2})
    interrupting = await turn(client, session, {"input": 3, "multitask": "interrupt"})

    page = (await ui.get(f"/ui/sessions/{session}")).text
    assert '<dd data-testid="multitask">enqueue</dd>' in page
    # In start order: the interrupting turn first, then the enqueued one.
    assert page.index(f'data-turn="{interrupting["id"]}"') < page.index(
        f'data-turn="{enqueued["id"]}"'
    )
    first_row = row(page, "turn", str(interrupting["id"]))
    assert first_row.startswith("1 ")
    assert "interrupt" in first_row
    assert "pending (interrupts by" in first_row
    second_row = row(page, "turn", str(enqueued["id"]))
    assert second_row.startswith("2 ")
    assert " enqueue " in second_row
    assert second_row.endswith("pending")

    # A user's cancel, with words: the interrupting turn starts, and is interrupted in turn by
    # the next interrupt (it is only queued), which starts at once.
    cancel = await client.post(f"/runs/{first['id']}/cancel", json={"reason": "wrong question"})
    assert cancel.status_code == 200, cancel.text
    latest = await turn(client, session, {"input": 4, "multitask": "interrupt"})
    page = (await ui.get(f"/ui/sessions/{session}")).text
    assert row(page, "run", str(first["id"])).endswith("wrong question")
    assert row(page, "run", str(interrupting["id"])).endswith("interrupted")
    assert "cancelled" not in row(page, "run", str(latest["id"]))
    assert f'data-turn="{interrupting["id"]}"' not in page  # it left pending: it is a run
    assert row(page, "turn", str(enqueued["id"])).startswith("1 ")

    run_page = (await ui.get(f"/ui/runs/{first['id']}")).text
    assert re.search(r'data-testid="cancel-reason">wrong question <span', run_page), run_page
    run_page = (await ui.get(f"/ui/runs/{interrupting['id']}")).text
    assert 'data-testid="cancel-reason">interrupted' in run_page
    assert 'data-testid="cancel-reason"' not in (await ui.get(f"/ui/runs/{latest['id']}")).text

    # A run whose deadline to start passed says so, on both pages.
    other = (await client.post("/sessions")).json()["id"]
    late = await turn(client, other, {"input": 5, "start_within": 10})
    clock.advance(11)
    expired = await api.queue.expire_overdue()
    assert [run.id for run in expired] == [UUID(str(late["id"]))]
    page = (await ui.get(f"/ui/sessions/{other}")).text
    assert '<dd data-testid="multitask">reject</dd>' in page
    assert "No turn waits." in page
    assert row(page, "run", str(late["id"])).endswith("expired")
    run_page = (await ui.get(f"/ui/runs/{late['id']}")).text
    assert 'data-testid="cancel-reason">expired <span class="muted">(by expirer)' in run_page
