"""`Turnstile`: the blocking client of the Turnstile API, on httpx; the same methods, retries
and resume rules as `AsyncTurnstile` (app/client/aio.py), for code without an event loop.

Submissions carry an `Idempotency-Key` (one is made when the caller gives none) and are
retried with that same key (app/client/retry.py), so a turn whose answer was lost is replayed,
never run twice. `wait` follows a run with the API's long poll; `events` follows its log over
Server-Sent Events (httpx-sse) and, when the connection drops, reconnects with
`Last-Event-ID`, so no event is missed or repeated.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Generator
from datetime import datetime
from types import TracebackType
from typing import Any

import httpx
from httpx_sse import connect_sse

from app.client import calls
from app.client.calls import RunRef, SessionRef
from app.client.errors import StreamEndedError, WaitTimeoutError, problem_from
from app.client.models import (
    JSON,
    SETTLED_STATUSES,
    Delta,
    Event,
    PriorityClass,
    Run,
    Session,
)
from app.client.retry import (
    RETRIED_TRANSPORT_ERRORS,
    RetryPolicy,
    retry_after_of,
    retryable_answer,
)


class Turnstile:
    """The API at `base_url`, as the holder of `api_key`. Use it as a context manager, or call
    `close()` when done."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.retry = retry or RetryPolicy()
        self.timeout = timeout
        self._http = httpx.Client(
            base_url=base_url,
            headers=calls.default_headers(api_key),
            timeout=timeout,
            transport=transport,
        )

    def __enter__(self) -> Turnstile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # --- sessions and submissions --------------------------------------------------------------
    def create_session(self) -> Session:
        return calls.as_session(self._send(calls.create_session()))

    def get_session(self, session: SessionRef) -> Session:
        return calls.as_session(self._send(calls.get_session(session)))

    def submit_turn(
        self,
        session: SessionRef,
        input: JSON,
        *,
        agent: str | None = None,
        priority: PriorityClass | None = None,
        scheduled_for: datetime | str | None = None,
        idempotency_key: str | None = None,
    ) -> Run:
        """A user's turn: a new run, or, when the session's run waits for the user, the answer
        that sends that same run back to the queue. Raises `SessionBusyError` (with
        `active_run_id`) when the session's run is queued or running."""
        body = calls.submission_body(input, agent, priority, scheduled_for)
        key = idempotency_key or calls.new_idempotency_key()
        return calls.as_run(self._send(calls.submit_turn(session, body, key)))

    def answer(self, run: Run, input: JSON, *, idempotency_key: str | None = None) -> Run:
        """Answer the question of a run waiting for the user: its session's next turn."""
        if run.session_id is None:
            raise ValueError("only a session's run can be answered")
        return self.submit_turn(run.session_id, input, idempotency_key=idempotency_key)

    def submit_run(
        self,
        input: JSON,
        *,
        agent: str | None = None,
        priority: PriorityClass | None = None,
        scheduled_for: datetime | str | None = None,
        idempotency_key: str | None = None,
    ) -> Run:
        """A sessionless run (back-end work, `async` unless `priority` says otherwise)."""
        body = calls.submission_body(input, agent, priority, scheduled_for)
        key = idempotency_key or calls.new_idempotency_key()
        return calls.as_run(self._send(calls.submit_run(body, key)))

    # --- runs ----------------------------------------------------------------------------------
    def get_run(self, run: RunRef) -> Run:
        return calls.as_run(self._send(calls.get_run(run)))

    def wait(
        self,
        run: RunRef,
        timeout: float | None = None,
        *,
        until: Collection[str] = SETTLED_STATUSES,
    ) -> Run:
        """The run once its status is one of `until` (by default: finished, or waiting for the
        user), following it with long polls of at most a minute each. Raises
        `WaitTimeoutError` (carrying the run as last seen) after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        current = run if isinstance(run, Run) else self.get_run(run)
        while current.status not in until:
            remaining = calls.MAX_WAIT_SECONDS if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeoutError(current, timeout or 0.0)
            seconds = min(remaining, calls.MAX_WAIT_SECONDS)
            current = calls.as_run(
                self._send(calls.poll_run(current, current.status, seconds, self.timeout))
            )
        return current

    def cancel(self, run: RunRef) -> Run:
        """Cancel from any non-terminal status; a cancelled run answers again. Raises
        `RunFinishedError` for a run that succeeded or failed."""
        return calls.as_run(self._send(calls.cancel(run)))

    def events(self, run: RunRef, *, after: int = 0) -> Generator[Event, None, None]:
        """The run's events after sequence number `after`, in order, as they happen; ends after
        the run's terminal event. A dropped connection is resumed with `Last-Event-ID`, so each
        event comes exactly once."""
        last = after
        failures = 0
        while True:
            fresh = False
            try:
                with connect_sse(
                    self._http,
                    "GET",
                    calls.events_path(run),
                    headers=calls.stream_headers(last),
                    timeout=httpx.Timeout(self.timeout, read=calls.STREAM_READ_TIMEOUT),
                ) as source:
                    response = source.response
                    if response.is_error:
                        response.read()
                        retry_after = retry_after_of(response)
                        failures += 1
                        if not retryable_answer(response) or failures >= self.retry.attempts:
                            raise problem_from(response, retry_after=retry_after)
                        time.sleep(self.retry.delay(failures, retry_after))
                        continue
                    for message in source.iter_sse():
                        if not message.data or message.event in (
                            calls.DELTA_EVENT,
                            calls.ENDED_EVENT,
                        ):
                            continue  # live text (session_events shows it), or the end
                        event = calls.decode_event(message.data)
                        if event.seq <= last:
                            continue  # already delivered before a reconnect
                        last, fresh, failures = event.seq, True, 0
                        yield event
                        if event.terminal:
                            return
            except RETRIED_TRANSPORT_ERRORS:
                failures += 1
                if failures >= self.retry.attempts:
                    raise
                time.sleep(self.retry.delay(failures, None))
                continue
            # The stream ended cleanly before the terminal event: the API process is stopping
            # (reconnect, maybe to another), or the run finished with nothing left to send.
            if not fresh:
                if (self.get_run(run)).finished:
                    return
                failures += 1
                if failures >= self.retry.attempts:
                    raise StreamEndedError(f"the event stream of run {calls.run_id(run)} ended")
                time.sleep(self.retry.delay(failures, None))

    def session_events(
        self, session: SessionRef, *, after: str | None = None
    ) -> Generator[Event | Delta, None, None]:
        """The conversation's stream (`GET /sessions/{id}/events`): the durable events of all
        the session's runs in order (each an `Event` with `run_id` and `run_no`) and live
        `Delta`s of the messages being written, after the event id `after` (`<run_no>.<seq>`).
        It does not end with a run: stop iterating to leave. A dropped connection is resumed
        with `Last-Event-ID`, so each durable event comes exactly once; deltas missed while
        disconnected are gone (their `message.completed` is not). `LiveText` assembles the
        deltas and drops those of an older epoch."""
        last = calls.session_position(after) if after else None
        failures = 0
        while True:
            try:
                with connect_sse(
                    self._http,
                    "GET",
                    calls.session_events_path(session),
                    headers=calls.session_stream_headers(last),
                    timeout=httpx.Timeout(self.timeout, read=calls.STREAM_READ_TIMEOUT),
                ) as source:
                    response = source.response
                    if response.is_error:
                        response.read()
                        retry_after = retry_after_of(response)
                        failures += 1
                        if not retryable_answer(response) or failures >= self.retry.attempts:
                            raise problem_from(response, retry_after=retry_after)
                        time.sleep(self.retry.delay(failures, retry_after))
                        continue
                    for message in source.iter_sse():
                        if not message.data or message.event == calls.ENDED_EVENT:
                            continue
                        item = calls.decode_item(message.event, message.data)
                        if isinstance(item, Event):
                            if last is not None and item.position <= last:
                                continue  # already delivered before a reconnect
                            last = item.position
                        failures = 0
                        yield item
            except RETRIED_TRANSPORT_ERRORS:
                failures += 1
                if failures >= self.retry.attempts:
                    raise
                time.sleep(self.retry.delay(failures, None))
                continue
            # The stream ended cleanly: the API process is stopping. Reconnect (maybe to
            # another), after a pause.
            failures += 1
            if failures >= self.retry.attempts:
                raise StreamEndedError(
                    f"the event stream of session {calls.session_id(session)} ended"
                )
            time.sleep(self.retry.delay(failures, None))

    # --- sending -------------------------------------------------------------------------------
    def _send(self, call: calls.Call) -> Any:
        """The answer's JSON; retried as the policy says, else a ProblemError."""
        attempt = 0
        while True:
            attempt += 1
            try:
                response = self._http.request(
                    call.method,
                    call.path,
                    json=call.json,
                    params=call.params,
                    headers=call.headers,
                    timeout=self.timeout if call.timeout is None else call.timeout,
                )
            except RETRIED_TRANSPORT_ERRORS:
                if not call.retry or attempt >= self.retry.attempts:
                    raise
                time.sleep(self.retry.delay(attempt, None))
                continue
            if response.is_success:
                return response.json()
            retry_after = retry_after_of(response)
            if call.retry and retryable_answer(response) and attempt < self.retry.attempts:
                time.sleep(self.retry.delay(attempt, retry_after))
                continue
            raise problem_from(response, retry_after=retry_after)
