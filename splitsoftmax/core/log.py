"""The ``logging`` logger ``"splitsoftmax"`` and the ``SPLITSOFTMAX_LOG`` switch.

The sharded schedules log at DEBUG what they decide and move: the block pairs each ring step
computes, every transfer posted (peer, elements, bytes), host time per step, the tree's rounds.
Nothing is printed unless asked: ``SPLITSOFTMAX_LOG=debug`` (or ``info``, ``warning``, ...) sets the
logger's level and, when the application has configured no handler for it, adds one that writes
``splitsoftmax[rank R] LEVEL message`` lines to stderr. An application with its own logging setup
can instead configure ``logging.getLogger("splitsoftmax")`` as usual.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import warnings

LOG = logging.getLogger("splitsoftmax")
LEVELS = ("debug", "info", "warning", "error", "critical")


def _rank() -> str:
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        if var in os.environ:
            return os.environ[var]
    return "0"


def configure(value: str | None = None) -> None:
    """Apply ``SPLITSOFTMAX_LOG`` (or ``value``): a level name; unset or empty leaves logging alone."""
    value = (os.environ.get("SPLITSOFTMAX_LOG", "") if value is None else value).strip().lower()
    if not value:
        return
    if value not in LEVELS:
        warnings.warn(f"SPLITSOFTMAX_LOG={value!r} is not one of {', '.join(LEVELS)}; ignored", stacklevel=2)
        return
    LOG.setLevel(value.upper())
    if not LOG.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"splitsoftmax[rank {_rank()}] %(levelname)s %(message)s"))
        LOG.addHandler(handler)


def nbytes(t) -> int:
    return t.numel() * t.element_size()


clock = time.perf_counter  # host time of a step (CUDA work may still be running: launch cost, not GPU time)


configure()
