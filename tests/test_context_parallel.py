"""``ss.context_parallel``: a plain torch model trained under the block equals one process.

The model calls ``F.scaled_dot_product_attention`` itself (``is_causal`` with ``enable_gqa``, a
boolean causal mask built from the local length, an additive causal mask of the full sequence from
an unsharded buffer) and reads rotary tables from buffers the block shards. Loss and every parameter
gradient (summed over ranks, as data parallelism would) equal the float64 one-process run; the
per-rank logits are the layout's shards of the full logits. ``case_*(group)`` run on the loopback
world here and in Gloo worker processes of 2 and 4 ranks (``test_gloo_*``).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import splitsoftmax as ss
from splitsoftmax.distributed import LoopbackWorld, as_comm
from splitsoftmax.ops.attention.context import mask_is_causal
from splitsoftmax.distributed.layout import shard_lengths
from splitsoftmax.distributed.tree import allreduce_sum

DEVICE = torch.device(os.environ.get("SPLITSOFTMAX_TEST_DEVICE", "cpu"))
F64 = dict(atol=1e-10, rtol=1e-9)  # float64 on both sides: equal to rounding
STYLES = ("causal_gqa", "bool_mask", "additive_full")


class Layer(torch.nn.Module):
    """Pre-norm attention (rotary q/k, SDPA called as ``style`` says) and a GELU MLP."""

    def __init__(self, e: int, h: int, hkv: int, style: str):
        super().__init__()
        self.h, self.hkv, self.d, self.style = h, hkv, e // h, style
        self.wq = torch.nn.Linear(e, h * self.d, bias=False)
        self.wkv = torch.nn.Linear(e, 2 * hkv * self.d, bias=False)
        self.wo = torch.nn.Linear(h * self.d, e, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(e, 2 * e), torch.nn.GELU(), torch.nn.Linear(2 * e, e))

    def attend(self, q, k, v, bias):
        if self.style == "causal_gqa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        k, v = (t.repeat_interleave(self.h // self.hkv, dim=1) for t in (k, v))
        if self.style == "bool_mask":
            s = q.shape[2]
            return F.scaled_dot_product_attention(q, k, v, torch.ones(s, s, dtype=torch.bool, device=q.device).tril())
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.3)

    def forward(self, x, cos, sin, bias):
        b, s, _ = x.shape
        y = F.rms_norm(x, (x.shape[-1],))
        q = rotary(self.wq(y).view(b, s, self.h, self.d).transpose(1, 2), cos, sin)
        k, v = self.wkv(y).view(b, s, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)
        o = self.attend(q, rotary(k, cos, sin), v, bias)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(F.rms_norm(x, (x.shape[-1],)))


def rotary(x, cos, sin):
    """Rotate pairs of ``x (B, H, S, D)`` by the angles of ``cos, sin (S, D/2)``."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


class TinyLM(torch.nn.Module):
    """Token ids ``(B, S)`` -> logits ``(B, S, V)``; rotary tables ``cos, sin (S, D/2)`` are buffers,
    ``bias (S, S)`` an additive causal mask kept whole."""

    def __init__(self, seq: int, vocab: int = 29, e: int = 16, h: int = 4, hkv: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, e)
        self.layers = torch.nn.ModuleList(Layer(e, h, hkv, style) for style in STYLES)
        self.head = torch.nn.Linear(e, vocab, bias=False)
        d = e // h
        angle = torch.arange(seq, dtype=torch.float64)[:, None] / 10.0 ** (torch.arange(d // 2) / (d // 2))
        self.register_buffer("cos", angle.cos())
        self.register_buffer("sin", angle.sin())
        self.register_buffer("bias", torch.full((seq, seq), float("-inf"), dtype=torch.float64).triu(1))

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin, self.bias)
        return self.head(F.rms_norm(x, (x.shape[-1],)))


def setup(seq: int, batch: int = 2):
    """The same float64 model and batch on every rank: ``(model, tokens, labels)``."""
    torch.manual_seed(1234)
    model = TinyLM(seq).double().to(DEVICE)
    tokens = torch.randint(0, 29, (batch, seq + 1), device=DEVICE)
    return model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def step(model, tokens, labels, count: int):
    """Logits and the loss (summed cross-entropy over ``count`` tokens); gradients accumulated."""
    model.zero_grad()
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / count
    loss.backward()
    return logits.detach(), loss.detach()


def one_process(seq: int):
    model, tokens, labels = setup(seq)
    logits, loss = step(model, tokens, labels, labels.numel())
    return logits, loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def check_training(group, seq: int, layout: str, schedule: str) -> None:
    """Training step under the block: loss, gradients and logits equal one process; buffers restored."""
    comm = as_comm(group)
    ref_logits, ref_loss, ref_grads = one_process(seq)
    model, tokens, labels = setup(seq)
    buffers = [tokens, labels, model.cos, model.sin]
    before = [(b, b.clone(), b.data_ptr()) for b in buffers]
    local = shard_lengths(seq, comm.size, layout)[comm.rank]
    with ss.context_parallel(group, buffers=buffers, buffer_seq_dims=[1, 1, 0, 0], layout=layout, schedule=schedule):
        assert tokens.shape == labels.shape == (2, local) and model.cos.shape[0] == local
        logits, loss = step(model, tokens, labels, 2 * seq)
    loss = allreduce_sum(comm, loss, "test loss")
    torch.testing.assert_close(loss, ref_loss, **F64)
    torch.testing.assert_close(ss.unshard(logits, 1, group=comm, layout=layout), ref_logits, **F64)
    for name, p in model.named_parameters():
        torch.testing.assert_close(allreduce_sum(comm, p.grad, "test grad"), ref_grads[name], **F64, msg=name)
    for b, value, ptr in before:
        assert b.data_ptr() == ptr and torch.equal(b, value)


def case_training(group) -> None:
    """Zigzag ring and contiguous all-gather, even and uneven sequence lengths."""
    check_training(group, 16, "zigzag", "ring")
    check_training(group, 13, "contiguous", "allgather")
    check_training(group, 13, "zigzag", "allgather")


def case_refusals(group) -> None:
    """A refusal on one rank raises on every rank; the group and the buffers are fine afterwards."""
    comm = as_comm(group)
    model, tokens, labels = setup(16)
    cos = model.cos.clone()
    q = torch.randn(2, 4, 16, 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="dropout_p" if comm.rank == comm.size - 1 else "rejected their arguments"):
        with ss.context_parallel(group, buffers=[model.cos], buffer_seq_dims=[0]):
            qs = ss.shard(q, 2, group=comm, layout="zigzag")
            F.scaled_dot_product_attention(qs, qs, qs, dropout_p=0.1 if comm.rank == comm.size - 1 else 0.0)
    assert torch.equal(model.cos, cos)
    extra = [labels] if comm.rank == 0 else []
    with pytest.raises(ValueError, match="buffers differs across ranks"):
        with ss.context_parallel(group, buffers=[tokens, *extra], buffer_seq_dims=[1] * (1 + len(extra))):
            pass
    assert tokens.shape == (2, 16)
    check_training(group, 16, "zigzag", "ring")


@pytest.mark.parametrize("p", [1, 2, 3])
def test_training_loopback(p):
    LoopbackWorld(p).run(case_training)


def test_refusals_loopback():
    LoopbackWorld(2).run(case_refusals)


@pytest.mark.distributed
@pytest.mark.parametrize("size", [2, 4])
def test_gloo(size):
    from _dist_util import assert_ok, spawn
    assert_ok(spawn(size, "tests/test_context_parallel.py:case_all", timeout=240, env={"SPLITSOFTMAX_TIMEOUT": "60"}),
              f"gloo world of {size}")


def case_mesh(group) -> None:
    """A 1-D DeviceMesh of the world names the group."""
    from torch.distributed.device_mesh import init_device_mesh
    check_training(init_device_mesh(DEVICE.type, (as_comm(group).size,)), 16, "zigzag", "ring")


def case_all(group) -> None:
    case_training(group)
    case_refusals(group)
    case_mesh(group)


def test_mask_is_causal():
    tri = torch.ones(6, 6, dtype=torch.bool).tril()
    additive = torch.zeros(6, 6).masked_fill(~tri, float("-inf"))
    assert mask_is_causal(tri, 2, 4, (6,)) and mask_is_causal(tri.expand(2, 4, 6, 6), 2, 4, (6,))
    assert mask_is_causal(additive, 2, 4, (6,))
    assert mask_is_causal(torch.zeros(6, 6).masked_fill(~tri, torch.finfo(torch.float32).min), 2, 4, (6,))
    assert mask_is_causal(tri[None, None], 2, 4, (3, 6))  # the full sequence's mask, this rank holding 3
    assert not mask_is_causal(torch.ones(2, 1, 1, 6, dtype=torch.bool), 2, 4, (6,))
    assert not mask_is_causal(torch.zeros(6, 6, dtype=torch.float64), 2, 4, (6,))
    refused = {"neither all visible nor causal": [tri.T, torch.rand(6, 6) > 0.5, torch.stack([tri, tri.T])[:, None],
                                                 torch.ones(6, 6, dtype=torch.bool).tril(-1)],
               "only 0 \\(visible\\) and -inf": [additive + 0.5, torch.full((6, 6), 1e4)],
               "does not broadcast": [tri[:5, :5], torch.ones(3, 1, 6, 6, dtype=torch.bool), tri[None, None, None]],
               "boolean or floating": [tri.int()]}
    for match, masks in refused.items():
        for m in masks:
            with pytest.raises(ValueError, match=match):
                mask_is_causal(m, 2, 4, (6,))


def _refused(call, match: str, error=ValueError, **block) -> None:
    """Every rank of a loopback world of 2 makes the same mistake inside a block over a 16-position
    buffer: each raises ``error`` matching ``match``, and the buffer is whole afterwards."""
    def rank(comm):
        buf = torch.arange(16.0)[:, None].expand(16, 3).contiguous()
        try:
            with pytest.raises(error, match=match):
                with ss.context_parallel(comm, buffers=[buf], buffer_seq_dims=[0], **block):
                    call(comm, buf)
        finally:
            assert torch.equal(buf, torch.arange(16.0)[:, None].expand(16, 3))
    LoopbackWorld(2).run(rank)


def _qkv(comm, shape=(2, 4, 16, 8), hkv=4, **kw):
    """``q, k, v`` shards (zigzag along dim 2) of a full ``(B, H, 16, D)`` sequence."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(*shape, generator=g, dtype=torch.float64)
    k, v = (torch.randn(shape[0], hkv, *shape[2:], generator=g, dtype=torch.float64) for _ in range(2))
    return [ss.shard(t, 2, group=comm, layout="zigzag") for t in (q, k, v)]


def test_refused_calls():
    sdpa = F.scaled_dot_product_attention
    tri = torch.ones(8, 8, dtype=torch.bool).tril()
    _refused(lambda c, b: sdpa(*_qkv(c), dropout_p=0.1), "dropout_p=0.1")
    _refused(lambda c, b: sdpa(*_qkv(c), attn_mask=tri.T), "attn_mask .* neither all visible nor causal")
    _refused(lambda c, b: sdpa(*_qkv(c), attn_mask=torch.zeros(8, 8).masked_fill(~tri, -1e4).double()),
             "attn_mask: an additive mask must hold only 0")
    _refused(lambda c, b: sdpa(*_qkv(c), attn_mask=tri, is_causal=True), "attn_mask must be None when is_causal")
    _refused(lambda c, b: sdpa(*_qkv(c, hkv=2), is_causal=True), "enable_gqa=False but query has 4 heads and key 2")
    _refused(lambda c, b: sdpa(*(t.transpose(1, 2) for t in _qkv(c)), is_causal=True),
             "query of shape \\(2, 8, 4, 8\\) has 4 positions .* this rank holds 8 of the 16 .*transpose\\(1, 2\\)")
    _refused(lambda c, b: sdpa(*(t[0] for t in _qkv(c))), "query must be 4-D")
    _refused(lambda c, b: sdpa(*_qkv(c), bogus=1), "unexpected keyword argument 'bogus'", error=TypeError)
    _refused(lambda c, b: sdpa(*_qkv(c), is_causal=True), "schedule='tree' is not one of", schedule="tree")
    _refused(lambda c, b: ss.context_parallel(c).__enter__(), "already inside an ss.context_parallel block")


def test_refused_blocks():
    """Arguments of the block itself, refused on every rank before anything is sharded."""
    x, grad = torch.zeros(2, 16), torch.zeros(16, requires_grad=True)
    cases = [(dict(buffers=[x], buffer_seq_dims=[1, 0]), "buffer_seq_dims must give one dim per buffer"),
             (dict(buffers=[x, torch.zeros(15)], buffer_seq_dims=[1, 0]), "different lengths .*\\[16, 15\\]"),
             (dict(buffers=[x, x], buffer_seq_dims=[1, 1]), "buffers\\[1\\] is the same tensor"),
             (dict(buffers=[grad], buffer_seq_dims=[0]), "buffers\\[0\\] requires grad"),
             (dict(buffers=[x], buffer_seq_dims=[2]), "buffer_seq_dims\\[0\\]=2 is out of range"),
             (dict(layout="striped"), "layout='striped'")]

    def rank(comm):
        for block, match in cases:
            with pytest.raises(ValueError, match=match):
                with ss.context_parallel(comm, **block):
                    pass
            assert x.shape == (2, 16)
    LoopbackWorld(2).run(rank)


def test_exception_restores_and_leaves():
    """An exception inside the block restores the buffers; SDPA outside is torch's own again."""
    def rank(comm):
        buf = torch.arange(12).view(2, 6)
        ptr = buf.data_ptr()
        with pytest.raises(RuntimeError, match="inside"):
            with ss.context_parallel(comm, buffers=[buf], buffer_seq_dims=[1]):
                assert buf.tolist() == ([[0, 1, 5], [6, 7, 11]] if comm.rank == 0 else [[2, 3, 4], [8, 9, 10]])
                raise RuntimeError("inside")
        assert buf.data_ptr() == ptr and buf.tolist() == torch.arange(12).view(2, 6).tolist()
        q = torch.randn(1, 2, 5, 4)
        torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q), ss.attention(q, q, q))
        with ss.context_parallel(comm, buffers=[buf], buffer_seq_dims=[1]):  # a new block opens
            assert buf.shape == (2, 3)
    LoopbackWorld(2).run(rank)


def test_no_grad_forward():
    """Under ``torch.no_grad`` (evaluation) the logits are the shards of one process's."""
    with torch.no_grad():
        ref = setup(13)[0](setup(13)[1])

    def rank(comm):
        model, tokens, _ = setup(13)
        with torch.no_grad(), ss.context_parallel(comm, buffers=[tokens, model.cos, model.sin],
                                                  buffer_seq_dims=[1, 0, 0]):
            logits = model(tokens)
        assert not logits.requires_grad
        torch.testing.assert_close(ss.unshard(logits, 1, group=comm, layout="zigzag"), ref, **F64)
    LoopbackWorld(3).run(rank)


def test_autocast_like_sdpa():
    """Under ``torch.autocast`` the call casts q, k, v and returns the dtype SDPA returns."""
    def rank(comm):
        q, k, v = (t.float() for t in _qkv(comm))
        buf = torch.zeros(16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = F.scaled_dot_product_attention(q, k, v, is_causal=True).dtype
            with ss.context_parallel(comm, buffers=[buf], buffer_seq_dims=[0]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert want == out.dtype == torch.bfloat16
    LoopbackWorld(2).run(rank)


@pytest.mark.distributed
def test_example_torchrun():
    """examples/context_parallel_example.py on 2 Gloo ranks under torchrun: loss and gradients match."""
    from _dist_util import ROOT, _collect, _start, assert_ok, worker_env
    from test_launch_example import torchrun
    example = os.path.join(ROOT, "examples", "context_parallel_example.py")
    cmd = [*torchrun(), "--standalone", "--nproc-per-node=2", "--max-restarts=0", example]
    p, log = _start(cmd, worker_env({"TORCHELASTIC_ERROR_FILE": os.devnull}))
    results = _collect([p], [log], timeout=120)
    assert_ok(results, "torchrun --nproc-per-node=2")
    out = results[0][1]
    assert "2 ranks (torchrun, cpu, torch.float32), S=128, this rank's shard 64 positions" in out, out
    assert "OK: context-parallel step matches one process" in out, out
    errs = [float(line.split("max rel err")[1].split()[0]) for line in out.splitlines() if "max rel err" in line]
    assert len(errs) == 17 and max(errs) <= 1e-4, out
