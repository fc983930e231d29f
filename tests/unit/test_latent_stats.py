"""bench.latent_stats: each figure on latents whose answer is known, pooled over shards as over one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.latent_stats import cache_stats, latent_stats, main, pooled


def _shard(path: Path, hr: torch.Tensor, ref: torch.Tensor) -> None:
    torch.save({"hr": hr, "ref": ref}, path)


def test_known_figures() -> None:
    # every value +-1 (std 1): constant over time and equal to the reference -> 0 and 0; the sign
    # alternates between horizontal neighbours -> spatial change |2| / 1 = 2
    row = torch.tensor([1.0, -1.0, 1.0, -1.0])
    hr = row.expand(3, 5, 2, 4, 4).clone()  # (N, T, C, h, w)
    out = pooled([latent_stats(hr, hr[:, 0])])
    assert out == pytest.approx({"std": 1.0, "temporal": 0.0, "to_reference": 0.0, "spatial": 2.0})
    moved = hr.clone()
    moved[:, 1::2] *= -1  # every other frame flipped: each step changes by 2, half the frames differ from ref by 2
    out = pooled([latent_stats(moved, hr[:, 0])])
    assert out["temporal"] == pytest.approx(2.0) and out["to_reference"] == pytest.approx(2.0 * 2 / 5)
    with pytest.raises(ValueError, match="hr must be"):
        latent_stats(hr, hr[:1, 0])
    with pytest.raises(ValueError, match="std 0"):
        pooled([latent_stats(torch.zeros(1, 2, 1, 2, 2), torch.zeros(1, 1, 2, 2))])


def test_shards_pool_as_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = torch.Generator().manual_seed(0)
    hr, ref = torch.randn(6, 4, 3, 5, 5, generator=g), torch.randn(6, 3, 5, 5, generator=g)
    _shard(tmp_path / "shard_000.pt", hr[:4], ref[:4])
    _shard(tmp_path / "shard_001.pt", hr[4:], ref[4:])
    whole = pooled([latent_stats(hr, ref)])
    got = cache_stats(tmp_path)
    assert got["clips"] == 6 and got["channels"] == 3
    assert {k: got[k] for k in whole} == pytest.approx(whole)
    assert cache_stats(tmp_path, shards=1)["clips"] == 4
    assert main([str(tmp_path)]) == 0
    assert f"| {tmp_path} | 3 | 6 | " in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="no latent shards"):
        cache_stats(tmp_path / "missing")
