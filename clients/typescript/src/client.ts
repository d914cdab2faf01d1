/**
 * `Turnstile`: the client of the Turnstile API for browsers and Node, on `fetch`.
 *
 * Submissions carry an `Idempotency-Key` (one is made when the caller gives none) and are
 * retried with that same key (retry.ts), so a turn whose answer was lost is replayed, never run
 * twice. `wait` follows a run with the API's long poll; `events` and `sessionEvents` follow
 * Server-Sent Events (sse.ts) and, when the connection drops, reconnect with `Last-Event-ID`,
 * so no durable event is missed or repeated. Paths and answers are typed from the API's OpenAPI
 * document (openapi.ts), so a route the server no longer has fails to compile.
 */

import {
  StreamEndedError,
  TurnPendingError,
  TurnstileError,
  WaitTimeoutError,
  problemFrom,
} from "./errors.js";
import type { operations, paths } from "./openapi.js";
import {
  DELTA_EVENT,
  ENDED_EVENT,
  type ApprovalDecision,
  type ApprovalPolicy,
  type Delta,
  type Event,
  type Json,
  type MultitaskPolicy,
  type PendingTurn,
  type PendingTurnRef,
  type PriorityClass,
  type Run,
  type RunRef,
  type RunStatus,
  SETTLED_STATUSES,
  type Session,
  type SessionRef,
  TERMINAL_EVENTS,
  approvalRequestOf,
  isFinished,
  isPendingTurn,
  pendingTurnId,
  runId,
  sessionId,
} from "./models.js";
import {
  type RetryPolicy,
  delayMs,
  retryAfterOf,
  retryPolicy,
  retryableAnswer,
  sleep,
  transportError,
} from "./retry.js";
import { sseMessages } from "./sse.js";
import type { EventSourceMessage } from "eventsource-parser";

/** The API's cap on one long poll (seconds), as the server has it. */
const MAX_WAIT_MS = 60_000;
/** Above the API's keep-alive comments (every 15 s), so a silent stream is a dead one. */
const STREAM_IDLE_MS = 45_000;

export interface TurnstileOptions {
  /** Where the API is, such as `https://turnstile.example.com` or `http://127.0.0.1:8000`. */
  baseUrl: string;
  /** A key from `turnstile keys create`. In a browser, one of the user's own principal. */
  apiKey: string;
  /** Each request's timeout (a long poll's own wait comes on top). Default 30 s. */
  timeoutMs?: number;
  retry?: Partial<RetryPolicy>;
  /** The `fetch` to use (default: the global one). */
  fetch?: typeof fetch;
  /** Called with every answer the API gives: its headers (`Location`, `RateLimit`, ...). */
  onResponse?: (answer: ResponseInfo) => void;
}

export interface ResponseInfo {
  method: string;
  path: string;
  status: number;
  headers: Headers;
}

export interface CallOptions {
  signal?: AbortSignal;
}

export interface SubmitOptions extends CallOptions {
  agent?: string;
  priority?: PriorityClass;
  /** Not claimable before this time (a string must be RFC 3339 with an offset). */
  scheduledFor?: Date | string;
  /** A deadline to start, in seconds after the run becomes eligible: still queued then, it
   * ends `cancelled` with reason `expired` (docs/start-deadlines.md). Not with `startBefore`. */
  startWithin?: number;
  /** The deadline to start as a time (a string must be RFC 3339 with an offset). */
  startBefore?: Date | string;
  /** Yours, to make a retry across restarts safe; default `turnstile-client-<uuid>`. */
  idempotencyKey?: string;
  /** Which of the new run's tool calls wait for `approve`, `reject` or `edit`
   * (docs/approvals.md); default: the session's policy, else the server's. */
  approval?: ApprovalPolicy;
}

export interface TurnOptions extends SubmitOptions {
  /** What this turn does if the session's run is queued or running; default: the session's
   * policy (docs/turn-control.md). A turn kept pending cannot carry its own `approval`. */
  multitask?: MultitaskPolicy;
}

export interface SessionOptions extends CallOptions {
  /** What a turn does while the session's run is queued or running; default `reject`. */
  multitask?: MultitaskPolicy;
  /** Which tool calls of the session's runs wait for a user's approval; default: the server's. */
  approval?: ApprovalPolicy;
}

export interface DecisionOptions extends CallOptions {
  /** The call decided; default: the one the run shows it waits for (`approval_request`). */
  callId?: string;
  /** Why: kept with the decision, and told to the agent for a rejection. */
  reason?: string;
  /** Yours, to make a retry across restarts safe; default `turnstile-client-<uuid>`. */
  idempotencyKey?: string;
}

export interface CancelOptions extends CallOptions {
  /** Why: in the run's `run.cancelled` event and webhook. */
  reason?: string;
}

export interface WaitOptions extends CallOptions {
  /** Give up (WaitTimeoutError) after this long; default: never. */
  timeoutMs?: number;
  /** The statuses to stop at; default: finished, or waiting for the user. */
  until?: Iterable<RunStatus>;
}

type Ok<Op extends keyof operations, Code extends number> = operations[Op]["responses"] extends {
  [code in Code]: { content: { "application/json": infer Document } };
}
  ? Document
  : { "the operation has no JSON answer with this status": [Op, Code] }; // fails to compile where used

type SessionBody = NonNullable<
  operations["update_session_sessions__session_id__patch"]["requestBody"]
>["content"]["application/json"];

type TurnBody = NonNullable<
  operations["submit_turn_sessions__session_id__turns_post"]["requestBody"]
>["content"]["application/json"];

interface Call {
  method: "GET" | "POST" | "PATCH";
  path: string;
  query?: Record<string, string>;
  body?: unknown;
  idempotencyKey?: string;
  timeoutMs?: number;
  retry: boolean;
  signal?: AbortSignal | undefined;
}

/** What a stream does when the server ends it cleanly. */
type End = "stop" | "reconnect" | "failure";

function route(template: keyof paths, params: Record<string, string> = {}): string {
  return template.replace(/\{(\w+)\}/g, (_, name: string) =>
    encodeURIComponent(params[name] ?? ""),
  );
}

/** A signal aborted by the caller's, or by a timeout (which `timedOut` then reports). */
function guarded(signal: AbortSignal | undefined, timeoutMs: number | null) {
  const controller = new AbortController();
  let timedOut = false;
  const forward = (): void => controller.abort(signal?.reason);
  if (signal?.aborted) {
    forward();
  } else {
    signal?.addEventListener("abort", forward, { once: true });
  }
  const timer =
    timeoutMs === null
      ? undefined
      : setTimeout(() => {
          timedOut = true;
          controller.abort(new Error("timed out"));
        }, timeoutMs);
  return {
    signal: controller.signal,
    abort: () => controller.abort(),
    timedOut: () => timedOut,
    /** The timeout no longer applies (a stream's answer came: its idle timer takes over). */
    answered: () => clearTimeout(timer),
    done: () => {
      clearTimeout(timer);
      signal?.removeEventListener("abort", forward);
    },
  };
}

/** A new `Idempotency-Key`: a random UUID, from `crypto` wherever the platform has it. */
export function newIdempotencyKey(): string {
  const bytes = new Uint8Array(16);
  if (globalThis.crypto?.getRandomValues) {
    globalThis.crypto.getRandomValues(bytes);
  } else {
    for (let i = 0; i < bytes.length; i++) {
      bytes[i] = Math.floor(Math.random() * 256);
    }
  }
  bytes[6] = ((bytes[6] ?? 0) & 0x0f) | 0x40;
  bytes[8] = ((bytes[8] ?? 0) & 0x3f) | 0x80;
  const hex = Array.from(bytes, (byte) => byte.toString(16).padStart(2, "0")).join("");
  const uuid = [0, 8, 12, 16, 20].map((at, i, all) => hex.slice(at, all[i + 1])).join("-");
  return `turnstile-client-${uuid}`;
}

function submissionBody(input: Json, options: TurnOptions): TurnBody {
  const body: TurnBody = { input: input ?? null };
  if (options.multitask !== undefined) {
    body.multitask = options.multitask;
  }
  if (options.approval !== undefined) {
    body.approval = options.approval;
  }
  if (options.agent !== undefined) {
    body.agent = options.agent;
  }
  if (options.priority !== undefined) {
    body.priority = options.priority;
  }
  if (options.scheduledFor !== undefined) {
    body.scheduled_for =
      options.scheduledFor instanceof Date
        ? options.scheduledFor.toISOString()
        : options.scheduledFor;
  }
  if (options.startWithin !== undefined) {
    body.start_within = options.startWithin;
  }
  if (options.startBefore !== undefined) {
    body.start_before =
      options.startBefore instanceof Date ? options.startBefore.toISOString() : options.startBefore;
  }
  return body;
}

function position(event: Event): [number, number] {
  return [event.run_no ?? 0, event.seq];
}

function after(a: [number, number], b: [number, number]): boolean {
  return a[0] > b[0] || (a[0] === b[0] && a[1] > b[1]);
}

export class Turnstile {
  readonly baseUrl: string;
  readonly timeoutMs: number;
  readonly retry: RetryPolicy;
  readonly #apiKey: string;
  readonly #fetch: typeof fetch;
  readonly #onResponse: ((answer: ResponseInfo) => void) | undefined;

  constructor(options: TurnstileOptions) {
    let url: URL;
    try {
      url = new URL(options.baseUrl);
    } catch {
      throw new TypeError(`baseUrl must be an http:// or https:// URL: ${options.baseUrl}`);
    }
    if (!["http:", "https:"].includes(url.protocol) || !url.host) {
      throw new TypeError(`baseUrl must be an http:// or https:// URL: ${options.baseUrl}`);
    }
    this.baseUrl = url.href.replace(/\/+$/, "");
    this.#apiKey = options.apiKey;
    this.timeoutMs = options.timeoutMs ?? 30_000;
    this.retry = retryPolicy(options.retry);
    // Bound: a browser's fetch refuses to run with another `this`.
    this.#fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
    this.#onResponse = options.onResponse;
  }

  // --- sessions and submissions -------------------------------------------------------------

  /**
   * A new conversation; `multitask` sets what a turn does while its run is active (default
   * `reject`), `approval` which tool calls of its runs wait for a user's approval (default: the
   * server's). A retry after a lost answer may leave an unused empty session behind.
   */
  async createSession(options: SessionOptions = {}): Promise<Session> {
    const body: SessionBody = {};
    if (options.multitask !== undefined) {
      body.multitask = options.multitask;
    }
    if (options.approval !== undefined) {
      body.approval = options.approval;
    }
    return this.#send<Ok<"create_session_sessions_post", 201>>({
      method: "POST",
      path: route("/sessions"),
      ...(Object.keys(body).length > 0 ? { body } : {}),
      retry: true,
      signal: options.signal,
    });
  }

  /**
   * Change the session's multitask policy, for turns that arrive from now on (pending turns
   * keep their own). A `PATCH`: a page of another origin needs the server's CORS to allow it.
   */
  async setMultitask(
    session: SessionRef,
    multitask: MultitaskPolicy,
    options: CallOptions = {},
  ): Promise<Session> {
    return this.#updateSession(session, { multitask }, options);
  }

  /**
   * Change the session's approval policy (`null`: back to the server's default); its runs
   * follow it from their next execution's first tool call. A `PATCH`, as `setMultitask`.
   */
  async setApproval(
    session: SessionRef,
    approval: ApprovalPolicy | null,
    options: CallOptions = {},
  ): Promise<Session> {
    return this.#updateSession(session, { approval }, options);
  }

  async #updateSession(
    session: SessionRef,
    body: SessionBody,
    options: CallOptions,
  ): Promise<Session> {
    // Setting the same policy again is the same change: safe to repeat.
    return this.#send<Ok<"update_session_sessions__session_id__patch", 200>>({
      method: "PATCH",
      path: route("/sessions/{session_id}", { session_id: sessionId(session) }),
      body,
      retry: true,
      signal: options.signal,
    });
  }

  async getSession(session: SessionRef, options: CallOptions = {}): Promise<Session> {
    return this.#send<Ok<"get_session_sessions__session_id__get", 200>>({
      method: "GET",
      path: route("/sessions/{session_id}", { session_id: sessionId(session) }),
      retry: true,
      signal: options.signal,
    });
  }

  /**
   * A user's turn: a new run, or, when the session's run waits for the user, the answer that
   * sends that same run back to the queue. When the session's run is queued or running, the
   * multitask policy decides (`multitask`, else the session's): `reject` throws
   * `SessionBusyError` (with `activeRunId`); `enqueue`, and `interrupt` of a running run, answer
   * a `PendingTurn` (tell them apart with `isPendingTurn`; follow it with `getPendingTurn`: once
   * started, its `run_id` is the run, which has the pending turn's own id); `interrupt` of a
   * queued run answers the new run; `steer` answers the active run (same id). A run waiting for
   * a tool call's approval throws `ApprovalPendingError`: answer it with `approve`, `reject` or
   * `edit`. A session already holding its maximum of pending turns throws
   * `TooManyPendingTurnsError` (not retried). `startWithin` or `startBefore` gives a new run a
   * deadline to start (docs/start-deadlines.md).
   */
  async sendTurn(
    session: SessionRef,
    input: Json,
    options: TurnOptions = {},
  ): Promise<Run | PendingTurn> {
    return this.#send<Ok<"submit_turn_sessions__session_id__turns_post", 202>>({
      method: "POST",
      path: route("/sessions/{session_id}/turns", { session_id: sessionId(session) }),
      body: submissionBody(input, options),
      idempotencyKey: options.idempotencyKey ?? newIdempotencyKey(),
      retry: true,
      signal: options.signal,
    });
  }

  /**
   * A user's turn, for code that expects a run: `sendTurn` under the session's own policy. With
   * `reject` (the default) the answer is always a run, or `SessionBusyError` (with
   * `activeRunId`) when the session's run is queued or running. Should the session's policy keep
   * the turn pending instead (enqueue, interrupt of a running run), this throws
   * `TurnPendingError`: the turn **was accepted** and will start (its `pendingTurn` says
   * where), so it is not sent again; it is an error only because there is no run to return yet.
   * It does not wait for the turn to start, which could take as long as the active run. Use
   * `sendTurn` for sessions with another policy.
   */
  async submitTurn(session: SessionRef, input: Json, options: SubmitOptions = {}): Promise<Run> {
    const answered = await this.sendTurn(session, input, options);
    if (isPendingTurn(answered)) {
      throw new TurnPendingError(answered);
    }
    return answered;
  }

  /** The session's pending turns, in the order they will start. */
  async listPendingTurns(session: SessionRef, options: CallOptions = {}): Promise<PendingTurn[]> {
    const page = await this.#send<
      Ok<"list_pending_turns_sessions__session_id__pending_turns_get", 200>
    >({
      method: "GET",
      path: route("/sessions/{session_id}/pending-turns", { session_id: sessionId(session) }),
      retry: true,
      signal: options.signal,
    });
    return page.pending_turns;
  }

  /**
   * A pending turn as it stands: `position` (1 is next) while `pending`; then `started` with
   * `run_id`, the run it became; `delivered` (a steer the run took), or `cancelled`.
   */
  async getPendingTurn(
    session: SessionRef,
    turn: PendingTurnRef,
    options: CallOptions = {},
  ): Promise<PendingTurn> {
    return this.#send<Ok<"get_pending_turn_sessions__session_id__pending_turns__turn_id__get", 200>>(
      {
        method: "GET",
        path: route("/sessions/{session_id}/pending-turns/{turn_id}", {
          session_id: sessionId(session),
          turn_id: pendingTurnId(turn),
        }),
        retry: true,
        signal: options.signal,
      },
    );
  }

  /**
   * Withdraw a pending turn before it starts (a cancelled one answers again). Throws
   * `TurnStartedError` (with `runId`) once it became a run or reached one: cancel that run.
   */
  async cancelPendingTurn(
    session: SessionRef,
    turn: PendingTurnRef,
    options: CallOptions = {},
  ): Promise<PendingTurn> {
    // A cancelled pending turn answers 200 again, so a retry is safe.
    return this.#send<
      Ok<"cancel_pending_turn_sessions__session_id__pending_turns__turn_id__cancel_post", 200>
    >({
      method: "POST",
      path: route("/sessions/{session_id}/pending-turns/{turn_id}/cancel", {
        session_id: sessionId(session),
        turn_id: pendingTurnId(turn),
      }),
      retry: true,
      signal: options.signal,
    });
  }

  /** Answer the question of a run waiting for the user: its session's next turn. */
  async answer(
    run: Run,
    input: Json,
    options: Pick<SubmitOptions, "idempotencyKey" | "signal"> = {},
  ): Promise<Run> {
    if (run.session_id === null) {
      throw new TypeError("only a session's run can be answered");
    }
    return this.submitTurn(run.session_id, input, options);
  }

  /**
   * A sessionless run (back-end work, `async` unless `priority` says otherwise); `approval`
   * says which of its tool calls wait for `approve`, `reject` or `edit`.
   */
  async submitRun(input: Json, options: SubmitOptions = {}): Promise<Run> {
    return this.#send<Ok<"submit_run_runs_post", 202>>({
      method: "POST",
      path: route("/runs"),
      body: submissionBody(input, options),
      idempotencyKey: options.idempotencyKey ?? newIdempotencyKey(),
      retry: true,
      signal: options.signal,
    });
  }

  // --- runs ---------------------------------------------------------------------------------

  async getRun(run: RunRef, options: CallOptions = {}): Promise<Run> {
    return this.#send<Ok<"get_run_runs__run_id__get", 200>>({
      method: "GET",
      path: route("/runs/{run_id}", { run_id: runId(run) }),
      retry: true,
      signal: options.signal,
    });
  }

  /**
   * The run once its status is one of `until` (by default: finished, or waiting for the user),
   * following it with long polls of at most a minute each. Throws `WaitTimeoutError` (carrying
   * the run as last seen) after `timeoutMs`.
   */
  async wait(run: RunRef, options: WaitOptions = {}): Promise<Run> {
    const until = new Set(options.until ?? SETTLED_STATUSES);
    const deadline =
      options.timeoutMs === undefined ? null : performance.now() + options.timeoutMs;
    let current = typeof run === "string" ? await this.getRun(run, options) : run;
    while (!until.has(current.status)) {
      const remaining = deadline === null ? MAX_WAIT_MS : deadline - performance.now();
      if (remaining <= 0) {
        throw new WaitTimeoutError(current, options.timeoutMs ?? 0);
      }
      const waitMs = Math.min(remaining, MAX_WAIT_MS);
      current = await this.#send<Ok<"get_run_runs__run_id__get", 200>>({
        method: "GET",
        path: route("/runs/{run_id}", { run_id: current.id }),
        query: { wait: (waitMs / 1000).toFixed(3), status: current.status },
        timeoutMs: waitMs + this.timeoutMs,
        retry: true,
        signal: options.signal,
      });
    }
    return current;
  }

  /**
   * Cancel from any non-terminal status; a cancelled run answers again. `reason` goes into its
   * `run.cancelled` event and webhook. Throws `RunFinishedError` for a run that succeeded or
   * failed.
   */
  async cancel(run: RunRef, options: CancelOptions = {}): Promise<Run> {
    // Cancelling a cancelled run answers 200 again, so a retry is safe.
    return this.#send<Ok<"cancel_runs__run_id__cancel_post", 200>>({
      method: "POST",
      path: route("/runs/{run_id}/cancel", { run_id: runId(run) }),
      ...(options.reason !== undefined ? { body: { reason: options.reason } } : {}),
      retry: true,
      signal: options.signal,
    });
  }

  // --- approval before a tool call (docs/approvals.md) --------------------------------------

  /**
   * Approve the tool call the run waits for (by default the one its `approval_request` names):
   * the same run goes back to the queue and makes the call, once. Throws
   * `NoApprovalPendingError` when nothing waits for that call (decided already), and its
   * subclass `ApprovalCallMismatchError` when another call waits.
   */
  async approve(run: RunRef, options: DecisionOptions = {}): Promise<Run> {
    return this.#decide(run, "approve", undefined, options);
  }

  /** Refuse the call: it is never made, and the agent is told so, with `reason`. */
  async reject(run: RunRef, options: DecisionOptions = {}): Promise<Run> {
    return this.#decide(run, "reject", undefined, options);
  }

  /**
   * Approve the call with other arguments, checked against the tool's schema (the request's
   * `parameters`): `InvalidApprovalError`, with `errors`, when they do not fit it.
   */
  async edit(
    run: RunRef,
    args: { [key: string]: Json },
    options: DecisionOptions = {},
  ): Promise<Run> {
    return this.#decide(run, "edit", args, options);
  }

  async #decide(
    run: RunRef,
    decision: ApprovalDecision["decision"],
    args: { [key: string]: Json } | undefined,
    options: DecisionOptions,
  ): Promise<Run> {
    let callId = options.callId;
    if (callId === undefined) {
      const request = typeof run === "string" ? null : approvalRequestOf(run);
      if (request === null) {
        throw new TypeError("name the callId: this run shows no approval_request");
      }
      callId = request.call_id;
    }
    const body: ApprovalDecision = { call_id: callId, decision };
    if (args !== undefined) {
      body.args = args;
    }
    if (options.reason !== undefined) {
      body.reason = options.reason;
    }
    return this.#send<Ok<"decide_approval_runs__run_id__approval_post", 202>>({
      method: "POST",
      path: route("/runs/{run_id}/approval", { run_id: runId(run) }),
      body,
      // A retry with the same key replays the first decision instead of refusing a second.
      idempotencyKey: options.idempotencyKey ?? newIdempotencyKey(),
      retry: true,
      signal: options.signal,
    });
  }

  /**
   * The run's events after sequence number `after`, in order, as they happen; ends after the
   * run's terminal event. A dropped connection is resumed with `Last-Event-ID`, so each event
   * comes exactly once (live `message.delta`s are left out: `sessionEvents` has them).
   */
  async *events(
    run: RunRef,
    options: CallOptions & { after?: number } = {},
  ): AsyncGenerator<Event, void, undefined> {
    const id = runId(run);
    let last = options.after ?? 0;
    let fresh = false;
    const ended = async (): Promise<End> => {
      if (fresh) {
        fresh = false;
        return "reconnect"; // the API process is stopping: go on, maybe with another
      }
      return isFinished(await this.getRun(id, options)) ? "stop" : "failure";
    };
    const messages = this.#follow(
      route("/runs/{run_id}/events", { run_id: id }),
      () => (last > 0 ? String(last) : null),
      ended,
      `the event stream of run ${id}`,
      options.signal,
    );
    for await (const message of messages) {
      if (!message.data || message.event === DELTA_EVENT || message.event === ENDED_EVENT) {
        continue; // live text (sessionEvents has it), or the server's end of the stream
      }
      const event = JSON.parse(message.data) as Event;
      if (event.seq <= last) {
        continue; // already delivered before a reconnect
      }
      last = event.seq;
      fresh = true;
      yield event;
      if (TERMINAL_EVENTS.has(event.type)) {
        return;
      }
    }
  }

  /**
   * The conversation's stream (`GET /sessions/{id}/events`): the durable events of all the
   * session's runs in order (each with `run_id` and `run_no`) and live `Delta`s of the
   * messages being written, after the event id `after` (`<run_no>.<seq>`). It does not end with
   * a run: stop iterating (or abort the signal) to leave. A dropped connection is resumed with
   * `Last-Event-ID`, so each durable event comes exactly once; deltas missed while disconnected
   * are gone (their `message.completed` is not). `LiveText` assembles the deltas.
   */
  async *sessionEvents(
    session: SessionRef,
    options: CallOptions & { after?: string } = {},
  ): AsyncGenerator<Event | Delta, void, undefined> {
    let last: [number, number] | null = null;
    if (options.after) {
      const [runNo, seq] = options.after.trim().split(".");
      last = [Number(runNo), Number(seq)];
    }
    const id = sessionId(session);
    const messages = this.#follow(
      route("/sessions/{session_id}/events", { session_id: id }),
      () => (last === null ? null : `${last[0]}.${last[1]}`),
      async () => "failure",
      `the event stream of session ${id}`,
      options.signal,
    );
    for await (const message of messages) {
      if (!message.data || message.event === ENDED_EVENT) {
        continue;
      }
      const document = JSON.parse(message.data) as Record<string, unknown>;
      if (message.event === DELTA_EVENT) {
        yield { ...(document as Omit<Delta, "type">), type: DELTA_EVENT };
        continue;
      }
      const event = document as Event;
      if (last !== null && !after(position(event), last)) {
        continue; // already delivered before a reconnect
      }
      last = position(event);
      yield event;
    }
  }

  // --- sending ------------------------------------------------------------------------------

  #headers(extra: Record<string, string>): Record<string, string> {
    // Nothing a browser would have to preflight beyond what the API's CORS allows.
    return { Authorization: `Bearer ${this.#apiKey}`, ...extra };
  }

  #observe(method: string, path: string, response: Response): void {
    this.#onResponse?.({ method, path, status: response.status, headers: response.headers });
  }

  /** The answer's JSON; retried as the policy says, else a ProblemError or TransportError. */
  async #send<Document>(call: Call): Promise<Document> {
    const url = new URL(this.baseUrl + call.path);
    for (const [name, value] of Object.entries(call.query ?? {})) {
      url.searchParams.set(name, value);
    }
    const headers = this.#headers({ Accept: "application/json" });
    if (call.body !== undefined) {
      headers["Content-Type"] = "application/json";
    }
    if (call.idempotencyKey !== undefined) {
      headers["Idempotency-Key"] = call.idempotencyKey;
    }
    for (let attempt = 1; ; attempt++) {
      const guard = guarded(call.signal, call.timeoutMs ?? this.timeoutMs);
      let response: Response;
      let text: string;
      try {
        response = await this.#fetch(url, {
          method: call.method,
          headers,
          body: call.body === undefined ? null : JSON.stringify(call.body),
          signal: guard.signal,
          credentials: "omit", // bearer keys only: never the dashboard's cookie
        });
        text = await response.text();
      } catch (error) {
        if (call.signal?.aborted) {
          throw call.signal.reason; // the caller's own abort: not retried
        }
        if (!call.retry || attempt >= this.retry.attempts) {
          throw transportError(
            error,
            guard.timedOut(),
            this.baseUrl,
            attempt,
            call.idempotencyKey ?? null,
          );
        }
        await sleep(delayMs(this.retry, attempt, null), call.signal);
        continue;
      } finally {
        guard.done();
      }
      this.#observe(call.method, call.path, response);
      if (response.ok) {
        return (text ? JSON.parse(text) : null) as Document;
      }
      const retryAfter = retryAfterOf(response.headers);
      if (call.retry && retryableAnswer(response.status, text) && attempt < this.retry.attempts) {
        await sleep(delayMs(this.retry, attempt, retryAfter), call.signal);
        continue;
      }
      throw problemFrom(response.status, response.statusText, text, retryAfter);
    }
  }

  /**
   * The messages of the stream at `path`, across reconnections: each connection resumes from
   * `resumeFrom()`; a failed one is retried as the policy says; `ended` decides what a clean
   * end of the stream means.
   */
  async *#follow(
    path: string,
    resumeFrom: () => string | null,
    ended: () => Promise<End>,
    what: string,
    signal: AbortSignal | undefined,
  ): AsyncGenerator<EventSourceMessage, void, undefined> {
    let failures = 0;
    while (true) {
      // Until the answer's headers come, the client's timeout; then the idle timer.
      const guard = guarded(signal, this.timeoutMs);
      let idle = false;
      let end: End;
      try {
        const headers = this.#headers({ Accept: "text/event-stream" });
        const resume = resumeFrom();
        if (resume !== null) {
          headers["Last-Event-ID"] = resume;
        }
        const response = await this.#fetch(this.baseUrl + path, {
          headers,
          signal: guard.signal,
          credentials: "omit",
          cache: "no-store",
        });
        guard.answered();
        if (!response.ok) {
          const text = await response.text();
          this.#observe("GET", path, response);
          const retryAfter = retryAfterOf(response.headers);
          failures += 1;
          if (!retryableAnswer(response.status, text) || failures >= this.retry.attempts) {
            throw problemFrom(response.status, response.statusText, text, retryAfter);
          }
          await sleep(delayMs(this.retry, failures, retryAfter), signal);
          continue;
        }
        this.#observe("GET", path, response);
        if (response.body !== null) {
          const onIdle = (): void => {
            idle = true;
            guard.abort();
          };
          for await (const message of sseMessages(response.body, STREAM_IDLE_MS, onIdle)) {
            failures = 0;
            yield message;
          }
        }
        end = await ended();
      } catch (error) {
        if (error instanceof TurnstileError) {
          throw error; // an answer (a problem), not a broken connection
        }
        if (signal?.aborted) {
          throw signal.reason;
        }
        failures += 1;
        if (failures >= this.retry.attempts) {
          throw transportError(error, idle || guard.timedOut(), this.baseUrl, failures, null);
        }
        await sleep(delayMs(this.retry, failures, null), signal);
        continue;
      } finally {
        guard.done();
        guard.abort(); // the connection is not reused: the stream is over or left
      }
      if (end === "stop") {
        return;
      }
      if (end === "failure") {
        failures += 1;
        if (failures >= this.retry.attempts) {
          throw new StreamEndedError(`${what} ended`);
        }
        await sleep(delayMs(this.retry, failures, null), signal);
      }
    }
  }
}

