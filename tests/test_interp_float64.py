"""float64 inputs take the float64 torch path even where Triton would run (the kernels keep
float32 statistics): gradcheck holds with TRITON_INTERPRET=1 as on the CPU lane."""
import pytest
import torch

import splitsoftmax as ss
from splitsoftmax.ops._registry import use_triton

pytestmark = pytest.mark.interpreter


def test_float64_is_routed_to_the_torch_path():
    assert use_triton(torch.zeros(1)) and not use_triton(torch.zeros(1, dtype=torch.float64))


def test_gradcheck_float64():
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: ss.log_softmax(t, 0), (x,))
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda a, b, c: ss.attention(a, b, c, causal=True), (q, k, v))
