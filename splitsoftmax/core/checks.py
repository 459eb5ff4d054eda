"""Argument checks shared by the public functions: each error names the argument and the value."""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import Tensor

SCHEDULES = ("ring", "allgather", "tree", "heads", "heads+ring", "heads+allgather")
MESH_SCHEDULES = ("heads+ring", "heads+allgather")  # those of a 2-D group (sequence x heads)
LAYOUTS = ("contiguous", "zigzag", "balanced")
REDUCTIONS = ("mean", "sum", "none")


def tensor(name: str, x, *, floating: bool = True) -> Tensor:
    if type(x) is Tensor:  # (the common case first: two checks less)
        if floating and not x.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
        return x
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if type(x).__name__ == "DTensor":
        raise TypeError(dtensor_message(name, x))
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    return x


def dtensor_message(name: str, x) -> str:
    """Why a DTensor is refused, and what to pass instead (docs/API.md, "Conventions")."""
    placements = ", ".join(map(str, getattr(x, "placements", ())))
    return (f"{name} is a DTensor (placements [{placements}]): splitsoftmax takes plain tensors. Pass "
            f"{name}.to_local() to the single-device op when the dims it reduces over are whole on every rank "
            f"(Replicate, or Shard of another dim), or to the ss.sharded_* op with group=<that mesh dim> when they "
            f"are sharded (attention: Shard(2), the sequence); wrap the result with DTensor.from_local")


def dim(name: str, d, ndim: int) -> int:
    """Normalise ``d`` into ``[0, ndim)`` (a 0-d tensor counts as 1-d)."""
    if type(d) is not int:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral):  # numpy integers too, as torch
            raise TypeError(f"{name} must be an int, got {type(d).__name__} {d!r}")
        d = int(d)
    n = ndim if ndim > 0 else 1
    if not -n <= d < n:
        raise ValueError(f"{name}={d} is out of range for a tensor with {ndim} dimensions")
    return d % n


def as_float(name: str, value) -> float:
    """Real ``value`` as a float; an int too large for one is a ``ValueError`` naming ``name``."""
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name}={value} is out of the range of a float") from None


def scale(s, head_dim: int) -> float:
    if s is None:
        return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    if isinstance(s, bool) or not isinstance(s, numbers.Real):  # numpy floats too, as torch
        raise TypeError(f"scale must be a float or None, got {type(s).__name__} {s!r}")
    s = as_float("scale", s)
    if not math.isfinite(s):
        raise ValueError(f"scale must be finite, got {s}")
    return s


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def choice(name: str, value, options: tuple) -> str:
    if value not in options:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, options))}")
    return value


def layout(value, cu_seqlens) -> str:
    """A known layout; ``"balanced"`` places whole documents, so it needs ``cu_seqlens``."""
    choice("layout", value, LAYOUTS)
    if value == "balanced" and cu_seqlens is None:
        raise ValueError("layout='balanced' places packed documents and needs cu_seqlens (the documents' "
                         "boundaries), got cu_seqlens=None; pass cu_seqlens, or use layout='zigzag'")
    return value


def same_device_dtype(**named: Tensor) -> None:
    (first, t0), *rest = named.items()
    for name, t in rest:
        if t.device != t0.device:
            raise ValueError(f"{name} is on {t.device} but {first} is on {t0.device}")
        if t.dtype != t0.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but {first} has dtype {t0.dtype}")


def attention_args(q, k, v, scale_: Optional[float], causal) -> float:
    """Check SDPA-layout ``q (B, H, Sq, D)``, ``k (B, Hkv, Sk, D)``, ``v (B, Hkv, Sk, Dv)``; return the scale."""
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and q.dtype == k.dtype == v.dtype
            and q.is_floating_point() and q.dim() == k.dim() == v.dim() == 4 and q.device == k.device == v.device):
        for name, t in (("q", q), ("k", k), ("v", v)):  # (the common case above: one check of each)
            tensor(name, t)
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D (B, heads, seq, head_dim), got shape {tuple(t.shape)}")
        same_device_dtype(q=q, k=k, v=v)
    if causal is not True and causal is not False:
        flag("causal", causal)
    (b, h, _, d), (bk, hkv, sk, dk), (bv, hv, skv, _) = q.shape, k.shape, v.shape
    if bk != b or bv != b:
        raise ValueError(f"batch sizes differ: q has {b}, k has {bk}, v has {bv}")
    if hv != hkv or skv != sk:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in heads and seq")
    if dk != d:
        raise ValueError(f"head_dim of k ({dk}) must equal head_dim of q ({d})")
    if hkv == 0 or h % hkv:
        raise ValueError(f"q heads H={h} must be a multiple of k/v heads Hkv={hkv}")
    return scale(scale_, d)


def merge_args(outs, lses) -> None:
    tensor("outs", outs)
    tensor("lses", lses)
    if outs.dim() < 2:
        raise ValueError(f"outs must be (N, *rows, Dv), got shape {tuple(outs.shape)}")
    if tuple(lses.shape) != tuple(outs.shape[:-1]):
        raise ValueError(f"lses shape {tuple(lses.shape)} must equal outs.shape[:-1] = {tuple(outs.shape[:-1])}")
    if lses.device != outs.device:
        raise ValueError(f"lses is on {lses.device} but outs is on {outs.device}")


def class_targets(target, logits: Tensor, ignore_index) -> None:
    """``target (N,)``: integer class ids of the rows of ``logits (N, V)``, on its device;
    ``ignore_index`` an int (``TypeError`` / ``ValueError`` naming the argument)."""
    tensor("target", target, floating=False)
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class ids, got dtype {target.dtype}")
    if tuple(target.shape) != tuple(logits.shape[:1]):
        raise ValueError(f"target shape {tuple(target.shape)} must be (N,) = ({logits.shape[0]},)")
    if target.device != logits.device:
        raise ValueError(f"target is on {target.device} but logits is on {logits.device}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__} {ignore_index!r}")


def target_values(target: Tensor, ignore_index: int, vocab: int, on_device: bool = False) -> None:
    """Every target is a class id in ``[0, vocab)`` or ``ignore_index`` (skipped while compiling).

    On the CPU a bad target raises ``ValueError`` naming it. On an accelerator the check does not
    wait for the device: like torch's own cross-entropy there, a bad target fails a device-side
    assertion (a host synchronisation per call would cost more than the loss itself), in the
    Triton kernel that computes the row losses (``ce_loss``: ``on_device``), or here.
    """
    if torch.compiler.is_compiling() or target.numel() == 0 or (on_device and target.is_cuda):
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if target.device.type != "cpu":
        torch._assert_async(~bad.any(), f"target holds a class outside [0, {vocab}) that is not "
                                        f"ignore_index={ignore_index}")
        return
    if bool(bad.any()):
        value = int(target[bad][0])
        raise ValueError(f"target holds class {value}, outside [0, {vocab}) and not ignore_index={ignore_index}")
