"""Helpers for the job/worker integration tests (fixtures in conftest.py): a fresh migrated PostgreSQL database per test
(cloned from a migrated template), a Celery queue of its own, and real Celery worker PROCESSES running the
fake render (tests/integration/fake_pipeline.py).

Servers: PostgreSQL 127.0.0.1:5432 (user postgres, trust) and Redis 127.0.0.1:6379 db 1; tests that
restart a server start their own private instance (see test_jobs_outages.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import create_engine

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PG_HOST = os.environ.get("LONGTAKE_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")
REDIS_URL = os.environ.get("LONGTAKE_TEST_REDIS", "redis://127.0.0.1:6379/1")

sys.path.insert(0, str(HERE))

import fake_pipeline  # noqa: E402

from worker.jobs.queue import create_celery_app, enqueue_render  # noqa: E402
from worker.jobs.records import JobRecord  # noqa: E402
from worker.jobs.store import JobStore  # noqa: E402
from worker.settings import Settings  # noqa: E402
from worker.spec import JobSpec, spec_context  # noqa: E402


def admin_engine():  # type: ignore[no-untyped-def]
    return create_engine(f"{PG_HOST}/postgres", isolation_level="AUTOCOMMIT", pool_pre_ping=True)


def drop_queue(url: str, queue: str) -> None:
    """Delete one test's Celery queue (its list and bindings), leaving every other key alone, so
    test runs that share the Redis server (two checkouts, two suites) cannot wipe each other's."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    client.delete(queue, f"_kombu.binding.{queue}", *client.keys(f"{queue}\x06\x16*"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class CeleryWorker:
    """One ``celery -A celery_apps:<app> worker`` process (its own process group, so kill -9 of the
    group takes the render child with it); ``app`` names a worker app of tests/integration/celery_apps.py."""

    def __init__(
        self, name: str, env: dict[str, str], log_path: Path, pool: str = "solo", app: str = "app"
    ) -> None:
        self.name, self.env, self.log_path, self.pool, self.app = name, env, log_path, pool, app
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 90.0) -> CeleryWorker:
        env = {**self.env, "LONGTAKE_WORKER_NAME": self.name}
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                f"celery_apps:{self.app}",
                "worker",
                f"--pool={self.pool}",
                "-c",
                "1",
                "-Q",
                env["LONGTAKE_QUEUE_NAME"],
                "-n",
                f"{self.name}@%h",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "-l",
                "INFO",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited:\n{self.log_path.read_text()[-4000:]}")
            if b" ready." in self.log_path.read_bytes():
                return self
            time.sleep(0.2)
        raise TimeoutError(
            f"worker {self.name} not ready after {timeout}s:\n{self.log_path.read_text()[-4000:]}"
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def render_pids(self) -> list[int]:
        """The spawned render processes (not multiprocessing's resource tracker)."""
        out = []
        for p in child_pids(self.pid):
            try:
                cmd = Path(f"/proc/{p}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmd and pid_alive(p):
                out.append(p)
        return out

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGQUIT)  # cold shutdown: do not wait for a render
            self.proc.wait(10)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@dataclass
class JobsEnv:
    """Everything a worker test needs: settings shared with the workers, a store, a publisher."""

    tmp: Path
    settings: Settings
    env: dict[str, str]
    store: JobStore
    workers: list[CeleryWorker] = field(default_factory=list)

    @property
    def render_log(self) -> Path:
        return self.tmp / "renders.log"

    def start_worker(self, name: str, pool: str = "solo", app: str = "app", **extra_env: str) -> CeleryWorker:
        env = {**self.env, **{f"LONGTAKE_{k.upper()}": v for k, v in extra_env.items()}}
        w = CeleryWorker(name, env, self.tmp / f"{name}.log", pool=pool, app=app).start()
        self.workers.append(w)
        return w

    def submit(
        self,
        *,
        seed: int,
        num_fragments: int,
        sleep_s: float,
        publish: bool = True,
        fail_at: int | None = None,
        fail_code: str | None = None,
        tenant: str = "t1",
        hang_at: int | None = None,
        options: dict[str, str | int | float] | None = None,
    ) -> str:
        plan = fake_pipeline.write_plan(
            self.tmp / "in" / f"plan-{seed}.json",
            num_fragments=num_fragments,
            sleep_s=sleep_s,
            fail_at=fail_at,
            fail_code=fail_code,
            hang_at=hang_at,
            hang_once=self.tmp / f"hang-{seed}" if hang_at is not None else None,
        )
        spec = JobSpec.model_validate(
            {"image": f"file://{self.tmp}/in/face.png", "audio": f"file://{plan}", "seed": seed,
             "options": options or {}},
            context=spec_context(self.settings.file_root),
        )
        rec = self.store.create(spec, tenant=tenant)
        if publish:
            self.publish(rec.id)
        return rec.id

    def publish(self, job_id: str) -> None:
        enqueue_render(self.celery, job_id, queue=self.settings.queue_name)

    @property
    def celery(self):  # type: ignore[no-untyped-def]
        if not hasattr(self, "_celery"):
            self._celery = create_celery_app(self.settings)
        return self._celery

    def wait(
        self,
        job_ids: list[str],
        *,
        timeout: float,
        statuses: tuple[str, ...] = ("succeeded", "failed", "cancelled"),
    ) -> list[JobRecord]:
        deadline = time.monotonic() + timeout
        while True:
            recs = [self.store.get(j) for j in job_ids]
            if all(r is not None and r.status in statuses for r in recs):
                return recs  # type: ignore[return-value]
            if time.monotonic() > deadline:
                pending = [
                    (r.id[:8], r.status, r.chunks_done) for r in recs if r and r.status not in statuses
                ]
                logs = "\n".join(f"--- {w.name}\n{w.log_path.read_text()[-3000:]}" for w in self.workers)
                raise TimeoutError(f"jobs not done after {timeout}s: {pending}\n{logs}")
            time.sleep(0.1)

    def wait_for(self, job_id: str, pred, timeout: float) -> JobRecord:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rec = self.store.get(job_id)
            if rec is not None and pred(rec):
                return rec
            time.sleep(0.05)
        raise TimeoutError(f"job {job_id}: condition not met in {timeout}s; now {self.store.get(job_id)}")

    def renders(self) -> Counter[tuple[int, int]]:
        """(seed, fragment index) -> times the fake render produced it."""
        if not self.render_log.exists():
            return Counter()
        return Counter(
            (int(a), int(b))
            for a, b, _ in (ln.split() for ln in self.render_log.read_text().split("\n") if ln.strip())
        )

    def api(self, token: str = "outage-token-0123456789", tenant: str = "t1"):  # type: ignore[no-untyped-def]
        """The production API app on this env's database, broker and object store, driven
        in-process (``fastapi.testclient.TestClient``); ``token`` authenticates as ``tenant``."""
        from fastapi.testclient import TestClient

        from worker.api.app import create_app

        settings = self.settings.model_copy(update={"api_tokens": {token: tenant}})
        client = TestClient(create_app(settings), raise_server_exceptions=False)
        client.headers["Authorization"] = f"Bearer {token}"
        return client

    def api_spec(self, *, seed: int, num_fragments: int, sleep_s: float) -> dict[str, object]:
        """A JSON job spec for :meth:`api` running the fake render (same inputs as :meth:`submit`)."""
        plan = fake_pipeline.write_plan(
            self.tmp / "in" / f"plan-{seed}.json", num_fragments=num_fragments, sleep_s=sleep_s
        )
        return {"image": f"file://{self.tmp}/in/face.png", "audio": f"file://{plan}", "seed": seed}

    def final_bytes(self, rec: JobRecord) -> bytes:
        uri = rec.outputs["mp4"]
        assert uri.startswith("file://"), uri
        return Path(uri[len("file://") :]).read_bytes()


def make_env(tmp: Path, database_url: str, broker_url: str, **overrides: str) -> dict[str, str]:
    (tmp / "in").mkdir(parents=True, exist_ok=True)
    (tmp / "in" / "face.png").write_bytes(b"not really a png")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LONGTAKE_")}
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]),
            "LONGTAKE_DATABASE_URL": database_url,
            "LONGTAKE_BROKER_URL": broker_url,
            "LONGTAKE_OBJECT_STORE_URL": f"file://{tmp}/objects",
            "LONGTAKE_FILE_ROOT": str(tmp / "in"),
            "LONGTAKE_WORK_DIR": str(tmp / "work"),
            # one queue per test: a message can only reach this test's workers
            "LONGTAKE_QUEUE_NAME": f"longtake-test-{uuid.uuid4().hex[:10]}",
            "LONGTAKE_LEASE_S": "3",
            # a state with every segment: these tests count renders per fragment (the interval's
            # re-render-and-verify path is tested in test_delivery_s3.py)
            "LONGTAKE_STATE_EVERY": "1",
            "LONGTAKE_HEARTBEAT_S": "0.5",
            "LONGTAKE_REAPER_INTERVAL_S": "0.5",
            "LONGTAKE_CANCEL_POLL_S": "0.1",
            "LONGTAKE_CANCEL_GRACE_S": "3",
            "LONGTAKE_KILL_GRACE_S": "2",
            "LONGTAKE_MAX_ATTEMPTS": "3",
            "LONGTAKE_LOG_LEVEL": "INFO",
            "LONGTAKE_FAKE_RENDER_LOG": str(tmp / "renders.log"),
        }
    )
    env.update({f"LONGTAKE_{k.upper()}": v for k, v in overrides.items()})
    return env


def settings_from_env(env: dict[str, str]) -> Settings:
    saved = {k: v for k, v in os.environ.items() if k.startswith("LONGTAKE_")}
    try:
        for k in saved:
            del os.environ[k]
        os.environ.update({k: v for k, v in env.items() if k.startswith("LONGTAKE_")})
        return Settings()
    finally:
        for k in [k for k in os.environ if k.startswith("LONGTAKE_")]:
            del os.environ[k]
        os.environ.update(saved)
