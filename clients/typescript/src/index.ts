/**
 * @turnstile/client: the client of the Turnstile API for browsers and Node.
 *
 *     const turnstile = new Turnstile({ baseUrl: "http://127.0.0.1:8000", apiKey });
 *     const session = await turnstile.createSession();
 *     const run = await turnstile.wait(await turnstile.submitTurn(session, { text: "hi" }));
 *
 * Turn control (docs/turn-control.md): `createSession({ multitask: "enqueue" })`, then
 * `sendTurn` answers a `Run` or a `PendingTurn` (`isPendingTurn`); approvals
 * (docs/approvals.md): `approve`, `reject`, `edit`.
 */

export {
  Turnstile,
  newIdempotencyKey,
  type CallOptions,
  type CancelOptions,
  type DecisionOptions,
  type ResponseInfo,
  type SessionOptions,
  type SubmitOptions,
  type TurnOptions,
  type TurnstileOptions,
  type WaitOptions,
} from "./client.js";
export {
  AnswerConflictError,
  ApprovalCallMismatchError,
  ApprovalPendingError,
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
  TurnPendingError,
  TurnStartedError,
  TurnstileError,
  UnauthorizedError,
  UnreachableError,
  WaitTimeoutError,
} from "./errors.js";
export { LiveText } from "./live-text.js";
export {
  SETTLED_STATUSES,
  TERMINAL_EVENTS,
  TERMINAL_STATUSES,
  approvalRequestOf,
  isDelta,
  isFinished,
  isPendingTurn,
  type ApprovalDecision,
  type ApprovalPolicy,
  type ApprovalRequest,
  type Delta,
  type Event,
  type Json,
  type MultitaskPolicy,
  type PendingTurn,
  type PendingTurnRef,
  type PriorityClass,
  type Problem,
  type Run,
  type RunRef,
  type RunStatus,
  type Session,
  type SessionRef,
  type SessionState,
} from "./models.js";
export { DEFAULT_RETRY, type RetryPolicy } from "./retry.js";
