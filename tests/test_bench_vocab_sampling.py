"""bench vocab's sampling part on the CPU: the torch peers draw inside the filtered support, and
the table and targets read the timings they are given."""
import torch

from _sampling_util import filtered_probs
from splitsoftmax.tools.bench import vocab_sampling as vs


def test_peers_draw_inside_the_support():
    torch.manual_seed(0)
    x = torch.randn(400, 50) * 2
    for name, kw in vs.FILTERS.items():
        tokens = vs.torch_sampler(name)(x)
        assert tokens.shape == (400,)
        if name == "greedy":
            assert torch.equal(tokens, x.argmax(dim=1))
            continue
        for r in range(0, 400, 7):
            assert filtered_probs(x[r], **kw)[tokens[r]] > 0, (name, r)


def test_table_and_targets():
    results = [{"batch": b, "filter": f, "impl": impl, "eager_us": 10.0 * (1 + (impl == "torch")) * b,
                "graph_us": 5.0 * b} for b in vs.BATCHES for f in vs.FILTERS for impl in ("torch", "ss")]
    r = {"vocab": vs.VOCAB, "gate": [{"filter": f, "ok": True} for f in vs.FILTERS], "results": results,
         "targets": vs._targets(results)}
    assert r["targets"]["top_p=0.9 at batch 256"] == {"limit_us": 200.0, "eager_us": 2560.0, "graph_us": 1280.0,
                                                      "eager_met": False, "graph_met": False}
    assert r["targets"]["every filter at batch 1"]["eager_met"] and r["targets"]["every filter at batch 1"]["graph_met"]
    text = vs.table_sampling(r)
    assert "  256 top_p=0.9" in text and "2.00x" in text and vs.passed(r)
    assert not vs.passed(dict(r, gate=[{"filter": "plain", "ok": False}]))
