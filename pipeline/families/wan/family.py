"""The ``wan`` family's wiring: the models of ``models/wan`` as modules (built from a release
directory, or seeded random init), and the three stages.

Who calls what: :class:`~pipeline.families.wan.WanFamily` delegates here (imported on first use).
:func:`family_modules` is the one weight builder: the in-process render builds through it lazily and
a NodeEngine rank (``family_loaders``) builds the same weights through it, shards the DiT and hands
the modules back (``FamilyRuntime(..., loaded=ctx.modules)``).

``--weights DIR`` is the folder holding the downloads side by side, as the upstream READMEs put them
(:func:`release_paths`): ``Wan2.1-I2V-14B-480P/``, ``InfiniteTalk/single/infinitetalk.safetensors`` and
``chinese-wav2vec2-base/`` for InfiniteTalk; ``SoulX-FlashTalk-14B/`` and ``chinese-wav2vec2-base/``
for FlashTalk. :func:`check_weights` names what is missing and the command that downloads it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from models.wan.text import WanTextEncoder
from pipeline.errors import ModuleLoadError
from pipeline.families.wan.presets import WanPreset
from pipeline.families.wan.stages.a2v import WanA2VStage
from pipeline.families.wan.stages.context import WanContextStage
from pipeline.families.wan.stages.decode import WanDecodeStage
from pipeline.module import Module
from pipeline.stage import Stage
from pipeline.stage_common import Timings

MODULE_NAMES = ("dit", "vae", "audio", "text", "image")
TOKENIZER_DIR = Path("google") / "umt5-xxl"

_DOWNLOADS = {
    "Wan2.1-I2V-14B-480P": "huggingface-cli download Wan-AI/Wan2.1-I2V-14B-480P --local-dir {d}",
    "Wan2.1-I2V-14B-720P": "huggingface-cli download Wan-AI/Wan2.1-I2V-14B-720P --local-dir {d}",
    "InfiniteTalk": "huggingface-cli download MeiGen-AI/InfiniteTalk --local-dir {d}",
    "SoulX-FlashTalk-14B": "huggingface-cli download Soul-AILab/SoulX-FlashTalk-14B --local-dir {d}",
    "chinese-wav2vec2-base": ("huggingface-cli download TencentGameMate/chinese-wav2vec2-base --local-dir {d} && "
                              "huggingface-cli download TencentGameMate/chinese-wav2vec2-base model.safetensors "
                              "--revision refs/pr/1 --local-dir {d}"),
}


def release_paths(p: WanPreset, weights: Path) -> dict[str, Path]:
    """Where each part of ``p``'s release lives under ``weights``: ``base`` (VAE / T5 / CLIP files and
    the DiT's config + shards), ``overlay`` (InfiniteTalk's audio layers; absent for FlashTalk), ``wav2vec``."""
    weights = Path(weights)
    if p.release == "flashtalk":
        return {"base": weights / "SoulX-FlashTalk-14B", "wav2vec": weights / "chinese-wav2vec2-base"}
    return {"base": weights / p.wan_folder, "overlay": weights / "InfiniteTalk" / "single" / "infinitetalk.safetensors",
            "wav2vec": weights / "chinese-wav2vec2-base"}


def check_weights(p: WanPreset, weights: Path | None) -> None:
    """Raise :class:`ModuleLoadError` naming every missing part of ``p``'s release under ``weights``
    and the command that downloads it there (cheap: file presence only; the loaders check the rest)."""
    from models.wan.release import WAN_COMPONENT_FILES, WAN_I2V_FILES

    if weights is None:
        if p.release and p.dit_shape != "tiny":
            raise ModuleLoadError(
                f"preset {p.name!r} renders the {p.release} weights: pass --weights DIR (the folder holding "
                f"the downloads; docs/wan.md), or use a random-init preset ('14b', '1.3b', 'tiny') for measurements")
        return
    paths = release_paths(p, weights)
    base_files = (("config.json",) if p.release == "flashtalk" else WAN_I2V_FILES) + WAN_COMPONENT_FILES
    missing = [paths["base"] / f for f in base_files if not (paths["base"] / f).exists()]
    if "overlay" in paths and not paths["overlay"].is_file():
        missing.append(paths["overlay"])
    if not (paths["wav2vec"] / "config.json").is_file():
        missing.append(paths["wav2vec"] / "config.json")
    if missing:
        folders = sorted({m.relative_to(weights).parts[0] for m in missing})
        fixes = "; ".join(_DOWNLOADS.get(f, f"download {f}").format(d=Path(weights) / f) for f in folders)
        raise ModuleLoadError(
            f"wan preset {p.name!r}: the weights under {weights} are incomplete — missing "
            f"{', '.join(str(m.relative_to(weights)) for m in missing[:6])}"
            f"{' …' if len(missing) > 6 else ''}. Download them into {weights}: {fixes}")


class WanPromptEncoder(nn.Module):
    """umT5 plus its tokenizer: prompts → per prompt the states of its real tokens ``[L_i, D]``.

    The tokenizer is the release's ``google/umt5-xxl`` folder (padding / truncation to the DiT's
    ``text_len`` = 512, as Wan's ``HuggingfaceTokenizer``); random-init presets have none and map
    UTF-8 bytes to ids instead (their text encoder is random anyway)."""

    def __init__(self, encoder: WanTextEncoder, tokenizer_dir: Path | None, text_len: int = 512) -> None:
        super().__init__()
        self.encoder = encoder
        self.text_len = text_len
        self.tokenizer = None
        if tokenizer_dir is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)

    def forward(self, texts: list[str]) -> list[Tensor]:
        if self.tokenizer is not None:
            tok = self.tokenizer(texts, padding="max_length", max_length=self.text_len, truncation=True,
                                 add_special_tokens=True, return_tensors="pt")
            ids, mask = tok["input_ids"], tok["attention_mask"]
        else:
            vocab = int(self.encoder.model.config.vocab_size)
            rows = [[3 + b % (vocab - 3) for b in t.encode()][: self.text_len - 1] + [1] for t in texts]
            ids = torch.zeros(len(rows), self.text_len, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, row in enumerate(rows):
                ids[i, : len(row)] = torch.tensor(row)
                mask[i, : len(row)] = 1
        device = next(self.encoder.parameters()).device
        out: list[Tensor] = self.encoder.encode(ids.to(device), mask.to(device))
        return out


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)  # type: ignore[no-any-return]


def build_module(p: WanPreset, name: str, weights: Path | None, seed: int) -> nn.Module:
    """Model ``name`` of preset ``p``: loaded strictly from the release under ``weights`` (the
    ``models.wan`` loaders), or seeded random init at the preset's shapes when ``weights`` is None."""
    from models.wan.config import WanDiTConfig, dit_preset

    dtype = _dtype(p.dtype)
    shapes = p.shapes
    if weights is not None:
        from models.wan.audio import load_wav2vec2
        from models.wan.clip import load_clip_vision
        from models.wan.release import load_flashtalk_dit, load_infinitetalk_dit
        from models.wan.text import load_umt5
        from models.wan.vae import load_wan_vae

        paths = release_paths(p, weights)
        base = paths["base"]
        if name == "dit":
            if p.release == "flashtalk":
                return load_flashtalk_dit(base, dtype=dtype)
            return load_infinitetalk_dit(base, paths["overlay"], dtype=dtype)
        if name == "vae":  # float32: the decoder is small and decides the output's colours
            return load_wan_vae(base, dtype=torch.float32, config=shapes.get("vae"))
        if name == "audio":
            return load_wav2vec2(paths["wav2vec"])
        if name == "text":
            text_len = WanDiTConfig.from_wan_json(base / "config.json").text_len
            tokenizer = base / TOKENIZER_DIR
            return WanPromptEncoder(load_umt5(base, dtype=dtype, config=shapes.get("t5")),
                                    tokenizer if tokenizer.is_dir() else None, text_len)
        if name == "image":
            return load_clip_vision(base, dtype=dtype, config=shapes.get("clip"))
        raise KeyError(name)
    torch.manual_seed(seed * len(MODULE_NAMES) + MODULE_NAMES.index(name))
    if name == "dit":
        from models.wan.dit import WanAvatarDiT
        from models.wan.release import keep_fp32

        dit = WanAvatarDiT(dit_preset(p.dit_shape))
        for pname, param in dit.named_parameters():
            if not keep_fp32(pname):
                param.data = param.data.to(dtype)
        return dit
    if name == "vae":
        from diffusers import AutoencoderKLWan

        from models.wan.vae import WanStreamingVAE

        return WanStreamingVAE(AutoencoderKLWan(**shapes.get("vae", {})))  # type: ignore[no-untyped-call]
    if name == "audio":
        from transformers import Wav2Vec2Config, Wav2Vec2Model

        from models.wan.audio import WanAudioFeatures

        w2v_cfg: dict[str, Any] = dict(shapes.get("audio", {}))
        return WanAudioFeatures(Wav2Vec2Model(Wav2Vec2Config(**w2v_cfg)))
    if name == "text":
        from transformers import UMT5Config, UMT5EncoderModel

        from models.wan.text import UMT5_XXL

        t5_cfg: dict[str, Any] = {**UMT5_XXL, **shapes.get("t5", {})}
        t5 = UMT5EncoderModel(UMT5Config(**t5_cfg)).to(dtype)  # type: ignore[arg-type]
        return WanPromptEncoder(WanTextEncoder(t5), None, dit_preset(p.dit_shape).text_len)
    if name == "image":
        from transformers import CLIPVisionConfig, CLIPVisionModel

        from models.wan.clip import VIT_H_14, WanImageEncoder

        clip_cfg: dict[str, Any] = {**VIT_H_14, **shapes.get("clip", {})}
        return WanImageEncoder(CLIPVisionModel(CLIPVisionConfig(**clip_cfg)).to(dtype))  # type: ignore[arg-type]
    raise KeyError(name)


def family_modules(p: WanPreset, checkpoint: Path | None, *, device: str = "cpu", seed: int = 0
                   ) -> dict[str, Module]:
    """One unloaded :class:`Module` per model ("dit", "vae", "audio", "text", "image"); the builder
    loads the release itself (``prefix=None``) and keeps its dtypes (``dtype=None``: the DiT's
    modulation stays float32). Checks that the release is complete first (:func:`check_weights`)."""
    check_weights(p, checkpoint)
    return {
        name: Module(name, functools.partial(build_module, p, name, checkpoint, seed), checkpoint=checkpoint,
                     prefix=None, device=device, dtype=None)
        for name in MODULE_NAMES
    }


def family_stages(p: WanPreset, modules: Mapping[str, Module], timings: Timings) -> list[Stage]:
    """Context → A2V (per step), decode (per emission)."""
    return [
        WanContextStage(modules["vae"], modules["audio"], modules["text"], modules["image"],
                        audio_context=p.audio_context, timings=timings),
        WanA2VStage(modules["dit"], modules["vae"], timings=timings),
        WanDecodeStage(modules["vae"], timings=timings),
    ]
