"""The ``longtake`` command: render locally, talk to the API, run the services.

Size: ~550 lines: the parser and eleven small subcommand functions, each a few lines next to the
others; ``render`` lives in :mod:`worker.cli.render`. Split the client and service commands into
modules of their own when one of them grows.

``main(argv)`` is the console-script entry point (``longtake = "worker.cli:main"``). Subcommands:

- ``render``  — render one video on this machine (delegates to ``worker.cli.render:main``; imported
  only in that branch, so rendering never imports Celery or SQLAlchemy);
- ``submit | status | wait | fetch | cancel | preview`` — HTTP API client commands
  (:class:`worker.client.LongtakeClient`); ``live`` streams a file or stdin into a live session
  (:mod:`worker.cli.live`; docs/sessions.md); ``--api``/``--token`` or ``LONGTAKE_API_URL`` /
  ``LONGTAKE_API_TOKEN`` read through :class:`worker.settings.Settings`;
- ``worker`` — a Celery worker for this node (one task at a time, no prefetch);
- ``api`` — the HTTP API under uvicorn; ``migrate`` — ``alembic upgrade head``;
- ``reap`` — requeue jobs whose lease expired (once, or every ``--every`` seconds);
- ``up`` — everything on embedded defaults (SQLite, a local object store, a SQLite-backed broker):
  the same API, worker and task code as production, only the settings differ.

Every subcommand returns an exit status: 0 ok, 1 the job failed / was cancelled or a server error,
2 usage errors, 3 the API refused the request (the message says why and how to fix it).
Heavy imports (Celery, SQLAlchemy, FastAPI, uvicorn) happen inside the subcommand that needs them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from worker.cli.helpfmt import DefaultsShown
from worker.cli.options import add_option_argument, options_of

if TYPE_CHECKING:

    from worker.client import JobView, LongtakeClient
    from worker.settings import Settings

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3

_URI_SCHEMES = ("s3://", "file://", "upload://")

__all__ = ["build_parser", "embedded_env", "main"]


# ---------------------------------------------------------------------------------------------- parser


def _add_client_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("API connection")
    g.add_argument(
        "--api",
        metavar="URL",
        help="API base URL (default: LONGTAKE_API_URL or http://LONGTAKE_API_HOST:LONGTAKE_API_PORT)",
    )
    g.add_argument(
        "--token", metavar="TOKEN", help="bearer token of your tenant (default: LONGTAKE_API_TOKEN)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longtake",
        description="Render audio-driven avatar video of any length; submit and follow render jobs.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    sub.add_parser(
        "render",
        help="render one video locally (no servers)",
        add_help=False,
        description="Render one video on this machine; see `longtake render --help`.",
    )

    p = sub.add_parser(
        "submit",
        help="submit a render job to the API",
        description="Submit a job. Local files given to --image/--audio are uploaded; "
        "s3://, file:// and upload:// URIs are passed as they are.",
    )
    p.add_argument("--image", required=True, help="reference image: a local file to upload, or a URI")
    p.add_argument("--audio", required=True, help="driving audio: a local file to upload, or a URI")
    p.add_argument("--text", help="text/scene prompt")
    p.add_argument("--seed", type=int, help="seed (>= 0); same seed and inputs give the same video")
    p.add_argument("--family", help="model family (default: 'tiny')")
    p.add_argument("--preset", help="model preset (default: the server's, 'tiny')")
    p.add_argument("--priority", type=int, help="0 (lowest) to 9 (highest)")
    p.add_argument("--idempotency-key", help="resubmitting with the same key returns the same job")
    add_option_argument(p)
    p.add_argument(
        "--spec",
        type=Path,
        metavar="FILE",
        help="JSON file with further spec fields (output, preview, options, ...); command-line options "
        "override it (--option per key)",
    )
    p.add_argument("--wait", action="store_true", help="then wait for the job, with a progress bar")
    p.add_argument("--json", action="store_true", help="print the job as JSON")
    _add_client_args(p)

    p = sub.add_parser(
        "status",
        help="show one job, or list your jobs",
        description="Show a job (with JOB_ID) or list your jobs, newest first.",
    )
    p.add_argument("job_id", nargs="?", help="job id (omit to list)")
    p.add_argument(
        "--status",
        dest="filter_status",
        choices=["queued", "running", "succeeded", "failed", "cancelled"],
        help="list filter",
    )
    p.add_argument("--limit", type=int, default=20, help="list at most this many (default 20)")
    p.add_argument("--json", action="store_true", help="print JSON")
    _add_client_args(p)

    p = sub.add_parser(
        "wait",
        help="wait for a job, with a progress bar",
        description="Poll a job until it ends; show chunks done, frames/s and ETA.",
    )
    p.add_argument("job_id")
    p.add_argument("--timeout", type=float, help="give up after this many seconds (the job keeps running)")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between polls (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (e.g. in logs)")
    _add_client_args(p)

    p = sub.add_parser(
        "fetch",
        help="download a job's final MP4 (and segments)",
        description="Download a finished job's MP4 to -o (a file, or a directory for <JOB_ID>.mp4); "
        "with --segments also the committed segments of any job, finished or not.",
    )
    p.add_argument("job_id")
    p.add_argument("-o", "--out", type=Path, default=Path("."), help="file or directory (default: .)")
    p.add_argument("--segments", action="store_true", help="also download the committed segments")
    _add_client_args(p)

    p = sub.add_parser(
        "cancel",
        help="cancel a job (stops between chunks)",
        description="Cancel a job: a queued one at once, a running one between two chunks (its "
        "committed segments stay; `longtake fetch --segments` gets them).",
    )
    p.add_argument("job_id")
    _add_client_args(p)

    p = sub.add_parser(
        "preview",
        help="print the URL to watch a job while it renders",
        description="Print one URL: a page on the API that plays the render while it runs (any "
        "browser; the link is signed and expires after LONGTAKE_PRESIGN_EXPIRES_S). KVS jobs: the "
        "KVS HLS session URL.",
    )
    p.add_argument("job_id")
    p.add_argument("--playlist", action="store_true", help="print the HLS playlist URL instead (VLC, ffplay)")
    _add_client_args(p)

    from worker.cli.live import add_parser as add_live_parser

    _add_client_args(add_live_parser(sub))

    p = sub.add_parser(
        "worker",
        help="run a Celery render worker for this node",
        description="Run one Celery worker: one job at a time, no prefetch, late ack.",
    )
    p.add_argument("--hostname", help="Celery node name (default: longtake@<host>)")
    p.add_argument("--loglevel", default=None, help="Celery log level (default: LONGTAKE_LOG_LEVEL)")

    p = sub.add_parser(
        "api",
        help="serve the HTTP API (uvicorn)",
        description="Serve the HTTP API (docs/api.md) with uvicorn on the LONGTAKE_* settings: jobs "
        "database, broker, object store, LONGTAKE_API_TOKENS.",
    )
    p.add_argument("--host", help="bind address (default: LONGTAKE_API_HOST)")
    p.add_argument("--port", type=int, help="port (default: LONGTAKE_API_PORT)")

    sub.add_parser(
        "migrate",
        help="create/upgrade the jobs database schema (alembic upgrade head)",
        description="Create or upgrade the jobs database at LONGTAKE_DATABASE_URL to the newest "
        "schema (alembic upgrade head); safe to repeat.",
    )

    p = sub.add_parser(
        "reap",
        help="requeue jobs whose worker lease expired",
        description="Requeue jobs whose worker stopped heartbeating (lease expired) and publish their "
        "messages again; once, or every --every seconds. Workers also reap on their own.",
    )
    p.add_argument("--every", type=float, metavar="SECONDS", help="repeat forever at this interval")

    p = sub.add_parser(
        "up",
        help="run API + worker on embedded defaults (no servers)",
        description="Run the API and one worker on embedded defaults: SQLite jobs database, a local "
        "directory as object store, and a SQLite-backed Celery broker (kombu sqla transport), all "
        "under --home. The code path is the production one; only the settings differ.",
    )
    p.add_argument(
        "--home", type=Path, default=Path(".longtake"), help="state directory (default ./.longtake)"
    )
    p.add_argument("--host", default="127.0.0.1", help="API bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="API port (default 8000)")
    p.add_argument("--no-worker", action="store_true", help="run only the API")
    for command in sub.choices.values():
        command.formatter_class = DefaultsShown
    return parser


# ---------------------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    # `render` owns its own argument parser (the lead's worker/cli/render.py): hand over everything.
    if args_list and args_list[0] == "render":
        from worker.cli.render import main as render_main

        return int(render_main(args_list[1:]) or 0)
    parser = build_parser()
    args = parser.parse_args(args_list)
    logging.basicConfig(level=_log_level(args), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = _COMMANDS[args.command]
    from worker.client import LongtakeAPIError, LongtakeConnectionError

    try:
        return handler(args)
    except LongtakeConnectionError as exc:
        print(f"longtake {args.command}: {exc}", file=sys.stderr)
        return EXIT_JOB_FAILED
    except LongtakeAPIError as exc:
        print(f"longtake {args.command}: {exc.message} (HTTP {exc.status_code})", file=sys.stderr)
        return EXIT_REFUSED if 400 <= exc.status_code < 500 else EXIT_JOB_FAILED
    except (FileNotFoundError, ValueError) as exc:
        print(f"longtake {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


_SERVICE_COMMANDS = frozenset({"worker", "api", "migrate", "reap", "up"})


def _log_level(args: argparse.Namespace) -> int:
    """Services log INFO; client commands only warnings (no httpx line per request), ``-v`` DEBUG."""
    if args.verbose:
        return logging.DEBUG
    return logging.INFO if args.command in _SERVICE_COMMANDS else logging.WARNING


def _settings() -> Settings:
    """``Settings()`` from the environment; a bad value raises ``ValueError`` naming the variable."""
    from pydantic import ValidationError

    from worker.settings import Settings

    try:
        return Settings()  # every field has a default; values come from the environment
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err.get("loc", ()))
            name = f"LONGTAKE_{field.upper()}" if field else "LONGTAKE_* settings"
            msg = str(err.get("msg", "")).removeprefix("Value error, ")
            problems.append(msg if msg.startswith(name) else f"{name}: {msg}")
        raise ValueError("; ".join(problems)) from None


def _client(args: argparse.Namespace) -> LongtakeClient:
    from worker.client import LongtakeClient

    settings = _settings()
    api = args.api or settings.client_api_url()
    token = args.token or settings.api_token
    if not token:
        raise ValueError("no API token; pass --token TOKEN or set LONGTAKE_API_TOKEN")
    return LongtakeClient(api, token)


def _print_job(job: JobView, *, as_json: bool) -> None:
    if as_json:
        print(job.model_dump_json(indent=2))
        return
    p = job.progress
    total = f"/{p.num_chunks}" if p.num_chunks is not None else ""
    line = f"{job.id}  {job.status:<9}  chunks {p.chunks_done}{total}  {p.seconds_done:.1f}s of video"
    if job.status == "running" and p.moved_at is not None:
        # heartbeats keep a stuck job "running"; this is what tells it apart
        line += f"  last moved {_ago(p.moved_at)} ago"
    if job.error_code:
        line += f"  error {job.error_code}: {job.error_message}"
    if job.cancel_requested and not job.is_terminal:
        line += "  (cancel requested)"
    print(line)


def _ago(when: datetime, now: datetime | None = None) -> str:
    """``when`` as an age: ``42s``, ``3m05s``, ``2h07m``."""
    s = max(0, int(((now or datetime.now(UTC)) - when).total_seconds()))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _is_uri(value: str) -> bool:
    return value.startswith(_URI_SCHEMES)


# ---------------------------------------------------------------------------------------------- client commands


def cmd_submit(args: argparse.Namespace) -> int:
    spec: dict[str, object] = {}
    if args.spec is not None:
        loaded = json.loads(args.spec.read_text())
        if not isinstance(loaded, dict):
            raise ValueError(f"--spec {args.spec}: must hold a JSON object (the job spec)")
        spec.update(loaded)
    for field in ("text", "seed", "family", "preset", "priority", "idempotency_key"):
        value = getattr(args, field)
        if value is not None:
            spec[field] = value
    uploads: dict[str, Path] = {}
    for field in ("image", "audio"):
        given: str = getattr(args, field)
        if _is_uri(given):
            spec[field] = given
        else:
            path = Path(given)
            if not path.is_file():
                raise FileNotFoundError(
                    f"--{field} {given}: no such file; give a local file or an s3://, file:// or upload:// URI"
                )
            spec.pop(field, None)
            uploads[field] = path
    options = options_of(args.options)
    with _client(args) as client:
        job = client.submit(spec, image=uploads.get("image"), audio=uploads.get("audio"), options=options)
        if args.json:
            _print_job(job, as_json=True)
        else:
            print(job.id)
        if args.wait:
            return _wait(client, job.id, timeout_s=None, poll_s=1.0, progress=True)
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.job_id:
            _print_job(client.get(args.job_id), as_json=args.json)
            return EXIT_OK
        page = client.list(status=args.filter_status, limit=args.limit)
        if args.json:
            print(page.model_dump_json(indent=2))
        else:
            for job in page.jobs:
                _print_job(job, as_json=False)
    return EXIT_OK


def _wait(
    client: LongtakeClient, job_id: str, *, timeout_s: float | None, poll_s: float, progress: bool
) -> int:
    from tqdm import tqdm

    bar: tqdm[int] | None = None
    last: dict[str, float] = {}

    def on_update(job: JobView) -> None:
        nonlocal bar
        p = job.progress
        if not progress or (bar is None and job.is_terminal):
            return  # a job that had ended before we looked: its line below says it all
        if bar is None:
            # initial=: chunks done before we looked are not counted into tqdm's chunk/s rate
            bar = tqdm(total=p.num_chunks, initial=p.chunks_done, unit="chunk", desc=job_id[:8],
                       file=sys.stderr, dynamic_ncols=True)
        if p.num_chunks is not None and bar.total != p.num_chunks:
            bar.total = p.num_chunks
        # frames/s over the last poll interval: what the user feels, not a lifetime average;
        # nothing is shown until two polls have been seen
        now = time.monotonic()
        rate = ""
        if "t" in last and now > last["t"]:
            rate = f" {max(0.0, (p.frames_done - last['frames']) / (now - last['t'])):.1f} fps"
        last.update(t=now, frames=float(p.frames_done))
        bar.n = p.chunks_done
        bar.set_postfix_str(f"{job.status}{rate} {p.seconds_done:.1f}s video")
        bar.refresh()

    try:
        job = client.wait(job_id, poll_s=poll_s, timeout_s=timeout_s, on_update=on_update)
    finally:
        if bar is not None:
            bar.close()
    _print_job(job, as_json=False)
    return EXIT_OK if job.status == "succeeded" else EXIT_JOB_FAILED


def cmd_wait(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            return _wait(
                client, args.job_id, timeout_s=args.timeout, poll_s=args.poll, progress=not args.no_progress
            )
        except TimeoutError as exc:
            print(f"longtake wait: {exc}", file=sys.stderr)
            return EXIT_JOB_FAILED


def cmd_fetch(args: argparse.Namespace) -> int:
    with _client(args) as client:
        for path in client.fetch(args.job_id, args.out, segments=args.segments):
            print(path)
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        _print_job(client.cancel(args.job_id), as_json=False)
    return EXIT_OK


def cmd_live(args: argparse.Namespace) -> int:
    from worker.cli.live import cmd_live as run_live

    settings = _settings()
    token = args.token or settings.api_token
    if not token:
        raise ValueError("no API token; pass --token TOKEN or set LONGTAKE_API_TOKEN")
    return run_live(args, api=args.api or settings.client_api_url(), token=token)


def cmd_preview(args: argparse.Namespace) -> int:
    with _client(args) as client:
        view = client.preview(args.job_id)
    if view.url is None:
        print(f"longtake preview: {view.detail}", file=sys.stderr)
        return EXIT_JOB_FAILED
    if args.playlist or view.page_url is None:
        print(view.url)
    else:
        print(view.page_url)
        print("open it in a browser; --playlist prints the HLS playlist for players", file=sys.stderr)
    return EXIT_OK


# ---------------------------------------------------------------------------------------------- services


def worker_argv(settings: Settings, *, hostname: str | None, loglevel: str | None) -> list[str]:
    """Celery worker arguments for one render worker per node.

    One task at a time (``--concurrency 1``, solo pool: the task itself spawns and supervises the
    render process, so no pool child is needed), no prefetch (``--prefetch-multiplier 1`` plus late
    ack in the app config), no gossip/mingle chatter, only our queue.
    """
    return [
        "worker",
        "--pool",
        "solo",
        "--concurrency",
        "1",
        "--prefetch-multiplier",
        "1",
        "--without-gossip",
        "--without-mingle",
        "--queues",
        settings.queue_name,
        "--hostname",
        hostname or "longtake@%h",
        "--loglevel",
        loglevel or settings.log_level,
    ]


def cmd_worker(args: argparse.Namespace) -> int:
    from worker.jobs.celery_app import app

    settings = _settings()
    app.worker_main(worker_argv(settings, hostname=args.hostname, loglevel=args.loglevel))
    return EXIT_OK


def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    from worker.api.app import create_app
    from worker.jobs.queue import create_celery_app

    settings = _settings()
    celery = create_celery_app(settings)
    app = create_app(settings, celery=celery)
    uvicorn.run(
        app,
        host=args.host or settings.api_host,
        port=args.port or settings.api_port,
        log_level=settings.log_level.lower(),
    )
    return EXIT_OK


def cmd_migrate(args: argparse.Namespace) -> int:
    from worker.jobs.db import migrate

    settings = _settings()
    migrate(settings.database_url)
    print(f"database at head: {_redact(settings.database_url)}")
    return EXIT_OK


def cmd_reap(args: argparse.Namespace) -> int:
    from worker.jobs.db import make_engine
    from worker.jobs.queue import create_celery_app
    from worker.jobs.reaper import reap_once
    from worker.jobs.store import JobStore

    settings = _settings()
    store = JobStore(make_engine(settings.database_url), max_attempts=settings.max_attempts)
    celery = create_celery_app(settings)
    while True:
        ids = reap_once(store, celery, queue=settings.queue_name)
        print(f"requeued {len(ids)} job(s){': ' + ', '.join(ids) if ids else ''}")
        if args.every is None:
            return EXIT_OK
        time.sleep(args.every)


def embedded_env(home: Path, *, host: str, port: int, token: str) -> dict[str, str]:
    """The ``LONGTAKE_*`` settings of ``longtake up``: SQLite, local object store, SQLite broker.

    Only the *values* differ from production; the API, the worker, the task and the store are the
    same code. The broker is kombu's SQLAlchemy transport on a SQLite file: it needs no server and
    works across processes (the API process sends, the worker process consumes).
    """
    home = home.resolve()
    return {
        "LONGTAKE_DATABASE_URL": f"sqlite:///{home / 'longtake.db'}",
        "LONGTAKE_OBJECT_STORE_URL": (home / "objects").as_uri(),
        "LONGTAKE_BROKER_URL": f"sqla+sqlite:///{home / 'broker.db'}",
        "LONGTAKE_WORK_DIR": str(home / "work"),
        "LONGTAKE_FILE_ROOT": str(home / "inputs"),
        "LONGTAKE_API_HOST": host,
        "LONGTAKE_API_PORT": str(port),
        "LONGTAKE_API_TOKENS": json.dumps({token: "local"}),
        "LONGTAKE_API_URL": f"http://{host}:{port}",
        "LONGTAKE_API_TOKEN": token,
    }


def self_command() -> str:
    """How the user can run ``longtake`` again, as a shell word: ``longtake`` when that is on PATH
    and is this interpreter's script, else the script's path (``.venv/bin/longtake`` after
    ``make demo``, relative to the working directory when under it), else ``python -m worker.cli``.
    Used by the commands that print commands to run next (``up``)."""
    import shlex
    import shutil

    script = Path(sys.executable).with_name("longtake")
    on_path = shutil.which("longtake")
    if script.is_file() and on_path and Path(on_path).resolve() == script.resolve():
        return "longtake"
    if script.is_file():
        try:
            return shlex.quote(str(script.relative_to(Path.cwd())))
        except ValueError:
            return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -m worker.cli"


def _demo_inputs() -> tuple[str, str]:
    """The shipped demo face and speech (what ``make demo`` renders), or placeholders when this is
    an installed package without them."""
    root = Path(__file__).resolve().parents[2]
    image, audio = root / "models/checkpoints/demo_reference.png", root / "assets/demo/speech.wav"
    if image.is_file() and audio.is_file():
        return str(image), str(audio)
    return "face.png", "speech.wav"


def up_banner(home: Path, *, host: str, port: int, token: str) -> str:
    """What ``longtake up`` prints once its services are started: the two settings the client
    commands read (``Settings.api_url`` / ``api_token``) as one ``export`` line, and commands that
    work as printed in that shell (tests/unit/test_cli.py runs them)."""
    import shlex

    lt = self_command()
    image, audio = (shlex.quote(p) for p in _demo_inputs())
    return (
        f"longtake up: API on http://{host}:{port}, state in {home}\n"
        f"  export LONGTAKE_API_URL=http://{host}:{port} LONGTAKE_API_TOKEN={token}\n"
        f"  {lt} submit --image {image} --audio {audio} --wait\n"
        f"  {lt} preview JOB        # a page that plays the render while it runs\n"
        f"  {lt} fetch JOB -o out.mp4"
    )


def _api_answers(url: str) -> bool:
    """True once ``GET url/healthz`` answers at all (``up`` polls it before printing its banner)."""
    import httpx

    try:
        resp = httpx.get(f"{url}/healthz", timeout=1.0)
    except httpx.HTTPError:
        return False
    if resp.status_code != 200:
        print(f"longtake up: the API answers /healthz with {resp.status_code}: {resp.text}", file=sys.stderr)
    return True


def new_api_token() -> str:
    """A fresh API token that is safe on a command line: hex, so never starting with '-'.

    (A url-safe token starts with '-' one time in 64, and `--token -x...` is then read as an option.)
    """
    return secrets.token_hex(24)


def cmd_up(args: argparse.Namespace) -> int:
    home: Path = args.home.resolve()
    for sub_dir in ("objects", "work", "inputs"):
        (home / sub_dir).mkdir(parents=True, exist_ok=True)
    token_file = home / "token"
    if not token_file.exists():
        token_file.write_text(new_api_token())
        token_file.chmod(0o600)
    token = token_file.read_text().strip()
    env = {**os.environ, **embedded_env(home, host=args.host, port=args.port, token=token)}
    python = sys.executable
    # Each service is the ordinary subcommand with embedded settings in its environment.
    subprocess.run([python, "-m", "worker.cli", "migrate"], env=env, check=True)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    if not args.no_worker:
        procs["worker"] = subprocess.Popen(
            [python, "-m", "worker.cli", "worker", "--hostname", "longtake-up@%h"], env=env
        )
    procs["api"] = subprocess.Popen([python, "-m", "worker.cli", "api"], env=env)
    api_url = f"http://{args.host}:{args.port}"
    announced = False  # the banner's commands work only once the API answers: print it then
    stopping = False

    def _stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    rc = EXIT_OK
    try:
        while not stopping:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    print(f"longtake up: {name} exited with {proc.returncode}; stopping", file=sys.stderr)
                    rc = EXIT_JOB_FAILED
                    stopping = True
            if not announced and not stopping and _api_answers(api_url):
                print(up_banner(home, host=args.host, port=args.port, token=token), flush=True)
                announced = True
            time.sleep(0.2)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return rc


def _redact(url: str) -> str:
    parsed = urlparse(url)
    if parsed.password:
        return url.replace(f":{parsed.password}@", ":***@")
    return url


_COMMANDS = {
    "submit": cmd_submit,
    "status": cmd_status,
    "wait": cmd_wait,
    "fetch": cmd_fetch,
    "cancel": cmd_cancel,
    "preview": cmd_preview,
    "live": cmd_live,
    "worker": cmd_worker,
    "api": cmd_api,
    "migrate": cmd_migrate,
    "reap": cmd_reap,
    "up": cmd_up,
}

