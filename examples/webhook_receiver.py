"""A webhook receiver to try Turnstile's webhooks on one machine: it listens on HOST:PORT, says
so, verifies the one delivery it gets with the endpoint's secret (WEBHOOK_SECRET), prints it and
exits. Usage: WEBHOOK_SECRET=whsec_... python3 webhook_receiver.py 127.0.0.1:9000
(docs/guides/webhooks.md walks through it)."""

import base64
import hashlib
import hmac
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


def verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """True when Turnstile signed this body (headers with lower-case names)."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    webhook_id, timestamp = headers["webhook-id"], headers["webhook-timestamp"]
    if abs(time.time() - int(timestamp)) > 300:  # refuse replays of old deliveries
        return False
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return any(
        hmac.compare_digest(expected, sig.removeprefix("v1,"))
        for sig in headers["webhook-signature"].split()
    )


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        headers = {name.lower(): value for name, value in self.headers.items()}
        if not verify(os.environ["WEBHOOK_SECRET"], headers, body):
            self.send_response(401)  # not signed by Turnstile: refused
            self.end_headers()
            return
        self.send_response(204)  # any 2xx: delivered
        self.end_headers()
        event = json.loads(body)
        print(headers["webhook-id"], event["type"], event["data"]["run_id"], flush=True)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the line printed for each delivery says enough."""


if __name__ == "__main__":
    host, port = sys.argv[1].rsplit(":", 1)
    with HTTPServer((host, int(port)), Receiver) as server:
        print(f"listening on {host}:{port}", flush=True)
        server.handle_request()  # one delivery, then exit; a real receiver: serve_forever()
