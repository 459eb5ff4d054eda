"""``torch.compile``: the single-device ops compile with ``fullgraph=True`` and Dynamo warns of
nothing in the package's own code; the collective ops run eagerly (a clean graph break, and a
refusal naming the reason under ``fullgraph=True``), and importing the package loads no Dynamo."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch

import splitsoftmax as ss
from splitsoftmax.distributed import LoopbackWorld


def _compiled(fn, *args, fullgraph):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=fullgraph, backend="eager")(*args)


def _messages(caplog, caught) -> list[str]:
    return [r.getMessage() for r in caplog.records] + [str(w.message) for w in caught]


@pytest.mark.parametrize("name", ["softmax", "logsumexp", "attention", "cross_entropy"])
def test_single_device_ops_compile_fullgraph_without_warnings(name, caplog):
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 8, (54,))
    fns = {"softmax": lambda x: ss.softmax(x).square().sum(),
           "logsumexp": lambda x: ss.logsumexp(x).sum(),
           "attention": lambda x: ss.attention(x, x, x, causal=True).square().sum(),
           "cross_entropy": lambda x: ss.cross_entropy(x.reshape(-1, 8), target)}
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = _compiled(fns[name], x, fullgraph=True)
        (grad,) = torch.autograd.grad(loss, x)
    want = fns[name](x)
    (want_grad,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
    ours = [m for m in _messages(caplog, caught) if "splitsoftmax" in m or "Silent incorrectness" in m]
    assert not ours, ours


def test_collective_ops_run_eagerly_under_compile():
    x = torch.randn(3, 10, dtype=torch.float64)

    def rank(comm):
        fn = lambda x: ss.sharded_softmax(x, group=comm) * 2   # noqa: E731
        with pytest.raises(Exception, match="collective across ranks: it runs eagerly"):
            _compiled(fn, x, fullgraph=True)
        return _compiled(fn, x, fullgraph=False)

    (got,) = LoopbackWorld(1).run(rank)
    torch.testing.assert_close(got, torch.softmax(x, -1) * 2, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["sharded_softmax", "sharded_log_softmax", "sharded_logsumexp", "sharded_attention",
                                  "shard", "unshard", "sharded_cross_entropy", "sharded_logprobs", "sharded_entropy",
                                  "sharded_kl_div", "sharded_topk", "sharded_sample"])
def test_every_collective_op_is_marked_eager(name):
    fn = getattr(ss, name)
    assert getattr(fn, "_torchdynamo_disable", False), f"ss.{name} is traced by Dynamo"


def test_import_loads_no_dynamo():
    """Dynamo (as long to import as torch itself) is loaded by ``torch.compile``, not by ``import
    splitsoftmax``; a collective op called without it runs as it is."""
    code = ("import sys, torch, splitsoftmax as ss\n"
            "from splitsoftmax.distributed import LoopbackWorld\n"
            "x = torch.randn(2, 5, dtype=torch.float64)\n"
            "(y,) = LoopbackWorld(1).run(lambda comm: ss.sharded_softmax(x, group=comm))\n"
            "assert 'torch._dynamo' not in sys.modules, 'Dynamo loaded'\n"
            "assert torch.allclose(y, torch.softmax(x, -1))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
