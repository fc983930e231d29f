"""The job service renders a ``wan`` job end to end: real PostgreSQL, Redis, Celery worker process
(``celery_apps:real``, the production app and the real pipeline) and an S3 server (moto) on loopback;
the spec names the tiny Wan release by a model name from the operator's list (LONGTAKE_MODELS)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from jobs_harness import JobsEnv, drop_queue, make_env, settings_from_env
from sqlalchemy import create_engine

from bench.inputs import DEMO_IMAGE, speech_wav
from models.wan.tiny_release import write_tiny_infinitetalk
from tests.integration.s3_fixtures import ACCESS_KEY, REGION, SECRET_KEY, MotoServer, moto_s3  # noqa: F401
from worker.jobs.store import JobStore
from worker.spec import JobSpec, spec_context

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_wan_job_end_to_end_on_s3(tmp_path: Path, pg_url: str, moto_s3: MotoServer) -> None:  # noqa: F811
    bucket = moto_s3.make_bucket()
    weights = write_tiny_infinitetalk(tmp_path / "weights")
    env = make_env(tmp_path, pg_url, "redis://127.0.0.1:6379/1", OBJECT_STORE_URL=f"s3://{bucket}/out",
                   S3_ENDPOINT_URL=moto_s3.endpoint_url, MODELS=json.dumps({"wan-tiny": str(weights)}),
                   NODE_THREADS_PER_RANK="1")
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION=REGION)
    (tmp_path / "in" / "face.png").write_bytes(DEMO_IMAGE.read_bytes())
    speech_wav(tmp_path / "in" / "speech.wav", 1.3)
    settings = settings_from_env(env)
    engine = create_engine(pg_url)
    je = JobsEnv(tmp=tmp_path, settings=settings, env=env, store=JobStore(engine, max_attempts=1))
    try:
        ctx = spec_context(settings.file_root, settings.models)
        spec = JobSpec.model_validate({"image": f"file://{tmp_path}/in/face.png", "audio": f"file://{tmp_path}/in/speech.wav",
                                       "text": "w1 w2", "family": "wan", "preset": "tiny", "model": "wan-tiny"},
                                      context=ctx)
        je.start_worker("w1", app="real")
        rec = je.store.create(spec, tenant="t1")
        je.publish(rec.id)
        (done,) = je.wait([rec.id], timeout=240)
        assert done.status == "succeeded", (done.status, done.error_code, done.error_message)
        uri = done.outputs["mp4"]
        assert uri.startswith(f"s3://{bucket}/"), uri
        mp4 = tmp_path / "got.mp4"
        moto_s3.client().download_file(bucket, uri[len(f"s3://{bucket}/"):], str(mp4))
        out = subprocess.run(["ffprobe", "-v", "error", "-show_entries", "stream=codec_type,duration", "-of", "json",
                              str(mp4)], check=True, capture_output=True, text=True).stdout
        d = {s["codec_type"]: float(s["duration"]) for s in json.loads(out)["streams"]}
        assert abs(d["video"] - d["audio"]) <= 1 / 25 + 1e-6 and abs(d["video"] - 1.3) <= 1 / 25 + 1e-6, d
    finally:
        for w in je.workers:
            w.stop()
        engine.dispose()
        drop_queue("redis://127.0.0.1:6379/1", settings.queue_name)
