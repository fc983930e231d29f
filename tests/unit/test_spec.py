"""JobSpec validation: bad submissions fail with a message naming the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.request import MAX_TEXT_CHARS
from worker.spec import STORED_KEY, JobSpec, resolve_file_uri, spec_context

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


def test_family_options_are_checked_for_the_preset_and_stored_as_the_family_reads_them() -> None:
    assert JobSpec.model_validate(GOOD).options == {}
    spec = JobSpec.model_validate({**GOOD, "options": {"steps": 3.0, "audio_guidance": 2}})
    assert spec.options == {"steps": 3, "audio_guidance": 2.0}
    assert type(spec.options["steps"]) is int and type(spec.options["audio_guidance"]) is float
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec  # the row round-trips
    # the same check with the API's context, and another family's options with its own keys
    assert JobSpec.model_validate({**GOOD, "options": {"steps": 50}}, context=spec_context(None)).options == {
        "steps": 50}
    wan = JobSpec.model_validate({**GOOD, "family": "wan", "preset": "infinitetalk",
                                  "options": {"steps": 4, "conditioning": "reencode", "text_guidance": 5}})
    assert wan.options == {"steps": 4, "conditioning": "reencode", "text_guidance": 5.0}


def _field_errors(data: dict[str, object]) -> list[dict[str, str]]:
    """The API's ``errors`` list of a refused spec (``worker.api.deps.field_errors``)."""
    from worker.api.deps import field_errors

    with pytest.raises(ValidationError) as ei:
        JobSpec.model_validate(data, context=spec_context(None))
    return field_errors(ei.value, known_fields=list(JobSpec.model_fields))


@pytest.mark.parametrize(
    ("options", "field", "message"),
    [
        ({"steps": 0}, "options.steps", "options.steps=0: must be int in [1, 50] (preset 'tiny' default 5)"),
        ({"steps": 2.5}, "options.steps", "options.steps=2.5: must be int in [1, 50] (preset 'tiny' default 5)"),
        ({"steps": "5"}, "options.steps", "options.steps='5': must be int in [1, 50] (preset 'tiny' default 5)"),
        ({"audio_guidance": True}, "options.audio_guidance",
         "options.audio_guidance=True: must be float in [1, 10] (preset 'tiny' default 2.0)"),
        ({"audio_guidance": None}, "options.audio_guidance",
         "options.audio_guidance=None: must be float in [1, 10] (preset 'tiny' default 2.0)"),
        ({"steps": 3, "text_guidance": 5.0}, "options.text_guidance",
         "options.text_guidance: the tiny family takes ['audio_guidance', 'audio_guidance_peak', 'interp_start_noise', 'start_noise', 'steps']"),
        ([1, 2], "options", "options: must be an object of option names to values (got list); send e.g. "
         '{"steps": 3, "audio_guidance": 2.0}'),
    ],
)
def test_a_bad_option_is_refused_naming_the_option(options: object, field: str, message: str) -> None:
    assert _field_errors({**GOOD, "options": options}) == [{"field": field, "message": message}]


def test_options_follow_the_preset_and_wait_for_a_valid_family_and_preset() -> None:
    # the bounds' message quotes the requested preset's default, not the family default's
    wan = {**GOOD, "family": "wan", "preset": "infinitetalk"}
    (err,) = _field_errors({**wan, "options": {"audio_guidance": 30}})
    assert err == {"field": "options.audio_guidance",
                   "message": "options.audio_guidance=30: must be float in [1, 20] (preset 'infinitetalk' default 4.0)"}
    # an unknown family or preset is refused once, under its own field, not again under options
    assert [e["field"] for e in _field_errors({**GOOD, "preset": "huge", "options": {"steps": 0}})] == ["preset"]
    assert [e["field"] for e in _field_errors({**GOOD, "family": "sora", "options": {"steps": 0}})] == ["family"]


def test_a_stored_row_keeps_options_its_family_now_refuses() -> None:
    """A row written when the bounds were wider (or behind the API's back) stays readable: the
    render's check of the same options fails the job, naming the option (test_jobs_worker.py)."""
    stale = {**GOOD, "options": {"steps": 99}}
    assert JobSpec.model_validate(stale, context={STORED_KEY: True}).options == {"steps": 99}
    assert _field_errors(stale)[0]["field"] == "options.steps"
    # the shape is still checked on a stored row
    with pytest.raises(ValidationError, match="options.steps: must be a number or a string"):
        JobSpec.model_validate({**GOOD, "options": {"steps": [3]}}, context={STORED_KEY: True})


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
