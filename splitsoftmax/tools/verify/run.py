"""``python -m splitsoftmax verify``: every op, forward and backward, against float64.

Each check computes splitsoftmax's result and gradient, the float64 reference, and the same
quantity through torch in the same dtype; the tolerance is FlashAttention's rule (twice torch's
own error, 4x for gradients, plus twice the rounding of the float64 truth to the result's dtype:
relative to the result's size, :mod:`.compare`). The
single-device rows are here, the sharded ones in :mod:`.sharded`. One table, non-zero exit
on any mismatch.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional, Sequence

import torch

import splitsoftmax as ss
from ...core import reference as ref
from .compare import Row, compare, sdpa, table
from .job import Job
from .sharded import sharded_rows


def single_device_rows(device: str = "cpu", dtype: torch.dtype = torch.float32) -> list[Row]:
    """The single-device table of docs/API.md on odd sizes, with an all ``-inf`` row (the same inputs
    on every rank and every run: a fixed seed)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)
    x = randn(33, 1000) * 4
    x[3] = float("-inf")
    rows = []
    rows += compare("softmax 33x1000", ss.softmax, lambda t: torch.softmax(t, -1), ref.softmax, [x])
    rows += compare("log_softmax 33x1000", ss.log_softmax, lambda t: torch.log_softmax(t, -1), ref.log_softmax, [x])
    rows += compare("logsumexp 33x1000", ss.logsumexp, lambda t: torch.logsumexp(t, -1), ref.logsumexp, [x])
    for causal in (False, True):
        q, k, v = randn(2, 4, 97, 64), randn(2, 2, 129, 64), randn(2, 2, 129, 64)
        rows += compare(f"attention GQA 4/2 97x129{' causal' if causal else ''}",
                        lambda q, k, v, c=causal: ss.attention(q, k, v, causal=c), sdpa(causal, 2),
                        lambda q, k, v, c=causal: ref.attention(q, k, v, causal=c)[0], [q, k, v])
    return rows


def run_table(rows_fn: Callable[[], list[Row]], stream=sys.stdout) -> int:
    """Print the table of ``rows_fn()`` to ``stream``; non-zero on a mismatch, whose rows go to stderr
    as well where ``stream`` is not stdout (a rank other than 0, whose stderr the launcher shows)."""
    rows = rows_fn()
    print(table(rows), file=stream)
    bad = [r for r in rows if not r.ok]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} checks passed", file=stream)
    if bad and stream is not sys.stdout:
        print(table(bad), file=sys.stderr)
    return 1 if bad else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="splitsoftmax verify", description=__doc__)
    parser.add_argument("--nproc", type=int, default=None,
                        help="launch this many local ranks (Gloo on CPU, NCCL with a GPU per rank); default: "
                             "one per GPU when there are several, else 4 CPU ranks")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--deadline", type=float, default=1800.0, help="seconds before --nproc ranks are stopped")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="cpu: CPU ranks (Gloo) even with GPUs; cuda: ranks on GPUs (under mpirun even when "
                             "they share one); default: cuda when every rank has its own GPU, else cpu")
    parser.add_argument("--model", default=None, metavar="CONFIG",
                        help="a transformers model instead of the ops: a built-in tiny config (" +
                             ", ".join(model_configs()) + ") or a config.json path; its loss and every parameter "
                             "gradient, sequence-parallel under every schedule and mesh shape, against one rank "
                             "(float32)")
    ns = parser.parse_args(argv)
    if ns.model is not None:
        _check_model(parser, ns)
    if ns.nproc is not None and ns.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {ns.nproc}")
    if ns.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here (torch.cuda.is_available() is False)")
    from .. import launcher
    kind = launcher.launched_by()
    if kind is None:
        device = ["--device", ns.device] if ns.device else []
        model = ["--model", ns.model] if ns.model is not None else []
        return launcher.spawn(ns.nproc or launcher.default_nproc(),
                              ["verify", "--dtype", ns.dtype, *device, *model], ns.deadline)
    return _verify_ranks(kind, getattr(torch, ns.dtype), ns.device, ns.model)


def model_configs() -> tuple:
    from .model import CONFIGS
    return tuple(CONFIGS)


def _check_model(parser: argparse.ArgumentParser, ns) -> None:
    """Usage errors of ``--model`` before any rank starts: its dtype, and a config that loads."""
    if ns.dtype != "float32":
        parser.error(f"--model runs in float32 (its tolerance is float32's), got --dtype {ns.dtype}")
    from .model import load_config
    try:
        load_config(ns.model)
    except ValueError as e:
        parser.error(str(e))


def _verify_ranks(kind: str, dtype: torch.dtype, device: Optional[str], model: Optional[str] = None) -> int:
    """One rank of a job: single-device rows on its device, then the sharded rows (or the model's
    runs with ``model``); rank 0 prints."""
    from .. import launcher
    group, device, rank, world = launcher.init_ranks(kind, device)
    job = Job(group, device, rank, world, dtype)
    quiet = open(os.devnull, "w") if rank else sys.stdout
    try:
        if model is not None:
            return run_model(job, model, quiet)
        return run_table(lambda: single_device_rows(str(device), dtype) + sharded_rows(job), stream=quiet)
    finally:
        launcher.finish_ranks(kind)


def run_model(job: Job, spec: str, stream) -> int:
    """``verify --model``: the model table on rank 0, non-zero there on any mismatch."""
    from . import model as vm
    config = vm.load_config(spec)
    rows = vm.model_rows(job, config)
    if job.rank:
        return 0
    print(f"verify --model {spec}: {vm.describe(config)}; float32 on {job.world} ranks ({job.device.type}), "
          f"attn_implementation='splitsoftmax_sp' (zigzag shards) against one rank ('eager')\n", file=stream)
    print(vm.table(rows), file=stream)
    bad = [r for r in rows if not r.ok]
    print(f"\n{vm.TOLERANCE}\n{len(rows) - len(bad)}/{len(rows)} runs passed", file=stream)
    return 1 if bad else 0
