"""`AsyncTurnstile`: the asyncio client of the Turnstile API, on httpx; the one implementation
of the client (the blocking `Turnstile`, blocking.py, runs these same methods).

Submissions carry an `Idempotency-Key` (one is made when the caller gives none) and are
retried with that same key (retry.py), so a turn whose answer was lost is replayed, never run
twice. `wait` follows a run with the API's long poll; `events` follows its log over
Server-Sent Events (httpx-sse) and, when the connection drops, reconnects with
`Last-Event-ID`, so no event is missed or repeated.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Collection
from datetime import datetime
from types import TracebackType
from typing import Any

import httpx
from httpx_sse import aconnect_sse

from turnstile_client import calls
from turnstile_client.calls import PendingTurnRef, RunRef, SessionRef
from turnstile_client.errors import (
    StreamEndedError,
    TransportError,
    WaitTimeoutError,
    problem_from,
    transport_error,
)
from turnstile_client.models import (
    JSON,
    SETTLED_STATUSES,
    ApprovalPolicy,
    Delta,
    Event,
    MultitaskPolicy,
    PendingTurn,
    PriorityClass,
    Run,
    Session,
)
from turnstile_client.retry import (
    RETRIED_TRANSPORT_ERRORS,
    RetryPolicy,
    retry_after_of,
    retryable_answer,
)


class AsyncTurnstile:
    """The API at `base_url`, as the holder of `api_key`. Use it as an async context manager,
    or call `aclose()` when done."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.retry = retry or RetryPolicy()
        self.timeout = timeout
        self.base_url = calls.checked_base_url(base_url)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=calls.default_headers(api_key),
            timeout=timeout,
            transport=transport,
        )

    async def __aenter__(self) -> AsyncTurnstile:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # --- sessions and submissions --------------------------------------------------------------
    async def create_session(
        self,
        *,
        multitask: MultitaskPolicy | None = None,
        approval: ApprovalPolicy | None = None,
    ) -> Session:
        """A new session; `multitask` sets what a turn does while its run is active (default
        reject), `approval` which tool calls of its runs wait for a user's approval (default:
        the server's)."""
        return calls.as_session(await self._send(calls.create_session(multitask, approval)))

    async def set_approval(self, session: SessionRef, approval: ApprovalPolicy | None) -> Session:
        """Change the session's approval policy (None: back to the server's default); its
        runs follow it from their next tool call."""
        return calls.as_session(await self._send(calls.update_approval(session, approval)))

    # --- approval before a tool call (the server's docs/approvals.md) --------------------------
    async def approve(
        self, run: RunRef, *, call_id: str | None = None, idempotency_key: str | None = None
    ) -> Run:
        """Approve the tool call the run waits for (by default the one `run.approval_request`
        names): the same run goes back to the queue and makes the call once."""
        return await self._decide(
            run, calls.decision_body(run, call_id, "approve"), idempotency_key
        )

    async def reject(
        self,
        run: RunRef,
        reason: str | None = None,
        *,
        call_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> Run:
        """Refuse the call: it is never made, and the agent is told so, with `reason`."""
        body = calls.decision_body(run, call_id, "reject", reason=reason)
        return await self._decide(run, body, idempotency_key)

    async def edit(
        self,
        run: RunRef,
        args: dict[str, JSON],
        *,
        reason: str | None = None,
        call_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> Run:
        """Approve the call with other arguments, checked against the tool's schema (raises
        `InvalidApprovalError` when they do not fit it)."""
        body = calls.decision_body(run, call_id, "edit", args=args, reason=reason)
        return await self._decide(run, body, idempotency_key)

    async def _decide(self, run: RunRef, body: dict[str, Any], key: str | None) -> Run:
        # A retry with the same key replays the first decision instead of refusing a second.
        key = key or calls.new_idempotency_key()
        return calls.as_run(await self._send(calls.decide(run, body, key)))

    async def set_multitask(self, session: SessionRef, multitask: MultitaskPolicy) -> Session:
        """Change the session's policy, for turns that arrive from now on."""
        return calls.as_session(await self._send(calls.update_session(session, multitask)))

    async def list_pending_turns(self, session: SessionRef) -> list[PendingTurn]:
        """The session's pending turns in the order they will start (1 is next)."""
        return calls.as_pending_turns(await self._send(calls.list_pending_turns(session)))

    async def get_pending_turn(self, turn: PendingTurnRef) -> PendingTurn:
        """A pending turn as it stands: its position, or the run it became (`run_id`)."""
        return calls.as_pending_turn(await self._send(calls.get_pending_turn(turn)))

    async def cancel_pending_turn(self, turn: PendingTurnRef) -> PendingTurn:
        """Withdraw a pending turn before it starts (a cancelled one answers again). Raises
        `TurnStartedError` (with `run_id`) once it has become a run or reached one."""
        return calls.as_pending_turn(await self._send(calls.cancel_pending_turn(turn)))

    async def get_session(self, session: SessionRef) -> Session:
        return calls.as_session(await self._send(calls.get_session(session)))

    async def submit_turn(
        self,
        session: SessionRef,
        input: JSON,
        *,
        agent: str | None = None,
        priority: PriorityClass | None = None,
        scheduled_for: datetime | str | None = None,
        start_within: float | None = None,
        start_before: datetime | str | None = None,
        idempotency_key: str | None = None,
        multitask: MultitaskPolicy | None = None,
        approval: ApprovalPolicy | None = None,
    ) -> Run | PendingTurn:
        """A user's turn: a new run, or, when the session's run waits for the user, the answer
        that sends that same run back to the queue. When the session's run is queued or
        running, the multitask policy decides (`multitask`, else the session's): reject raises
        `SessionBusyError` (with `active_run_id`); enqueue, and interrupt of a running run,
        answer a `PendingTurn` (follow it with `get_pending_turn`); interrupt of a queued run
        answers the new run; steer answers the active run (same id). `start_within` (seconds
        after the run becomes eligible) or `start_before` (a time) gives a new run a deadline to
        start: still queued then, it ends `cancelled` with reason `expired`."""
        body = calls.submission_body(
            input, agent, priority, scheduled_for, start_within, start_before, multitask, approval
        )
        key = idempotency_key or calls.new_idempotency_key()
        return calls.as_submitted(await self._send(calls.submit_turn(session, body, key)))

    async def answer(self, run: Run, input: JSON, *, idempotency_key: str | None = None) -> Run:
        """Answer the question of a run waiting for the user: its session's next turn."""
        if run.session_id is None:
            raise ValueError("only a session's run can be answered")
        # A run waiting for the user takes the turn as its answer whatever the policy.
        answered = await self.submit_turn(run.session_id, input, idempotency_key=idempotency_key)
        if not isinstance(answered, Run):
            raise ValueError(f"the session's run {run.id} was not waiting for the user")
        return answered

    async def submit_run(
        self,
        input: JSON,
        *,
        agent: str | None = None,
        priority: PriorityClass | None = None,
        scheduled_for: datetime | str | None = None,
        start_within: float | None = None,
        start_before: datetime | str | None = None,
        idempotency_key: str | None = None,
        approval: ApprovalPolicy | None = None,
    ) -> Run:
        """A sessionless run (back-end work, `async` unless `priority` says otherwise), with an
        optional deadline to start as for `submit_turn`, and `approval`: which of its tool
        calls wait for `approve`, `reject` or `edit`."""
        body = calls.submission_body(
            input, agent, priority, scheduled_for, start_within, start_before, approval=approval
        )
        key = idempotency_key or calls.new_idempotency_key()
        return calls.as_run(await self._send(calls.submit_run(body, key)))

    # --- runs ----------------------------------------------------------------------------------
    async def get_run(self, run: RunRef) -> Run:
        return calls.as_run(await self._send(calls.get_run(run)))

    async def wait(
        self,
        run: RunRef,
        timeout: float | None = None,  # noqa: ASYNC109 (the deadline spans many long polls)
        *,
        until: Collection[str] = SETTLED_STATUSES,
    ) -> Run:
        """The run once its status is one of `until` (by default: finished, or waiting for the
        user), following it with long polls of at most a minute each. Raises
        `WaitTimeoutError` (carrying the run as last seen) after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        current = run if isinstance(run, Run) else await self.get_run(run)
        while current.status not in until:
            remaining = calls.MAX_WAIT_SECONDS if deadline is None else deadline - loop.time()
            if remaining <= 0:
                raise WaitTimeoutError(current, timeout or 0.0)
            seconds = min(remaining, calls.MAX_WAIT_SECONDS)
            current = calls.as_run(
                await self._send(calls.poll_run(current, current.status, seconds, self.timeout))
            )
        return current

    async def cancel(self, run: RunRef, *, reason: str | None = None) -> Run:
        """Cancel from any non-terminal status; a cancelled run answers again. `reason` goes
        into its `run.cancelled` event and webhook. Raises `RunFinishedError` for a run that
        succeeded or failed."""
        return calls.as_run(await self._send(calls.cancel(run, reason)))

    async def events(self, run: RunRef, *, after: int = 0) -> AsyncGenerator[Event, None]:
        """The run's events after sequence number `after`, in order, as they happen; ends after
        the run's terminal event. A dropped connection is resumed with `Last-Event-ID`, so each
        event comes exactly once."""
        last = after
        failures = 0
        while True:
            fresh = False
            try:
                async with aconnect_sse(
                    self._http,
                    "GET",
                    calls.events_path(run),
                    headers=calls.stream_headers(last),
                    timeout=httpx.Timeout(self.timeout, read=calls.STREAM_READ_TIMEOUT),
                ) as source:
                    response = source.response
                    if response.is_error:
                        await response.aread()
                        retry_after = retry_after_of(response)
                        failures += 1
                        if not retryable_answer(response) or failures >= self.retry.attempts:
                            raise problem_from(response, retry_after=retry_after)
                        await asyncio.sleep(self.retry.delay(failures, retry_after))
                        continue
                    async for message in source.aiter_sse():
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
            except RETRIED_TRANSPORT_ERRORS as exc:
                failures += 1
                if failures >= self.retry.attempts:
                    raise self._transport_error(exc, failures) from exc
                await asyncio.sleep(self.retry.delay(failures, None))
                continue
            # The stream ended cleanly before the terminal event: the API process is stopping
            # (reconnect, maybe to another), or the run finished with nothing left to send.
            if not fresh:
                if (await self.get_run(run)).finished:
                    return
                failures += 1
                if failures >= self.retry.attempts:
                    raise StreamEndedError(f"the event stream of run {calls.run_id(run)} ended")
                await asyncio.sleep(self.retry.delay(failures, None))

    async def session_events(
        self, session: SessionRef, *, after: str | None = None
    ) -> AsyncGenerator[Event | Delta, None]:
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
                async with aconnect_sse(
                    self._http,
                    "GET",
                    calls.session_events_path(session),
                    headers=calls.session_stream_headers(last),
                    timeout=httpx.Timeout(self.timeout, read=calls.STREAM_READ_TIMEOUT),
                ) as source:
                    response = source.response
                    if response.is_error:
                        await response.aread()
                        retry_after = retry_after_of(response)
                        failures += 1
                        if not retryable_answer(response) or failures >= self.retry.attempts:
                            raise problem_from(response, retry_after=retry_after)
                        await asyncio.sleep(self.retry.delay(failures, retry_after))
                        continue
                    async for message in source.aiter_sse():
                        if not message.data or message.event == calls.ENDED_EVENT:
                            continue
                        item = calls.decode_item(message.event, message.data)
                        if isinstance(item, Event):
                            if last is not None and item.position <= last:
                                continue  # already delivered before a reconnect
                            last = item.position
                        failures = 0
                        yield item
            except RETRIED_TRANSPORT_ERRORS as exc:
                failures += 1
                if failures >= self.retry.attempts:
                    raise self._transport_error(exc, failures) from exc
                await asyncio.sleep(self.retry.delay(failures, None))
                continue
            # The stream ended cleanly: the API process is stopping. Reconnect (maybe to
            # another), after a pause.
            failures += 1
            if failures >= self.retry.attempts:
                raise StreamEndedError(
                    f"the event stream of session {calls.session_id(session)} ended"
                )
            await asyncio.sleep(self.retry.delay(failures, None))

    # --- sending -------------------------------------------------------------------------------
    async def _send(self, call: calls.Call) -> Any:
        """The answer's JSON; retried as the policy says, else a ProblemError."""
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await self._http.request(
                    call.method,
                    call.path,
                    json=call.json,
                    params=call.params,
                    headers=call.headers,
                    timeout=self.timeout if call.timeout is None else call.timeout,
                )
            except RETRIED_TRANSPORT_ERRORS as exc:
                if not call.retry or attempt >= self.retry.attempts:
                    key = call.headers.get("Idempotency-Key")
                    raise self._transport_error(exc, attempt, key) from exc
                await asyncio.sleep(self.retry.delay(attempt, None))
                continue
            if response.is_success:
                return response.json()
            retry_after = retry_after_of(response)
            if call.retry and retryable_answer(response) and attempt < self.retry.attempts:
                await asyncio.sleep(self.retry.delay(attempt, retry_after))
                continue
            raise problem_from(response, retry_after=retry_after)

    def _transport_error(
        self, exc: httpx.TransportError, attempts: int, key: str | None = None
    ) -> TransportError:
        return transport_error(exc, base_url=self.base_url, attempts=attempts, idempotency_key=key)
