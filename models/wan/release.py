"""User-facing loaders: the directories a user downloads → built, filled modules.

Layouts (read from the public repositories; see docs/wan.md for the files each was read from):

* ``Wan2.1-I2V-14B-480P/`` (Wan-AI): ``config.json`` (original Wan keys, ``model_type: i2v``),
  ``diffusion_pytorch_model-0000N-of-00007.safetensors`` + ``diffusion_pytorch_model.safetensors.index.json``
  (original Wan key names), ``Wan2.1_VAE.pth``, ``models_t5_umt5-xxl-enc-bf16.pth``,
  ``models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth``, tokenizer folders ``google/umt5-xxl``,
  ``xlm-roberta-large``.
* InfiniteTalk (MeiGen-AI): ``single/infinitetalk.safetensors`` — the audio layers (and any base tensors
  it overrides), applied on top of the Wan DiT, as ``wan/multitalk.py`` merges it before a strict load.
* SoulX-FlashTalk-14B (Soul-AILab): one folder loaded by ``WanModel.from_pretrained`` upstream, i.e.
  ``config.json`` + ``diffusion_pytorch_model*.safetensors`` (+ index) holding the whole DiT, audio
  layers included, next to the same VAE / T5 / CLIP files as the Wan folder.

Who calls what: a family's module loader calls :func:`load_avatar_dit` (and the VAE / audio / text /
image loaders of the sibling modules) once per process; nothing here knows about jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from models.wan.audio import WanAudioFeatures, load_wav2vec2
from models.wan.checkpoint import WanCheckpointError, fill_module, safetensors_entries, sharded_entries
from models.wan.clip import WanImageEncoder, load_clip_vision
from models.wan.config import WanDiTConfig
from models.wan.dit import WanAvatarDiT
from models.wan.text import WanTextEncoder, load_umt5
from models.wan.vae import WanStreamingVAE, load_wan_vae

DIT_STEM = "diffusion_pytorch_model"
WAN_I2V_FILES = ("config.json", f"{DIT_STEM}.safetensors.index.json")


def keep_fp32(name: str) -> bool:
    # Wan computes these under float32 autocast; they are tiny, so they stay float32.
    return name.endswith("modulation") or name.startswith(("time_embedding.", "time_projection."))


def build_dit(cfg: WanDiTConfig) -> WanAvatarDiT:
    """The DiT on the meta device (no memory), ready for :func:`models.wan.checkpoint.fill_module`."""
    with torch.device("meta"):
        return WanAvatarDiT(cfg)


def check_release_dir(folder: Path, required: tuple[str, ...], release: str) -> None:
    """Raise a clear error when ``folder`` is not the named release (missing files)."""
    if not folder.is_dir():
        raise WanCheckpointError(f"{folder}: not a directory; pass the downloaded {release} folder")
    missing = [name for name in required if not (folder / name).exists()]
    if missing:
        raise WanCheckpointError(
            f"{folder}: not the {release} release — missing {', '.join(missing)}; download the whole "
            f"folder (docs/wan.md lists its layout)"
        )


def load_avatar_dit(
    wan_dir: Path,
    overlay_files: tuple[Path, ...] = (),
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    release: str = "Wan2.1-I2V-14B-480P + InfiniteTalk",
) -> WanAvatarDiT:
    """Build the DiT from ``wan_dir/config.json`` and fill it from the sharded base checkpoint plus the
    overlay files (InfiniteTalk's ``single/infinitetalk.safetensors``; none for FlashTalk, whose folder
    holds the audio layers itself). Strict: the union must be exactly the model's parameters."""
    wan_dir = Path(wan_dir)
    check_release_dir(wan_dir, ("config.json",), release)
    cfg = WanDiTConfig.from_wan_json(wan_dir / "config.json")
    entries = sharded_entries(wan_dir, DIT_STEM)
    entries.update(safetensors_entries(overlay_files))
    dit = build_dit(cfg)
    fill_module(dit, entries, dtype=dtype, device=device, what=f"{release} DiT", keep_fp32=keep_fp32)
    return dit.eval().requires_grad_(False)


def load_infinitetalk_dit(
    wan_dir: Path,
    infinitetalk_file: Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> WanAvatarDiT:
    """InfiniteTalk: ``Wan2.1-I2V-14B-480P/`` + ``InfiniteTalk/single/infinitetalk.safetensors``."""
    check_release_dir(Path(wan_dir), WAN_I2V_FILES, "Wan2.1-I2V-14B-480P")
    if not Path(infinitetalk_file).is_file():
        raise WanCheckpointError(
            f"{infinitetalk_file}: not found; pass InfiniteTalk/single/infinitetalk.safetensors from the "
            "MeiGen-AI/InfiniteTalk download"
        )
    return load_avatar_dit(Path(wan_dir), (Path(infinitetalk_file),), dtype=dtype, device=device)


def load_flashtalk_dit(
    flashtalk_dir: Path, *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> WanAvatarDiT:
    """SoulX-FlashTalk-14B: one folder with the whole DiT (audio layers included)."""
    check_release_dir(Path(flashtalk_dir), ("config.json",), "SoulX-FlashTalk-14B")
    return load_avatar_dit(Path(flashtalk_dir), (), dtype=dtype, device=device, release="SoulX-FlashTalk-14B")


def parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


WAN_COMPONENT_FILES = ("Wan2.1_VAE.pth", "models_t5_umt5-xxl-enc-bf16.pth",
                       "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth")  # fmt: skip


@dataclass
class WanAvatarModules:
    """Everything one avatar job needs; ``text`` / ``image`` run once per job and can then be parked."""

    dit: WanAvatarDiT
    vae: WanStreamingVAE
    audio: WanAudioFeatures
    text: WanTextEncoder | None
    image: WanImageEncoder | None


def _load_components(
    folder: Path,
    dit: WanAvatarDiT,
    wav2vec_dir: Path,
    dtype: torch.dtype,
    device: str,
    with_encoders: bool,
    shapes: dict[str, dict[str, object]],
) -> WanAvatarModules:
    vae = load_wan_vae(folder, dtype=dtype, device=device, config=shapes.get("vae"))
    audio = load_wav2vec2(wav2vec_dir, device=device)
    text = load_umt5(folder, dtype=dtype, config=shapes.get("t5")) if with_encoders else None
    image = load_clip_vision(folder, dtype=dtype, config=shapes.get("clip")) if with_encoders else None
    return WanAvatarModules(dit, vae, audio, text, image)


def load_infinitetalk(
    wan_dir: Path,
    infinitetalk_file: Path,
    wav2vec_dir: Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    with_encoders: bool = True,
    shapes: dict[str, dict[str, object]] | None = None,
) -> WanAvatarModules:
    """InfiniteTalk from the three downloaded folders (docs/wan.md). Every folder is checked before any
    tensor is read. ``with_encoders=False`` skips umT5 / CLIP (when their outputs are cached per job);
    ``shapes`` overrides the VAE / T5 / CLIP configs (tests)."""
    wan_dir, wav2vec_dir = Path(wan_dir), Path(wav2vec_dir)
    check_release_dir(wan_dir, WAN_I2V_FILES + WAN_COMPONENT_FILES, "Wan2.1-I2V-14B-480P")
    check_release_dir(wav2vec_dir, ("config.json",), "chinese-wav2vec2-base")
    dit = load_infinitetalk_dit(wan_dir, Path(infinitetalk_file), dtype=dtype, device=device)
    return _load_components(wan_dir, dit, wav2vec_dir, dtype, device, with_encoders, shapes or {})


def load_flashtalk(
    flashtalk_dir: Path,
    wav2vec_dir: Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    with_encoders: bool = True,
    shapes: dict[str, dict[str, object]] | None = None,
) -> WanAvatarModules:
    """SoulX-FlashTalk-14B from its folder (DiT with audio layers + the Wan VAE / T5 / CLIP files)."""
    flashtalk_dir, wav2vec_dir = Path(flashtalk_dir), Path(wav2vec_dir)
    check_release_dir(flashtalk_dir, ("config.json",) + WAN_COMPONENT_FILES, "SoulX-FlashTalk-14B")
    check_release_dir(wav2vec_dir, ("config.json",), "chinese-wav2vec2-base")
    dit = load_flashtalk_dit(flashtalk_dir, dtype=dtype, device=device)
    return _load_components(flashtalk_dir, dit, wav2vec_dir, dtype, device, with_encoders, shapes or {})
