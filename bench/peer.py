"""longtake's ``wan`` family beside diffusers' conventional Wan image-to-video pipeline, same weights.

    python -m bench.peer --seconds 1,4,16 --json          # a tiny release written to a temp dir
    python -m bench.peer --weights DIR --seconds 1 --json  # an existing tiny release (tiny_release.py)

Both sides load the SAME files: the tiny InfiniteTalk release of :mod:`models.wan.tiny_release` (public
layout). diffusers gets them the way ``tests/wan`` maps them: the base DiT shards through diffusers' own
``convert_wan_transformer_to_diffusers`` into ``WanTransformer3DModel`` (the audio layers left out — the
conventional pipeline has none), the VAE / umT5 / CLIP through the ``models.wan`` loaders (whose inner
modules *are* diffusers' ``AutoencoderKLWan`` and transformers' ``UMT5EncoderModel`` / ``CLIPVisionModel``),
the release's tokenizer. ``WanImageToVideoPipeline`` then makes all ``N = 4k + 1`` frames in one
latent video and decodes it whole; longtake renders the same length in chunks, streaming.

What is compared, per case (each side in a fresh process, alternated, same torch threads): making a
video of ``N`` frames from the reference at the same resolution, same number of sampling steps, no
classifier-free guidance on either side (``guidance_scale=1``; longtake ``text_guidance =
audio_guidance = 1``: one DiT forward per step on both), both writing an MP4 with the audio track
through the same x264 encoder (``pipeline.encode.FragmentEncoder``, ``veryfast``). longtake's audio path
is INCLUDED (wav2vec2 features per chunk and the DiT's audio cross-attention, which diffusers does not
compute) and so are its chunk overlaps (C context latents and the I chunks), so longtake does more
DiT work per frame than the single-clip pipeline: the comparison is conservative for longtake.

Fields: ``ttff_s`` (process's t0 — before any model is built — to the first frame: longtake's first
fragment in its sink; diffusers' return of ``pipe()`` with every frame in memory, before encoding, which
favours diffusers), ``wall_s`` (t0 to the MP4 closed), ``peak_rss_bytes`` (``VmHWM``), ``fps`` (frames /
wall), ``frames``, ``video_s``. ``--compare`` (the default with several ``--seconds``) prints one JSON
object per case with both sides and the diffusers / longtake ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench.inputs import DEMO_IMAGE, speech_wav

SIDES = ("longtake", "diffusers")
PROMPT = "w1 w2 w3"  # words of the tiny release's tokenizer


def diffusers_frames(seconds: float, fps: int = 25) -> int:
    """The ``4k + 1`` frame count diffusers' Wan I2V pipeline takes that covers ``seconds`` of video."""
    n = max(1, round(seconds * fps))
    return 4 * -(-(n - 1) // 4) + 1


def build_diffusers_pipeline(weights: Path) -> object:
    """``WanImageToVideoPipeline`` over the tiny release under ``weights`` (no audio layers)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    try:  # transformers 5 without torchvision: the PIL backend (the same preprocessing)
        from transformers import CLIPImageProcessorPil as CLIPImageProcessor
    except ImportError:  # pragma: no cover - older transformers
        from transformers import CLIPImageProcessor  # type: ignore[assignment]

    from models.wan.clip import load_clip_vision
    from models.wan.config import TINY_SHAPES, WanDiTConfig
    from models.wan.text import load_umt5
    from models.wan.tiny_release import is_audio_key
    from models.wan.vae import load_wan_vae

    base = Path(weights) / "Wan2.1-I2V-14B-480P"
    cfg = WanDiTConfig.from_wan_json(base / "config.json")
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(base.glob("diffusion_pytorch_model-*.safetensors")):
        state.update({k: v for k, v in load_file(str(shard)).items() if not is_audio_key(k)})
    transformer = WanTransformer3DModel(
        patch_size=cfg.patch_size, num_attention_heads=cfg.num_heads, attention_head_dim=cfg.head_dim,
        in_channels=cfg.in_dim, out_channels=cfg.out_dim, text_dim=cfg.text_dim, freq_dim=cfg.freq_dim,
        ffn_dim=cfg.ffn_dim, num_layers=cfg.num_layers, cross_attn_norm=cfg.cross_attn_norm,
        qk_norm="rms_norm_across_heads", eps=cfg.eps, image_dim=cfg.image_dim, added_kv_proj_dim=cfg.dim)
    transformer.load_state_dict(convert_wan_transformer_to_diffusers(state), strict=True)
    clip = load_clip_vision(base, dtype=torch.float32, config=TINY_SHAPES["clip"]).model
    size = int(clip.config.image_size)
    return WanImageToVideoPipeline(
        tokenizer=AutoTokenizer.from_pretrained(str(base / "google" / "umt5-xxl"), local_files_only=True),
        text_encoder=load_umt5(base, dtype=torch.float32, config=TINY_SHAPES["t5"]).model,
        vae=load_wan_vae(base, dtype=torch.float32, config=TINY_SHAPES["vae"]).vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        image_processor=CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}),
        image_encoder=clip, transformer=transformer.eval())


def prompt_embeds(pipe: object, prompt: str) -> object:
    """The umT5 states ``WanImageToVideoPipeline._get_t5_prompt_embeds`` computes, without its
    ``ftfy`` text clean-up (an optional dependency not installed here; a no-op on this ASCII prompt):
    tokens padded to 512, states trimmed at the mask and zero-padded back, as diffusers does."""
    import torch

    tok = pipe.tokenizer(prompt, padding="max_length", max_length=512, truncation=True,  # type: ignore[attr-defined]
                         add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    states = pipe.text_encoder(tok.input_ids, tok.attention_mask).last_hidden_state  # type: ignore[attr-defined]
    n = int(tok.attention_mask.sum())
    return torch.cat([states[:, :n], states.new_zeros(1, 512 - n, states.shape[-1])], dim=1)


def run_diffusers(weights: Path, preset: str, seconds: float, steps: int, seed: int, tmp: Path) -> dict[str, object]:
    import numpy as np
    import torch
    from PIL import Image

    from pipeline.encode import FragmentEncoder
    from pipeline.families import FAMILIES
    from pipeline.families.wan.presets import PRESETS
    from pipeline.inputs import AudioSource

    audio = speech_wav(tmp / "speech.wav", seconds, seed=seed)
    image = Image.open(DEMO_IMAGE).convert("RGB")
    height, width = FAMILIES.get("wan").output_size(PRESETS[preset], (image.height, image.width))
    num_frames = diffusers_frames(seconds)
    t0 = time.perf_counter()
    pipe = build_diffusers_pipeline(weights)
    pipe.set_progress_bar_config(disable=True)  # type: ignore[attr-defined]
    with torch.no_grad():
        embeds = prompt_embeds(pipe, PROMPT)
        video = pipe(image=image.resize((width, height)), prompt_embeds=embeds, height=height,  # type: ignore[operator]
                     width=width, num_frames=num_frames, num_inference_steps=steps, guidance_scale=1.0,
                     output_type="np", generator=torch.Generator().manual_seed(seed)).frames[0]
    t_first = time.perf_counter()
    frames = (np.clip(video, 0, 1) * 255).round().astype(np.uint8)
    out = tmp / "diffusers.mp4"
    with AudioSource.open(audio, model_rate=16000) as src, out.open("wb") as f:
        enc = FragmentEncoder(width, height, 25, src, preset="veryfast")
        f.write(enc.init_segment.data)
        f.write(enc.encode(frames, first_frame=0, index=0, is_last=True).data)
    return _fields("diffusers", t0, t_first, time.perf_counter(), len(frames), out)


def run_longtake(weights: Path, preset: str, seconds: float, steps: int, seed: int, tmp: Path) -> dict[str, object]:
    from pipeline.render import RenderRequest, render
    from pipeline.sinks import FileSink

    audio = speech_wav(tmp / "speech.wav", seconds, seed=seed)
    out = tmp / "longtake.mp4"
    first: list[float] = []

    class FirstFrameSink(FileSink):
        def write(self, fragment):  # type: ignore[no-untyped-def]
            first.append(time.perf_counter())
            super().write(fragment)

    request = RenderRequest(image=DEMO_IMAGE, audio=audio, text=PROMPT, seed=seed, family="wan", preset=preset,
                            checkpoint=weights, options={"steps": steps, "text_guidance": 1.0, "audio_guidance": 1.0})
    t0 = time.perf_counter()
    r = render(request, [FirstFrameSink(out)])
    return _fields("longtake", t0, first[0], time.perf_counter(), r.num_frames, out)


def _fields(side: str, t0: float, t_first: float, t_end: float, frames: int, out: Path) -> dict[str, object]:
    import torch

    from pipeline.host import peak_rss_bytes

    wall = t_end - t0
    return {"side": side, "frames": frames, "video_s": frames / 25, "ttff_s": t_first - t0, "wall_s": wall,
            "fps": frames / wall, "peak_rss_bytes": peak_rss_bytes(), "mp4_bytes": out.stat().st_size,
            "threads": torch.get_num_threads()}


def run_side(side: str, weights: Path, preset: str, seconds: float, steps: int, seed: int, threads: int | None) -> dict[str, object]:
    """One side, in this process (``--side``; the parent starts a fresh process per side and case)."""
    import torch

    from pipeline.host import default_threads

    torch.set_num_threads(threads or default_threads())
    with tempfile.TemporaryDirectory(prefix="longtake-peer-") as tmp:
        run = run_longtake if side == "longtake" else run_diffusers
        result = run(weights, preset, seconds, steps, seed, Path(tmp))
    return {**result, "preset": preset, "seconds": seconds, "steps": steps}


def compare(weights: Path, preset: str, seconds: list[float], steps: int, seed: int, threads: int | None
            ) -> Iterator[dict[str, object]]:
    """Each case, each side in its own process (longtake first, then diffusers, back to back)."""
    for s in seconds:
        case: dict[str, object] = {"seconds": s}
        for side in SIDES:
            cmd = [sys.executable, "-m", "bench.peer", "--side", side, "--weights", str(weights), "--preset", preset, "--seconds", str(s),
                   "--steps", str(steps), "--seed", str(seed), "--json"]
            if threads:
                cmd += ["--threads", str(threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"bench.peer --side {side} --seconds {s} failed:\n{proc.stderr[-4000:]}")
            case[side] = json.loads(proc.stdout.strip().splitlines()[-1])
        lt, df = case["longtake"], case["diffusers"]
        assert isinstance(lt, dict) and isinstance(df, dict)
        case["diffusers_over_longtake"] = {k: df[k] / lt[k] for k in ("ttff_s", "wall_s", "peak_rss_bytes")}
        yield case


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", default="1,4", help="comma-separated video lengths in seconds")
    p.add_argument("--weights", type=Path, default=None, help="a tiny release (default: written to a temp dir)")
    p.add_argument("--preset", choices=("tiny", "tiny-128"), default="tiny-128",
                   help="the wan preset over the tiny release: its bucket is the resolution of both sides")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--side", choices=SIDES, default=None, help="run one side in this process")
    p.add_argument("--json", action="store_true", help="one JSON line per case")
    args = p.parse_args(argv)
    seconds = [float(s) for s in args.seconds.split(",")]
    if args.side:
        if args.weights is None:
            p.error("--side needs --weights")
        print(json.dumps(run_side(args.side, args.weights, args.preset, seconds[0], args.steps, args.seed, args.threads)))
        return 0
    with tempfile.TemporaryDirectory(prefix="longtake-peer-weights-") as tmp:
        weights = args.weights
        if weights is None:
            from models.wan.tiny_release import write_tiny_infinitetalk

            weights = write_tiny_infinitetalk(Path(tmp) / "weights")
        for case in compare(weights, args.preset, seconds, args.steps, args.seed, args.threads):
            print(json.dumps(case) if args.json else json.dumps(case, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
