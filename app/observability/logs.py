"""Structured logs: JSON lines (or readable lines on a terminal), one level setting, and the
run's context on every line written while a run executes.

The worker pool sets the run's context (run id, session id, epoch, worker id, slot group) in a
context variable for the task executing it, so every log line from the runtime, the tools and
the queue core during that execution carries it without passing it around. Secrets never go
into log records: the API key of a model endpoint is held by the agent and never formatted.

Outbound requests: at the default level nothing is logged per request (the HTTP clients'
loggers are quiet below debug). At debug, httpx logs each one with its full URL, and a URL's
query string (`?token=...`) or user info (`user:password@`) may carry a credential that a
tenant's tool call, a webhook endpoint or the model endpoint's settings put there. Those
lines keep the method, the host, the path and the status, with the query and the user info
replaced by `[redacted]` (`OutboundUrlRedaction`). httpcore's own debug traces (headers as sent and
received) stay off whatever the level.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
from datetime import UTC, datetime
from typing import Any

run_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "turnstile_run_context", default=None
)
# Attributes every LogRecord has; anything else was passed with `extra=` and is printed.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = dict(run_context.get() or {})
    fields.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
    return fields


# An http(s) URL in a log line: its user info and its query string are what may carry secrets.
_URL = re.compile(
    r"(?P<scheme>https?://)(?P<userinfo>[^/@\s\"'?#]*@)?(?P<rest>[^\s\"'?#]*)"
    r"(?P<query>\?[^\s\"'#]*)?",
    re.IGNORECASE,
)


def redact_urls(text: str) -> str:
    """`text` with every URL's user info and query string replaced by `[redacted]`."""

    def redacted(found: re.Match[str]) -> str:
        userinfo = "[redacted]@" if found["userinfo"] else ""
        query = "?[redacted]" if found["query"] else ""
        return f"{found['scheme']}{userinfo}{found['rest']}{query}"

    return _URL.sub(redacted, text)


class OutboundUrlRedaction(logging.Filter):
    """Rewrites a record's message with its URLs redacted (see the module's docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact_urls(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


REDACTED_LOGGERS = ("httpx",)

QUIET_LOGGERS = ("httpx", "aiohttp")
"""HTTP clients that log each request: heard at debug level only."""


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class ReadableFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        text = f"{record.levelname.lower():7} {record.name}: {record.getMessage()}"
        text = f"{text}  {fields}" if fields else text
        if record.exc_info:
            text = f"{text}\n{self.formatException(record.exc_info)}"
        return text


def configure_logging(level: str, *, json_lines: bool | None = None) -> None:
    """Route every logger (uvicorn's too) through one handler on stderr."""
    use_json = (not sys.stderr.isatty()) if json_lines is None else json_lines
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if use_json else ReadableFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Libraries that narrate their own start-up at info level speak up only when asked.
    logging.getLogger("alembic").setLevel("DEBUG" if level == "debug" else "WARNING")
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
    for name in REDACTED_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, OutboundUrlRedaction) for f in logger.filters):
            logger.addFilter(OutboundUrlRedaction())
    # Wire-level traces of the HTTP client, response headers included: never in our logs.
    logging.getLogger("httpcore").setLevel("WARNING")
    # A line per outbound request (httpx's, at info) only at debug: a worker's own line per
    # run transition is enough, and thousands of model calls a second made thousands of lines.
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel("DEBUG" if level.lower() == "debug" else "WARNING")
