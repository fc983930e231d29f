"""Bearer-token table parsing, tenant lookup and preview-link signing (worker/api/auth.py)."""

from __future__ import annotations

import pytest

from worker.api.auth import AuthError, PreviewSigner, TokenAuth, parse_tokens

TOK_A = "aaaaaaaa-token"
TOK_B = "bbbbbbbb-token"


def test_parse_accepts_settings_mapping_string_and_pairs() -> None:
    expected = {TOK_A: "tenant-a", TOK_B: "tenant-b"}
    assert parse_tokens({TOK_A: "tenant-a", TOK_B: "tenant-b"}) == expected
    assert parse_tokens(f"tenant-a:{TOK_A}, tenant-b:{TOK_B},") == expected
    assert parse_tokens([("tenant-a", TOK_A), ("tenant-b", TOK_B)]) == expected


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("tenant-a", "has no ':'"),
        ("bad/tenant:" + TOK_A, "is not a valid name"),
        ("tenant-a:short", "shorter than 8"),
        (f"tenant-a:{TOK_A},tenant-b:{TOK_A}", "share a token"),
    ],
)
def test_parse_rejects_bad_tables_with_the_fix(value: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_tokens(value)


def test_rotation_two_tokens_one_tenant() -> None:
    auth = TokenAuth.from_setting({TOK_A: "tenant-a", TOK_B: "tenant-a"})
    assert auth.tenant_for(f"Bearer {TOK_A}") == auth.tenant_for(f"bearer  {TOK_B} ") == "tenant-a"
    assert auth.tenants == frozenset({"tenant-a"})


@pytest.mark.parametrize(
    ("header", "error"),
    [
        (None, "invalid_request"),
        ("", "invalid_request"),
        (f"Basic {TOK_A}", "invalid_request"),
        ("Bearer", "invalid_request"),
        (f"Bearer {TOK_A[:-1]}", "invalid_token"),
        (f"Bearer {TOK_A}x", "invalid_token"),
        ("Bearer wrong-token-entirely", "invalid_token"),
    ],
)
def test_bad_headers_raise_with_rfc6750_error(header: str | None, error: str) -> None:
    auth = TokenAuth.from_setting({TOK_A: "tenant-a"})
    with pytest.raises(AuthError) as exc:
        auth.tenant_for(header)
    assert exc.value.error == error
    assert exc.value.www_authenticate().startswith(f'Bearer realm="longtake", error="{error}"')


def test_preview_signature_binds_job_and_expiry_and_key() -> None:
    signer = PreviewSigner({TOK_A: "tenant-a"})
    sig = signer.sign("job-1", 2_000)
    assert signer.check("job-1", 2_000, sig, now=1_000)
    assert not signer.check("job-2", 2_000, sig, now=1_000)  # other job
    assert not signer.check("job-1", 2_001, sig, now=1_000)  # stretched expiry
    assert not signer.check("job-1", 2_000, sig, now=2_001)  # expired
    rotated = PreviewSigner({TOK_B: "tenant-a"})
    assert not rotated.check("job-1", 2_000, sig, now=1_000)  # token rotation revokes links
