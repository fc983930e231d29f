"""Flow-matching Euler sampler with a shifted timestep schedule.

Who calls it: the pipeline's A2V stage, once per chunk, with a ``velocity_fn`` that wraps the A2V DiT
(reference, audio and text conditioning bound in). Convention (rectified flow): ``x_t = (1-t) x0 + t noise``
and the model predicts ``v = noise - x0``; Euler integrates from t = 1 (noise) to t = 0.

Known frames (context for N chunks, anchors for I chunks) are reset to their clean values before every
model call and in the result, so they come back bit-exact.

Starting from a prior (``start`` < 1): the unknown frames start at flow time ``start`` on the straight
line from a caller-given guess ``prior`` to the noise, ``(1 - start) prior + start noise``, and the
same number of steps covers ``[start, 0]`` (the shifted curve cut at ``start``). This is SDEdit's
start (Meng et al., 2022) in flow-matching form: the guess fixes what the first, noisiest steps
would otherwise draw at random (for the A2V: where the head and its features sit), the rest of the
steps draw the detail. ``start`` = 1 is the plain sampler, bit for bit.

Per-frame starts (``start`` a sequence, one per frame): windows packed along T that start at
different times (the A2V's N and I windows of one batched step) share one sampling of the same
number of steps, each frame on its own start's schedule; ``velocity_fn`` then gets the times per
frame, ``(B, T)``, instead of ``(B,)``. Each frame's arithmetic is the one its own start would run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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

    def timesteps(self, start: float = 1.0) -> Tensor:
        """``num_steps + 1`` float32 times from ``start`` to 0: ``t' = shift t / (1 + (shift - 1) t)``, t
        uniform from the ``t`` whose ``t'`` is ``start`` (``start`` = 1: from 1)."""
        if not 0.0 < start <= 1.0:
            raise ValueError(f"start={start}: must be in (0, 1] (the flow time sampling starts at; 1 = pure noise)")
        u0 = start / (self.shift - (self.shift - 1.0) * start)
        t = torch.linspace(u0, 0.0, self.num_steps + 1, dtype=torch.float64)
        return (self.shift * t / (1.0 + (self.shift - 1.0) * t)).float()

    def sample(
        self,
        velocity_fn: Callable[[Tensor, Tensor], Tensor],
        noise_BCThw: Tensor,
        known_BCThw: Tensor,
        known_BT: Tensor,
        prior_BCThw: Tensor | None = None,
        start: float | Sequence[float] = 1.0,
    ) -> Tensor:
        """Euler from t = ``start`` to 0; ``velocity_fn(x_BCThw, t) -> v_BCThw`` with ``t`` of shape
        ``(B,)``, or ``(B, T)`` when ``start`` is per frame. Returns the x0 estimate.

        ``known_BCThw`` holds the clean latents at the frames where ``known_BT`` is True (other frames
        are ignored). With ``start`` < 1 the unknown frames start at ``(1 - start) prior_BCThw + start
        noise_BCThw`` (``prior_BCThw`` required, the shape of the noise; frames whose start is 1 take
        the noise whatever their prior). ``start`` a sequence: one start per frame (T of them).
        """
        if noise_BCThw.shape != known_BCThw.shape:
            raise ValueError(
                f"known_BCThw {tuple(known_BCThw.shape)} must match noise_BCThw {tuple(noise_BCThw.shape)}"
            )
        B, _, T = noise_BCThw.shape[:3]
        if known_BT.shape != (B, T):
            raise ValueError(f"known_BT {tuple(known_BT.shape)} must be (B, T) = {(B, T)}")
        per_frame = not isinstance(start, (int, float))
        starts = [float(s) for s in start] if per_frame else [float(start)] * T  # type: ignore[union-attr, arg-type]
        if len(starts) != T:
            raise ValueError(f"start has {len(starts)} per-frame values, the window T = {T} frames")
        schedules = {s: self.timesteps(s) for s in dict.fromkeys(starts)}
        ts = torch.stack([schedules[s] for s in starts], dim=1).to(noise_BCThw.device)  # (steps + 1, T)

        def per_frame_row(t_T: Tensor) -> Tensor:  # a time per frame, broadcast over (B, C, T, h, w)
            return t_T.to(noise_BCThw.dtype)[:, None, None]

        x_start = noise_BCThw
        if min(starts) < 1.0:
            if prior_BCThw is None or prior_BCThw.shape != noise_BCThw.shape:
                got = None if prior_BCThw is None else tuple(prior_BCThw.shape)
                raise ValueError(f"start={start} < 1 needs prior_BCThw of shape {tuple(noise_BCThw.shape)}, got {got}")
            x_start = torch.lerp(prior_BCThw, noise_BCThw, per_frame_row(ts[0]))
        keep = known_BT.to(torch.bool)[:, None, :, None, None]
        x = torch.where(keep, known_BCThw, x_start)
        for i in range(self.num_steps):
            t, t_next = ts[i], ts[i + 1]
            t_arg = t[None].expand(B, T) if per_frame else t[:1].expand(B)
            v = velocity_fn(x, t_arg.to(noise_BCThw.dtype))
            x = x + per_frame_row(t_next - t) * v
            x = torch.where(keep, known_BCThw, x)
        return x
