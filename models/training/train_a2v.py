"""Train the A2V DiT and the audio encoder jointly with flow matching on cached latent clips.

Who calls it: ``train_all`` (after the latent cache exists) or ``python -m models.training.train_a2v``.

One model, every window the pipeline runs (pipeline/schedule.py): per step one kind is drawn:
* ``N``  — C + L frames, the first C known (context from the previous N chunk); with
  ``preset.reference_frame`` 1 + C + L frames, the reference's own low-res latent in front as one
  more known frame (every N chunk re-anchored on the reference: the drift fix of issue 6);
* ``R``  — 1 + L frames, the reference's low-res latent known in front (``N_0`` with
  ``reference_frame``); without it ``N0`` — L frames, none known;
* ``I``  — e + 2 frames, the first and the last known (anchors).
Frame indices start at a random absolute offset (RoPE sees only relative offsets, but this also covers
any absolute-position leak). Known frames are corrupted (Gaussian noise and a small per-channel
offset) while the target stays clean: at inference the context is the model's own output, and the
model learns to pull it back towards the reference instead of copying its errors; I anchors get a
little noise only (``anchor_noise``: joining them exactly is what removes seams). The reference slot
stays clean (at inference it is the exact reference latent). Loss: |v - (noise - x0)|^2 on unknown
frames only, each latent cell weighted by how far it is from the reference's (``change_weights``: the
mouth, the eyes and the head's motion are a few cells of the frame, and an unweighted loss is
satisfied by a still face), and with ``mouth_weight`` > 0 by ``1 + mouth_weight * `` the cell's
coverage by the frame's mouth box (``box_cover`` of the cache's ``mouth_box``: the lips move a few
pixels, and appearance, which improves with every step, must not win over them). An EMA of the
weights is what ships.
The text encoder stays at its seeded init (frozen); with probability ``text_prob`` a prompt is passed
so the DiT learns that a prompt does not change the face.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.audio import AudioEncoder
from models.checkpoint import build_modules, load_checkpoint
from models.dit import A2VDiT
from models.presets import ModelPreset, get_preset
from models.training.common import (
    DEFAULT_CACHE,
    Budget,
    LossLog,
    cosine_lr,
    load_state,
    on_device,
    save_state,
    setup_logging,
    step_generator,
    warm_start,
)
from models.training.data import LatentClips

log = logging.getLogger(__name__)

PROMPTS = ["", "a person talking", "a friendly presenter speaking to the camera", "news anchor, studio",
           "someone explaining a recipe", "ein Mensch spricht", "une personne parle calmement", "smiling"]


def lowres(hr_NTCHW: torch.Tensor, factor: int) -> torch.Tensor:
    n, t, c, h, w = hr_NTCHW.shape
    return F.avg_pool2d(hr_NTCHW.reshape(n * t, c, h, w), factor).reshape(n, t, c, h // factor, w // factor)


def change_weights(x_BCThw: torch.Tensor, ref_BChw: torch.Tensor, gain: float = 3.0, cap: float = 10.0
                   ) -> torch.Tensor:
    """Per-cell loss weights ``(B, T, h, w)``: 1 + gain * (distance to the reference / its mean over the
    sample), capped. Cells that never move (background, hair) keep weight ~1; cells that move with
    the audio (mouth) or the head get several times more."""
    d = (x_BCThw - ref_BChw[:, :, None]).abs().mean(dim=1)  # (B, T, h, w)
    d = d / d.mean(dim=(1, 2, 3), keepdim=True).clamp_min(1e-6)
    return (1 + gain * d).clamp_max(cap)


def box_cover(boxes_BT4: torch.Tensor, h: int, w: int, cell: float) -> torch.Tensor:
    """``(B, T, h, w)``: the fraction of each ``cell``-pixel latent cell inside the box ``(x0, y0, x1, y1)``
    (pixels) of each frame."""
    def overlap(lo: torch.Tensor, hi: torch.Tensor, n: int) -> torch.Tensor:  # (B, T, n)
        e = torch.arange(n, dtype=torch.float32) * cell
        return (torch.minimum(hi[..., None], e + cell) - torch.maximum(lo[..., None], e)).clamp_min(0) / cell

    b = boxes_BT4.float()
    return overlap(b[..., 1], b[..., 3], h)[..., :, None] * overlap(b[..., 0], b[..., 2], w)[..., None, :]


class A2VBatcher:
    """Draws training windows from :class:`LatentClips` (all randomness from the step's generator)."""

    def __init__(self, clips: LatentClips, preset: ModelPreset, *, context_noise: float = 0.3,
                 context_offset: float = 0.08, anchor_noise: float | None = 0.05) -> None:
        self.clips, self.preset = clips, preset
        self.lr = lowres(clips.hr, preset.lowres_factor)  # (N, T, C, h, w)
        self.spf = preset.samples_per_frame
        self.pad = preset.audio.context_frames
        self.context_noise, self.context_offset = context_noise, context_offset
        self.anchor_noise = anchor_noise
        L, C, e = preset.chunk_frames, preset.context_frames, preset.interp_frames
        self.ref_slot = preset.reference_frame  # kinds whose first frame is the reference latent
        self.kinds = {"N": (1 + C + L, list(range(C + 1))) if self.ref_slot else (C + L, list(range(C))),
                      "N0": (L, []), "I": (e + 2, [0, e + 1]), "R": (1 + L, [0])}
        if clips.clip_frames < self.kinds["N"][0]:
            raise ValueError(f"cached clips have {clips.clip_frames} frames; the N window needs "
                             f"{self.kinds['N'][0]}: rebuild the cache with longer clips")
        self.ref_lr = lowres(clips.ref[:, None], preset.lowres_factor)[:, 0]  # (N, C, h, w)
        # each frame's mouth box as a share of every low-res cell (N, T, h, w), for --mouth-weight
        h, w = self.lr.shape[-2:]
        self.mouth_cover = (None if clips.mouth_box is None
                            else box_cover(clips.mouth_box, h, w, preset.height / h))
        # the window kinds the pipeline runs for this preset, and how often a step draws each
        self.probs = ((("N", 0.5), ("I", 0.3), ("R", 0.2)) if self.ref_slot
                      else (("N", 0.5), ("I", 0.3), ("R", 0.15), ("N0", 0.05)))

    def draw_kind(self, gen: torch.Generator) -> str:
        """The window kind of a step (:attr:`probs`)."""
        u = float(torch.rand(1, generator=gen))
        for kind, pr in self.probs:
            if u < pr:
                return kind
            u -= pr
        return self.probs[-1][0]

    def batch(self, gen: torch.Generator, kind: str, size: int) -> dict[str, torch.Tensor]:
        T, known_pos = self.kinds[kind]
        n_clips, t_clip = self.clips.num_clips, self.clips.clip_frames
        # an R window takes L clip frames and puts the reference in front; the audio of that slot is
        # the audio before the clip's first frame (any audio: the frame is known)
        idx = torch.randint(n_clips, (size,), generator=gen)
        start = torch.randint(t_clip - T + 1, (size,), generator=gen)
        windows = list(zip(idx.tolist(), start.tolist(), strict=True))
        x0 = torch.stack([self.lr[i, s : s + T] for i, s in windows]).transpose(1, 2).contiguous()  # (B, C, T, h, w)
        waves = torch.stack([self.clips.audio[i, s * self.spf : (s + T + 2 * self.pad) * self.spf] for i, s in windows])
        known = torch.zeros(size, T, dtype=torch.bool)
        known[:, known_pos] = True
        offset = torch.randint(0, 20_000, (size, 1), generator=gen)
        frame_index = offset + torch.arange(T)[None]
        # corrupted context: noise of random strength + a per-channel offset (colour drift stand-in)
        # I anchors are the model's own fresh outputs and the I chunk's job is to join them exactly:
        # a little noise only, no colour offset (that is the N context's drift stand-in)
        # (anchor_noise None: I anchors corrupted like N context, as the shipped run's first 40 minutes)
        noise_scale, offset_scale = ((self.anchor_noise, 0.0) if kind == "I" and self.anchor_noise is not None
                                     else (self.context_noise, self.context_offset))
        sig = torch.rand(size, 1, 1, 1, 1, generator=gen) * noise_scale
        bias = torch.randn(size, x0.shape[1], 1, 1, 1, generator=gen) * offset_scale
        bias = bias * (torch.rand(size, 1, 1, 1, 1, generator=gen) < 0.5)
        ref_slot = kind == "R" or (kind == "N" and self.ref_slot)
        if ref_slot:  # the reference's low-res latent as the window's first (known) frame
            x0[:, :, 0] = self.ref_lr[idx]
        ctx = x0 + sig * torch.randn(x0.shape, generator=gen) + bias
        if ref_slot:  # at inference the reference slot is exact: never corrupted
            ctx[:, :, 0] = self.ref_lr[idx]
        out = {"x0": x0, "ctx": ctx, "wave": waves, "known": known, "frame_index": frame_index,
               "ref": self.clips.ref[idx], "ref_lr": self.ref_lr[idx], "mouth": self.clips.mouth[idx]}
        if self.mouth_cover is not None:  # (B, T, h, w); the reference slot's frame is known: never weighted
            out["mouth_cover"] = torch.stack([self.mouth_cover[i, s : s + T] for i, s in windows])
        return out


def flow_loss(dit: A2VDiT, audio: AudioEncoder, b: dict[str, torch.Tensor], gen: torch.Generator, shift: float,
              text: tuple[torch.Tensor, torch.Tensor] | None, mouth_weight: float = 0.0) -> torch.Tensor:
    # drawn on the CPU from the step's generator, then moved: the same samples on any device
    dev = dit.head.weight.device
    B = b["x0"].shape[0]
    u = torch.rand(B, generator=gen)
    noise = torch.randn(b["x0"].shape, generator=gen).to(dev)
    b = on_device({**b, "u": u}, dev)  # type: ignore[assignment]
    x0, known, u = b["x0"], b["known"], b["u"]
    T = x0.shape[2]
    t = shift * u / (1 + (shift - 1) * u)  # the sampler's shifted schedule
    tt = t[:, None, None, None, None]
    keep = known[:, None, :, None, None]
    x_t = torch.where(keep, b["ctx"], (1 - tt) * x0 + tt * noise)
    feats = audio(b["wave"], T)
    text_B = ((text[0].to(dev).expand(B, -1, -1), text[1].to(dev).expand(B, -1)) if text is not None
              else (None, None))
    v = dit(x_t, t, known, b["frame_index"], b["ref"], feats, text_B[0], text_B[1])
    w = change_weights(x0, b["ref_lr"]) * (~known).float()[:, :, None, None]  # (B, T, h, w)
    if mouth_weight > 0.0:
        w = w * (1.0 + mouth_weight * b["mouth_cover"])
    err = (v - (noise - x0)).pow(2).mean(dim=1)  # (B, T, h, w)
    return (err * w).sum() / w.sum()


@torch.no_grad()
def heldout_loss(dit: A2VDiT, audio: AudioEncoder, batcher: A2VBatcher, shift: float, *, batches: int = 8,
                 batch_n: int = 6, batch_i: int = 16, seed: int = 4321) -> dict[str, float]:
    """The flow loss (change-weighted, no mouth weight, no prompt) on fixed windows of a held-out cache
    (held-out identities and voices): ``batches`` batches of each window kind the plan runs
    (``batcher.probs``), every draw from fixed generators, so the same weights give the same figure
    and two runs' figures compare. Whether a falling training loss is learning or memorising the
    training clips."""
    out: dict[str, float] = {}
    for kind, _ in batcher.probs:
        vals = []
        for i in range(batches):
            gen = step_generator(seed, i, 2)
            b = batcher.batch(gen, kind, batch_i if kind == "I" else batch_n)
            vals.append(float(flow_loss(dit, audio, b, gen, shift, None)))
        out[f"heldout_loss_{kind}"] = sum(vals) / len(vals)
    out["heldout_loss"] = sum(out.values()) / len(out)
    return out


class EMA:
    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.shadow = {k: copy.deepcopy(m).eval().requires_grad_(False) for k, m in modules.items()}

    @torch.no_grad()
    def update(self, modules: dict[str, nn.Module], decay: float) -> None:
        for k, m in modules.items():
            for ps, p in zip(self.shadow[k].parameters(), m.parameters(), strict=True):
                ps.lerp_(p, 1 - decay)


def train_a2v(preset: ModelPreset, cache_dir: Path, state_path: Path, *, minutes: float, seed: int = 0,
              batch_n: int = 6, batch_i: int = 16, lr: float = 1e-3, text_prob: float = 0.25,
              ema_max: float = 0.998, log_every: int = 20, save_every_s: float = 120.0,
              threads: int | None = None, anchor_noise: float | None = 0.05,
             init_from: Path | None = None, mouth_weight: float = 0.0,
             heldout_dir: Path | None = None, device: str = "cpu",
             reinit_reshaped: bool = False) -> dict[str, float]:
    """Train (or resume) for ``minutes`` of wall time in total; the state file holds model + EMA weights.

    ``init_from``: a fresh run starts from that checkpoint's A2V and audio encoder (its EMA weights)
    instead of the seeded init (:func:`~models.training.common.warm_start`; ``reinit_reshaped``: tensors
    whose shape changed since keep the seeded init). ``mouth_weight``: see the
    module's docstring; it needs a cache with mouth boxes. ``heldout_dir``: a latent cache of held-out
    identities (``train_all --stage heldout-cache``); the EMA weights' :func:`heldout_loss` is logged at
    the start, at every save and at the end, and kept in the state (``heldout_loss_start`` / ``heldout_loss``).
    ``device``: where the models train (``cuda`` on a GPU machine); windows and noise are drawn on the
    CPU from the step's generator either way (:func:`flow_loss`)."""
    if threads:
        torch.set_num_threads(threads)
    base = build_modules(preset, seed)
    dit, audio = base["a2v"], base["audio"]
    assert isinstance(dit, A2VDiT) and isinstance(audio, AudioEncoder)
    dit.to(device)
    audio.to(device)
    with torch.no_grad():  # start from a zero velocity head: stable first steps
        dit.head.weight.zero_()
        dit.head.bias.zero_()
    text_enc = base.get("text")
    prompts = None
    if text_enc is not None:
        with torch.no_grad():
            prompts = [text_enc([p]) for p in PROMPTS]
    train_mods: dict[str, nn.Module] = {"a2v": dit, "audio": audio}
    ema = EMA(train_mods)
    opt = torch.optim.AdamW([p for m in train_mods.values() for p in m.parameters()], lr=lr, weight_decay=0.01,
                            betas=(0.9, 0.99))
    st = load_state(state_path, {**train_mods, "ema_a2v": ema.shadow["a2v"], "ema_audio": ema.shadow["audio"]}, opt)
    if init_from is not None and warm_start(train_mods, init_from, preset.name, st,
                                            reinit_reshaped=reinit_reshaped):
        ema = EMA(train_mods)  # the average starts at the loaded weights, not at the seeded init
    clips = LatentClips(cache_dir)
    if mouth_weight > 0.0 and clips.mouth_box is None:
        raise ValueError(f"mouth_weight={mouth_weight}: the latent cache in {cache_dir} has no mouth boxes (written "
                         "before they were kept): rebuild it with `models.training.train_all --stage cache`, "
                         "or pass --mouth-weight 0")
    st.extra["mouth_weight"] = mouth_weight
    st.extra["batch_n"], st.extra["batch_i"] = batch_n, batch_i
    st.extra["lr"] = lr
    batcher = A2VBatcher(clips, preset, anchor_noise=anchor_noise)
    losses = LossLog(state_path.with_suffix(".jsonl"), "a2v")
    held = A2VBatcher(LatentClips(heldout_dir), preset, anchor_noise=anchor_noise) if heldout_dir else None

    def score_heldout() -> None:
        if held is not None:
            h = heldout_loss(ema.shadow["a2v"], ema.shadow["audio"], held, preset.shift)  # type: ignore[arg-type]
            st.extra.setdefault("heldout_loss_start", h["heldout_loss"])
            st.extra.update(h)
            log.info("a2v step %d held-out (EMA): %s", st.step, " ".join(f"{k}={v:.5f}" for k, v in h.items()))

    score_heldout()
    # the budget is training time: it starts after the start-of-run scoring, so a short budget still trains
    budget = Budget(minutes, st.elapsed_s)
    last_save = budget.elapsed_s
    while not budget.done():
        gen = step_generator(seed, st.step, 1)
        kind = batcher.draw_kind(gen)
        b = batcher.batch(gen, kind, batch_i if kind == "I" else batch_n)
        text = None
        if prompts is not None and float(torch.rand(1, generator=gen)) < text_prob:
            text = prompts[int(torch.randint(len(prompts), (1,), generator=gen))]
        for g in opt.param_groups:
            g["lr"] = cosine_lr(lr, budget.fraction)
        loss = flow_loss(dit, audio, b, gen, preset.shift, text, mouth_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], 1.0)
        opt.step()
        st.step += 1
        ema.update(train_mods, min(ema_max, (1 + st.step) / (10 + st.step)))
        losses.add(loss=loss.item(), **{f"loss_{kind}": loss.item()})
        if st.step % log_every == 0:
            st.losses.append(losses.flush(st.step, budget.elapsed_s)["loss"])
        if budget.elapsed_s - last_save > save_every_s:
            score_heldout()
            st.elapsed_s = budget.elapsed_s
            save_state(state_path, {**train_mods, "ema_a2v": ema.shadow["a2v"], "ema_audio": ema.shadow["audio"]},
                       opt, st)
            last_save = budget.elapsed_s
    score_heldout()
    st.elapsed_s = budget.elapsed_s
    save_state(state_path, {**train_mods, "ema_a2v": ema.shadow["a2v"], "ema_audio": ema.shadow["audio"]}, opt, st)
    return {"steps": st.step, "elapsed_s": st.elapsed_s, "final_loss": st.losses[-1] if st.losses else float("nan"),
            **{k: v for k, v in st.extra.items() if k.startswith("heldout_loss")}}


def score_checkpoints(preset: ModelPreset, heldout_dir: Path, checkpoints: list[Path]) -> dict[str, dict[str, float]]:
    """:func:`heldout_loss` of each checkpoint's A2V and audio encoder on one held-out cache."""
    batcher = A2VBatcher(LatentClips(heldout_dir), preset)
    out = {}
    for path in checkpoints:
        mods = build_modules(preset, 0)
        load_checkpoint(mods, path, preset=preset.name)
        out[str(path)] = heldout_loss(mods["a2v"], mods["audio"], batcher, preset.shift)  # type: ignore[arg-type]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--minutes", type=float, default=35.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="where the models train: cpu, or cuda on a GPU machine")
    p.add_argument("--batch-n", type=int, default=6, help="windows per step of the N / N0 / R kinds")
    p.add_argument("--batch-i", type=int, default=16, help="windows per step of the I kind (short windows)")
    p.add_argument("--anchor-noise", default="0.05",
                   help="max noise on I anchors (no colour offset), or 'context' to corrupt them like N context")
    p.add_argument("--from", dest="from_checkpoint", type=Path, default=None,
                   help="start from this checkpoint's A2V and audio encoder (a fresh state file only)")
    p.add_argument("--reinit-reshaped", action="store_true",
                   help="with --from: tensors whose shape differs from the checkpoint's (a preset with other latent "
                        "channels: patch embeddings, head) keep the seeded init instead of failing; the rest load")
    p.add_argument("--heldout-cache", type=Path, default=None,
                   help="a held-out latent cache (train_all --stage heldout-cache): log the EMA's flow loss on it")
    p.add_argument("--score", type=Path, nargs="+", default=None, metavar="CKPT",
                   help="print the held-out flow loss of these checkpoints (needs --heldout-cache) and exit")
    p.add_argument("--mouth-weight", type=float, default=0.0,
                   help="extra loss weight on the cells of each frame's mouth box (1 + w * coverage)")
    a = p.parse_args(argv)
    if a.reinit_reshaped and a.from_checkpoint is None:
        p.error("--reinit-reshaped needs --from CHECKPOINT (it says which of that checkpoint's tensors to skip)")
    if a.score:
        if a.heldout_cache is None:
            p.error("--score needs --heldout-cache DIR (train_all --stage heldout-cache writes one)")
        if a.threads:
            torch.set_num_threads(a.threads)
        print(json.dumps(score_checkpoints(get_preset(a.preset), a.heldout_cache, a.score), indent=1))
        return 0
    setup_logging(a.cache_dir / "train.log")
    out = train_a2v(get_preset(a.preset), a.cache_dir / "latents", a.cache_dir / "a2v_state.pt",
                    minutes=a.minutes, seed=a.seed, lr=a.lr, threads=a.threads,
                    anchor_noise=None if a.anchor_noise == "context" else float(a.anchor_noise),
                    init_from=a.from_checkpoint, mouth_weight=a.mouth_weight, heldout_dir=a.heldout_cache,
                    device=a.device, batch_n=a.batch_n, batch_i=a.batch_i, reinit_reshaped=a.reinit_reshaped)
    log.info("a2v done: %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
