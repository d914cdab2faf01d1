/**
 * Server-Sent Events read from a fetch response's body. `EventSource` cannot send our
 * `Authorization` header, so the client fetches the stream itself and parses it with
 * eventsource-parser. A stream silent for longer than `idleMs` is a dead one (the API sends a
 * keep-alive comment every 15 s): `onIdle` is called, which aborts the fetch.
 */

import { type EventSourceMessage, createParser } from "eventsource-parser";

export async function* sseMessages(
  body: ReadableStream<Uint8Array>,
  idleMs: number,
  onIdle: () => void,
): AsyncGenerator<EventSourceMessage, void, undefined> {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  const ready: EventSourceMessage[] = [];
  const parser = createParser({ onEvent: (message) => ready.push(message) });
  try {
    while (true) {
      const timer = setTimeout(onIdle, idleMs);
      let chunk: ReadableStreamReadResult<Uint8Array>;
      try {
        chunk = await reader.read();
      } finally {
        clearTimeout(timer);
      }
      parser.feed(chunk.done ? decoder.decode() : decoder.decode(chunk.value, { stream: true }));
      while (ready.length > 0) {
        yield ready.shift() as EventSourceMessage;
      }
      if (chunk.done) {
        return;
      }
    }
  } finally {
    // Left early (the caller stopped reading) or broken: close the connection.
    reader.cancel().catch(() => undefined);
  }
}
