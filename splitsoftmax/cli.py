"""``python -m splitsoftmax <trace|verify|bench|env>`` (also the ``splitsoftmax`` script)."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

BENCHES = ("softmax", "attention", "ring", "cross_entropy", "vocab")


def _env() -> int:
    from .env import report
    print(report())
    return 0


def _trace() -> int:
    from .trace import main
    return main()


def _bench(args: Sequence[str]) -> int:
    if not args or args[0] not in BENCHES:
        print(f"usage: python -m splitsoftmax bench {{{','.join(BENCHES)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(f"splitsoftmax.bench.{args[0]}")
    return module.main(list(args[1:]))


def _verify(args: Sequence[str]) -> int:
    from .verify import main
    return main(list(args))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="splitsoftmax", description=__doc__)
    parser.add_argument("command", choices=("trace", "verify", "bench", "env"))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the command (see <command> --help)")
    ns = parser.parse_args(argv)
    if ns.command == "trace":
        return _trace()
    if ns.command == "env":
        return _env()
    if ns.command == "bench":
        return _bench(ns.args)
    return _verify(ns.args)
