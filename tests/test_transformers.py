"""attn_implementation="splitsoftmax" on a tiny random Llama (no downloads) against "sdpa"."""
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import splitsoftmax as ss  # noqa: E402
from splitsoftmax.integrations import transformers as sst  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist_util import assert_ok, spawn  # noqa: E402

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
CLOSE = dict(atol=2e-5, rtol=2e-5)


def models(**overrides):
    """The same random Llama weights under ``sdpa`` and ``splitsoftmax``."""
    sst.register()
    torch.manual_seed(0)
    kw = {**SMALL, **overrides}
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw, attn_implementation="sdpa"))
    ours = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw, attn_implementation="splitsoftmax"))
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == "splitsoftmax"
    return ref, ours


def ids_of(b, s, seed=1):
    return torch.randint(0, SMALL["vocab_size"], (b, s), generator=torch.Generator().manual_seed(seed))


def test_logits_and_gradients_match_sdpa():
    ref, ours = models()
    ids = ids_of(2, 37)
    a, b = ref(ids, labels=ids), ours(ids, labels=ids)
    torch.testing.assert_close(b.logits, a.logits, **CLOSE)
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **CLOSE, msg=name)


def test_generate_with_kv_cache_matches_sdpa():
    """Decoding with a cache: the keys outrun the queries and causal aligns bottom-right."""
    ref, ours = models()
    ids = ids_of(1, 11)
    with torch.no_grad():
        a = ref.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
        b = ours.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.scores, b.scores):
        torch.testing.assert_close(y, x, **CLOSE)


class _Module:
    def __init__(self, causal, groups):
        self.is_causal, self.num_key_value_groups = causal, groups


@pytest.mark.parametrize("causal", [False, True])
def test_attention_function_gqa_scaling_and_causal(causal):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    q, k, v = torch.randn(2, 6, 13, 16), torch.randn(2, 2, 13, 16), torch.randn(2, 2, 13, 16)
    for scaling in (None, 0.37):
        got, _ = sst.attention_forward(_Module(causal, 3), q, k, v, None, scaling=scaling)
        want, _ = sdpa_attention_forward(_Module(causal, 3), q, k, v, None, scaling=scaling)
        assert got.shape == (2, 13, 6, 16)
        torch.testing.assert_close(got, want, **CLOSE)
    got, _ = sst.attention_forward(_Module(True, 3), q, k, v, None, is_causal=False)
    want, _ = sdpa_attention_forward(_Module(True, 3), q, k, v, None, is_causal=False)
    torch.testing.assert_close(got, want, **CLOSE)


def test_refuses_what_it_cannot_compute():
    ref, ours = models()
    ids = ids_of(2, 12)
    padded = torch.ones(2, 12, dtype=torch.long)
    padded[0, :3] = 0
    with pytest.raises(ValueError, match="padding"):
        ours(ids, attention_mask=padded)
    ours(ids, attention_mask=torch.ones(2, 12, dtype=torch.long))  # an all-ones mask is fine
    packed = torch.cat((torch.arange(5), torch.arange(7))).unsqueeze(0).expand(2, -1)
    for use_cache in (False, True):  # the mask function's check, and the attention function's
        with pytest.raises(ValueError, match="packed"):
            ours(ids, position_ids=packed, use_cache=use_cache)
    with pytest.raises(ValueError, match="mask"):
        sst.attention_forward(_Module(True, 1), *(torch.randn(1, 2, 4, 8) for _ in range(3)),
                              torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="sliding"):
        sst.attention_forward(_Module(True, 1), *(torch.randn(1, 2, 4, 8) for _ in range(3)), None, sliding_window=2)
    _, drop = models(attention_dropout=0.1)
    drop.train()
    with pytest.raises(ValueError, match="dropout"):
        drop(ids)


def test_refuses_sliding_window_layers():
    cfg = dict(SMALL, sliding_window=4)
    sst.register()
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**cfg, attn_implementation="splitsoftmax"))
    with pytest.raises(ValueError, match="sliding"):
        model(ids_of(1, 9))


def test_shard_inputs_single_process_and_layouts():
    """In a one-rank group the shards are the inputs; labels come back shifted once."""
    from splitsoftmax.distributed import LoopbackWorld
    ids = ids_of(2, 10)
    labels = ids.clone()
    labels[0, 4] = -100

    def rank(comm):
        return sst.shard_inputs(ids, labels=labels, group=comm)

    zig = LoopbackWorld(2).run(rank)
    full_shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    chunks = torch.tensor_split(torch.arange(10), 4)
    for r, got in enumerate(zig):
        idx = torch.cat((chunks[r], chunks[3 - r]))
        assert torch.equal(got["input_ids"], ids[:, idx]) and torch.equal(got["position_ids"], idx.expand(2, -1))
        assert torch.equal(got["shift_labels"], full_shift[:, idx]) and got["labels"] is got["shift_labels"]
        assert got["num_items_in_batch"] == int((full_shift != -100).sum())


def case_sharded(group):
    """Gloo worker: zigzag-sharded forward/backward equals the single-process sdpa run."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    ref, ours = models()
    ids = ids_of(2, 29)
    w = torch.randn(2, 29, SMALL["vocab_size"], generator=torch.Generator().manual_seed(2))
    full = ref(ids).logits
    (full * w).sum().backward()
    inp = sst.shard_inputs(ids, labels=ids)
    out = ours(input_ids=inp["input_ids"], position_ids=inp["position_ids"]).logits
    torch.testing.assert_close(out, ss.shard(full.detach(), 1, layout="zigzag"), **CLOSE)
    (out * ss.shard(w, 1, layout="zigzag")).sum().backward()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        g = q.grad.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(g, p.grad, atol=5e-5, rtol=5e-5, msg=name)
    # the model's own loss: each rank's share of the global mean, summing to the sdpa loss
    loss = ours(**inp).loss.detach().reshape(1)
    dist.all_reduce(loss)
    torch.testing.assert_close(loss[0], ref(ids, labels=ids).loss.detach(), **CLOSE)
    with pytest.raises(ValueError, match="zigzag shard"):  # unsharded positions are refused on every rank
        ours(input_ids=inp["input_ids"], position_ids=torch.arange(inp["input_ids"].shape[1]).unsqueeze(0))


@pytest.mark.distributed
@pytest.mark.parametrize("size", [2, 3])
def test_sharded_gloo_matches_single_process_sdpa(size):
    assert_ok(spawn(size, "tests/test_transformers.py:case_sharded", timeout=240,
                    env={"SPLITSOFTMAX_TIMEOUT": "60"}), f"transformers sharded on {size} Gloo ranks")
