"""The ``wan`` family's models at the 14B and 1.3B shapes on one GPU: the figures to put beside
SoulX-FlashTalk (0.87 s to first frame, 32 fps on 8×H800 at 768×448) and LiveTalk (0.33 s, 24.8 fps,
one GPU, 1.3B).

    python -m bench.gpu_wan --json                                  # GPU: 14b and 1.3b × 480p and 720p
    python -m bench.gpu_wan --device cpu --shapes tiny --json       # the CPU fallback (tiny shapes)

One JSON line per case (shape × bucket). Random weights built on the device in the preset's dtype
(bf16 for 14b / 1.3b; the VAE in float32, as the family runs it), the reference a 768×448 portrait
(FlashTalk's size), so the bucket is the one the family picks for it: 480p → 832×448, 720p → 1280×704.
Each component is timed on the device (synchronised; one warm-up, then the median of ``--repeats``):

* ``dit_step_s``: one DiT forward (= one sampling step with ``--branches 1``, i.e. no guidance, as the
  distilled FlashTalk; 3 = InfiniteTalk's text + audio guidance batched) on an N chunk's window
  (``L + C`` latents), also ``dit_step_n0_s`` (``L``) and ``dit_step_i_s`` (an I chunk, ``e + 2``);
* ``audio_tokens_s`` (the DiT's audio projection, once per chunk), ``setup_s`` (once per job: VAE
  encode of the reference and of the padding frames, CLIP, umT5 of prompt + negative, the DiT's
  context embedding);
* ``decode_first_s`` (emission 0: ``L`` latents → ``1 + 4(L − 1)`` frames) and ``decode_chunk_s``
  (a later emission, ``4L`` frames, through the causal cache).

From them, on the family's schedule (N0 → N1 → I0 → N2 → I1 …; each later emission needs one N and
one I chunk): ``ttff_s = setup + steps·dit_n0 + audio_tokens + decode_first`` and ``fps = 4L /
(steps·(dit_n + dit_i) + 2·audio_tokens + decode_chunk)`` — stages run one after the other (the
emission lane's overlap of decode with the next step is not counted, so fps is a lower bound);
wav2vec2 (95 M parameters, once per chunk) is not included. ``peak_device_bytes``: the CUDA
allocator's peak after setup, umT5 and CLIP parked on the host as the family does (DiT + VAE +
activations; CPU: the process's peak RSS). These are model figures on one GPU,
not a served render.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

BUCKETS = {"480p": "", "720p": "-720p"}
REFERENCE_HW = (768, 448)  # FlashTalk's portrait size


def preset_name(shape: str, bucket: str) -> str:
    return "tiny" if shape == "tiny" else f"{shape}{BUCKETS[bucket]}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up, synchronised on ``device``."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def run_case(shape: str, bucket: str, *, device: str, steps: int, branches: int, repeats: int,
             seed: int = 0) -> dict[str, object]:
    from models.wan.config import dit_preset
    from pipeline.families.wan.family import build_module
    from pipeline.families.wan.presets import PRESETS, WAN_NEGATIVE_PROMPT
    from pipeline.host import peak_rss_bytes

    dev = torch.device(device)
    p = PRESETS[preset_name(shape, bucket)]
    h, w = p.bucket(REFERENCE_HW)
    cfg = dit_preset(p.dit_shape)
    L, C, e = p.chunk_frames, p.context_frames, p.interp_frames
    t_build = time.perf_counter()
    with dev:
        mods = {name: build_module(p, name, None, seed).eval() for name in ("dit", "vae", "text", "image")}
    _sync(dev)
    build_s = time.perf_counter() - t_build
    dit, vae, text, image = mods["dit"], mods["vae"], mods["text"], mods["image"]
    g = torch.Generator(dev).manual_seed(seed)
    lh, lw = h // 8, w // 8
    z = cfg.out_dim

    ref_B3HW = torch.rand(1, 3, h, w, device=dev, generator=g) * 2 - 1

    def setup() -> tuple[torch.Tensor, torch.Tensor]:
        vae.encode(ref_B3HW[:, :, None])
        gray = torch.cat([ref_B3HW[:, :, None], torch.zeros(1, 3, 8, h, w, device=dev)], 2)
        vae.encode(gray)
        clip = image.encode(ref_B3HW).float()
        prompt, negative = text(["a person talking", WAN_NEGATIVE_PROMPT])
        n = max(prompt.shape[0], negative.shape[0])
        text_BND = torch.stack([torch.nn.functional.pad(s, (0, 0, 0, n - s.shape[0])) for s in (prompt, negative)])
        return dit.embed_context(text_BND.float(), clip)  # type: ignore[no-any-return]

    setup_s = timed(setup, dev, max(1, repeats // 2))
    text_ctx, image_ctx = setup()
    if dev.type == "cuda":  # as the family: umT5 and CLIP parked after setup; the peak from here on
        text.to("cpu"), image.to("cpu")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    ctx = (text_ctx[[0] * branches], image_ctx.expand(branches, *image_ctx.shape[1:]))

    def window(t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        frames = 1 + cfg.vae_scale * (t - 1)
        audio = torch.randn(1, frames, cfg.audio_window, cfg.audio_layers, cfg.audio_channels, device=dev, generator=g)
        x = torch.randn(branches, z, t, lh, lw, device=dev, generator=g)
        cond = torch.randn(branches, cfg.in_dim - z, t, lh, lw, device=dev, generator=g)
        return audio, x, cond

    def dit_step(t: int) -> float:
        audio, x, cond = window(t)
        tokens = dit.audio_tokens(audio).expand(branches, -1, -1, -1)
        ts = torch.full((branches,), 500.0, device=dev)
        return timed(lambda: dit(x, cond, ts, ctx, tokens), dev, repeats)

    dit_n0, dit_n, dit_i = dit_step(L), dit_step(L + C), dit_step(e + 2)
    audio_win = window(L + C)[0]
    audio_tokens_s = timed(lambda: dit.audio_tokens(audio_win), dev, repeats)

    lat = torch.randn(1, z, L, lh, lw, device=dev, generator=g)

    def decode_first() -> None:
        vae.decode_chunk(lat, vae.new_cache())

    def decode_later() -> None:
        cache = vae.new_cache()
        vae.decode_chunk(lat, cache)
        _sync(dev)
        t0 = time.perf_counter()
        vae.decode_chunk(lat, cache)
        _sync(dev)
        later.append(time.perf_counter() - t0)

    decode_first_s = timed(decode_first, dev, repeats)
    later: list[float] = []
    decode_later()
    for _ in range(repeats):
        decode_later()
    decode_chunk_s = statistics.median(later[1:])

    ttff = setup_s + steps * dit_n0 + audio_tokens_s + decode_first_s
    per_emission = steps * (dit_n + dit_i) + 2 * audio_tokens_s + decode_chunk_s
    fps = cfg.vae_scale * L / per_emission
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else peak_rss_bytes()
    return {
        "shape": shape, "bucket": bucket if shape != "tiny" else "tiny", "preset": p.name, "height": h, "width": w,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(next(dit.parameters()).dtype).removeprefix("torch."), "steps": steps, "branches": branches,
        "chunk": {"L": L, "C": C, "e": e}, "tokens_per_n_window": (L + C) * (lh // 2) * (lw // 2),
        "build_s": build_s, "setup_s": setup_s, "dit_step_s": dit_n, "dit_step_n0_s": dit_n0, "dit_step_i_s": dit_i,
        "audio_tokens_s": audio_tokens_s, "decode_first_s": decode_first_s, "decode_chunk_s": decode_chunk_s,
        "frames_per_emission": cfg.vae_scale * L, "ttff_s": ttff, "fps": fps, "realtime_factor": fps / p.fps,
        "peak_device_bytes": peak, "dit_parameters": sum(q.numel() for q in dit.parameters()),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_wan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="14b,1.3b", help="comma-separated: 14b, 1.3b, tiny")
    ap.add_argument("--buckets", default="480p,720p", help="comma-separated: 480p, 720p (tiny: its own)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--branches", type=int, choices=(1, 2, 3), default=1,
                    help="DiT batch per step: 1 = no guidance (FlashTalk), 3 = text + audio guidance (InfiniteTalk)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON line per case (default: indented)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        from pipeline.host import default_threads

        torch.set_num_threads(default_threads())
    shapes = args.shapes.split(",")
    buckets = args.buckets.split(",")
    for shape in shapes:
        for bucket in buckets if shape != "tiny" else buckets[:1]:
            result = run_case(shape, bucket, device=args.device, steps=args.steps, branches=args.branches,
                              repeats=args.repeats)
            print(json.dumps(result) if args.json else json.dumps(result, indent=2), flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
