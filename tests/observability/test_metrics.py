"""Prometheus metrics after real runs: the API's /metrics and a worker's --metrics-port, with
the series and labels the operations guide names."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import string
from typing import Any

import httpx
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import Settings
from app.main import create_app
from app.observability.metrics import HTTP_METHODS, Metrics
from app.queue.core import Queue, QueueConfig
from app.store.embedded import free_port
from app.vocabulary.classes import PriorityClass
from app.vocabulary.layout import parse_slots
from app.vocabulary.records import NewRun
from tests.support.api import running_api
from tests.support.clock import ManualClock
from tests.support.processes import turnstile
from tests.support.waiting import eventually

# The default layout's interactive slots, which a process started without TURNSTILE_SLOTS has.
DEFAULT_INTERACTIVE_SLOTS = next(
    group.size
    for group in parse_slots(Settings.model_fields["slots"].default)
    if group.name == "interactive"
)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(found: dict[Any, float], name: str, **labels: str) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


async def test_api_metrics_after_real_runs(database_url: str, engine: AsyncEngine) -> None:
    async with running_api(database_url, engine, workers=True) as api:
        client = await api.client()
        done = await client.post("/runs", json={"input": {"script": [{"final": 1}]}})
        later = await client.post(
            "/runs", json={"input": 1, "scheduled_for": "2099-01-01T00:00:00Z"}
        )
        await client.post(f"/runs/{later.json()['id']}/cancel")

        async def finished() -> bool:
            run = (await client.get(f"/runs/{done.json()['id']}")).json()
            return bool(run["status"] == "succeeded")

        await eventually(finished, what="the run to finish")
        async with httpx.AsyncClient(base_url=api.base) as anonymous:
            scraped = await anonymous.get("/metrics")
        assert scraped.headers["content-type"].startswith("text/plain")
        found = samples(scraped.text)
    assert value(found, "turnstile_runs_enqueued_total", **{"class": "async"}) == 2
    assert value(found, "turnstile_runs_claimed_total", **{"class": "async"}) == 1
    assert value(found, "turnstile_runs_succeeded_total", **{"class": "async"}) == 1
    assert value(found, "turnstile_runs_cancelled_total", **{"class": "async"}) == 1
    assert value(found, "turnstile_claim_wait_seconds_count", **{"class": "async"}) == 1
    assert value(found, "turnstile_slots", group="interactive") == DEFAULT_INTERACTIVE_SLOTS
    assert value(found, "turnstile_slots_busy", group="async") is not None
    assert (
        value(found, "turnstile_http_requests_total", route="/runs", method="POST", status="202")
        == 2
    )
    assert (
        value(
            found,
            "turnstile_http_requests_total",
            route="/runs/{run_id}/cancel",
            method="POST",
            status="200",
        )
        == 1
    )
    for service in ("sweeper", "idempotency-pruner", "run-retention", "session-retention"):
        stamp = value(
            found, "turnstile_maintenance_last_success_timestamp_seconds", service=service
        )
        assert stamp is not None, service
        assert stamp > 0
    for reason in ("lease_expired", "queued_too_long", "waiting_too_long"):
        assert value(found, "turnstile_stuck_runs", reason=reason) is not None
    assert (
        value(found, "turnstile_queue_depth", **{"class": "maintenance"}, status="queued")
        is not None
    )
    # The NOTIFY queue's fill level, which every notifying transition depends on.
    usage = value(found, "turnstile_notification_queue_usage_ratio")
    assert usage is not None
    assert 0 <= usage < 1


async def test_open_streams_gauge_counts_long_polls_in_their_handlers(
    database_url: str, engine: AsyncEngine
) -> None:
    """`turnstile_api_open_streams`: a long poll holds its place while it waits, and gives it
    back when it is answered (here by the run's cancellation)."""
    async with running_api(database_url, engine) as api:
        client = await api.client()
        later = (
            await client.post("/runs", json={"input": 1, "scheduled_for": "2099-01-01T00:00:00Z"})
        ).json()

        async def open_streams() -> float | None:
            async with httpx.AsyncClient(base_url=api.base) as anonymous:
                found = samples((await anonymous.get("/metrics")).text)
            return value(found, "turnstile_api_open_streams")

        assert await open_streams() == 0
        poll = asyncio.create_task(
            client.get(f"/runs/{later['id']}", params={"wait": 30, "status": "queued"})
        )

        async def one_open() -> bool:
            return await open_streams() == 1

        await eventually(one_open, what="the long poll to hold its place")
        await client.post(f"/runs/{later['id']}/cancel")
        answered = await asyncio.wait_for(poll, 30)
        assert answered.json()["status"] == "cancelled"

        async def none_open() -> bool:
            return await open_streams() == 0

        await eventually(none_open, what="the answered poll to give its place back")


async def test_requeued_released_and_fenced_are_counted(engine: AsyncEngine) -> None:
    metrics = Metrics()
    clock = ManualClock()
    queue = Queue(engine, QueueConfig(lease_seconds=30), clock=clock, observer=metrics)
    for _ in range(3):
        await queue.enqueue(
            NewRun(
                tenant_id="t",
                principal="p",
                agent="scripted",
                input={},
                priority=PriorityClass.MAINTENANCE.base,
            )
        )
    leases = [c.lease for c in await queue.claim("w", [PriorityClass.MAINTENANCE], limit=3)]
    await queue.release(leases[0], graceful=True)
    await queue.cancel(leases[1].run_id, actor="op")
    await queue.record_fenced(leases[1], during="heartbeat")
    clock.advance(31)
    await queue.sweep()
    found = samples(generate_latest(metrics.registry).decode())
    labels = {"class": "maintenance"}
    assert value(found, "turnstile_runs_released_total", **labels) == 1
    assert value(found, "turnstile_runs_cancelled_total", **labels) == 1
    assert value(found, "turnstile_runs_fenced_total", **labels) == 1
    assert value(found, "turnstile_runs_requeued_total", **labels) == 1


async def test_a_worker_serves_its_own_metrics_port(database_url: str, engine: AsyncEngine) -> None:
    port = free_port()
    queue = Queue(engine)
    async with turnstile(
        "worker",
        "--metrics-port",
        str(port),
        ready=b"running slots",
        env={"DATABASE_URL": database_url},
    ):
        run = await queue.enqueue(
            NewRun(
                tenant_id="t", principal="p", agent="scripted", input={"script": [{"final": "ok"}]}
            )
        )

        async def counted() -> dict[Any, float] | None:
            async with httpx.AsyncClient() as client:
                text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
            found = samples(text)
            done = value(found, "turnstile_runs_succeeded_total", **{"class": "interactive"})
            return found if done == 1 else None

        found = await eventually(counted, within=20, what="the worker's metrics")
        assert value(found, "turnstile_slots", group="interactive") == DEFAULT_INTERACTIVE_SLOTS
        assert (await queue.get_run(run.id)).status == "succeeded"  # type: ignore[union-attr]


async def test_http_labels_come_from_fixed_sets(database_url: str, engine: AsyncEngine) -> None:
    """Random methods and paths (one method of 8 KB) add no series: unknown methods count as
    `other`, paths as their route template or `unmatched`."""
    rng = random.Random(7)
    async with (
        running_api(database_url, engine) as api,
        httpx.AsyncClient(base_url=api.base) as anonymous,
    ):
        baseline = len((await anonymous.get("/metrics")).text)
        methods = ["".join(rng.choices(string.ascii_uppercase, k=12)) for _ in range(50)]
        for method in [*methods, "M" * 8192]:
            await anonymous.request(method, "/healthz")
            await anonymous.request(method, f"/no/such/{rng.getrandbits(64):x}")
        for _ in range(20):
            await anonymous.get(f"/runs/{rng.getrandbits(64):x}/nowhere")
        scraped = (await anonymous.get("/metrics")).text
    app = create_app(Settings(database_url=database_url))
    templates = {getattr(route, "path", None) for route in app.routes}
    templates |= {*app.openapi()["paths"], "unmatched"}
    found = samples(scraped)
    http = [dict(labels) for (name, labels) in found if name == "turnstile_http_requests_total"]
    assert {labels["method"] for labels in http} <= {*HTTP_METHODS, "other"}
    assert {labels["route"] for labels in http} <= templates
    # httptools (uvicorn's parser when installed, as it is here) refuses methods it does not
    # know with a 400 before the app sees them; h11 hands them to the app, which answers 405
    # and counts them as `other`. Either way they add no series of their own.
    expected = None if importlib.util.find_spec("httptools") is not None else 51
    assert (
        value(
            found, "turnstile_http_requests_total", route="/healthz", method="other", status="405"
        )
        == expected
    )
    assert len(scraped) < baseline + 16_000  # a few new series, not one per method


async def test_metrics_can_require_an_admin_key(database_url: str, engine: AsyncEngine) -> None:
    async with running_api(database_url, engine, metrics_require_key=True) as api:
        admin = await api.client("platform", "prometheus", "admin")
        operator = await api.client("acme", "ops", "operator")
        tenant = await api.client("acme", "alice")
        async with httpx.AsyncClient(base_url=api.base) as anonymous:
            refused = await anonymous.get("/metrics")
        assert refused.status_code == 401
        assert refused.headers["content-type"] == "application/problem+json"
        for client in (operator, tenant):
            forbidden = await client.get("/metrics")
            assert forbidden.status_code == 403
            assert forbidden.json()["type"].endswith("/forbidden")
        served = await admin.get("/metrics")
        assert served.status_code == 200
        assert "turnstile_http_requests_total" in served.text
