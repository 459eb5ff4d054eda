"""The attention backward's kernels as compiled for sm_90 (Hopper), no GPU needed.

A host call is made on meta-free CPU tensors with the launches captured (Hopper assumed, 132 SMs);
each launch is then compiled for sm_90 with the signature it would have: the deterministic pair
(masks on and off), the five-product kernel with its TMA descriptors and reductions, and the
pre-pass. Each must compile and fit an SM's shared memory; the Gluon kernels also with the variants'
masks.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for a GPU target: not under the interpreter", allow_module_level=True)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from _sm90 import ptxas_report, spill_stores  # noqa: E402
from splitsoftmax.ops.attention import bwd as AB  # noqa: E402
from splitsoftmax.ops._triton import configs, launch  # noqa: E402
from splitsoftmax.core.mask import Mask  # noqa: E402

SM90_SMEM = 227 * 1024
TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32"}


def _signature(fn, args, kwargs):
    """``(signature, constexprs, attrs)`` of a launch as Triton would specialise it."""
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if i >= len(args):
            sig[name], consts[name] = "constexpr", kwargs.get(name, fn.params[i].default)
            continue
        a = args[i]
        if a is None:  # (an absent operand: a constexpr, as Triton specialises it)
            sig[name], consts[name] = "constexpr", None
        elif isinstance(a, torch.Tensor):
            sig[name] = "*" + TY[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]] if a.data_ptr() % 16 == 0 else []
        elif isinstance(a, TensorDescriptor):
            sig[name] = f"tensordesc<{TY[a.base.dtype]}[{','.join(map(str, a.block_shape))}]>"
        elif isinstance(a, GluonDescriptor):
            sig[name] = mangle_type(a)
        elif isinstance(a, int) and a == 1 and name not in fn.do_not_specialize:
            sig[name], consts[name] = "constexpr", 1
        elif isinstance(a, int):
            sig[name] = "i32"
            if a % 16 == 0 and name not in fn.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return sig, consts, {k: v for k, v in attrs.items() if v}


def _launches(monkeypatch, atomic: bool, mask: Mask, tma: bool = False, gluon: bool = False, causal: bool = True,
              ds: bool = True, sinks: bool = False, dtype: torch.dtype = torch.bfloat16):
    from splitsoftmax.ops.attention import bwd_plain as ABP
    captured = []
    monkeypatch.setattr(launch.Launcher, "__call__",
                        lambda self, grid, key, args, kw: captured.append((self.fn, args, kw)))
    monkeypatch.setattr(AB, "hopper", lambda t: True)
    monkeypatch.setattr(AB, "sm_count", lambda t: 132)
    monkeypatch.setattr(ABP, "hopper", lambda t: True)
    monkeypatch.setattr(ABP, "sm90", lambda t: gluon)
    monkeypatch.setattr(ABP, "_LAUNCHES", launch.Memo())  # (it keys on the device, not on sm90)
    monkeypatch.setattr(configs, "ATTN_BWD_ATOMIC", atomic)
    monkeypatch.setattr(configs, "ATTN_BWD_TMA", tma)
    monkeypatch.setattr(configs, "ATTN_BWD_DS", ds)
    q, dout = (torch.randn(1, 16, 512, 128).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, 4, 512, 128).to(dtype) for _ in range(2))
    lse, delta = torch.randn(1, 16, 512), torch.randn(1, 16, 512)
    AB.attn_bwd(q, k, v, dout, lse, delta, 0.1, causal, 0, mask, out_dtype=dtype,
                sinks=torch.randn(16) if sinks else None)
    return captured


MASK = Mask(lo=-100, softcap=30.0, kv_range=torch.tensor([[0, 500]], dtype=torch.int32),
            q_offset=torch.tensor([3], dtype=torch.int32),
            rows=torch.stack((torch.zeros(512), torch.full((512,), 512))).to(torch.int32))


COMPILE_CASES = [
    (False, Mask(), False, False, True, True, 0), (False, Mask(), True, False, True, True, 0),
    (False, Mask(), True, True, True, True, 72), (False, Mask(), True, True, False, True, 28),
    (False, Mask(), True, True, True, False, 72),
    (False, MASK, False, False, True, True, 0), (False, MASK, True, True, True, True, 292),
    (False, MASK, True, True, True, False, 292), (False, Mask(softcap=20.0), True, True, False, True, 100),
    (True, Mask(), False, False, True, True, 0)]
COMPILE_IDS = ["pair", "pair-tma", "pair-gluon", "pair-gluon-full", "pair-gluon-recompute", "pair-masks",
               "gluon-masks", "gluon-masks-recompute", "gluon-softcap-full", "five-product"]


@pytest.mark.parametrize("atomic,mask,tma,gluon,causal,ds,kv_spills", COMPILE_CASES, ids=COMPILE_IDS)
def test_backward_compiles_for_sm90(atomic, mask, tma, gluon, causal, ds, kv_spills, monkeypatch):
    """Every backward launch compiles for sm_90 within its shared memory; the Gluon kernels without
    serialized products, within their spill bounds, their registers moved between warpgroups. The
    Gluon pair's dQ kernel reads the ``dS`` the dK/dV kernel wrote (``configs.ATTN_BWD_DS``), with
    every mask, else recomputes it."""
    launches = _launches(monkeypatch, atomic, mask, tma, gluon, causal, ds)
    _check_compiled(launches, atomic, mask, tma, gluon, ds, kv_spills)


# The sinks' variants of the dK/dV kernels (``SINK``: per key, the running sums of ``p_sink P dP`` over
# a query head's tiles, the head's sink and each tile's ``p_sink``) spill within the bounds of their
# launches without sinks, but where a Triton version's ptxas spills more in the Gluon kernel's first
# score warpgroup (most in the loop of its masked tiles, which holds every mask's values beside the
# tile; the sums added into memory tile by tile instead spilled more on 3.6 and 3.7). Those are
# (Triton version, launch) -> ptxas's spill stores in bytes; without sinks the same launches spill
# 284, 284 (3.6), 284, 212 (3.7), 228, 228, 24, 40 (3.8). Triton 3.9 spills 4, 0, 4, 68, 76 and 0
# bytes with sinks (pair-gluon, -full, -recompute, gluon-masks, -recompute, gluon-softcap-full).
SINK_SPILLS = {((3, 6), "gluon-masks"): 480, ((3, 6), "gluon-masks-recompute"): 480,
               ((3, 7), "gluon-masks"): 452, ((3, 7), "gluon-masks-recompute"): 460,
               ((3, 8), "gluon-masks"): 476, ((3, 8), "gluon-masks-recompute"): 472,
               ((3, 8), "pair-gluon"): 124, ((3, 8), "pair-gluon-recompute"): 128}


@pytest.mark.parametrize("atomic,mask,tma,gluon,causal,ds,kv_spills", COMPILE_CASES, ids=COMPILE_IDS)
def test_backward_with_sinks_compiles_for_sm90(atomic, mask, tma, gluon, causal, ds, kv_spills, request,
                                               monkeypatch):
    """With sinks the dK/dV launch takes ``SINK`` and its operands (the dQ launch is the same): every
    launch compiles as :func:`test_backward_compiles_for_sm90` checks it, within the same spill
    bounds but those of :data:`SINK_SPILLS`."""
    launches = _launches(monkeypatch, atomic, mask, tma, gluon, causal, ds, sinks=True)
    kv = [kwargs for fn, _, kwargs in launches if "_kv_" in fn.fn.__name__]
    assert len(kv) == 1 and kv[0]["SINK"] is True
    case = request.node.callspec.id
    _check_compiled(launches, atomic, mask, tma, gluon, ds,
                    SINK_SPILLS.get((configs.TRITON_VERSION[:2], case), kv_spills))


def _check_compiled(launches, atomic, mask, tma, gluon, ds, kv_spills):
    """The checks of :func:`test_backward_compiles_for_sm90` on ``launches``."""
    if tma:
        assert all(any(isinstance(a, (TensorDescriptor, GluonDescriptor)) for a in args) for _, args, _ in launches)
    names = [fn.fn.__name__ for fn, _, _ in launches]
    dq = "_attn_bwd_q_ds_kernel" if ds else "_attn_bwd_q_gluon"
    pair = ["_attn_bwd_kv_ws", dq] if gluon else ["_attn_bwd_kv_kernel", "_attn_bwd_q_kernel"]
    assert names == (["_attn_bwd_pre_kernel", "_attn_bwd_kv_kernel"] if atomic else pair)
    for fn, args, kwargs in launches:
        sig, consts, attrs = _signature(fn, args, kwargs)
        src = (GluonASTSource if fn.is_gluon() else ASTSource)(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        opts = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        assert kernel.metadata.shared <= SM90_SMEM, (fn.fn.__name__, kernel.metadata.shared)
        if fn.is_gluon():  # their tiles run without spills, and the products overlap as written
            report = ptxas_report(kernel.asm["ptx"])
            assert "wgmma.mma_async instructions are serialized" not in report, report
            # (but the dK/dV kernel's first score warpgroup, which also holds the program's own values
            # within the registers that the gradient one leaves it, spills ``kv_spills`` bytes: most in
            # the loop of its masked tiles, a few per program; its plain launches timed as fast as with
            # the 16 bytes of a kernel that took no masks)
            assert spill_stores(report) <= (kv_spills if fn.fn.__name__ == "_attn_bwd_kv_ws" else 0), report
        if fn.fn.__name__ == "_attn_bwd_q_ds_kernel":  # two programs share an SM: registers and shared memory
            report = ptxas_report(kernel.asm["ptx"])
            used = int(re.search(r"Used (\d+) registers", report).group(1))
            assert kwargs.get("maxnreg") == 128 and used <= 128 and 2 * kernel.metadata.shared <= SM90_SMEM, report
            # (a few spilled bytes with a plain mask; with every variant's mask at once 80-136: the
            # documents' and window's launches timed faster at 128 registers than unbounded all the same)
            assert spill_stores(report) <= (4 if mask.plain() else 160), report
        if fn.fn.__name__ == "_attn_bwd_kv_ws":  # its warpgroups' registers are moved within the launch's
            assert "setmaxnreg.inc" in kernel.asm["ptx"] and f".maxnreg {kwargs['maxnreg']}" in kernel.asm["ptx"]
            assert kwargs["maxnreg"] * 4 * 128 <= 64 * 1024  # (three warpgroups and the producer's, padded)


# The fused backward's launch (configs.ATTN_BWD_FUSED) by (visibility, mask): ptxas's spill stores on
# sm_90 at 240 registers per MMA warpgroup and 24 for the producer warp, by the Triton version (the same
# in float16 as in bfloat16 but where FUSED_SPILLS_FP16 says). Those at 0 are in
# configs.ATTN_BWD_FUSED_MASKS: with Triton 3.9 every one; Triton 3.6-3.8 spill in every launch, and
# there the pair runs.
FUSED_MASKS = {"plain": Mask(), "window": Mask(lo=-100), "kv_range": Mask(kv_range=MASK.kv_range),
               "q_offset": Mask(q_offset=MASK.q_offset),
               "window-kv_range-q_offset": Mask(lo=-100, kv_range=MASK.kv_range, q_offset=MASK.q_offset),
               "documents": Mask(rows=MASK.rows), "softcap": Mask(softcap=20.0)}
FUSED_SPILLS_39 = {(v, m): 0 for v in ("full", "causal") for m in FUSED_MASKS}
FUSED_SPILLS = {
    (3, 6): {("full", "plain"): 260, ("causal", "plain"): 480,
             ("full", "window"): 504, ("causal", "window"): 488,
             ("full", "kv_range"): 444, ("causal", "kv_range"): 476,
             ("full", "q_offset"): 260, ("causal", "q_offset"): 484,
             ("full", "window-kv_range-q_offset"): 484, ("causal", "window-kv_range-q_offset"): 480,
             ("full", "documents"): 484, ("causal", "documents"): 552,
             ("full", "softcap"): 196, ("causal", "softcap"): 480},
    (3, 7): {("full", "plain"): 264, ("causal", "plain"): 476,
             ("full", "window"): 492, ("causal", "window"): 496,
             ("full", "kv_range"): 452, ("causal", "kv_range"): 480,
             ("full", "q_offset"): 264, ("causal", "q_offset"): 476,
             ("full", "window-kv_range-q_offset"): 476, ("causal", "window-kv_range-q_offset"): 484,
             ("full", "documents"): 500, ("causal", "documents"): 536,
             ("full", "softcap"): 204, ("causal", "softcap"): 408},
    (3, 8): {("full", "plain"): 256, ("causal", "plain"): 468,
             ("full", "window"): 484, ("causal", "window"): 472,
             ("full", "kv_range"): 460, ("causal", "kv_range"): 456,
             ("full", "q_offset"): 256, ("causal", "q_offset"): 468,
             ("full", "window-kv_range-q_offset"): 468, ("causal", "window-kv_range-q_offset"): 488,
             ("full", "documents"): 484, ("causal", "documents"): 560,
             ("full", "softcap"): 220, ("causal", "softcap"): 428},
}.get(configs.TRITON_VERSION[:2], FUSED_SPILLS_39)
FUSED_SPILLS_FP16 = {(3, 8): {("causal", "plain"): 472}}.get(configs.TRITON_VERSION[:2], {})
FUSED_CASES = [(v, m, torch.bfloat16) for v, m in FUSED_SPILLS] + [(v, "plain", torch.float16)
                                                                   for v in ("full", "causal")]


@pytest.mark.parametrize("vis,mask,dtype", FUSED_CASES, ids=[f"{v}-{m}-{TY[t]}" for v, m, t in FUSED_CASES])
def test_fused_backward_compiles_for_sm90(vis, mask, dtype, monkeypatch):
    """With ``configs.ATTN_BWD_FUSED`` (and the visibility and mask allowed) a Hopper backward of 2-byte
    inputs at D=128 (GQA 16/4) is one launch of the fused kernel, which compiles for sm_90 within an
    SM's shared memory, its products not serialized, its registers moved to 240 per MMA warpgroup and
    24 for the producer (``setmaxnreg``) out of ``maxnreg`` 168, spilling no more than
    :data:`FUSED_SPILLS` (0 where dispatched); without the allowance the pair runs."""
    from splitsoftmax.ops.attention import bwd_plain as ABP
    monkeypatch.setattr(configs, "ATTN_BWD_FUSED", True)
    causal = vis == "causal"
    used = {vis, *ABP._mask_fields(FUSED_MASKS[mask])}
    assert (used <= configs.ATTN_BWD_FUSED_MASKS) == (FUSED_SPILLS[(vis, mask)] == 0)
    monkeypatch.setattr(configs, "ATTN_BWD_FUSED_MASKS", frozenset(used))
    launches = _launches(monkeypatch, False, FUSED_MASKS[mask], True, True, causal, dtype=dtype)
    assert [fn.fn.__name__ for fn, _, _ in launches] == ["_attn_bwd_fused"]
    fn, args, kwargs = launches[0]
    sig, consts, attrs = _signature(fn, args, kwargs)
    opts = {k: kwargs[k] for k in ("num_warps", "maxnreg")}
    kernel = triton.compile(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=opts)
    assert kernel.metadata.shared <= SM90_SMEM, kernel.metadata.shared
    ptx = kernel.asm["ptx"]
    report = ptxas_report(ptx)
    assert "wgmma.mma_async instructions are serialized" not in report, report
    spills = FUSED_SPILLS_FP16.get((vis, mask)) if dtype == torch.float16 else None
    assert spill_stores(report) <= (FUSED_SPILLS[(vis, mask)] if spills is None else spills), report
    regs = {int(n) for n in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx)}
    assert kwargs["maxnreg"] == 168 and ".maxnreg 168" in ptx and 240 in regs, regs
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
    monkeypatch.setattr(configs, "ATTN_BWD_FUSED_MASKS", frozenset())
    assert [fn.fn.__name__ for fn, _, _ in _launches(monkeypatch, False, FUSED_MASKS[mask], True, True, causal,
                                                     dtype=dtype)] != ["_attn_bwd_fused"]


def test_fused_backward_keeps_the_pair_when_deterministic(monkeypatch):
    """Under ``torch.use_deterministic_algorithms(True)`` the fused backward, though on, is not taken:
    the atomic-free Gluon pair runs (bitwise reproducible)."""
    monkeypatch.setattr(configs, "ATTN_BWD_FUSED", True)
    monkeypatch.setattr(configs, "ATTN_BWD_FUSED_MASKS", frozenset({"full"}))
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        launches = _launches(monkeypatch, False, Mask(), True, True, False)
    finally:
        torch.use_deterministic_algorithms(was)
    assert [fn.fn.__name__ for fn, _, _ in launches] == ["_attn_bwd_kv_ws", "_attn_bwd_q_ds_kernel"]
    assert [fn.fn.__name__ for fn, _, _ in _launches(monkeypatch, False, Mask(), True, True, False)] == [
        "_attn_bwd_fused"]


def test_deterministic_algorithms_keep_the_gluon_pair(monkeypatch):
    """Under ``torch.use_deterministic_algorithms(True)`` a Hopper launch that would take the
    five-product kernel (``ATTN_BWD_ATOMIC``) takes the Gluon pair, atomic-free and so bitwise
    reproducible (the GPU lane repeats it), as it does with the flag off and the five-product kernel
    not chosen."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        launches = _launches(monkeypatch, True, Mask(), True, True)
    finally:
        torch.use_deterministic_algorithms(was)
    assert [fn.fn.__name__ for fn, _, _ in launches] == ["_attn_bwd_kv_ws", "_attn_bwd_q_ds_kernel"]
    assert [fn.fn.__name__ for fn, _, _ in _launches(monkeypatch, False, Mask(), True, True)] == [
        "_attn_bwd_kv_ws", "_attn_bwd_q_ds_kernel"]


def _pieces_plan(monkeypatch, cap: int, hkv: int) -> tuple:
    """``(plan, ops)`` of the backward at B=2, 8 query heads over ``hkv``, 300 causal rows (bf16, D=128)
    on a Hopper of 5 SMs (each piece's 5 key blocks per kv head fill a wave), the dS buffer's bound
    ``cap`` bytes; ``ops``: ``(q, k, v, dout, lse, delta, dq, dk, dv)``."""
    from splitsoftmax.ops.attention import bwd_plain as ABP
    monkeypatch.setattr(configs, "ATTN_BWD_DS_MAX_BYTES", cap)
    monkeypatch.setattr(configs, "ATTN_BWD_DS_MIN_WAVES", 1)
    monkeypatch.setattr(ABP, "sm_count", lambda t: 5)
    monkeypatch.setattr(ABP, "hopper", lambda t: True)
    monkeypatch.setattr(ABP, "sm90", lambda t: True)
    monkeypatch.setattr(configs, "ATTN_BWD_TMA", True)
    monkeypatch.setattr(ABP, "_LAUNCHES", launch.Memo())
    q, dout = (torch.randn(2, 8, 300, 128).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, hkv, 300, 128).to(torch.bfloat16) for _ in range(2))
    lse, delta = torch.randn(2, 8, 300), torch.randn(2, 8, 300)
    ops = (q, k, v, dout, lse, delta, *(torch.empty_like(t) for t in (q, k, v)))
    return ABP._plan(*ops, 0.1, True, 0, Mask()), ops


@pytest.mark.parametrize("cap_units,pieces", [
    (16, None), (8, None), (7, [(0, 1, 0, 4), (1, 2, 0, 4)]), (4, [(0, 1, 0, 4), (1, 2, 0, 4)]),
    (2, [(0, 1, 0, 2), (0, 1, 2, 4), (1, 2, 0, 2), (1, 2, 2, 4)]), (3, [(0, 1, 0, 3), (0, 1, 3, 4), (1, 2, 0, 3),
                                                                       (1, 2, 3, 4)]), (0, "recompute")])
def test_backward_pieces_keep_the_ds_buffer_within_its_bound(cap_units, pieces, monkeypatch):
    """Where the dS buffer of the whole backward passes ``ATTN_BWD_DS_MAX_BYTES`` the pair runs in
    pieces (whole batch elements while they fit, else kv heads of one) that cover every (batch, kv
    head) once, each piece's buffer within the bound; where not even one query head fits, the dQ
    kernel recomputes dS. B=2, 8/4 heads, 300 rows: one (batch, kv head) is 2 x 320 x 320 x 2 bytes."""
    from splitsoftmax.ops.attention import bwd_plain as ABP
    plan, ops = _pieces_plan(monkeypatch, cap_units * 2 * 320 * 320 * 2, 4)
    q, grads = ops[0], ops[6:]
    got = [p for p, _ in plan]
    assert got == (pieces if isinstance(pieces, list) else [None])
    for piece, run in plan:
        assert (run.ds is None) == (pieces == "recompute")
        if run.ds:
            assert run.ds[0] * run.ds[1] * 2 <= configs.ATTN_BWD_DS_MAX_BYTES
        if piece:
            views = ABP._piece(ops, piece)
            b0, b1, h0, h1 = piece
            assert views[0].data_ptr() == q[b0, 2 * h0].data_ptr() and views[0].shape[:2] == (b1 - b0, 2 * (h1 - h0))
            assert views[7].data_ptr() == grads[1][b0, h0].data_ptr() and views[7].shape[:2] == (b1 - b0, h1 - h0)
    if isinstance(pieces, list):  # every (batch, kv head) once
        covered = sorted((i, j) for b0, b1, h0, h1 in pieces for i in range(b0, b1) for j in range(h0, h1))
        assert covered == [(i, j) for i in range(2) for j in range(4)]


def test_backward_parts_of_a_kv_heads_query_heads(monkeypatch):
    """Where one (batch element, kv head)'s dS buffer passes the bound but one query head's fits, the
    pieces are parts of each kv head's query heads, in order, each within the bound, every query head
    once; their launches take float32 dK/dV buffers (the parts' sum, rounded once). B=2, 8/2 heads
    (4 query heads a kv head), 300 rows: one query head is 320 x 320 x 2 bytes."""
    from splitsoftmax.ops.attention import bwd_plain as ABP
    plan, ops = _pieces_plan(monkeypatch, 3 * 320 * 320 * 2, 2)
    q, grads = ops[0], ops[6:]
    assert [p for p, _ in plan] == [(i, i + 1, j, j + 1, a, min(a + 3, 4)) for i in range(2) for j in range(2)
                                    for a in (0, 3)]
    for piece, run in plan:
        assert run.ds and run.ds[0] * run.ds[1] * 2 <= configs.ATTN_BWD_DS_MAX_BYTES
        i, _, j, _, a, e = piece
        views = ABP._piece(ops, piece)
        assert views[0].data_ptr() == q[i, 4 * j + a].data_ptr() and views[0].shape[:2] == (1, e - a)
        assert views[7].data_ptr() == grads[1][i, j].data_ptr() and views[7].shape[:2] == (1, 1)
        # the dK/dV launch writes float32 buffers of the part (dense), not the bfloat16 gradients
        assert run.kv[1][0] == ABP._launches(*views[:7], *ABP._part_grads(views[7:]), 0.1, True, 0, Mask(),
                                              piece).kv[1][0]
        assert run.kv[1][0] != ABP._launches(*views, 0.1, True, 0, Mask(), piece).kv[1][0]


def test_parts_sum_their_dk_dv_in_float32_into_the_kv_heads(monkeypatch):
    """Run in parts (the launches replaced by a record that writes each part's query-head count), a kv
    head's dK and dV are the float32 sum of its parts' buffers, written once into its bfloat16
    gradients after its last part; dQ goes straight to each part's query heads."""
    from splitsoftmax.ops.attention import bwd_plain as ABP
    plan, ops = _pieces_plan(monkeypatch, 3 * 320 * 320 * 2, 2)
    seen = []

    def run(launches, q, k, v, dout, lse, delta, dq, dk, dv, mts):
        seen.append((dk.dtype, dv.dtype, dk.data_ptr() == ops[7].data_ptr()))
        dq.fill_(q.shape[1])
        dk.fill_(0.25 * q.shape[1])  # (3 + 1 parts of query heads: 0.75 + 0.25 in float32)
        dv.fill_(1 / 3 * q.shape[1])
    monkeypatch.setattr(ABP, "_run", run)
    for t in ops[6:]:
        t.fill_(float("nan"))
    ABP._run_pieces(plan, ops, Mask(), None)
    assert seen == [(torch.float32, torch.float32, False)] * 8
    dq, dk, dv = ops[6:]
    assert torch.equal(dq[:, [0, 1, 2, 4, 5, 6]].float(), torch.full_like(dq[:, :6].float(), 3))
    assert torch.equal(dq[:, [3, 7]].float(), torch.ones_like(dq[:, :2].float()))
    assert torch.equal(dk.float(), torch.ones_like(dk.float()))
    want = (torch.tensor(1 / 3 * 3, dtype=torch.float32) + torch.tensor(1 / 3, dtype=torch.float32)).to(dv.dtype)
    assert torch.equal(dv, torch.full_like(dv, want.item()))


@pytest.mark.parametrize("causal,cu,window,sq,sk,fewer", [
    (True, None, None, 1000, 1000, False), (False, None, None, 700, 900, False),
    (True, None, (300, 0), 2000, 2000, True), (True, None, (64, 0), 1000, 1300, True),
    (True, [0, 100, 100, 900, 1000, 2000], None, 2000, 2000, True),
    (False, [0, 1, 65, 600, 1100, 1500, 2000], None, 2000, 2000, False),
    (True, [0, 500, 1300, 2000], (200, 0), 2000, 2000, True),
    (True, list(range(0, 4097, 256)), None, 4096, 4096, True)])
def test_ds_buffer_columns_hold_every_visited_tile(causal, cu, window, sq, sk, fewer):
    """The ``dS^T`` buffer's columns (``_ds_cols``) hold every tile the dK/dV kernel visits, a causal
    key block's from its first row in the band rounded down to the dQ kernel's tile, for masks made
    as ``ss.attention`` makes them (the documents' rows noted with their reach); fewer than ``Sq``
    under a causal window or short causal documents."""
    from splitsoftmax.core import keywords as variants
    from splitsoftmax.ops.attention import bwd_plain as ABP
    from splitsoftmax.core.mask import visible
    spec = variants.parse(batch=1, heads=1, sq=sq, sk=sk, device="cpu", causal=causal, cu_seqlens=cu,
                          window_size=window, q_offset=sk - sq)
    mask, band, diag = variants.local_mask(spec, 0, sq, 0, sk, "cpu")
    gkv, bmq = configs.ATTN_TILES[("bwd_kv_ws", 2, 128)], configs.ATTN_TILES[("bwd_q_ds", 2, 128)][0]
    bm, bn = gkv[:2]
    cols = ABP._ds_cols(sq, gkv, 128, mask, band, diag)
    seen = visible(mask, band, diag, 1, sq, sk)[0].T  # [Sk, Sq]
    need = 0
    for n0 in range(0, sk, bn):
        rows = seen[n0:n0 + bn].any(0).nonzero()
        if rows.numel():
            first = max(n0 - diag, 0) // bm if band else 0
            assert first <= rows.min().item() // bm
            need = max(need, (rows.max().item() // bm + 1) * bm - first * bm // bmq * bmq)
    assert need <= cols <= -(-sq // bm) * bm
    assert (cols < -(-sq // bm) * bm) == fewer


def test_fused_backward_row_fields():
    """The fused kernel's per-row fields, one TMA tile per query tile: ``lse * log2(e)`` (``+inf``
    where ``lse = -inf``), ``delta``, and with documents each row's bounds as int32 bits; the padding
    past ``Sq`` gives ``p = 0`` and no key seen."""
    from splitsoftmax.ops.attention.gluon.bwd_fused import _row_stats
    g = torch.Generator().manual_seed(3)
    lse, delta = torch.randn(2, 3, 70, generator=g), torch.randn(2, 3, 70, generator=g)
    lse[1, 2, 5] = float("-inf")
    rows = torch.stack((torch.arange(70) // 10 * 10, torch.arange(70) // 10 * 10 + 10)).to(torch.int32)
    plain, docs = _row_stats(lse, delta, None, 64), _row_stats(lse, delta, rows, 64)
    assert plain.shape == (2, 3, 2, 128) and docs.shape == (2, 3, 4, 128)
    for st in (plain, docs):
        want = torch.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        assert torch.allclose(st[:, :, 0, :70], want, rtol=1e-6) and st[1, 2, 0, 5] == float("inf")
        assert torch.equal(st[:, :, 1, :70], delta)
        assert (st[:, :, 0, 70:] == float("inf")).all() and (st[:, :, 1, 70:] == 0).all()
    bounds = docs.view(torch.int32)[:, :, 2:]
    assert torch.equal(bounds[..., :70], rows.expand(2, 3, 2, 70)) and (bounds[..., 70:] == 0).all()
