"""CUDA's device rules on a CPU-only torch: :class:`OnCuda` tensors hold CPU data but live on cuda:0.

A CPU build of torch cannot allocate CUDA tensors, and fake tensors (``torch._subclasses.fake_tensor``)
carry no data, so every data-dependent read (``.tolist()``, ``bool(mask.all())``, a boolean mask) stops
them. An :class:`OnCuda` tensor wraps real CPU data and reports ``device == cuda:0``; inside
:class:`AsCuda` every torch function that takes one checks CUDA's rule (all tensor operands on one
device; a 0-dim CPU tensor counts as a scalar; indices of a CUDA tensor may be on the CPU), runs the
CPU function on the data and puts the result on cuda:0. ``.numpy()`` of one fails as on CUDA;
``.cpu()``, ``.to(...)``, ``.tolist()`` and ``.item()`` are the host copies. The CPU kernels run on
the same data, so a run on OnCuda tensors computes exactly the numbers of a CPU run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__float__,
               torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.__complex__}
_METADATA = {torch._has_compatible_shallow_copy_type}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


class DeviceMismatchError(RuntimeError):
    pass


class OnCuda(torch.Tensor):
    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> OnCuda:
        r = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            device=CUDA, requires_grad=False)
        r.elem = elem
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # aten ops that reach the wrapper below the Python API (detach, views of properties)
        return _run(func, args, kwargs or {})

    def __repr__(self) -> str:  # type: ignore[override]
        return f"OnCuda({self.elem!r})"


def _dev(t: torch.Tensor) -> torch.device:
    return CUDA if isinstance(t, OnCuda) else t.device


def _unwrap(x: Any) -> Any:
    return x.elem if isinstance(x, OnCuda) else x


def _is_cuda(x: object) -> bool:
    return (isinstance(x, torch.device) and x.type == "cuda") or (isinstance(x, str) and x.startswith("cuda"))


def _check(func: Any, tensors: list[torch.Tensor]) -> set[torch.device]:
    devices = {_dev(t) for t in tensors if not (_dev(t) == CPU and t.dim() == 0)}
    if len(devices) > 1:
        raise DeviceMismatchError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{' and '.join(sorted(map(str, devices)))}! (in {getattr(func, '__name__', func)})")
    return devices


def _run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, check: bool = True) -> Any:
    """``func`` on the CPU data, its tensor results on cuda:0 when an operand is."""
    leaves, _ = tree_flatten((args, kwargs))
    wrapped = {id(x.elem): x for x in leaves if isinstance(x, OnCuda)}
    devices = _check(func, [x for x in leaves if isinstance(x, torch.Tensor)]) if check else set()
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if not wrapped or (check and CUDA not in devices):
        return out

    def wrap(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or isinstance(x, OnCuda):
            return x
        same = wrapped.get(id(x))  # an in-place op returns its operand
        return same if same is not None else OnCuda(x)

    return tree_map(wrap, out)


def _to(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``Tensor.to`` / ``.cuda`` / ``.cpu``: a copy of the data, on the target device."""
    x, rest, kw = args[0], list(args[1:]), dict(kwargs)
    target: torch.device | None = None
    if func is torch.Tensor.cuda:
        rest, target = [], CUDA
        kw = {k: v for k, v in kw.items() if k in ("non_blocking", "memory_format")}
    elif func is torch.Tensor.cpu:
        rest, kw, target = [], {}, CPU
    for i, a in enumerate(rest):
        if isinstance(a, (torch.device, str)):
            target, rest[i] = torch.device(a), CPU
        elif isinstance(a, torch.Tensor):  # x.to(other): other's device and dtype
            target, rest[i] = _dev(a), a.dtype
    if kw.get("device") is not None:
        target, kw["device"] = torch.device(kw["device"]), CPU
    base = _unwrap(x)
    out = torch.Tensor.to(base, *rest, **kw)
    on_cuda = target.type == "cuda" if target is not None else isinstance(x, OnCuda)
    if on_cuda != isinstance(x, OnCuda) and out is base:
        out = base.clone()  # a move copies
    if not on_cuda:
        return out
    return x if out is base else OnCuda(out)


class AsCuda(TorchFunctionMode):
    """``with AsCuda():`` every torch function follows CUDA's device rules for :class:`OnCuda` tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__" or func in _METADATA:  # the wrapper's own metadata
            return func(*args, **kwargs)
        first = args[0] if args else None
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return _to(func, args, kwargs)
        if isinstance(first, OnCuda):
            if func is torch.Tensor.numpy:  # what CUDA says
                raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
                                "tensor to host memory first.")
            if func in _HOST_READS:  # a device-to-host copy, as on CUDA
                return func(first.elem, *args[1:], **kwargs)
        if _is_cuda(kwargs.get("device")):  # a factory: CPU data, on cuda:0
            out = func(*args, **{**kwargs, "device": CPU})
            return tree_map(lambda x: OnCuda(x) if isinstance(x, torch.Tensor) else x, out)
        if func in _INDEXING and isinstance(first, torch.Tensor):
            return self._index(func, args, kwargs)
        leaves, _ = tree_flatten((args, kwargs))
        if not any(isinstance(x, OnCuda) for x in leaves):
            return func(*args, **kwargs)
        return _run(func, args, kwargs, check=func is not torch.Tensor.copy_)  # copy_ may cross devices

    @staticmethod
    def _index(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # CUDA: the indices of a CUDA tensor may be on the CPU, a CPU tensor's may not be on CUDA; a
        # value assigned must be on the tensor's device unless it is a scalar
        leaves, _ = tree_flatten(args[1])
        idx = [x for x in leaves if isinstance(x, torch.Tensor)]
        self_dev = _dev(args[0])
        if any(_dev(t) not in (self_dev, CPU) for t in idx):
            raise DeviceMismatchError(f"indices on {sorted({str(_dev(t)) for t in idx})} for a tensor on {self_dev}")
        if func is torch.Tensor.__setitem__:
            value = args[2]
            if isinstance(value, torch.Tensor) and value.dim() > 0 and _dev(value) != self_dev:
                raise DeviceMismatchError(f"setitem of a tensor on {self_dev} with a value on {_dev(value)}")
        out = func(*tree_map(_unwrap, args), **kwargs)
        return OnCuda(out) if isinstance(out, torch.Tensor) and self_dev.type == "cuda" else out


def to_cuda(model: nn.Module) -> None:
    """Every parameter and buffer of ``model`` on cuda:0 (as :class:`OnCuda`, the same data)."""
    for m in model.modules():
        for k, p in m._parameters.items():
            if p is not None and not isinstance(p, OnCuda):
                m._parameters[k] = nn.Parameter(OnCuda(p.detach()), requires_grad=False)
        for k, b in m._buffers.items():
            if b is not None and not isinstance(b, OnCuda):
                m._buffers[k] = OnCuda(b)
