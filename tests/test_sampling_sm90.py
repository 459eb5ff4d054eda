"""The sampling kernels that merge records compile for sm_90 (no GPU needed) with one record per
row (``KR = 1``, plain and greedy draws), on the triton under test (``make test`` runs it on both
ends of the declared range). ``tl.topk`` itself fails to compile for ``k = 1`` on Triton 3.6."""
from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for a GPU target: not under the interpreter", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from splitsoftmax.ops.sampling.jit import _top  # noqa: E402


@triton.jit
def _merge_keys(X, Y, N: tl.constexpr, K: tl.constexpr):
    tl.store(Y + tl.arange(0, K), _top(tl.load(X + tl.arange(0, N)), K))


@pytest.mark.parametrize("k", [1, 2, 8])
def test_top_keys_compile_for_sm90(k):
    src = ASTSource(fn=_merge_keys, signature={"X": "*i64", "Y": "*i64", "N": "constexpr", "K": "constexpr"},
                    constexprs={"N": 64, "K": k})
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).metadata.shared >= 0
