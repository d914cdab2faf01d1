"""The benchmark's entry point runs end to end in its tiny profile: every phase (ceiling, worker
processes, backlog latency, claim at depth, the API from its own client process, runs of the
openai agent in flight against a fake endpoint, the peers' workloads) on this suite's
PostgreSQL, and writes its JSON and Markdown. PGQueuer and Procrastinate come with the `bench`
extra; without them the peers phase runs Turnstile's side alone and says they are missing.
Its figures mean nothing at that size and nothing here looks at them: speed is measured by
`make bench`, never asserted in tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_bench_runs_in_its_tiny_profile(server_url: str, tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import ceiling

        try:
            ceiling.pgbench_binary()
        except SystemExit:
            pytest.skip("pgbench not found (it ships with the PostgreSQL server packages)")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "BENCH_QUICK")}
    env["TEST_DATABASE_URL"] = server_url
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--profile", "tiny", "--out", tmp_path],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "tiny.json").read_text())
    assert results["ceiling"]["pgbench_tps"] > 0
    assert results["throughput"][0]["runs"] == 200
    assert results["latency"]["classes"]["interactive"]["n"] > 0
    assert results["depth"][0]["queued"] == 1000
    assert results["api"]["statuses"].get("202", 0) > 0
    assert results["worker_peak_rss_mb"] > 0
    assert results["inflight"][0]["runs"] == results["inflight"][0]["slots"]
    assert "Turnstile" in results["peers"]["systems"]
    assert "| Figure |" in (tmp_path / "tiny.md").read_text()
