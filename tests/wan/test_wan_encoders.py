"""umT5 and CLIP: Wan's ``.pth`` key layouts (written here on random weights) load strictly into
transformers' UMT5EncoderModel / CLIPVisionModel and give their outputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

from models.wan.checkpoint import WanCheckpointError
from models.wan.clip import MEAN, STD, VIT_H_14, load_clip_vision
from models.wan.text import UMT5_XXL, load_umt5, umt5_key
from models.wan.tiny_release import wan_t5_keys

T5_TINY = {"vocab_size": 64, "d_model": 16, "d_kv": 4, "d_ff": 24, "num_layers": 2, "num_heads": 4}
CLIP_TINY = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2,
             "image_size": 28, "patch_size": 14}  # fmt: skip


def _randomize(model: torch.nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name and name.endswith("weight") else 0.0) + 0.3 * torch.randn_like(p))


@torch.no_grad()
def test_umt5_from_wan_pth(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ref = UMT5EncoderModel(UMT5Config(**{**UMT5_XXL, **T5_TINY})).eval()
    _randomize(ref)
    hf = ref.state_dict()
    # Wan t5.py names (T5Encoder, shared_pos=False): the inverse of umt5_key, checked by the round trip
    inverse = {umt5_key(k): k for k in wan_t5_keys(T5_TINY["num_layers"])}
    assert set(inverse) == set(hf) - {"encoder.embed_tokens.weight"}
    path = tmp_path / "models_t5_umt5-xxl-enc-bf16.pth"
    torch.save({wan: hf[key].to(torch.bfloat16) for key, wan in inverse.items()}, path)
    enc = load_umt5(path, dtype=torch.float32, config=T5_TINY)
    ids = torch.randint(1, 64, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    got = enc.encode(ids, mask)
    ref_bf = UMT5EncoderModel(UMT5Config(**{**UMT5_XXL, **T5_TINY})).eval()
    ref_bf.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in hf.items()})
    want = ref_bf(input_ids=ids, attention_mask=mask).last_hidden_state
    assert [g.shape[0] for g in got] == [9, 6]
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1, :6], rtol=1e-5, atol=1e-5)
    assert enc.model.encoder.embed_tokens is enc.model.shared
    state = torch.load(path, weights_only=True)
    state["textual.extra"] = torch.zeros(1)
    torch.save(state, path)
    try:
        load_umt5(path, config=T5_TINY)
    except WanCheckpointError as exc:
        assert "textual.extra" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("expected WanCheckpointError")


def _wan_visual_forward(
    state: dict[str, torch.Tensor], x: torch.Tensor, heads: int, layers: int
) -> torch.Tensor:
    """Wan ``clip.py`` VisionTransformer.forward(use_31_block=True) re-expressed on its own keys
    (read from Wan-Video/Wan2.1 wan/modules/clip.py: pre-norm blocks, fused to_qkv split (3, heads, d),
    nn.GELU, all blocks but the last)."""
    s = {k.removeprefix("visual."): v for k, v in state.items() if k.startswith("visual.")}
    b = x.shape[0]
    h = F.conv2d(x, s["patch_embedding.weight"], stride=s["patch_embedding.weight"].shape[-1]).flatten(2)
    h = torch.cat([s["cls_embedding"].expand(b, -1, -1), h.permute(0, 2, 1)], dim=1) + s["pos_embedding"]
    dim = h.shape[-1]
    h = F.layer_norm(h, (dim,), s["pre_norm.weight"], s["pre_norm.bias"])
    for i in range(layers - 1):
        p = f"transformer.{i}."
        y = F.layer_norm(h, (dim,), s[p + "norm1.weight"], s[p + "norm1.bias"])
        q, k, v = (
            F.linear(y, s[p + "attn.to_qkv.weight"], s[p + "attn.to_qkv.bias"])
            .view(b, -1, 3, heads, dim // heads)
            .unbind(2)
        )
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        h = h + F.linear(
            a.transpose(1, 2).reshape(b, -1, dim), s[p + "attn.proj.weight"], s[p + "attn.proj.bias"]
        )
        y = F.layer_norm(h, (dim,), s[p + "norm2.weight"], s[p + "norm2.bias"])
        y = F.linear(
            F.gelu(F.linear(y, s[p + "mlp.0.weight"], s[p + "mlp.0.bias"])),
            s[p + "mlp.2.weight"],
            s[p + "mlp.2.bias"],
        )
        h = h + y
    return h  # fmt: skip


@torch.no_grad()
def test_clip_visual_from_wan_pth(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d, n_layers, heads, ps = 16, 3, 2, 14
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: 0.3 * torch.randn(*shape, generator=g)  # noqa: E731
    state = {"visual.patch_embedding.weight": r(d, 3, ps, ps), "visual.cls_embedding": r(1, 1, d),
             "visual.pos_embedding": r(1, 5, d), "visual.pre_norm.weight": 1 + r(d), "visual.pre_norm.bias": r(d),
             "visual.post_norm.weight": 1 + r(d), "visual.post_norm.bias": r(d), "visual.head": r(d, 8),
             "textual.token_embedding.weight": r(10, 8), "log_scale": r(1)}  # fmt: skip
    for i in range(n_layers):
        p = f"visual.transformer.{i}."
        state.update({p + "norm1.weight": 1 + r(d), p + "norm1.bias": r(d), p + "attn.to_qkv.weight": r(3 * d, d),
                      p + "attn.to_qkv.bias": r(3 * d), p + "attn.proj.weight": r(d, d), p + "attn.proj.bias": r(d),
                      p + "norm2.weight": 1 + r(d), p + "norm2.bias": r(d), p + "mlp.0.weight": r(2 * d, d),
                      p + "mlp.0.bias": r(2 * d), p + "mlp.2.weight": r(d, 2 * d), p + "mlp.2.bias": r(d)})  # fmt: skip
    path = tmp_path / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
    torch.save(state, path)
    enc = load_clip_vision(path, dtype=torch.float32, config=CLIP_TINY)
    image = torch.rand(1, 3, 40, 36, generator=g) * 2 - 1
    got = enc.encode(image)
    x = F.interpolate(image, size=(28, 28), mode="bicubic", align_corners=False) * 0.5 + 0.5
    x = (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    want = _wan_visual_forward(state, x, heads, n_layers)
    assert got.shape == (1, 5, d)  # ViT-H/14 at 224: 257 tokens
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the real shape: 1 + (224/14)^2 = 257 tokens of 1280
    cfg = CLIPVisionConfig(**VIT_H_14)
    assert 1 + (cfg.image_size // cfg.patch_size) ** 2 == 257 and cfg.hidden_size == 1280
    assert isinstance(enc.model, CLIPVisionModel)
