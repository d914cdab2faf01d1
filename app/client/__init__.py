"""The Python client of the Turnstile API: `AsyncTurnstile` (asyncio) and `Turnstile`
(blocking), on httpx.

It imports nothing of the server (no FastAPI, SQLAlchemy or asyncpg; tests/test_architecture.py
holds the rule), so a program that only calls the API pays for httpx and httpx-sse alone.

    async with AsyncTurnstile("http://127.0.0.1:8000", api_key) as turnstile:
        session = await turnstile.create_session()
        run = await turnstile.submit_turn(session, {"text": "hello"})
        run = await turnstile.wait(run, timeout=60)
"""

from app.client.aio import AsyncTurnstile
from app.client.errors import (
    AnswerConflictError,
    ClientError,
    ForbiddenError,
    IdempotencyKeyInFlightError,
    IdempotencyKeyReusedError,
    InvalidRequestError,
    NotFoundError,
    ProblemError,
    QueueQuotaError,
    RunFinishedError,
    ServiceUnavailableError,
    SessionBusyError,
    StreamEndedError,
    TooManyStreamsError,
    UnauthorizedError,
    WaitTimeoutError,
)
from app.client.models import (
    SETTLED_STATUSES,
    TERMINAL_STATUSES,
    Delta,
    Event,
    LiveText,
    PriorityClass,
    Run,
    RunStatus,
    Session,
    SessionState,
)
from app.client.retry import RetryPolicy
from app.client.sync import Turnstile

__all__ = [
    "SETTLED_STATUSES",
    "TERMINAL_STATUSES",
    "AnswerConflictError",
    "AsyncTurnstile",
    "ClientError",
    "Delta",
    "Event",
    "ForbiddenError",
    "IdempotencyKeyInFlightError",
    "IdempotencyKeyReusedError",
    "InvalidRequestError",
    "LiveText",
    "NotFoundError",
    "PriorityClass",
    "ProblemError",
    "QueueQuotaError",
    "RetryPolicy",
    "Run",
    "RunFinishedError",
    "RunStatus",
    "ServiceUnavailableError",
    "Session",
    "SessionBusyError",
    "SessionState",
    "StreamEndedError",
    "TooManyStreamsError",
    "Turnstile",
    "UnauthorizedError",
    "WaitTimeoutError",
]
