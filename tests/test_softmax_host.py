"""CPU lane: the softmax family's host path (``ops/softmax/kernel.py``) with its launches recorded,
not run. Its launcher keys are built by hand: each key, with the constexprs beside it, must fix
what Triton specialises every argument on; its plans are worked out once per shape and forgotten
when ``configs.SOFTMAX`` changes."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from splitsoftmax.ops._triton import configs, launch  # noqa: E402

K = pytest.importorskip("splitsoftmax.ops.softmax.kernel")

# config overrides that reach the looped paths at these sizes (as in test_interp_softmax.py)
PATHS = {
    "one_pass": {},
    "two_pass": dict(one_pass_max_cols=16, loop_tile_bytes=32, split_rows_per_sm=0.0, coop_max_chunks=0),
    "split": dict(one_pass_max_cols=16, loop_tile_bytes=32, split_rows_per_sm=1e9, split_min_tiles=1,
                  split_programs_per_sm=4, coop_max_chunks=0),
}


def _spec(fn, args: tuple) -> tuple:
    """Each argument as the launcher's contract keys it: a tensor by dtype and 16-byte alignment,
    an integer by value (a ``do_not_specialize`` one by whether it is typed i32)."""
    out = []
    for unspecialised, a in zip(_unspecialised(fn), args):
        if isinstance(a, torch.Tensor):
            out.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, int):
            out.append(-2 ** 31 <= a < 2 ** 31 if unspecialised else a)
        else:
            out.append(type(a))
    return tuple(out)


def _unspecialised(fn) -> list:
    """Per parameter of the kernel ``fn``: whether it is ``do_not_specialize`` (a ``JITFunction``,
    or the interpreter's ``InterpretedFunction``, which keeps the decorator's arguments)."""
    if hasattr(fn, "params"):
        return [p.do_not_specialize for p in fn.params]
    names = fn.kwargs.get("do_not_specialize") or ()
    return [n in names or i in names for i, n in enumerate(fn.arg_names)]


@pytest.fixture
def launches(monkeypatch):
    """``(kernel name, key, constexprs) -> {argument specialisations}`` of every launch."""
    seen = defaultdict(set)

    def record(self, grid, key, args, kwargs):
        seen[self.fn.fn.__name__, key, tuple(kwargs.items())].add(_spec(self.fn, args))
    monkeypatch.setattr(launch.Launcher, "__call__", record)
    return seen


def _views(dtype):
    """Groups of ``(R, N)`` views with unit column stride: two row strides, each at element
    offsets that misalign the start."""
    g = torch.Generator().manual_seed(0)
    for r, n in ((1, 5), (3, 16), (8, 37), (5, 64), (8, 61)):  # (the last: row stride 64 again)
        group = []
        for stride in (n, n + 3):
            base = torch.randn(r * stride + 8, generator=g).to(dtype)
            group += [base[off:off + r * stride].view(r, stride)[:, :n] for off in (0, 1, 8)]
        yield group


@pytest.mark.parametrize("path", list(PATHS))
def test_launcher_keys_fix_every_specialisation(path, launches, monkeypatch):
    for k, v in PATHS[path].items():
        monkeypatch.setattr(configs.SOFTMAX, k, v)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for group in _views(dtype):
            r = group[0].shape[0]
            lses = torch.randn(r + 1)[1:], torch.randn(r)  # misaligned and aligned
            gs = (*lses, lses[1].to(dtype))
            dys = (*group, group[0].to(torch.float16 if dtype == torch.float32 else torch.float32))
            for x in group:
                for log in (False, True):
                    K.softmax_fwd(x, log)
                    K.normalize(x, lses[0], log)
                    K.normalize(x, lses[1], log)
                    for dy in dys:  # other alignments, row strides and dtypes
                        K.softmax_rowsum(x, dy, log)
                        for lse in lses:
                            K.softmax_bwd(x, dy, lse, log)
                            K.softmax_bwd(x, dy, lse, log, rowsum=lses[0])
                K.lse_rows(x)
                for lse in lses:
                    for g in gs:
                        K.logsumexp_bwd(x, lse, g)
    kernels = {name for name, _, _ in launches}
    assert {"_softmax_fwd_kernel", "_softmax_bwd_kernel", "_normalize_fwd_kernel", "_rowsum_bwd_kernel",
            "_lse_fwd_kernel"} <= kernels
    assert ("_lse_merge_fwd_kernel" in kernels) == (path == "split")
    for (name, key, constexprs), specs in launches.items():
        assert len(specs) == 1, f"{name}: key {key} {constexprs} stands for {len(specs)} specialisations: {specs}"


def test_plans_are_kept_until_the_config_changes(monkeypatch):
    made = []
    plan = configs.softmax_plan
    monkeypatch.setattr(configs, "softmax_plan", lambda *a: made.append(a) or plan(*a))
    x = torch.randn(4, 64)
    assert K._plan(x).path == "one_pass" and K._plan(x).path == "one_pass" and len(made) == 1
    monkeypatch.setattr(configs.SOFTMAX, "one_pass_max_cols", 16)
    assert K._plan(x).path != "one_pass" and len(made) == 2
    monkeypatch.undo()
    assert K._plan(x).path == "one_pass"
    saved = configs.SOFTMAX
    try:
        configs.SOFTMAX = replace(saved, one_pass_max_cols=16, coop_max_chunks=0)
        assert K._plan(x).path == "two_pass"
    finally:
        configs.SOFTMAX = saved
    assert K._plan(x).path == "one_pass"
