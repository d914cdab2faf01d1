// LiveText's rules (docs/runtime.md): deltas placed at their offsets, older epochs dropped, a
// newer epoch starting again, a gap waiting for the whole text, message.completed authoritative,
// offsets in code points.

import assert from "node:assert/strict";
import { test } from "node:test";

import { LiveText, newIdempotencyKey } from "../dist/index.js";

const RUN = "00000000-0000-4000-8000-000000000001";

/**
 * @param {number} epoch
 * @param {number} message
 * @param {number} offset
 * @param {string} text
 * @returns {import("../dist/index.js").Delta}
 */
function delta(epoch, message, offset, text) {
  return { type: "message.delta", run_id: RUN, epoch, message, offset, text };
}

/**
 * @param {string} type
 * @param {number} epoch
 * @param {unknown} data
 * @returns {import("../dist/index.js").Event}
 */
function event(type, epoch, data = {}) {
  return { seq: 1, type, epoch, data, created_at: "2026-12-01T00:00:00Z", run_id: RUN, run_no: 1 };
}

test("deltas are placed at their offsets and message.completed is authoritative", () => {
  const live = new LiveText();
  assert.equal(live.apply(delta(1, 0, 0, "Hello ")), "Hello ");
  assert.equal(live.apply(delta(1, 0, 6, "there")), "Hello there");
  assert.equal(live.apply(delta(1, 0, 0, "Hi")), "Hi"); // a retried model call starts again
  assert.equal(live.apply(delta(1, 0, 9, "late")), "Hi"); // a gap: wait for the whole text
  assert.equal(live.apply(event("message.completed", 1, { text: "Hi all", message: 0 })), "Hi all");
  assert.equal(live.text(RUN), "");
  assert.equal(live.apply(delta(1, 0, 0, "stale")), ""); // the completed message's
  assert.equal(live.apply(delta(1, 1, 0, "Next")), "Next");
});

test("an older epoch is dropped and a newer one starts again", () => {
  const live = new LiveText();
  live.apply(delta(1, 0, 0, "The answer is"));
  assert.equal(live.apply(delta(2, 0, 0, "Re-run")), "Re-run");
  assert.equal(live.apply(delta(1, 0, 13, " forty-two")), "Re-run");
  assert.equal(live.apply(event("run.claimed", 3)), null); // a new claim: nothing yet
  assert.equal(live.text(RUN), "");
  live.apply(delta(3, 0, 0, "x"));
  assert.equal(live.apply(event("run.succeeded", 3)), null);
  assert.equal(live.text(RUN), ""); // forgotten once the run ends
});

test("offsets count code points, not UTF-16 units", () => {
  const live = new LiveText();
  live.apply(delta(1, 0, 0, "🙂🙂 ok"));
  assert.equal(live.apply(delta(1, 0, 2, "!")), "🙂🙂!");
});

test("idempotency keys are random version-4 UUIDs", () => {
  const key = newIdempotencyKey();
  assert.match(key, /^turnstile-client-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$/);
  assert.notEqual(newIdempotencyKey(), key);
});
