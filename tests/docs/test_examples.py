"""Every example runs as written (issue 38): the shell and Python blocks of README.md and docs/
run, in each page's order, against a real `turnstile serve` on a free loopback port with a fresh
database of TEST_DATABASE_URL's server. The rules a page follows are in tests/docs/doc_blocks.py.

One server serves every page, started as the README says to serve your own agent (from
examples/, `TURNSTILE_PLUGINS=my_agent:register`) and with the settings the guides ask for: the
webhooks' `TURNSTILE_SECRET_KEY` and allow-list entry for a receiver on this machine, and
`TURNSTILE_OPENAI_BASE_URL` pointing at a loopback stand-in for a model (so no network model is
needed). Each page runs in one bash process (`set -euo pipefail`, curl failing on an HTTP error),
so a variable a page never defines, a 401, or a Python function defined and never called fails
its test. The blocks' addresses are the reader's: `http://127.0.0.1:8000` (and `localhost`) is
this server, `127.0.0.1:9000` a free port for the webhook receiver. The shell has the server's
settings and DATABASE_URL in its environment, as the reader's shell would after exporting them.
Skipped blocks are listed one by one with their reason (`pytest -ra` shows them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from app.store.embedded import free_port
from tests.docs.doc_blocks import NOT_RUN, PYTHON, ROOT, SHELL, Block, blocks, pages
from tests.support.databases import clone_database, drop_database

BIN = Path(sys.executable).parent
PAGES = pages()
ALL_BLOCKS = [block for page in PAGES for block in blocks(page)]
RUN_PAGES = [page for page in PAGES if any(block.runs for block in blocks(page))]
SKIPPED = [block for block in ALL_BLOCKS if block.directive == "skip"]
FILES = [block for block in ALL_BLOCKS if block.directive == "file"]
PAGE_TIMEOUT_SECONDS = 120


@dataclass(frozen=True)
class DocServer:
    base: str  # the server, in place of http://127.0.0.1:8000
    receiver: str  # host:port for the webhook receiver, in place of 127.0.0.1:9000
    shell_env: dict[str, str]


class StandInModel(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat-completions endpoint on loopback: it remembers a name it was
    told in the conversation, and otherwise says what it was asked."""

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        said = [
            str(message.get("content") or "")
            for message in request["messages"]
            if message["role"] == "user"
        ]
        names = [match[1] for text in said if (match := re.search(r"name is (\w+)", text))]
        last = said[-1] if said else ""
        if "my name" in last.lower() and "?" in last and names:
            text = f"Your name is {names[-1]}."
        elif names and last.endswith(f"name is {names[-1]}."):
            text = f"Hello {names[-1]}! How can I help you today?"
        else:
            text = f"(a stand-in model on loopback) You asked: {last}"
        body = json.dumps(
            {
                "id": "chatcmpl-doc",
                "object": "chat.completion",
                "model": request.get("model", "stand-in"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the test's output is the pages'."""


@pytest.fixture(scope="module")
def model() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInModel)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def doc_server(server_url: str, template_database: str, model: str) -> Iterator[DocServer]:
    database = asyncio.run(clone_database(server_url, template_database))
    port, receiver = free_port(), f"127.0.0.1:{free_port()}"
    settings = {
        "DATABASE_URL": database,
        "TURNSTILE_SECRET_KEY": secrets.token_urlsafe(32),
        "TURNSTILE_HTTP_ALLOWED_HOSTS": f"{receiver},*",
    }
    inherited = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("TURNSTILE_") and name != "DATABASE_URL"
    }
    server_env = {
        **inherited,
        **settings,
        "TURNSTILE_PLUGINS": "my_agent:register",
        "TURNSTILE_OPENAI_BASE_URL": model,
        "TURNSTILE_OPENAI_API_KEY": "stand-in",
        "TURNSTILE_OPENAI_STREAM": "false",
        "TURNSTILE_LOG_FORMAT": "text",
    }
    log = tempfile.TemporaryFile()  # noqa: SIM115 (kept open for the server's whole life)
    process = subprocess.Popen(
        [str(BIN / "turnstile"), "serve", "--port", str(port)],
        cwd=ROOT / "examples",  # the README's way: the plugin module is in the current folder
        env=server_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert process.stderr is not None
    ready = threading.Event()

    def read_log(stream: object = process.stderr) -> None:
        assert process.stderr is not None
        for line in process.stderr:
            log.write(line)
            if b"Uvicorn running" in line:
                ready.set()

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        if not ready.wait(60):
            log.seek(0)
            pytest.fail("turnstile serve did not start:\n" + log.read().decode()[-3000:])
        yield DocServer(
            base=f"http://127.0.0.1:{port}",
            receiver=receiver,
            shell_env={**inherited, **settings, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"},
        )
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        reader.join(10)
        process.stderr.close()
        log.close()
        asyncio.run(drop_database(server_url, database))


PRELUDE = r"""set -euo pipefail
doctest_interrupt() {  # pid, the text it prints once ready, its output file
  local waited=0
  until grep -qF -- "$2" "$3"; do
    kill -0 "$1" 2>/dev/null || break
    (( waited++ < 600 )) || break
    sleep 0.1
  done
  kill -INT "$1"
  local status=0
  wait "$1" || status=$?
  cat "$3"
  if (( status != 0 )) || grep -q Traceback "$3"; then
    echo "doctest: exit status $status after Ctrl-C, or a traceback" >&2
    return 1
  fi
}
"""


def addresses(text: str, server: DocServer) -> str:
    return (
        text.replace("http://127.0.0.1:8000", server.base)
        .replace("http://localhost:8000", server.base)
        .replace("127.0.0.1:9000", server.receiver)
    )


def curl_failing_on_errors(folder: Path) -> Path:
    """A `curl` first on the blocks' PATH that fails on an HTTP error answer, as a reader would
    notice one (a 401 for a key never defined). It execs the real one, so `curl ... &` leaves a
    curl process that `kill $!` ends."""
    real = shutil.which("curl")
    assert real is not None, "the doc tests need curl"
    folder.mkdir()
    wrapper = folder / "curl"
    wrapper.write_text(f'#!/bin/sh\nexec {real} --fail-with-body "$@"\n')
    wrapper.chmod(0o755)
    return folder


def script(page: Path, server: DocServer, scratch: Path) -> str:
    """The page's blocks, in order, as one bash script (each announces itself on stderr)."""
    parts = [PRELUDE]
    for block in blocks(page):
        if not block.runs:
            continue
        text = addresses(block.text, server)
        parts.append(f'echo "doctest: {block.where} (at $SECONDS s)" >&2')
        if block.lang in SHELL:
            parts.append(text)
        elif block.directive == "interrupt after":
            out = scratch / f"block-{block.line}.out"
            parts.append(
                f"python3 tests/docs/run_python.py '{block.where}' > '{out}' 2>&1 "
                f"<<'DOCTEST_PYTHON_END' &\n{text}DOCTEST_PYTHON_END\n"
                f"doctest_interrupt $! {block.argument!r} '{out}'"
            )
        else:
            parts.append(
                f"python3 tests/docs/run_python.py '{block.where}' "
                f"<<'DOCTEST_PYTHON_END'\n{text}DOCTEST_PYTHON_END"
            )
    return "\n".join(parts) + "\n"


@pytest.mark.parametrize("page", RUN_PAGES, ids=[str(p.relative_to(ROOT)) for p in RUN_PAGES])
def test_the_pages_examples_run_as_written(
    page: Path, doc_server: DocServer, tmp_path: Path
) -> None:
    path, output = tmp_path / "page.sh", tmp_path / "page.out"
    path.write_text(script(page, doc_server, tmp_path))
    bin_dir = curl_failing_on_errors(tmp_path / "bin")
    env = {**doc_server.shell_env, "PATH": f"{bin_dir}{os.pathsep}{doc_server.shell_env['PATH']}"}
    with output.open("wb") as out:
        # A file, not a pipe: a background job a block leaves running cannot hold the test up.
        process = subprocess.Popen(
            ["bash", str(path)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its background jobs are ended with it
        )
        try:
            process.wait(timeout=PAGE_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    text = output.read_text(errors="replace")
    print(text)
    blocks_run = re.findall(r"^doctest: (\S+:\d+) \(at \d+ s\)$", text, flags=re.MULTILINE)
    assert process.returncode != -signal.SIGKILL, (
        f"{page.name} ran past {PAGE_TIMEOUT_SECONDS} s, in the block at "
        f"{blocks_run[-1] if blocks_run else page.name}:\n{text[-4000:]}"
    )
    assert process.returncode == 0, (
        f"the block at {blocks_run[-1] if blocks_run else page.name} failed "
        f"(exit {process.returncode}):\n{text[-4000:]}"
    )


@pytest.mark.parametrize("block", SKIPPED, ids=[block.where for block in SKIPPED])
def test_a_skipped_block_says_why(block: Block) -> None:
    assert block.argument, f"{block.where}: `doctest: skip:` needs a reason"
    pytest.skip(f"{block.where}: {block.argument}")


@pytest.mark.parametrize("block", FILES, ids=[block.where for block in FILES])
def test_a_files_copy_is_the_file(block: Block) -> None:
    path = ROOT / block.argument
    assert path.is_file(), f"{block.where}: no file {block.argument}"
    assert block.text == path.read_text(encoding="utf-8"), (
        f"{block.where} differs from {block.argument}: copy the file into the page again"
    )


def test_every_block_says_what_it_is() -> None:
    """A fence without a language (or with one nobody knows) could be a command left unrun."""
    known = SHELL | PYTHON | NOT_RUN
    unclear = [f"{b.where} ({b.lang or 'no language'})" for b in ALL_BLOCKS if b.lang not in known]
    assert not unclear, f"say what these blocks are (```sh, ```python, ```text...): {unclear}"
    runs_in_python = [
        b.where for b in ALL_BLOCKS if b.directive == "interrupt after" and b.lang not in PYTHON
    ]
    assert not runs_in_python, f"`interrupt after` is for Python blocks: {runs_in_python}"


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 200, f"README.md has {lines} lines: move the details into docs/"


def test_the_docs_site_builds(tmp_path: Path) -> None:
    """`make docs`: the generated references, then `mkdocs build --strict` (a broken link or a
    page missing from the nav fails it)."""
    subprocess.run([sys.executable, "scripts/docs_reference.py"], cwd=ROOT, check=True)
    built = subprocess.run(
        [str(BIN / "mkdocs"), "build", "--strict", "--quiet", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    assert (tmp_path / "reference" / "http-api.html").is_file()
    assert (tmp_path / "reference" / "cli.html").is_file()
