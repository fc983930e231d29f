"""The chain's upper bounds on a held-out ground-truth render (``reconstruction_report``): lip sync r
and PSNR after the VAE alone, and after encode -> to_lowres -> SR -> decode (what a perfect A2V
would give). Separates what the autoencoder / SR lose from what the A2V DiT loses.

``python -m bench.reconstruction --fidelity [--identities 20] [--seconds 4]`` scores the same two
chains with ``bench.fidelity`` (per-region distance, SSIM, accessory presence against ground truth,
over held-out identities, :func:`fidelity_bounds`): how much of the reference the autoencoder and
the SR keep before the A2V has drawn anything — where identity is lost (issue 15).

Who calls what: ``python -m bench.reconstruction --seconds 10`` while training. Scoring a checkpoint's
*renders* is ``bench.quality``'s model mode, which scores the frames of the real pipeline
(``bench.quality_render``: ``render()`` with a frame tap), so there is one renderer.
``LONGTAKE_EVAL_CHECKPOINT`` overrides the checkpoint (default models/checkpoints/tiny.safetensors).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.machine import machine
from bench.quality import QualityMeter, heldout_speech, require_heldout_voices
from models.avatars.dataset import FPS
from models.checkpoint import GROWN_PARTS, build_modules, load_checkpoint
from models.presets import ModelPreset, get_preset
from models.training.common import REPO_ROOT
from models.training.train_vae import vae_from_state
from models.vae import DecoderReference


def load_modules(checkpoint: Path | None = None, preset: str = "tiny", vae_state: Path | None = None
                 ) -> tuple[dict[str, torch.nn.Module], ModelPreset]:
    """The preset's modules from ``checkpoint`` (default ``$LONGTAKE_EVAL_CHECKPOINT``, else the shipped
    file), or with ``vae_state`` only the VAE, from a VAE training state (``train_vae``'s ``vae_state.pt``,
    or ``vae_final.pt``): an autoencoder scored before anything is trained on its latents (the other
    modules keep their seeded init, so only the ``vae`` chain means anything)."""
    p = get_preset(preset)
    mods = build_modules(p)
    if vae_state is not None:
        blob = torch.load(vae_state, map_location="cpu", weights_only=False)
        # a plain decoder's training state (train_vae's) in a decoder that reads the reference: its window no-op
        mods["vae"] = vae_from_state(p.vae, blob["modules"]["vae"] if "modules" in blob else blob["vae"])
    else:
        ckpt = checkpoint or Path(os.environ.get("LONGTAKE_EVAL_CHECKPOINT", "") or
                                  REPO_ROOT / "models" / "checkpoints" / f"{preset}.safetensors")
        # a checkpoint from before a part grew (a plain decoder's) scores as it computed: the part a no-op
        load_checkpoint(mods, ckpt, allow_missing=GROWN_PARTS)
    for mod in mods.values():
        mod.eval()
    return mods, p


@torch.inference_mode()
def reconstruction_report(seconds: float = 20.0, identity: int = 0, seed: int = 0,
                          checkpoint: Path | None = None) -> dict[str, float]:
    """Upper bounds of the chain on a held-out ground-truth render: lip sync r and PSNR after the VAE
    alone (encode -> decode) and after encode -> to_lowres -> SR -> decode (what a perfect A2V would
    give). Separates what the autoencoder / SR lose from what the A2V DiT loses."""
    from models.avatars.dataset import IDENTITY_SPLITS, AvatarRenderer
    from models.avatars.speech import normalize_loudness
    from models.training.data import psnr, to_unit

    mods, p = load_modules(checkpoint)
    audio = normalize_loudness(heldout_speech(seconds, seed))
    gt = AvatarRenderer(IDENTITY_SPLITS["heldout"][0] + identity, motion_seed=seed + 17)
    ref = gt.reference()
    ref_inputs = _reference(mods["vae"], to_unit(ref)[None])
    meters = {k: QualityMeter(ref, gt.reference_mouth_box(), gt.reference_face_box(), gt.reference_eyes_box())
              for k in ("gt", "vae", "sr")}
    errs: dict[str, list[float]] = {"vae": [], "sr": []}
    batch: list[np.ndarray] = []
    n = int(seconds * p.fps)

    def flush() -> None:
        x = to_unit(np.stack(batch)).transpose(0, 1)[None]  # (1, 3, T, H, W)
        for k, (y, frames) in _chains(mods, x, ref_inputs).items():
            errs[k].append(psnr(y, x))
            for f in frames:
                meters[k].add(f)
        for f in batch:
            meters["gt"].add(f)
        batch.clear()

    for frame, _truth in gt.stream(audio, num_frames=n):
        batch.append(frame)
        if len(batch) == 16:
            flush()
    if batch:
        flush()
    out: dict[str, float] = {}
    for k, meter in meters.items():
        s = meter.summary(audio, [])
        out[f"{k}_lipsync_r"] = float(s["lipsync_r"])
        out[f"{k}_face_first"] = float(s["drift_face_first"])
        out[f"{k}_background_first"] = float(s["drift_background_first"])
        if k in errs:
            out[f"{k}_psnr_db"] = round(float(np.mean(errs[k])), 2)
    return out


CHAIN_BATCH = 16  # frames encoded together (the causal VAE's chunk; its seams are the clip's seams)
CHAINS = ("vae", "sr")  # encode -> decode; encode -> to_lowres -> SR -> decode


def _reference(vae: torch.nn.Module, ref_rgb: torch.Tensor) -> tuple[torch.Tensor, DecoderReference | None]:
    """What the chains read of the reference ``ref_rgb`` (1, 3, H, W) in [-1, 1], once per clip: its hr
    latent (the SR's) and the decoder's ``reference_features`` (None for a decoder that does not read it)."""
    return vae.encode(ref_rgb[:, :, None])[:, :, 0], vae.reference_features(ref_rgb)  # type: ignore[operator]


def _chains(mods: dict[str, torch.nn.Module], x: torch.Tensor, ref: tuple[torch.Tensor, DecoderReference | None],
            names: tuple[str, ...] = ("vae", "sr"), offsets: dict[str, list[torch.Tensor]] | None = None,
            ) -> dict[str, tuple[torch.Tensor, list[np.ndarray]]]:
    """Frames ``x`` (1, 3, T, H, W) in [-1, 1] through encode -> decode ("vae") and/or encode ->
    to_lowres -> SR -> decode ("sr"), ``ref`` (:func:`_reference`) given to the SR and the decoder: each
    chain's output tensor and its uint8 frames. ``offsets``: per chain, a list that a decoder whose warp
    copies the reference appends its read to (``CausalVAE.decode(offsets=)``; ``bench.warp_error``)."""
    vae = mods["vae"]
    ref_z, ref_features = ref
    z = vae.encode(x)  # type: ignore[operator]
    outs = {name: vae.decode(z if name == "vae" else mods["sr"](vae.to_lowres(z), ref_z),  # type: ignore[operator]
                             reference=ref_features, offsets=None if offsets is None else offsets[name])[0]
            for name in names}
    return {k: (y, list(((y[0].permute(1, 2, 3, 0) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()))
            for k, y in outs.items()}


@torch.inference_mode()
def fidelity_bounds(num_identities: int = 20, seconds: float = 4.0, seed: int = 0,
                    checkpoint: Path | None = None, chains: tuple[str, ...] = CHAINS,
                    vae_state: Path | None = None, first: int = 0, *, vae: torch.nn.Module | None = None,
                    sheet: Path | None = None) -> dict[str, object]:
    """``bench.fidelity`` over the chains' outputs of the ground-truth clips (the same identities,
    audio and statistics as ``bench.quality --fidelity``; ``first``: held-out identities first..,
    as its ``--first-identity``): ``{"vae": result, "sr": result}`` (the ``chains`` asked for), each
    with its per-identity rows and aggregate (model / ground truth ratios).
    ``vae_state``: score that VAE training state instead of a checkpoint's (:func:`load_modules`;
    ``chains`` must then be ``("vae",)``); ``vae``: score this autoencoder module, likewise
    (``bench.decoder_ceiling``'s fitted ones). ``sheet``: a contact sheet of the one chain asked for."""
    if (vae_state is not None or vae is not None) and tuple(chains) != ("vae",):
        raise ValueError(f"vae_state={vae_state}, vae={type(vae).__name__}: only the vae chain can be scored "
                         f"without a checkpoint (chains={chains!r}): pass chains=('vae',) (--chains vae)")
    if sheet is not None and len(chains) != 1:
        raise ValueError(f"sheet={sheet}: one contact sheet shows one chain (chains={chains!r}): ask for one")
    from bench.fidelity import run_fidelity
    from models.avatars.dataset import AvatarRenderer
    from models.training.data import to_unit

    mods = {"vae": vae} if vae is not None else load_modules(checkpoint, vae_state=vae_state)[0]

    def chain_clip(name: str) -> Callable[[AvatarRenderer, np.ndarray], tuple[list[np.ndarray], list[int]]]:
        def clip(gt: AvatarRenderer, audio: np.ndarray) -> tuple[list[np.ndarray], list[int]]:
            ref = _reference(mods["vae"], to_unit(gt.reference())[None])
            n = math.ceil(seconds * FPS)
            truth = [frame for frame, _ in gt.stream(audio, num_frames=n)]
            out: list[np.ndarray] = []
            for i in range(0, n, CHAIN_BATCH):
                x = to_unit(np.stack(truth[i : i + CHAIN_BATCH])).transpose(0, 1)[None]
                out += _chains(mods, x, ref, (name,))[name][1]
            return out, list(range(CHAIN_BATCH, n, CHAIN_BATCH))

        return clip

    return {name: run_fidelity(num_identities, seconds, seed, None, sheet, clip_fn=chain_clip(name), first=first)
            for name in chains}


def parse_chains(p: argparse.ArgumentParser, spec: str) -> tuple[str, ...]:
    """A CLI's ``--chains``: comma-separated names of :data:`CHAINS`, refused through ``p.error``."""
    chains = tuple(c.strip() for c in spec.split(",") if c.strip())
    if not chains or set(chains) - set(CHAINS):
        p.error(f"--chains {spec!r}: give one or more of {', '.join(CHAINS)}, comma-separated")
    return chains


def main(argv: list[str] | None = None) -> int:
    import json

    p = argparse.ArgumentParser(prog="python -m bench.reconstruction", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=None,
                   help="lip sync / PSNR report: seconds of held-out speech (default 20); --fidelity: clip length (default 4)")
    p.add_argument("--fidelity", action="store_true", help="identity fidelity of the chains (bench.fidelity)")
    p.add_argument("--identities", type=int, default=20, help="--fidelity: held-out identities 0..N-1 (default 20)")
    p.add_argument("--first-identity", type=int, default=0,
                   help="--fidelity: score held-out identities K..K+N-1 instead (default 0), as bench.quality's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--markdown", action="store_true", help="--fidelity: the aggregates as Markdown tables")
    p.add_argument("--chains", default=",".join(CHAINS),
                   help="--fidelity: comma-separated chains to score, of vae (encode -> decode) and sr (encode -> "
                        "to_lowres -> SR -> decode); vae alone scores an autoencoder whose SR was not trained on it")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="the checkpoint to score (default: $LONGTAKE_EVAL_CHECKPOINT, else the shipped one)")
    p.add_argument("--vae-state", type=Path, default=None,
                   help="--fidelity --chains vae: score this VAE training state (train_vae's vae_state.pt, or "
                        "vae_final.pt) instead of a checkpoint's VAE, before anything is trained on its latents")
    a = p.parse_args(argv)
    chains = parse_chains(p, a.chains)
    if a.vae_state is not None and (not a.fidelity or chains != ("vae",)):
        p.error("--vae-state scores an autoencoder alone: use it with --fidelity --chains vae")
    from bench.fidelity import check_heldout_args, markdown_table

    if a.fidelity:
        check_heldout_args(p, a.first_identity, a.identities)
    try:
        require_heldout_voices()
    except RuntimeError as exc:
        p.error(str(exc))
    torch.set_num_threads(a.threads)
    if not a.fidelity:
        print(json.dumps({**reconstruction_report(a.seconds or 20.0, seed=a.seed, checkpoint=a.checkpoint),
                          "machine": machine()}))
        return 0
    result = fidelity_bounds(a.identities, a.seconds or 4.0, a.seed, a.checkpoint, chains, vae_state=a.vae_state,
                             first=a.first_identity)
    if a.markdown:
        for name, r in result.items():
            print(f"### {name}\n\n{markdown_table(r)}\n")
    else:
        print(json.dumps({**{k: v["aggregate"] for k, v in result.items()}, "machine": machine()}))  # type: ignore[index]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
