"""Traces (app/observability/tracing.py): the run's work joins the caller's trace.

In-process, with the SDK's in-memory exporter: the API and a worker pool in this process, a
caller's `traceparent` on a turn, and the span tree it yields (submission, claim with attempt
and epoch, tool call with its class and outcome, the write that ends each hold), an answer that
resumes the run in the answer's trace, a fenced write as a span event, a model call with the
GenAI attributes, and nothing of OpenTelemetry imported when tracing is off. End to end: real
`turnstile serve` and `turnstile worker` processes export over OTLP/HTTP to a receiver on
loopback, which decodes the protobuf.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any
from uuid import UUID

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.observability import tracing
from app.observability.tracing import parse_traceparent, wanted
from app.queue.core import Queue
from app.queue.model_budgets import ModelBudgets, endpoint_key
from app.runtime.outbound import ModelClient
from app.security.api_keys import create_key
from app.store.embedded import free_port
from app.vocabulary.records import NewRun
from app.worker.execution import ExecutionContext
from tests.runtime.test_openai_agent import FakeModel, executor
from tests.support.api import running_api
from tests.support.processes import turnstile
from tests.support.runtime import execute_once
from tests.support.servers import running_server
from tests.support.waiting import eventually

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
CALLER = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
ANSWER_TRACE = "0af7651916cd43dd8448eb211c80319c"
ANSWER_SPAN = "b7ad6b7169203331"
ANSWER = f"00-{ANSWER_TRACE}-{ANSWER_SPAN}-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        yield exporter
    finally:
        tracing.uninstall()
        provider.shutdown()


def hex_trace(span: ReadableSpan) -> str:
    return format(span.context.trace_id, "032x")


def hex_span(span_id: int) -> str:
    return format(span_id, "016x")


def parent_of(span: ReadableSpan) -> str | None:
    return hex_span(span.parent.span_id) if span.parent is not None else None


def named(found: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in found if s.name == name]


def one(found: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    matches = named(found, name)
    assert len(matches) == 1, f"{name}: {[s.name for s in found]}"
    return matches[0]


async def stored_traceparent(engine: AsyncEngine, run_id: str) -> str | None:
    async with engine.connect() as conn:
        value = await conn.scalar(
            text("SELECT traceparent FROM runs WHERE id = :id"), {"id": run_id}
        )
    return str(value) if value is not None else None


async def run_status(client: httpx.AsyncClient, run_id: str, status: str) -> dict[str, Any] | None:
    document: dict[str, Any] = (await client.get(f"/runs/{run_id}")).json()
    return document if document["status"] == status else None


# --- the trace context ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("header", "kept"),
    [
        (CALLER, CALLER),
        (f"  {CALLER}  ", CALLER),
        # A later version may add fields: its first four are read as version 00's.
        (f"01-{CALLER_TRACE}-{CALLER_SPAN}-01-future", CALLER),
        (None, None),
        ("", None),
        (CALLER.upper(), None),  # upper-case hex is invalid
        (f"00-{'0' * 32}-{CALLER_SPAN}-01", None),
        (f"00-{CALLER_TRACE}-{'0' * 16}-01", None),
        (f"ff-{CALLER_TRACE}-{CALLER_SPAN}-01", None),
        (f"{CALLER}-extra", None),  # version 00 has exactly four fields
        ("00-abc-def-01", None),
    ],
)
def test_a_traceparent_is_kept_only_when_valid(header: str | None, kept: str | None) -> None:
    assert parse_traceparent(header) == kept


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False),
    ],
)
def test_tracing_is_on_only_when_the_standard_settings_say_so(
    environ: dict[str, str], on: bool
) -> None:
    assert wanted(environ) is on


def test_configured_from_the_settings_it_is_on_until_its_shutdown() -> None:
    stop = tracing.configure_from_env("worker", {"OTEL_TRACES_EXPORTER": "console"})
    assert stop is not None
    try:
        assert tracing.enabled()
        # Already on: a second configuration (another app in this process) changes nothing.
        assert tracing.configure_from_env("serve", {"OTEL_TRACES_EXPORTER": "console"}) is None
    finally:
        stop()
    assert not tracing.enabled()
    assert tracing.configure_from_env("serve", {"OTEL_TRACES_EXPORTER": "zipkin"}) is None
    assert not tracing.enabled()


def test_off_neither_the_sdk_nor_an_exporter_is_imported() -> None:
    """With the OTEL_* settings unset, loading the whole service and calling every hook imports
    neither the OpenTelemetry SDK nor an exporter (a fresh interpreter: this one has them)."""
    program = """
import sys
import app.main, app.roles, app.cli
from app.observability import tracing
assert tracing.configure_from_env("serve") is None
with tracing.submission("turn", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01") as s:
    assert s.traceparent == "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
with tracing.claim(None, {"turnstile.run.attempt": 1}) as c:
    c.set({"x": 1})
    tracing.event("turnstile.fenced")
    tracing.note({"y": 2})
# The API package may be there (FastAPI imports it for its own telemetry); the SDK and the
# exporters must not be.
heavy = ("opentelemetry.sdk", "opentelemetry.exporter")
loaded = sorted(m for m in sys.modules if m.startswith(heavy))
assert not loaded, loaded
"""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", program], env=environ, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def test_a_submission_nests_in_a_server_span_already_current(
    spans: InMemorySpanExporter,
) -> None:
    """An embedding program's own HTTP instrumentation read the header first: the submission
    is a child of its request span, not a sibling."""
    theirs = TracerProvider().get_tracer("their-http-instrumentation")
    with (
        theirs.start_as_current_span("POST /runs") as request,
        tracing.submission("run", CALLER) as submission,
    ):
        kept = submission.traceparent
    submit = one(spans.get_finished_spans(), "turnstile.submit")
    assert parent_of(submit) == hex_span(request.get_span_context().span_id)
    assert kept is not None
    # Its flags may carry more than "sampled" (the W3C level-2 "random" bit, 02).
    assert kept.startswith(f"00-{hex_trace(submit)}-{hex_span(submit.context.span_id)}-")


async def test_off_the_callers_traceparent_is_still_kept_with_the_run(
    database_url: str, engine: AsyncEngine
) -> None:
    """A worker with tracing on joins the caller's trace even when the API process has it off;
    an invalid header is ignored, not refused."""
    async with running_api(database_url, engine) as api:
        client = await api.client()
        kept = await client.post("/runs", json={"input": "x"}, headers={"traceparent": CALLER})
        ignored = await client.post("/runs", json={"input": "y"}, headers={"traceparent": "zz"})
        assert (kept.status_code, ignored.status_code) == (202, 202)
        assert await stored_traceparent(engine, kept.json()["id"]) == CALLER
        assert await stored_traceparent(engine, ignored.json()["id"]) is None


# --- the span tree, in-process -------------------------------------------------------------------
async def test_a_turn_its_answer_and_their_work_join_the_callers_traces(
    database_url: str, engine: AsyncEngine, spans: InMemorySpanExporter
) -> None:
    script = {
        "script": [
            {"call": "echo", "args": {"n": 1}},
            {"ask": "Which account?"},
            {"final": "done"},
        ]
    }
    async with running_api(database_url, engine, workers=True) as api:
        client = await api.client()
        session = (await client.post("/sessions")).json()["id"]
        turn = await client.post(
            f"/sessions/{session}/turns", json={"input": script}, headers={"traceparent": CALLER}
        )
        assert turn.status_code == 202, turn.text
        run_id = turn.json()["id"]
        await eventually(
            lambda: run_status(client, run_id, "waiting_for_user"), what="the question"
        )
        first = await stored_traceparent(engine, run_id)
        answer = await client.post(
            f"/sessions/{session}/turns", json={"input": "acct-7"}, headers={"traceparent": ANSWER}
        )
        assert answer.status_code == 202, answer.text
        assert answer.json()["id"] == run_id
        await eventually(lambda: run_status(client, run_id, "succeeded"), what="the run's end")
        second = await stored_traceparent(engine, run_id)

    found = spans.get_finished_spans()
    submits = named(found, "turnstile.submit")
    claims = named(found, "turnstile.claim")
    assert (len(submits), len(claims)) == (2, 2), [s.name for s in found]
    by_trace = {hex_trace(s): s for s in submits}

    # The turn: a child of the caller's span, in the caller's trace; the run keeps its context.
    submit = by_trace[CALLER_TRACE]
    assert parent_of(submit) == CALLER_SPAN
    assert submit.attributes is not None
    assert submit.attributes["turnstile.submission"] == "turn"
    assert submit.attributes["turnstile.submission.routed"] == "created"
    assert submit.attributes["turnstile.run.id"] == run_id
    assert first == f"00-{CALLER_TRACE}-{hex_span(submit.context.span_id)}-01"

    # Its claim: a child of the submission (the kept context), with attempt and epoch.
    claim = next(c for c in claims if hex_trace(c) == CALLER_TRACE)
    assert parent_of(claim) == hex_span(submit.context.span_id)
    assert claim.attributes is not None
    assert claim.attributes["turnstile.run.id"] == run_id
    assert claim.attributes["turnstile.run.attempt"] == 1
    assert claim.attributes["turnstile.lease.epoch"] == 1
    assert claim.attributes["turnstile.agent"] == "scripted"

    # The tool call and the question, inside the claim.
    echo = one(found, "execute_tool echo")
    assert parent_of(echo) == hex_span(claim.context.span_id)
    assert echo.attributes is not None
    assert echo.attributes["gen_ai.tool.name"] == "echo"
    assert echo.attributes["turnstile.tool.idempotency_class"] == "safe"
    assert echo.attributes["turnstile.tool.outcome"] == "succeeded"
    asked = one(found, "turnstile.wait_for_user")
    assert parent_of(asked) == hex_span(claim.context.span_id)
    assert asked.attributes is not None
    assert asked.attributes["turnstile.transition.written"]

    # The answer: its own submission in the answer's trace, which the resumed work joins.
    resumed = by_trace[ANSWER_TRACE]
    assert parent_of(resumed) == ANSWER_SPAN
    assert resumed.attributes is not None
    assert resumed.attributes["turnstile.submission.routed"] == "delivered"
    assert second == f"00-{ANSWER_TRACE}-{hex_span(resumed.context.span_id)}-01"
    again = next(c for c in claims if hex_trace(c) == ANSWER_TRACE)
    assert parent_of(again) == hex_span(resumed.context.span_id)
    assert again.attributes is not None
    assert again.attributes["turnstile.lease.epoch"] == 2
    assert again.attributes["turnstile.run.attempt"] == 1  # a question is not a failure
    completed = one(found, "turnstile.complete")
    assert parent_of(completed) == hex_span(again.context.span_id)
    assert not named(found, "turnstile.fail")


class GatedExecutor:
    """Holds every run until `gate` opens, then completes it (possibly too late)."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.holding: list[UUID] = []

    async def execute(self, ctx: ExecutionContext) -> None:
        self.holding.append(ctx.lease.run_id)
        await self.gate.wait()
        await ctx.complete({"late": True})


async def test_a_fenced_write_is_an_event_on_the_span_of_the_write(
    database_url: str, engine: AsyncEngine, spans: InMemorySpanExporter
) -> None:
    executor = GatedExecutor()
    async with running_api(database_url, engine, workers=True, executor=executor) as api:
        client = await api.client()
        created = await client.post("/runs", json={"input": "x"}, headers={"traceparent": CALLER})
        run_id = created.json()["id"]
        await eventually(lambda: asyncio.sleep(0, executor.holding or None), what="the claim")
        cancelled = await client.post(f"/runs/{run_id}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        executor.gate.set()

        async def fenced() -> bool:
            events = (await client.get(f"/runs/{run_id}/events")).json()["events"]
            return any(e["type"] == "run.fenced" for e in events)

        await eventually(fenced, what="run.fenced")

        async def closed() -> ReadableSpan | None:
            claims = named(spans.get_finished_spans(), "turnstile.claim")
            return claims[0] if claims else None

        claim = await eventually(closed, what="the claim's span to end")

    found = spans.get_finished_spans()
    submit = one(found, "turnstile.submit")
    cancel = one(found, "turnstile.cancel")  # the terminal transition, made by the API
    assert parent_of(cancel) == hex_span(submit.context.span_id)
    write = one(found, "turnstile.complete")
    assert hex_trace(write) == CALLER_TRACE
    assert parent_of(write) == hex_span(claim.context.span_id)
    assert write.attributes is not None
    assert write.attributes["turnstile.transition.written"] is False
    [event] = [e for e in write.events if e.name == "turnstile.fenced"]
    assert event.attributes is not None
    assert dict(event.attributes) == {
        "turnstile.fenced.during": "complete",
        "turnstile.lease.epoch": 1,
    }
    assert claim.attributes is not None
    assert claim.attributes["turnstile.lease.epoch"] == 1


async def test_a_run_taken_over_by_another_pool_stays_in_the_callers_trace(
    database_url: str, engine: AsyncEngine, spans: InMemorySpanExporter
) -> None:
    """The first pool stops while it holds the run (the drain gives it back); a second pool,
    another service built from scratch, claims it again. Both claims are children of the
    submission, each with its own epoch: the trace survives the change of holder."""
    held = GatedExecutor()  # never opened: the drain takes the run back
    async with running_api(
        database_url, engine, workers=True, executor=held, drain_grace_seconds=0.2
    ) as api:
        client = await api.client()
        created = await client.post("/runs", json={"input": "x"}, headers={"traceparent": CALLER})
        run_id = created.json()["id"]
        await eventually(lambda: asyncio.sleep(0, held.holding or None), what="the first claim")
    finishing = GatedExecutor()
    finishing.gate.set()
    async with running_api(database_url, engine, workers=True, executor=finishing) as api:
        client = await api.client()
        await eventually(lambda: run_status(client, run_id, "succeeded"), what="the second claim")

    found = spans.get_finished_spans()
    submit = one(found, "turnstile.submit")
    claims = sorted(
        named(found, "turnstile.claim"),
        key=lambda c: int(str((c.attributes or {})["turnstile.lease.epoch"])),
    )
    assert [hex_trace(c) for c in claims] == [CALLER_TRACE, CALLER_TRACE]
    assert {parent_of(c) for c in claims} == {hex_span(submit.context.span_id)}
    assert [(c.attributes or {})["turnstile.lease.epoch"] for c in claims] == [1, 2]
    assert (claims[0].attributes or {})["turnstile.claim.stopped"] == "drain"
    release = one(found, "turnstile.release")
    assert parent_of(release) == hex_span(claims[0].context.span_id)
    complete = one(found, "turnstile.complete")
    assert parent_of(complete) == hex_span(claims[1].context.span_id)


async def test_a_model_call_has_the_genai_attributes(
    engine: AsyncEngine, spans: InMemorySpanExporter
) -> None:
    fake = FakeModel()
    fake.call(("c1", "echo", {"n": 1}), usage=12)
    fake.say("all done", usage=20)
    queue = Queue(engine)
    run = await queue.enqueue(NewRun("acme", "alice", "openai", "hello"))
    http = ModelClient(2)
    try:
        async with running_server(fake.app()) as base:
            assert await execute_once(queue, executor(base, http))
    finally:
        await http.aclose()
    assert (await queue.get_run(run.id)).status == "succeeded"  # type: ignore[union-attr]

    calls = named(spans.get_finished_spans(), "chat test-model")
    assert len(calls) == 2
    first, last = calls
    assert first.kind.name == "CLIENT"
    assert first.attributes is not None
    assert last.attributes is not None
    assert first.attributes["gen_ai.system"] == "openai"
    assert first.attributes["gen_ai.operation.name"] == "chat"
    assert first.attributes["gen_ai.request.model"] == "test-model"
    assert first.attributes["server.address"] == "127.0.0.1"
    assert first.attributes["gen_ai.usage.input_tokens"] == 12
    assert first.attributes["gen_ai.usage.output_tokens"] == 2
    assert last.attributes["gen_ai.usage.input_tokens"] == 20
    assert last.attributes["gen_ai.usage.output_tokens"] == 1
    # The tool the model asked for ran between the two calls.
    tool = one(spans.get_finished_spans(), "execute_tool echo")
    assert first.end_time is not None
    assert last.start_time is not None
    assert first.end_time <= (tool.start_time or 0) <= last.start_time


async def test_a_wait_for_model_capacity_is_a_span_carrying_the_wait(
    engine: AsyncEngine, spans: InMemorySpanExporter
) -> None:
    """The give-back of a run that waits for model capacity is its own span, with the
    endpoint, what it lacks, how long and until when (docs/model-budgets.md)."""
    fake = FakeModel()
    queue = Queue(engine)
    budgets = ModelBudgets(queue)
    run = await queue.enqueue(NewRun("acme", "alice", "openai", "hello"))
    http = ModelClient(2)
    try:
        async with running_server(fake.app()) as base:
            endpoint = endpoint_key(f"{base}/v1", "test-model")
            until = await budgets.pause(endpoint, 30)
            runtime = executor(base, http)
            runtime.budgets = budgets
            assert await execute_once(queue, runtime)
    finally:
        await http.aclose()
    assert (await queue.get_run(run.id)).status == "queued"  # type: ignore[union-attr]
    wait = one(spans.get_finished_spans(), "turnstile.wait_for_capacity")
    assert wait.attributes is not None
    assert wait.attributes["turnstile.transition.written"] is True
    assert wait.attributes["turnstile.capacity.endpoint"] == endpoint
    assert wait.attributes["turnstile.capacity.short_of"] == "paused"
    assert wait.attributes["turnstile.capacity.ready_at"] == until.isoformat()
    assert float(wait.attributes["turnstile.capacity.wait_seconds"]) > 0  # type: ignore[arg-type]


# --- end to end: real processes exporting over OTLP/HTTP -----------------------------------------
class OtlpReceiver:
    """An OTLP/HTTP traces receiver on loopback: POST /v1/traces with a protobuf body,
    decoded into spans (a small asyncio HTTP/1.1 server, enough for the SDK's exporter)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []  # (service.name, the span's protobuf)
        self.paths: list[str] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while request := await reader.readuntil(b"\r\n\r\n"):
                head = request.decode("latin-1").split("\r\n")
                self.paths.append(head[0].split(" ")[1])
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (line.partition(":") for line in head[1:] if line)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                self.take(body)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\n"
                    b"Content-Length: 0\r\n\r\n"
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def take(self, body: bytes) -> None:
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        for resource_spans in export.resource_spans:
            service = next(
                (
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "turnstile.role"
                ),
                "",
            )
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend((service, span) for span in scope_spans.spans)


@asynccontextmanager
async def otlp_receiver() -> AsyncIterator[tuple[OtlpReceiver, str]]:
    receiver = OtlpReceiver()
    server = await asyncio.start_server(receiver.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield receiver, f"http://127.0.0.1:{port}"


def attributes_of(span: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for attribute in span.attributes:
        value = attribute.value
        values[attribute.key] = getattr(value, value.WhichOneof("value"))
    return values


async def test_serve_and_worker_processes_export_one_trace_over_otlp(
    database_url: str, engine: AsyncEngine
) -> None:
    """An API-only `turnstile serve` and a `turnstile worker`, each exporting over OTLP/HTTP:
    the receiver gets the submission from one and the claim, tool call and completion from the
    other, all in the caller's trace, flushed when each process stops."""
    port = free_port()
    key = (await create_key(engine, tenant_id="acme", principal="svc")).secret
    async with otlp_receiver() as (receiver, endpoint):
        env = {
            "DATABASE_URL": database_url,
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(
                turnstile(
                    "serve", "--no-workers", "--port", str(port), ready=b"Uvicorn running", env=env
                )
            )
            await stack.enter_async_context(turnstile("worker", ready=b"running slots", env=env))
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}",
                headers={"Authorization": f"Bearer {key}"},
                timeout=30,
            ) as client:
                body = {"input": {"script": [{"call": "echo", "args": {"n": 1}}, {"final": 1}]}}
                created = await client.post("/runs", json=body, headers={"traceparent": CALLER})
                assert created.status_code == 202, created.text
                run_id = created.json()["id"]
                await eventually(
                    lambda: run_status(client, run_id, "succeeded"), what="the run's end"
                )
        # Both processes stopped (SIGTERM, exit 0): each flushed its batch on the way out.

    assert set(receiver.paths) == {"/v1/traces"}
    ours = [(role, s) for role, s in receiver.spans if s.trace_id.hex() == CALLER_TRACE]
    by_name = {s.name: (role, s) for role, s in ours}
    assert {"turnstile.submit", "turnstile.claim", "execute_tool echo", "turnstile.complete"} <= (
        set(by_name)
    ), sorted(by_name)
    submit_role, submit = by_name["turnstile.submit"]
    claim_role, claim = by_name["turnstile.claim"]
    assert (submit_role, claim_role) == ("serve", "worker")
    assert submit.parent_span_id.hex() == CALLER_SPAN
    assert claim.parent_span_id == submit.span_id
    assert by_name["execute_tool echo"][1].parent_span_id == claim.span_id
    assert by_name["turnstile.complete"][1].parent_span_id == claim.span_id
    assert attributes_of(claim)["turnstile.run.id"] == run_id
    assert attributes_of(claim)["turnstile.run.attempt"] == 1
    assert attributes_of(claim)["turnstile.lease.epoch"] == 1
    assert json.loads(json.dumps(attributes_of(submit)))["turnstile.submission"] == "run"
