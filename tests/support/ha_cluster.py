"""A highly available PostgreSQL of the test's own: pg_auto_failover's monitor, a primary and a
synchronous standby, each a throwaway cluster on its own loopback port (never the machine's
server on 5432), started and stopped by the test.

Chosen over Patroni with etcd: one Debian package pair (`postgresql-15-auto-failover`,
`pg-auto-failover-cli`, installed by `.ci/install-system-packages`), no consensus store to run
beside it, and a failover that is one state machine on the monitor, which a test can read
(`pg_autoctl show state`) and drive (`pg_autoctl perform failover`).

Facts this module works around: `pg_autoctl` and initdb refuse to run as root, so everything
runs as the `postgres` system user in folders it owns; a node's `shared_buffers` is set small
(PostgreSQL's own default, not one sized from the machine's memory); with one standby,
`--replication-quorum true` gives `synchronous_standby_names = 'ANY 1 (...)'`, so a commit
acknowledged by the primary is on the standby too; and a SIGKILLed postmaster alone is often
restarted by its own `pg_autoctl` before the monitor fails over, so `kill_primary` kills the
node's `pg_autoctl` first, then its postmaster (a machine lost whole). The monitor's health
checks and its demote timeout are made shorter than their defaults (a node is declared
unhealthy after about 5 s, not 20 s; the promoted standby takes writes 5 s later, not 30 s)
so a test's failover takes seconds; docs/deployment.md gives the production figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.store.embedded import free_port
from tests.support.system_tools import require_or_skip

PG_BIN = Path("/usr/lib/postgresql/15/bin")
EXTENSION = Path("/usr/share/postgresql/15/extension/pgautofailover.control")

MONITOR_SETTINGS = {
    # How the monitor decides a node is gone (defaults 5 s, 5 s, 2, 2 s, 20 s): a node that
    # stopped answering is declared unhealthy after about 5 s instead of 20 s.
    "pgautofailover.health_check_period": "1000",
    "pgautofailover.health_check_timeout": "1000",
    "pgautofailover.health_check_max_retries": "1",
    "pgautofailover.health_check_retry_delay": "500",
    "pgautofailover.node_considered_unhealthy_timeout": "3000",
    # How long a promoted standby waits (in stop_replication, its commits held) for the lost
    # primary to report itself demoted before it takes writes anyway (default 30 s): the guard
    # against two primaries when the old one is only cut off. Here it is known dead.
    "pgautofailover.primary_demote_timeout": "5000",
}

NODE_SETTINGS = (
    "shared_buffers = '32MB'\n"
    "max_connections = 120\n"
    "fsync = off\n"  # a throwaway cluster; synchronous replication is what the test relies on
    "wal_keep_size = '256MB'\n"
)


def pg_autoctl() -> Path:
    """The pg_autoctl binary, else skip (or fail under TURNSTILE_REQUIRE_SYSTEM_TESTS=1)."""
    found = shutil.which("pg_autoctl") or (
        str(PG_BIN / "pg_autoctl") if (PG_BIN / "pg_autoctl").is_file() else None
    )
    if found is None or not EXTENSION.is_file() or not (PG_BIN / "pg_ctl").is_file():
        require_or_skip(
            "pg_auto_failover",
            "pg_autoctl and the pgautofailover extension of PostgreSQL 15 are needed "
            "(apt-get install postgresql-15-auto-failover pg-auto-failover-cli)",
        )
    return Path(str(found))


@dataclass
class Node:
    name: str
    port: int
    pgdata: Path
    process: subprocess.Popen[bytes] | None = None

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.pgdata / "postmaster.pid").read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None


@dataclass
class AutoFailoverCluster:
    """A monitor and two nodes (`node1` first primary, `node2` its synchronous standby)."""

    folder: Path
    binary: Path
    monitor_port: int = field(default_factory=free_port)
    nodes: list[Node] = field(default_factory=list)
    monitor: Node | None = None
    log: list[str] = field(default_factory=list)

    # --- running pg_autoctl as postgres ------------------------------------------------------
    def _env(self) -> dict[str, str]:
        return {
            "PATH": f"{PG_BIN}:/usr/bin:/bin",
            "HOME": str(self.folder),
            "XDG_CONFIG_HOME": str(self.folder / "config"),
            "XDG_DATA_HOME": str(self.folder / "share"),
            "XDG_RUNTIME_DIR": str(self.folder / "run"),
            "PG_CONFIG": str(PG_BIN / "pg_config"),
            "LANG": "C.UTF-8",
        }

    def _user(self) -> dict[str, Any]:
        if os.geteuid() != 0:
            return {}  # not root: pg_autoctl runs as whoever runs the tests
        entry = pwd.getpwnam("postgres")
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        done = subprocess.run(
            [str(self.binary), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self._env(),
            cwd=self.folder,
            check=False,
            **self._user(),
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"pg_autoctl {' '.join(args)}: {done.stderr[-2000:]}")
        return str(done.stdout)

    def psql(self, port: int, sql: str, database: str = "postgres") -> str:
        command = [str(PG_BIN / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres"]
        done = subprocess.run(
            [*command, "-d", database, "-XAtc", sql],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            **self._user(),
        )
        if done.returncode != 0:
            raise RuntimeError(f"psql on {port}: {done.stderr[-1000:]}")
        return str(done.stdout).strip()

    def _spawn(self, node: Node) -> None:
        logfile = (self.folder / f"{node.name}.log").open("ab")
        node.process = subprocess.Popen(
            [str(self.binary), "run", "--pgdata", str(node.pgdata)],
            stdout=logfile,
            stderr=subprocess.STDOUT,
            env=self._env(),
            cwd=self.folder,
            start_new_session=True,
            **self._user(),
        )
        logfile.close()

    # --- lifecycle ---------------------------------------------------------------------------
    def monitor_uri(self) -> str:
        return f"postgres://autoctl_node@127.0.0.1:{self.monitor_port}/pg_auto_failover?sslmode=disable"

    def start(self) -> None:
        self.monitor = Node("monitor", self.monitor_port, self.folder / "monitor")
        self.run(
            "create",
            "monitor",
            "--pgdata",
            str(self.monitor.pgdata),
            "--pgport",
            str(self.monitor_port),
            "--pgctl",
            str(PG_BIN / "pg_ctl"),
            "--hostname",
            "127.0.0.1",
            "--auth",
            "trust",
            "--no-ssl",
        )
        self._tune(self.monitor.pgdata, monitor=True)
        self._spawn(self.monitor)
        self._wait(lambda: self._answers(self.monitor_port), "the monitor to answer")
        for name in ("node1", "node2"):
            node = Node(name, free_port(), self.folder / name)
            self.nodes.append(node)
            self.run(
                "create",
                "postgres",
                "--pgdata",
                str(node.pgdata),
                "--pgport",
                str(node.port),
                "--pgctl",
                str(PG_BIN / "pg_ctl"),
                "--hostname",
                "127.0.0.1",
                "--name",
                name,
                "--auth",
                "trust",
                "--no-ssl",
                "--replication-quorum",
                "true",
                "--monitor",
                self.monitor_uri(),
                timeout=300,
            )
            self._tune(node.pgdata, monitor=False)
            self._spawn(node)
            # Alone, the first node is `single`; the standby's arrival makes it `primary`.
            wanted = "single" if name == "node1" else "secondary"
            self._wait(lambda n=name, w=wanted: self.states().get(n) == (w, w), f"{name} {wanted}")
        self.wait_for("node1")
        self._wait(self.synchronous, "synchronous replication")

    def _tune(self, pgdata: Path, *, monitor: bool) -> None:
        """Small settings for a throwaway node, in postgresql.conf (read at the next start)."""
        extra = NODE_SETTINGS
        if monitor:
            extra += "".join(f"{k} = {v}\n" for k, v in MONITOR_SETTINGS.items())
        with (pgdata / "postgresql.conf").open("a") as conf:
            conf.write(extra)
        # Stopped here, `pg_autoctl run` starts it again with these settings.
        subprocess.run(
            [str(PG_BIN / "pg_ctl"), "-D", str(pgdata), "-m", "fast", "-w", "stop"],
            capture_output=True,
            timeout=60,
            check=False,
            env=self._env(),
            **self._user(),
        )

    def _answers(self, port: int) -> bool:
        try:
            return self.psql(port, "SELECT 1", "postgres") == "1"
        except RuntimeError:
            return False

    def _wait(self, condition: Any, what: str, within: float = 180) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            try:
                if condition():
                    return
            except (RuntimeError, subprocess.TimeoutExpired, ValueError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}: {self.states()} {self.tail()}")

    def tail(self) -> str:
        return "\n".join(
            f"--- {p.name}\n" + p.read_text(errors="replace")[-1500:]
            for p in sorted(self.folder.glob("*.log"))
        )

    def states(self) -> dict[str, tuple[str, str]]:
        """Each node's (reported, assigned) state, as the monitor sees it."""
        try:
            out = self.run("show", "state", "--json", "--monitor", self.monitor_uri(), timeout=20)
            rows = json.loads(out)
        except (RuntimeError, ValueError, subprocess.TimeoutExpired):
            return {}
        return {
            row["nodename"]: (row["current_group_state"], row["assigned_group_state"])
            for row in rows
        }

    def synchronous(self) -> bool:
        primary = self.primary()
        if primary is None:
            return False
        names = self.psql(primary.port, "SHOW synchronous_standby_names")
        return names.startswith("ANY 1")

    def primary(self) -> Node | None:
        for node in self.nodes:
            if self.states().get(node.name) == ("primary", "primary"):
                return node
        return None

    def url(self, database: str = "postgres") -> str:
        """The multi-host URL the services use: both nodes, the primary wherever it is."""
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        return (
            f"postgresql://postgres@{hosts}/{database}"
            "?target_session_attrs=read-write&connect_timeout=3"
        )

    def kill(self, node: Node) -> None:
        """The node lost whole: its pg_autoctl (which would restart PostgreSQL) and its
        postmaster SIGKILLed, in that order."""
        if node.process is not None and node.process.poll() is None:
            os.killpg(node.process.pid, signal.SIGKILL)
            node.process.wait(30)
        pid = node.postmaster_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def restart(self, node: Node) -> None:
        """The lost node comes back: its pg_autoctl rejoins it as a standby (pg_rewind)."""
        self._wait(lambda: not self._postmaster_alive(node), f"{node.name}'s postmaster to exit")
        self._spawn(node)

    def _postmaster_alive(self, node: Node) -> bool:
        pid = node.postmaster_pid()
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def wait_for(self, primary: str, *, within: float = 180) -> None:
        """Until `primary` is the primary and the other node its standby, in sync again."""
        other = next(n.name for n in self.nodes if n.name != primary)
        self._wait(
            lambda: (
                self.states().get(primary) == ("primary", "primary")
                and self.states().get(other) == ("secondary", "secondary")
            ),
            f"{primary} primary and {other} secondary",
            within,
        )

    def wait_promoted(self, name: str, *, within: float = 120) -> None:
        """Until `name` takes writes (it may still wait for its standby to come back)."""
        node = next(n for n in self.nodes if n.name == name)
        self._wait(
            lambda: self.psql(node.port, "SELECT pg_is_in_recovery()") == "f",
            f"{name} to be promoted",
            within,
        )

    def perform_failover(self) -> None:
        self.run("perform", "failover", "--monitor", self.monitor_uri(), "--wait", "0", timeout=60)

    def stop(self) -> None:
        for node in [*self.nodes, *([self.monitor] if self.monitor else [])]:
            if node.process is not None and node.process.poll() is None:
                node.process.send_signal(signal.SIGTERM)
        for node in [*self.nodes, *([self.monitor] if self.monitor else [])]:
            if node.process is not None:
                try:
                    node.process.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(node.process.pid, signal.SIGKILL)
                    node.process.wait(30)
            pid = node.postmaster_pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.folder, ignore_errors=True)


def prepared_folder(prefix: str) -> Path:
    """A temporary folder the `postgres` user owns (and can reach)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    folder.chmod(0o755)
    for sub in ("config", "share", "run"):
        (folder / sub).mkdir(mode=0o700)
    if os.geteuid() != 0:
        return folder
    entry = pwd.getpwnam("postgres")
    for path in [folder, *folder.iterdir()]:
        os.chown(path, entry.pw_uid, entry.pw_gid)
    return folder


async def start_cluster() -> AutoFailoverCluster:
    binary = pg_autoctl()
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            require_or_skip("the postgres user", "pg_autoctl refuses root and runs as postgres")
    cluster = AutoFailoverCluster(prepared_folder("turnstile-ha-"), binary)
    try:
        await asyncio.to_thread(cluster.start)
    except BaseException:
        await asyncio.to_thread(cluster.stop)
        raise
    return cluster
