/**
 * What the client returns: runs, sessions and events as the API's JSON documents, typed from
 * its OpenAPI document (openapi.ts, generated), and the live `Delta`s of a session's stream.
 */

import type { components } from "./openapi.js";

type Schemas = components["schemas"];

/** A run as `GET /runs/{id}` shows it (times are RFC 3339 strings). */
export type Run = Schemas["RunDocument"];
/** A conversation: `idle`, `busy` with its active run, or `waiting_for_user`. */
export type Session = Schemas["SessionDocument"];
/** A turn kept until the session's active run ends, interrupts or takes it (a session's
 * multitask policy other than reject: docs/turn-control.md). */
export type PendingTurn = Schemas["PendingTurnDocument"];
/** What a turn does while its session's run is queued or running (docs/turn-control.md):
 * `reject` (SessionBusyError), `enqueue`, `interrupt`, `steer`. */
export type MultitaskPolicy = Session["multitask"];
/** Which tool calls wait for a user's approval (docs/approvals.md): tool names and idempotency
 * classes, `{"tools": ["http_request"], "classes": ["unsafe"]}`; `{}`: none. */
export type ApprovalPolicy = Schemas["ApprovalPolicyBody"];
/** A decision on a tool call waiting for approval, as `POST /runs/{id}/approval` takes it. */
export type ApprovalDecision = Schemas["ApprovalDecisionBody"];
export type RunStatus = Schemas["RunStatus"];
export type PriorityClass = Schemas["PriorityClass"];
export type SessionState = Session["state"];
/** An RFC 9457 problem document, with the extensions its type adds. */
export type Problem = Schemas["Problem"] & Record<string, unknown>;
/** Anything JSON: the API keeps inputs, questions and results as the client sent them. */
export type Json = Schemas["JsonValue"];

/**
 * One entry of a run's log: `seq` numbers them from 1 without gaps; `epoch` is the claim that
 * wrote it (0 before the first claim). On a session's stream it also names its run and that
 * run's number in the session.
 */
export type Event = Schemas["EventDocument"] & { run_id?: string; run_no?: number };

/**
 * A piece of the message a run is writing (`message.delta`): never stored, so it may be missed;
 * `message.completed` (an `Event`) carries the whole text. `epoch` is the claim that wrote it,
 * `message` counts the messages that claim completed before it, `offset` says where `text`
 * goes in the message, in characters (Unicode code points).
 */
export interface Delta {
  type: "message.delta";
  run_id: string;
  epoch: number;
  message: number;
  offset: number;
  text: string;
}

/**
 * The tool call a run waits to have approved (`approval_request` of a run or session): its
 * `call_id` (the run's id and the call's step), the tool, the arguments the agent gave, and
 * the tool's JSON schema (`parameters`) to edit them against.
 */
export interface ApprovalRequest {
  call_id: string;
  tool: string;
  arguments: { [key: string]: Json };
  idempotency_class: "safe" | "keyed" | "unsafe";
  step: number;
  description?: string;
  parameters?: Json;
}

export type RunRef = Run | string;
export type SessionRef = Session | string;
export type PendingTurnRef = PendingTurn | string;

export const TERMINAL_STATUSES: ReadonlySet<RunStatus> = new Set<RunStatus>([
  "succeeded",
  "failed",
  "cancelled",
]);
/** The statuses a waiter stops at: the run is over, or it needs the user. */
export const SETTLED_STATUSES: ReadonlySet<RunStatus> = new Set<RunStatus>([
  ...TERMINAL_STATUSES,
  "waiting_for_user",
]);
/** The events that close a run's log: its stream ends after one of them. */
export const TERMINAL_EVENTS: ReadonlySet<string> = new Set([
  "run.succeeded",
  "run.failed",
  "run.cancelled",
]);
export const DELTA_EVENT = "message.delta";
/**
 * The server's last word on a stream it ends early (the key was revoked): not an event of a
 * run. The reconnect that follows gets the API's answer (401), thrown as an error.
 */
export const ENDED_EVENT = "stream.ended";

/** Succeeded, failed or cancelled: nothing will change it any more. */
export function isFinished(run: Pick<Run, "status">): boolean {
  return TERMINAL_STATUSES.has(run.status);
}

/** A turn's answer is a pending turn (enqueue, or interrupt of a running run), not a run. */
export function isPendingTurn(answer: Run | PendingTurn): answer is PendingTurn {
  return "kind" in answer && answer.kind === "pending_turn";
}

/** The tool call the run (or the session's run) waits to have approved, if it waits for one. */
export function approvalRequestOf(
  waiting: Pick<Run, "approval_request"> | Pick<Session, "approval_request">,
): ApprovalRequest | null {
  const request = waiting.approval_request;
  return request !== null &&
    typeof request === "object" &&
    !Array.isArray(request) &&
    typeof (request as Record<string, unknown>)["call_id"] === "string"
    ? (request as unknown as ApprovalRequest)
    : null;
}

/** A stream's item is a live delta (else a durable `Event`). */
export function isDelta(item: Event | Delta): item is Delta {
  return !("seq" in item);
}

export function runId(run: RunRef): string {
  return typeof run === "string" ? run : run.id;
}

export function sessionId(session: SessionRef): string {
  return typeof session === "string" ? session : session.id;
}

export function pendingTurnId(turn: PendingTurnRef): string {
  return typeof turn === "string" ? turn : turn.id;
}
