"""The client's exceptions: every problem+json answer (RFC 9457) becomes a `ProblemError`
carrying its fields, or the subclass named after its `type`, so callers catch what they can
handle (`SessionBusyError` and its `active_run_id`) and let the rest rise. A request that got no
answer at all, once its retries ran out, is a `TransportError`: `UnreachableError` (no
connection could be made), `ConnectionLostError` or `ResponseTimeoutError`; httpx's own error
is its `__cause__`."""

from __future__ import annotations

from typing import Any
from uuid import UUID

import httpx


class ClientError(Exception):
    """The root of the client's own exceptions."""


class TransportError(ClientError):
    """No answer came from the API, after `attempts` tries. `idempotency_key` is the key a
    submission was sent with: send it again later with that key and it is replayed if it did
    reach the server, never run twice."""

    def __init__(
        self, message: str, *, base_url: str, attempts: int, idempotency_key: str | None = None
    ) -> None:
        super().__init__(message)
        self.base_url = base_url
        self.attempts = attempts
        self.idempotency_key = idempotency_key


class UnreachableError(TransportError, ConnectionError):
    """No connection could be made (refused, unknown host, no route, connect timeout): the
    server is down, or the base URL is wrong. Nothing reached the server."""


class ConnectionLostError(TransportError, ConnectionError):
    """The connection broke before the answer came: the request may or may not have been
    processed (a submission is safe to send again with its `idempotency_key`)."""


class ResponseTimeoutError(TransportError, TimeoutError):
    """The server did not answer within the client's timeout."""


def transport_error(
    exc: httpx.TransportError, *, base_url: str, attempts: int, idempotency_key: str | None
) -> TransportError:
    """The client's error for httpx's `exc`, the last of `attempts` tries (raise it `from
    exc`)."""
    reason = str(exc) or type(exc).__name__
    tries = f" (after {attempts} attempts)" if attempts > 1 else ""
    kind: type[TransportError]
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        kind, message = UnreachableError, f"cannot reach the Turnstile API at {base_url}"
    elif isinstance(exc, httpx.TimeoutException):
        kind, message = ResponseTimeoutError, f"the Turnstile API at {base_url} did not answer"
    else:
        kind, message = ConnectionLostError, f"the connection to {base_url} broke"
    return kind(
        f"{message}: {reason}{tries}",
        base_url=base_url,
        attempts=attempts,
        idempotency_key=idempotency_key,
    )


class ProblemError(ClientError):
    """The API answered with an error. `type`, `title`, `status`, `detail` and `instance` are
    the problem's fields; `body` is the whole document (extensions such as `errors` included);
    `retry_after` is the `Retry-After` header in seconds, when the answer had one."""

    slug: str | None = None  # the `/problems/<slug>` a subclass stands for

    def __init__(self, body: dict[str, Any], *, retry_after: float | None = None) -> None:
        self.body = body
        self.type = str(body.get("type", "about:blank"))
        self.title = str(body.get("title", ""))
        self.status = int(body.get("status", 0))
        detail = body.get("detail")
        self.detail = None if detail is None else str(detail)
        instance = body.get("instance")
        self.instance = None if instance is None else str(instance)
        self.retry_after = retry_after
        super().__init__(f"{self.status} {self.type}: {self.detail or self.title}")


class InvalidRequestError(ProblemError):
    """422 `invalid-request` (and 400 `malformed-json`): `errors` lists each problem."""

    slug = "invalid-request"

    @property
    def errors(self) -> list[dict[str, Any]]:
        return list(self.body.get("errors", []))


class UnauthorizedError(ProblemError):
    slug = "unauthorized"


class ForbiddenError(ProblemError):
    slug = "forbidden"


class NotFoundError(ProblemError):
    """404: no such session or run, or not one this key may see."""

    slug = "not-found"


class SessionBusyError(ProblemError):
    """409 `session-busy`: the session's run is queued or running; `active_run_id` names it
    (wait for it, or cancel it, then send the turn again)."""

    slug = "session-busy"

    def __init__(self, body: dict[str, Any], *, retry_after: float | None = None) -> None:
        super().__init__(body, retry_after=retry_after)
        self.active_run_id = UUID(str(body["active_run_id"]))
        self.active_run_status: str | None = body.get("active_run_status")


class RunFinishedError(ProblemError):
    """409 `run-finished`: a succeeded or failed run cannot be cancelled."""

    slug = "run-finished"


class AnswerConflictError(ProblemError):
    """422 `answer-conflict`: an answer tried to change the waiting run's agent, class or
    schedule; `field` names which."""

    slug = "answer-conflict"


class IdempotencyKeyReusedError(ProblemError):
    """422: this Idempotency-Key was used with another request; use a new key."""

    slug = "idempotency-key-reused"


class IdempotencyKeyInFlightError(ProblemError):
    """409: the first request with this key is still being processed (retried by the client
    until its attempts run out)."""

    slug = "idempotency-key-in-flight"


class TooManyStreamsError(ProblemError):
    """429: this key or API process holds too many event streams and long polls."""

    slug = "too-many-streams"


class QueueQuotaError(ProblemError):
    """429 `queue-quota`: the tenant's queued quota is full; retried (its runs start and make
    room), then raised."""

    slug = "queue-quota"


class RateLimitedError(ProblemError):
    """429 `rate-limited`: over the tenant's submission rate; nothing was written. Retried
    (honouring `Retry-After`), then raised; `retry_after` says when a token is back."""

    slug = "rate-limited"


class TooManyPendingTurnsError(ProblemError):
    """429 `too-many-pending-turns`: the session holds as many pending turns as it may
    (`max_pending`); not retried. Wait for its runs, or cancel a pending turn."""

    slug = "too-many-pending-turns"


class TurnStartedError(ProblemError):
    """409 `turn-started`: the pending turn became a run, or reached one (`run_id`); cancel
    that run instead."""

    slug = "turn-started"


class ApprovalPendingError(ProblemError):
    """409 `approval-pending`: the session's run waits for a tool call's approval (`call_id`,
    `tool`); only `approve`, `reject` or `edit` answers it."""

    slug = "approval-pending"

    def __init__(self, body: dict[str, Any], *, retry_after: float | None = None) -> None:
        super().__init__(body, retry_after=retry_after)
        self.call_id = str(body["call_id"])
        self.tool: str | None = body.get("tool")


class NoApprovalPendingError(ProblemError):
    """409 `no-approval-pending` or `approval-call-mismatch`: the run waits for no approval of
    this call (decided already, or it waits for `pending_call_id`)."""

    slug = "no-approval-pending"


class InvalidApprovalError(ProblemError):
    """422 `invalid-approval`: edited arguments outside the tool's schema (`errors`)."""

    slug = "invalid-approval"


class ServiceUnavailableError(ProblemError):
    """503 `database-busy` or `database-unavailable`: nothing was written; retried."""


_BY_SLUG: dict[str, type[ProblemError]] = {
    cls.slug: cls
    for cls in (
        InvalidRequestError,
        UnauthorizedError,
        ForbiddenError,
        NotFoundError,
        SessionBusyError,
        RunFinishedError,
        AnswerConflictError,
        IdempotencyKeyReusedError,
        IdempotencyKeyInFlightError,
        TooManyStreamsError,
        QueueQuotaError,
        RateLimitedError,
        TooManyPendingTurnsError,
        TurnStartedError,
        ApprovalPendingError,
        NoApprovalPendingError,
        InvalidApprovalError,
    )
    if cls.slug is not None
} | {
    "approval-call-mismatch": NoApprovalPendingError,
    "malformed-json": InvalidRequestError,
    "database-busy": ServiceUnavailableError,
    "database-unavailable": ServiceUnavailableError,
}


def slug_of(problem_type: str) -> str:
    """`/problems/session-busy` -> `session-busy`."""
    return problem_type.rstrip("/").rsplit("/", 1)[-1]


def problem_from(response: httpx.Response, *, retry_after: float | None) -> ProblemError:
    """The exception for an error answer that has been read. A body that is not a problem
    document (a proxy's HTML page, say) still gives a ProblemError with the status."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or "type" not in body:
        body = {
            "type": "about:blank",
            "title": response.reason_phrase,
            "status": response.status_code,
            "detail": response.text[:500] or None,
        }
    body.setdefault("status", response.status_code)
    cls = _BY_SLUG.get(slug_of(str(body["type"])), ProblemError)
    try:
        return cls(body, retry_after=retry_after)
    except (KeyError, ValueError):  # a subclass's own field missing: keep the plain problem
        return ProblemError(body, retry_after=retry_after)


class WaitTimeoutError(ClientError, TimeoutError):
    """`wait` ran out of time before the run settled; `run` is how it was last seen."""

    def __init__(self, run: Any, timeout: float) -> None:
        super().__init__(f"run {run.id} still {run.status} after {timeout:g} s")
        self.run = run


class StreamEndedError(ClientError):
    """A run's event stream kept ending before the run's terminal event, and the client gave up
    reconnecting (the API processes were stopping, say)."""
