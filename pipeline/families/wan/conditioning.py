"""The known frames of a Wan window — what goes into the DiT's I2V conditioning channels — in the
two chunk-conditioning modes.

* ``latent`` (default): ``N_k`` sees the last ``C`` latent frames of ``N_{k-1}`` exactly as sampled;
  nothing is decoded and encoded again, so no colour or detail is lost at a chunk boundary.
* ``reencode`` (upstream InfiniteTalk / FlashTalk): the previous chunk is decoded on its own, its last
  ``1 + 4(C - 1)`` video frames (InfiniteTalk's ``motion_frame = 9`` for ``C = 3``) are encoded again
  as a clip of their own — the first of them as a causal first frame — and those ``C`` latents are
  the context.

Both modes give ``N_0`` the reference's latent as frame 0 and give ``I`` chunks their two anchors as
latents (upstream has no I chunks), so the modes differ only in the context frames of ``N_k``, k >= 1
(tests/wan/test_wan_family.py shows it). Unknown frames get ``pad_latent`` (gray frames encoded after
the reference, as upstream pads its condition clip with zero frames) and a zero mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from pipeline.schedule import ChunkKind, ChunkStep
from pipeline.stage_common import known_positions

MASK_CHANNELS = 4  # one mask channel per video frame of a latent (the VAE's temporal stride)


def known_latents(step: ChunkStep, mode: str, ref_latent: Tensor, last_n: Tensor | None, prev_last: Tensor | None,
                  reencode: Callable[[Tensor, int], Tensor]) -> Tensor:
    """The known frames of ``step``'s window, in window order: ``[1, C, len(step.known), h, w]``.

    ``reencode(latents, n)``: the ``n`` latents of the re-encode mode from the previous chunk's
    latents (decode alone, encode the last ``1 + 4(n - 1)`` frames)."""
    if step.reference_slot:
        return ref_latent
    if last_n is None:
        raise RuntimeError(f"{step.name} needs the previous N chunk but the rolling state has none")
    n = len(step.known)
    if step.kind is ChunkKind.N:
        return last_n[:, :, -n:] if mode == "latent" else reencode(last_n, n)
    if prev_last is None:
        raise RuntimeError(f"{step.name} needs its left anchor but the rolling state has none")
    e = len(step.generate)
    return torch.cat([prev_last, last_n[:, :, e : e + 1]], dim=2)


def condition(step: ChunkStep, known: Tensor, pad_latent: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(cond_BCTHW, known_BCTHW, known_BT)`` of the window: the DiT's I2V condition (4 mask channels
    + known-frame latents, ``pad_latent`` elsewhere), the clean latents for the sampler, the mask."""
    device = pad_latent.device  # the window's tensors live where the latents do
    known_BT = torch.tensor([step.known_mask()], dtype=torch.bool, device=device)
    t = len(step.window)
    lat = pad_latent.expand(-1, -1, t, -1, -1).clone()
    lat[:, :, known_positions(step, device)] = known.to(lat.dtype)
    mask = known_BT[:, None, :, None, None].to(lat.dtype).expand(-1, MASK_CHANNELS, -1, *lat.shape[3:])
    return torch.cat([mask, lat], dim=1), lat, known_BT
