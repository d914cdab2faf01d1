"""The model-budgets benchmark (bench/model_budgets.py, `make bench-budgets`) runs end to end at
a tiny count on this suite's PostgreSQL: the limited endpoint, real worker processes with
budgets and without, and its JSON and Markdown. Its figures mean nothing at that size and
nothing here looks at them beyond their presence: budgets are measured by the benchmark,
never asserted on time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_budgets_burst_runs_at_a_tiny_count(server_url: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "BENCH_QUICK")}
    env["TEST_DATABASE_URL"] = server_url
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "model_budgets.py"),
            *("--runs", "24", "--tpm", "3500", "--rpm", "100"),
            *("--out", str(tmp_path), "--stem", "tiny-budgets"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "tiny-budgets.json").read_text())
    rows = {row["mode"]: row for row in results["budgets"]}
    assert set(rows) == {"budgets", "none"}
    for row in rows.values():
        assert row["runs"] == 24
        assert set(row["per_class_and_tenant"]) >= {"interactive/a", "async/b"}
    assert rows["budgets"]["budget"]["requests_used"] >= 24
    assert "| Mode |" in (tmp_path / "tiny-budgets.md").read_text()
