"""Correctness cases of every sharded op, runnable on any group.

Each ``case_*(group)`` builds the full inputs from a fixed seed on every rank, shards them, and
asserts forward and backward against float64 single-device results. Here they run on the
in-process loopback world (P in 1, 2, 3, 5, 8); test_dist_gloo.py and test_dist_mpi.py run the
same functions in Gloo and MPI worker processes.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from splitsoftmax import sharded_attention, sharded_log_softmax, sharded_logsumexp, sharded_softmax
from splitsoftmax.distributed import LoopbackWorld, as_comm, shard, unshard

from splitsoftmax.core import reference as ref
from splitsoftmax.distributed.handshake import REASON_BYTES, handshake
from splitsoftmax.ops._registry import use_triton

NEG_INF = float("-inf")
F32 = dict(atol=3e-5, rtol=3e-5)
# float64 inputs: exact to rounding on the torch path; Triton kernels (interpreter lane) compute in float32
F64 = F32 if use_triton(torch.zeros(0)) else dict(atol=1e-10, rtol=1e-9)
# where the cases put their tensors: the CPU, or "cuda" (the rank's current GPU) in NCCL workers
DEVICE = torch.device(os.environ.get("SPLITSOFTMAX_TEST_DEVICE", "cpu"))


def _randn(g, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE, dtype)


def uneven_lengths(p: int, seed: int) -> list:
    """Unequal shard lengths in 1..6, with one rank empty when P > 1."""
    lens = torch.randint(1, 7, (p,), generator=torch.Generator().manual_seed(seed)).tolist()
    if p > 1:
        lens[seed % p] = 0
    return lens


def _ref_softmax(x, dy, dim, log):
    """float64 softmax / log-softmax (the package's oracle) and its input gradient by autograd;
    all ``-inf`` rows give 0 / -inf and dx 0."""
    x = x.detach().double().requires_grad_()
    y = (ref.log_softmax if log else ref.softmax)(x, dim)
    (dx,) = torch.autograd.grad(y, x, dy.double())
    return y.detach(), dx


def _clean(t, dim=1):
    """``t`` (float64) without the row holding the NaN input, which must not reach any other row."""
    t = t.double().clone()
    t.select(-1, 2)[1] = 0.0
    assert not torch.isnan(t).any(), "NaN reached a row that does not depend on it"
    return t


def case_softmax(group):
    """sharded_softmax / log_softmax / logsumexp: uneven and empty shards, -inf and NaN rows."""
    c = as_comm(group)
    for dtype, tol in ((torch.float64, F64), (torch.float32, F32)):
        lens = uneven_lengths(c.size, 1)
        g = torch.Generator().manual_seed(2)
        x = _randn(g, 3, sum(lens), 4, dtype=dtype)
        x[0, :, 1] = NEG_INF  # an all -inf row: zeros, no NaN
        if sum(lens):
            x[1, sum(lens) - 1, 2] = float("nan")  # reaches row (1, 2) only
        dy = _randn(g, 3, sum(lens), 4)
        xs = x.split(lens, 1)[c.rank].clone().requires_grad_()
        dys = dy.split(lens, 1)[c.rank]
        for log, fn in ((False, sharded_softmax), (True, sharded_log_softmax)):
            y = fn(xs, dim=1, group=group)
            y_ref, dx_ref = _ref_softmax(x, dy, 1, log)
            assert y.dtype == dtype and y.shape == xs.shape
            torch.testing.assert_close(_clean(y), _clean(y_ref.split(lens, 1)[c.rank]), **tol)
            (dx,) = torch.autograd.grad(y, xs, dys.to(dtype))
            torch.testing.assert_close(_clean(dx), _clean(dx_ref.split(lens, 1)[c.rank]), **tol)
        lse = sharded_logsumexp(xs, dim=-2, group=group)
        lse_ref = torch.logsumexp(x.double(), 1)
        assert lse.dtype == torch.float32 and lse.shape == (3, 4)
        torch.testing.assert_close(_clean(lse, 0), _clean(lse_ref, 0), **F32)
        gl = _randn(g, 3, 4)
        (dx,) = torch.autograd.grad(lse, xs, gl.float())
        p = torch.where(lse_ref.unsqueeze(1) == NEG_INF, 0.0, torch.exp(x.double() - lse_ref.unsqueeze(1)))
        torch.testing.assert_close(_clean(dx), _clean((p * gl.unsqueeze(1)).split(lens, 1)[c.rank]), **F32)


def ref_attention(q, k, v, scale, causal, offset=0):
    """float64 attention with lse; query ``i`` sits at global ``offset + i``, sees keys ``j <= offset + i``."""
    return ref.attention(q, k, v, causal=causal, scale=scale, diag=offset)


def _qkv(seed, sq, sk, dtype=torch.float64, b=2, h=4, hkv=2, d=8, dv=6):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (_randn(g, *shape, dtype=dtype) for shape in ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv)))
    wo, wl = _randn(g, b, h, sq, dv), _randn(g, b, h, sq).float().double()  # lse is float32: so is its grad
    return q, k, v, wo, wl


def _reference_grads(q, k, v, wo, wl, scale, causal, offset=0):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = ref_attention(q, k, v, scale, causal, offset)
    ((out * wo).sum() + (lse * wl).sum()).backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _split_seq(x, layout, lens, group):
    return shard(x, 2, group=group, layout=layout) if lens is None else x.split(lens, 2)[as_comm(group).rank]


def _check_sharded(group, schedule, layout, causal, lens, dtype=torch.float64, tol=F64, seed=3):
    c = as_comm(group)
    s = 13 if lens is None else sum(lens)
    q, k, v, wo, wl = _qkv(seed, s, s, dtype)
    out_r, lse_r, dq_r, dk_r, dv_r = _reference_grads(q, k, v, wo, wl, 8 ** -0.5, causal)
    ql, kl, vl = (_split_seq(t, layout, lens, group).detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = sharded_attention(ql, kl, vl, causal=causal, group=group, schedule=schedule, layout=layout,
                                 return_lse=True)
    mine = lambda t: _split_seq(t, layout, lens, group)  # noqa: E731
    what = f"{schedule} {layout} causal={causal} lens={lens} rank {c.rank}/{c.size}"
    assert out.dtype == dtype and lse.dtype == torch.float32, what
    torch.testing.assert_close(out.double(), mine(out_r), **tol, msg=lambda m: f"{what} out: {m}")
    torch.testing.assert_close(lse.double(), mine(lse_r), **F32, msg=lambda m: f"{what} lse: {m}")
    ((out * mine(wo).to(dtype)).sum() + (lse * mine(wl).float()).sum()).backward()
    for name, got, want in (("dq", ql.grad, dq_r), ("dk", kl.grad, dk_r), ("dv", vl.grad, dv_r)):
        torch.testing.assert_close(got.double(), mine(want), **tol, msg=lambda m: f"{what} {name}: {m}")


def case_attention(group):
    """ring and allgather, contiguous (uneven, one empty) and zigzag, causal and not, GQA."""
    p = as_comm(group).size
    for schedule in ("ring", "allgather"):
        for causal in (False, True):
            _check_sharded(group, schedule, "contiguous", causal, uneven_lengths(p, 4))
            _check_sharded(group, schedule, "zigzag", causal, None)
    _check_sharded(group, "ring", "contiguous", True, None, torch.float32, F32)


def case_tree(group):
    """Split-KV: q replicated, uneven k/v shards; causal bottom-right; out/lse identical everywhere."""
    c = as_comm(group)
    lens = uneven_lengths(c.size, 5)
    sk = sum(lens) + 3
    lens[-1] += 3
    for sq in (1, 3):
        for causal in (False, True):
            q, k, v, wo, wl = _qkv(6, sq, sk)
            ref = _reference_grads(q, k, v, wo, wl, 0.3, causal, offset=sk - sq)
            ql = q.clone().requires_grad_()
            kl, vl = (t.split(lens, 2)[c.rank].clone().requires_grad_() for t in (k, v))
            out, lse = sharded_attention(ql, kl, vl, causal=causal, scale=0.3, group=group, schedule="tree",
                                         return_lse=True)
            what = f"tree sq={sq} causal={causal} rank {c.rank}"
            every = unshard(torch.cat((out.detach(), lse.detach().unsqueeze(-1).double()), -1)[None], 0, group=group)
            assert all(torch.equal(e, every[0]) for e in every), f"{what}: ranks differ"
            again = sharded_attention(ql, kl, vl, causal=causal, scale=0.3, group=group, schedule="tree")
            assert torch.equal(again, out), f"{what}: not reproducible"
            torch.testing.assert_close(out, ref[0], **F64, msg=lambda m: f"{what} out: {m}")
            torch.testing.assert_close(lse.double(), ref[1], **F32, msg=lambda m: f"{what} lse: {m}")
            ((out * wo).sum() + (lse * wl.float()).sum()).backward()
            torch.testing.assert_close(ql.grad, ref[2], **F64, msg=lambda m: f"{what} dq: {m}")
            torch.testing.assert_close(kl.grad, ref[3].split(lens, 2)[c.rank], **F64)
            torch.testing.assert_close(vl.grad, ref[4].split(lens, 2)[c.rank], **F64)


def case_nan_key(group):
    """A NaN key reaches exactly the rows that see it, through every schedule's merges: causal
    ring / allgather rows at or after it (others match float64), every tree row of its kv head."""
    c = as_comm(group)
    q, k, v, _, _ = _qkv(11, 12, 12, torch.float32)
    k[:, 0, 5, 0] = float("nan")  # kv head 0 = query heads 0 and 1, global key 5
    out_r = ref_attention(q, k, v, 8 ** -0.5, True)[0]
    for schedule, layout in (("ring", "zigzag"), ("ring", "contiguous"), ("allgather", "zigzag")):
        ql, kl, vl = (shard(t, 2, group=group, layout=layout) for t in (q, k, v))
        out = unshard(sharded_attention(ql, kl, vl, causal=True, group=group, schedule=schedule, layout=layout),
                      2, group=group, layout=layout)
        what = f"{schedule} {layout} rank {c.rank}/{c.size}"
        assert torch.isnan(out[:, :2, 5:]).all(dim=-1).all(), f"{what}: a row that sees the NaN key is not NaN"
        clean = torch.cat((out[:, :2, :5], out[:, 2:]), 2).double()
        torch.testing.assert_close(clean, torch.cat((out_r[:, :2, :5], out_r[:, 2:]), 2), **F32,
                                   msg=lambda m: f"{what}: {m}")
    lens = [12 // c.size + (r < 12 % c.size) for r in range(c.size)]
    out, lse = sharded_attention(q[:, :, -1:], k.split(lens, 2)[c.rank], v.split(lens, 2)[c.rank], group=group,
                                 schedule="tree", return_lse=True)
    assert torch.isnan(lse[:, :2]).all() and torch.isnan(out[:, :2]).all(), f"tree rank {c.rank}"
    assert torch.isfinite(out[:, 2:]).all() and torch.isfinite(lse[:, 2:]).all(), f"tree rank {c.rank}"


def case_shard(group):
    """shard / unshard as tensor_split (contiguous) and chunks r, 2P-1-r (zigzag); their gradients."""
    c = as_comm(group)
    for s in (1, 13, 2 * c.size + 1):
        x = _randn(torch.Generator().manual_seed(s), 2, 3, s, 4)
        chunks = torch.tensor_split(x, 2 * c.size, 2)
        want = {"contiguous": torch.tensor_split(x, c.size, 2)[c.rank],
                "zigzag": torch.cat((chunks[c.rank], chunks[2 * c.size - 1 - c.rank]), 2)}
        for layout, expect in want.items():
            xl = x.clone().requires_grad_()
            mine = shard(xl, 2, group=group, layout=layout)
            assert torch.equal(mine, expect), f"shard {layout} S={s} rank {c.rank}"
            full = unshard(mine * 2.0, 2, group=group, layout=layout)
            assert torch.equal(full, 2.0 * x), f"unshard {layout} S={s} rank {c.rank}"
            (full * x).sum().backward()
            assert torch.equal(xl.grad, 2.0 * x), f"shard/unshard grad {layout} S={s}"
    ids = torch.arange(10, device=DEVICE).view(1, 10)
    assert torch.equal(unshard(shard(ids, 1, group=group), 1, group=group), ids)


def case_mismatch(group):
    """Mismatched fields raise ValueError on every rank, naming field and ranks; the group stays usable."""
    c = as_comm(group)
    if c.size == 1:
        return
    last = c.size - 1
    q, k, v, _, _ = _qkv(7, 4, 4, d=16 if c.rank == last else 8)
    with pytest.raises(ValueError, match=rf"D differs across ranks.*rank\(s\) \[{last}\]: 16"):
        sharded_attention(q, k, v, group=group)
    q, k, v, _, _ = _qkv(7, 4, 4)
    with pytest.raises(ValueError, match=r"dtype differs"):
        sharded_attention(*(t.float() if c.rank == 0 else t for t in (q, k, v)), group=group)
    with pytest.raises(ValueError, match=r"schedule='bogus' is not one of|rank\(s\) \[0\] rejected their arguments "
                                         r"\(rank 0: schedule='bogus' is not one of"):
        sharded_attention(q, k, v, group=group, schedule="bogus" if c.rank == 0 else "ring")
    with pytest.raises(ValueError, match=r"rows differs"):
        sharded_softmax(torch.randn(2 + (c.rank == last), 3, device=DEVICE), group=group)
    with pytest.raises(ValueError, match=rf"causal differs across ranks \(rank\(s\) \[0\]: True; .*{last}\]: False"):
        sharded_attention(q, k, v, causal=c.rank == 0, group=group)
    with pytest.raises(ValueError, match=rf"layout differs .*rank\(s\) \[{last}\]: 'zigzag'"):
        sharded_attention(q, k, v, group=group, layout="zigzag" if c.rank == last else "contiguous")
    with pytest.raises(ValueError, match=r"x.shape\[0\] differs across ranks"):  # same row count, other rows
        sharded_softmax(torch.randn(*((2, 6, 3) if c.rank == 0 else (3, 4, 3)), device=DEVICE), group=group)
    _shard_mismatch(c, group)
    q, k, v, _, _ = _qkv(7, 4 + c.rank, 4 + c.rank)
    with pytest.raises(ValueError, match=r"layout='zigzag' but rank\(s\) \[0"):
        sharded_attention(q, k, v, group=group, layout="zigzag")
    _check_sharded(group, "ring", "contiguous", True, None)


def _shard_mismatch(c, group):
    """shard of a "full" tensor whose values (or length) differ on the last rank: every rank raises,
    naming the argument and the ranks, before anything is sliced."""
    last = c.size - 1
    x = _randn(torch.Generator().manual_seed(3), 2, 3, 9, 4)
    mine = x.clone()
    if c.rank == last:
        mine[1, 2, 8, 3] += 1.0  # one element of the last rank's copy (a per-rank data pipeline)
    for layout in ("contiguous", "zigzag"):
        with pytest.raises(ValueError, match=rf"shard: x differs across ranks \(rank\(s\) \[0.*\] hold copy 1; "
                                             rf"rank\(s\) \[{last}\] hold copy 2\)"):
            shard(mine, 2, group=group, layout=layout)
    with pytest.raises(ValueError, match=rf"shard: x.shape\[2\] differs across ranks .*rank\(s\) \[{last}\]: 8"):
        shard(x[:, :, :9 - (c.rank == last)], 2, group=group)
    with pytest.raises(ValueError, match=r"x differs across ranks"):  # any dtype: bits compared
        shard(torch.arange(6, device=DEVICE).view(1, 6) + (c.rank == 0), 1, group=group)
    assert torch.equal(shard(x, 2, group=group), torch.tensor_split(x, c.size, 2)[c.rank])  # still usable


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("case", [case_softmax, case_attention, case_tree, case_nan_key, case_shard, case_mismatch],
                         ids=lambda f: f.__name__)
def test_loopback(size, case):
    LoopbackWorld(size).run(case)


def test_refusal_reasons_reach_every_rank():
    """Every refusing rank's message reaches every rank in the handshake, cut to ``REASON_BYTES``
    (a character cut in two is replaced, not an error); the refusing ranks raise their own error."""
    def run(c):
        mine = ValueError(f"x is odd on rank {c.rank}: " + "\u00e9" * 2000) if c.rank % 2 else None
        with pytest.raises(ValueError) as info:
            handshake(c, "shard", {"a": 1}, None, mine)
        if mine is not None:
            assert info.value is mine
            return
        msg = str(info.value)
        assert msg.startswith("shard: rank(s) [1, 3] rejected their arguments (rank 1: x is odd on rank 1: \u00e9"), msg
        assert "; rank 3: x is odd on rank 3: \u00e9" in msg and len(msg.encode()) < 2 * REASON_BYTES + 200, msg
    LoopbackWorld(4).run(run)


TAGS = {"meta": 11, "kv": 21, "dkv": 22, "gather": 31, "scatter": 32, "tree": 41}


def _count(size, schedule, backward):
    q, k, v, _, _ = _qkv(8, 2 * size, 2 * size)
    world = LoopbackWorld(size)

    def run(c):
        ql = (q if schedule == "tree" else shard(q, group=c)).requires_grad_()
        out = sharded_attention(ql, shard(k, group=c), shard(v, group=c), group=c, schedule=schedule)
        if backward:
            out.sum().backward()

    world.run(run)
    return {name: world.sends.get(tag, 0) for name, tag in TAGS.items()}


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("schedule", ["ring", "allgather", "tree"])
def test_transfer_counts(size, schedule):
    """Per rank: P-1 K/V transfers per ring pass (+ P-1 dK/dV home), P-1 sends per all-gather /
    reduce-scatter, ceil(log2 P) tree rounds; one handshake (P-1 sends) per call."""
    p, rounds = size, math.ceil(math.log2(size))
    fwd, bwd = {"ring": ({"kv": p - 1}, {"kv": p - 1, "dkv": p - 1}),
                "allgather": ({"gather": p - 1}, {"gather": p - 1, "scatter": p - 1}),
                "tree": ({"tree": rounds}, {"tree": rounds})}[schedule]
    calls = 3 if schedule == "tree" else 4
    f, fb = _count(size, schedule, False), _count(size, schedule, True)
    for name in TAGS:
        assert f[name] == p * (fwd.get(name, 0) + (calls * (p - 1) if name == "meta" else 0)), (name, f)
        assert fb[name] - f[name] == p * bwd.get(name, 0), (name, f, fb)


def case_groups(group):
    """torch.distributed only: an explicit ProcessGroup, a subgroup of the last ranks, a 1-d DeviceMesh."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return
    from torch.distributed.device_mesh import init_device_mesh
    p = dist.get_world_size()
    sub_ranks = list(range(p))[-2:]
    sub = dist.new_group(sub_ranks)
    if dist.get_rank() in sub_ranks:
        _check_sharded(sub, "ring", "zigzag", True, None)
        case_tree(sub)
    _check_sharded(dist.new_group(list(range(p))), "allgather", "contiguous", True, uneven_lengths(p, 9))
    _check_sharded(init_device_mesh(DEVICE.type, (p,)), "ring", "contiguous", False, uneven_lengths(p, 10))


def case_all(group):
    """Every case above, in one worker start (process groups are slow to start)."""
    for case in (case_softmax, case_attention, case_tree, case_nan_key, case_shard, case_mismatch, case_groups):
        case(group)


def test_bad_arguments():
    """Local argument errors name the argument; a bad group is a TypeError; no default group: ValueError."""
    world = LoopbackWorld(1)
    c = world.comm(0)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="q must be 4-D"):
        world.run(lambda c: sharded_attention(q[0], q, q, group=c))
    with pytest.raises(ValueError, match="layout='diagonal'"):
        world.run(lambda c: sharded_attention(q, q, q, group=c, layout="diagonal"))
    with pytest.raises(ValueError, match="tree schedule takes contiguous"):
        world.run(lambda c: sharded_attention(q, q, q, group=c, layout="zigzag", schedule="tree"))
    with pytest.raises(ValueError, match="dim=5"):
        world.run(lambda c: sharded_softmax(q, dim=5, group=c))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        world.run(lambda c: sharded_logsumexp([1.0], group=c))
    with pytest.raises(TypeError, match="group must be"):
        sharded_softmax(q, group=42)
    import torch.distributed as dist
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="init_process_group"):
            sharded_softmax(q)
    assert c.rank == 0 and c.size == 1


def case_multinode(group):
    """The cases a multi-node launch checks: ranks on different agents exchange K/V and states."""
    import torch.distributed as dist
    assert os.environ["GROUP_WORLD_SIZE"] == "2" and dist.get_world_size() == 4, "2 agents x 2 ranks"
    for case in (case_softmax, case_attention, case_tree):
        case(group)


def test_poll_pause_schedule():
    """A wait polls without sleeping for its first 20 ms (short transfers are not overshot), then
    sleeps 1% of the time waited, from 50 us to 2 ms (a stalled peer costs little CPU)."""
    from splitsoftmax.distributed.comm import _poll_pause
    assert [_poll_pause(t) for t in (0.0, 0.001, 0.0199)] == [0.0, 0.0, 0.0]
    assert _poll_pause(0.02) == pytest.approx(2e-4)
    assert _poll_pause(0.1) == pytest.approx(1e-3)
    assert _poll_pause(300.0) == 2e-3
    pauses = [_poll_pause(t / 1000) for t in range(0, 1000)]
    assert pauses == sorted(pauses)


def test_post_that_blocks_is_bounded(monkeypatch):
    """A transfer whose start blocks the host (NCCL's first contact with a dead peer) runs on the
    poster thread; the wait still ends after SPLITSOFTMAX_TIMEOUT naming the peer and the step."""
    import threading
    import time
    from splitsoftmax.distributed import comm as cm
    release = threading.Event()
    started = cm._nccl_poster().submit(release.wait)
    handle = cm.Handle(3, lambda: started.done() and started.result())
    monkeypatch.setenv("SPLITSOFTMAX_TIMEOUT", "0.3")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"step x: rank 0: peer rank\(s\) \[3\] did not answer within 0.3 s"):
        cm.Communicator.wait(LoopbackWorld(1).comm(0), [handle], "step x")
    assert time.monotonic() - t0 < 2.0
    release.set()
    assert started.result(timeout=5) is True
    failing = cm._nccl_poster().submit(lambda: 1 / 0)
    with pytest.raises(RuntimeError, match=r"step y: rank 0: transfer with peer rank 1 failed \(ZeroDivisionError"):
        cm.Communicator.wait(LoopbackWorld(1).comm(0), [cm.Handle(1, lambda: failing.done() and failing.result())],
                             "step y")
