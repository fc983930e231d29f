"""Shared by the placement tests: a small block-structured transformer, its loaders and the jobs the
NodeEngine runs in the rank processes (module-level, so the spawned ranks import them by name).

The model stands in for the DiT family (``blocks: nn.ModuleList`` in forward order, root parameters
before and after the blocks) until the real tiny preset is used; placement code is generic over it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from pipeline.placement.fsdp import parallelize
from pipeline.placement.rank import RankContext

DIM, DEPTH, TOKENS, IN_DIM = 50, 4, 16, 10  # 50: uneven shards over 4 ranks (padding)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 3 * dim), nn.GELU(), nn.Linear(3 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, in_dim: int = IN_DIM, dim: int = DIM, depth: int = DEPTH) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, in_dim)
        self.register_buffer("pos", torch.linspace(-1.0, 1.0, TOKENS * dim).reshape(TOKENS, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build_model(seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    model = TinyTransformer()
    # non-trivial norms so every parameter matters to the output
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def make_input(seed: int, batch: int = 2, tokens: int = TOKENS) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, tokens, IN_DIM, generator=g)


# -- loaders (ctx) -> nn.Module ---------------------------------------------------------------
def load_plain(ctx: RankContext) -> nn.Module:
    return build_model().to(ctx.device)


def load_sharded(ctx: RankContext) -> nn.Module:
    return parallelize(build_model(), ctx.mesh, prefetch=1)


def load_sharded_parked(ctx: RankContext) -> nn.Module:
    model = parallelize(build_model(), ctx.mesh, prefetch=1)
    ctx.parker.register("dit", model, gathers_ahead=1)
    return model


def load_sharded_no_prefetch(ctx: RankContext) -> nn.Module:
    return parallelize(build_model(), ctx.mesh, prefetch=0)


# -- jobs (ctx, payload) -> value ---------------------------------------------------------------
def job_forward(ctx: RankContext, payload: Mapping[str, object]) -> torch.Tensor:
    model = ctx.modules[str(payload.get("module", "dit"))]
    with torch.no_grad():
        return model(make_input(int(payload.get("seed", 0))).to(ctx.device)).cpu()  # type: ignore[arg-type]


def job_park_roundtrip(ctx: RankContext, payload: Mapping[str, object]) -> dict[str, object]:
    """Forward, park (this rank's shards leave), forward again: both outputs and the parked bytes."""
    model = ctx.modules["parked"]
    x = make_input(3)
    with torch.no_grad():
        before = model(x)
        ctx.parker.park("dit")
        parked = ctx.parker.resident_bytes()["dit"]
        after = model(x)
    return {
        "before": before,
        "after": after,
        "parked_resident": parked,
        "restored_resident": ctx.parker.resident_bytes()["dit"],
    }


def job_record_unshard_order(ctx: RankContext, payload: Mapping[str, object]) -> list[str]:
    """Record FSDP param-group unshards and block forward ends during one forward (in call order)."""
    model = ctx.modules[str(payload["module"])]
    events: list[str] = []
    original = FSDPParamGroup.unshard

    def unshard(self: FSDPParamGroup, async_op: bool = False) -> None:
        events.append(f"unshard {self._module_fqn}")
        original(self, async_op)

    handles = [
        b.register_forward_hook(lambda m, a, o, i=i: events.append(f"end blocks.{i}"))
        for i, b in enumerate(model.blocks)  # type: ignore[union-attr,arg-type]
    ]
    FSDPParamGroup.unshard = unshard  # type: ignore[method-assign]
    try:
        with torch.no_grad():
            model(make_input(0))
    finally:
        FSDPParamGroup.unshard = original  # type: ignore[method-assign]
        for h in handles:
            h.remove()
    return events


def job_slow_collectives(ctx: RankContext, payload: Mapping[str, object]) -> int:
    """Rank 0 publishes 'started' then every rank loops forwards + all_reduce (a job to kill mid-way)."""
    if ctx.is_publisher:
        ctx.publish({"started": os.getpid()})
    total = torch.zeros(1)
    for _ in range(int(payload.get("steps", 200))):
        with torch.no_grad():
            ctx.modules["dit"](make_input(0))
        dist.all_reduce(total)
        time.sleep(0.02)
    return int(total.item())


def job_raise(ctx: RankContext, payload: Mapping[str, object]) -> None:
    kind = str(payload.get("kind", "value"))
    if kind == "invalid_input":
        from pipeline.errors import InvalidInputError

        raise InvalidInputError(f"payload field 'seed' must be >= 0, got {payload.get('seed')}", field="seed")
    raise ValueError(f"bad payload on rank {ctx.rank}")


def job_raise_on_rank1(ctx: RankContext, payload: Mapping[str, object]) -> None:
    """Rank 1 raises while the others wait in a collective it never joins (a partial failure)."""
    if ctx.rank == 1:
        raise RuntimeError("rank 1 failed mid-job")
    dist.all_reduce(torch.ones(1))


def job_chunks(ctx: RankContext, payload: Mapping[str, object]) -> int:
    """A stand-in for a chunked render: `chunks` forwards of a ~4 MB activation, outputs dropped
    (or kept when `leak`, the negative control), rank 0 publishes a checksum per chunk."""
    model = ctx.modules["dit"]
    kept: list[torch.Tensor] = []
    for k in range(int(payload["chunks"])):  # type: ignore[call-overload]
        x = make_input(k, batch=64)
        with torch.no_grad():
            y = model(x)
        if payload.get("leak"):
            kept.append(y.repeat(32, 1, 1))  # ~1.3 MB per chunk kept alive
        if ctx.is_publisher:
            ctx.publish(float(y.sum()))
    return len(kept)


def job_wait_for_cancel(ctx: RankContext, payload: Mapping[str, object]) -> str:
    if ctx.is_publisher:
        ctx.publish("running")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if ctx.cancel_requested():
            return "cancelled"
        time.sleep(0.01)
    return "not cancelled"


def job_raise_mid_forward(ctx: RankContext, payload: Mapping[str, object]) -> None:
    """Every rank raises inside block 2's forward (after blocks 0-1 and the prefetches ran)."""
    model = ctx.modules["dit"]

    def fail(module: nn.Module, args: object, output: object) -> None:
        raise ValueError("shape mismatch inside blocks.2")

    handle = model.blocks[2].register_forward_hook(fail)  # type: ignore[index,union-attr]
    try:
        with torch.no_grad():
            model(make_input(0))
    finally:
        handle.remove()


# -- the real tiny preset (models.presets "tiny") -----------------------------------------------
def tiny_stage_outputs(a2v: nn.Module, sr: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """One A2V velocity over an N window and one SR pass of its L frames, as the stages call them."""
    from models.presets import get_preset

    p = get_preset("tiny")
    L, C, c = p.chunk_frames, p.context_frames, p.latent_channels
    g = torch.Generator().manual_seed(7)
    ref = torch.randn(1, c, *p.hr_latent_hw, generator=g)
    x = torch.randn(1, c, C + L, *p.lr_latent_hw, generator=g)
    known = torch.zeros(1, C + L, dtype=torch.bool)
    known[:, :C] = True
    audio = torch.randn(1, C + L, p.dit.audio_dim, generator=g)
    text = torch.randn(1, 5, p.dit.text_dim or 1, generator=g)
    with torch.no_grad():
        context = a2v.embed_context(ref, text)  # type: ignore[operator]
        v = a2v(x, torch.full((1,), 0.5), known, torch.arange(C + L)[None], ref, audio, context=context)
        hr = sr(v[:, :, C:], ref, ref_tokens=sr.embed_reference(ref))  # type: ignore[operator]
    return v, hr


def job_tiny_stages(ctx: RankContext, payload: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """Resident outputs, then both models parked and returned just in time (twice, switching)."""
    a2v, sr = ctx.modules["a2v"], ctx.modules["sr"]
    v, hr = tiny_stage_outputs(a2v, sr)
    ctx.parker.park("a2v")
    ctx.parker.park("sr")
    parked = sum(ctx.parker.resident_bytes().values())
    v2, hr2 = tiny_stage_outputs(a2v, sr)
    ctx.parker.activate("sr")
    v3, hr3 = tiny_stage_outputs(a2v, sr)
    return {
        "v": v,
        "hr": hr,
        "v_parked": v2,
        "hr_parked": hr2,
        "v_switch": v3,
        "hr_switch": hr3,
        "parked_bytes": torch.tensor(parked),
    }


def job_park_before_first_forward(ctx: RankContext, payload: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """Park a freshly sharded model that never ran (FSDP not yet lazily initialized), run it, park it
    again: every rank's shards must then be gone (FSDP's lazy init must not have swapped a padded
    shard for a copy the parker does not know). Returns the output and the bytes left, summed."""
    model = parallelize(build_model(), ctx.mesh, prefetch=1)
    ctx.parker.register("fresh", model, gathers_ahead=1)
    ctx.parker.park("fresh")
    try:
        with torch.no_grad():
            out = model(make_input(int(payload.get("seed", 0))))
        ctx.parker.park("fresh")
        left = torch.tensor([sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())])  # type: ignore[attr-defined]
        dist.all_reduce(left)
        return {"out": out, "bytes_left_after_park": left}
    finally:
        ctx.parker.unregister("fresh")


def load_broken(ctx: RankContext) -> nn.Module:
    raise FileNotFoundError("checkpoint /nonexistent/a2v.safetensors not found")


def job_relay_fragments(ctx: RankContext, payload: Mapping[str, object]) -> int:
    """Every rank renders 'fragments' through a RelaySink (only rank 0's reach the parent)."""
    from pipeline.media_types import Fragment, InitSegment
    from pipeline.placement.relay import RelaySink

    sink = RelaySink(ctx)
    sink.open(InitSegment(b"ftyp-moov", 256, 256, 25, 16000, "avc1.64001e", "mp4a.40.2"))
    count = int(payload["fragments"])  # type: ignore[call-overload]
    for i in range(count):
        if ctx.cancel_requested():
            sink.close(ok=False)
            return i
        data = bytes([ctx.rank]) * 8
        sink.write(Fragment(i, data, 16 * i, 16, 0.64 * i, 0.64, is_last=i == count - 1))
        time.sleep(0.05)
    sink.close(ok=True)
    return count


def job_publish_from_threads(ctx: RankContext, payload: Mapping[str, object]) -> int:
    """Rank 0 publishes from several threads at once, as the render loop (progress) and its
    publisher lane (fragments) do: each event is (thread, seq, bytes of one value)."""
    import threading

    threads, events, size = int(payload["threads"]), int(payload["events"]), int(payload["size"])  # type: ignore[call-overload]
    if not ctx.is_publisher:
        return 0

    def publish(t: int) -> None:
        for seq in range(events):
            ctx.publish((t, seq, bytes([(t * 31 + seq) % 256]) * size))

    workers = [threading.Thread(target=publish, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return threads * events


def job_send_garbage(ctx: RankContext, payload: Mapping[str, object]) -> str:
    """Write bytes that are no pickle onto the rank's pipe (a torn message), then keep running as
    the old bug's rank did, so only the engine's reaction can end the job."""
    if ctx.is_publisher:
        assert ctx._outbox is not None
        ctx._outbox.conn.send_bytes(b"\x00\x00garbage, not a pickle")
    time.sleep(float(payload.get("sleep_s", 60.0)))  # type: ignore[arg-type]
    return "finished"


def job_send_unknown_message(ctx: RankContext, payload: Mapping[str, object]) -> str:
    """A well-formed pickle that is not a message of the protocol."""
    if ctx.is_publisher:
        assert ctx._outbox is not None
        ctx._outbox.conn.send({"not": "a message"})
    time.sleep(float(payload.get("sleep_s", 60.0)))  # type: ignore[arg-type]
    return "finished"
