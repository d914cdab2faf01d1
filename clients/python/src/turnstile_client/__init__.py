"""The Python client of the Turnstile API (the `turnstile-client` distribution): `AsyncTurnstile`
(asyncio) and `Turnstile` (blocking, the same methods), on httpx.

It shares nothing with the server (no FastAPI, SQLAlchemy or asyncpg, and no `app` package:
tests/test_architecture.py holds the rule), so a program that only calls the API installs and
loads httpx and httpx-sse alone, and its own `app` package collides with nothing.

    async with AsyncTurnstile("http://127.0.0.1:8000", api_key) as turnstile:
        session = await turnstile.create_session()
        run = await turnstile.submit_turn(session, {"text": "hello"})
        run = await turnstile.wait(run, timeout=60)
"""

from turnstile_client.aio import AsyncTurnstile
from turnstile_client.blocking import Turnstile
from turnstile_client.errors import (
    AnswerConflictError,
    ApprovalPendingError,
    ClientError,
    ConnectionLostError,
    ForbiddenError,
    IdempotencyKeyInFlightError,
    IdempotencyKeyReusedError,
    InvalidApprovalError,
    InvalidRequestError,
    NoApprovalPendingError,
    NotFoundError,
    ProblemError,
    QueueQuotaError,
    RateLimitedError,
    ResponseTimeoutError,
    RunFinishedError,
    ServiceUnavailableError,
    SessionBusyError,
    StreamEndedError,
    TooManyPendingTurnsError,
    TooManyStreamsError,
    TransportError,
    TurnStartedError,
    UnauthorizedError,
    UnreachableError,
    WaitTimeoutError,
)
from turnstile_client.models import (
    SETTLED_STATUSES,
    TERMINAL_STATUSES,
    ApprovalPolicy,
    Delta,
    Event,
    LiveText,
    MultitaskPolicy,
    PendingTurn,
    PriorityClass,
    Run,
    RunStatus,
    Session,
    SessionState,
)
from turnstile_client.retry import RetryPolicy

__all__ = [
    "SETTLED_STATUSES",
    "TERMINAL_STATUSES",
    "AnswerConflictError",
    "ApprovalPendingError",
    "ApprovalPolicy",
    "AsyncTurnstile",
    "ClientError",
    "ConnectionLostError",
    "Delta",
    "Event",
    "ForbiddenError",
    "IdempotencyKeyInFlightError",
    "IdempotencyKeyReusedError",
    "InvalidApprovalError",
    "InvalidRequestError",
    "LiveText",
    "MultitaskPolicy",
    "NoApprovalPendingError",
    "NotFoundError",
    "PendingTurn",
    "PriorityClass",
    "ProblemError",
    "QueueQuotaError",
    "RateLimitedError",
    "ResponseTimeoutError",
    "RetryPolicy",
    "Run",
    "RunFinishedError",
    "RunStatus",
    "ServiceUnavailableError",
    "Session",
    "SessionBusyError",
    "SessionState",
    "StreamEndedError",
    "TooManyPendingTurnsError",
    "TooManyStreamsError",
    "TransportError",
    "TurnStartedError",
    "Turnstile",
    "UnauthorizedError",
    "UnreachableError",
    "WaitTimeoutError",
]
