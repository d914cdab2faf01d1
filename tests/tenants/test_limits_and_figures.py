"""Tenants' limits and figures (issue 21, items 2's admin surface and 5): `GET`/`PUT
/tenants/{tenant}/limits` (admin scope, overrides and effective values, problem+json on bad
input and nothing written), `turnstile tenants get|set` (one-line errors), and the per-tenant
running and queued figures of `GET /queue/stats`, `turnstile queue stats --by-tenant`, the
dashboard's overview and the metrics, bounded to the busiest tenants with the rest as `other`.

The per-tenant counts are seeded straight into `tenant_class_counts`: they are the source of
truth every one of these views reads (the transitions keep them; not counted from runs)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.maintenance.queue_metrics import QueueMetrics
from app.observability.metrics import Metrics
from app.queue.core import Queue
from tests.observability.test_metrics import samples
from tests.support.api import Api, running_api
from tests.support.processes import run_cli
from tests.ui.test_dashboard_http import signed_in


@pytest.fixture
async def api(database_url: str, engine: AsyncEngine) -> AsyncIterator[Api]:
    async with running_api(
        database_url, engine, submit_rate_per_second=10.0, submit_burst=None
    ) as running:
        yield running


async def cli(database_url: str, *args: str, **env: str) -> tuple[int, str, str]:
    return await run_cli(*args, env={"DATABASE_URL": database_url, **env})


def assert_problem(response: httpx.Response, status: int, slug: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["type"] == f"/problems/{slug}"
    return body


async def limits_rows(engine: AsyncEngine) -> list[tuple[Any, ...]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT tenant_id, max_running, max_queued, submit_rate_per_second, "
                "submit_burst FROM tenant_limits ORDER BY tenant_id"
            )
        )
        return [tuple(row) for row in rows]


NO_CLASSES = {"interactive": None, "async": None, "maintenance": None}
NO_HOLDINGS = {
    "max_schedules": None,
    "max_webhook_endpoints": None,
    "min_schedule_interval_seconds": None,
}


# --- the admin API ----------------------------------------------------------------------------
async def test_limits_are_read_and_replaced_by_admins(api: Api) -> None:
    admin = await api.client("platform", "sre", "admin")
    fresh = await admin.get("/tenants/acme/limits")
    assert fresh.status_code == 200
    assert fresh.json() == {
        "tenant": "acme",
        "overrides": {
            "max_running": NO_CLASSES,
            "max_queued": None,
            "submit_rate_per_second": None,
            "submit_burst": None,
            **NO_HOLDINGS,
        },
        # The process defaults: a rate of 10 with no burst set is a burst of 10; the holdings'
        # defaults (TURNSTILE_TENANT_MAX_SCHEDULES and the rest).
        "effective": {
            "max_running": NO_CLASSES,
            "max_queued": None,
            "submit_rate_per_second": 10.0,
            "submit_burst": 10,
            "max_schedules": 100,
            "max_webhook_endpoints": 20,
            "min_schedule_interval_seconds": 60,
        },
        "updated_at": None,
    }
    put = await admin.put(
        "/tenants/acme/limits",
        json={"max_running": {"async": 4, "interactive": 0}, "max_queued": 100, "submit_burst": 3},
    )
    assert put.status_code == 200, put.text
    document = put.json()
    assert document["overrides"]["max_running"] == {
        "interactive": 0,
        "async": 4,
        "maintenance": None,
    }
    assert document["effective"]["submit_rate_per_second"] == 10.0  # the default
    assert document["effective"]["submit_burst"] == 3  # the override
    assert document["updated_at"] is not None
    assert (await admin.get("/tenants/acme/limits")).json() == document

    # PUT replaces: what it leaves out returns to the default.
    replaced = (
        await admin.put("/tenants/acme/limits", json={"max_running": {"interactive": 2}})
    ).json()
    assert replaced["overrides"] == {
        "max_running": {"interactive": 2, "async": None, "maintenance": None},
        "max_queued": None,
        "submit_rate_per_second": None,
        "submit_burst": None,
        **NO_HOLDINGS,
    }
    assert await limits_rows(api.engine) == [("acme", {"interactive": 2}, None, None, None)]
    # A class set to null is the same as one left out.
    cleared = await admin.put("/tenants/acme/limits", json={"max_running": {"interactive": None}})
    assert cleared.json()["overrides"]["max_running"] == NO_CLASSES
    assert await limits_rows(api.engine) == [("acme", {}, None, None, None)]
    blank = assert_problem(await admin.get("/tenants/%20/limits"), 422, "invalid-request")
    assert blank["detail"].startswith("path.tenant: ")


@pytest.mark.parametrize(
    ("body", "where"),
    [
        pytest.param({"max_running": {"batch": 1}}, "body.max_running", id="unknown-class"),
        pytest.param({"max_running": {"async": -1}}, "body.max_running.async", id="negative"),
        pytest.param({"max_running": {"async": 1.5}}, "body.max_running.async", id="fraction"),
        pytest.param({"max_running": {"async": "4"}}, "body.max_running.async", id="string"),
        pytest.param({"max_queued": -1}, "body.max_queued", id="negative-quota"),
        pytest.param({"max_queued": True}, "body.max_queued", id="boolean"),
        pytest.param({"submit_rate_per_second": 0}, "body.submit_rate_per_second", id="zero"),
        pytest.param({"submit_rate_per_second": -2.5}, "body.submit_rate_per_second", id="neg"),
        pytest.param({"submit_burst": 0}, "body.submit_burst", id="burst-zero"),
        pytest.param({"submit_burst": 2**31}, "body.submit_burst", id="burst-huge"),
        pytest.param({"max_runing": {}}, "body.max_runing", id="misspelt"),
    ],
)
async def test_bad_limits_are_refused_and_nothing_is_written(
    api: Api, body: dict[str, Any], where: str
) -> None:
    admin = await api.client("platform", "sre", "admin")
    await admin.put("/tenants/acme/limits", json={"max_queued": 7})
    before = await limits_rows(api.engine)
    refused = assert_problem(
        await admin.put("/tenants/acme/limits", json=body), 422, "invalid-request"
    )
    assert refused["detail"].startswith(where), refused["detail"]
    assert await limits_rows(api.engine) == before


async def test_limits_need_the_admin_scope(api: Api) -> None:
    for scopes in ((), ("operator",)):
        client = await api.client("acme", "ops", *scopes)
        assert_problem(await client.get("/tenants/acme/limits"), 403, "forbidden")
        assert_problem(
            await client.put("/tenants/acme/limits", json={"submit_burst": 1}), 403, "forbidden"
        )
    async with httpx.AsyncClient(base_url=api.base) as anonymous:
        assert_problem(await anonymous.get("/tenants/acme/limits"), 401, "unauthorized")
    assert await limits_rows(api.engine) == []


# --- the CLI ----------------------------------------------------------------------------------
async def test_tenants_set_and_get_from_the_cli(database_url: str, engine: AsyncEngine) -> None:
    code, out, err = await cli(
        database_url,
        "tenants",
        "set",
        "acme",
        "--max-running",
        "async=4",
        "--max-running",
        "interactive=2",
        "--submit-rate",
        "2.5",
        "--json",
        TURNSTILE_SUBMIT_BURST="6",
    )
    assert code == 0, err
    document = json.loads(out)
    assert document["overrides"]["max_running"] == {
        "interactive": 2,
        "async": 4,
        "maintenance": None,
    }
    assert document["effective"]["submit_burst"] == 6  # the process default
    # `set` changes only what it names; `default` returns a class or a value to the default.
    code, out, err = await cli(
        database_url, "tenants", "set", "acme", "--max-running", "async=default", "--json"
    )
    assert code == 0, err
    again = json.loads(out)["overrides"]
    assert again["max_running"] == {"interactive": 2, "async": None, "maintenance": None}
    assert again["submit_rate_per_second"] == 2.5
    code, out, _ = await cli(database_url, "tenants", "set", "acme", "--submit-rate", "default")
    assert code == 0
    assert "overrides: " in out
    code, out, _ = await cli(database_url, "tenants", "get", "acme", "--json")
    assert json.loads(out)["overrides"]["submit_rate_per_second"] is None
    assert await limits_rows(engine) == [("acme", {"interactive": 2}, None, None, None)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-running", "batch=1"], "max_running: unknown class 'batch'"),
        (["--max-running", "async"], "--max-running takes CLASS=N or CLASS=default"),
        (["--max-running", "async=many"], "--max-running takes a whole number or 'default'"),
        (["--max-queued", "-1"], "max_queued: must be between 0 and"),
        (["--submit-rate", "0"], "submit_rate_per_second: must be from"),
        (["--submit-rate", "nan"], "submit_rate_per_second: must be from"),
        (["--submit-rate", "1e-300"], "(one a day)"),
        (["--submit-burst", "1.5"], "--submit-burst takes a whole number"),
        ([], "nothing to set"),
    ],
)
async def test_bad_cli_limits_are_one_line_errors(
    database_url: str, engine: AsyncEngine, args: list[str], message: str
) -> None:
    code, out, err = await cli(database_url, "tenants", "set", "acme", *args)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("turnstile: "), err
    assert message in lines[0], err
    assert await limits_rows(engine) == []


# --- the per-tenant figures -------------------------------------------------------------------
# tenant -> [(band, running, queued)]
COUNTS = {
    "acme": [(0, 2, 1), (1, 1, 30)],
    "globex": [(1, 4, 50)],
    "initech": [(1, 0, 5), (2, 1, 0)],
    "umbrella": [(0, 1, 2)],
    "hooli": [(1, 3, 0)],
    "idle": [(0, 0, 0)],  # a tenant whose work is done keeps its rows, at zero
}


async def seed_counts(engine: AsyncEngine) -> None:
    """Each tenant's running count rows, and its queued runs themselves (the figures count
    queued runs; running runs are the count rows')."""
    async with engine.begin() as conn:
        for tenant, rows in COUNTS.items():
            for band, running, queued in rows:
                await conn.execute(
                    text(
                        "INSERT INTO tenant_class_counts (tenant_id, band, running) "
                        "VALUES (:t, :b, :r)"
                    ),
                    {"t": tenant, "b": band, "r": running},
                )
                await conn.execute(
                    text(
                        "INSERT INTO runs (tenant_id, principal, agent, input, priority) "
                        "SELECT :t, 'p', 'scripted', '{}'::jsonb, :b * 10 "
                        "FROM generate_series(1, :q)"
                    ),
                    {"t": tenant, "b": band, "q": queued},
                )


async def test_queue_stats_per_tenant_for_operators_and_admins(api: Api) -> None:
    await seed_counts(api.engine)
    ops = await api.client("acme", "ops", "operator")
    own = (await ops.get("/queue/stats")).json()["tenants"]
    assert own == [
        {
            "tenant": "acme",
            "running": 3,
            "queued": 31,
            "classes": {
                "interactive": {"running": 2, "queued": 1},
                "async": {"running": 1, "queued": 30},
                "maintenance": {"running": 0, "queued": 0},
            },
        }
    ]
    admin = await api.client("platform", "sre", "admin")
    everyone = (await admin.get("/queue/stats", params={"top": 2})).json()["tenants"]
    # The busiest by queued runs, then the rest summed (umbrella, initech, hooli; idle has none).
    assert [(t["tenant"], t["queued"], t["running"]) for t in everyone] == [
        ("globex", 50, 4),
        ("acme", 31, 3),
        (None, 7, 5),
    ]
    assert everyone[2]["classes"]["maintenance"] == {"running": 1, "queued": 0}
    assert len((await admin.get("/queue/stats")).json()["tenants"]) == 5  # all fit in 20
    assert_problem(await admin.get("/queue/stats", params={"top": 0}), 422, "invalid-request")
    # A tenant with nothing queued or running has no line.
    quiet = await api.client("idle", "ops", "operator")
    assert (await quiet.get("/queue/stats")).json()["tenants"] == []


async def test_queue_stats_by_tenant_from_the_cli(database_url: str, engine: AsyncEngine) -> None:
    await seed_counts(engine)
    code, out, err = await cli(
        database_url, "queue", "stats", "--by-tenant", "--top", "1", "--json"
    )
    assert code == 0, err
    rows = json.loads(out)
    assert {(r["tenant"], r["class"]): (r["running"], r["queued"]) for r in rows} == {
        ("globex", "interactive"): (0, 0),
        ("globex", "async"): (4, 50),
        ("globex", "maintenance"): (0, 0),
        ("other", "interactive"): (3, 3),
        ("other", "async"): (4, 35),
        ("other", "maintenance"): (1, 0),
    }
    code, out, _ = await cli(database_url, "queue", "stats", "--by-tenant", "--tenant", "acme")
    assert code == 0
    assert "tenant=acme  class=async  running=1  queued=30" in out
    code, _, err = await cli(database_url, "queue", "stats", "--by-tenant", "--top", "0")
    assert (code, err.strip()) == (2, "turnstile: --top must be at least 1")


async def test_the_overview_lists_the_busiest_tenants(api: Api) -> None:
    await seed_counts(api.engine)
    admin = await signed_in(api, await api.key("platform", "sre", "admin"))
    page = (await admin.get("/ui/overview/fragment")).text
    assert 'data-testid="tenants"' in page
    # Most queued first; all five fit in the overview's ten.
    order = [page.index(f'data-tenant="{t}"') for t in ("globex", "acme", "initech", "umbrella")]
    assert order == sorted(order)
    assert 'data-tenant="idle"' not in page
    ops = await signed_in(api, await api.key("acme", "ops", "operator"))
    own = (await ops.get("/ui/overview/fragment")).text
    assert 'data-tenant="acme"' in own
    assert 'data-tenant="globex"' not in own


async def test_tenant_metrics_are_bounded(engine: AsyncEngine) -> None:
    """However many tenants have work, the gauges carry the busiest N and `other`."""
    await seed_counts(engine)
    metrics = Metrics()
    await QueueMetrics(Queue(engine), metrics, holder="test", interval=60, top_tenants=2).run_once()
    found = samples(generate_latest(metrics.registry).decode())
    tenant_series = {
        dict(labels)["tenant"]: value
        for (name, labels), value in found.items()
        if name == "turnstile_tenant_runs"
    }
    assert set(tenant_series) == {"globex", "acme", "other"}
    series = {
        (labels["tenant"], labels["class"], labels["status"]): value
        for (name, raw), value in found.items()
        if name == "turnstile_tenant_runs"
        for labels in [dict(raw)]
    }
    assert len(series) == 3 * 3 * 2  # (N + other) x classes x (running, queued)
    assert series[("globex", "async", "queued")] == 50
    assert series[("other", "async", "queued")] == 5
    assert series[("other", "interactive", "queued")] == 2
    # Totals are kept: nothing is dropped by the bound.
    for status, index in (("running", 1), ("queued", 2)):
        total = sum(row[index] for rows in COUNTS.values() for row in rows)
        assert sum(v for (_, _, s), v in series.items() if s == status) == total
