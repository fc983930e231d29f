"""The ``wan`` family's presets: which release, its published sampling defaults, chunk shape, buckets.

Plain data, no torch: the registry (and the API validating a job spec) reads these. The numbers
and where they come from:

* **InfiniteTalk** (MeiGen-AI/InfiniteTalk ``generate_infinitetalk.py``): 40 steps, shift 7 at 480p
  (11 at 720p), text guidance 5, audio guidance 4, clips of 81 video frames = 21 latents of which the
  first ``motion_frame = 9`` video frames (3 latents) are the previous clip's end. Here: ``L = 18``
  generated + ``C = 3`` context latents = the same 21-latent window, ``e = 3``.
* **SoulX-FlashTalk-14B** (``flash_talk/configs/infer_params.yaml``): 4 steps, shift 5, no guidance
  (a distilled model), 33 frames = 9 latents with 5 motion frames (2 latents): ``L = 7``, ``C = 2``,
  ``e = 2``; one 768×448 bucket.
* Buckets: InfiniteTalk's ``ASPECT_RATIO_627`` (480p) and ``ASPECT_RATIO_960`` (720p) tables
  (``wan/utils/multitalk_utils.py``, key = height / width); the reference picks the bucket whose ratio
  is closest to its own, as upstream does, and is centre-cropped and resized to it.
* ``14b`` / ``1.3b`` (+ ``-720p``): random-init shapes for speed and memory measurement (no release).
* ``tiny``: the tiny release of ``models.wan.tiny_release`` (CPU tests), 32-pixel buckets; ``tiny-128``:
  the same release at one 128×128 bucket (``bench.peer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models.wan.config import TINY_SHAPES

AUDIO_WINDOW = 5
"""wav2vec2 frames per video frame (WanDiTConfig.audio_window of every release); the context stage
windows the features with it."""

# (height / width, height, width); upstream's tables (key rounded to 2 digits as upstream writes it)
BUCKETS_480P: tuple[tuple[float, int, int], ...] = (
    (0.26, 320, 1216), (0.38, 384, 1024), (0.50, 448, 896), (0.67, 512, 768), (0.82, 576, 704),
    (1.00, 640, 640), (1.22, 704, 576), (1.50, 768, 512), (1.86, 832, 448), (2.00, 896, 448),
    (2.50, 960, 384), (2.83, 1088, 384), (3.60, 1152, 320), (3.80, 1216, 320), (4.00, 1280, 320),
)  # fmt: skip
BUCKETS_720P: tuple[tuple[float, int, int], ...] = (
    (0.22, 448, 2048), (0.29, 512, 1792), (0.36, 576, 1600), (0.45, 640, 1408), (0.55, 704, 1280),
    (0.63, 768, 1216), (0.76, 832, 1088), (0.88, 896, 1024), (1.00, 960, 960), (1.14, 1024, 896),
    (1.31, 1088, 832), (1.50, 1152, 768), (1.58, 1216, 768), (1.82, 1280, 704), (1.91, 1344, 704),
    (2.20, 1408, 640), (2.30, 1472, 640), (2.67, 1536, 576), (2.89, 1600, 576), (3.62, 1664, 448),
    (3.00, 1728, 576), (3.14, 1792, 576), (3.43, 1856, 576), (3.75, 1920, 512),
)  # fmt: skip
BUCKETS_TINY: tuple[tuple[float, int, int], ...] = ((0.50, 32, 64), (1.00, 32, 32), (2.00, 64, 32))

# Wan's default negative prompt (Wan-Video/Wan2.1 wan/configs/shared_config.py, sample_neg_prompt)
WAN_NEGATIVE_PROMPT = (
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，"
    "丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，"
    "杂乱的背景，三条腿，背景人很多，倒着走"
)

CONDITIONING_MODES = ("latent", "reencode")


@dataclass(frozen=True)
class WanPreset:
    """One ``wan`` preset (satisfies ``pipeline.model_family.FamilyPreset``)."""

    name: str
    release: str  # "infinitetalk" | "flashtalk": the download layout under --weights DIR
    dit_shape: str  # models.wan.config.dit_preset name for random init (no weights)
    buckets: tuple[tuple[float, int, int], ...]
    num_steps: int
    shift: float
    text_guidance: float
    audio_guidance: float
    chunk_frames: int  # L latent frames generated per N chunk
    context_frames: int  # C latent frames of N_{k-1} in front of N_k
    interp_frames: int  # e latent frames generated per I chunk
    wan_folder: str = "Wan2.1-I2V-14B-480P"
    dtype: str = "bfloat16"  # weights (the DiT's modulation / time MLP stay float32)
    shapes: dict[str, dict[str, object]] = field(default_factory=dict)  # component shape overrides (tiny)
    audio_context: int = 16  # wav2vec2 context (video frames) each side of a chunk's window
    fps: int = 25
    sample_rate: int = 16000
    reference_frame: bool = False  # the reference is timeline frame 0 instead (FrameGrid.reference_is_first)
    vae_stride: int = 4

    @property
    def height(self) -> int:  # the square bucket (the size before a reference picks one)
        return min(self.buckets, key=lambda b: abs(b[0] - 1.0))[1]

    @property
    def width(self) -> int:
        return min(self.buckets, key=lambda b: abs(b[0] - 1.0))[2]

    def bucket(self, source_hw: tuple[int, int]) -> tuple[int, int]:
        """``(height, width)`` of the bucket whose ratio is closest to the reference's ``h / w``."""
        ratio = source_hw[0] / source_hw[1]
        _, h, w = min(self.buckets, key=lambda b: abs(b[0] - ratio))
        return h, w


def _random(shape: str, buckets: tuple[tuple[float, int, int], ...], shift: float, suffix: str = "") -> WanPreset:
    return WanPreset(f"{shape}{suffix}", "", shape, buckets, num_steps=4, shift=shift, text_guidance=1.0,
                     audio_guidance=1.0, chunk_frames=18, context_frames=3, interp_frames=3)


PRESETS: dict[str, WanPreset] = {
    p.name: p
    for p in (
        WanPreset("infinitetalk", "infinitetalk", "14b", BUCKETS_480P, num_steps=40, shift=7.0, text_guidance=5.0,
                  audio_guidance=4.0, chunk_frames=18, context_frames=3, interp_frames=3),
        WanPreset("infinitetalk-720p", "infinitetalk", "14b", BUCKETS_720P, num_steps=40, shift=11.0,
                  text_guidance=5.0, audio_guidance=4.0, chunk_frames=18, context_frames=3, interp_frames=3),
        WanPreset("flashtalk", "flashtalk", "14b", ((1.71, 768, 448),), num_steps=4, shift=5.0, text_guidance=1.0,
                  audio_guidance=1.0, chunk_frames=7, context_frames=2, interp_frames=2),
        _random("14b", BUCKETS_480P, 7.0), _random("14b", BUCKETS_720P, 11.0, "-720p"),
        _random("1.3b", BUCKETS_480P, 7.0), _random("1.3b", BUCKETS_720P, 11.0, "-720p"),
        WanPreset("tiny", "infinitetalk", "tiny", BUCKETS_TINY, num_steps=2, shift=5.0, text_guidance=5.0,
                  audio_guidance=4.0, chunk_frames=4, context_frames=1, interp_frames=2, dtype="float32",
                  audio_context=4,
                  shapes=TINY_SHAPES),
        # the same tiny release at one 128x128 bucket (bench.peer: frames large enough for length to matter)
        WanPreset("tiny-128", "infinitetalk", "tiny", ((1.00, 128, 128),), num_steps=2, shift=5.0,
                  text_guidance=5.0, audio_guidance=4.0, chunk_frames=4, context_frames=1, interp_frames=2,
                  dtype="float32", audio_context=4, shapes=TINY_SHAPES),
    )
}

# bounds of the per-job overrides (RenderRequest.options / the job spec): name -> (type, low, high)
OPTION_BOUNDS: dict[str, tuple[type, float, float]] = {
    "steps": (int, 1, 100),
    "shift": (float, 0.5, 20.0),
    "text_guidance": (float, 1.0, 20.0),
    "audio_guidance": (float, 1.0, 20.0),
}
