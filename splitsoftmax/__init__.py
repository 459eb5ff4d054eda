"""splitsoftmax: exact softmax, logsumexp and attention over rows split across tiles, GPUs and nodes.

Every split computes a small state (running max ``m``, normaliser ``l``, numerator ``o``);
states merge with the associative rescaling operator of :mod:`splitsoftmax.core.state`.
"""
from .distributed.shard import shard, unshard
from .ops.attention.api import attention
from .ops.attention.context import context_parallel
from .ops.attention.sharded import sharded_attention
from .ops.merge.api import merge_states
from .ops.softmax.api import log_softmax, logsumexp, softmax
from .ops.softmax.sharded import sharded_log_softmax, sharded_logsumexp, sharded_softmax
from .ops.cross_entropy.api import cross_entropy, sharded_cross_entropy
from .ops.vocab.api import entropy, kl_div, logprobs, sharded_entropy, sharded_kl_div, sharded_logprobs
from .ops.sampling.api import sample, sharded_sample, sharded_topk, topk
from .planning import plan_attention

__version__ = "0.1.0"

__all__ = [
    "softmax", "log_softmax", "logsumexp", "attention", "merge_states",
    "sharded_softmax", "sharded_log_softmax", "sharded_logsumexp", "sharded_attention", "shard", "unshard",
    "context_parallel",
    "cross_entropy", "sharded_cross_entropy",
    "logprobs", "entropy", "kl_div", "sharded_logprobs", "sharded_entropy", "sharded_kl_div",
    "topk", "sharded_topk", "sample", "sharded_sample",
    "plan_attention",
]
