"""Benchmarks against the peers (``python -m splitsoftmax bench <name>``)."""


def best_ms(fn, rep: int = 100, grad_to_none=None) -> float:
    """The better of two medians of ``triton.testing.do_bench`` (ms). A first timing has read low on
    the H200 for torch and splitsoftmax alike: up to 25% for a new softmax shape, 12% for the first
    replay timing of a 1M-key decode graph (docs/benchmarks/decode-merge.md, earlier history)."""
    import triton.testing
    return min(triton.testing.do_bench(fn, warmup=25, rep=rep, grad_to_none=grad_to_none, return_mode="median")
               for _ in range(2))


def graph_ms(fn, rep: int = 100) -> float:
    """:func:`best_ms` of ``fn`` replayed from a CUDA graph (no host launch cost), after a warm-up
    on a side stream."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return best_ms(graph.replay, rep=rep)
