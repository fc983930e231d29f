"""How rough an autoencoder's latents are, read from latent caches before any A2V is trained on them.

The A2V predicts each frame's latent from the reference, the audio and the frames before it; the
more a latent changes between neighbouring frames, cells, or away from the reference latent, the
more of it the A2V has to guess. Each figure is a mean absolute difference divided by the latents'
std, so caches of autoencoders with other channel counts or scales compare:

* ``temporal``: between consecutive frames of a clip;
* ``to_reference``: between each frame and its clip's reference latent;
* ``spatial``: between horizontally neighbouring cells.

    python -m bench.latent_stats .cache/training/latents /tmp/other/latents [--shards N] [--json]

A cache is a directory of ``shard_*.pt`` written by ``models.training.train_all --stage cache``
(``hr`` (N, T, C, h, w), ``ref`` (N, C, h, w)). Measured on 2026-12-04 (docs/quality.md "A 16-channel
chain in one hour"): the latents of a 16-channel VAE trained four times the steps change 1.8x as much
between frames as the shipped 8-channel VAE's, and its A2V's flow loss stayed 4x higher.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

STATS = ("std", "temporal", "to_reference", "spatial")


def latent_stats(hr_NTChw: torch.Tensor, ref_NChw: torch.Tensor) -> dict[str, float]:
    """The figures of the module docstring for one batch of clips (sums, so batches can be pooled:
    see :func:`cache_stats`)."""
    hr, ref = hr_NTChw.float(), ref_NChw.float()
    if hr.dim() != 5 or ref.dim() != 4 or hr.shape[0] != ref.shape[0] or hr.shape[2:] != ref.shape[1:]:
        raise ValueError(f"latent_stats: hr must be (N, T, C, h, w) and ref (N, C, h, w) of the same N, C, h, w; "
                         f"got {tuple(hr.shape)} and {tuple(ref.shape)}")
    if hr.shape[1] < 2:
        raise ValueError(f"latent_stats: clips of {hr.shape[1]} frame(s); temporal change needs at least 2")
    return {
        "n": float(hr.numel()), "sum": float(hr.sum()), "sum_sq": float(hr.double().pow(2).sum()),
        "temporal_sum": float((hr[:, 1:] - hr[:, :-1]).abs().sum()), "temporal_n": float(hr[:, 1:].numel()),
        "to_reference_sum": float((hr - ref[:, None]).abs().sum()),
        "spatial_sum": float((hr[..., 1:] - hr[..., :-1]).abs().sum()), "spatial_n": float(hr[..., 1:].numel()),
    }


def pooled(parts: list[dict[str, float]]) -> dict[str, float]:
    """Pool :func:`latent_stats` sums of several batches into the figures of ``STATS`` (the latents' std,
    then each mean absolute difference divided by it)."""
    tot = {k: sum(p[k] for p in parts) for k in parts[0]}
    mean = tot["sum"] / tot["n"]
    std = max(tot["sum_sq"] / tot["n"] - mean * mean, 0.0) ** 0.5
    if std == 0.0:
        raise ValueError("latent_stats: every latent value is the same (std 0); the cache holds no information")
    return {"std": std,
            "temporal": tot["temporal_sum"] / tot["temporal_n"] / std,
            "to_reference": tot["to_reference_sum"] / tot["n"] / std,
            "spatial": tot["spatial_sum"] / tot["spatial_n"] / std}


def cache_stats(cache_dir: Path, shards: int | None = None) -> dict[str, float | int]:
    """The figures over the first ``shards`` shards of a cache (all by default), one shard in memory at a time."""
    paths = sorted(Path(cache_dir).glob("shard_*.pt"))[:shards]
    if not paths:
        raise FileNotFoundError(f"no latent shards (shard_*.pt) in {cache_dir}: pass a cache directory written by "
                                "models.training.train_all --stage cache (its latents/ folder)")
    parts, clips, channels = [], 0, 0
    for p in paths:
        blob = torch.load(p, map_location="cpu")
        parts.append(latent_stats(blob["hr"], blob["ref"]))
        clips += int(blob["hr"].shape[0])
        channels = int(blob["hr"].shape[2])
    return {"channels": channels, "clips": clips, **pooled(parts)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("caches", type=Path, nargs="+", help="latent cache directories (holding shard_*.pt)")
    p.add_argument("--shards", type=int, default=None, help="read only the first N shards of each cache")
    p.add_argument("--json", action="store_true", help="print one JSON object per cache")
    a = p.parse_args(argv)
    if a.shards is not None and a.shards < 1:
        p.error(f"--shards {a.shards}: pass a positive number of shards, or leave it out to read them all")
    rows = {str(c): cache_stats(c, a.shards) for c in a.caches}
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("| cache | channels | clips | " + " | ".join(STATS) + " |")
    print("|---|---|---|" + "---|" * len(STATS))
    for name, r in rows.items():
        print(f"| {name} | {r['channels']} | {r['clips']} | " + " | ".join(f"{r[k]:.3f}" for k in STATS) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
