"""JobSpec validation: bad submissions fail with a message naming the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.request import MAX_TEXT_CHARS
from worker.spec import JobSpec, resolve_file_uri, spec_context

GOOD = {"image": "s3://bucket-a/in/face.png", "audio": "upload://abcdef123456"}


def _err(data: dict[str, object], ctx: dict[str, object] | None = None) -> str:
    with pytest.raises(ValidationError) as ei:
        JobSpec.model_validate(data, context=ctx)
    return str(ei.value)


def test_minimal_spec_defaults_and_roundtrip() -> None:
    spec = JobSpec.model_validate(GOOD)
    assert spec.seed == 0 and spec.preset == "tiny" and spec.priority == 5
    assert spec.preview.hls is True and spec.preview.kvs is None
    again = JobSpec.model_validate(spec.model_dump(mode="json"))
    assert again == spec
    with pytest.raises(ValidationError):
        spec.__setattr__("seed", 3)  # frozen


def test_unknown_field_is_named() -> None:
    msg = _err({**GOOD, "tenant": "someone-else"})
    assert "tenant" in msg and "Extra inputs are not permitted" in msg
    assert "colour" in _err({**GOOD, "preview": {"hls": True, "colour": 1}})


def test_negative_seed_and_bad_priority() -> None:
    assert "seed" in _err({**GOOD, "seed": -1})
    assert "priority" in _err({**GOOD, "priority": 10})


def test_text_over_limit_names_the_limit() -> None:
    msg = _err({**GOOD, "text": "x" * (MAX_TEXT_CHARS + 1)})
    assert "text" in msg and str(MAX_TEXT_CHARS) in msg and "shorten" in msg
    assert JobSpec.model_validate({**GOOD, "text": "x" * MAX_TEXT_CHARS}).text is not None


@pytest.mark.parametrize(
    "uri",
    [
        "s3://bucket-a/../etc/passwd",
        "s3://bucket-a/a/./b.png",
        "s3://Bad_Bucket/key.png",
        "s3://bucket-a/",
        "http://example.com/a.png",
        "face.png",
        "file://relative/path.png",
        "file:///srv/in/../../etc/passwd",
        "upload://../../x",
        "upload://short",
    ],
)
def test_bad_uris_rejected(uri: str) -> None:
    msg = _err({**GOOD, "image": uri})
    assert "image" in msg


def test_file_uri_under_allowed_root(tmp_path: Path) -> None:
    root = tmp_path / "inputs"
    (root / "a").mkdir(parents=True)
    (root / "a" / "face.png").write_bytes(b"x")
    ctx = spec_context(root)
    ok = JobSpec.model_validate({**GOOD, "image": f"file://{root}/a/face.png"}, context=ctx)
    assert resolve_file_uri(ok.image, root) == root / "a" / "face.png"
    msg = _err({**GOOD, "image": f"file://{tmp_path}/other.png"}, ctx)
    assert "outside the allowed root" in msg and "image" in msg
    # a symlink that points out of the root is outside too
    (root / "link.png").symlink_to(tmp_path / "other.png")
    assert "outside the allowed root" in _err({**GOOD, "image": f"file://{root}/link.png"}, ctx)
    # no root configured: file:// is refused, with the fix
    assert "LONGTAKE_FILE_ROOT" in _err({**GOOD, "audio": f"file://{root}/a/face.png"}, spec_context(None))


def test_kvs_and_idempotency_key() -> None:
    spec = JobSpec.model_validate(
        {
            **GOOD,
            "preview": {"kvs": {"stream_name": "demo-1", "region": "eu-west-1"}},
            "idempotency_key": "k:1",
        }
    )
    assert spec.preview.kvs is not None and spec.preview.kvs.region == "eu-west-1"
    assert "region" in _err({**GOOD, "preview": {"kvs": {"stream_name": "s", "region": "mars"}}})
    assert "idempotency_key" in _err({**GOOD, "idempotency_key": "has space"})


def test_settings_guard_long_jobs_and_celery_config() -> None:
    from worker.jobs.queue import celery_config
    from worker.settings import Settings

    with pytest.raises(ValidationError, match="visibility_timeout_s"):
        Settings(max_job_s=100_000, visibility_timeout_s=50_000)
    with pytest.raises(ValidationError, match="heartbeat_s"):
        Settings(lease_s=10, heartbeat_s=6)
    s = Settings(max_job_s=3600, visibility_timeout_s=7200)
    conf = celery_config(s)
    assert conf["worker_prefetch_multiplier"] == 1 and conf["worker_concurrency"] == 1
    assert conf["task_acks_late"] and conf["task_reject_on_worker_lost"] and conf["task_ignore_result"]
    assert conf["accept_content"] == ["json"] and conf["broker_connection_retry_on_startup"]
    assert conf["broker_transport_options"]["visibility_timeout"] == 7200 > s.max_job_s


def test_strict_types_refuse_coercion() -> None:
    for bad in ({"seed": "7"}, {"seed": True}, {"seed": 7.0}, {"priority": "9"}, {"preview": {"hls": "yes"}}):
        msg = _err({**GOOD, **bad})
        assert next(iter(bad)) in msg


def test_preset_must_belong_to_the_family() -> None:
    msg = _err({**GOOD, "preset": "huge"})
    assert "preset" in msg and "'tiny'" in msg
    assert JobSpec.model_validate({**GOOD, "family": "wan", "preset": "infinitetalk"}).preset == "infinitetalk"
    assert "preset" in _err({**GOOD, "family": "tiny", "preset": "infinitetalk"})


def test_file_root_is_not_shown_in_the_refusal(tmp_path: Path) -> None:
    root = tmp_path / "secret-inputs"
    root.mkdir()
    msg = _err({**GOOD, "image": "file:///etc/passwd"}, spec_context(root))
    assert "outside the allowed root" in msg and str(root) not in msg


def test_input_grants_per_tenant_and_job_store() -> None:
    from worker.access import InputGrants, InputRefusedError
    from worker.settings import Settings

    grants = InputGrants.from_settings(
        Settings(
            object_store_url="s3://jobs/base",
            input_grants={"tenant-a": ["s3://assets/a/"], "*": ["s3://public/"], "tenant-b": ["s3://jobs/"]},
        )
    )
    grants.check("tenant-a", "image", "s3://assets/a/face.png")
    grants.check("tenant-b", "image", "s3://public/face.png")
    grants.check("tenant-b", "image", "upload://abcdef123456")
    grants.check("tenant-b", "image", "s3://jobs/base/tenants/tenant-b/uploads/x")
    for tenant, uri in [
        ("tenant-b", "s3://assets/a/face.png"),  # another tenant's grant
        ("tenant-a", "s3://assets/ab/face.png"),  # a prefix is a directory, not a string prefix
        ("tenant-a", "s3://public-evil/face.png"),
        ("tenant-b", "s3://jobs/base/tenants/tenant-a/jobs/j/final.mp4"),  # granted bucket, other tenant
    ]:
        with pytest.raises(InputRefusedError, match="image"):
            grants.check(tenant, "image", uri)
    with pytest.raises(ValidationError, match="LONGTAKE_INPUT_GRANTS"):
        Settings(input_grants={"tenant-a": ["s3://assets/no-slash"]})


def test_token_bucket_refills_at_its_rate() -> None:
    from worker.api.gate import TokenBucket

    now = [0.0]
    bucket = TokenBucket(2.0, 3, clock=lambda: now[0])
    assert [bucket.take("t") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take("t") == pytest.approx(0.5)
    assert bucket.take("other") == 0.0  # per key
    now[0] = 0.5
    assert bucket.take("t") == 0.0 and bucket.take("t") > 0
    assert TokenBucket(0.0, 1).take("t") == 0.0  # 0 = no limit
