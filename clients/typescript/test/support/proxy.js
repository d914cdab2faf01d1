// A TCP proxy on loopback in front of the API, that breaks connections on demand (the Python
// suite's tests/support/proxy.py, for Node): `cut()` resets every open connection, as a network
// failure would; `dropResponses` swallows the next N answers and closes their connections (a
// request that reached the server and whose answer never came back); `answerWith` answers the
// next requests in the server's place (a load balancer's 503, say).

import net from "node:net";

export class BreakingProxy {
  /** @param {string} upstream the API's base URL */
  constructor(upstream) {
    const url = new URL(upstream);
    this.upstream = { host: url.hostname, port: Number(url.port) };
    this.port = 0;
    this.dropResponses = 0;
    /** @type {Buffer[]} everything clients sent */
    this.sent = [];
    /** @type {string[]} whole HTTP responses to answer the next requests with */
    this.answerWith = [];
    this.connections = 0;
    /** @type {Set<net.Socket>} */
    this.open = new Set();
    this.server = net.createServer((client) => this.handle(client));
  }

  get base() {
    return `http://127.0.0.1:${this.port}`;
  }

  /** @returns {Promise<BreakingProxy>} */
  start() {
    return new Promise((resolve) => {
      this.server.listen(0, "127.0.0.1", () => {
        this.port = /** @type {net.AddressInfo} */ (this.server.address()).port;
        resolve(this);
      });
    });
  }

  cut() {
    for (const socket of this.open) {
      socket.resetAndDestroy();
    }
  }

  /**
   * The values of header `name` in every request sent so far, in order.
   * @param {string} name
   */
  sentHeaders(name) {
    const prefix = `${name.toLowerCase()}:`;
    return Buffer.concat(this.sent)
      .toString("latin1")
      .split("\r\n")
      .filter((line) => line.toLowerCase().startsWith(prefix))
      .map((line) => line.slice(prefix.length).trim());
  }

  /** The request lines sent so far (`GET /runs/...?wait=... HTTP/1.1`). */
  requestLines() {
    return Buffer.concat(this.sent)
      .toString("latin1")
      .split("\r\n")
      .filter((line) => /^(GET|POST|PUT|DELETE|OPTIONS) /.test(line));
  }

  /** @param {net.Socket} client */
  handle(client) {
    this.connections += 1;
    const upstream = net.connect(this.upstream.port, this.upstream.host);
    this.open.add(client).add(upstream);
    const forget = () => {
      this.open.delete(client);
      this.open.delete(upstream);
      client.destroy();
      upstream.destroy();
    };
    client.on("data", (data) => {
      this.sent.push(data);
      const canned = this.answerWith.shift();
      if (canned !== undefined) {
        client.write(canned);
        return;
      }
      upstream.write(data);
    });
    upstream.on("data", (data) => {
      if (this.dropResponses > 0) {
        this.dropResponses -= 1;
        forget();
        return;
      }
      client.write(data);
    });
    for (const socket of [client, upstream]) {
      socket.on("close", forget);
      socket.on("error", forget);
    }
  }

  /** @returns {Promise<void>} */
  close() {
    this.cut();
    return new Promise((resolve) => this.server.close(() => resolve()));
  }
}

/**
 * A whole HTTP response, for `answerWith`.
 * @param {number} status
 * @param {string} reason
 * @param {string} [body]
 * @param {Record<string, string>} [headers]
 */
export function httpResponse(status, reason, body = "", headers = {}) {
  const lines = [`HTTP/1.1 ${status} ${reason}`, `Content-Length: ${Buffer.byteLength(body)}`];
  for (const [name, value] of Object.entries(headers)) {
    lines.push(`${name}: ${value}`);
  }
  return `${lines.join("\r\n")}\r\n\r\n${body}`;
}

/**
 * Resolve once `condition()` holds, checking at each turn of the event loop (bounded).
 * @param {() => boolean} condition
 * @param {string} what
 */
export async function until(condition, what) {
  for (let turn = 0; turn < 10_000; turn++) {
    if (condition()) {
      return;
    }
    await new Promise((resolve) => setTimeout(resolve, 5));
  }
  throw new Error(`still waiting for ${what}`);
}

/** A loopback port nothing listens on (bound, then closed). */
export async function closedPort() {
  const server = net.createServer();
  await new Promise((resolve) => server.listen(0, "127.0.0.1", () => resolve(undefined)));
  const port = /** @type {net.AddressInfo} */ (server.address()).port;
  await new Promise((resolve) => server.close(() => resolve(undefined)));
  return port;
}
