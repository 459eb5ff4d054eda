"""Exit soak: many short Gloo jobs, every rank of every launch must exit with code 0.

Each launch starts ``P`` CPU processes (a fresh interpreter each, Gloo on 127.0.0.1). Every rank
builds the same tiny Llama (transformers, random weights), registers
``attn_implementation="splitsoftmax"`` with ``sequence_parallel=True``, runs the model on its
zigzag shard (``shard_inputs``) forward and backward, then ``ss.sharded_attention`` forward and
backward under the launch's schedule (ring, allgather, tree, heads), calls
``torch.distributed.destroy_process_group()`` and leaves through the interpreter's normal exit
(where an abort at teardown would show: SIGABRT, exit code -6).

Launches cycle over every (ranks, schedule) pair, run in batches of ``--parallel`` at once, each
bounded by ``--timeout`` seconds. The summary gives, per pair, the launches and the non-zero exits
by kind (abort, timeout, other); the exit code is 1 if any rank of any launch exited non-zero.

    PYTHONPATH=. python scripts/exit_soak.py --launches 200 --sizes 2,3 --schedules ring,allgather,tree,heads
"""
from __future__ import annotations

import argparse
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(schedule: str) -> None:
    """One rank's job (RANK, WORLD_SIZE, MASTER_* from the environment)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import torch.distributed as dist
    import transformers

    import splitsoftmax as ss
    from splitsoftmax.integrations import transformers as sst

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    sst.register(sequence_parallel=True)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=128, attn_implementation="splitsoftmax")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(1))
    out = model(**sst.shard_inputs(ids, labels=ids))
    out.loss.backward()
    g = torch.Generator().manual_seed(2 + dist.get_rank())
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g, requires_grad=True) for _ in range(3))
    if schedule == "tree":  # q replicated on every rank
        q = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    att = ss.sharded_attention(q, k, v, causal=True, schedule=schedule,
                               layout="contiguous" if schedule == "tree" else "zigzag")
    att.square().sum().backward()
    ok = bool(torch.isfinite(out.loss)) and all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(f"rank {os.environ['RANK']}: non-finite results")


def launch(size: int, schedule: str, timeout: float) -> subprocess.Popen:
    """Start the ``size`` ranks of one launch; returns them with their log files."""
    from splitsoftmax.tools.launcher import free_port
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               SPLITSOFTMAX_TIMEOUT=str(int(timeout)))
    ranks = []
    for r in range(size):
        log = tempfile.TemporaryFile()
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", schedule],
                             env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        ranks.append((p, log))
    return ranks


def finish(ranks: list, deadline: float) -> list:
    """Exit codes of one launch's ranks (``"timeout"`` for a rank killed at the deadline) and logs."""
    out = []
    for p, log in ranks:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
            rc = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = "timeout"
        log.seek(0)
        out.append((rc, log.read().decode(errors="replace")))
        log.close()
    return out


def kind(rc) -> str:
    return "timeout" if rc == "timeout" else "abort" if rc == -signal.SIGABRT else f"rc {rc}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--sizes", default="2,3")
    ap.add_argument("--schedules", default="ring,allgather,tree,heads")
    ap.add_argument("--parallel", type=int, default=1, help="launches run at once")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per launch")
    ap.add_argument("--worker", metavar="SCHEDULE", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker)
        return 0
    pairs = list(itertools.product([int(s) for s in a.sizes.split(",")], a.schedules.split(",")))
    todo = list(itertools.islice(itertools.cycle(pairs), a.launches))
    runs, bad = Counter(), Counter()
    for at in range(0, len(todo), a.parallel):
        batch = todo[at:at + a.parallel]
        started = [(pair, launch(*pair, a.timeout)) for pair in batch]
        deadline = time.monotonic() + a.timeout
        for n, (pair, ranks) in enumerate(started, at + 1):
            runs[pair] += 1
            for r, (rc, log) in enumerate(finish(ranks, deadline)):
                if rc != 0:
                    bad[pair, kind(rc)] += 1
                    tail = " | ".join(log.strip().splitlines()[-3:])
                    print(f"launch {n} {pair[0]} ranks {pair[1]}: rank {r} {kind(rc)}: {tail}", flush=True)
        print(f"{min(at + a.parallel, len(todo))}/{len(todo)} launches, {sum(bad.values())} non-zero exits",
              flush=True)
    for pair in pairs:
        fails = {k: c for (p, k), c in bad.items() if p == pair}
        print(f"{pair[0]} ranks, {pair[1]}: {runs[pair]} launches, non-zero exits: {fails or 0}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
