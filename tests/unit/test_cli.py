"""The ``longtake`` CLI: argument parsing, --help of every subcommand, error messages, the render
hand-off (which must not import Celery or SQLAlchemy), and the embedded (`up`) settings."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker import cli

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SUBCOMMANDS = [
    "submit",
    "status",
    "wait",
    "fetch",
    "cancel",
    "preview",
    "live",
    "worker",
    "api",
    "migrate",
    "reap",
    "up",
]


def test_top_level_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ["render", *SUBCOMMANDS]:
        assert name in out, f"{name} missing from `longtake --help`"


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: longtake {command}")


def test_client_commands_take_api_and_token(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ["submit", "status", "wait", "fetch", "cancel", "preview", "live"]:
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        out = capsys.readouterr().out
        assert "--api URL" in out and "--token TOKEN" in out, command


def test_generated_tokens_pass_as_a_command_line_value() -> None:
    """`longtake up` writes the token users pass as `--token X`; one starting with '-' would be read as an option
    (a url-safe token does one time in 64: CI failed on it). Hex digits never start one; a url-safe token of
    this length holds a non-hex character almost surely, so the alphabet check fails on it at once."""
    for _ in range(20):
        token = cli.new_api_token()
        assert len(token) >= 32 and set(token) <= set(string.hexdigits), token
    assert cli.build_parser().parse_args(["status", "--token", token]).token == token


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["wait"], "the following arguments are required: job_id"),
        (["submit", "--audio", "a.wav"], "the following arguments are required: --image"),
        (["submit", "--image", "a.png", "--audio", "a.wav", "--seed", "abc"], "invalid int value: 'abc'"),
        (["status", "--status", "done"], "invalid choice: 'done'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_usage_errors_exit_2_with_message(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_submit_missing_local_file_names_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.png"
    rc = cli.main(
        [
            "submit",
            "--image",
            str(missing),
            "--audio",
            "s3://bucket/a.wav",
            "--api",
            "http://127.0.0.1:9",
            "--token",
            "t" * 16,
        ]
    )
    assert rc == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"--image {missing}: no such file" in err
    assert "s3://" in err  # says what else is accepted


def test_submit_without_token_says_how_to_give_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LONGTAKE_API_TOKEN", raising=False)
    rc = cli.main(
        [
            "submit",
            "--image",
            "s3://bucket/f.png",
            "--audio",
            "s3://bucket/a.wav",
            "--api",
            "http://127.0.0.1:9",
        ]
    )
    assert rc == cli.EXIT_USAGE
    assert "pass --token TOKEN or set LONGTAKE_API_TOKEN" in capsys.readouterr().err


def test_submit_spec_file_must_be_an_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text("[1, 2]")
    rc = cli.main(
        [
            "submit",
            "--image",
            "s3://b1/f.png",
            "--audio",
            "s3://b1/a.wav",
            "--spec",
            str(spec),
            "--token",
            "t" * 16,
            "--api",
            "http://127.0.0.1:9",
        ]
    )
    assert rc == cli.EXIT_USAGE
    assert "must hold a JSON object" in capsys.readouterr().err


def test_unreachable_api_is_reported_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    # Port 9 (discard) is closed on loopback: a connection error must surface as a clear message.
    rc = cli.main(["status", "--api", "http://127.0.0.1:9", "--token", "t" * 16])
    assert rc == cli.EXIT_JOB_FAILED
    err = capsys.readouterr().err
    assert "cannot reach the API at http://127.0.0.1:9" in err


def test_render_is_delegated_without_importing_celery_or_sqlalchemy(tmp_path: Path) -> None:
    # A stand-in render_cli records its argv; the real one is the lead's. Run in a fresh interpreter
    # so nothing imported by other tests hides an import the render path would make.
    fake_pkg = tmp_path / "fake"
    fake_pkg.mkdir()
    code = f"""
import sys, types, json
sys.path.insert(0, {str(ROOT)!r})
mod = types.ModuleType("worker.cli.render")
seen = []
def main(argv):
    seen.append(list(argv))
    return 7
mod.main = main
sys.modules["worker.cli.render"] = mod
from worker.cli import main as cli_main
rc = cli_main(["render", "--image", "x.png", "--help"])
heavy = sorted(m for m in ("celery", "sqlalchemy", "fastapi", "boto3", "kombu") if m in sys.modules)
print(json.dumps({{"rc": rc, "seen": seen, "heavy": heavy}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"rc": 7, "seen": [["--image", "x.png", "--help"]], "heavy": []}


def test_worker_flags_run_one_task_at_a_time_without_prefetch() -> None:
    from worker.settings import Settings

    argv = cli.worker_argv(Settings(queue_name="q-test"), hostname="n1@h", loglevel="WARNING")
    joined = " ".join(argv)
    assert argv[0] == "worker"
    assert "--concurrency 1" in joined and "--prefetch-multiplier 1" in joined
    assert "--pool solo" in joined and "--queues q-test" in joined
    assert "--hostname n1@h" in joined and "--loglevel WARNING" in joined
    assert "--without-gossip" in argv and "--without-mingle" in argv


def test_embedded_env_is_serverless_and_loads_into_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.settings import Settings

    env = cli.embedded_env(tmp_path / "home", host="127.0.0.1", port=8123, token="tok-" + "x" * 12)
    assert env["LONGTAKE_DATABASE_URL"].startswith("sqlite:////")
    assert env["LONGTAKE_OBJECT_STORE_URL"].startswith("file:///")
    assert env["LONGTAKE_BROKER_URL"].startswith("sqla+sqlite:////")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s = Settings()
    assert s.database_url == env["LONGTAKE_DATABASE_URL"]
    assert s.broker_url == env["LONGTAKE_BROKER_URL"]
    assert s.api_port == 8123
    assert s.api_tokens == {"tok-" + "x" * 12: "local"}
    assert str(s.file_root) == str((tmp_path / "home" / "inputs").resolve())


def test_python_m_worker_cli_runs(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "worker.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0 and "usage: longtake" in out.stdout


# ---------------------------------------------------------------------------------------------- up end to end


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 90.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"`longtake up` exited early with {proc.returncode}")
        try:
            resp = httpx.get(f"{url}/healthz", timeout=2)
            if resp.status_code == 200:
                return
            last = resp.text
        except httpx.TransportError as exc:
            last = str(exc)
        time.sleep(0.3)
    raise AssertionError(f"`longtake up` not healthy after {timeout_s} s: {last}")


@pytest.mark.slow  # three Python processes start (migrate, worker, API): ~45 s on the shared 2-core box
def test_up_then_submit_wait_fetch_on_embedded_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`longtake up` runs the production API + task code on SQLite, a local object store and a
    SQLite broker; here with ``--no-worker`` beside the production worker app with the fake pipeline
    injected (``celery_apps:app``, started exactly as ``longtake worker`` starts its app). The inputs
    are local files, so `submit` uploads them and the worker reads them back as upload://."""
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    import fake_pipeline
    from jobs_harness import settings_from_env
    from PIL import Image

    home = tmp_path / "home"
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "integration")]),
        "LONGTAKE_LOG_JSON": "false",
        "LONGTAKE_LOG_LEVEL": "WARNING",
        "LONGTAKE_REAPER_ENABLED": "false",
    }
    log = (tmp_path / "up.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "up", "--no-worker", "--home", str(home), "--port", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    worker: subprocess.Popen[bytes] | None = None
    try:
        _wait_healthy(url, proc)  # migrated, API up: now the worker, as `longtake worker` runs it
        worker_env = {**env, **cli.embedded_env(home.resolve(), host="127.0.0.1", port=port, token="-")}
        argv = cli.worker_argv(settings_from_env(worker_env), hostname="up-test@%h", loglevel="WARNING")
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "celery_apps:app", *argv],
            env=worker_env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        token = (home / "token").read_text().strip()
        image = tmp_path / "face.png"
        Image.new("RGB", (96, 96), (90, 60, 40)).save(image)  # the API probes uploads at submit
        audio = tmp_path / "plan.wav"
        fake_pipeline.write_plan(audio, num_fragments=4, sleep_s=0.3, as_wav=True)
        conn = ["--api", url, "--token", token]
        capsys.readouterr()
        assert cli.main(["submit", "--image", str(image), "--audio", str(audio), "--seed", "5", *conn]) == 0
        job_id = capsys.readouterr().out.strip()
        assert len(job_id) == 36
        assert cli.main(["wait", job_id, "--timeout", "120", "--poll", "0.2", *conn]) == 0
        out, err = capsys.readouterr()
        assert "succeeded" in out and "chunk" in err  # the progress bar went to stderr
        assert cli.main(["fetch", job_id, "-o", str(tmp_path / "out"), *conn]) == 0
        fetched = Path(capsys.readouterr().out.strip())
        assert fetched.read_bytes() == fake_pipeline.expected_output(5, 4)
        assert cli.main(["status", "--json", *conn]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert [j["id"] for j in listed["jobs"]] == [job_id]
        assert listed["jobs"][0]["progress"]["moved_at"] is not None  # issue 18 item 8, through the API
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        try:
            if worker is not None:
                worker.wait(timeout=40)
            rc = proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        log.close()
    assert rc == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert (home / "longtake.db").exists() and (home / "broker.db").exists()


def test_migrate_then_reap_requeues_an_expired_lease_and_republishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`longtake migrate` + `longtake reap` on embedded settings (SQLite DB, SQLite broker)."""
    from kombu import Connection
    from sqlalchemy import inspect

    from worker.jobs.db import make_engine
    from worker.jobs.store import JobStore
    from worker.spec import JobSpec

    for key, value in cli.embedded_env(tmp_path, host="127.0.0.1", port=8000, token="t" * 16).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LONGTAKE_QUEUE_NAME", "reap-test")
    assert cli.main(["migrate"]) == 0
    assert "database at head" in capsys.readouterr().out
    engine = make_engine(f"sqlite:///{tmp_path / 'longtake.db'}")
    assert {"jobs", "segments"} <= set(inspect(engine).get_table_names())
    store = JobStore(engine)
    job = store.create(JobSpec(image="s3://bucket-a/f.png", audio="s3://bucket-a/a.wav"), tenant="local")
    assert store.claim(job.id, owner="dead-worker", lease_s=0.05) is not None
    time.sleep(0.2)
    assert cli.main(["reap"]) == 0
    assert f"requeued 1 job(s): {job.id}" in capsys.readouterr().out
    rec = store.get(job.id)
    assert rec is not None and rec.status == "queued"
    with Connection(f"sqla+sqlite:///{tmp_path / 'broker.db'}") as conn:
        queue = conn.SimpleQueue("reap-test")
        msg = queue.get(timeout=5)
        assert msg.headers["task"] == "longtake.render_job" and msg.payload[0] == [job.id]
        msg.ack()
        queue.close()
    engine.dispose()


def test_real_render_help_goes_through_the_cli_without_service_imports() -> None:
    code = f"""
import sys, json
sys.path.insert(0, {str(ROOT)!r})
from worker.cli import main
try:
    rc = main(["render", "--help"])
except SystemExit as exc:
    rc = exc.code
heavy = sorted(m for m in ("celery", "sqlalchemy", "fastapi", "boto3", "kombu") if m in sys.modules)
print(json.dumps({{"rc": rc, "heavy": heavy}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "--audio" in out.stdout  # the render parser's own help
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"rc": 0, "heavy": []}


# ---------------------------------------------------------------------------------------------- issue 18: as printed


def start_up(home: Path, port: int, log: Path, *extra: str) -> subprocess.Popen[str]:
    """`longtake up` as a user starts it (the venv's script when there is one), stdout piped so the
    banner can be read line by line; everything else goes to ``log``."""
    script = Path(sys.executable).with_name("longtake")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "worker.cli"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LONGTAKE_LOG_JSON": "false", "LONGTAKE_LOG_LEVEL": "WARNING",
           "PYTHONUNBUFFERED": "1"}
    for key in ("LONGTAKE_API_URL", "LONGTAKE_API_TOKEN", "LONGTAKE_API_TOKENS"):
        env.pop(key, None)
    return subprocess.Popen([*cmd, "up", "--home", str(home), "--port", str(port), *extra], env=env,
                            cwd=home.parent, stdout=subprocess.PIPE, stderr=log.open("wb"), text=True)


def read_banner(proc: subprocess.Popen[str], timeout_s: float = 90.0) -> list[str]:
    """The lines `longtake up` prints, up to its last command (`... fetch JOB ...`); a reader thread,
    so a banner that never comes fails after ``timeout_s`` instead of blocking on readline."""
    import queue
    import threading

    assert proc.stdout is not None
    stdout = proc.stdout
    lines_q: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stdout:
            lines_q.put(line.rstrip("\n"))
        lines_q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines_q.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            raise AssertionError(f"`longtake up` exited ({proc.poll()}) after printing {lines}")
        lines.append(line)
        if " fetch JOB" in line:
            return lines
    raise AssertionError(f"no complete banner after {timeout_s} s: {lines}")


def banner_env(lines: list[str]) -> dict[str, str]:
    """The environment after running the banner's `export A=1 B=2` line in a shell."""
    import shlex

    (export,) = [ln.strip() for ln in lines if ln.strip().startswith("export ")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LONGTAKE_")}
    env["PYTHONPATH"] = str(ROOT)
    for word in shlex.split(export)[1:]:
        key, _, value = word.partition("=")
        env[key] = value
    return env


def banner_command(lines: list[str], verb: str) -> list[str]:
    import shlex

    (line,) = [ln.split("#")[0].strip() for ln in lines if f" {verb} " in ln and not ln.strip().startswith("export")]
    return shlex.split(line)


def stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def test_up_banner_commands_work_as_printed(tmp_path: Path) -> None:
    """Issue 18 item 1: `longtake up` prints an export line and a submit; pasted into a shell, that
    submit reaches the API with the token (on main it failed: 'no API token')."""
    home = tmp_path / "home"
    home.mkdir()
    port = _free_port()
    proc = start_up(home, port, tmp_path / "up.log", "--no-worker")
    try:
        lines = read_banner(proc)
        env = banner_env(lines)
        assert env["LONGTAKE_API_URL"] == f"http://127.0.0.1:{port}"
        submit = banner_command(lines, "submit")
        assert "longtake" in submit[0] or submit[1:3] == ["-m", "worker.cli"]
        assert Path(submit[0]).is_file() or shutil_which(submit[0]), f"{submit[0]} is not a command here"
        assert Path(submit[submit.index("--image") + 1]).is_file()  # the printed inputs exist
        submit.remove("--wait")  # no worker in this test: the slow test below waits for a real one
        out = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        job_id = out.stdout.strip()
        status = subprocess.run([*submit[: submit.index("submit")], "status", job_id], env=env,
                                capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert status.returncode == 0 and "queued" in status.stdout, status.stderr
        assert "HTTP Request" not in out.stderr + status.stderr  # no httpx INFO noise (item 7)
    finally:
        rc = stop(proc)
    assert rc == 0, (tmp_path / "up.log").read_text()[-3000:]


def shutil_which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("tenantA:tokenA-0123456789", {"tokenA-0123456789": "tenantA"}),
        ("a:tok-aaaaaaaaaa, b:tok-bbbbbbbbbb", {"tok-aaaaaaaaaa": "a", "tok-bbbbbbbbbb": "b"}),
        ('{"tok-cccccccccc": "c"}', {"tok-cccccccccc": "c"}),
    ],
)
def test_api_tokens_env_accepts_the_documented_forms(
    value: str, expected: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 1: the auth docstring's `LONGTAKE_API_TOKENS="tenantA:tokenA"` parses (it crashed with an
    opaque SettingsError), and so does the JSON object of docs/api.md."""
    from worker.settings import Settings

    monkeypatch.setenv("LONGTAKE_API_TOKENS", value)
    assert Settings().api_tokens == expected


def test_bad_api_tokens_env_names_variable_and_format(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LONGTAKE_API_TOKENS", "s3cr3t-token-without-tenant")
    assert cli.main(["status", "--api", "http://127.0.0.1:9", "--token", "t" * 16]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "LONGTAKE_API_TOKENS" in err and "tenant:token" in err and "JSON object" in err
    assert "s3cr3t-token-without-tenant" not in err  # a token is a secret: the message shows its start only
    assert "Traceback" not in err


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_help_has_a_description_and_its_defaults(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 7: `--help` of every command says what it does (a description paragraph, not only the
    usage line) and shows every default."""
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]
    assert not description.lstrip().startswith(("options:", "positional arguments:")), out
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    flat = " ".join(out.split())
    for action in sub._actions:
        if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
            assert "default" in (action.help or "") or f"(default: {action.default})" in flat, action.dest


class _FinishedJobClient:
    """Stands in for LongtakeClient.wait on a job that ended before `longtake wait` looked."""

    def wait(self, job_id: str, *, poll_s: float, timeout_s: float | None, on_update: object) -> object:
        from worker.client import JobView, ProgressView

        job = JobView(id=job_id, tenant="local", status="succeeded",
                      progress=ProgressView(chunks_done=17, num_chunks=17, frames_done=272, seconds_done=10.9))
        on_update(job)  # type: ignore[operator]
        return job


def test_wait_on_a_finished_job_prints_no_absurd_rates(capsys: pytest.CaptureFixture[str]) -> None:
    """Item 7: on main this printed '694162 chunk/s ... 0.0 fps' (17 chunks 'done' in 0 s)."""
    rc = cli._wait(_FinishedJobClient(), "j" * 36, timeout_s=None, poll_s=0.1, progress=True)  # type: ignore[arg-type]
    out, err = capsys.readouterr()
    assert rc == 0 and "succeeded" in out and "chunks 17/17" in out
    assert "chunk/s" not in err and "0.0 fps" not in err, err


@pytest.mark.slow  # `up` starts migrate, a real worker (torch, tiny preset) and the API: ~1-2 min on 2 cores
def test_first_hour_as_printed_up_export_submit_wait_preview_fetch(tmp_path: Path) -> None:
    """Issue 18 acceptance: the `longtake up` banner followed literally on the embedded defaults with
    the real worker and the real pipeline — export, submit --wait, preview (the page plays in
    headless Chromium), fetch."""
    import re as _re

    from tests.integration.test_delivery_preview_page import CHROMIUM, page_state

    home = tmp_path / "home"
    home.mkdir()
    port = _free_port()
    proc = start_up(home, port, tmp_path / "up.log")
    try:
        lines = read_banner(proc)
        env = banner_env(lines)
        submit = banner_command(lines, "submit")
        done = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:] + (tmp_path / "up.log").read_text()[-3000:]
        job_id = done.stdout.split()[0]
        assert "succeeded" in done.stdout
        lt = submit[: submit.index("submit")]
        preview = subprocess.run([*lt, "preview", job_id], env=env, capture_output=True, text=True, timeout=120)
        assert preview.returncode == 0, preview.stderr
        (url,) = preview.stdout.split()
        if CHROMIUM is not None:
            state, detail = page_state(url, tmp_path)
            assert state == "complete", detail
            seconds = float(_re.search(r"([\d.]+) s buffered", detail).group(1))  # type: ignore[union-attr]
            assert seconds > 5, detail  # assets/demo/speech.wav: ~10 s
        fetch = banner_command(lines, "fetch")
        fetch[fetch.index("JOB")] = job_id
        got = subprocess.run(fetch, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert got.returncode == 0, got.stderr
        video = tmp_path / "out.mp4"
        assert video.read_bytes()[4:8] == b"ftyp"
    finally:
        rc = stop(proc)
    assert rc == 0, (tmp_path / "up.log").read_text()[-3000:]


def test_status_shows_when_a_running_job_last_moved(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 18 item 8: a stuck job heartbeats and looks 'running'; its age of progress tells."""
    from datetime import UTC, datetime, timedelta

    from worker.client import JobView, ProgressView

    moved = datetime.now(UTC) - timedelta(seconds=125)
    running = JobView(id="j1", tenant="t", status="running", progress=ProgressView(chunks_done=3, moved_at=moved))
    cli._print_job(running, as_json=False)
    assert "last moved 2m05s ago" in capsys.readouterr().out
    done = running.model_copy(update={"status": "succeeded"})
    cli._print_job(done, as_json=False)
    assert "last moved" not in capsys.readouterr().out
    assert cli._ago(moved - timedelta(hours=2), now=moved) == "2h00m"
    assert cli._ago(moved, now=moved - timedelta(seconds=5)) == "0s"


def test_option_flag_parses_key_value_as_int_float_or_string(capsys: pytest.CaptureFixture[str]) -> None:
    from worker.cli.options import options_of, parse_option
    from worker.cli.render import build_parser as render_parser

    argv = ["--image", "s3://b1/f.png", "--option", "steps=3", "--option", "audio_guidance=2.0",
            "--option", "conditioning=latent", "--option", "shift=1e1", "--option", "negative_prompt=a=b c",
            "--option", "x=nan", "--option", "empty="]
    for command in (["submit", "--audio", "s3://b1/a.wav"], ["live", "--audio-from", "-"]):
        args = cli.build_parser().parse_args([*command, *argv])
        opts = options_of(args.options)
        assert opts == {"steps": 3, "audio_guidance": 2.0, "conditioning": "latent", "shift": 10.0,
                        "negative_prompt": "a=b c", "x": "nan", "empty": ""}, command
        assert type(opts["steps"]) is int and type(opts["audio_guidance"]) is float
    args = render_parser().parse_args(["--image", "f.png", "--audio", "a.wav", "--out", "o.mp4", "--option", "steps=3"])
    assert options_of(args.options) == {"steps": 3}
    assert options_of(cli.build_parser().parse_args(["submit", *argv[:2], "--audio", "a.wav"]).options) == {}
    assert parse_option(" steps =4") == ("steps", 4)
    for bad in ("steps", "=3"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["submit", "--image", "a.png", "--audio", "a.wav", "--option", bad])
        assert exc.value.code == 2
        assert f"argument --option: '{bad}' is not KEY=VALUE; write e.g. --option steps=3" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--option steps= is given twice \(3 and 4\); give it once"):
        options_of([("steps", 3), ("steps", 4)])
    for command in ("submit", "live"):  # --help names the flag with an example
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        assert "--option KEY=VALUE" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["render", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--option KEY=VALUE" in help_text and "e.g. --option steps=3 --option audio_guidance=2.0" in help_text


def test_submit_sends_options_over_the_spec_files_and_refuses_a_repeated_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import httpx

    from worker.client import LongtakeClient

    sent: list[dict[str, object]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(201, json={"id": "j1", "tenant": "t", "status": "queued", "spec": sent[-1]})

    monkeypatch.setattr(cli, "_client", lambda args: LongtakeClient(
        "http://api.test", "t" * 16, transport=httpx.MockTransport(answer)))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"seed": 4, "options": {"steps": 9, "audio_guidance": 2.0}}))
    base = ["submit", "--image", "s3://b1/f.png", "--audio", "s3://b1/a.wav"]
    assert cli.main([*base, "--spec", str(spec), "--option", "steps=3"]) == cli.EXIT_OK
    assert sent[-1]["options"] == {"steps": 3, "audio_guidance": 2.0} and sent[-1]["seed"] == 4
    assert cli.main(base) == cli.EXIT_OK and "options" not in sent[-1]
    capsys.readouterr()
    assert cli.main([*base, "--option", "steps=3", "--option", "steps=4"]) == cli.EXIT_USAGE
    assert "--option steps= is given twice" in capsys.readouterr().err and len(sent) == 2
