"""Server restarts mid-render: a private Redis and a private PostgreSQL (started here, on their own
ports, so the shared servers are never disturbed) are restarted while a job renders; the job still
finishes with a complete, correct output, and the worker keeps serving new jobs afterwards."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import fake_pipeline
import pytest
from jobs_harness import JobsEnv, free_port, make_env, settings_from_env
from sqlalchemy import text

from worker.jobs.db import make_engine, migrate
from worker.jobs.store import JobStore

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class PrivateRedis:
    def __init__(self, workdir: Path) -> None:
        self.dir, self.port = workdir, free_port()
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
                "yes",
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
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._ctl("-o", opts, "start")

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


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    d = tmp_path / "redis"
    d.mkdir()
    r = PrivateRedis(d)
    r.start()
    yield r
    r.stop()


def _env(tmp: Path, db_url: str, broker_url: str) -> JobsEnv:
    env = make_env(tmp, db_url, broker_url)
    settings = settings_from_env(env)
    return JobsEnv(
        tmp=tmp,
        settings=settings,
        env=env,
        store=JobStore(make_engine(db_url), max_attempts=settings.max_attempts),
    )


def test_redis_restart_mid_render(tmp_path: Path, pg_url: str, private_redis: PrivateRedis) -> None:
    je = _env(tmp_path, pg_url, private_redis.url)
    try:
        je.start_worker("w1")
        n = 24
        job = je.submit(seed=61, num_fragments=n, sleep_s=0.2)
        je.wait_for(job, lambda r: r.chunks_done >= 3, timeout=60)
        private_redis.stop()
        time.sleep(1.0)
        private_redis.start()
        (rec,) = je.wait([job], timeout=120)
        assert rec.status == "succeeded" and rec.attempts == 1
        assert je.final_bytes(rec) == fake_pipeline.expected_output(61, n)
        # the worker reconnected: a job submitted after the restart runs too
        job2 = je.submit(seed=62, num_fragments=3, sleep_s=0.02)
        (rec2,) = je.wait([job2], timeout=120)
        assert rec2.status == "succeeded"
    finally:
        for w in je.workers:
            w.stop()


def test_postgres_restart_mid_render(tmp_path: Path, private_redis: PrivateRedis) -> None:
    pg = PrivatePostgres()
    try:
        pg.start()
        url = pg.create_db("jobs_outage")
        migrate(url)
        je = _env(tmp_path, url, private_redis.url)
        try:
            je.start_worker("w1")
            n = 24
            job = je.submit(seed=71, num_fragments=n, sleep_s=0.2)
            je.wait_for(job, lambda r: r.chunks_done >= 3, timeout=60)
            t0 = time.monotonic()
            pg.restart()
            print(f"PostgreSQL restart took {time.monotonic() - t0:.1f} s")
            (rec,) = je.wait([job], timeout=120)
            assert rec.status == "succeeded", rec
            assert rec.attempts == 1  # no lease was lost: the retries bridged the outage
            assert [s.index for s in je.store.segments(job)] == list(range(n))
            assert je.final_bytes(rec) == fake_pipeline.expected_output(71, n)
            log = (tmp_path / "w1.log").read_text()
            assert "database connection error" in log  # the outage was really seen, and retried
        finally:
            for w in je.workers:
                w.stop()
            je.store.engine.dispose()
    finally:
        pg.stop()
