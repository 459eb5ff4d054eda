"""splitsoftmax: exact softmax, logsumexp and attention over rows split across tiles, GPUs and nodes.

Every split computes a small state (running max ``m``, normaliser ``l``, numerator ``o``);
states merge with the associative rescaling operator of :mod:`splitsoftmax.state`.
"""
from .functional import attention, log_softmax, logsumexp, merge_states, softmax

__version__ = "0.1.0"

__all__ = [
    "softmax", "log_softmax", "logsumexp", "attention", "merge_states",
]
