/**
 * @turnstile/client: the client of the Turnstile API for browsers and Node.
 *
 *     const turnstile = new Turnstile({ baseUrl: "http://127.0.0.1:8000", apiKey });
 *     const session = await turnstile.createSession();
 *     const run = await turnstile.wait(await turnstile.submitTurn(session, { text: "hi" }));
 */

export {
  Turnstile,
  newIdempotencyKey,
  type CallOptions,
  type ResponseInfo,
  type SubmitOptions,
  type TurnstileOptions,
  type WaitOptions,
} from "./client.js";
export {
  AnswerConflictError,
  ConnectionLostError,
  ForbiddenError,
  IdempotencyKeyInFlightError,
  IdempotencyKeyReusedError,
  InvalidRequestError,
  NotFoundError,
  ProblemError,
  QueueQuotaError,
  RateLimitedError,
  ResponseTimeoutError,
  RunFinishedError,
  ServiceUnavailableError,
  SessionBusyError,
  StreamEndedError,
  TooManyStreamsError,
  TransportError,
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
  isDelta,
  isFinished,
  type Delta,
  type Event,
  type Json,
  type PendingTurn,
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
