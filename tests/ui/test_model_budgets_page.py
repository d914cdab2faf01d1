"""The dashboard's model budgets page (/ui/model-budgets) over HTTP: admin keys only (a budget
is every tenant's, as GET /model-budgets); each endpoint's effective rate, override, pause,
calls in flight and booked, and per tenant its holds, use and own limits, as the core has
them; an empty page says so."""

from __future__ import annotations

import re

from sqlalchemy.ext.asyncio import AsyncEngine

from app.queue.model_budgets import BudgetDefaults, CapacityShort, ModelBudgets, Reservation
from app.vocabulary.classes import PriorityClass
from app.vocabulary.records import NewRun
from tests.support.api import running_api
from tests.ui.test_dashboard_pages_http import signed_in

ENDPOINT = "gpt-4o-mini@https://api.openai.com/v1"


def text_of(html: str, testid: str) -> list[str]:
    """The text of every element with this data-testid, tags stripped."""
    found = re.findall(rf'data-testid="{testid}"[^>]*>(.*?)</(?:dd|td|span|p)>', html, re.S)
    return [re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", f)).strip() for f in found]


async def test_the_model_budgets_page_shows_each_budget_and_its_tenants(
    database_url: str, engine: AsyncEngine
) -> None:
    async with running_api(database_url, engine) as api:
        admin = await signed_in(api, await api.key("platform", "root", "admin"))
        empty = await admin.get("/ui/model-budgets")
        assert empty.status_code == 200, empty.text
        assert 'data-testid="no-budgets"' in empty.text

        budgets = ModelBudgets(api.queue, BudgetDefaults())
        await budgets.set_budget(ENDPOINT, requests_per_minute=2, tokens_per_minute=90_000)
        await budgets.set_tenant_budget("acme", ENDPOINT, tokens_per_minute=5000)
        await budgets.set_tenant_budget("acme", None, requests_per_minute=40)
        for tenant in ("acme", "acme", "globex"):
            await api.queue.enqueue(
                NewRun(tenant_id=tenant, principal="p", agent="openai", input={}, priority=10)
            )
        held = await api.queue.claim("w", list(PriorityClass), limit=3)
        assert len(held) == 3
        outcomes = [await budgets.reserve(run.lease, ENDPOINT, 100) for run in held]
        assert [type(o) for o in outcomes] == [Reservation, Reservation, CapacityShort]
        first = outcomes[0]
        assert isinstance(first, Reservation)
        await budgets.settle(first, 70)
        await budgets.pause(ENDPOINT, 600)

        page = await admin.get("/ui/model-budgets")
        assert page.status_code == 200, page.text
        html = page.text
        assert f'data-budget="{ENDPOINT}"' in html
        assert text_of(html, "budget-state") == ["paused"]
        assert text_of(html, "effective") == ["2 requests, 90,000 tokens a minute"]
        assert text_of(html, "in-flight") == ["1 calls holding 100 tokens"]
        assert text_of(html, "booked") == ["1 calls waiting their turn, 100 tokens taken"]
        assert text_of(html, "used")[0].startswith("1 calls, 70 tokens")
        assert "until " in text_of(html, "paused-until")[0]
        rows = dict(
            re.findall(
                r'data-tenant="([^"]+)">.*?data-testid="tenant-limits">(.*?)</td>', html, re.S
            )
        )
        assert re.sub(r"<[^>]+>", "", rows["acme"]) == "40 requests, 5,000 tokens"
        assert "none" in rows["globex"]
        used = text_of(html, "tenant-used")
        assert "1 calls, 70 tokens" in used
        assert 'href="/ui/model-budgets"' in html  # in the admin's navigation

        # Not for keys without the admin scope, nor in their navigation.
        operator = await signed_in(api, await api.key("acme", "ops", "operator"))
        refused = await operator.get("/ui/model-budgets")
        assert refused.status_code == 403
        assert "Model budgets need the admin scope." in refused.text
        assert 'href="/ui/model-budgets"' not in (await operator.get("/ui")).text
