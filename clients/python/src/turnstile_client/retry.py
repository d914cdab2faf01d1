"""When the client tries a request again, and how long it waits first.

Retried: transport errors (refused or reset connections, timeouts, and the keep-alive race in
which a server closes an idle connection just as the client sends on it, seen as
`httpx.ReadError` or `httpx.RemoteProtocolError`), 5xx answers, 429, and 409
`idempotency-key-in-flight`. A submission is retried with the same `Idempotency-Key`, so a
request that did reach the server is replayed, never run twice. The wait doubles from
`base_delay` up to `max_delay`, with jitter, or is the answer's `Retry-After` when it gives one
(capped at `max_retry_after`); after `attempts` tries the last error is raised (a transport
error as the client's own `TransportError`, errors.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

import httpx

from turnstile_client.errors import slug_of

RETRIED_TRANSPORT_ERRORS: tuple[type[httpx.TransportError], ...] = (
    httpx.NetworkError,  # ConnectError, ReadError, WriteError, CloseError
    httpx.TimeoutException,
    httpx.RemoteProtocolError,  # "server disconnected without sending a response"
)


@dataclass(frozen=True)
class RetryPolicy:
    """How hard the client tries: `attempts` in all (1 disables retries)."""

    attempts: int = 6
    base_delay: float = 0.2
    max_delay: float = 5.0
    max_retry_after: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be at least 1")
        if not 0 <= self.base_delay <= self.max_delay:
            raise ValueError("need 0 <= base_delay <= max_delay")

    def backoff(self, attempt: int) -> float:
        """The pause after failed try number `attempt` (1-based): exponential, with jitter so
        that clients cut off together do not come back together."""
        ceiling = min(self.max_delay, self.base_delay * 2 ** (attempt - 1))
        return random.uniform(ceiling / 2, ceiling)

    def delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_retry_after)
        return self.backoff(attempt)


def retry_after_of(response: httpx.Response) -> float | None:
    """`Retry-After` in seconds: a number, or an HTTP date (RFC 9110); None when absent or
    unreadable."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max((when - datetime.now(UTC)).total_seconds(), 0.0)


def retryable_answer(response: httpx.Response) -> bool:
    """An error answer worth sending again unchanged (the request wrote nothing, or its key
    makes a repeat safe)."""
    status = response.status_code
    if status == 429 and _slug(response) == "too-many-pending-turns":
        return False  # the session's runs must finish first: minutes, not a retry's backoff
    if status >= 500 or status == 429:
        return True
    if status == 409:
        try:
            body = response.json()
        except ValueError:
            return False
        return isinstance(body, dict) and slug_of(str(body.get("type", ""))) == (
            "idempotency-key-in-flight"
        )
    return False


def _slug(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return ""
    return slug_of(str(body.get("type", ""))) if isinstance(body, dict) else ""
