"""Flow-matching Euler sampler with a shifted timestep schedule.

Who calls it: the pipeline's A2V stage, once per chunk, with a ``velocity_fn`` that wraps the A2V DiT
(reference, audio and text conditioning bound in). Convention (rectified flow): ``x_t = (1-t) x0 + t noise``
and the model predicts ``v = noise - x0``; Euler integrates from t = 1 (noise) to t = 0.

Known frames (context for N chunks, anchors for I chunks) are reset to their clean values before every
model call and in the result, so they come back bit-exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


class FlowMatchEulerSampler:
    def __init__(self, num_steps: int, shift: float) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps={num_steps}: must be >= 1")
        if shift <= 0:
            raise ValueError(f"shift={shift}: must be > 0 (1.0 = no shift, > 1 spends more steps near noise)")
        self.num_steps = num_steps
        self.shift = shift

    def timesteps(self) -> Tensor:
        """``num_steps + 1`` float32 times from 1 to 0: ``t' = shift t / (1 + (shift - 1) t)``, t uniform."""
        t = torch.linspace(1.0, 0.0, self.num_steps + 1, dtype=torch.float64)
        return (self.shift * t / (1.0 + (self.shift - 1.0) * t)).float()

    def sample(
        self,
        velocity_fn: Callable[[Tensor, Tensor], Tensor],
        noise_BCThw: Tensor,
        known_BCThw: Tensor,
        known_BT: Tensor,
    ) -> Tensor:
        """Euler from t = 1 to 0; ``velocity_fn(x_BCThw, t_B) -> v_BCThw``. Returns the x0 estimate.

        ``known_BCThw`` holds the clean latents at the frames where ``known_BT`` is True (other frames
        are ignored).
        """
        if noise_BCThw.shape != known_BCThw.shape:
            raise ValueError(
                f"known_BCThw {tuple(known_BCThw.shape)} must match noise_BCThw {tuple(noise_BCThw.shape)}"
            )
        B, _, T = noise_BCThw.shape[:3]
        if known_BT.shape != (B, T):
            raise ValueError(f"known_BT {tuple(known_BT.shape)} must be (B, T) = {(B, T)}")
        keep = known_BT.to(torch.bool)[:, None, :, None, None]
        x = torch.where(keep, known_BCThw, noise_BCThw)
        ts = self.timesteps().to(noise_BCThw.device)
        for i in range(self.num_steps):
            t, t_next = ts[i], ts[i + 1]
            v = velocity_fn(x, t.expand(B).to(noise_BCThw.dtype))
            x = x + (t_next - t).to(x.dtype) * v
            x = torch.where(keep, known_BCThw, x)
        return x
