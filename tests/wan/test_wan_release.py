"""Loading tiny releases written in the public layout: strict, clear errors, nothing loaded on error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from wan_fixtures import random_dit_state, wan_config_json, write_sharded

from models.wan.checkpoint import WanCheckpointError
from models.wan.release import load_flashtalk_dit, load_infinitetalk_dit


def _shard(wan: Path, i: int = 1) -> Path:
    return wan / f"diffusion_pytorch_model-{i:05d}-of-00003.safetensors"


def _rewrite(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path), metadata={"format": "pt"})


def test_loads_strictly_in_each_dtype(infinitetalk_release) -> None:  # type: ignore[no-untyped-def]
    wan, it, state = infinitetalk_release(dtype=torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        dit = load_infinitetalk_dit(wan, it, dtype=dtype)
        q = dit.blocks[1].self_attn.q.weight
        assert q.dtype == dtype and q.device.type == "cpu"
        torch.testing.assert_close(q.float(), state["blocks.1.self_attn.q.weight"].to(dtype).float())
        torch.testing.assert_close(
            dit.audio_proj.proj3.weight.float(), state["audio_proj.proj3.weight"].to(dtype).float()
        )


def test_overlay_overrides_base_tensors(infinitetalk_release, tmp_path) -> None:  # type: ignore[no-untyped-def]
    wan, it, state = infinitetalk_release()
    new = torch.full_like(state["blocks.0.ffn.0.weight"], 0.25)
    _rewrite(it, lambda s: s.__setitem__("blocks.0.ffn.0.weight", new))
    dit = load_infinitetalk_dit(wan, it, dtype=torch.float32)
    torch.testing.assert_close(dit.blocks[0].ffn[0].weight, new)


@pytest.mark.parametrize(
    "corruption, message",
    [
        ("missing_key", "keys missing: blocks.0.self_attn.q.bias"),
        ("missing_audio", "keys missing: blocks.0.audio_cross_attn.q_linear.weight"),
        ("extra_key", "unexpected keys in infinitetalk.safetensors: blocks.0.extra.weight"),
        ("wrong_shape", "wrong shape: patch_embedding.weight"),
        ("wrong_dtype", "dtype this loader does not convert: audio_proj.proj1.bias (torch.int64"),
        ("truncated", "truncated"),
        ("missing_index", "missing diffusion_pytorch_model.safetensors.index.json"),
        ("index_mismatch", "not in the shard the index names"),
        ("not_release", "not the Wan2.1-I2V-14B-480P release — missing config.json"),
        ("t2v_config", "model_type='t2v'"),
    ],
)
def test_each_corruption_is_named_and_loads_nothing(infinitetalk_release, corruption, message) -> None:  # type: ignore[no-untyped-def]
    wan, it, state = infinitetalk_release()
    owner = json.loads((wan / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"]
    if corruption == "missing_key":
        _rewrite(wan / owner["blocks.0.self_attn.q.bias"], lambda s: s.pop("blocks.0.self_attn.q.bias"))
        index = wan / "diffusion_pytorch_model.safetensors.index.json"
        raw = json.loads(index.read_text())
        raw["weight_map"].pop("blocks.0.self_attn.q.bias")
        index.write_text(json.dumps(raw))
    elif corruption == "missing_audio":
        _rewrite(it, lambda s: s.pop("blocks.0.audio_cross_attn.q_linear.weight"))
    elif corruption == "extra_key":
        _rewrite(it, lambda s: s.__setitem__("blocks.0.extra.weight", torch.zeros(2)))
    elif corruption == "wrong_shape":
        shard = wan / owner["patch_embedding.weight"]
        _rewrite(shard, lambda s: s.__setitem__("patch_embedding.weight", torch.zeros(32, 16, 1, 2, 2)))
    elif corruption == "wrong_dtype":
        _rewrite(it, lambda s: s.__setitem__("audio_proj.proj1.bias", torch.zeros(32, dtype=torch.int64)))
    elif corruption == "truncated":
        shard = _shard(wan, 2)
        shard.write_bytes(shard.read_bytes()[:-100])
    elif corruption == "missing_index":
        (wan / "diffusion_pytorch_model.safetensors.index.json").unlink()
    elif corruption == "index_mismatch":
        index = wan / "diffusion_pytorch_model.safetensors.index.json"
        raw = json.loads(index.read_text())
        raw["weight_map"]["head.head.weight"] = (
            _shard(wan, 3).name
            if raw["weight_map"]["head.head.weight"] != _shard(wan, 3).name
            else _shard(wan, 1).name
        )
        index.write_text(json.dumps(raw))
    elif corruption == "not_release":
        (wan / "config.json").unlink()
    elif corruption == "t2v_config":
        cfg = json.loads((wan / "config.json").read_text())
        cfg["model_type"] = "t2v"
        (wan / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((WanCheckpointError, ValueError)) as err:
        load_infinitetalk_dit(wan, it, dtype=torch.float32)
    assert message in str(err.value), str(err.value)
    assert str(wan) in str(err.value) or corruption in ("missing_audio", "extra_key", "wrong_dtype")


def test_flashtalk_single_folder_with_audio_layers(tmp_path, tiny_cfg) -> None:  # type: ignore[no-untyped-def]
    state = random_dit_state(tiny_cfg, seed=3)
    folder = tmp_path / "SoulX-FlashTalk-14B"
    write_sharded(folder, {k: v.to(torch.bfloat16) for k, v in state.items()}, num_shards=2)
    raw = wan_config_json(tiny_cfg)
    # upstream WanModel argument names in the config are understood
    raw["context_tokens"] = raw.pop("audio_context_tokens")
    (folder / "config.json").write_text(json.dumps(raw))
    dit = load_flashtalk_dit(folder, dtype=torch.bfloat16)
    torch.testing.assert_close(
        dit.audio_proj.proj1.weight, state["audio_proj.proj1.weight"].to(torch.bfloat16)
    )
    (folder / "diffusion_pytorch_model.safetensors.index.json").unlink()
    with pytest.raises(WanCheckpointError, match="2 shard files are there, so the index was lost"):
        load_flashtalk_dit(folder)


def test_whole_infinitetalk_release_loads_and_checks_every_folder_first(
    infinitetalk_release, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    from diffusers import AutoencoderKLWan
    from test_wan_audio import TINY as W2V_TINY
    from test_wan_vae import TINY as VAE_TINY
    from test_wan_vae import to_original_keys
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    from models.wan.release import load_infinitetalk

    wan, it, _ = infinitetalk_release()
    torch.manual_seed(0)
    vae_state = AutoencoderKLWan(**VAE_TINY).state_dict()  # type: ignore[arg-type]
    torch.save({to_original_keys(k): v for k, v in vae_state.items()}, wan / "Wan2.1_VAE.pth")
    (wan / "models_t5_umt5-xxl-enc-bf16.pth").touch()
    w2v = tmp_path / "chinese-wav2vec2-base"
    Wav2Vec2Model(Wav2Vec2Config(**W2V_TINY)).save_pretrained(w2v)
    with pytest.raises(
        WanCheckpointError, match="missing models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
    ):
        load_infinitetalk(wan, it, w2v, with_encoders=False)
    (wan / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth").touch()
    mods = load_infinitetalk(wan, it, w2v, dtype=torch.float32, with_encoders=False, shapes={"vae": VAE_TINY})
    assert mods.text is None and mods.image is None
    lat = torch.randn(1, 4, 2, 2, 2)
    assert mods.vae.decode_chunk(lat, mods.vae.new_cache()).shape == (1, 3, 5, 16, 16)
    assert mods.dit.blocks[0].audio_cross_attn.q_linear.weight.dtype == torch.float32
    assert len(mods.audio.model.encoder.layers) == W2V_TINY["num_hidden_layers"]
