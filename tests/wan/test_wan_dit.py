"""The Wan avatar DiT: equivalence with diffusers' WanTransformer3DModel (audio output zeroed), the audio
branch against a reading of the public InfiniteTalk code, and unit properties of the audio path."""

from __future__ import annotations

import torch
from diffusers import WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from torch import Tensor

from models.wan.config import WanDiTConfig
from models.wan.dit import AudioCrossAttention, AudioProjection, WanAvatarDiT
from models.wan.release import load_infinitetalk_dit


def _inputs(cfg: WanDiTConfig, t: int = 3, h: int = 4, w: int = 6, seed: int = 1) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    f = 1 + cfg.vae_scale * (t - 1)
    return {
        "latents": torch.randn(1, cfg.out_dim, t, h, w, generator=g),
        "cond": torch.randn(1, cfg.in_dim - cfg.out_dim, t, h, w, generator=g),
        "timestep": torch.tensor([637.0]),
        "text": torch.randn(1, cfg.text_len, cfg.text_dim, generator=g),
        "clip": torch.randn(1, 257, cfg.image_dim, generator=g),
        "audio": torch.randn(1, f, cfg.audio_window, cfg.audio_layers, cfg.audio_channels, generator=g),
    }


def _ours(dit: WanAvatarDiT, x: dict[str, Tensor], with_audio: bool = True) -> Tensor:
    context = dit.embed_context(x["text"], x["clip"])
    audio = dit.audio_tokens(x["audio"]) if with_audio else None
    return dit(x["latents"], x["cond"], x["timestep"], context, audio)


def _diffusers_model(cfg: WanDiTConfig, state: dict[str, Tensor]) -> WanTransformer3DModel:
    ref = WanTransformer3DModel(
        patch_size=cfg.patch_size,
        num_attention_heads=cfg.num_heads,
        attention_head_dim=cfg.head_dim,
        in_channels=cfg.in_dim,
        out_channels=cfg.out_dim,
        text_dim=cfg.text_dim,
        freq_dim=cfg.freq_dim,
        ffn_dim=cfg.ffn_dim,
        num_layers=cfg.num_layers,
        cross_attn_norm=cfg.cross_attn_norm,
        qk_norm="rms_norm_across_heads",
        eps=cfg.eps,
        image_dim=cfg.image_dim,
        added_kv_proj_dim=cfg.dim,
    )
    base = {k: v.clone() for k, v in state.items() if "audio" not in k and "norm_x" not in k}
    ref.load_state_dict(convert_wan_transformer_to_diffusers(base), strict=True)
    return ref.eval()


def _zero_audio_out(state: dict[str, Tensor]) -> None:
    for k in list(state):
        if ".audio_cross_attn.proj." in k:
            state[k] = torch.zeros_like(state[k])


@torch.no_grad()
def test_equals_diffusers_wan_i2v_with_audio_output_zeroed(infinitetalk_release, tiny_cfg) -> None:  # type: ignore[no-untyped-def]
    wan, it, state = infinitetalk_release(mutate=_zero_audio_out)
    dit = load_infinitetalk_dit(wan, it, dtype=torch.float32)
    x = _inputs(tiny_cfg)
    ref = _diffusers_model(tiny_cfg, state)
    want = ref(
        torch.cat([x["latents"], x["cond"]], 1),
        x["timestep"],
        x["text"],
        encoder_hidden_states_image=x["clip"],
        return_dict=False,
    )[0]
    got = _ours(dit, x)
    assert got.shape == x["latents"].shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the audio branch really is zero here, and really matters when not zeroed
    torch.testing.assert_close(_ours(dit, x, with_audio=False), want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_audio_changes_output_and_bf16_load_is_close(infinitetalk_release, tiny_cfg) -> None:  # type: ignore[no-untyped-def]
    wan, it, _ = infinitetalk_release()
    dit = load_infinitetalk_dit(wan, it, dtype=torch.float32)
    x = _inputs(tiny_cfg)
    with_audio, without = _ours(dit, x), _ours(dit, x, with_audio=False)
    assert (with_audio - without).abs().max() > 1e-2
    dit16 = load_infinitetalk_dit(wan, it, dtype=torch.bfloat16)
    assert dit16.blocks[0].self_attn.q.weight.dtype == torch.bfloat16
    assert dit16.blocks[0].modulation.dtype == torch.float32  # computed in float32, as upstream
    got16 = _ours(dit16, x)
    rel = (got16 - with_audio).norm() / with_audio.norm()
    assert rel < 0.05, rel


# --- The audio branch against the public code -------------------------------------------------------
# Read from MeiGen-AI/InfiniteTalk @0107cd9: wan/modules/multitalk_model.py (WanModel.forward: the audio
# window slicing into first / latter frames; AudioProjModel.forward) and wan/modules/attention.py
# (SingleStreamAttention.forward, the human_num == 1 path of SingleStreamMutiAttention, qk_norm=False).
# Below, that computation re-expressed step by step with the upstream tensor layouts.


def _upstream_audio_proj(p: AudioProjection, audio: Tensor) -> Tensor:
    cfg = p.cfg
    first = audio[:, :1]
    latter = audio[:, 1:]
    b, f1 = latter.shape[:2]
    latter = latter.reshape(b, f1 // cfg.vae_scale, cfg.vae_scale, *latter.shape[2:])  # b n_t n w s c
    mid = cfg.audio_window // 2
    lf = latter[:, :, :1, : mid + 1].flatten(2, 3)
    ll = latter[:, :, -1:, mid:].flatten(2, 3)
    lm = latter[:, :, 1:-1, mid : mid + 1].flatten(2, 3)
    latter_s = torch.cat([lf, lm, ll], dim=2)
    a = torch.relu(p.proj1(first.reshape(b * 1, -1))).reshape(b, 1, -1)
    v = torch.relu(p.proj1_vf(latter_s.reshape(b * latter_s.shape[1], -1))).reshape(b, latter_s.shape[1], -1)
    c = torch.cat([a, v], dim=1)
    n_t = c.shape[1]
    c = torch.relu(p.proj2(c.reshape(b * n_t, -1)))
    tokens = p.proj3(c).reshape(b * n_t, cfg.audio_context_tokens, cfg.audio_output_dim)
    return p.norm(tokens).reshape(b, n_t, cfg.audio_context_tokens, cfg.audio_output_dim)


def _upstream_single_stream(attn: AudioCrossAttention, x: Tensor, enc: Tensor, n_t: int) -> Tensor:
    # upstream: encoder_hidden_states.squeeze(0) -> [N_t, M, C]; x "B (N_t S) C -> (B N_t) S C"
    b, n_tok, c = x.shape
    h = attn.num_heads
    xs = x.reshape(b * n_t, n_tok // n_t, c)
    q = attn.q_linear(xs).view(b * n_t, -1, h, c // h).permute(0, 2, 1, 3)
    kv = attn.kv_linear(enc).view(b * n_t, enc.shape[1], 2, h, c // h).permute(2, 0, 3, 1, 4)
    k, v = kv.unbind(0)
    scores = (q @ k.transpose(-1, -2)) / (c // h) ** 0.5  # xformers memory_efficient_attention, default scale
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b * n_t, -1, c)
    return attn.proj(out).reshape(b, n_tok, c)


@torch.no_grad()
def test_audio_projection_and_cross_attention_match_upstream_reading(tiny_cfg) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    dit = WanAvatarDiT(tiny_cfg).eval()
    for p in dit.audio_proj.parameters():
        p.normal_(0, 0.3)
    x = _inputs(tiny_cfg, t=3)
    tokens = dit.audio_tokens(x["audio"])
    torch.testing.assert_close(tokens, _upstream_audio_proj(dit.audio_proj, x["audio"]), rtol=1e-6, atol=1e-6)
    assert tokens.shape == (1, 3, tiny_cfg.audio_context_tokens, tiny_cfg.audio_output_dim)
    attn = dit.blocks[0].audio_cross_attn
    hidden = torch.randn(1, 3 * 2 * 3, tiny_cfg.dim)
    torch.testing.assert_close(
        attn(hidden, tokens), _upstream_single_stream(attn, hidden, tokens[0], 3), rtol=1e-5, atol=1e-5
    )


@torch.no_grad()
def test_audio_is_local_to_its_latent_frame(tiny_cfg) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    dit = WanAvatarDiT(tiny_cfg).eval()
    x = _inputs(tiny_cfg, t=3)
    base = dit.audio_tokens(x["audio"])
    # video frames 5..8 belong to latent frame 2; frame 0 alone to latent frame 0
    moved = x["audio"].clone()
    moved[:, 5:9] += 1.0
    changed = (dit.audio_tokens(moved) - base).abs().amax(dim=(0, 2, 3))
    assert changed[0] == 0 and changed[1] == 0 and changed[2] > 0
    hidden = torch.randn(1, 3 * 4, tiny_cfg.dim)  # 3 latent frames × 4 tokens
    tok2 = base.clone()
    tok2[:, 2] += 1.0
    attn = dit.blocks[0].audio_cross_attn
    diff = (attn(hidden, tok2) - attn(hidden, base)).abs().reshape(3, 4, -1).amax(dim=(1, 2))
    assert diff[0] == 0 and diff[1] == 0 and diff[2] > 0


def test_wrong_audio_window_count_names_the_shape(tiny_cfg) -> None:  # type: ignore[no-untyped-def]
    dit = WanAvatarDiT(tiny_cfg)
    bad = torch.zeros(1, 6, tiny_cfg.audio_window, tiny_cfg.audio_layers, tiny_cfg.audio_channels)
    try:
        dit.audio_tokens(bad)
    except ValueError as exc:
        assert "one window per video frame" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("expected ValueError")


@torch.no_grad()
def test_packed_windows_equal_each_window_alone(tiny_cfg) -> None:  # type: ignore[no-untyped-def]
    # the pipeline's batched steps (I_{k-1} with N_{k+1}): two windows of different lengths packed
    # along T, each with rotary frame positions from 0 and self-attention to itself only, under all
    # three guidance branches at once (B = 3); each window's velocity is its own forward's
    torch.manual_seed(0)
    dit = WanAvatarDiT(tiny_cfg).eval()
    a, b = _inputs(tiny_cfg, t=2, seed=2), _inputs(tiny_cfg, t=5, seed=3)
    context = dit.embed_context(a["text"].expand(3, -1, -1), a["clip"].expand(3, -1, -1))

    def batch3(x: Tensor) -> Tensor:
        return torch.cat([x, x + 0.5, x - 0.5])

    parts = [(batch3(x["latents"]), batch3(x["cond"]), batch3(dit.audio_tokens(x["audio"]))) for x in (a, b)]
    t = torch.tensor([637.0, 637.0, 637.0])
    alone = [dit(lat, cond, t, context, au) for lat, cond, au in parts]
    packed = dit(torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2), t, context,
                 torch.cat([p[2] for p in parts], 1), windows=(2, 5))
    assert torch.equal(packed[:, :, :2], alone[0]) and torch.equal(packed[:, :, 2:], alone[1])
    # without windows the two attend to each other (and b's positions would start at 2)
    mixed = dit(torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2), t, context,
                torch.cat([p[2] for p in parts], 1))
    assert not torch.allclose(mixed[:, :, :2], alone[0], atol=1e-4)
    try:
        dit(parts[0][0], parts[0][1], t, context, parts[0][2], windows=(1, 3))
    except ValueError as exc:
        assert "must split the 2 latent frames" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("expected ValueError")
