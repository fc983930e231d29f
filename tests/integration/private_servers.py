"""Private servers for outage tests: a redis-server and a PostgreSQL (initdb + pg_ctl) of the test's
own, on free ports, so stopping or restarting them never disturbs the shared servers."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from jobs_harness import free_port
from sqlalchemy import text

from worker.jobs.db import make_engine


class PrivateRedis:
    """A redis-server of the test's own; ``persist=False`` keeps nothing across a restart (every
    message is lost, as with a Redis run without AOF or a fresh pod)."""

    def __init__(self, workdir: Path, *, persist: bool = True) -> None:
        self.dir, self.port, self.persist = workdir, free_port(), persist
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed")
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "yes" if self.persist else "no",
                "--protected-mode",
                "no",
            ],
            stdout=open(self.dir / "redis.log", "ab"),
            stderr=subprocess.STDOUT,
        )
        import redis

        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(self.url, socket_timeout=1).ping()
                return
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)


class PrivatePostgres:
    """initdb + pg_ctl into a temp dir, run as the postgres user when we are root."""

    def __init__(self) -> None:
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not bins:
            pytest.skip("initdb not found under /usr/lib/postgresql/*/bin; cannot run a private PostgreSQL")
        self.bin = Path(bins[-1]).parent
        self.dir = Path(tempfile.mkdtemp(prefix="jobs_pg_"))
        self.port = free_port()
        self.as_postgres: list[str] = []
        if os.geteuid() == 0:
            runuser = shutil.which("runuser")
            if runuser is None:
                pytest.skip("running as root without runuser: cannot initdb as the postgres user")
            shutil.chown(self.dir, "postgres", "postgres")
            self.as_postgres = [runuser, "-u", "postgres", "--"]

    def _ctl(self, *args: str) -> None:
        subprocess.run(
            [
                *self.as_postgres,
                str(self.bin / "pg_ctl"),
                "-D",
                str(self.dir / "data"),
                "-w",
                "-t",
                "60",
                "-l",
                str(self.dir / "pg.log"),
                *args,
            ],
            check=True,
            capture_output=True,
        )

    def start(self) -> None:
        subprocess.run(
            [
                *self.as_postgres,
                str(self.bin / "initdb"),
                "-D",
                str(self.dir / "data"),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
            check=True,
            capture_output=True,
        )
        self.start_server()

    def start_server(self) -> None:
        """(Re)start the server on its data directory (after :meth:`stop_server`)."""
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._ctl("-o", opts, "start")

    def stop_server(self) -> None:
        """Stop the server (fast: sessions are cut), keeping its data for :meth:`start_server`."""
        self._ctl("-m", "fast", "stop")

    def restart(self) -> None:
        self._ctl("-m", "fast", "restart")

    def stop(self) -> None:
        try:
            self._ctl("-m", "immediate", "stop")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def create_db(self, name: str) -> str:
        admin = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres")
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        admin.dispose()
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"
