"""A loopback HTTP server, run as its own process, that counts every request reaching it.

The chaos suite points its runs' `http_request` calls here. Each call's path names the run's
submission and the script step (`/effect/{tag}/{step}`), so a count per path is a count of
effects per tool invocation, whatever happened to the workers that made them. It runs outside
the test's own process so a busy load generator never slows its answers (a slow answer would
turn into timeouts and change what the test observes).

    python -m tests.support.counting_server PORT

`GET /__hits` returns every request seen so far as `[method, path, idempotency-key]` triples.
"""

from __future__ import annotations

import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

HITS: list[tuple[str, str, str | None]] = []

app = FastAPI()


@app.get("/__hits")
async def hits() -> JSONResponse:
    return JSONResponse(HITS)


@app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def record(path: str, request: Request) -> JSONResponse:
    HITS.append((request.method, "/" + path, request.headers.get("idempotency-key")))
    return JSONResponse({"ok": True, "n": len(HITS)})


def main() -> None:
    port = int(sys.argv[1])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
