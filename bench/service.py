"""The job service end to end with the real pipeline, under load and under kill -9.

    python -m bench.service --jobs 6 --seconds 60 --kills 5 --json

Runs on this machine's PostgreSQL and Redis (a database and a Celery queue of its own, dropped at
the end), a local object store, ``max_attempts = kills + 2``, and ``--workers`` real ``longtake worker`` processes (the
production Celery app: real pipeline, tiny preset, one CPU rank each). Three phases:

1. **Load**: ``--jobs`` jobs of ``--seconds`` of speech each, submitted at once; every job must
   succeed on its first attempt, and the final MP4 of each must hold the audio's duration (ffprobe).
   This is the shape that lost 6 of 20 jobs when rank 0 wrote its pipe from two threads (issue 17).
2. **Reference**: one more job, uninterrupted: its final MP4 bytes.
3. **Chaos**: the same spec (same seed and inputs: the same bytes are due) again, and the worker
   holding it is killed with SIGKILL (the process group: worker and rank) when its committed chunk
   count reaches each of ``--kills`` points spread over the job; a fresh worker replaces it. The
   final MP4 must equal the reference byte for byte; each segment object must have been written
   once (its mtime never changes after it first appears); the time from each kill to the job's next
   committed chunk on another worker is reported.

``--load-only`` stops after phase 1: the shape of the long-job check (``--jobs 1 --seconds 7200
--workers 1 --load-only``: a 2-hour job through the service), which also samples the resident
memory of each worker's process tree every 10 s — the worker process and its rank apart, each as
resident and anonymous bytes (``/proc/<pid>/smaps_rollup``) — and reports it by quarter of the
job's progress with a slope per part: flat memory over hours, as users run it, and if not, which
process holds what grows. ``--samples FILE`` writes each sample as it is taken.

Prints one JSON object. Settings that shorten the lease (``--lease-s``) are printed with it: the
death-to-resume figure is ``lease_s + reaper_interval_s`` plus one chunk, by design.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.inputs import DEMO_IMAGE, speech_wav

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
PG_HOST = "postgresql+psycopg://postgres@127.0.0.1:5432"
REDIS = "redis://127.0.0.1:6379/5"


def _env(tmp: Path, db_url: str, queue: str, lease_s: float, max_attempts: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LONGTAKE_")}
    env.update({
        "LONGTAKE_DATABASE_URL": db_url,
        "LONGTAKE_BROKER_URL": REDIS,
        "LONGTAKE_QUEUE_NAME": queue,
        "LONGTAKE_OBJECT_STORE_URL": (tmp / "objects").as_uri(),
        "LONGTAKE_FILE_ROOT": str(tmp / "in"),
        "LONGTAKE_WORK_DIR": str(tmp / "work"),
        "LONGTAKE_LEASE_S": str(lease_s),
        "LONGTAKE_HEARTBEAT_S": str(max(0.5, lease_s / 5)),
        "LONGTAKE_REAPER_INTERVAL_S": "1",
        "LONGTAKE_MAX_ATTEMPTS": str(max_attempts),
        "LONGTAKE_LOG_LEVEL": "INFO",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]),
    })
    return env


class _Worker:
    def __init__(self, name: str, env: dict[str, str], log: Path) -> None:
        from worker.cli import worker_argv
        from worker.settings import Settings

        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        try:
            argv = worker_argv(Settings(), hostname=f"{name}@%h", loglevel="INFO")
        finally:
            os.environ.clear()
            os.environ.update(saved)
        self.name, self.log = name, log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "worker.jobs.celery_app", *argv],
                env={**env, "LONGTAKE_WORKER_NAME": name},
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while b" ready." not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.name} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _duration(path: Path) -> float:
    out = subprocess.run(
        ["ffprobe", "-v", "error", "-show_entries", "format=duration", "-of", "csv=p=0", str(path)],
        capture_output=True, text=True, check=True,
    )
    return float(out.stdout.strip())


def _rollup(pid: int) -> tuple[int, int]:
    """(resident, anonymous) bytes of one process (``/proc/<pid>/smaps_rollup``; zeros when gone)."""
    rss = anon = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Anonymous:"):
                anon = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, anon


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc), ``pid`` first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _tree_memory(pid: int) -> dict[str, int]:
    """Resident memory of a worker's tree, split: the worker process itself and its descendants
    (the rank and whatever the rank runs), each as resident and anonymous bytes."""
    pids = _tree(pid)
    worker_rss, worker_anon = _rollup(pids[0])
    ranks = [_rollup(p) for p in pids[1:]]
    rank_rss, rank_anon = sum(r for r, _ in ranks), sum(a for _, a in ranks)
    return {"rss": worker_rss + rank_rss, "worker_rss": worker_rss, "worker_anon": worker_anon,
            "rank_rss": rank_rss, "rank_anon": rank_anon}


def _peak_since_reset(pid: int) -> int:
    """``pid``'s peak resident bytes since the last call: its ``VmHWM``, then reset to its current
    RSS (as ``bench.stream`` does per minute of video); 0 when gone."""
    from pipeline.host import peak_rss_bytes, reset_peak_rss

    peak = peak_rss_bytes(pid)
    reset_peak_rss(pid)
    return peak


def _tree_peaks(pid: int) -> dict[str, int]:
    """Peak resident bytes since the last call: the worker process, and its descendants (the rank;
    the sum of their peaks)."""
    pids = _tree(pid)
    return {"worker_peak": _peak_since_reset(pids[0]), "rank_peak": sum(_peak_since_reset(p) for p in pids[1:])}


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (0 when gone)."""
    return _tree_memory(pid)["rss"]


def _slope_mb_per_10_min(points: list[tuple[float, int]]) -> float | None:
    """Least-squares slope of (seconds, bytes) points, in MB per 10 minutes."""
    if len(points) < 3:
        return None
    mt = sum(t for t, _ in points) / len(points)
    mm = sum(m for _, m in points) / len(points)
    var = sum((t - mt) ** 2 for t, _ in points)
    return round(sum((t - mt) * (m - mm) for t, m in points) / var * 600 / 2**20, 3) if var else None


def _segment_mtimes(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*.m4s")}


def run(
    jobs: int, seconds: float, kills: int, workers: int, lease_s: float, load_only: bool = False,
    samples_path: Path | None = None,
) -> dict[str, Any]:
    from sqlalchemy import create_engine, text

    from worker.jobs.db import make_engine, migrate
    from worker.jobs.queue import create_celery_app, enqueue_render
    from worker.jobs.store import JobStore
    from worker.settings import Settings
    from worker.spec import JobSpec, spec_context

    tmp = Path(tempfile.mkdtemp(prefix="longtake-bench-service-"))
    (tmp / "in").mkdir()
    db = f"bench_service_{uuid.uuid4().hex[:8]}"
    queue = f"bench-service-{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{db}"'))
    db_url = f"{PG_HOST}/{db}"
    migrate(db_url)
    env = _env(tmp, db_url, queue, lease_s, max_attempts=kills + 2)  # every kill costs an attempt
    saved = dict(os.environ)
    os.environ.update({k: v for k, v in env.items() if k.startswith("LONGTAKE_")})
    settings = Settings()
    os.environ.clear()
    os.environ.update(saved)
    engine = make_engine(db_url)
    store = JobStore(engine, max_attempts=kills + 2)  # every kill costs an attempt
    celery = create_celery_app(settings)
    shutil.copy(DEMO_IMAGE, tmp / "in" / "ref.png")
    pool: list[_Worker] = []
    report: dict[str, Any] = {"jobs": jobs, "seconds": seconds, "workers": workers, "lease_s": lease_s}

    def submit(seed: int) -> str:
        audio = tmp / "in" / f"speech-{seed}.wav"
        if not audio.exists():
            speech_wav(audio, seconds, seed=seed)
        spec = JobSpec.model_validate(
            {"image": (tmp / "in" / "ref.png").as_uri(), "audio": audio.as_uri(), "seed": seed},
            context=spec_context(settings.file_root),
        )
        rec = store.create(spec, tenant="bench")
        enqueue_render(celery, rec.id, queue=queue)
        return rec.id

    # (elapsed s, fraction of frames done, memory of the workers' trees: see _tree_memory)
    samples: list[tuple[float, float, dict[str, int]]] = []
    # per minute of wall time: each part's peak over that minute (_tree_peaks; single samples of a
    # rank swing by an emission's tensors, its peaks per minute do not)
    minute_peaks: list[tuple[float, float, dict[str, int]]] = []
    samples_file = samples_path.open("a") if samples_path else None

    def wait(ids: list[str], timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        t0, next_sample = time.monotonic(), 0.0
        next_minute = t0 + 60.0
        if load_only:
            for w in pool:
                _tree_peaks(w.proc.pid)  # start the first minute now
        while True:
            recs = [store.get(i) for i in ids]
            if all(r is not None and r.status in ("succeeded", "failed", "cancelled") for r in recs):
                return recs
            if load_only and time.monotonic() >= next_sample:
                total = sum(r.num_frames or 0 for r in recs if r)  # 0 until the worker has planned
                done = sum(r.frames_done for r in recs if r) / total if total else 0.0
                mem: dict[str, int] = {}
                for w in pool:
                    for k, v in _tree_memory(w.proc.pid).items():
                        mem[k] = mem.get(k, 0) + v
                samples.append((time.monotonic() - t0, done, mem))
                if samples_file:  # as it goes: a run cut short still leaves its curve
                    samples_file.write(json.dumps({"t": round(samples[-1][0], 1), "done": round(done, 5),
                                                   **{k: round(v / 2**20, 2) for k, v in mem.items()}}) + "\n")
                    samples_file.flush()
                next_sample = time.monotonic() + 10.0
            if load_only and time.monotonic() >= next_minute:
                peaks: dict[str, int] = {}
                for w in pool:
                    for k, v in _tree_peaks(w.proc.pid).items():
                        peaks[k] = peaks.get(k, 0) + v
                minute_peaks.append((time.monotonic() - t0, samples[-1][1] if samples else 0.0, peaks))
                if samples_file:
                    samples_file.write(json.dumps({"t": round(minute_peaks[-1][0], 1), "minute_peaks_mb": {
                        k: round(v / 2**20, 2) for k, v in peaks.items()}}) + "\n")
                    samples_file.flush()
                next_minute += 60.0
            if time.monotonic() > deadline:
                raise TimeoutError(f"not done after {timeout} s: {[(r.id[:8], r.status, r.chunks_done) for r in recs if r]}")
            time.sleep(0.5)

    def final(rec: Any) -> Path:
        return Path(rec.outputs["mp4"].removeprefix("file://"))

    def start(name: str) -> _Worker:
        w = _Worker(name, env, tmp / f"{name}.log")
        w.wait_ready()
        pool.append(w)
        return w

    try:
        for i in range(workers):
            start(f"w{i}")
        # 1. load (--jobs 0 skips it)
        t0 = time.monotonic()
        ids = [submit(100 + i) for i in range(jobs)]
        recs = wait(ids, timeout=jobs * seconds * 10 + 300) if ids else []
        report["load"] = {
            "wall_s": round(time.monotonic() - t0, 1),
            "succeeded": sum(r.status == "succeeded" for r in recs),
            "first_attempt": sum(r.status == "succeeded" and r.attempts == 1 for r in recs),
            "errors": sorted({f"{r.error_code}" for r in recs if r.error_code}),
            "durations_s": [round(_duration(final(r)), 3) for r in recs if r.status == "succeeded"],
        }
        print(json.dumps({"load": report["load"]}), file=sys.stderr, flush=True)
        if load_only:
            quarters = []
            for q in range(4):
                rss = [m["rss"] for _, f, m in samples if q / 4 <= f < (q + 1) / 4 and m["rss"] > 0]
                quarters.append(round(max(rss) / 2**20, 1) if rss else None)
            # least-squares slopes after the first tenth of the job (the warm-up), for the tree and
            # for each part of it: which process holds what grows, and whether it is heap (anonymous)
            late = [(t, m) for t, f, m in samples if f >= 0.1 and m["rss"] > 0]
            parts = ("rss", "worker_rss", "worker_anon", "rank_rss", "rank_anon")
            report["memory"] = {
                "samples": len(samples),
                "rss_mb_per_minute": [round(m["rss"] / 2**20, 1) for t, _, m in samples if int(t) % 60 < 10],
                "slope_mb_per_10_min": _slope_mb_per_10_min([(t, m["rss"]) for t, m in late]),
                "slope_mb_per_10_min_by_part": {
                    k: _slope_mb_per_10_min([(t, m[k]) for t, m in late]) for k in parts},
                "mean_mb_by_half_by_part": {
                    k: [round(sum(m[k] for _, m in h) / len(h) / 2**20, 1) if h else None
                        for h in (late[: len(late) // 2], late[len(late) // 2:])] for k in parts},
                "peak_rss_mb_by_quarter": quarters,
                "peak_mb_per_minute_by_part": {
                    k: [round(m[k] / 2**20, 1) for _, _, m in minute_peaks] for k in ("worker_peak", "rank_peak")},
                "peak_slope_mb_per_10_min_by_part": {  # after the first tenth, as the slopes above
                    k: _slope_mb_per_10_min([(t, m[k]) for t, f, m in minute_peaks if f >= 0.1])
                    for k in ("worker_peak", "rank_peak")},
                # the first quarter holds the warm-up (models loaded, encoder primed): compare after it
                "last_over_second_quarter": round(quarters[3] / quarters[1], 4)
                if quarters[1] and quarters[3] else None,
            }
            return report
        # 2. reference (uninterrupted)
        (ref,) = wait([submit(7)], timeout=seconds * 10 + 300)
        reference = final(ref).read_bytes()
        num_chunks = int(ref.num_chunks or 0)
        # 3. chaos: the same spec, kill -9 of its worker at `kills` chunks
        job = submit(7)
        marks = [max(1, round(num_chunks * (k + 1) / (kills + 1))) for k in range(kills)]
        seen: dict[str, int] = {}
        rewritten: set[str] = set()
        resumes: list[float] = []
        n = 0
        for mark in marks:
            rec = store.get(job)
            while rec is not None and rec.chunks_done < mark and rec.status in ("queued", "running"):
                time.sleep(0.05)
                rec = store.get(job)
            if rec is None or rec.status not in ("queued", "running") or rec.lease_owner is None:
                break
            victim = next(w for w in pool if w.name == rec.lease_owner)
            done = rec.chunks_done
            victim.kill9()
            killed_at = time.monotonic()
            pool.remove(victim)
            n += 1
            start(f"r{n}")
            while True:  # the next committed chunk, on another worker
                r = store.get(job)
                if r is None or r.status in ("failed", "cancelled"):
                    break
                if (r.chunks_done > done or r.status == "succeeded") and r.lease_owner != victim.name:
                    resumes.append(round(time.monotonic() - killed_at, 2))
                    break
                time.sleep(0.05)
            for key, mtime in _segment_mtimes(tmp / "objects").items():
                if key in seen and seen[key] != mtime:
                    rewritten.add(key)
                seen.setdefault(key, mtime)
        (rec,) = wait([job], timeout=seconds * 20 + 600)
        for key, mtime in _segment_mtimes(tmp / "objects").items():
            if key in seen and seen[key] != mtime:
                rewritten.add(key)
        report["chaos"] = {
            "kills": n,
            "at_chunks": marks[:n],
            "num_chunks": num_chunks,
            "status": rec.status,
            "attempts": rec.attempts,
            "byte_identical": rec.status == "succeeded" and final(rec).read_bytes() == reference,
            "segments_rewritten": len(rewritten),
            "death_to_resume_s": resumes,
        }
        return report
    finally:
        for w in pool:
            w.stop()
        if samples_file:
            samples_file.close()
        engine.dispose()
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
        admin.dispose()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=6, help="jobs of the load phase")
    p.add_argument("--seconds", type=float, default=60.0, help="audio seconds per job")
    p.add_argument("--kills", type=int, default=5, help="kill -9 points in the chaos phase")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--lease-s", type=float, default=10.0, help="LONGTAKE_LEASE_S of the workers")
    p.add_argument("--load-only", action="store_true",
                   help="phase 1 only, with worker memory by quarter of progress (the 2-hour job check)")
    p.add_argument("--samples", type=Path, help="--load-only: append each memory sample to this file as "
                   "a JSON line while the job runs (MB per part; a run cut short still leaves its curve)")
    p.add_argument("--json", action="store_true", help="one JSON object (default: indented)")
    a = p.parse_args(argv)
    report = run(a.jobs, a.seconds, a.kills, a.workers, a.lease_s, load_only=a.load_only,
                 samples_path=a.samples)
    print(json.dumps(report) if a.json else json.dumps(report, indent=2))
    ok = report["load"]["first_attempt"] == a.jobs
    if not a.load_only:
        ok = ok and report["chaos"]["byte_identical"] and report["chaos"]["segments_rewritten"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
