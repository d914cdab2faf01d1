// The TypeScript client's turn control and approvals (the server's docs/turn-control.md and
// docs/approvals.md) against a real `turnstile serve` with its worker pool (started by
// tests/clients/test_typescript_turn_control.py with TURNSTILE_MAX_PENDING_TURNS=2, or by hand:
// TURNSTILE_URL, TURNSTILE_KEY for a key without a scope). An enqueued turn followed to the run
// it becomes, pending turns listed and withdrawn, a full session's 429 not retried, an interrupt
// of a running run, a steer, a cancel with its reason, and tool calls approved, edited and
// rejected.

import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import {
  ApprovalCallMismatchError,
  ApprovalPendingError,
  InvalidApprovalError,
  NoApprovalPendingError,
  SessionBusyError,
  TooManyPendingTurnsError,
  TurnPendingError,
  TurnStartedError,
  Turnstile,
  approvalRequestOf,
  isPendingTurn,
} from "../dist/index.js";
import { BreakingProxy } from "./support/proxy.js";

const BASE = process.env.TURNSTILE_URL ?? "";
const KEY = process.env.TURNSTILE_KEY ?? "";
const MAX_PENDING = Number(process.env.TURNSTILE_MAX_PENDING_TURNS ?? "20");
const skip = BASE && KEY ? false : "set TURNSTILE_URL and TURNSTILE_KEY to a running turnstile serve";
const FAST = { attempts: 5, baseDelayMs: 20, maxDelayMs: 100 };
const LATER = "2030-01-01T09:00:00Z";
const WAIT = { timeoutMs: 30_000 };
/** Long enough to be interrupted between its tool calls, never to end on its own in a test. */
const LONG = {
  script: [
    ...Array.from({ length: 40 }, () => ({ call: "sleep", args: { seconds: 0.5 } })),
    { final: "slept" },
  ],
};

/** @type {BreakingProxy} */
let proxy;

before(async () => {
  if (!skip) {
    proxy = await new BreakingProxy(BASE).start();
  }
});

after(async () => {
  await proxy?.close();
});

/** @param {Partial<import("../dist/index.js").TurnstileOptions>} [options] */
function client(options = {}) {
  return new Turnstile({ baseUrl: BASE, apiKey: KEY, ...options });
}

/** A run's whole log, to its terminal event. @param {Turnstile} turnstile @param {string} run */
async function logOf(turnstile, run) {
  const events = [];
  for await (const event of turnstile.events(run)) {
    events.push(event);
  }
  return events;
}

/**
 * The answer as a pending turn (failing otherwise).
 * @param {import("../dist/index.js").Run | import("../dist/index.js").PendingTurn} answer
 */
function pending(answer) {
  assert.ok(isPendingTurn(answer), `a pending turn, not the run ${answer.id}`);
  return answer;
}

test("an enqueued turn waits, then becomes the run of its own id", { skip }, async () => {
  const turnstile = client();
  const session = await turnstile.createSession({ multitask: "enqueue" });
  assert.equal(session.multitask, "enqueue");
  // Queued until 2030: only the cancel below ends it, so the test decides when turns start.
  const first = await turnstile.submitTurn(session, { text: "first" }, { scheduledFor: LATER });
  assert.ok(!isPendingTurn(first));

  const second = pending(await turnstile.sendTurn(session, { script: [{ final: "second" }] }));
  assert.equal(second.status, "pending");
  assert.equal(second.policy, "enqueue");
  assert.equal(second.position, 1);
  assert.equal(second.active_run_id, first.id);
  assert.equal(second.session_id, session.id);

  // submitTurn wants a run: the turn is accepted all the same, and the error carries it.
  /** @type {import("../dist/index.js").PendingTurn | null} */
  let third = null;
  await assert.rejects(turnstile.submitTurn(session, { text: "third" }), (error) => {
    assert.ok(error instanceof TurnPendingError);
    third = error.pendingTurn;
    assert.equal(third.position, 2);
    return true;
  });
  assert.ok(third);
  assert.deepEqual(
    (await turnstile.listPendingTurns(session)).map((turn) => turn.id),
    [second.id, /** @type {{ id: string }} */ (third).id],
  );
  assert.equal((await turnstile.getSession(session)).pending_turns, 2);

  const withdrawn = await turnstile.cancelPendingTurn(session, /** @type {any} */ (third));
  assert.equal(withdrawn.status, "cancelled");
  assert.equal((await turnstile.cancelPendingTurn(session.id, withdrawn.id)).status, "cancelled");
  assert.deepEqual(
    (await turnstile.listPendingTurns(session.id)).map((turn) => turn.id),
    [second.id],
  );

  // The first run's end (a cancel, with its reason) starts the pending turn in the same
  // transaction: no waiting for it.
  const cancelled = await turnstile.cancel(first, { reason: "the user moved on" });
  assert.equal(cancelled.status, "cancelled");
  const log = await logOf(turnstile, first.id);
  const end = log.at(-1);
  assert.equal(end?.type, "run.cancelled");
  assert.equal(/** @type {{ reason: string }} */ (end?.data).reason, "the user moved on");
  assert.ok(log.some((event) => event.type === "turn.pending"));
  assert.ok(log.some((event) => event.type === "turn.cancelled"));

  const started = await turnstile.getPendingTurn(session, second);
  assert.equal(started.status, "started");
  assert.equal(started.run_id, second.id); // the run has the pending turn's own id
  const done = await turnstile.wait(second.id, WAIT);
  assert.equal(done.status, "succeeded");
  assert.equal(done.session_id, session.id);
  assert.equal(/** @type {{ final: string }} */ (done.result).final, "second");
  await assert.rejects(turnstile.cancelPendingTurn(session, second), (error) => {
    assert.ok(error instanceof TurnStartedError);
    assert.equal(error.status, 409);
    assert.equal(error.runId, second.id);
    assert.equal(error.turnStatus, "started");
    return true;
  });

  // Back to reject: a busy session refuses, and nothing is kept.
  const rejecting = await turnstile.setMultitask(session, "reject");
  assert.equal(rejecting.multitask, "reject");
  const held = await turnstile.submitTurn(session, { text: "held" }, { scheduledFor: LATER });
  await assert.rejects(turnstile.sendTurn(session, { text: "no" }), (error) => {
    assert.ok(error instanceof SessionBusyError);
    assert.equal(error.activeRunId, held.id);
    return true;
  });
  assert.deepEqual(await turnstile.listPendingTurns(session), []);
  // A turn's own policy overrides the session's: a queued run is interrupted at once.
  const now = await turnstile.sendTurn(session, { script: [{ final: "now" }] }, { multitask: "interrupt" });
  assert.ok(!isPendingTurn(now));
  assert.notEqual(now.id, held.id);
  assert.equal((await turnstile.getRun(held)).status, "cancelled");
  assert.equal((await turnstile.wait(now, WAIT)).status, "succeeded");
});

test("a session full of pending turns is a 429, not retried", { skip }, async () => {
  const turnstile = client({ baseUrl: proxy.base, retry: FAST });
  const session = await turnstile.createSession({ multitask: "enqueue" });
  const first = await turnstile.submitTurn(session, { text: "first" }, { scheduledFor: LATER });
  for (let i = 0; i < MAX_PENDING; i++) {
    pending(await turnstile.sendTurn(session, { text: `pending ${i}` }));
  }
  proxy.sent = [];
  await assert.rejects(
    turnstile.sendTurn(session, { text: "one too many" }, { idempotencyKey: "ts-full-1" }),
    (error) => {
      assert.ok(error instanceof TooManyPendingTurnsError);
      assert.equal(error.status, 429);
      assert.equal(error.maxPending, MAX_PENDING);
      return true;
    },
  );
  assert.deepEqual(proxy.sentHeaders("Idempotency-Key"), ["ts-full-1"]); // one try only
  assert.equal((await turnstile.listPendingTurns(session)).length, MAX_PENDING);
  for (const turn of await turnstile.listPendingTurns(session)) {
    await turnstile.cancelPendingTurn(session, turn);
  }
  await turnstile.cancel(first);
});

test("an interrupt stops the running run at its next boundary and starts the turn", { skip }, async () => {
  const turnstile = client();
  const session = await turnstile.createSession();
  const working = await turnstile.submitTurn(session, LONG);
  const running = await turnstile.wait(working, { ...WAIT, until: ["running"] });
  assert.equal(running.status, "running");

  const turn = pending(
    await turnstile.sendTurn(session, { script: [{ final: "instead" }] }, { multitask: "interrupt" }),
  );
  assert.equal(turn.policy, "interrupt");
  assert.equal(turn.active_run_id, working.id);
  assert.ok(turn.interrupt_by);

  const stopped = await turnstile.wait(working, WAIT);
  assert.equal(stopped.status, "cancelled");
  const log = await logOf(turnstile, working.id);
  const interrupted = log.find((event) => event.type === "run.interrupted");
  assert.ok(interrupted, "a run.interrupted event");
  assert.equal(/** @type {{ pending_turn_id: string }} */ (interrupted.data).pending_turn_id, turn.id);
  assert.equal(/** @type {{ reason: string }} */ (log.at(-1)?.data).reason, "interrupted");

  const started = await turnstile.getPendingTurn(session, turn.id);
  assert.equal(started.status, "started");
  const instead = await turnstile.wait(/** @type {string} */ (started.run_id), WAIT);
  assert.equal(instead.status, "succeeded");
  assert.equal(/** @type {{ final: string }} */ (instead.result).final, "instead");
});

test("a steer reaches the running run, which answers as itself", { skip }, async () => {
  const turnstile = client();
  const session = await turnstile.createSession({ multitask: "steer" });
  const working = await turnstile.submitTurn(session, {
    script: [...Array.from({ length: 4 }, () => ({ call: "sleep", args: { seconds: 0.5 } })), { final: "steered" }],
  });
  await turnstile.wait(working, { ...WAIT, until: ["running"] });
  const steered = await turnstile.sendTurn(session, { text: "also this" });
  assert.ok(!isPendingTurn(steered));
  assert.equal(steered.id, working.id); // the active run itself
  const done = await turnstile.wait(steered, WAIT);
  assert.equal(done.status, "succeeded");
  assert.deepEqual(/** @type {{ steered: unknown[] }} */ (done.result).steered, [{ text: "also this" }]);
  assert.deepEqual(await turnstile.listPendingTurns(session), []);
});

test("tool calls are edited, approved and rejected, each resuming the same run", { skip }, async () => {
  const turnstile = client();
  const session = await turnstile.createSession({ approval: { tools: ["sleep", "echo"] } });
  assert.deepEqual(session.approval, { tools: ["echo", "sleep"], classes: [] });
  const run = await turnstile.submitTurn(session, {
    script: [
      { call: "sleep", args: { seconds: 5 } },
      { call: "echo", args: { to: "ada" } },
      { call: "echo", args: { to: "bob" } },
      { final: "done" },
    ],
  });

  const asked = await turnstile.wait(run, WAIT);
  assert.equal(asked.status, "waiting_for_user");
  const request = approvalRequestOf(asked);
  assert.ok(request);
  assert.equal(request.tool, "sleep");
  assert.deepEqual(request.arguments, { seconds: 5 });
  assert.equal(request.call_id, approvalRequestOf(await turnstile.getSession(session))?.call_id);
  await assert.rejects(turnstile.sendTurn(session, "hello?", { multitask: "enqueue" }), (error) => {
    assert.ok(error instanceof ApprovalPendingError);
    assert.equal(error.status, 409);
    assert.equal(error.callId, request.call_id);
    assert.equal(error.tool, "sleep");
    assert.equal(error.runId, run.id);
    return true;
  });
  await assert.rejects(turnstile.edit(asked, { seconds: -1 }), (error) => {
    assert.ok(error instanceof InvalidApprovalError);
    assert.ok(error.errors.length > 0);
    return true;
  });
  const edited = await turnstile.edit(asked, { seconds: 0.01 }, { idempotencyKey: "ts-edit-1" });
  assert.equal(edited.id, run.id);
  assert.equal(edited.status, "queued");
  const again = await turnstile.edit(asked, { seconds: 0.01 }, { idempotencyKey: "ts-edit-1" });
  assert.equal(again.id, run.id); // replayed, not refused

  const second = await turnstile.wait(edited, WAIT);
  const echo = approvalRequestOf(second);
  assert.equal(echo?.tool, "echo");
  await assert.rejects(turnstile.approve(second, { callId: `${run.id}.9` }), (error) => {
    assert.ok(error instanceof ApprovalCallMismatchError);
    assert.ok(error instanceof NoApprovalPendingError);
    assert.equal(error.pendingCallId, echo?.call_id);
    return true;
  });
  const approved = await turnstile.approve(second);
  assert.equal(approved.id, run.id);

  const third = await turnstile.wait(approved, WAIT);
  assert.deepEqual(approvalRequestOf(third)?.arguments, { to: "bob" });
  const done = await turnstile.wait(await turnstile.reject(third, { reason: "not to Bob" }), WAIT);
  assert.equal(done.status, "succeeded");
  const outcomes = /** @type {{ tool_outcomes: Array<{ status: string, outcome: any }> }} */ (done.result)
    .tool_outcomes;
  assert.deepEqual(
    outcomes.map((outcome) => outcome.status),
    ["succeeded", "succeeded", "rejected"],
  );
  assert.deepEqual(outcomes[0]?.outcome, { slept: 0.01 });
  assert.deepEqual(outcomes[1]?.outcome, { echo: { to: "ada" } });
  assert.equal(outcomes[2]?.outcome.reason, "not to Bob");
  // Decided already: nothing waits for that call any more.
  await assert.rejects(turnstile.approve(done, { callId: echo?.call_id }), (error) => {
    assert.ok(error instanceof NoApprovalPendingError);
    assert.ok(!(error instanceof ApprovalCallMismatchError));
    assert.equal(error.runStatus, "succeeded");
    return true;
  });
  await assert.rejects(turnstile.approve(done), TypeError); // no call to default to
});

test("a sessionless run is approved, and session policies are changed", { skip }, async () => {
  const turnstile = client();
  const run = await turnstile.submitRun(
    { script: [{ call: "echo", args: { to: "ada" } }, { final: "sent" }] },
    { approval: { tools: ["echo"] } },
  );
  const asked = await turnstile.wait(run, WAIT);
  assert.equal(approvalRequestOf(asked)?.tool, "echo");
  const done = await turnstile.wait(await turnstile.approve(asked.id, { callId: approvalRequestOf(asked)?.call_id }), WAIT);
  assert.equal(done.status, "succeeded");

  const session = await turnstile.createSession();
  assert.equal(session.multitask, "reject");
  const changed = await turnstile.setApproval(session, { classes: ["unsafe"] });
  assert.deepEqual(changed.approval, { tools: [], classes: ["unsafe"] });
  assert.equal((await turnstile.setApproval(session.id, null)).approval, null);
  assert.equal((await turnstile.setMultitask(session, "steer")).multitask, "steer");
});
