/**
 * When the client tries a request again, and how long it waits first (the Python client's
 * rules). Retried: transport errors (refused or reset connections, timeouts), 5xx answers, 429
 * (but not `too-many-pending-turns`, which lasts until the session's runs end), and 409
 * `idempotency-key-in-flight`. A submission is retried with the same `Idempotency-Key`,
 * so a request that did reach the server is replayed, never run twice. The wait doubles from
 * `baseDelayMs` up to `maxDelayMs`, with jitter, or is the answer's `Retry-After` when it gives
 * one (capped at `maxRetryAfterMs`); after `attempts` tries the last error is thrown.
 */

import {
  ConnectionLostError,
  ResponseTimeoutError,
  type TransportError,
  UnreachableError,
  slugOf,
} from "./errors.js";

export interface RetryPolicy {
  /** Tries in all (1 turns retries off). */
  attempts: number;
  baseDelayMs: number;
  maxDelayMs: number;
  maxRetryAfterMs: number;
}

export const DEFAULT_RETRY: Readonly<RetryPolicy> = {
  attempts: 6,
  baseDelayMs: 200,
  maxDelayMs: 5_000,
  maxRetryAfterMs: 30_000,
};

export function retryPolicy(given: Partial<RetryPolicy> = {}): RetryPolicy {
  const policy = { ...DEFAULT_RETRY, ...given };
  if (!Number.isInteger(policy.attempts) || policy.attempts < 1) {
    throw new RangeError("retry.attempts must be a whole number of at least 1");
  }
  if (!(policy.baseDelayMs >= 0 && policy.baseDelayMs <= policy.maxDelayMs)) {
    throw new RangeError("need 0 <= retry.baseDelayMs <= retry.maxDelayMs");
  }
  return policy;
}

/** The pause in ms after failed try number `attempt` (1-based), or `Retry-After` (seconds). */
export function delayMs(policy: RetryPolicy, attempt: number, retryAfter: number | null): number {
  if (retryAfter !== null) {
    return Math.min(Math.max(retryAfter * 1000, 0), policy.maxRetryAfterMs);
  }
  // Jitter, so that clients cut off together do not come back together.
  const ceiling = Math.min(policy.maxDelayMs, policy.baseDelayMs * 2 ** (attempt - 1));
  return ceiling / 2 + Math.random() * (ceiling / 2);
}

/** `Retry-After` in seconds: a number, or an HTTP date (RFC 9110); null when absent or unreadable. */
export function retryAfterOf(headers: Headers): number | null {
  const value = headers.get("retry-after")?.trim();
  if (!value) {
    return null;
  }
  if (/^\d+$/.test(value)) {
    return Number(value);
  }
  const when = Date.parse(value);
  return Number.isNaN(when) ? null : Math.max((when - Date.now()) / 1000, 0);
}

/** An error answer worth sending again unchanged (it wrote nothing, or its key makes a repeat safe). */
export function retryableAnswer(status: number, text: string): boolean {
  if (status === 429 && slugOfAnswer(text) === "too-many-pending-turns") {
    return false; // the session's runs must end first: minutes, not a retry's backoff
  }
  if (status >= 500 || status === 429) {
    return true;
  }
  return status === 409 && slugOfAnswer(text) === "idempotency-key-in-flight";
}

/** The problem's slug of an answer's text ("" when it is not a problem document). */
function slugOfAnswer(text: string): string {
  try {
    const body: unknown = JSON.parse(text);
    return typeof body === "object" && body !== null
      ? slugOf(String((body as { type?: unknown }).type ?? ""))
      : "";
  } catch {
    return "";
  }
}

// Node (undici) names why a connection could not be made; after a connection, other codes.
const CONNECT_CODES = new Set([
  "ECONNREFUSED",
  "ENOTFOUND",
  "EAI_AGAIN",
  "EHOSTUNREACH",
  "ENETUNREACH",
  "EADDRNOTAVAIL",
  "UND_ERR_CONNECT_TIMEOUT",
]);

function codeOf(error: unknown): string | null {
  for (let current = error, depth = 0; current && depth < 4; depth++) {
    const code = (current as { code?: unknown }).code;
    if (typeof code === "string") {
      return code;
    }
    current = (current as { cause?: unknown }).cause;
  }
  return null;
}

/** The client's error for fetch's `error`, the last of `attempts` tries. */
export function transportError(
  error: unknown,
  timedOut: boolean,
  baseUrl: string,
  attempts: number,
  idempotencyKey: string | null,
): TransportError {
  const tries = attempts > 1 ? ` (after ${attempts} attempts)` : "";
  const code = codeOf(error);
  const reason = code ?? (error instanceof Error ? error.message : String(error));
  if (timedOut) {
    return new ResponseTimeoutError(
      `the Turnstile API at ${baseUrl} did not answer in time${tries}`,
      baseUrl,
      attempts,
      idempotencyKey,
      { cause: error },
    );
  }
  // A browser says only "Failed to fetch": no connection, or a refusal by CORS.
  if (code === null || CONNECT_CODES.has(code)) {
    return new UnreachableError(
      `cannot reach the Turnstile API at ${baseUrl}: ${reason}${tries}`,
      baseUrl,
      attempts,
      idempotencyKey,
      { cause: error },
    );
  }
  return new ConnectionLostError(
    `the connection to ${baseUrl} broke: ${reason}${tries}`,
    baseUrl,
    attempts,
    idempotencyKey,
    { cause: error },
  );
}

/** Wait `ms`, or until `signal` aborts (then throw its reason). */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(signal.reason);
      return;
    }
    const onAbort = (): void => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}
