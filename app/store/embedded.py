"""The zero-setup database: an embedded PostgreSQL kept in a local data folder.

With no `DATABASE_URL`, Turnstile runs on a PostgreSQL of its own:
1. the `pgserver` package's bundled server, where a wheel exists for this Python (it listens on a
   Unix socket in the data folder only, and as root it runs the server as its own system user);
2. otherwise PostgreSQL binaries found on the machine (`pg_ctl` on PATH or a Debian-style
   `/usr/lib/postgresql/<version>/bin`), started the same way by `LocalCluster`;
3. otherwise `EmbeddedUnavailableError`, whose message says how to set `DATABASE_URL`.

The embedded server is a separate process tree in a session of its own (pg_ctl calls setsid()),
so a signal to the service's process group (Ctrl-C in a terminal, SIGTERM from a supervisor)
never reaches it: the service drains its pool and disposes its engine first, then releases the
server (`EmbeddedDatabase.release`), which pgserver stops once no process holds it.

pgserver narrates every command it runs (initdb's whole output included) through its logger at
info level: that goes to a file of its own in the data folder (`embedded-postgres.log`), not
among the service's log lines; its warnings and errors still reach them.

`LocalCluster` is also what tests use to start throwaway clusters they may stop, restart or break
without touching the machine's own server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

log = logging.getLogger("turnstile.embedded")

EMBEDDED_LOG = "embedded-postgres.log"
"""The embedded server's own narration (pgserver's), in the data folder."""

SET_DATABASE_URL_HINT = (
    "set DATABASE_URL=postgresql://USER@HOST:5432/DATABASE to use an existing PostgreSQL"
)


class EmbeddedUnavailableError(RuntimeError):
    """No embedded PostgreSQL can be started on this machine."""


def _socket_url(socket_dir: Path, port: int, user: str, database: str) -> str:
    return f"postgresql://{user}@/{database}?host={quote(str(socket_dir))}&port={port}"


def pgserver_bin_dir() -> Path | None:
    """The bin folder of the `pgserver` package's bundled PostgreSQL, if it is installed."""
    try:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset, which is normal in containers.
            warnings.simplefilter("ignore")
            from pgserver._commands import POSTGRES_BIN_PATH
    except ImportError:
        return None
    path = Path(POSTGRES_BIN_PATH)
    return path if (path / "pg_ctl").exists() else None


def system_bin_dir() -> Path | None:
    """A PostgreSQL server's bin folder found on this machine, newest version first."""
    candidates: list[Path] = []
    pg_ctl = shutil.which("pg_ctl")
    if pg_ctl:
        candidates.append(Path(pg_ctl).resolve().parent)
    candidates.extend(
        sorted(
            Path("/usr/lib/postgresql").glob("*/bin"),
            # ASCII digits only: str.isdigit() also accepts '²', which int() refuses.
            key=lambda p: int(p.parent.name) if re.fullmatch(r"[0-9]{1,6}", p.parent.name) else 0,
            reverse=True,
        )
    )
    for candidate in candidates:
        if (candidate / "initdb").exists() and (candidate / "postgres").exists():
            return candidate
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class LocalCluster:
    """A PostgreSQL cluster in a folder of ours, started with `pg_ctl`.

    As root, PostgreSQL refuses to run, so the server runs as `run_as` (a system user that is
    created when missing). `port` None means Unix socket only (the embedded default); a port
    makes it listen on 127.0.0.1 too (tests that restart a server they can reach over TCP).
    """

    bin_dir: Path
    data_dir: Path
    port: int | None = None
    run_as: str | None = None
    socket_dir: Path = field(init=False)
    _user: str = field(init=False, default="postgres")

    def __post_init__(self) -> None:
        self.data_dir = self.data_dir.resolve()
        self.socket_dir = self.data_dir
        if self.run_as is None and os.geteuid() == 0:
            self.run_as = "pgserver" if pgserver_bin_dir() == self.bin_dir else "postgres"

    # --- lifecycle ----------------------------------------------------------------------------
    def _run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        kwargs: dict[str, object] = {}
        if self.run_as is not None:
            entry = pwd.getpwnam(self.run_as)
            # Drop root's groups too, or root's group permissions would still apply.
            kwargs.update(user=entry.pw_uid, group=entry.pw_gid, extra_groups=[])
        return subprocess.run(  # type: ignore[call-overload, no-any-return]
            list(args), capture_output=True, text=True, timeout=timeout, check=False, **kwargs
        )

    def _prepare_owner(self) -> None:
        if self.run_as is None:
            return
        _ensure_system_user(self.run_as)
        entry = pwd.getpwnam(self.run_as)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # Every folder above the data folder, and above the binaries, must be traversable by
        # the server's user: a checkout under a private folder (mktemp -d makes it 0700) would
        # otherwise keep initdb from even starting.
        for parent in {*self.data_dir.parents, self.bin_dir, *self.bin_dir.parents}:
            mode = parent.stat().st_mode
            if not mode & 0o001:
                parent.chmod(mode | 0o001)
        os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
        self.data_dir.chmod(0o700)

    def initialised(self) -> bool:
        return (self.data_dir / "PG_VERSION").exists()

    def init(self) -> None:
        """Create the cluster (trust auth, user `postgres`) if the folder holds none yet."""
        self._prepare_owner()
        if self.initialised():
            return
        done = self._run(
            str(self.bin_dir / "initdb"),
            "-D",
            str(self.data_dir),
            "-U",
            self._user,
            "--auth=trust",
            "--encoding=UTF8",
            "--no-sync",
        )
        if done.returncode != 0:
            raise EmbeddedUnavailableError(f"initdb failed: {done.stderr.strip()[-500:]}")

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        self._prepare_owner()
        listen = (
            f"-c listen_addresses=127.0.0.1 -p {self.port}"
            if self.port
            else ("-c listen_addresses=''")
        )
        options = f"{listen} -k {self.socket_dir} -c max_connections=200"
        done = self._run(
            str(self.bin_dir / "pg_ctl"),
            "-D",
            str(self.data_dir),
            "-w",
            "-t",
            "60",
            "-l",
            str(self.data_dir / "server.log"),
            "-o",
            options,
            "start",
            timeout=90,
        )
        if done.returncode != 0:
            log = self.data_dir / "server.log"
            tail = log.read_text(errors="replace")[-800:] if log.exists() else ""
            raise EmbeddedUnavailableError(f"pg_ctl start failed: {done.stderr.strip()} {tail}")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`fast`: disconnect clients; `immediate`: like a crash)."""
        if not self.running():
            return
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "stop")

    def kill(self) -> None:
        """SIGKILL the postmaster: the closest thing to pulling the plug."""
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)

    def pid(self) -> int | None:
        pidfile = self.data_dir / "postmaster.pid"
        try:
            return int(pidfile.read_text().splitlines()[0])
        except (FileNotFoundError, ValueError, IndexError):
            return None

    def running(self) -> bool:
        pid = self.pid()
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def url(self, database: str = "postgres") -> str:
        """A libpq-style URL: TCP when the cluster has a port, else its Unix socket."""
        if self.port:
            return f"postgresql://{self._user}@127.0.0.1:{self.port}/{database}"
        return _socket_url(self.socket_dir, 5432, self._user, database)


def _ensure_system_user(name: str) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True,
            capture_output=True,
        )


@dataclass
class EmbeddedDatabase:
    """The embedded server backing a process that was given no DATABASE_URL."""

    url: str
    kind: str  # "pgserver" or "system binaries"
    data_dir: Path
    _cluster: LocalCluster | None = None
    _handle: Any = None  # pgserver's PostgresServer, shared by every process that uses it

    def release(self) -> None:
        """Give this process's hold on the server back, once nothing in it uses the server any
        more (the pool drained, the engine disposed): pgserver stops the server when the last
        process holding it lets go, and leaves it to the others otherwise. Without this call
        pgserver does the same at interpreter exit; calling it is what makes the order
        explicit. A server of system binaries keeps running for the next start."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            handle.cleanup()  # pgserver's own release: a no-op again at exit
            log.info("embedded PostgreSQL released", extra={"data_dir": str(self.data_dir)})

    def stop(self) -> None:
        """Stop the server now (pgserver would otherwise stop it when this process exits)."""
        if self._cluster is not None:
            self._cluster.stop()


class _ProblemsToService(logging.Handler):
    """Hands pgserver's warnings and errors on to the service's own log."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger().handle(record)


class _NarrationFile(logging.FileHandler):
    """pgserver's narration file. pgserver still narrates from its exit hook, when the data
    folder (a throwaway one in tests and tools) may be gone: a line with nowhere to go is
    dropped, not raised from the interpreter's exit."""

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(OSError):
            super().emit(record)


def _pgserver_log_to(path: Path) -> None:
    """pgserver's logger writes to `path` (its info lines only there), once per process."""
    logger = logging.getLogger("pgserver")
    if any(getattr(handler, "baseFilename", None) == str(path) for handler in logger.handlers):
        return
    to_file = _NarrationFile(path, encoding="utf-8")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.handlers[:] = [to_file, _ProblemsToService()]
    logger.setLevel(logging.INFO)
    logger.propagate = False


def start_embedded(data_dir: Path) -> EmbeddedDatabase:
    """Start (or reuse) the embedded PostgreSQL whose data lives in `data_dir`."""
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    if pgserver_bin_dir() is not None:
        _pgserver_log_to(data_dir / EMBEDDED_LOG)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import pgserver

        server = pgserver.get_server(  # type: ignore[attr-defined]
            data_dir / "pgdata", cleanup_mode="stop"
        )
        # pgserver hands back the handle it cached in this process even when the server was
        # stopped since; start it again in that case.
        server.ensure_postgres_running()
        info = server.get_postmaster_info()
        url = _socket_url(Path(info.socket_dir), int(info.port or 5432), "postgres", "postgres")
        handle = LocalCluster(bin_dir=Path(str(pgserver_bin_dir())), data_dir=data_dir / "pgdata")
        return EmbeddedDatabase(
            url=url, kind="pgserver", data_dir=data_dir, _cluster=handle, _handle=server
        )
    bin_dir = system_bin_dir()
    if bin_dir is None:
        raise EmbeddedUnavailableError(
            "no embedded PostgreSQL for this Python (pgserver has no wheel for it) and no "
            f"PostgreSQL binaries on this machine: {SET_DATABASE_URL_HINT}"
        )
    cluster = LocalCluster(bin_dir=bin_dir, data_dir=data_dir / "pgdata-system")
    cluster.init()
    if not cluster.running():
        cluster.start()
    return EmbeddedDatabase(
        url=cluster.url(), kind="system binaries", data_dir=data_dir, _cluster=cluster
    )
