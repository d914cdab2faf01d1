// The page tests/clients/test_typescript_client.py loads in Chromium, from another loopback origin than
// the API's: it imports the built bundle (dist/turnstile-client.js) as a page without a bundler
// would, and drives a chat turn through CORS. Each function returns what it saw.

import {
  LiveText,
  RateLimitedError,
  SessionBusyError,
  Turnstile,
  UnreachableError,
  isDelta,
} from "/turnstile-client.js";

const status = /** @type {HTMLElement} */ (document.getElementById("status"));
const shown = /** @type {HTMLElement} */ (document.getElementById("live"));

/**
 * A turn followed live, then what only readable headers and problem documents can tell.
 * @param {string} baseUrl
 * @param {string} apiKey
 * @param {string} throttledKey
 */
async function chat(baseUrl, apiKey, throttledKey) {
  /** @type {import("../../dist/index.js").ResponseInfo[]} */
  const answers = [];
  const turnstile = new Turnstile({ baseUrl, apiKey, onResponse: (answer) => answers.push(answer) });
  const session = await turnstile.createSession();
  const live = new LiveText();
  const controller = new AbortController();
  let deltas = 0;
  let completed = "";
  let runId = "";
  const following = (async () => {
    for await (const item of turnstile.sessionEvents(session, { signal: controller.signal })) {
      const text = live.apply(item);
      if (isDelta(item)) {
        deltas += 1;
        shown.textContent = text;
      } else if (item.type === "message.completed") {
        completed = text ?? "";
        shown.textContent = completed;
      } else if (item.type === "run.succeeded") {
        runId = item.run_id ?? "";
        return;
      }
    }
  })();
  while (!answers.some((answer) => answer.path.endsWith("/events"))) {
    await new Promise((resolve) => setTimeout(resolve, 10)); // until the stream is open
  }
  const text = "Hello from the browser, streamed live.";
  const turn = { script: [{ say: text, pieces: 6, delay: 0.03 }] };
  const run = await turnstile.submitTurn(session, turn, { idempotencyKey: "browser-turn-1" });
  await following;
  const replayed = await turnstile.submitTurn(session, turn, { idempotencyKey: "browser-turn-1" });
  const [first, second] = answers.filter((answer) => answer.path.endsWith("/turns"));

  // A problem document, read across origins; then a stream resumed with Last-Event-ID.
  let busy = null;
  const held = await turnstile.submitTurn(session, { text: "later" }, {
    scheduledFor: "2030-01-01T09:00:00Z",
  });
  try {
    await turnstile.submitTurn(session, { text: "too soon" });
  } catch (error) {
    busy = error instanceof SessionBusyError ? { status: error.status, active: error.activeRunId } : String(error);
  }
  await turnstile.cancel(held);
  const resumed = [];
  for await (const event of turnstile.events(run, { after: 2 })) {
    resumed.push(event.seq);
  }

  // Over a tenant's rate limit: the 429's Retry-After is readable.
  let retryAfter = null;
  const throttled = new Turnstile({ baseUrl, apiKey: throttledKey, retry: { attempts: 1 } });
  await throttled.submitRun({ n: 1 });
  try {
    await throttled.submitRun({ n: 2 });
  } catch (error) {
    retryAfter = error instanceof RateLimitedError ? error.retryAfter : String(error);
  }
  status.textContent = "done";
  return {
    text,
    completed,
    deltas,
    sameRun: run.id === runId && replayed.id === run.id,
    location: first?.headers.get("Location") ?? null,
    replayedHeader: second?.headers.get("Idempotent-Replayed") ?? null,
    rateLimitPolicy: first?.headers.get("RateLimit-Policy") ?? null,
    rateLimit: first?.headers.get("RateLimit") ?? null,
    busy,
    heldId: held.id,
    resumed,
    retryAfter,
  };
}

/**
 * The same call from an origin the API does not allow: the browser keeps the answer.
 * @param {string} baseUrl
 * @param {string} apiKey
 */
async function refused(baseUrl, apiKey) {
  const turnstile = new Turnstile({ baseUrl, apiKey, retry: { attempts: 1 } });
  try {
    await turnstile.createSession();
    return "answered";
  } catch (error) {
    return error instanceof UnreachableError ? `${error.name}: ${error.message}` : String(error);
  }
}

Object.assign(window, { chat, refused });
status.textContent = "ready";
