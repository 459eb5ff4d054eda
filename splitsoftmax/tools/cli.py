"""``python -m splitsoftmax <trace|verify|bench|env|warmup|plan|simulate|calibrate>`` (also the ``splitsoftmax`` script)."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

BENCH_HELP = {
    "softmax": "softmax, log_softmax and logsumexp beside torch's, at model shapes and over a sweep of row lengths",
    "attention": "ss.attention beside SDPA flash, SDPA cuDNN and FlexAttention, forward and backward",
    "ring": "attention over a sequence sharded across ranks beside torch's context parallelism "
            "(GPUs over NCCL, or CPU ranks over Gloo)",
    "cross_entropy": "ss.cross_entropy beside torch.nn.functional.cross_entropy",
    "host": "host time per call at short lengths beside torch",
    "model": "a Hugging Face training step of a Llama-shaped model with random weights",
    "vocab": "the vocabulary statistics (log-probabilities, entropy, KL) beside torch, in parts",
    "placement": "one rank's share of packed documents under each placement, 16 to 1024 ranks, on one GPU "
                 "(toy sizes on CPU)",
}
BENCHES = tuple(BENCH_HELP)
# benches that time one GPU (ring also runs on CPU ranks, placement at toy sizes on CPU)
CUDA_BENCHES = ("softmax", "attention", "cross_entropy", "host", "model", "vocab")
HELP = {
    "trace": "the online-softmax state trace of a small row, against a two-pass softmax and the wrong "
             "no-rescale variant (no options)",
    "verify": "every sharded op, forward and backward, against one device; --model CONFIG: a transformers model "
              "sequence-parallel under every schedule against one rank (see verify --help)",
    "bench": "benchmarks against the peers: bench {" + ",".join(BENCHES) + "} --help",
    "env": "versions, devices, backends, launchers and settings (no options)",
    "warmup": "compile the attention kernels of every length bucket ahead (see warmup --help)",
    "plan": "rank every schedule and mesh shape for one attention layer by predicted time (see plan --help)",
    "simulate": "predicted time and efficiency of each schedule from 8 to 4096 GPUs, CSV/JSON and a plot "
                "(see simulate --help)",
    "calibrate": "measure a profile (kernel and link rates) on the launched ranks (see calibrate --help)",
}


def _no_options(command: str, args: Sequence[str]) -> None:
    """``trace`` and ``env`` take no options: ``--help`` explains them, anything else is an error."""
    argparse.ArgumentParser(prog=f"splitsoftmax {command}", description=HELP[command]).parse_args(list(args))


def _env(args: Sequence[str]) -> int:
    _no_options("env", args)
    from .env import report
    print(report())
    return 0


def _trace(args: Sequence[str]) -> int:
    _no_options("trace", args)
    from .trace import main
    return main()


def _rest(parser: argparse.ArgumentParser, what: str) -> None:
    """The positional ``args``: everything after the command, ``--help`` included, none required."""
    parser.add_argument("args", nargs=argparse.REMAINDER, help=what).required = False


def _bench_parser() -> argparse.ArgumentParser:
    width = max(map(len, BENCHES))
    parser = argparse.ArgumentParser(
        prog="splitsoftmax bench", description="benchmarks of splitsoftmax against its peers; "
        f"{', '.join(CUDA_BENCHES)} time one CUDA device, ring runs on GPUs or CPU ranks, placement on one GPU (or toy sizes on CPU)",
        epilog="\n".join(f"{b:<{width}}  {v}" for b, v in BENCH_HELP.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=BENCHES, help="the benchmark (listed below)")
    _rest(parser, "the benchmark's options (see bench <name> --help)")
    return parser


def _bench(args: Sequence[str]) -> int:
    ns = _bench_parser().parse_args(list(args))
    args = [ns.name, *ns.args]
    asks_help = any(a in ("-h", "--help") for a in args[1:])
    if args[0] in CUDA_BENCHES and not asks_help:
        import torch
        if not torch.cuda.is_available():
            print(f"bench {args[0]} needs a CUDA device (none is visible here); `python -m splitsoftmax verify` "
                  f"checks correctness on CPU", file=sys.stderr)
            return 2
    module = importlib.import_module(f"splitsoftmax.tools.bench.{args[0]}")
    return module.main(list(args[1:]))


def _warmup(args: Sequence[str]) -> int:
    from .warmup import main
    return main(list(args))


def _plan(args: Sequence[str]) -> int:
    from .plan import plan_main
    return plan_main(list(args))


def _simulate(args: Sequence[str]) -> int:
    from .plan import simulate_main
    return simulate_main(list(args))


def _calibrate(args: Sequence[str]) -> int:
    from .calibrate import main
    return main(list(args))


def _verify(args: Sequence[str]) -> int:
    from .verify.run import main
    return main(list(args))


COMMANDS = {"plan": _plan, "simulate": _simulate, "calibrate": _calibrate}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="splitsoftmax", description="exact softmax, logsumexp and attention "
                                     "over rows split across tiles, GPUs and nodes",
                                     epilog="\n".join(f"{k}: {v}" for k, v in HELP.items()),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("trace", "verify", "bench", "env", "warmup", "plan", "simulate", "calibrate"))
    _rest(parser, "arguments of the command (see <command> --help)")
    ns = parser.parse_args(argv)
    if ns.command == "trace":
        return _trace(ns.args)
    if ns.command == "env":
        return _env(ns.args)
    if ns.command == "bench":
        return _bench(ns.args)
    if ns.command == "warmup":
        return _warmup(ns.args)
    if ns.command in COMMANDS:
        return COMMANDS[ns.command](ns.args)
    return _verify(ns.args)
