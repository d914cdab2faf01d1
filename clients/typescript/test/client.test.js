// The TypeScript client against a real `turnstile serve` (started by
// tests/clients/test_typescript_client.py, or by hand: TURNSTILE_URL, TURNSTILE_KEY for a key without a
// scope, TURNSTILE_THROTTLED_KEY for one of a tenant limited to one submission). Submitting,
// the long poll, answering, problem+json as typed errors, a lost answer retried with the same
// Idempotency-Key, streams resumed after a cut, live text, the client's own errors for a server
// that is down, silent or cut off, headers read from answers, and aborting.

import assert from "node:assert/strict";
import net from "node:net";
import { after, before, test } from "node:test";

import {
  AnswerConflictError,
  ConnectionLostError,
  InvalidRequestError,
  LiveText,
  NotFoundError,
  RateLimitedError,
  ResponseTimeoutError,
  RunFinishedError,
  ServiceUnavailableError,
  SessionBusyError,
  TransportError,
  Turnstile,
  UnreachableError,
  WaitTimeoutError,
  isDelta,
} from "../dist/index.js";
import { BreakingProxy, closedPort, httpResponse, until } from "./support/proxy.js";

const BASE = process.env.TURNSTILE_URL ?? "";
const KEY = process.env.TURNSTILE_KEY ?? "";
const THROTTLED_KEY = process.env.TURNSTILE_THROTTLED_KEY ?? "";
const skip = BASE && KEY ? false : "set TURNSTILE_URL and TURNSTILE_KEY to a running turnstile serve";
const FAST = { attempts: 5, baseDelayMs: 20, maxDelayMs: 100 };
const QUESTION = {
  script: [
    { call: "echo", args: { lookup: "accounts" } },
    { ask: "Which account?" },
    { final: "transfer booked" },
  ],
};
const SLOW = {
  script: [
    { call: "sleep", args: { seconds: 0.3 } },
    { call: "sleep", args: { seconds: 0.3 } },
    { final: "done" },
  ],
};
const LATER = "2030-01-01T09:00:00Z";

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

/** The ids of a session's runs, read past the client. @param {string} session */
async function runsOf(session) {
  const answer = await fetch(`${BASE}/sessions/${session}/runs`, {
    headers: { Authorization: `Bearer ${KEY}` },
  });
  assert.equal(answer.status, 200);
  const page = /** @type {{ runs: Array<{ id: string }> }} */ (await answer.json());
  return page.runs.map((run) => run.id);
}

test("a turn is submitted, waited for, answered, and its log read", { skip }, async () => {
  const turnstile = client();
  const session = await turnstile.createSession();
  assert.equal(session.state, "idle");
  const run = await turnstile.submitTurn(session, QUESTION);
  assert.equal(run.session_id, session.id);
  assert.equal(run.class, "interactive");

  const asked = await turnstile.wait(run, { timeoutMs: 30_000 });
  assert.equal(asked.status, "waiting_for_user");
  assert.equal(asked.question, "Which account?");
  assert.equal((await turnstile.getSession(session.id)).state, "waiting_for_user");

  const answered = await turnstile.answer(asked, "acct-42");
  assert.equal(answered.id, run.id); // the answer resumes the same run
  const done = await turnstile.wait(answered, { timeoutMs: 30_000 });
  assert.equal(done.status, "succeeded");
  const result = /** @type {{ final: string, answers: string[] }} */ (done.result);
  assert.equal(result.final, "transfer booked");
  assert.deepEqual(result.answers, ["acct-42"]);

  const events = [];
  for await (const event of turnstile.events(run)) {
    events.push(event);
  }
  assert.deepEqual(
    events.map((event) => event.seq),
    events.map((_, i) => i + 1),
  );
  assert.equal(events.at(-1)?.type, "run.succeeded");

  // A sessionless run scheduled for later: the wait times out, the cancel answers twice.
  const later = await turnstile.submitRun({ report: "weekly" }, { scheduledFor: new Date(LATER) });
  assert.equal(later.session_id, null);
  assert.equal(later.class, "async");
  await assert.rejects(turnstile.wait(later, { timeoutMs: 200 }), (error) => {
    assert.ok(error instanceof WaitTimeoutError);
    assert.equal(error.run.status, "queued");
    return true;
  });
  assert.equal((await turnstile.cancel(later)).status, "cancelled");
  assert.equal((await turnstile.cancel(later.id)).status, "cancelled");
});

test("problem+json answers are typed errors with their fields", { skip }, async () => {
  const turnstile = client();
  const session = await turnstile.createSession();
  const first = await turnstile.submitTurn(session, { text: "first" }, { scheduledFor: LATER });
  await assert.rejects(turnstile.submitTurn(session, { text: "second" }), (error) => {
    assert.ok(error instanceof SessionBusyError);
    assert.equal(error.status, 409);
    assert.equal(error.type, "/problems/session-busy");
    assert.equal(error.title, "The session already has a run in progress");
    assert.ok(error.detail);
    assert.equal(error.activeRunId, first.id);
    assert.equal(error.activeRunStatus, "queued");
    return true;
  });
  assert.deepEqual(await runsOf(session.id), [first.id]); // not retried

  await assert.rejects(turnstile.getRun("00000000-0000-4000-8000-000000000000"), NotFoundError);
  await assert.rejects(
    // @ts-expect-error: not a class, as the server's OpenAPI document says
    turnstile.submitRun({ n: 1 }, { priority: "urgent" }),
    (error) => {
      assert.ok(error instanceof InvalidRequestError);
      assert.ok(error.errors.length > 0);
      return true;
    },
  );
  const done = await turnstile.wait(await turnstile.submitRun({ script: [{ final: "ok" }] }), {
    timeoutMs: 30_000,
  });
  await assert.rejects(turnstile.cancel(done), (error) => {
    assert.ok(error instanceof RunFinishedError);
    assert.equal(error.body.run_status, "succeeded");
    return true;
  });

  const asking = await turnstile.createSession();
  const asked = await turnstile.wait(await turnstile.submitTurn(asking, QUESTION), {
    timeoutMs: 30_000,
  });
  await assert.rejects(turnstile.submitTurn(asking, "x", { priority: "async" }), (error) => {
    assert.ok(error instanceof AnswerConflictError);
    assert.equal(error.field, "priority");
    return true;
  });
  await turnstile.cancel(asked);
});

test("a lost answer is retried with the same Idempotency-Key", { skip }, async () => {
  const turnstile = client({ baseUrl: proxy.base, retry: FAST });
  const session = await turnstile.createSession();
  proxy.sent = [];
  // The turn reaches the server and is committed; its answer never comes back.
  proxy.dropResponses = 1;
  const run = await turnstile.submitTurn(session, { text: "hello" });
  const keys = proxy.sentHeaders("Idempotency-Key");
  assert.equal(keys.length, 2); // the first try and the retry
  assert.equal(keys[0], keys[1]);
  assert.match(keys[0] ?? "", /^turnstile-client-/);
  assert.deepEqual(await runsOf(session.id), [run.id]); // replayed, not run again

  proxy.sent = [];
  proxy.dropResponses = 1;
  const other = await turnstile.submitRun({ text: "batch" }, { idempotencyKey: "ts-job-7" });
  assert.deepEqual(proxy.sentHeaders("Idempotency-Key"), ["ts-job-7", "ts-job-7"]);
  const again = await turnstile.submitRun({ text: "batch" }, { idempotencyKey: "ts-job-7" });
  assert.equal(again.id, other.id);
});

test("5xx and 429 answers are retried with the same key, then thrown", { skip }, async () => {
  const problem = JSON.stringify({ type: "/problems/database-unavailable", title: "x", status: 503 });
  const unavailable = httpResponse(503, "Service Unavailable", problem, {
    "Content-Type": "application/problem+json",
    "Retry-After": "0",
  });
  const turnstile = client({ baseUrl: proxy.base, retry: FAST });
  const session = await turnstile.createSession();
  proxy.sent = [];
  // Answered in the server's place: nothing reaches the server until the third try.
  proxy.answerWith = [unavailable, httpResponse(429, "Too Many Requests", "", { "Retry-After": "0" })];
  const run = await turnstile.submitTurn(session, { text: "hello" });
  const keys = proxy.sentHeaders("Idempotency-Key");
  assert.equal(keys.length, 3);
  assert.equal(new Set(keys).size, 1);
  assert.deepEqual(await runsOf(session.id), [run.id]);

  proxy.answerWith = Array(FAST.attempts).fill(unavailable);
  await assert.rejects(turnstile.getRun(run), (error) => {
    assert.ok(error instanceof ServiceUnavailableError);
    assert.equal(error.status, 503);
    assert.equal(error.retryAfter, 0);
    return true;
  });
  assert.deepEqual(proxy.answerWith, []);
});

test("a run's events resume from Last-Event-ID after the connection is cut", { skip }, async () => {
  proxy.sent = [];
  const connectionsBefore = proxy.connections;
  const turnstile = client({ baseUrl: proxy.base, retry: FAST });
  const run = await turnstile.submitRun(SLOW);
  const seen = [];
  for await (const event of turnstile.events(run)) {
    seen.push(event);
    if (seen.length === 1) {
      proxy.cut(); // mid-stream: the run has two tool calls of 0.3 s still to go
    }
  }
  assert.deepEqual(
    seen.map((event) => event.seq),
    seen.map((_, i) => i + 1),
  ); // no gap, no repeat
  assert.equal(seen.at(-1)?.type, "run.succeeded");
  const resumed = proxy.sentHeaders("Last-Event-ID").map(Number);
  assert.ok(resumed.length > 0);
  assert.ok(resumed[0] !== undefined && resumed[0] >= 1 && resumed[0] < (seen.at(-1)?.seq ?? 0));
  assert.ok(proxy.connections > connectionsBefore); // a new connection after the cut
});

test("the session stream and LiveText show the text as it is written", { skip }, async () => {
  const text = "Hello there, this is streamed in pieces.";
  /** @type {string[]} */
  const streamed = [];
  const turnstile = client({
    onResponse: (answer) => {
      if (answer.path.endsWith("/events")) {
        streamed.push(answer.path);
      }
    },
  });
  const session = await turnstile.createSession();
  const live = new LiveText();
  const controller = new AbortController();
  /** @type {string[]} */
  const shown = [];
  /** @type {string[]} */
  const completed = [];
  const following = (async () => {
    for await (const item of turnstile.sessionEvents(session, { signal: controller.signal })) {
      const now = live.apply(item);
      if (isDelta(item)) {
        shown.push(now ?? "");
      } else {
        assert.equal(item.run_no, 1);
        if (item.type === "message.completed") {
          completed.push(now ?? "");
        }
        if (item.type === "run.succeeded") {
          return;
        }
      }
    }
  })();
  await until(() => streamed.length > 0, "the session stream to open");
  await turnstile.submitTurn(session, { script: [{ say: text, pieces: 8, delay: 0.03 }] });
  await following;
  assert.deepEqual(completed, [text]);
  assert.ok(shown.length > 0);
  assert.ok(text.startsWith(shown.at(-1) ?? "?"));
});

test("a server that is down is an UnreachableError", { skip }, async () => {
  const base = `http://127.0.0.1:${await closedPort()}`;
  const turnstile = new Turnstile({
    baseUrl: base,
    apiKey: KEY,
    retry: { attempts: 3, baseDelayMs: 5, maxDelayMs: 10 },
  });
  await assert.rejects(
    turnstile.submitRun({ text: "hello" }, { idempotencyKey: "ts-down-1" }),
    (error) => {
      assert.ok(error instanceof UnreachableError);
      assert.ok(error instanceof TransportError);
      assert.equal(error.baseUrl, base);
      assert.equal(error.attempts, 3);
      assert.equal(error.idempotencyKey, "ts-down-1");
      assert.match(error.message, /^cannot reach the Turnstile API at .*ECONNREFUSED \(after 3 attempts\)$/);
      assert.ok(error.cause instanceof Error);
      return true;
    },
  );
  const stream = turnstile.events("00000000-0000-4000-8000-000000000000");
  await assert.rejects(stream.next(), UnreachableError);
});

test("a silent server is a ResponseTimeoutError", { skip }, async () => {
  /** @type {Set<net.Socket>} */
  const sockets = new Set();
  const silent = net.createServer((socket) => {
    sockets.add(socket);
    socket.on("close", () => sockets.delete(socket));
  });
  await new Promise((resolve) => silent.listen(0, "127.0.0.1", () => resolve(undefined)));
  const port = /** @type {net.AddressInfo} */ (silent.address()).port;
  try {
    const turnstile = new Turnstile({
      baseUrl: `http://127.0.0.1:${port}`,
      apiKey: KEY,
      timeoutMs: 200,
      retry: { attempts: 2, baseDelayMs: 5, maxDelayMs: 10 },
    });
    await assert.rejects(turnstile.createSession(), (error) => {
      assert.ok(error instanceof ResponseTimeoutError);
      assert.equal(error.attempts, 2);
      return true;
    });
    // A stream whose answer never starts gives up the same way.
    await assert.rejects(turnstile.events("00000000-0000-4000-8000-000000000000").next(), (error) => {
      assert.ok(error instanceof ResponseTimeoutError);
      assert.equal(error.attempts, 2);
      return true;
    });
  } finally {
    for (const socket of sockets) {
      socket.destroy();
    }
    await new Promise((resolve) => silent.close(() => resolve(undefined)));
  }
});

test("a connection lost on every try names the key to send again", { skip }, async () => {
  const turnstile = client({ baseUrl: proxy.base, retry: FAST });
  const session = await turnstile.createSession();
  proxy.sent = [];
  proxy.dropResponses = FAST.attempts;
  /** @type {string | null} */
  let key = null;
  await assert.rejects(turnstile.submitTurn(session, { text: "hello" }), (error) => {
    assert.ok(error instanceof ConnectionLostError);
    assert.equal(error.attempts, FAST.attempts);
    key = error.idempotencyKey;
    return true;
  });
  assert.ok(key);
  assert.deepEqual(proxy.sentHeaders("Idempotency-Key"), Array(FAST.attempts).fill(key));
  const [only] = await runsOf(session.id);
  const again = await turnstile.submitTurn(session, { text: "hello" }, { idempotencyKey: key });
  assert.equal(again.id, only);
  assert.deepEqual(await runsOf(session.id), [only]);
});

test("answers' headers are read: Location, Idempotent-Replayed, RateLimit, Retry-After", {
  skip: skip || (THROTTLED_KEY ? false : "set TURNSTILE_THROTTLED_KEY"),
}, async () => {
  /** @type {import("../dist/index.js").ResponseInfo[]} */
  const answers = [];
  const turnstile = new Turnstile({
    baseUrl: BASE,
    apiKey: THROTTLED_KEY,
    retry: { attempts: 1 },
    onResponse: (answer) => answers.push(answer),
  });
  const session = await turnstile.createSession();
  const turn = { idempotencyKey: "ts-headers-1" };
  const run = await turnstile.submitTurn(session, { script: [{ final: "ok" }] }, turn);
  const replayed = await turnstile.submitTurn(session, { script: [{ final: "ok" }] }, turn);
  assert.equal(replayed.id, run.id);
  const [first, second] = answers.filter((answer) => answer.path.endsWith("/turns"));
  assert.equal(first?.status, 202);
  assert.equal(first?.headers.get("Location"), `/runs/${run.id}`);
  assert.equal(first?.headers.get("Idempotent-Replayed"), null);
  assert.equal(second?.headers.get("Idempotent-Replayed"), "true");
  assert.match(first?.headers.get("RateLimit-Policy") ?? "", /^"submit";q=1;w=\d+/);
  await assert.rejects(turnstile.submitRun({ n: 2 }), (error) => {
    assert.ok(error instanceof RateLimitedError);
    assert.equal(error.status, 429);
    assert.ok(error.retryAfter !== null && error.retryAfter > 0);
    return true;
  });
});

test("an aborted wait stops at once and is not retried", { skip }, async () => {
  const turnstile = client({ baseUrl: proxy.base });
  const later = await turnstile.submitRun({ n: 1 }, { scheduledFor: LATER });
  proxy.sent = [];
  const controller = new AbortController();
  const waiting = turnstile.wait(later, { signal: controller.signal });
  const polls = () => proxy.requestLines().filter((line) => line.includes("?wait="));
  await until(() => polls().length === 1, "the long poll to be sent");
  controller.abort();
  await assert.rejects(waiting, { name: "AbortError" });
  assert.equal(polls().length, 1);
  await turnstile.cancel(later);
});

test("a base URL that is not http(s) is refused at once", () => {
  for (const baseUrl of ["127.0.0.1:8000", "ftp://example.com", "not a url"]) {
    assert.throws(() => new Turnstile({ baseUrl, apiKey: "k" }), TypeError);
  }
  assert.equal(new Turnstile({ baseUrl: "http://127.0.0.1:8000/", apiKey: "k" }).baseUrl, "http://127.0.0.1:8000");
});
