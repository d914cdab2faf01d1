"""The churn benchmark's entry point (bench/churn.py, `make bench-churn`) runs end to end at a
tiny count on this suite's PostgreSQL: producers, claiming lanes, the retention pruner and the
claim probes at every checkpoint, then its JSON and Markdown. Its figures mean nothing at that
size and nothing here looks at them: churn is measured by `make bench-churn`, never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_churn_runs_at_a_tiny_count(server_url: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env["TEST_DATABASE_URL"] = server_url
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "churn.py"),
            *("--runs", "300", "--backlog", "100", "--retention", "0"),
            *("--out", str(tmp_path), "--stem", "tiny-churn"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "tiny-churn.json").read_text())
    assert results["churn"]["runs"] >= 300
    assert [p["fraction"] for p in results["churn"]["checkpoints"]] == [0, 0.25, 0.5, 0.75, 1]
    assert "| Point |" in (tmp_path / "tiny-churn.md").read_text()
