/**
 * The client's errors. Every problem+json answer (RFC 9457) becomes a `ProblemError` carrying
 * its fields, or the subclass named after its `type`, so callers catch what they can handle
 * (`SessionBusyError` and its `activeRunId`) and let the rest rise. A request that got no
 * answer at all, once its retries ran out, is a `TransportError`: `UnreachableError`,
 * `ConnectionLostError` or `ResponseTimeoutError`, with fetch's own error as its `cause`.
 */

import type { PendingTurn, Problem, Run, RunStatus } from "./models.js";

/** The root of the client's own errors. */
export class TurnstileError extends Error {
  override name = "TurnstileError";
}

/**
 * The API answered with an error. `type`, `title`, `status`, `detail` and `instance` are the
 * problem's fields; `body` is the whole document (extensions such as `errors` included);
 * `retryAfter` is the `Retry-After` header in seconds, when the answer had one.
 */
export class ProblemError extends TurnstileError {
  override name = "ProblemError";
  readonly type: string;
  readonly title: string;
  readonly status: number;
  readonly detail: string | null;
  readonly instance: string | null;

  constructor(
    readonly body: Problem,
    readonly retryAfter: number | null = null,
  ) {
    super(`${body.status} ${body.type}: ${body.detail ?? body.title}`);
    this.type = body.type;
    this.title = body.title;
    this.status = body.status;
    this.detail = body.detail ?? null;
    this.instance = body.instance ?? null;
  }
}

/** 422 `invalid-request` (and 400 `malformed-json`): `errors` lists each problem. */
export class InvalidRequestError extends ProblemError {
  override name = "InvalidRequestError";
  get errors(): Array<Record<string, unknown>> {
    const errors = this.body["errors"];
    return Array.isArray(errors) ? (errors as Array<Record<string, unknown>>) : [];
  }
}

export class UnauthorizedError extends ProblemError {
  override name = "UnauthorizedError";
}

export class ForbiddenError extends ProblemError {
  override name = "ForbiddenError";
}

/** 404: no such session or run, or not one this key may see. */
export class NotFoundError extends ProblemError {
  override name = "NotFoundError";
}

/**
 * 409 `session-busy`: the session's run is queued or running; `activeRunId` names it (wait for
 * it, or cancel it, then send the turn again).
 */
export class SessionBusyError extends ProblemError {
  override name = "SessionBusyError";
  readonly activeRunId: string;
  readonly activeRunStatus: RunStatus | null;

  constructor(body: Problem, retryAfter: number | null = null) {
    super(body, retryAfter);
    this.activeRunId = String(body["active_run_id"]);
    this.activeRunStatus = (body["active_run_status"] as RunStatus | undefined) ?? null;
  }
}

/** 409 `run-finished`: a succeeded or failed run cannot be cancelled. */
export class RunFinishedError extends ProblemError {
  override name = "RunFinishedError";
}

/** 422 `answer-conflict`: an answer tried to change the waiting run's agent, class or schedule. */
export class AnswerConflictError extends ProblemError {
  override name = "AnswerConflictError";
  get field(): string | null {
    const field = this.body["field"];
    return typeof field === "string" ? field : null;
  }
}

/** 422: this Idempotency-Key was used with another request; use a new key. */
export class IdempotencyKeyReusedError extends ProblemError {
  override name = "IdempotencyKeyReusedError";
}

/** 409: the first request with this key is still being processed (retried, then raised). */
export class IdempotencyKeyInFlightError extends ProblemError {
  override name = "IdempotencyKeyInFlightError";
}

/** 429: this key or API process holds too many event streams and long polls. */
export class TooManyStreamsError extends ProblemError {
  override name = "TooManyStreamsError";
}

/** 429 `queue-quota`: the tenant's queued quota is full (retried, then raised). */
export class QueueQuotaError extends ProblemError {
  override name = "QueueQuotaError";
}

/** 429 `rate-limited`: over the tenant's submission rate; `retryAfter` says when to try again. */
export class RateLimitedError extends ProblemError {
  override name = "RateLimitedError";
}

/**
 * 429 `too-many-pending-turns`: the session holds as many pending turns as it may
 * (`maxPending`); nothing was written. Not retried: the session's runs must end first (minutes,
 * not a backoff). Wait for them, or cancel a pending turn.
 */
export class TooManyPendingTurnsError extends ProblemError {
  override name = "TooManyPendingTurnsError";
  readonly maxPending: number | null;

  constructor(body: Problem, retryAfter: number | null = null) {
    super(body, retryAfter);
    const max = body["max_pending"];
    this.maxPending = typeof max === "number" ? max : null;
  }
}

/**
 * 409 `turn-started`: the pending turn can no longer be withdrawn; it became a run, or was
 * delivered to the active run (`runId`, `turnStatus`). Cancel that run instead.
 */
export class TurnStartedError extends ProblemError {
  override name = "TurnStartedError";
  readonly runId: string | null;
  readonly turnStatus: string | null;

  constructor(body: Problem, retryAfter: number | null = null) {
    super(body, retryAfter);
    this.runId = stringOrNull(body["run_id"]);
    this.turnStatus = stringOrNull(body["turn_status"]);
  }
}

/**
 * 409 `approval-pending`: the session's run (`runId`) waits for the approval of a tool call
 * (`callId`, `tool`); only `approve`, `reject` or `edit` answers it, whatever the multitask
 * policy. Nothing was written.
 */
export class ApprovalPendingError extends ProblemError {
  override name = "ApprovalPendingError";
  readonly callId: string;
  readonly tool: string | null;
  readonly runId: string | null;

  constructor(body: Problem, retryAfter: number | null = null) {
    super(body, retryAfter);
    this.callId = String(body["call_id"]);
    this.tool = stringOrNull(body["tool"]);
    this.runId = stringOrNull(body["run_id"]);
  }
}

/**
 * 409 `no-approval-pending`: the run waits for no approval of this call (`callId`): it was
 * decided already, by this request without its key or by another, or the run never asked
 * (`runStatus` says where it is). Nothing was written.
 */
export class NoApprovalPendingError extends ProblemError {
  override name = "NoApprovalPendingError";
  get callId(): string | null {
    return stringOrNull(this.body["call_id"]);
  }
  get runStatus(): RunStatus | null {
    return stringOrNull(this.body["run_status"]) as RunStatus | null;
  }
}

/**
 * 409 `approval-call-mismatch`: the decision names another call than the one the run waits
 * for (`pendingCallId`, `tool`). A `NoApprovalPendingError`: nothing waits for `callId`.
 */
export class ApprovalCallMismatchError extends NoApprovalPendingError {
  override name = "ApprovalCallMismatchError";
  get pendingCallId(): string | null {
    return stringOrNull(this.body["pending_call_id"]);
  }
  get tool(): string | null {
    return stringOrNull(this.body["tool"]);
  }
}

/** 422 `invalid-approval`: edited arguments outside the tool's schema; `errors` says where. */
export class InvalidApprovalError extends ProblemError {
  override name = "InvalidApprovalError";
  get errors(): Array<Record<string, unknown>> {
    const errors = this.body["errors"];
    return Array.isArray(errors) ? (errors as Array<Record<string, unknown>>) : [];
  }
}

/** 503 `database-busy` or `database-unavailable`: nothing was written (retried, then raised). */
export class ServiceUnavailableError extends ProblemError {
  override name = "ServiceUnavailableError";
}

function stringOrNull(value: unknown): string | null {
  return typeof value === "string" ? value : null;
}

type ProblemClass = new (body: Problem, retryAfter: number | null) => ProblemError;

const BY_SLUG: ReadonlyMap<string, ProblemClass> = new Map<string, ProblemClass>([
  ["invalid-request", InvalidRequestError],
  ["malformed-json", InvalidRequestError],
  ["unauthorized", UnauthorizedError],
  ["forbidden", ForbiddenError],
  ["not-found", NotFoundError],
  ["session-busy", SessionBusyError],
  ["run-finished", RunFinishedError],
  ["answer-conflict", AnswerConflictError],
  ["idempotency-key-reused", IdempotencyKeyReusedError],
  ["idempotency-key-in-flight", IdempotencyKeyInFlightError],
  ["too-many-streams", TooManyStreamsError],
  ["queue-quota", QueueQuotaError],
  ["rate-limited", RateLimitedError],
  ["too-many-pending-turns", TooManyPendingTurnsError],
  ["turn-started", TurnStartedError],
  ["approval-pending", ApprovalPendingError],
  ["no-approval-pending", NoApprovalPendingError],
  ["approval-call-mismatch", ApprovalCallMismatchError],
  ["invalid-approval", InvalidApprovalError],
  ["database-busy", ServiceUnavailableError],
  ["database-unavailable", ServiceUnavailableError],
]);

/** `/problems/session-busy` -> `session-busy`. */
export function slugOf(problemType: string): string {
  return problemType.replace(/\/+$/, "").split("/").pop() ?? "";
}

/**
 * The error for an answer's status and text. A body that is not a problem document (a proxy's
 * HTML page, say) still gives a ProblemError with the status.
 */
export function problemFrom(
  status: number,
  statusText: string,
  text: string,
  retryAfter: number | null,
): ProblemError {
  let parsed: unknown = null;
  try {
    parsed = JSON.parse(text);
  } catch {
    // not JSON: described below
  }
  const body: Problem =
    parsed !== null && typeof parsed === "object" && "type" in parsed
      ? { ...(parsed as Problem), status: (parsed as Partial<Problem>).status ?? status }
      : {
          type: "about:blank",
          title: statusText,
          status,
          detail: text.slice(0, 500) || null,
          instance: null,
        };
  const kind = BY_SLUG.get(slugOf(String(body.type))) ?? ProblemError;
  return new kind(body, retryAfter);
}

/**
 * No answer came from the API, after `attempts` tries. `idempotencyKey` is the key a
 * submission was sent with: send it again later with that key and it is replayed if it did
 * reach the server, never run twice.
 */
export class TransportError extends TurnstileError {
  override name = "TransportError";
  constructor(
    message: string,
    readonly baseUrl: string,
    readonly attempts: number,
    readonly idempotencyKey: string | null,
    options?: { cause?: unknown },
  ) {
    super(message, options);
  }
}

/**
 * No connection could be made (refused, unknown host, offline): the server is down or the URL
 * is wrong. In a browser this is also how a request refused by CORS looks (fetch says no more):
 * is the page's origin in the server's TURNSTILE_CORS_ORIGINS?
 */
export class UnreachableError extends TransportError {
  override name = "UnreachableError";
}

/** The connection broke before the answer came: the request may or may not have been processed. */
export class ConnectionLostError extends TransportError {
  override name = "ConnectionLostError";
}

/** The server did not answer within the client's timeout. */
export class ResponseTimeoutError extends TransportError {
  override name = "ResponseTimeoutError";
}

/**
 * `submitTurn` (which returns a run) got a pending turn: the session's multitask policy kept
 * the turn until its active run ends (enqueue, or interrupt of a running run). The turn **was
 * accepted** and will start: `pendingTurn` is it, to follow with `getPendingTurn` or withdraw
 * with `cancelPendingTurn`; sending it again with the same `Idempotency-Key` replays this
 * answer. `sendTurn` returns pending turns instead of throwing.
 */
export class TurnPendingError extends TurnstileError {
  override name = "TurnPendingError";
  constructor(readonly pendingTurn: PendingTurn) {
    super(
      `the session's multitask policy (${pendingTurn.policy}) kept the turn pending as ` +
        `${pendingTurn.id} (position ${pendingTurn.position ?? "?"}); follow it at ` +
        `/sessions/${pendingTurn.session_id}/pending-turns/${pendingTurn.id}, or use sendTurn`,
    );
  }
}

/** `wait` ran out of time before the run settled; `run` is how it was last seen. */
export class WaitTimeoutError extends TurnstileError {
  override name = "WaitTimeoutError";
  constructor(
    readonly run: Run,
    timeoutMs: number,
  ) {
    super(`run ${run.id} still ${run.status} after ${timeoutMs} ms`);
  }
}

/**
 * A run's event stream kept ending before the run's terminal event, and the client gave up
 * reconnecting (the API processes were stopping, say).
 */
export class StreamEndedError extends TurnstileError {
  override name = "StreamEndedError";
}
