"""The Gluon forward (ops/attention/gluon/fwd.py) as compiled for sm_90 (Hopper), no GPU needed.

A host call of the plain forward is made on CPU tensors with the launch captured (an sm_90 GPU of
132 SMs assumed); the launch is compiled for sm_90 with the signature it would have. It must take
the Gluon kernel, fit an SM's shared memory and keep its products overlapped.
"""
from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for a GPU target: not under the interpreter", allow_module_level=True)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from _sm90 import ptxas_report, spill_stores  # noqa: E402
from test_attention_bwd_compile import SM90_SMEM, _signature  # noqa: E402
from splitsoftmax.ops.attention import fwd as A  # noqa: E402
from splitsoftmax.ops._triton import configs, launch  # noqa: E402
from splitsoftmax.ops.attention import decode  # noqa: E402
from splitsoftmax.ops._triton import device  # noqa: E402
from splitsoftmax.ops.attention.gluon.bwd import descriptor  # noqa: E402
from splitsoftmax.core.mask import NO_MASK, Mask  # noqa: E402


def _launch(monkeypatch, causal: bool, sq: int, views: bool, gluon: bool = True, lengths=(0, 0), batch: int = 1,
            runs: list = None, mask: Mask = NO_MASK, acc: bool = False):
    """The forward's one launch on bf16 ``(batch, 16, sq, 128)`` queries over 4 kv heads (``views``:
    ``(B, H, S, D)`` views of ``(B, S, H, D)`` tensors) under ``mask``, as captured; ``gluon``,
    ``lengths``: the Gluon forward's flag and least lengths; ``runs`` receives the Gluon forward's
    launch; ``acc``: a ring step's (``attn_fwd_acc`` into a float32 state)."""
    captured = []
    monkeypatch.setattr(launch.Launcher, "__call__",
                        lambda self, grid, key, args, kw: captured.append((self.fn, args, kw)))
    monkeypatch.setattr(configs, "ATTN_FWD_GLUON", gluon)
    monkeypatch.setattr(configs, "ATTN_FWD_GLUON_MIN_SQ", lengths)
    monkeypatch.setattr(A, "sm90", lambda t: True)
    monkeypatch.setattr(A, "hopper", lambda t: True)
    monkeypatch.setattr(device, "hopper", lambda t: True)
    monkeypatch.setattr(decode, "sm_count", lambda t: 132)
    monkeypatch.setattr(A, "sm_count", lambda t: 132)
    monkeypatch.setattr(A, "_FWD_LAUNCHES", launch.Memo())
    runs = [] if runs is None else runs
    monkeypatch.setattr(A, "_run_gluon_fwd", lambda run, q, k, v, out, lse, masks, bound=None: runs.append(run) or captured.append(
        (A._gluon_fwd_launcher().fn, (descriptor(q, run.rows[0]), descriptor(k, run.rows[1]),
                                      descriptor(v, run.rows[1]), out, lse, torch.zeros(2, dtype=torch.int32),
                                      *masks, *run.scalars), run.kwargs)))

    def make(h):
        t = torch.randn(batch, sq, h, 128).to(torch.bfloat16)
        return t.transpose(1, 2) if views else t.transpose(1, 2).contiguous()
    q, k, v = make(16), make(4), make(4)
    if acc:
        A.attn_fwd_acc(q, k, v, 0.088, causal, 0, torch.zeros(batch, 16, sq, 128), torch.zeros(batch, 16, sq),
                       mask=mask)
    else:
        A.attn_fwd(q, k, v, 0.088, causal, out_dtype=torch.bfloat16, mask=mask)
    return captured


def _compile(launched):
    """``(kernel, ptxas report)`` of the captured Gluon forward launch, compiled for sm_90."""
    (fn, args, kwargs), = launched
    assert fn.fn.__name__ == "_attn_fwd_gluon"
    sig, consts, attrs = _signature(fn, args, kwargs)
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = {k: kwargs[k] for k in ("num_warps", "maxnreg") if k in kwargs}
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    assert kernel.metadata.shared <= SM90_SMEM, kernel.metadata.shared
    report = ptxas_report(kernel.asm["ptx"])
    assert "wgmma.mma_async instructions are serialized" not in report, report
    return kernel, report


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("views", [False, True], ids=["contiguous", "views"])
def test_gluon_forward_compiles_for_sm90(causal, views, monkeypatch):
    _, report = _compile(_launch(monkeypatch, causal, 1000, views))
    # within the registers its warpgroups are given, the causal kernel spills a scalar or so (4 bytes
    # with Triton 3.6, none with 3.9); none full
    assert spill_stores(report) <= (16 if causal else 0), report


VARIANTS = {
    "window": Mask(lo=-300),
    "documents": Mask(rows=torch.tensor([[0] * 400 + [400] * 600, [400] * 400 + [1000] * 600], dtype=torch.int32)),
    "softcap": Mask(softcap=30.0),
    "kv_range_offset": Mask(kv_range=torch.tensor([[3, 900]], dtype=torch.int32),
                            q_offset=torch.tensor([5], dtype=torch.int32)),
}


# Spill stores (bytes) of the documents mask where a Triton version allocates the same source
# beyond the bound: ptxas on Triton 3.8.0's PTX gives the softmax warpgroups 168 registers a thread
# and reports "128 bytes stack frame, 292 bytes spill stores, 508 bytes spill loads" (3.6.0: 132
# bytes, 3.9.0: 88, their PTX unchanged by the algebra helpers; 3.8.0 spilled 284 before them); the
# row bounds a masked block reads are what spills.
DOCUMENT_SPILLS = {(3, 8): 292}


def _document_spills(default: int) -> int:
    """The spill bound of the documents mask on this Triton: its record, else ``default``."""
    return DOCUMENT_SPILLS.get(configs.TRITON_VERSION, default)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gluon_forward_variants_compile_for_sm90(variant, monkeypatch):
    """The variants' masks take the Gluon forward too, and it compiles for sm_90 with each: within
    shared memory, products overlapped; the row bounds a masked block reads spill some more scalars
    than the plain causal kernel (up to 132 bytes with Triton 3.6, 88 with 3.9: documents; 3.8 in
    :data:`DOCUMENT_SPILLS`)."""
    monkeypatch.setattr(configs, "ATTN_FWD_GLUON_VARIANTS", True)
    _, report = _compile(_launch(monkeypatch, True, 1000, True, mask=VARIANTS[variant]))
    assert spill_stores(report) <= (_document_spills(160) if variant == "documents" else 160), report


@pytest.mark.parametrize("case", ["causal", "full", "documents"])
def test_gluon_forward_merging_into_a_state_compiles_for_sm90(case, monkeypatch):
    """A ring step's forward (``attn_fwd_acc``: merged into a float32 running state) takes the Gluon
    kernel with its ``ACC``, and compiles for sm_90 within shared memory, products overlapped; the
    state's rows, read as each tile's are stored, spill no more than the kernel writing them."""
    mask = VARIANTS["documents"] if case == "documents" else NO_MASK
    launched = _launch(monkeypatch, case != "full", 1000, True, mask=mask, acc=True)
    assert launched[0][2]["ACC"]
    _, report = _compile(launched)
    assert spill_stores(report) <= (_document_spills(160) if case == "documents" else 16), report


def test_gluon_forward_merging_into_a_state_only_when_on(monkeypatch):
    """With ``configs.ATTN_FWD_GLUON_ACC`` off a ring step's forward takes the Triton kernel."""
    monkeypatch.setattr(configs, "ATTN_FWD_GLUON_ACC", False)
    (fn, _, kwargs), = _launch(monkeypatch, True, 1000, True, acc=True)
    assert fn.fn.__name__ == "_attn_fwd_kernel" and kwargs["ACC"]


def test_gluon_forward_variants_only_when_on(monkeypatch):
    """With ``configs.ATTN_FWD_GLUON_VARIANTS`` off a variant's mask takes the Triton kernel."""
    monkeypatch.setattr(configs, "ATTN_FWD_GLUON_VARIANTS", False)
    (fn, _, _), = _launch(monkeypatch, True, 1000, True, mask=VARIANTS["window"])
    assert fn.fn.__name__ == "_attn_fwd_kernel"


def test_gluon_forward_only_when_on(monkeypatch):
    """With the flag off the Triton kernel runs."""
    (fn, _, _), = _launch(monkeypatch, True, 1000, False, gluon=False)
    assert fn.fn.__name__ == "_attn_fwd_kernel"


@pytest.mark.parametrize("sq,causal,gluon", [(1000, False, False), (1024, False, True), (2047, True, False),
                                             (2048, True, True), (4096, True, True), (5000, False, True)])
def test_gluon_forward_from_its_least_lengths(sq, causal, gluon, monkeypatch):
    """The Gluon forward runs from ``configs.ATTN_FWD_GLUON_MIN_SQ`` queries on (full, causal), where
    it was timed faster than the Triton kernel; shorter rows keep the Triton kernel."""
    (fn, _, _), = _launch(monkeypatch, causal, sq, True, lengths=configs.ATTN_FWD_GLUON_MIN_SQ, batch=4)
    assert (fn.fn.__name__ == "_attn_fwd_gluon") == gluon


@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("batch,tiles", [(1, 8 * 16), (4, 4 * 8 * 16)])
def test_gluon_forward_grid(batch, tiles, persistent, monkeypatch):
    """The Gluon forward's grid: one program per SM (132 here) at the most when persistent, one per
    tile (blocks of 128 queries by B * H heads) otherwise; the tile count and heads go along."""
    monkeypatch.setattr(configs, "ATTN_FWD_GLUON_PERSISTENT", persistent)
    runs = []
    (_, args, _), = _launch(monkeypatch, True, 1000, True, batch=batch, runs=runs)
    run, = runs
    assert run.grid == ((min(tiles, 132) if persistent else tiles),)
    names = A._gluon_fwd_launcher().fn.arg_names
    nb, nbh = (args[names.index(n)] for n in ("NB", "NBH"))
    assert (nb, nbh) == (8, batch * 16)


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "EXP_BITS_BF16"), (torch.float16, "EXP_BITS_FP16")])
def test_exponent_bits_mark_exactly_the_nonfinite(dtype, name):
    """The forward's NaN/Inf check of a masked block takes the largest ``bits & EXP`` of its values:
    over every 2-byte pattern, ``bits & EXP == EXP`` exactly for the NaNs and infinities, and no
    finite value's field reaches it (so the largest field equals it iff one of them is there)."""
    from splitsoftmax.ops.attention.gluon import fwd as G
    exp = getattr(G, name).value
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    field = bits & exp
    nonfinite = ~torch.isfinite(bits.view(dtype))
    assert torch.equal(field == exp, nonfinite)
    assert int(field[~nonfinite].max()) < exp and int(field.min()) >= 0
