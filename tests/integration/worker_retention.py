"""What the worker process keeps per fragment of a long job, by component (tracemalloc; issue 16).

Drives the production worker path in this process: :class:`worker.jobs.tasks.JobWorker` claims a
job on a fresh PostgreSQL database, renders it on its real :class:`worker.jobs.runner.NodeExecutor`
(one spawned CPU rank running :func:`fake_pipeline.render`, so fragments come through the rank's
pipe and :class:`~pipeline.placement.relay.SinkRelay`), delivers with the production
:class:`worker.delivery.s3_sink.S3ProgressiveSink` into a local object store and commits every
segment row, heartbeats with the :class:`~worker.jobs.lease.LeaseKeeper`, logs JSON and counts
metrics — everything a real job does in the worker process except the model (which lives in the
rank). The hooks are harness-side: the worker's ``JobStore.commit_segment`` is wrapped to start
tracemalloc when fragment A is committed and take a snapshot (after ``gc.collect()``) at fragment B
— what is alive then and was allocated since A is what the worker keeps — and the sink's final-MP4
part size is ``--part-kib`` (64 KiB) instead of 5 MiB, so that its pending run (bounded by one part,
a sawtooth, not a leak) stays small next to what A..B accumulates.

    PYTHONPATH=$PWD .venv/bin/python tests/integration/worker_retention.py --at 500 3000 [--json out.json]

Prints what was kept from A to B in bytes per fragment, grouped by the innermost frame
in this repository (the code that made the allocation) and by that frame's file.

    PYTHONPATH=$PWD .venv/bin/python tests/integration/worker_retention.py --rss-every 500 [--no-trim]

instead samples this process's resident memory every 500 commits of an 8000-fragment job whose
fragments and resume states have a real tiny job's sizes (36 KiB, 1250 KiB: each fragment carries
its state through the rank's pipe), with or without the relay's heap trim after each fragment, and
prints the slope after the first fifth. Needs PostgreSQL
(``LONGTAKE_TEST_PG``, default 127.0.0.1:5432, user postgres); Redis is not used (no Celery).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import threading
import time
import tracemalloc
import uuid
import weakref
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fake_pipeline  # noqa: E402
from jobs_harness import PG_HOST, REDIS_URL, admin_engine, make_env, settings_from_env  # noqa: E402
from sqlalchemy import text  # noqa: E402

import worker  # noqa: E402

ROOT = Path(worker.__file__).resolve().parents[1]  # the checkout measured (PYTHONPATH)

_STDLIB_MARKERS = ("/lib/python3", "site-packages", "<frozen", "<string>")


def _component(tb: tracemalloc.Traceback) -> str:
    """``path:line`` of the innermost frame in this repository (else the innermost frame)."""
    for frame in reversed(tb):  # a Traceback runs from the oldest frame to the newest
        name = frame.filename
        if name.startswith(str(ROOT)) and not any(m in name for m in _STDLIB_MARKERS):
            if name.endswith("worker_retention.py"):
                continue
            return f"{Path(name).relative_to(ROOT)}:{frame.lineno}"
    f = tb[-1]
    return f"{f.filename}:{f.lineno}"


def growth(b: tracemalloc.Snapshot) -> dict[str, int]:
    """Bytes still alive in ``b`` (traced since fragment A), per :func:`_component`; tracemalloc's
    own frames are left out."""
    out: dict[str, int] = defaultdict(int)
    snap = b.filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    for stat in snap.statistics("traceback"):
        out[_component(stat.traceback)] += stat.size
    return dict(out)


def run_job(num_fragments: int, on_commit: Callable[[int], None], *, part_kib: int = 64,
            fragment_bytes: int = fake_pipeline.FRAGMENT_BYTES, state_bytes: int = 0,
            sleep_s: float = 0.0) -> str:
    """Run one job of ``num_fragments`` through the production worker path in this process (module
    docstring) and call ``on_commit(index)`` after each segment row is committed; the outcome."""
    from worker.jobs.db import make_engine, migrate
    from worker.jobs.store import JobStore
    from worker.jobs.tasks import JobWorker
    from worker.spec import JobSpec, spec_context

    db = f"wmem_{uuid.uuid4().hex[:10]}"
    admin = admin_engine()
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{db}"'))
    url = f"{PG_HOST}/{db}"
    tmp = Path(tempfile.mkdtemp(prefix="worker-retention-"))
    try:
        migrate(url)
        env = make_env(tmp, url, REDIS_URL, node_device="cpu", node_threads_per_rank="1",
                       progress_timeout_s="3600", lease_s="30", heartbeat_s="1")
        env.pop("LONGTAKE_FAKE_RENDER_LOG")  # one line per fragment on disk: not what is measured
        env.pop("LONGTAKE_STATE_EVERY")  # the production default (a state with every 8th segment)
        settings = settings_from_env(env)
        from worker.logging import configure_logging

        configure_logging("INFO", json_lines=True)
        logging.getLogger().handlers[0].setStream(open(tmp / "worker.log", "w"))  # type: ignore[attr-defined]
        plan = fake_pipeline.write_plan(tmp / "in" / "plan.json", num_fragments=num_fragments, sleep_s=sleep_s,
                                        fragment_bytes=fragment_bytes, state_bytes=state_bytes)
        spec = JobSpec.model_validate(
            {"image": f"file://{tmp}/in/face.png", "audio": f"file://{plan}", "seed": 7},
            context=spec_context(settings.file_root),
        )
        job_id = JobStore(make_engine(url), max_attempts=3).create(spec, tenant="t1").id

        def delivery(*args: Any, **kw: Any) -> Any:
            # the production delivery, with parts of part_kib
            from worker.delivery.job_delivery import s3_delivery

            d = s3_delivery(*args, **kw)
            d.sink._part_min = part_kib << 10  # type: ignore[attr-defined]
            return d

        worker = JobWorker(settings, renderer=fake_pipeline.render, delivery=delivery)
        commit = worker.store.commit_segment

        def commit_and_hook(lease: Any, seg: Any) -> None:
            commit(lease, seg)
            on_commit(seg.index)

        worker.store.commit_segment = commit_and_hook  # type: ignore[method-assign]
        try:
            outcome = worker.run(job_id)
        finally:
            tracemalloc.stop()
            worker.node.close()
            worker.engine.dispose()
        if outcome != "succeeded":
            print(f"the job ended {outcome}; see {tmp / 'worker.log'}", file=sys.stderr)
        return str(outcome)
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
        admin.dispose()


def profile(num_fragments: int, at: tuple[int, int], *, frames: int = 30, part_kib: int = 64,
            tracebacks: int = 0) -> dict[str, Any]:
    """tracemalloc from the commit of fragment A to fragment B: bytes kept per fragment, by
    component. The sink's final-MP4 part size is ``part_kib`` (64 KiB) instead of 5 MiB, so that
    its pending run (bounded by one part, a sawtooth, not a leak) stays small next to what A..B
    accumulates."""
    snaps: dict[str, tracemalloc.Snapshot] = {}
    finalizers: list[int] = []  # live weakref.finalize objects (SQLAlchemy's pool uses them)
    lock = threading.Lock()

    def on_commit(index: int) -> None:
        if index == at[0]:  # trace from here on: what is alive at B was made since A
            with lock:
                gc.collect()
                finalizers.append(len(weakref.finalize._registry))  # type: ignore[attr-defined]
                tracemalloc.start(frames)
        elif index == at[1]:
            with lock:
                gc.collect()
                snaps["b"] = tracemalloc.take_snapshot()
                tracemalloc.stop()
                finalizers.append(len(weakref.finalize._registry))  # type: ignore[attr-defined]

    run_job(num_fragments, on_commit, part_kib=part_kib)
    if "b" not in snaps:
        raise SystemExit(f"fragment {at[1]} was never committed")
    a, b = at
    span = b - a
    by_line = growth(snaps["b"])
    by_file: dict[str, int] = defaultdict(int)
    for where, size in by_line.items():
        by_file[where.rsplit(":", 1)[0]] += size
    if tracebacks:
        snap = snaps["b"].filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        for stat in snap.statistics("traceback")[:tracebacks]:
            print(f"--- {stat.size / span:+.1f} B/fragment ({stat.count} blocks)", file=sys.stderr)
            print("\n".join(stat.traceback.format()), file=sys.stderr)
    return {
        "fragments": num_fragments,
        "between": [a, b],
        "part_kib": part_kib,
        "weakref_finalizers": finalizers,
        "traced_bytes_per_fragment": round(sum(by_line.values()) / span, 1),
        "by_file": {k: round(v / span, 1) for k, v in sorted(by_file.items(), key=lambda kv: -kv[1])},
        "by_line": {k: round(v / span, 1) for k, v in sorted(by_line.items(), key=lambda kv: -kv[1])},
    }


def rss_profile(num_fragments: int, every: int, *, trim: bool = True, fragment_kib: int = 36,
                state_kib: int = 1250, sleep_s: float = 0.01) -> dict[str, Any]:
    """This process's resident and anonymous MB every ``every`` commits of a job whose fragments
    and resume states have a real tiny job's sizes, with the relay's per-fragment heap trim
    (``trim``, the production code) or without it (the relay's ``release_free_heap`` replaced by a
    no-op here); the least-squares slope after the first fifth, in MB per 1000 fragments."""
    from bench.memprofile import least_squares_slope, smaps_rollup
    from pipeline.placement import relay

    if not trim:
        relay.release_free_heap = lambda: None  # type: ignore[assignment]
    samples: list[dict[str, float]] = []
    t0 = time.monotonic()

    def on_commit(index: int) -> None:
        if index % every == 0:
            mem = smaps_rollup()
            samples.append({"fragment": index, "t": round(time.monotonic() - t0, 1), "rss": mem["rss"] / 2**20,
                            "anonymous": mem["anon"] / 2**20})

    outcome = run_job(num_fragments, on_commit, part_kib=5 << 10, fragment_bytes=fragment_kib << 10,
                      state_bytes=state_kib << 10, sleep_s=sleep_s)
    tail = samples[len(samples) // 5 :]
    ys = [s["rss"] for s in tail]
    slope = least_squares_slope([s["fragment"] for s in tail], ys)  # MB per fragment
    return {
        "fragments": num_fragments, "trim": trim, "outcome": outcome, "fragment_kib": fragment_kib,
        "state_kib": state_kib, "samples": samples,
        "rss_mb_after_first_fifth": {"min": min(ys), "max": max(ys), "mean": round(sum(ys) / len(ys), 1)},
        "rss_slope_mb_per_1000_fragments": round(slope * 1000, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fragments", type=int, help="default B + 1: the fake render (no sleep) runs ahead of the "
                   "uploads, so fragments after B would be in the sink's backlog at B")
    p.add_argument("--at", type=int, nargs=2, default=(500, 3000), metavar=("A", "B"))
    p.add_argument("--frames", type=int, default=30, help="tracemalloc traceback depth")
    p.add_argument("--part-kib", type=int, default=64, help="final MP4 part size (production: 5 MiB)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--tracebacks", type=int, default=0, help="print the N largest whole tracebacks (stderr)")
    p.add_argument("--json", type=Path)
    p.add_argument("--rss-every", type=int, metavar="N", help="instead: sample this process's RSS every N "
                   "commits of a job with a real job's fragment and state sizes (--fragments, default 8000)")
    p.add_argument("--no-trim", action="store_true", help="--rss-every: without the relay's heap trim")
    a = p.parse_args()
    if a.rss_every:
        res = rss_profile(a.fragments or 8000, a.rss_every, trim=not a.no_trim)
        if a.json:
            a.json.write_text(json.dumps(res, indent=1))
        for smp in res["samples"]:
            print(json.dumps(smp))
        print(f"trim={res['trim']} outcome={res['outcome']}: RSS after the first fifth "
              f"{res['rss_mb_after_first_fifth']} MB, slope {res['rss_slope_mb_per_1000_fragments']:+.3f} MB "
              "per 1000 fragments")
        return
    out = profile(a.fragments or a.at[1] + 1, (a.at[0], a.at[1]), frames=a.frames, part_kib=a.part_kib,
                  tracebacks=a.tracebacks)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    print(f"fragments {out['between'][0]}..{out['between'][1]}: traced "
          f"{out['traced_bytes_per_fragment']:+.1f} B/fragment")
    print(f"live weakref.finalize objects at A, B: {out['weakref_finalizers']}")
    print("by file (B/fragment):")
    for k, v in list(out["by_file"].items())[: a.top]:
        print(f"  {v:+9.1f}  {k}")
    print("by line (B/fragment):")
    for k, v in list(out["by_line"].items())[: a.top]:
        print(f"  {v:+9.1f}  {k}")


if __name__ == "__main__":
    main()
