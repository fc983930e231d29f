"""Parked models: weights in (pinned) host memory, brought back block by block just in time.

Who calls this: a rank's module loader registers every stage model once, after
:func:`pipeline.placement.fsdp.parallelize` (if any) and after the model is on its device; the
pipeline calls :meth:`ModelParker.activate` when a stage starts (``activate("sr")`` parks every other
model and starts copying the SR model's first blocks back). Everything after that is driven by
forward pre-hooks: the root's pre-hook waits for the root's own parameters (embeddings, head) and block
0; block ``n``'s pre-hook waits for block ``n`` (and the blocks FSDP will all-gather ahead of it) and
issues the copy of the next ones, so block ``n+1``'s host-to-device copy (on a side CUDA stream)
overlaps block ``n``'s compute.

How: a parked model keeps every parameter and buffer object; only the *storage* under them is freed
(``untyped_storage().resize_(0)``) and later re-allocated and filled from a host copy. Views sharing
that storage (FSDP2's padded shard buffer and the DTensor local shard on it) follow automatically, so
FSDP, hooks and the model never see a different tensor. With FSDP the parked bytes are this rank's
shards only. The host copy is taken once, at :meth:`ModelParker.register` (inference weights do not
change); parking is therefore only a stream-ordered free, and costs microseconds on the caller.

CPU-only machines: with ``enabled=False`` (the default without CUDA) nothing is parked — the weights
already live in host memory — and the hooks are not installed. ``enabled=True`` on CPU runs the same
free / re-allocate / copy path synchronously, which is how the tests check correctness and ordering.

Must not be kept: nothing here holds activations; the host copies are the only extra memory (one full
copy of each registered model's local parameters, pinned when CUDA exists).
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from pipeline.placement.fsdp import model_blocks, reshard_all

logger = logging.getLogger(__name__)

ROOT_GROUP = -1  # the group of parameters outside `blocks` (embeddings, head): restored first


class GroupState(enum.Enum):
    RESIDENT = "resident"
    PARKED = "parked"
    RESTORING = "restoring"  # copy issued on the side stream, not yet waited for


@dataclass(frozen=True)
class ParkEvent:
    """One step of the parking protocol, for tests and the benchmark (``kind``: park, issue, wait)."""

    kind: str
    model: str
    group: int


ParkListener = Callable[[ParkEvent], None]


@dataclass
class _Slot:
    """One storage of the model on its device and its host copy."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor  # uint8, pinned when CUDA exists

    def device_bytes(self) -> torch.Tensor:
        view = torch.empty(0, dtype=torch.uint8, device=self.storage.device)
        return view.set_(self.storage, 0, (self.nbytes,), (1,))


@dataclass
class _Group:
    index: int
    slots: list[_Slot] = field(default_factory=list)
    state: GroupState = GroupState.RESIDENT
    event: torch.cuda.Event | None = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tensors(module: nn.Module, exclude: set[int]) -> Iterator[torch.Tensor]:
    for t in list(module.parameters()) + list(module.buffers()):
        local = _local(t)
        if id(t) not in exclude and local.device.type != "meta":
            yield local


class ParkedModule:
    """One registered model: its storages grouped as root (-1) and blocks 0..n-1, and their states.

    Created by :meth:`ModelParker.register`; the pipeline never builds one directly.
    """

    def __init__(
        self,
        name: str,
        model: nn.Module,
        parker: ModelParker,
        gathers_ahead: int,
        lookahead: int,
        methods: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.model = model
        self._parker = parker
        self.gathers_ahead = gathers_ahead
        self.lookahead = lookahead
        self.is_sharded = isinstance(model, FSDPModule)
        blocks = model_blocks(model)
        reshard_all(model)  # with FSDP, park this rank's shards, never gathered copies
        seen: set[int] = set()  # StorageImpl addresses: a storage shared by two groups belongs to the first
        block_tensor_ids = {id(t) for b in blocks for t in list(b.parameters()) + list(b.buffers())}
        self.root = self._group(ROOT_GROUP, _tensors(model, block_tensor_ids), seen)
        self.blocks = [self._group(i, _tensors(b, set()), seen) for i, b in enumerate(blocks)]
        self._handles = [model.register_forward_pre_hook(self._root_pre_hook, prepend=True)]
        for i, b in enumerate(blocks):
            self._handles.append(b.register_forward_pre_hook(self._block_pre_hook(i), prepend=True))
        for method in methods:
            self._wrap_method(method)

    def _wrap_method(self, method: str) -> None:
        """Make ``model.<method>()`` (called on its own, like ``embed_context``) restore the root
        parameters first; wraps the instance attribute, so it runs before FSDP's wrapper of it."""
        inner = getattr(self.model, method)

        @functools.wraps(inner)
        def wrapped(*args: object, **kwargs: object) -> object:
            self._root_pre_hook(self.model, args)
            return inner(*args, **kwargs)

        setattr(self.model, method, wrapped)

    def _group(self, index: int, tensors: Iterator[torch.Tensor], seen: set[int]) -> _Group:
        group = _Group(index)
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            nbytes = storage.nbytes()
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._parker.pin_memory)
            slot = _Slot(storage, nbytes, host)
            host.copy_(slot.device_bytes())
            group.slots.append(slot)
        return group

    @property
    def groups(self) -> list[_Group]:
        return [self.root, *self.blocks]

    @property
    def is_parked(self) -> bool:
        """True when any group is not resident (a forward will restore it)."""
        return any(g.state is not GroupState.RESIDENT for g in self.groups)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    def resident_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups if g.state is not GroupState.PARKED)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- hooks ------------------------------------------------------------------------------
    def _root_pre_hook(self, module: nn.Module, args: object) -> None:
        if not self.is_parked:
            return
        if self.is_sharded and cast(FSDPModule, self.model)._get_fsdp_state()._is_root is None:
            # FSDP2's lazy init (at the first forward) re-checks every local shard against its padded
            # buffer: all shards must be present for it, once. Later returns are just in time.
            self._parker.restore(self.name)
            return
        self._parker._wait(self, self.root)
        self._ensure_through(0)

    def _block_pre_hook(self, index: int) -> Callable[[nn.Module, object], None]:
        def hook(module: nn.Module, args: object) -> None:
            if self.is_parked:
                self._ensure_through(index)

        return hook

    def _ensure_through(self, index: int) -> None:
        """Block ``index`` and the blocks FSDP gathers ahead of it must be resident now; the next
        ``lookahead`` ones start copying so they overlap this block's compute."""
        last_needed = min(index + self.gathers_ahead, len(self.blocks) - 1)
        last_issued = min(last_needed + self.lookahead, len(self.blocks) - 1)
        for i in range(index, last_issued + 1):
            self._parker._issue(self, self.blocks[i])
        for i in range(index, last_needed + 1):
            self._parker._wait(self, self.blocks[i])


class ModelParker:
    """Keeps stage models parked in host memory and returns them block by block just in time.

    Args:
        device: the rank's device (``cuda:i`` or ``cpu``).
        enabled: park for real. ``None``: only when ``device`` is CUDA (on CPU, weights are already in
            host memory and parking would only copy bytes around).
        listener: called with each :class:`ParkEvent` (tests and the benchmark observe the order).
    """

    def __init__(
        self, device: torch.device, *, enabled: bool | None = None, listener: ParkListener | None = None
    ) -> None:
        self.device = device
        self.enabled = device.type == "cuda" if enabled is None else enabled
        self.is_cuda = device.type == "cuda"
        self.pin_memory = self.is_cuda and torch.cuda.is_available()
        self.listener = listener
        self._models: dict[str, ParkedModule] = {}
        # GPU-only: the side stream for host-to-device copies, so they overlap compute.
        self._stream = (
            torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # torch's stub is untyped
            if self.is_cuda and self.enabled
            else None
        )

    def register(
        self,
        name: str,
        model: nn.Module,
        *,
        gathers_ahead: int = 0,
        lookahead: int = 1,
        methods: Sequence[str] = (),
    ) -> None:
        """Take the host copy of ``model`` (its local shards under FSDP) and install the hooks.

        Call after ``parallelize`` (the hooks must run before FSDP's all-gather hooks) and once per
        model. ``gathers_ahead``: the ``prefetch`` passed to ``parallelize`` (0 if not sharded): block
        ``n``'s pre-forward all-gathers that many next blocks, so they must be resident too.
        ``lookahead``: blocks copied ahead of need. ``methods``: other root methods called on their own
        (the ``forward_methods`` given to ``parallelize``). The model stays resident until parked.
        """
        if name in self._models:
            raise ValueError(
                f"model {name!r} is already registered with this ModelParker; register each once"
            )
        if not self.enabled:
            return
        if lookahead < 1 or gathers_ahead < 0:
            raise ValueError(
                f"need lookahead >= 1 and gathers_ahead >= 0, got {lookahead=}, {gathers_ahead=}"
            )
        self._models[name] = ParkedModule(name, model, self, gathers_ahead, lookahead, methods)

    def get(self, name: str) -> ParkedModule:
        try:
            return self._models[name]
        except KeyError:
            raise KeyError(f"no model {name!r} registered (registered: {sorted(self._models)})") from None

    def park(self, name: str) -> None:
        """Free ``name``'s device storages (stream-ordered: kernels already queued still see them)."""
        if not self.enabled:
            return
        pm = self.get(name)
        reshard_all(pm.model)
        for group in pm.groups:
            if group.state is GroupState.PARKED:
                continue
            for slot in group.slots:
                slot.storage.resize_(0)
            group.state, group.event = GroupState.PARKED, None
            self._emit("park", name, group.index)

    def prefetch(self, name: str, num_blocks: int = 1) -> None:
        """Start copying ``name``'s root parameters and first ``num_blocks`` blocks back, without waiting.

        Call a little before the stage starts (e.g. when the previous stage begins its last step) to
        hide even the first block's copy.
        """
        if not self.enabled:
            return
        pm = self.get(name)
        self._issue(pm, pm.root)
        for group in pm.blocks[:num_blocks]:
            self._issue(pm, group)

    def activate(self, name: str) -> None:
        """A stage using ``name`` starts: park every other registered model, start ``name``'s return."""
        if not self.enabled:
            return
        for other in self._models:
            if other != name:
                self.park(other)
        pm = self.get(name)
        if pm.is_parked:
            self.prefetch(name, pm.gathers_ahead + pm.lookahead)

    def restore(self, name: str) -> None:
        """Bring all of ``name`` back now (all-resident runs, checkpoint export)."""
        if not self.enabled:
            return
        pm = self.get(name)
        for group in pm.groups:
            self._issue(pm, group)
        for group in pm.groups:
            self._wait(pm, group)

    def unregister(self, name: str) -> None:
        """Restore ``name`` and remove its hooks; the parker forgets it (the model stays usable)."""
        if not self.enabled:
            return
        self.restore(name)
        self._models.pop(name).remove_hooks()

    def resident_bytes(self) -> dict[str, int]:
        return {name: pm.resident_bytes() for name, pm in self._models.items()}

    def close(self) -> None:
        """Restore every model and remove the hooks (the models stay usable, unparked)."""
        for name in list(self._models):
            self.unregister(name)

    # -- the copy protocol ---------------------------------------------------------------------
    def _issue(self, pm: ParkedModule, group: _Group) -> None:
        if group.state is not GroupState.PARKED:
            return
        if self._stream is None:  # CPU: synchronous
            for slot in group.slots:
                slot.storage.resize_(slot.nbytes)
                slot.device_bytes().copy_(slot.host)
            group.state = GroupState.RESTORING
        else:  # GPU-only path (not exercised on CPU CI): allocate and copy on the side stream
            with torch.cuda.stream(self._stream):
                for slot in group.slots:
                    slot.storage.resize_(slot.nbytes)
                    slot.device_bytes().copy_(slot.host, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch's stub is untyped
                event.record(self._stream)
            group.state, group.event = GroupState.RESTORING, event
        self._emit("issue", pm.name, group.index)

    def _wait(self, pm: ParkedModule, group: _Group) -> None:
        if group.state is GroupState.PARKED:
            self._issue(pm, group)
        if group.state is not GroupState.RESTORING:
            return
        if group.event is not None:  # GPU-only
            current = torch.cuda.current_stream(self.device)
            current.wait_event(group.event)
            if pm.is_sharded:
                # FSDP2 copies shards into its all-gather buffer on its own stream, which waits for
                # the current stream only at the root's pre-forward: a block's shards must be
                # complete before its (or its predecessor's prefetch) all-gather is issued.
                group.event.synchronize()
            for slot in group.slots:
                # the storage was allocated on the side stream and is now used on this one: a later
                # park must not let the allocator reuse it before this stream is done with it
                slot.device_bytes().record_stream(current)
        group.state, group.event = GroupState.RESIDENT, None
        self._emit("wait", pm.name, group.index)

    def _emit(self, kind: str, model: str, group: int) -> None:
        if self.listener is not None:
            self.listener(ParkEvent(kind, model, group))
