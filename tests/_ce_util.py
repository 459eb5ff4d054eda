"""Shared by the cross-entropy tests: a loss and its logits gradient from one backward."""
import torch


def loss_and_grad(fn, logits, target, **kw):
    """``fn(x, target, **kw)`` on a fresh leaf copy ``x`` of ``logits``, and ``d(sum(loss * w))/dx``
    (``w`` a ramp exact in bf16, so reduction='none' is checked row by row)."""
    x = logits.detach().clone().requires_grad_(True)
    loss = fn(x, target, **kw)
    w = torch.linspace(0.5, 1.5, loss.numel()).bfloat16().to(loss.dtype).reshape(loss.shape)
    (g,) = torch.autograd.grad((loss * w).sum(), x)
    return loss, g
