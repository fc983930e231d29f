"""The ``longtake`` CLI: argument parsing, --help of every subcommand, error messages, the render
hand-off (which must not import Celery or SQLAlchemy), and the embedded (`up`) settings."""

from __future__ import annotations

import json
import os
import signal
import socket
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
    for command in ["submit", "status", "wait", "fetch", "cancel", "preview"]:
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        out = capsys.readouterr().out
        assert "--api URL" in out and "--token TOKEN" in out, command


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
