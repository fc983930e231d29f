"""Train the whole ``tiny`` family within a wall-clock budget and write the shipped checkpoint.

``python -m models.training.train_all --minutes-budget 75`` runs, each stage resumable (rerun the
same command after an interruption; finished stages are skipped because their budget is spent):

1. VAE on random frames of train identities (``train_vae``), then the latent channels are rescaled to
   unit variance (``finalize_vae``) and frozen;
2. latent cache: speech clips of train identities encoded once (``data.build_latent_cache``);
3. A2V DiT + audio encoder with flow matching (``train_a2v``);
4. SR (``train_sr``);
5. the VAE decoder alone, encoder frozen (``train_decoder``; it does not change the latents, so it
   may also run in parallel with 3-4, see docs/training.md);
6. the decoder again, on the frozen SR model's outputs (``chain_decoder``: what the pipeline decodes);
7. ``assemble_checkpoint``: EMA weights of every trained module, the text encoder at its seeded
   init, into ``models/checkpoints/<preset>.safetensors`` with metadata (steps, losses, seed, commit).

``--stage reuse-vae --from CKPT`` replaces 1: the VAE (encoder and decoder) of an earlier checkpoint
of the same preset becomes ``vae_final.pt``, and its ``vae_*`` metadata is carried into the new
checkpoint. The VAE does not depend on the A2V / SR shapes, so a change there (``lowres_factor``,
the window kinds) retrains only stages 2-7.

``--stage export-vae --out FILE`` writes the VAE this cache trained (stage 1, rescaled) alone, as a
checkpoint of the one module ``vae`` with its ``vae_*`` metadata: a new autoencoder that a retrain on
its latents starts from on another machine or in a later session (``--stage reuse-vae --from FILE``;
``models/training/gpu_continue.sh`` with ``VAE_STATE=FILE``), a few MB instead of the optimizer state.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch

from models.checkpoint import GROWN_PARTS, build_modules, load_checkpoint, save_checkpoint
from models.presets import ModelPreset, get_preset
from models.training.common import (
    DEFAULT_CACHE,
    REPO_ROOT,
    TrainState,
    checkpoint_label,
    git_commit,
    setup_logging,
)
from models.training.data import build_latent_cache
from models.training.train_a2v import train_a2v
from models.training.train_sr import train_sr
from models.training.train_vae import (
    DECODER_LR,
    DECODER_SR_NOISE,
    finalize_vae,
    train_decoder,
    train_vae,
    vae_from_state,
    without_reference,
)
from models.vae import CausalVAE

log = logging.getLogger(__name__)

# share of the budget per stage (the cache build is not budgeted: its size is fixed by the clip count)
SHARES = {"vae": 0.2, "a2v": 0.45, "sr": 0.15, "decoder": 0.1, "chain": 0.1}


def save_final_vae(path: Path, state_dict: dict[str, torch.Tensor], from_state_step: int | None) -> None:
    """Write ``vae_final.pt`` atomically (temp file + rename: cache workers started together each
    compute the same rescale, and none reads another's half-written file), with its source: the step
    of this cache's ``vae_state.pt`` it was rescaled from, or ``None`` for a VAE reused from a checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save({"vae": state_dict, "from_state_step": from_state_step}, tmp)
    os.replace(tmp, path)


def _final_vae_file(preset: ModelPreset, cache_dir: Path) -> tuple[dict[str, torch.Tensor], int | None]:
    """``vae_final.pt``'s state dict and source (the ``vae_state.pt`` step, ``None`` if reused), rescaled from
    ``vae_state.pt`` first if it does not exist yet. One rescaled from an earlier step of
    ``vae_state.pt`` than the state holds now (the VAE trained on after the latents were cached) is an
    error, not silently used: the latent cache and anything trained on it came from that older VAE, so
    the fix is a new cache (the message says which files to delete)."""
    path, state_path = cache_dir / "vae_final.pt", cache_dir / "vae_state.pt"
    if not path.is_file():
        vae = CausalVAE(without_reference(preset.vae))  # train_vae trains a decoder that reads no reference
        blob = torch.load(state_path, map_location="cpu", weights_only=False)
        vae.load_state_dict(blob["modules"]["vae"])
        scales = finalize_vae(vae, preset)
        log.info("vae latent channel scales folded in: %s", [round(float(s), 4) for s in scales])
        save_final_vae(path, vae.state_dict(), TrainState(**blob["state"]).step)
    final = torch.load(path, map_location="cpu")
    if "vae" not in final:
        raise ValueError(f"{path} is a bare state dict written before vae_final.pt recorded its source: "
                         f"delete it and {cache_dir / 'latents'}, {cache_dir / 'heldout_latents'} and run "
                         "--stage reuse-vae or the VAE stage and the cache stages again")
    made_from = final["from_state_step"]
    if made_from is not None and state_path.is_file() and (now := _state(state_path).step) != made_from:
        raise RuntimeError(
            f"{path} was rescaled from step {made_from} of {state_path}, which is now at step {now} (the "
            "VAE trained on): its latents are not this VAE's. Delete vae_final.pt, latents/ and "
            f"heldout_latents/ in {cache_dir} and run the cache stages again, or train the VAE in a new "
            "cache dir")
    return final["vae"], made_from


def final_vae(preset: ModelPreset, cache_dir: Path) -> CausalVAE:
    """The trained, rescaled VAE the cache's latents are encoded with (:func:`_final_vae_file`); a decoder
    window and gate it lacks (a plain decoder's weights) start as no-ops (:func:`vae_from_state`)."""
    return vae_from_state(preset.vae, _final_vae_file(preset, cache_dir)[0]).eval().requires_grad_(False)


def chain_decoder(preset: ModelPreset, cache_dir: Path, minutes: float, seed: int, *, detail_weight: float = 0.0,
                  base: Path | None = None, lr: float = DECODER_LR, sr_noise: float = DECODER_SR_NOISE,
                  motion_weight: float = 0.0) -> dict[str, float]:
    """Last VAE stage: the decoder (from the decoder-only stage if it ran) fine-tuned on the frozen
    EMA SR model's outputs, i.e. on exactly what the pipeline decodes. The SR is this run's
    (``sr_state.pt``) or, when this run trained none, ``base``'s: with ``--stage reuse-vae --from
    BASE`` first, that fine-tunes a shipped checkpoint's decoder alone (its encoder, so its A2V and
    SR stay valid)."""
    state = cache_dir / "vae_chain_state.pt"
    vae = final_vae(preset, cache_dir)
    dec_state = cache_dir / "vae_decoder_state.pt"
    reused = cache_dir / "vae_reused.json"
    init_from = ""  # where a fresh run's decoder comes from, when not from this run's own stages
    if not state.is_file() and dec_state.is_file():
        vae.load_state_dict(torch.load(dec_state, map_location="cpu", weights_only=False)["modules"]["vae"])
    elif not state.is_file() and reused.is_file():  # a reused checkpoint's decoder, trained on here
        m = json.loads(reused.read_text())
        init_from = m["vae_reused_from"] + (
            f": its chain decoder, {m['vae_chain_steps']} steps, {m.get('vae_chain_minutes', '?')} min, held-out "
            f"PSNR {m.get('chain_heldout_psnr_db', '?')} dB" if "vae_chain_steps" in m else "")
    sr = build_modules(preset, seed)["sr"]
    sr_state = cache_dir / "sr_state.pt"
    if sr_state.is_file():
        sr.load_state_dict(torch.load(sr_state, map_location="cpu", weights_only=False)["modules"]["ema_sr"])
    elif base is not None:
        load_checkpoint({"sr": sr}, base, preset=preset.name, allow_missing=GROWN_PARTS)
    else:
        raise FileNotFoundError(f"{sr_state} does not exist: train the SR first (train_sr), or pass --from "
                                "CHECKPOINT to fine-tune the decoder on that checkpoint's SR")
    sr.eval().requires_grad_(False)
    return train_decoder(preset, vae, state, minutes=minutes, seed=seed, sr=sr, detail_weight=detail_weight, lr=lr,
                         sr_noise=sr_noise, init_from=init_from, motion_weight=motion_weight)


def reuse_vae(preset: ModelPreset, cache_dir: Path, checkpoint: Path) -> None:
    """Stage 1 from an earlier checkpoint: its VAE weights -> ``vae_final.pt``, its VAE metadata ->
    ``vae_reused.json`` (read by :func:`assemble_checkpoint`)."""
    vae = CausalVAE(preset.vae)
    # strict but for parts grown since (a decoder window starts as a no-op): a VAE of another shape is an
    # error here, not at assembly
    meta = load_checkpoint({"vae": vae}, checkpoint, preset=preset.name, allow_missing=GROWN_PARTS)
    if (cache_dir / "vae_state.pt").is_file():
        log.warning("%s: the VAE reused from %s replaces the one trained here", cache_dir, checkpoint)
    save_final_vae(cache_dir / "vae_final.pt", vae.state_dict(), None)
    # every VAE figure, the decoder stages' too: these are the decoder weights reused; a decoder stage
    # run on top replaces them at assembly
    carried = {k: v for k, v in meta.items() if k.startswith(("vae_", "chain_"))}
    carried["vae_reused_from"] = checkpoint_label(checkpoint, meta)
    (cache_dir / "vae_reused.json").write_text(json.dumps(carried, indent=1))
    log.info("vae reused from %s: %s", checkpoint, carried)


DECODER_META = ("vae_decoder", "vae_chain", "chain_")  # metadata of the decoder-only stages


def _state(path: Path) -> TrainState:
    blob = torch.load(path, map_location="cpu", weights_only=False)
    return TrainState(**blob["state"])


def assemble_checkpoint(preset: ModelPreset, cache_dir: Path, out: Path, seed: int,
                        extra_meta: dict[str, str] | None = None, base: Path | None = None) -> dict[str, str]:
    """Collect the trained weights (EMA where kept) into one safetensors checkpoint; returns metadata.

    With ``base`` (a checkpoint of the same preset) every module this run did not train (no
    ``a2v_state.pt``: A2V and audio; no ``sr_state.pt``: SR) keeps ``base``'s weights, and ``base``'s
    metadata for them is carried; without it every stage must have run."""
    mods = build_modules(preset, seed)
    base_meta = (load_checkpoint(mods, base, preset=preset.name, allow_missing=GROWN_PARTS)
                 if base is not None else {})
    # the decoder stages, in order (same encoder weights): fine-tuned after the encoder froze, then on
    # SR outputs; the last one that ran holds the shipped VAE. Each state file is read once.
    vae_sd = None
    decoder_meta: dict[str, str] = {}
    for path in (cache_dir / "vae_decoder_state.pt", cache_dir / "vae_chain_state.pt"):
        if not path.is_file():
            continue
        blob = torch.load(path, map_location="cpu", weights_only=False)
        vae_sd, st = blob["modules"]["vae"], TrainState(**blob["state"])
        psnr = f"{st.extra.get('heldout_psnr_db', float('nan')):.2f}"
        if path.name == "vae_decoder_state.pt":
            stage = "vae_decoder"
            decoder_meta |= {"vae_decoder_steps": str(st.step), "vae_decoder_minutes": f"{st.elapsed_s / 60:.1f}",
                             "vae_decoder_heldout_psnr_db": psnr}
        else:
            stage = "vae_chain"
            decoder_meta |= {"vae_chain_steps": str(st.step), "vae_chain_minutes": f"{st.elapsed_s / 60:.1f}",
                             "chain_heldout_psnr_db_start": f"{st.extra.get('start_psnr_db', float('nan')):.2f}",
                             "chain_heldout_psnr_db": psnr,
                             "vae_chain_detail_weight": f"{st.extra.get('detail_weight', 0.0):g}"}
        decoder_meta |= {f"{stage}_{k}": f"{st.extra[k]:g}" for k in ("lr", "sr_noise", "motion_weight")
                         if k in st.extra}
        if st.init_from:
            decoder_meta[f"{stage}_init_from"] = st.init_from
    mods["vae"].load_state_dict(vae_sd if vae_sd is not None else final_vae(preset, cache_dir).state_dict())
    trained: dict[str, str] = {}
    for name in ("a2v", "sr"):
        path = cache_dir / f"{name}_state.pt"
        if not path.is_file():
            if base is None:
                raise FileNotFoundError(f"{path} does not exist: train it first, or pass --from CHECKPOINT to "
                                        f"keep that checkpoint's {name}")
            trained.update({k: v for k, v in base_meta.items() if k.startswith(f"{name}_")})
            continue
        blob = torch.load(path, map_location="cpu", weights_only=False)
        st = TrainState(**blob["state"])
        if name == "a2v":
            mods["a2v"].load_state_dict(blob["modules"]["ema_a2v"])
            mods["audio"].load_state_dict(blob["modules"]["ema_audio"])
            trained.update({"a2v_steps": str(st.step), "a2v_minutes": f"{st.elapsed_s / 60:.1f}",
                            "a2v_final_loss": f"{st.losses[-1]:.4f}" if st.losses else "nan",
                            "a2v_mouth_weight": f"{st.extra.get('mouth_weight', 0.0):g}"})
            trained.update({f"a2v_{k}": f"{st.extra[k]:g}" for k in ("batch_n", "batch_i", "lr") if k in st.extra})
            if "heldout_loss" in st.extra:
                trained["a2v_heldout_loss"] = f"{st.extra['heldout_loss']:.4f}"
            if st.init_from:
                trained["a2v_init_from"] = st.init_from
        else:
            mods["sr"].load_state_dict(blob["modules"]["ema_sr"])
            trained.update({"sr_steps": str(st.step), "sr_minutes": f"{st.elapsed_s / 60:.1f}",
                            "sr_eval_l1": f"{st.extra.get('eval_l1', float('nan')):.4f}",
                            "sr_detail_weight": f"{st.extra.get('detail_weight', 0.0):g}",
                            "sr_feature_weight": f"{st.extra.get('feature_weight', 0.0):g}",
                            "sr_reference_share": f"{st.extra.get('reference_share', 0.0):g}",
                            "sr_feature_blur": f"{st.extra.get('feature_blur', 0.0):g}"})
            trained.update({f"sr_{k}": f"{st.extra[k]:g}" for k in ("batch", "lr", "pixel_weight") if k in st.extra})
            if st.init_from:
                trained["sr_init_from"] = st.init_from
    reused = cache_dir / "vae_reused.json"
    if reused.is_file():
        vae_meta: dict[str, str] = json.loads(reused.read_text())
        if decoder_meta:  # this run retrained the reused decoder: the reused checkpoint's decoder figures go
            # (what a chain stage started from is its vae_chain_init_from)
            vae_meta = {k: v for k, v in vae_meta.items() if not k.startswith(DECODER_META)}
    else:
        vae_meta = trained_vae_metadata(cache_dir)
    meta = {
        **_provenance(preset, seed),
        **vae_meta,
        **decoder_meta,
        **trained,
        **({"base_checkpoint": checkpoint_label(base, base_meta)} if base is not None else {}),
        **(extra_meta or {}),
    }
    save_checkpoint(mods, out, metadata=meta)
    log.info("checkpoint written: %s (%.1f MB) %s", out, out.stat().st_size / 1e6, json.dumps(meta))
    return meta


def _provenance(preset: ModelPreset, seed: int) -> dict[str, str]:
    return {"preset": preset.name, "seed": str(seed), "git_commit": git_commit(),
            "trained_on": "synthetic avatars (models.avatars), train identities [0, 1e6), train voices"}


def trained_vae_metadata(cache_dir: Path) -> dict[str, str]:
    """The ``vae_*`` figures of the VAE stage 1 trained in ``cache_dir`` (its ``vae_state.pt``)."""
    st = _state(cache_dir / "vae_state.pt")
    return {"vae_steps": str(st.step), "vae_minutes": f"{st.elapsed_s / 60:.1f}",
            "vae_heldout_psnr_db": f"{st.extra.get('heldout_psnr_db', float('nan')):.2f}",
            "vae_detail_weight": f"{st.extra.get('detail_weight', 0.0):g}",
            "vae_kl_weight": f"{st.extra.get('kl_weight', 1e-5):g}",
            "vae_scale_equivariance": f"{st.extra.get('scale_equivariance', 0.0):g}"}


def export_vae(preset: ModelPreset, cache_dir: Path, out: Path, seed: int) -> dict[str, str]:
    """Write the VAE stage 1 trained in ``cache_dir`` (rescaled: :func:`final_vae`) alone into ``out``,
    a checkpoint of the module ``vae`` that ``--stage reuse-vae --from out`` reads; returns its
    metadata. Refuses a cache whose VAE was itself reused (nothing trained here to export, or a VAE
    trained after reuse-vae, which the cache's latents are not of)."""
    if not (cache_dir / "vae_state.pt").is_file():
        raise FileNotFoundError(
            f"{cache_dir / 'vae_state.pt'} does not exist: export-vae writes a VAE trained in this cache dir "
            "(models.training.train_vae --cache-dir ...); a reused one is already a checkpoint")
    state_dict, made_from = _final_vae_file(preset, cache_dir)
    if made_from is None:
        raise ValueError(f"{cache_dir / 'vae_final.pt'} is a VAE reused from a checkpoint (--stage reuse-vae), "
                         "not the one trained here: export from a cache dir without reuse-vae, or delete "
                         "vae_final.pt and the latent caches there")
    vae = vae_from_state(preset.vae, state_dict)
    meta = {**_provenance(preset, seed), **trained_vae_metadata(cache_dir)}
    save_checkpoint({"vae": vae}, out, metadata=meta)
    log.info("vae written: %s (%.1f MB) %s", out, out.stat().st_size / 1e6, json.dumps(meta))
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=["all", "reuse-vae", "cache", "heldout-cache", "decoder", "chain", "assemble",
                                       "export-vae"],
                   default="all",
                   help="run one stage only (cache: --worker/--num-workers build shards in parallel; heldout-cache: "
                        "the same of held-out identities and voices in CACHE_DIR/heldout_latents, for "
                        "train_a2v --heldout-cache; "
                        "reuse-vae: the VAE of --from instead of training one; export-vae: the VAE trained in "
                        "CACHE_DIR alone into --out, for reuse-vae elsewhere)")
    p.add_argument("--from", dest="from_checkpoint", type=Path, default=None,
                   help="reuse-vae: the checkpoint whose VAE to reuse; chain: its SR when this run trained "
                        "none; assemble: its weights for every module this run did not train")
    p.add_argument("--detail-weight", type=float, default=0.0,
                   help="VAE, decoder and chain stages: extra loss weight on the face's small features")
    p.add_argument("--stage-minutes", type=float, default=None, help="with --stage decoder: its own budget")
    p.add_argument("--lr", type=float, default=DECODER_LR,
                   help="decoder and chain stages: peak learning rate (cosine, no warm-up)")
    p.add_argument("--sr-noise", type=float, default=DECODER_SR_NOISE,
                   help="chain stage: the SR's input gets noise of a std drawn uniformly in [0, this)")
    p.add_argument("--motion-weight", type=float, default=0.0,
                   help="decoder and chain stages, a decoder whose warp copies the reference: weight of the loss "
                        "on where the warp reads against the head's true motion (the generator's; 0: off)")
    p.add_argument("--worker", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--minutes-budget", type=float, default=75.0, help="training wall time (cache build excluded)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--out", type=Path, default=None,
                   help="default models/checkpoints/<preset>.safetensors (export-vae: required)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clips", type=int, default=160, help="speech clips in the latent cache")
    p.add_argument("--clip-frames", type=int, default=36)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    preset = get_preset(a.preset)
    setup_logging(a.cache_dir / "train.log")
    torch.set_num_threads(a.threads)
    t0 = time.monotonic()
    out = a.out or REPO_ROOT / "models" / "checkpoints" / f"{preset.name}.safetensors"
    extra = {"latent_clips": str(a.clips), "clip_frames": str(a.clip_frames)}
    if a.stage == "reuse-vae":
        if a.from_checkpoint is None:
            p.error("--stage reuse-vae needs --from CHECKPOINT (an earlier checkpoint of the same preset)")
        reuse_vae(preset, a.cache_dir, a.from_checkpoint)
        return 0
    if a.stage == "export-vae":
        if a.out is None:  # never the shipped checkpoint's path by default: a VAE alone would replace it
            p.error("--stage export-vae needs --out FILE (the VAE alone; not the shipped checkpoint)")
        export_vae(preset, a.cache_dir, a.out, a.seed)
        return 0
    if a.stage in ("cache", "heldout-cache"):
        held = a.stage == "heldout-cache"
        build_latent_cache(final_vae(preset, a.cache_dir), a.cache_dir / ("heldout_latents" if held else "latents"),
                           a.clips, a.clip_frames, split="heldout" if held else "train", seed=a.seed,
                           size=preset.height, worker=a.worker, num_workers=a.num_workers)
        return 0
    if a.stage == "decoder":
        train_decoder(preset, final_vae(preset, a.cache_dir), a.cache_dir / "vae_decoder_state.pt",
                      minutes=a.stage_minutes or a.minutes_budget * SHARES["decoder"], seed=a.seed,
                      detail_weight=a.detail_weight, lr=a.lr, motion_weight=a.motion_weight)
        return 0
    if a.stage == "chain":
        chain_decoder(preset, a.cache_dir, a.stage_minutes or a.minutes_budget * SHARES["chain"], a.seed,
                      detail_weight=a.detail_weight, base=a.from_checkpoint, lr=a.lr, sr_noise=a.sr_noise,
                      motion_weight=a.motion_weight)
        return 0
    if a.stage == "assemble":
        assemble_checkpoint(preset, a.cache_dir, out, a.seed, extra, base=a.from_checkpoint)
        return 0
    train_vae(preset, a.cache_dir / "vae_state.pt", minutes=a.minutes_budget * SHARES["vae"], seed=a.seed,
              detail_weight=a.detail_weight)
    vae = final_vae(preset, a.cache_dir)
    build_latent_cache(vae, a.cache_dir / "latents", a.clips, a.clip_frames, seed=a.seed, size=preset.height)
    t_cache = time.monotonic()
    train_a2v(preset, a.cache_dir / "latents", a.cache_dir / "a2v_state.pt",
              minutes=a.minutes_budget * SHARES["a2v"], seed=a.seed)
    train_sr(preset, a.cache_dir / "latents", a.cache_dir / "sr_state.pt",
             minutes=a.minutes_budget * SHARES["sr"], seed=a.seed)
    train_decoder(preset, final_vae(preset, a.cache_dir), a.cache_dir / "vae_decoder_state.pt",
                  minutes=a.minutes_budget * SHARES["decoder"], seed=a.seed, detail_weight=a.detail_weight,
                  motion_weight=a.motion_weight)
    chain_decoder(preset, a.cache_dir, a.minutes_budget * SHARES["chain"], a.seed, detail_weight=a.detail_weight,
                  motion_weight=a.motion_weight)
    assemble_checkpoint(preset, a.cache_dir, out, a.seed, extra)
    log.info("train_all finished in %.1f min (this invocation; cache build ended at %.1f min)",
             (time.monotonic() - t0) / 60, (t_cache - t0) / 60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
