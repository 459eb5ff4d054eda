"""Interpreter lane: the fused merge reads strided partials in place (rows walked by one stride) or
through a copy, and its part tile holds more parts than there are (masked parts merge as empty)."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.interpreter
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreter lane: set TRITON_INTERPRET=1 before importing triton", allow_module_level=True)

from splitsoftmax.core import state  # noqa: E402
from splitsoftmax.ops._triton import configs  # noqa: E402
from splitsoftmax.ops.merge import kernel as merge  # noqa: E402


def _partials(n, rows, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(n, *rows, dv, generator=g)
    lses = torch.randn(n, *rows, generator=g) * 3
    lses[0].view(-1)[0] = float("-inf")  # an empty part holding NaN
    outs[0].view(-1, dv)[0] = float("nan")
    return outs, lses


def _check(outs, lses):
    out, lse = merge.merge_out_lse(outs, lses)
    want_out, want_lse = state.merge_out_lse(outs.double(), lses.double())
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert out.is_contiguous() and lse.is_contiguous()
    torch.testing.assert_close(out.double(), want_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["every other part", "sliced rows", "unit dims", "transposed rows", "one row"])
def test_strided_partials(case):
    """Views whose rows one stride walks are read in place; the transposed rows take a copy."""
    if case == "every other part":
        outs, lses = _partials(6, (3, 5), 8)
        outs, lses = outs[::2], lses[::2]
    elif case == "sliced rows":
        outs, lses = _partials(3, (4, 7), 24)
        outs, lses = outs[:, 1:3], lses[:, 1:3]
    elif case == "unit dims":
        outs, lses = _partials(3, (2, 1, 5, 1), 16)
        outs, lses = outs.transpose(2, 4), lses.transpose(2, 4)
    elif case == "transposed rows":
        outs, lses = _partials(4, (16, 3), 8)
        outs, lses = outs.transpose(1, 2), lses.transpose(1, 2)
    else:
        outs, lses = _partials(5, (), 12)
    flat = merge._flat_rows(outs.shape, outs.stride(), lses.stride())
    assert (flat is None) == (case == "transposed rows")
    _check(outs, lses)


@pytest.mark.parametrize("n", [1, 2, 5, 17])
def test_parts_kernel_with_masked_parts(n, monkeypatch):
    """The all-parts kernel at part counts under its tile (``MERGE_PARTS_MIN_BLOCK``) and over it."""
    monkeypatch.setattr(configs, "MERGE_PARTS_PROGRAMS_PER_SM", 1 << 20)
    outs, lses = _partials(n, (3,), 16, seed=n)
    kind, _, kwargs = merge.merge_plan(n, 3, 16, 4, False)
    assert kind == "parts" and kwargs["BLOCK_P"] == max(configs.MERGE_PARTS_MIN_BLOCK, 1 << (n - 1).bit_length())
    _check(outs, lses)


def test_repeated_merge_states_is_one_lookup(monkeypatch):
    """``ss.merge_states`` recording no gradient, float32 partials of a geometry that ran before: no
    checks, no route, no plan, the outputs as the op's path makes them and against float64 every
    call. A setting the merge reads, another geometry or a misaligned copy is worked out anew;
    bfloat16 partials and a gradient to record take the op's path every time."""
    import splitsoftmax as ss
    from splitsoftmax.core.runtime import Memo
    from splitsoftmax.ops.merge import api
    monkeypatch.setattr(api, "_RUNNERS", Memo())
    worked = []
    for mod, name in ((api._checks, "merge_args"), (api, "call")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _fn=fn, _n=name, **kw: worked.append(_n) or _fn(*a, **kw))
    outs, lses = _partials(4, (3, 5), 16)

    def run(o, l):
        n = len(worked)
        out, lse = ss.merge_states(o, l)
        want_out, want_lse = state.merge_out_lse(o.double(), l.double())
        assert out.dtype == o.dtype and lse.dtype == torch.float32 and out.is_contiguous() and lse.is_contiguous()
        torch.testing.assert_close(out.double(), want_out, rtol=1e-6 if o.dtype == torch.float32 else 1e-2,
                                   atol=1e-6 if o.dtype == torch.float32 else 1e-2)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
        return worked[n:]

    assert run(outs, lses) == ["merge_args", "call"] and run(outs, lses) == [] and run(outs.clone(), lses) == []
    monkeypatch.setattr(configs, "MERGE_PARTS_PROGRAMS_PER_SM", configs.MERGE_PARTS_PROGRAMS_PER_SM + 1)
    assert run(outs, lses) != [] and run(outs, lses) == []
    assert run(outs[:3], lses[:3]) != [] and run(outs[:3], lses[:3]) == []
    off = torch.empty(outs.numel() + 1)[1:].view(outs.shape).copy_(outs)
    assert off.data_ptr() % 16 != 0 and run(off, lses) != [] and run(off, lses) == []
    low = outs.bfloat16()
    assert run(low, lses) != [] and run(low, lses) != []
    grad = outs.clone().requires_grad_()
    with torch.enable_grad():
        n = len(worked)
        assert ss.merge_states(grad, lses)[0].grad_fn is not None and worked[n:] == ["merge_args", "call"]
