"""Distributed traces (OpenTelemetry): optional, off unless the standard OTEL_* settings ask
for them, and then the only module that touches OpenTelemetry.

The rest of the code calls the small interface below and never imports OpenTelemetry itself:
`submission` (the API's span around a submission; its `traceparent` is what the run keeps),
`claim` (one claim of a run, a child of the trace context the run keeps), `tool`, `model_call`
(GenAI semantic conventions), `transition` (the write that ends a hold), `mark` (a transition
made outside any claim, such as a cancellation), and `note` / `event` (attributes and events on
whatever span is current, e.g. the `turnstile.fenced` event).

Off (the default, or without the `turnstile[otel]` extra), every call returns the one shared
no-op span and nothing of OpenTelemetry is imported: the cost is a function call. The run still
keeps a valid `traceparent` its caller sent, so a worker with tracing on joins that trace even
when the API process has tracing off.

Tracing is process-wide, like logging: `configure_from_env` (called by `app.main.services`)
turns it on for the process and hands back the flush to call at exit; tests and embedding
programs `install` a provider of their own (the SDK's in-memory exporter). No global
OpenTelemetry provider or propagator is set: Turnstile's spans go to its own provider only.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Span as OtelSpan
    from opentelemetry.trace import Tracer, TracerProvider

log = logging.getLogger("turnstile.tracing")

AttributeValue = str | bool | int | float | tuple[str, ...]
Attributes = Mapping[str, AttributeValue | None]

# W3C Trace Context, section 3.2: version-traceid-parentid-flags, lower-case hex. A future
# version may append fields after the flags; only version 00's four are kept.
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


def parse_traceparent(value: str | None) -> str | None:
    """A valid `traceparent` header as version 00 (55 characters), or None: an invalid one is
    ignored, as the W3C spec asks (the run then starts a trace of its own, if any)."""
    if not value:
        return None
    match = _TRACEPARENT.match(value.strip())
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    if version == "00" and rest:
        return None  # version 00 has exactly four fields
    return f"00-{trace_id}-{span_id}-{flags}"


class Span:
    """The span a hook gives back, used as a context manager. This base is the no-op one (and
    the only one when tracing is off); `traceparent` is then the caller's, passed through."""

    def __init__(self, traceparent: str | None = None) -> None:
        self._traceparent = traceparent

    def __enter__(self) -> Span:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        return None

    @property
    def traceparent(self) -> str | None:
        """The W3C trace context a run should keep to continue this trace."""
        return self._traceparent

    def set(self, attributes: Attributes) -> None:
        """Set attributes (None values are left out)."""

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        """Add a span event."""


_OFF = Span()


class _LiveSpan(Span):
    """An OpenTelemetry span, current (for the spans started under it) while entered."""

    def __init__(
        self,
        tracer: Tracer,
        name: str,
        *,
        kind: str,
        parent: str | None = None,
        attributes: Attributes | None = None,
    ) -> None:
        super().__init__()
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = None
        if parent is not None:
            # The run's kept trace context: this span continues the caller's trace, in
            # whichever process and claim it runs.
            context = TraceContextTextMapPropagator().extract({"traceparent": parent})
        self._manager = tracer.start_as_current_span(
            name,
            context=context,
            kind=getattr(trace.SpanKind, kind),
            attributes=_clean(attributes or {}),
        )
        self._span: OtelSpan | None = None

    def __enter__(self) -> Span:
        self._span = self._manager.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._manager.__exit__(kind, error, trace)

    @property
    def traceparent(self) -> str | None:
        if self._span is None:
            return None
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(self._span))
        return carrier.get("traceparent")

    def set(self, attributes: Attributes) -> None:
        if self._span is not None:
            self._span.set_attributes(_clean(attributes))

    def event(self, name: str, attributes: Attributes | None = None) -> None:
        if self._span is not None:
            self._span.add_event(name, _clean(attributes or {}))


def _clean(attributes: Attributes) -> dict[str, AttributeValue]:
    return {key: value for key, value in attributes.items() if value is not None}


# --- the process's tracer -----------------------------------------------------------------------
_tracer: Tracer | None = None


def enabled() -> bool:
    return _tracer is not None


def install(provider: TracerProvider) -> None:
    """Trace this process's work into `provider` (tests, embedding programs)."""
    global _tracer
    _tracer = provider.get_tracer("turnstile")


def uninstall() -> None:
    """Stop tracing (the provider is its owner's to shut down)."""
    global _tracer
    _tracer = None


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the standard settings ask for traces: an OTLP endpoint, or a traces exporter
    other than `none`; `OTEL_SDK_DISABLED=true` wins over both."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    )


def configure_from_env(
    role: str, environ: Mapping[str, str] | None = None
) -> Callable[[], None] | None:
    """Turn tracing on for this process when the standard settings ask for it, exporting in
    batches (`OTEL_BSP_*`) with OTLP over HTTP (`otlp`, the default) or to standard output
    (`console`). Returns the shutdown that flushes what is left (call it once, at exit), or None
    when tracing stays off: not asked for, already on (a provider was installed), or the
    `turnstile[otel]` extra is missing (logged)."""
    environ = os.environ if environ is None else environ
    if _tracer is not None or not wanted(environ):
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
    except ImportError:
        log.warning(
            "tracing is asked for (OTEL_*) but OpenTelemetry is not installed: "
            "pip install 'turnstile[otel]'; tracing stays off"
        )
        return None
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    exporters: list[SpanExporter] = []
    for name in names:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            protocol = environ.get(
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
            )
            if protocol.strip() not in ("", "http/protobuf"):
                log.warning("OTLP protocol %r not supported: exporting http/protobuf", protocol)

            exporters.append(OTLPSpanExporter())  # endpoint, headers, timeout: OTEL_EXPORTER_*
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        elif name and name != "none":
            log.warning("unknown OTEL_TRACES_EXPORTER %r ignored (otlp, console)", name)
    if not exporters:
        return None
    attributes: dict[str, Any] = {"turnstile.role": role}
    configured = environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    if not environ.get("OTEL_SERVICE_NAME") and "service.name=" not in configured:
        attributes["service.name"] = "turnstile"
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    install(provider)
    log.info("tracing on", extra={"exporters": ",".join(names)})

    def shutdown() -> None:
        uninstall()
        provider.shutdown()  # flushes the batch processors: the last spans are not lost

    return shutdown


# --- the hooks ------------------------------------------------------------------------------------
def submission(kind: str, traceparent: str | None) -> Span:
    """The API's span around one submission (`kind`: turn, run), a child of the caller's
    `traceparent` when valid. Its `traceparent` is the context the run keeps."""
    caller = parse_traceparent(traceparent)
    if _tracer is None:
        return Span(caller)
    from opentelemetry import trace

    # A server span already current (an embedding program's HTTP instrumentation, which read
    # the same header) is the better parent: the submission then nests inside the request.
    current = trace.get_current_span().get_span_context().is_valid
    return _LiveSpan(
        _tracer,
        "turnstile.submit",
        kind="INTERNAL" if current else "SERVER",
        parent=None if current else caller,
        attributes={"turnstile.submission": kind},
    )


def claim(traceparent: str | None, attributes: Attributes) -> Span:
    """One claim of a run, from the claim to the end of its hold, in the trace the run keeps."""
    if _tracer is None:
        return _OFF
    return _LiveSpan(
        _tracer, "turnstile.claim", kind="CONSUMER", parent=traceparent, attributes=attributes
    )


def tool(name: str, idempotency_class: str, step: int) -> Span:
    """One tool call (GenAI `execute_tool`); its outcome is set with `note`."""
    if _tracer is None:
        return _OFF
    return _LiveSpan(
        _tracer,
        f"execute_tool {name}",
        kind="INTERNAL",
        attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "turnstile.tool.idempotency_class": idempotency_class,
            "turnstile.tool.step": step,
        },
    )


def model_call(system: str, operation: str, model: str, server_address: str | None) -> Span:
    """One call to a model (GenAI semantic conventions); usage is set on the span after."""
    if _tracer is None:
        return _OFF
    return _LiveSpan(
        _tracer,
        f"{operation} {model}",
        kind="CLIENT",
        attributes={
            "gen_ai.system": system,
            "gen_ai.provider.name": system,
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": model,
            "server.address": server_address,
        },
    )


def transition(name: str, attributes: Attributes | None = None) -> Span:
    """The write that ends a hold: complete, fail, wait_for_user or release."""
    if _tracer is None:
        return _OFF
    return _LiveSpan(
        _tracer,
        f"turnstile.{name}",
        kind="INTERNAL",
        attributes={"turnstile.transition": name, **(attributes or {})},
    )


def mark(name: str, traceparent: str | None, attributes: Attributes | None = None) -> None:
    """A transition made outside any claim (a cancellation), recorded after the fact as a
    span of no length in the trace the run keeps; nothing when the run keeps none."""
    if _tracer is None or traceparent is None:
        return
    with _LiveSpan(_tracer, name, kind="INTERNAL", parent=traceparent, attributes=attributes):
        pass


def note(attributes: Attributes) -> None:
    """Set attributes on the current span (a tool call's outcome, for one)."""
    if _tracer is None:
        return
    from opentelemetry import trace

    trace.get_current_span().set_attributes(_clean(attributes))


def event(name: str, attributes: Attributes | None = None) -> None:
    """Add an event to the current span (a fenced write: `turnstile.fenced`)."""
    if _tracer is None:
        return
    from opentelemetry import trace

    trace.get_current_span().add_event(name, _clean(attributes or {}))
