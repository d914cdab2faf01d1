"""A fake OpenAI-compatible chat-completions endpoint that enforces rate limits of its own, as a
provider does, for the model-budgets phase (bench/model_budgets.py): requests a minute and
tokens a minute, each a token bucket holding a minute's worth and refilling continuously, and
over either a 429 with `Retry-After` (whole seconds until the bucket has room, at least 1).
Every answer carries the usual rate-limit headers, as OpenAI sends them:
`x-ratelimit-limit-requests`/`-tokens`, `x-ratelimit-remaining-requests`/`-tokens` and
`x-ratelimit-reset-requests`/`-tokens` (the time until the bucket is full again, as "1m2.5s").

A call costs its messages' JSON over 4 (its prompt tokens) plus ANSWER tokens (its answer),
charged when it arrives; the answer reports them as its `usage`. That is never more than a
Turnstile reservation's estimate (the whole request body over 4, plus the output bound), and
usually less: settlement gives the difference back. Like bench/fake_model.py, a raw asyncio
HTTP/1.1 server (keep-alive, Content-Length bodies) in a process of its own.

Usage: python bench/limited_model.py PORT RPM TPM [ANSWER_TOKENS] [DELAY_SECONDS]
(prints "ready" once listening). GET /stats answers what it saw: calls served and refused
(429), tokens served, and the wall-clock times of the first and last call served.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time


class Bucket:
    """A minute's worth at most, refilled continuously at a minute's worth a minute."""

    def __init__(self, per_minute: float) -> None:
        self.per_minute = per_minute
        self.level = per_minute
        self.at = time.monotonic()

    def refill(self) -> float:
        now = time.monotonic()
        self.level = min(self.per_minute, self.level + (now - self.at) * self.per_minute / 60)
        self.at = now
        return self.level

    def seconds_until(self, amount: float) -> float:
        return max(0.0, (amount - self.level) * 60 / self.per_minute)


def duration(seconds: float) -> str:
    """OpenAI's way of writing a reset time: `1m2.5s`, `6ms`, `0s`."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3g}s" if rest else ""
    return f"{int(minutes)}m{text}" if minutes else text


class Endpoint:
    def __init__(self, rpm: int, tpm: int, answer_tokens: int, delay: float) -> None:
        self.requests = Bucket(rpm)
        self.tokens = Bucket(tpm)
        self.answer_tokens = answer_tokens
        self.delay = delay
        self.served = 0
        self.refused = 0
        self.tokens_served = 0
        self.first: float | None = None
        self.last: float | None = None

    def headers(self) -> bytes:
        r, t = self.requests, self.tokens
        return (
            f"x-ratelimit-limit-requests: {int(r.per_minute)}\r\n"
            f"x-ratelimit-limit-tokens: {int(t.per_minute)}\r\n"
            f"x-ratelimit-remaining-requests: {max(0, math.floor(r.level))}\r\n"
            f"x-ratelimit-remaining-tokens: {max(0, math.floor(t.level))}\r\n"
            f"x-ratelimit-reset-requests: {duration(r.seconds_until(r.per_minute))}\r\n"
            f"x-ratelimit-reset-tokens: {duration(t.seconds_until(t.per_minute))}\r\n"
        ).encode()

    def complete(self, body: bytes) -> tuple[int, bytes, bytes]:
        request = json.loads(body)
        prompt = math.ceil(len(json.dumps(request.get("messages", []))) / 4)
        used = prompt + self.answer_tokens
        self.requests.refill()
        self.tokens.refill()
        waits = []
        if self.requests.level < 1:
            waits.append(self.requests.seconds_until(1))
        if self.tokens.level < used:
            waits.append(self.tokens.seconds_until(used))
        if waits:
            self.refused += 1
            answer = b'{"error": {"message": "rate limit reached", "type": "requests"}}'
            extra = b"Retry-After: %d\r\n" % max(1, math.ceil(max(waits)))
            return 429, answer, self.headers() + extra
        self.requests.level -= 1
        self.tokens.level -= used
        self.served += 1
        self.tokens_served += used
        now = time.time()
        self.first = self.first or now
        self.last = now
        answer = json.dumps(
            {
                "id": "chatcmpl-limited",
                "object": "chat.completion",
                "model": "limited",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "done"},
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": self.answer_tokens,
                    "total_tokens": used,
                },
            }
        ).encode()
        return 200, answer, self.headers()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length) if length else b""
                extra = b""
                if head.startswith(b"GET /stats"):
                    status, answer = 200, json.dumps(self.stats()).encode()
                else:
                    if self.delay:
                        await asyncio.sleep(self.delay)
                    status, answer, extra = self.complete(body)
                reason = b"OK" if status == 200 else b"Too Many Requests"
                writer.write(
                    b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n%s"
                    b"Content-Length: %d\r\n\r\n" % (status, reason, extra, len(answer)) + answer
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def stats(self) -> dict[str, float | int | None]:
        return {
            "served": self.served,
            "refused": self.refused,
            "tokens_served": self.tokens_served,
            "first_served_at": self.first,
            "last_served_at": self.last,
        }


async def main() -> None:
    port, rpm, tpm = (int(a) for a in sys.argv[1:4])
    answer_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 100
    delay = float(sys.argv[5]) if len(sys.argv) > 5 else 0.05
    endpoint = Endpoint(rpm, tpm, answer_tokens, delay)
    server = await asyncio.start_server(endpoint.handle, "127.0.0.1", port, backlog=8192)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
