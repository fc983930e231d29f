"""Model presets: one function per size, each returning a frozen :class:`ModelPreset`.

Who calls this: the pipeline (to size chunk plans, latents and audio windows), ``build_modules`` (to
construct the networks), training scripts and the benchmarks. Presets are plain Python, not YAML;
every component receives only its own sub-config (``DiTConfig`` for the A2V DiT, and so on).

* ``tiny`` — the trained demo: 256x256 RGB at 25 fps, runs faster than real time on 2 CPU cores.
* ``1.3b`` / ``14b`` — shapes of the Wan2.1 1.3B / 14B class for the A2V DiT (random init only),
  used to measure speed and memory on GPUs. Never instantiate them in CPU tests (use the meta device).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DiTConfig:
    """The flow-matching A2V DiT (``models.dit.A2VDiT``)."""

    in_channels: int  # latent channels of the low-res latent
    dim: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    patch_size: int  # spatial patch on the low-res latent
    ref_channels: int  # channels of the hr reference latent
    ref_patch_size: int  # spatial patch on the hr reference latent (reference tokens)
    audio_dim: int  # D of AudioEncoder features
    audio_tokens: int  # audio tokens per frame the features are split into
    audio_token_dim: int  # width of one audio token (keys/values of the frame-local audio attention)
    text_dim: int | None  # D of TextEncoder tokens (None: no text branch)
    freq_dim: int = 256  # sinusoidal timestep embedding width
    rope_theta: float = 10000.0
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


@dataclass(frozen=True)
class SRConfig:
    """The one-step latent super-resolution DiT (``models.sr.SRDiT``)."""

    channels: int  # latent channels (same on both sides)
    scale: int  # hr / lr spatial factor (= ModelPreset.lowres_factor)
    dim: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    patch_size: int  # spatial patch on the hr latent (also used for the reference tokens)
    # Full-resolution reference attention after the transformer (``models.layers.ReferenceWindowAttention``):
    # every hr latent cell attends to the reference's cells within +-ref_window_radius cells; 0 = none.
    ref_window_radius: int = 0
    ref_window_dim: int = 32  # query/key/value width of that attention (its heads are 16 wide)
    ref_window_hidden: int = 64  # width of the conv that turns what it read into a latent residual
    # how many such steps run one after the other (each reads the reference again, with queries from the
    # latent the previous step corrected); the 2nd.. are ``SRDiT.ref_window_more``
    ref_window_layers: int = 1
    rope_theta: float = 10000.0
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


@dataclass(frozen=True)
class VAEConfig:
    """The causal video VAE (``models.vae.CausalVAE``); no temporal compression.

    ``enc_channels`` / ``dec_channels`` list the channels per resolution level, from half the RGB
    resolution down to the latent resolution (``len == log2(factor)``): no convolution runs at full
    RGB resolution (pixel (un)shuffle crosses that last factor 2), and the decoder spends most of its
    channels at the latent resolution (DESIGN §8: full-resolution convolutions were 8x slower).
    ``dec_blocks`` counts the plain residual blocks per non-latent level (same order, without the
    latent level); the latent level has ``latent_res_blocks`` causal ones.
    """

    image_channels: int
    latent_channels: int
    factor: int  # spatial down-sampling factor, power of two
    enc_channels: tuple[int, ...]
    dec_channels: tuple[int, ...]
    latent_res_blocks: int  # causal (temporal) residual blocks at the latent resolution in the decoder
    dec_blocks: tuple[int, ...]
    temporal_kernel: int  # kernel of the causal temporal convs (cache keeps kernel-1 frames per layer)
    lowres_factor: int = 4  # hr latent -> A2V low-res latent (to_lowres); = ModelPreset.lowres_factor
    scaling: float = 1.0  # latents are multiplied by this after encode and divided before decode
    # The decoder reads the reference (``models.layers.ReferenceWindowAttention``) at twice the latent
    # resolution: every cell of a frame's features there attends to the reference's features and pixels
    # within +-ref_window_radius cells (``CausalVAE.reference_features``); 0 = none (a per-frame decoder
    # that never sees the reference).
    ref_window_radius: int = 0
    ref_window_dim: int = 32  # query/key/value width of that attention (its heads are 16 wide)
    ref_window_hidden: int = 32  # width of the conv that turns what it read into a feature residual
    # and copies the reference's pixels: each output pixel blends, by a gate the decoder predicts (starting
    # at 0), towards the reference warped by where the window read (its attention's expected offset)
    ref_warp: bool = False
    # and reads it rigidly: per frame, a head moved by one similarity map (shift, rotation, scale) fitted
    # to the reads, weighted by how sure each cell's attention is, and what stands still, read in place
    # (``models.vae.rigid_read``; no weights of its own). Takes out the per-cell jitter of the read, which
    # bent the noses, brows and glasses it copied (docs/quality.md). Inert without ref_warp
    ref_warp_rigid: bool = False


@dataclass(frozen=True)
class AudioConfig:
    """The audio feature encoder (``models.audio.AudioEncoder``)."""

    sample_rate: int
    fps: int
    context_frames: int  # video frames of audio context on each side of a frame
    n_fft: int
    hop_length: int
    n_mels: int
    dim: int  # hidden width of the learned layers
    out_dim: int  # D of the per-frame features
    num_layers: int
    f_min: float = 0.0
    f_max: float | None = None


@dataclass(frozen=True)
class TextConfig:
    """The byte-level text encoder (``models.text.TextEncoder``)."""

    max_length: int  # tokens including the BOS token; longer text is truncated
    dim: int
    num_layers: int
    num_heads: int
    ffn_dim: int


@dataclass(frozen=True)
class ModelPreset:
    name: str
    fps: int
    sample_rate: int
    height: int
    width: int
    latent_channels: int
    vae_factor: int
    lowres_factor: int
    chunk_frames: int  # L
    context_frames: int  # C
    interp_frames: int  # e
    num_steps: int
    shift: float
    dit: DiTConfig
    sr: SRConfig
    vae: VAEConfig
    audio: AudioConfig
    text: TextConfig | None
    # N_0 sees the reference's low-res latent as a known frame in front of its window (the A2V DiT's
    # positions are relative only, so a window with no known frame cannot place the reference)
    reference_frame: bool = False
    # classifier-free guidance on the audio, silence as the unconditional input (1.0: off); costs a
    # second A2V forward per sampler step (batched with the first)
    audio_guidance: float = 1.0
    # the guidance on the latent cells the audio moves most in each frame (the mouth's), audio_guidance
    # elsewhere, by the cell's share m of the frame's largest change: audio_guidance + (peak - audio_guidance)
    # * m ** audio_guidance_focus (pipeline/families/tiny/stages/a2v.py peak_guidance); None: audio_guidance
    # everywhere
    audio_guidance_peak: float | None = None
    audio_guidance_focus: float = 4.0
    # the flow time the A2V sampler starts at (1.0: pure noise); below 1 every unknown frame starts
    # from a guess, the reference's low-res latent (N chunks) or the line between the anchors (I
    # chunks), noised to that time (models/sampler.py; pipeline/families/tiny/stages/a2v.py)
    start_noise: float = 1.0
    # the same for I chunks, whose guess is the line between their anchors: below start_noise the
    # transition keeps more of that line, so the head travels between the anchors without a jump
    interp_start_noise: float = 1.0
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.height % (self.vae_factor * self.lowres_factor) or self.width % (
            self.vae_factor * self.lowres_factor
        ):
            raise ValueError(
                f"preset {self.name!r}: height x width {self.height}x{self.width} must be divisible by "
                f"vae_factor*lowres_factor={self.vae_factor * self.lowres_factor}"
            )
        if self.sample_rate % self.fps:
            raise ValueError(
                f"preset {self.name!r}: sample_rate={self.sample_rate} must be a multiple of fps={self.fps} "
                "so every video frame owns a whole number of audio samples"
            )
        if not self.audio_guidance_focus > 0:
            raise ValueError(f"preset {self.name!r}: audio_guidance_focus={self.audio_guidance_focus} must be > 0 "
                             "(the exponent of the audio's share; larger keeps the peak to fewer cells)")
        h, w = self.lr_latent_hw
        if h % self.dit.patch_size or w % self.dit.patch_size:
            raise ValueError(f"preset {self.name!r}: low-res latent {h}x{w} not divisible by dit.patch_size")
        if (
            self.sr.scale != self.lowres_factor
            or self.vae.factor != self.vae_factor
            or self.vae.lowres_factor != self.lowres_factor
        ):
            raise ValueError(f"preset {self.name!r}: sr.scale / vae.factor disagree with the preset factors")

    @property
    def hr_latent_hw(self) -> tuple[int, int]:
        return self.height // self.vae_factor, self.width // self.vae_factor

    @property
    def lr_latent_hw(self) -> tuple[int, int]:
        h, w = self.hr_latent_hw
        return h // self.lowres_factor, w // self.lowres_factor

    @property
    def samples_per_frame(self) -> int:
        return self.sample_rate // self.fps


def _tiny() -> ModelPreset:
    c = 8
    audio = AudioConfig(
        sample_rate=16000,
        fps=25,
        context_frames=2,
        n_fft=400,
        hop_length=160,
        n_mels=40,
        dim=96,
        out_dim=128,
        num_layers=2,
    )
    text = TextConfig(max_length=64, dim=96, num_layers=2, num_heads=4, ffn_dim=256)
    return ModelPreset(
        name="tiny",
        fps=25,
        sample_rate=16000,
        height=256,
        width=256,
        latent_channels=c,
        vae_factor=8,
        lowres_factor=2,
        chunk_frames=16,
        context_frames=4,
        interp_frames=4,
        num_steps=5,
        shift=3.0,
        dit=DiTConfig(
            in_channels=c,
            dim=128,
            num_layers=4,
            num_heads=4,
            ffn_dim=384,
            patch_size=4,
            ref_channels=c,
            ref_patch_size=4,
            audio_dim=audio.out_dim,
            audio_tokens=4,
            audio_token_dim=64,
            text_dim=text.dim,
            freq_dim=128,
        ),
        # two reference-window steps since the seventh checkpoint (glasses present 0.69 -> 0.79; MODEL_CARD.md)
        sr=SRConfig(channels=c, scale=2, dim=128, num_layers=4, num_heads=4, ffn_dim=384, patch_size=4,
                    ref_window_radius=2, ref_window_layers=2),
        vae=VAEConfig(
            image_channels=3,
            latent_channels=c,
            factor=8,
            enc_channels=(32, 64, 96),
            dec_channels=(16, 32, 64),
            latent_res_blocks=2,
            dec_blocks=(0, 1),
            temporal_kernel=3,
            lowres_factor=2,
            # the decoder reads the reference and copies its pixels from where it read, rigidly: nose /
            # hair / hat 1.41 / 1.56 / 1.38 -> 0.19 / 0.69 / 0.68x ground truth's distance (held-out 0-19;
            # docs/quality.md)
            ref_window_radius=3,
            ref_warp=True,
            ref_warp_rigid=True,
        ),
        audio=audio,
        text=text,
        reference_frame=True,  # every N window holds the reference latent as a known frame (trained so)
        # lip-sync r 0.78 -> 0.94 on held-out voices at 3 (first checkpoint); 2.5 from the fourth to the
        # seventh; 3.5 with start_noise 0.6 (below) for the eighth; 2.0 for the ninth, whose A2V opens
        # the mouths too wide at 3.5 (lips 15x ground truth's distance; MODEL_CARD.md)
        audio_guidance=2.0,
        # no audio_guidance_peak: a peak of 7 lifts lip sync over 20 faces 0.898 -> 0.912 but moves every
        # identity distance away from ground truth (nose 4.09 -> 4.37x; the eighth), so it is a request option only
        # N chunks' sampling starts from the reference noised to 0.6: glasses, earrings,
        # eyes, brows, hair and SSIM nearer ground truth on 40 held-out faces (MODEL_CARD.md)
        start_noise=0.6,
        # I chunks from their anchors' line noised to 0.1: the head no longer jumps at the seams
        # (seam jump 1.75 -> 1.00x ground truth's), mean lip sync 0.003 lower (MODEL_CARD.md)
        interp_start_noise=0.1,
        notes="trained demo preset; 256x256 at 25 fps on 2 CPU cores",
    )


def _wan_like(
    name: str,
    dim: int,
    layers: int,
    heads: int,
    ffn: int,
    sr_dim: int,
    sr_layers: int,
    height: int,
    width: int,
) -> ModelPreset:
    c = 16
    audio = AudioConfig(
        sample_rate=16000,
        fps=25,
        context_frames=2,
        n_fft=400,
        hop_length=160,
        n_mels=80,
        dim=512,
        out_dim=768,
        num_layers=4,
    )
    text = TextConfig(max_length=256, dim=1024, num_layers=6, num_heads=16, ffn_dim=4096)
    return ModelPreset(
        name=name,
        fps=25,
        sample_rate=16000,
        height=height,
        width=width,
        latent_channels=c,
        vae_factor=8,
        lowres_factor=2,
        chunk_frames=24,
        context_frames=4,
        interp_frames=4,
        num_steps=20,
        shift=5.0,
        dit=DiTConfig(
            in_channels=c,
            dim=dim,
            num_layers=layers,
            num_heads=heads,
            ffn_dim=ffn,
            patch_size=2,
            ref_channels=c,
            ref_patch_size=4,
            audio_dim=audio.out_dim,
            audio_tokens=4,
            audio_token_dim=1024,
            text_dim=text.dim,
            freq_dim=256,
        ),
        sr=SRConfig(
            channels=c,
            scale=2,
            dim=sr_dim,
            num_layers=sr_layers,
            num_heads=sr_dim // 128,
            ffn_dim=4 * sr_dim,
            patch_size=2,
        ),
        vae=VAEConfig(
            image_channels=3,
            latent_channels=c,
            factor=8,
            enc_channels=(128, 256, 512),
            dec_channels=(128, 256, 512),
            latent_res_blocks=2,
            dec_blocks=(1, 2),
            temporal_kernel=3,
            lowres_factor=2,
        ),
        audio=audio,
        text=text,
        notes="random init only: for speed and memory measurement on GPUs",
    )


def _1_3b() -> ModelPreset:
    # Wan2.1-1.3B-like: dim 1536, 30 layers, 12 heads, ffn 8960; 480p-ish (832x480) output
    return _wan_like("1.3b", 1536, 30, 12, 8960, sr_dim=768, sr_layers=12, height=480, width=832)


def _14b() -> ModelPreset:
    # Wan2.1-14B-like: dim 5120, 40 layers, 40 heads, ffn 13824; 720p-ish output (736 rows, not 720,
    # so the low-res latent 46x80 divides by the patch size 2)
    return _wan_like("14b", 5120, 40, 40, 13824, sr_dim=1536, sr_layers=24, height=736, width=1280)


PRESETS: dict[str, Callable[[], ModelPreset]] = {"tiny": _tiny, "1.3b": _1_3b, "14b": _14b}


def get_preset(name: str) -> ModelPreset:
    """Return the preset called ``name``; an unknown name raises ``ValueError`` naming the choices."""
    try:
        factory = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}: choose one of {sorted(PRESETS)}") from None
    return factory()
