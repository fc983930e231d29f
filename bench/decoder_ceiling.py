"""How far a decoder of a given size can take the autoencoder on the benchmark's identities (issue 15).

Question it answers: the per-region distances of the autoencoder alone (``bench.reconstruction
--fidelity --chains vae``) stay above the acceptance's 1.25x ground truth. Is that the latent (what the
frozen encoder keeps) or the decoder (its width, its training)? This fits a decoder on frames of the
very identities the fidelity benchmark scores — other poses, blinks and mouths than the benchmark's
clips (motion drawn here, not the benchmark's seeds), so it cannot copy the scored frames, but it may
learn those 20 faces by heart (``--fit-first-identity``: the control, other faces) — and then scores the ``vae`` chain with it exactly as
``bench.reconstruction`` does. A decoder specialised to the scored faces bounds every decoder of its
size on this encoder from above (up to its training time): if even it stays above 1.25x, a generally
trained one will too, and the latent is what must grow; if a wider one gets much nearer than the
present width in the same time, the decoder is.

    python -m bench.decoder_ceiling --minutes 40 --threads 1 --out /tmp/ceil-1x.json
    python -m bench.decoder_ceiling --minutes 40 --threads 1 --dec-channels 32,64,128 --out /tmp/ceil-2x.json

    python -m bench.decoder_ceiling --minutes 35 --threads 1 --train-encoder --latent-channels 16
    python -m bench.decoder_ceiling --minutes 60 --steps 6000 --threads 1 --fit-first-identity 20   # the control

The encoder is the checkpoint's, frozen, and the pool is encoded once. The decoder starts from the
checkpoint's when its shape is the preset's (``--from-scratch`` to start from the seeded init
instead), else from the seeded init. Its training is ``train_vae.train_decoder``'s (AdamW, cosine LR,
detail-weighted L1 + edges, causal taps on past frames kept at zero). ``--train-encoder`` fits the
whole autoencoder instead (``train_vae``'s loss, the latent sampled), the ceiling of latent and
decoder together; ``--latent-channels`` gives it another latent width (the layers that read or
write latents start from the seeded init, the rest from the checkpoint). ``--reference-window R``
and ``--[no-]reference-warp`` (default: the preset's) give the decoder that reads the reference
(``VAEConfig.ref_window_radius``, ``ref_warp``; docs/models.md), each frame its identity's
(``--reference-window 0``: a plain decoder); ``--fit-split train --fit-first-identity K
--fit-identities N`` draws the training frames from training faces, as a shipped decoder is trained,
so the scored faces are unseen:

    python -m bench.decoder_ceiling --steps 8000 --minutes 60 --threads 1 --fit-split train \
        --fit-first-identity 0 --fit-identities 480 --per-identity 4 --reference-window 3 --reference-warp

Diagnostic only: nothing
is written into a checkpoint (``--save`` keeps the fitted autoencoder to score again, ``--load``).
Figures: docs/quality.md "A decoder fit to the scored faces".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from collections import deque
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from bench.reconstruction import fidelity_bounds, load_modules
from models.avatars.dataset import IDENTITY_SPLITS, AvatarRenderer
from models.training.common import Budget, cosine_lr
from models.training.data import DETAIL_REGIONS
from models.training.train_vae import decoder_step, pixel_weight, vae_loss, vae_step, zero_past_taps
from models.vae import CausalVAE

log = logging.getLogger(__name__)


class Pool(NamedTuple):
    """Training frames: uint8 ``frames (N, 3, S, S)``, their detail coverage ``details (N, 1, S, S)``, the
    identities' references ``references (I, 3, S, S)`` uint8 and each frame's identity ``owner (N,)``."""

    frames: torch.Tensor
    details: torch.Tensor
    references: torch.Tensor
    owner: torch.Tensor


def frame_pool(first: int, num_identities: int, per_identity: int, seed: int, split: str = "heldout") -> Pool:
    """``per_identity`` random frames (pose, blink, mouth drawn as ``FrameSampler`` draws them) of each
    identity ``first ..`` of ``split`` (``heldout``: the benchmark's faces; ``train``: the training faces)."""
    gen = torch.Generator().manual_seed(seed)
    lo = IDENTITY_SPLITS[split][0]
    frames, details, refs, owner = [], [], [], []
    for i, k in enumerate(range(first, first + num_identities)):
        r = AvatarRenderer(lo + k)
        refs.append(torch.from_numpy(np.array(r.reference())).permute(2, 0, 1))
        for _ in range(per_identity):
            u = torch.rand(4, generator=gen).tolist()
            img, truth = r.frame(int(torch.randint(100_000, (1,), generator=gen)), u[0] if u[1] < 0.7 else 0.0, u[2])
            frames.append(torch.from_numpy(np.array(img)).permute(2, 0, 1))
            details.append(torch.from_numpy(r.coverage(truth, DETAIL_REGIONS)[0])[None])
            owner.append(i)
    return Pool(torch.stack(frames), torch.stack(details), torch.stack(refs), torch.tensor(owner))


def build_vae(checkpoint: Path | None, dec_channels: tuple[int, ...] | None, from_scratch: bool, seed: int,
              latent_channels: int | None = None, ref_window_radius: int | None = None,
              ref_warp: bool | None = None) -> tuple[CausalVAE, str]:
    """The checkpoint's autoencoder with a decoder of ``dec_channels``, a latent of ``latent_channels``
    and a reference window of ``ref_window_radius`` (0: a plain decoder) with or without ``ref_warp``
    (defaults: the preset's; the warp's is off without a window). A window or gate the checkpoint
    lacks starts as a no-op. Every tensor of the checkpoint's whose shape still fits is loaded — the
    decoder's only when ``from_scratch`` is off — the rest keep the seeded init (with another latent
    width: the encoder's output conv and the decoder's input conv). Returns it and what it started from."""
    mods, preset = load_modules(checkpoint)
    radius = preset.vae.ref_window_radius if ref_window_radius is None else ref_window_radius
    cfg = dataclasses.replace(preset.vae, dec_channels=dec_channels or preset.vae.dec_channels,
                              latent_channels=latent_channels or preset.vae.latent_channels,
                              ref_window_radius=radius,
                              ref_warp=(preset.vae.ref_warp and radius > 0) if ref_warp is None else ref_warp)
    torch.manual_seed(seed)
    vae = CausalVAE(cfg)
    own = vae.state_dict()
    keep = {k: v for k, v in mods["vae"].state_dict().items()
            if k in own and own[k].shape == v.shape and not (from_scratch and k.startswith("decoder."))}
    vae.load_state_dict(keep, strict=False)
    with torch.no_grad():
        zero_past_taps(vae)  # the decoder is per-frame, as train_vae leaves it
    fresh = sorted({k.split(".")[0] for k in own if k not in keep})
    start = "the checkpoint's autoencoder" if not fresh else (
        f"the checkpoint's autoencoder, seeded init for {len(own) - len(keep)} of {len(own)} tensors "
        f"({', '.join(fresh)})")
    return vae, start


def fit(vae: CausalVAE, pool: Pool, minutes: float, *, batch: int = 2,
        lr: float = 1.5e-3, detail_weight: float = 16.0, seed: int = 0, train_encoder: bool = False,
        kl_weight: float = 1e-5, max_steps: int | None = None) -> dict[str, float]:
    """Fit the decoder on the pool (latents encoded once by the frozen encoder) for ``minutes`` or
    ``max_steps``, whichever ends first (the cosine learning rate ends with it); with
    ``train_encoder`` the whole autoencoder (``train_vae``'s loss: the latent sampled, ``kl_weight`` x KL).
    A decoder that reads the reference reads each frame's identity's (``Pool.references``)."""
    frames, details, references, owner = pool
    vae.eval()
    z_all = torch.zeros(0)
    if not train_encoder:
        with torch.inference_mode():
            z_all = torch.cat([vae.encode_moments((frames[i : i + 16].float() / 127.5 - 1)[:, :, None])[0]
                               for i in range(0, len(frames), 16)]).clone()
    refs = references.float() / 127.5 - 1
    ref_z = None
    if not train_encoder and vae.decoder.ref_window is not None:  # a decoder that reads the reference
        with torch.inference_mode():
            ref_z = vae.encode(refs[:, :, None]).clone()
    vae.requires_grad_(False)
    part = vae if train_encoder else vae.decoder
    part.requires_grad_(True).train()
    opt = torch.optim.AdamW(part.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(seed)
    budget, steps = Budget(minutes), 0
    recent: deque[float] = deque(maxlen=200)  # the last 200 losses
    while not budget.done() and (max_steps is None or steps < max_steps):
        idx = torch.randint(len(frames), (batch,), generator=gen)
        x = (frames[idx].float() / 127.5 - 1)[:, :, None]
        weight = pixel_weight(details[idx][:, :, None], detail_weight)
        who = owner[idx]
        ref = vae.reference_features(refs[who], None if ref_z is None else ref_z[who])
        done = budget.fraction if max_steps is None else max(budget.fraction, steps / max_steps)
        for g in opt.param_groups:
            g["lr"] = cosine_lr(lr, done, warmup=0.0)
        if train_encoder:
            loss, _ = vae_loss(vae, x, gen, kl_weight, weight, reference=ref)
            vae_step(vae, opt, loss)
        else:
            loss, _ = decoder_step(vae, opt, z_all[idx], x, weight, reference=ref)
        steps += 1
        recent.append(loss.item())
        if steps % 500 == 0:
            log.info("step %d, %.0f s: loss (last 200) %.4f", steps, budget.elapsed_s, sum(recent) / len(recent))
    vae.eval()
    return {"steps": steps, "seconds": round(budget.elapsed_s, 1),
            "final_loss": round(sum(recent) / max(len(recent), 1), 5)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decoder_ceiling", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, default=None, help="encoder (and decoder) from here (default: shipped)")
    p.add_argument("--dec-channels", default=None,
                   help="decoder channels per level, comma-separated, half resolution first (default: the preset's)")
    p.add_argument("--from-scratch", action="store_true", help="start the decoder from the seeded init")
    p.add_argument("--latent-channels", type=int, default=None,
                   help="latent width (default the preset's); another one starts the layers that read or write "
                        "latents from the seeded init: use with --train-encoder")
    p.add_argument("--train-encoder", action="store_true",
                   help="fit the whole autoencoder (the ceiling of the latent and decoder together), not the decoder")
    p.add_argument("--minutes", type=float, default=40.0, help="fitting time (0: score the start)")
    p.add_argument("--identities", type=int, default=20)
    p.add_argument("--first-identity", type=int, default=0)
    p.add_argument("--per-identity", type=int, default=48, help="training frames drawn per identity")
    p.add_argument("--fit-first-identity", type=int, default=None,
                   help="draw the training frames from held-out identities K.. instead of the scored ones (the "
                        "control: the same training on faces the benchmark does not score)")
    p.add_argument("--fit-split", choices=("heldout", "train"), default="heldout",
                   help="the split --fit-first-identity counts in (train: the training faces, as a decoder that "
                        "ships is trained; default heldout)")
    p.add_argument("--fit-identities", type=int, default=None,
                   help="how many identities the training frames come from (default --identities)")
    p.add_argument("--reference-window", type=int, default=None, metavar="R",
                   help="the decoder reads the reference within R cells (VAEConfig.ref_window_radius; a window the "
                        "checkpoint lacks starts as a no-op); 0: a plain decoder (default: the preset's)")
    p.add_argument("--reference-warp", action=argparse.BooleanOptionalAction, default=None,
                   help="the decoder also blends towards the reference warped by where the window read "
                        "(VAEConfig.ref_warp; default: the preset's when there is a window)")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (or --minutes, the first)")
    p.add_argument("--detail-weight", type=float, default=16.0)
    p.add_argument("--seconds", type=float, default=4.0, help="scored clip length, as bench.reconstruction's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here too")
    p.add_argument("--save", type=Path, default=None,
                   help="write the fitted autoencoder here ({'vae': state dict, 'dec_channels': [...]}; --load reads it)")
    p.add_argument("--load", type=Path, default=None, help="score an autoencoder --save wrote instead of fitting one")
    p.add_argument("--sheet", type=Path, default=None, help="also write a contact sheet (bench.quality --sheet's)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(a.threads)
    dec = None
    if a.latent_channels is not None and not a.train_encoder:
        p.error(f"--latent-channels {a.latent_channels}: a latent of another width needs an encoder trained for it: "
                "add --train-encoder")
    if a.fit_split == "train" and a.fit_first_identity is None:
        p.error("--fit-split train: say which training faces with --fit-first-identity K (the scored ones are "
                "held-out faces, which no training face is)")
    if a.reference_warp and a.reference_window == 0:
        p.error("--reference-warp follows where the reference window read: give --reference-window R (R >= 1)")
    if a.reference_window is not None and a.reference_window < 0:
        p.error(f"--reference-window {a.reference_window}: give a radius >= 1 in cells, or 0 for none")
    if a.dec_channels:
        try:
            dec = tuple(int(c) for c in a.dec_channels.split(","))
        except ValueError:
            p.error(f"--dec-channels {a.dec_channels!r}: give integers, comma-separated (e.g. 32,64,128)")
    t0 = time.monotonic()
    trained: dict[str, object] = {}
    if a.load is not None:
        blob = torch.load(a.load, map_location="cpu", weights_only=False)
        vae = build_vae(a.checkpoint, tuple(blob["dec_channels"]), True, a.seed, blob["latent_channels"],
                        blob.get("ref_window_radius", 0), blob.get("ref_warp", False))[0]
        vae.load_state_dict(blob["vae"])
        trained, start = blob["fit"], str(a.load)
    else:
        vae, start = build_vae(a.checkpoint, dec, a.from_scratch, a.seed, a.latent_channels, a.reference_window,
                               a.reference_warp)
    if a.load is None and a.minutes > 0:
        fit_first = a.first_identity if a.fit_first_identity is None else a.fit_first_identity
        fit_n = a.fit_identities or a.identities
        pool = frame_pool(fit_first, fit_n, a.per_identity, a.seed + 1, a.fit_split)
        log.info("decoder %s, latent %d, reference window %d, from %s: %d decoder parameters; pool of %d frames "
                 "in %.0f s", vae.cfg.dec_channels, vae.cfg.latent_channels, vae.cfg.ref_window_radius, start,
                 sum(t.numel() for t in vae.decoder.parameters()), len(pool.frames), time.monotonic() - t0)
        trained = {**fit(vae, pool, a.minutes, detail_weight=a.detail_weight, seed=a.seed,
                         train_encoder=a.train_encoder, max_steps=a.steps),
                   "trained": "autoencoder" if a.train_encoder else "decoder",
                   "fit_split": a.fit_split, "fit_identities": [fit_first, fit_first + fit_n - 1]}
        if a.save is not None:
            torch.save({"vae": vae.state_dict(), "dec_channels": list(vae.cfg.dec_channels),
                        "latent_channels": vae.cfg.latent_channels,
                        "ref_window_radius": vae.cfg.ref_window_radius, "ref_warp": vae.cfg.ref_warp,
                        "fit": trained}, a.save)
    res = fidelity_bounds(a.identities, a.seconds, a.seed, chains=("vae",), first=a.first_identity, vae=vae,
                          sheet=a.sheet)["vae"]
    agg = res["aggregate"]["all"]  # type: ignore[index]
    out = {"dec_channels": list(vae.cfg.dec_channels), "latent_channels": vae.cfg.latent_channels,
           "ref_window_radius": vae.cfg.ref_window_radius, "ref_warp": vae.cfg.ref_warp, "start": start,
           **trained,
           "ratios": {k[len("ratio_"):]: v for k, v in agg.items() if k.startswith("ratio_")},
           "presence": {k: v for k, v in agg.items() if k.startswith("model_presence_")}}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out is not None:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
