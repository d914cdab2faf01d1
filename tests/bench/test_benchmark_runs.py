"""The benchmark's entry point runs end to end in its tiny profile: every phase (ceiling, worker
processes, backlog latency, claim at depth, the claim beside 10,000 idle tenants, the API at 1
and 2 API processes from client processes of its own, runs of the openai agent in flight
against a fake endpoint, the peers' workloads) on this suite's PostgreSQL, and writes its JSON
and Markdown; and the API's phase alone beside the ceiling (the scale curve's API rows).
PGQueuer and Procrastinate come with the `bench` extra; without them the peers phase runs
Turnstile's side alone and says they are missing. Its figures mean nothing at that size and
nothing here looks at them: speed is measured by `make bench`, never asserted in tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.config import Settings

ROOT = Path(__file__).resolve().parents[2]


def bench(server_url: str, out: Path, *args: str) -> None:
    """bench/run.py in its tiny profile, writing to `out`; skipped without pgbench."""
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
        [sys.executable, str(ROOT / "bench" / "run.py"), "--profile", "tiny", "--out", out, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_bench_runs_in_its_tiny_profile(server_url: str, tmp_path: Path) -> None:
    bench(server_url, tmp_path)
    results = json.loads((tmp_path / "tiny.json").read_text())
    assert results["ceiling"]["pgbench_tps"] > 0
    assert results["throughput"][0]["runs"] == 200
    # A default `turnstile serve` layout's drain (issue 41 item 5), in the table.
    assert results["default_layout"]["runs"] == 200
    assert results["default_layout"]["layout"] == Settings.model_fields["slots"].default
    assert results["latency"]["classes"]["interactive"]["n"] > 0
    assert results["depth"][0]["queued"] == 1000
    # The claim beside 10,000 tenants whose only work is due tomorrow (issue 32, defect 2).
    assert set(results["idle_tenants"]) == {"claim of 1", "claim of 8"}
    assert results["idle_tenants"]["claim of 1"]["ratio_p50"] > 0
    assert results["api"]["statuses"].get("202", 0) > 0
    assert [row["processes"] for row in results["api_scale"]] == [1, 2]
    assert results["worker_peak_rss_mb"] > 0
    # Three runs per slot (issue 41's drain), each slot's connection reused across them.
    assert results["inflight"][0]["runs"] == 3 * results["inflight"][0]["slots"]
    assert results["inflight"][0]["model_connections_opened"] <= results["inflight"][0]["slots"]
    assert [row["mode"] for row in results["budgets"]] == ["budgets", "none"]
    assert "Turnstile" in results["peers"]["systems"]
    table = (tmp_path / "tiny.md").read_text()
    assert "| Figure |" in table
    assert "in the default layout" in table


def test_the_api_scale_curve_runs_alone(server_url: str, tmp_path: Path) -> None:
    """`--phases ceiling,api`: 1 and 2 API processes, each its own `turnstile serve
    --no-workers`, loaded by two bench/http_load.py processes; the table shows the API rows and
    the scale curve beside the ceiling, in files of their own (a partial run never replaces a
    whole run's results)."""
    bench(server_url, tmp_path, "--phases", "ceiling,api")
    assert not (tmp_path / "tiny.json").exists()
    results = json.loads((tmp_path / "tiny-ceiling-api.json").read_text())
    rows = results["api_scale"]
    assert [row["processes"] for row in rows] == [1, 2]
    for row in rows:
        assert row["clients"] == 2
        assert row["statuses"].get("202", 0) > 0
        # The accepted turns of the measured window each created a run (warm-up turns too).
        assert row["runs_created"] >= row["statuses"]["202"]
        assert len(row["server_cpu_seconds_each"]) == row["processes"]
    assert results["api"] == rows[0]
    table = (tmp_path / "tiny-ceiling-api.md").read_text()
    assert "`turnstile serve --no-workers` x 2" in table
    assert "| POST /sessions/{id}/turns, 4 connections from 2 client processes, 2 uvicorn" in table
