/**
 * `LiveText`: the text of each run's message as it is being written, from a session stream's
 * deltas and events (docs/runtime.md, the same rules as the Python client's `LiveText`): a
 * delta of an older epoch than the run's newest is dropped, and one of a newer epoch (the run
 * was re-run after a lost lease) replaces the partial text; a delta places its text at its
 * offset (an offset before the end replaces from there, as a retried model call does; one past
 * the end means a delta was missed: it waits for the whole text); `message.completed` is the
 * authoritative text and ends the message. Offsets count Unicode code points, as the server
 * does, not UTF-16 units.
 */

import { type Delta, type Event, TERMINAL_EVENTS, isDelta } from "./models.js";

interface Partial {
  epoch: number;
  message: number;
  text: string[]; // code points
}

export class LiveText {
  readonly #runs = new Map<string, Partial>();

  /** The run's text so far ("" when nothing is being written). */
  text(runId: string): string {
    return this.#runs.get(runId)?.text.join("") ?? "";
  }

  /**
   * Take one item of a stream (`runId`: the run, for a run's own stream, whose events do not
   * name it); the run's partial text after it, or the whole text of a message it completed.
   */
  apply(item: Event | Delta, runId?: string): string | null {
    if (isDelta(item)) {
      const partial = this.#partial(item.run_id);
      const order = compare([item.epoch, item.message], [partial.epoch, partial.message]);
      if (order < 0) {
        return partial.text.join(""); // an older claim's, or an already completed message
      }
      if (order > 0) {
        Object.assign(partial, { epoch: item.epoch, message: item.message, text: [] });
      }
      if (item.offset <= partial.text.length) {
        partial.text = [...partial.text.slice(0, item.offset), ...Array.from(item.text)];
      }
      return partial.text.join("");
    }
    const owner = item.run_id ?? runId;
    if (owner === undefined) {
      return null;
    }
    const partial = this.#partial(owner);
    if (item.epoch > partial.epoch) {
      Object.assign(partial, { epoch: item.epoch, message: 0, text: [] });
    }
    const data = item.data as { text?: unknown; message?: unknown } | null;
    if (item.type === "message.completed" && data !== null && typeof data === "object") {
      partial.message = Number(data.message ?? 0) + 1;
      partial.text = [];
      return String(data.text ?? "");
    }
    if (TERMINAL_EVENTS.has(item.type)) {
      this.#runs.delete(owner);
    }
    return null;
  }

  #partial(runId: string): Partial {
    let partial = this.#runs.get(runId);
    if (partial === undefined) {
      partial = { epoch: 0, message: 0, text: [] };
      this.#runs.set(runId, partial);
    }
    return partial;
  }
}

function compare(a: [number, number], b: [number, number]): number {
  return a[0] !== b[0] ? a[0] - b[0] : a[1] - b[1];
}
