"""attn_implementation="splitsoftmax" on tiny random models (no downloads) against "sdpa": the
two modes (data parallel, and sequence parallel with packed documents and windows on 2 and 3
Gloo ranks), KV caches (dynamic and static), autocast, meta tensors, refusals, shard_inputs."""
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist_util import assert_ok, spawn  # noqa: E402
from _hf_util import (CLOSE, SMALL, VERSION, VOCAB, assert_grads_close, family_pair, ids_of,  # noqa: E402
                      packed_positions, pair)

import splitsoftmax as ss  # noqa: E402
from splitsoftmax.integrations import _hf_masks  # noqa: E402
from splitsoftmax.integrations import transformers as sst  # noqa: E402


def test_logits_and_gradients_match_sdpa():
    ref, ours = pair()
    ids = ids_of(2, 37)
    a, b = ref(ids, labels=ids), ours(ids, labels=ids)
    torch.testing.assert_close(b.logits, a.logits, **CLOSE)
    a.loss.backward()
    b.loss.backward()
    assert_grads_close(ref, ours)


def _generate(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=0, **kw)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_with_a_kv_cache_matches_sdpa(cache):
    """Dynamic: the keys outrun the queries. Static: the keys are max_cache_len rows, most of them
    unfilled, and where the queries sit comes from cache_position (a tensor, no host read)."""
    ref, ours = pair()
    ids = ids_of(2, 9)
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    a, b = _generate(ref, ids, **kw), _generate(ours, ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.scores, b.scores):
        torch.testing.assert_close(y, x, **CLOSE)


def test_static_cache_forward_matches_sdpa():
    """A StaticCache passed by hand: prefill then one step, logits equal sdpa's (the old code aligned
    causal bottom-right over all max_cache_len rows)."""
    ref, ours = pair()
    ids = ids_of(1, 9)
    outs = []
    for model in (ref, ours):
        cache = (transformers.StaticCache(config=model.config, max_cache_len=32) if _hf_new() else
                 transformers.StaticCache(config=model.config, max_batch_size=1, max_cache_len=32))
        with torch.no_grad():
            first = model(ids, past_key_values=cache, use_cache=True,
                          cache_position=torch.arange(9)).logits
            nxt = model(ids[:, -1:], past_key_values=cache, use_cache=True,
                        cache_position=torch.tensor([9])).logits
        outs.append((first, nxt))
    for x, y in zip(*outs):
        torch.testing.assert_close(y, x, **CLOSE)


def _hf_new() -> bool:
    import inspect
    return "max_batch_size" not in inspect.signature(transformers.StaticCache.__init__).parameters


def test_autocast_training_step_matches_sdpa():
    """Trainer(bf16=True) runs the forward under torch.autocast(bfloat16) with float32 weights: RoPE
    gives float32 q/k, the projections bfloat16 v. Loss and gradients against the float32 run: the
    error at most twice (gradients four times) SDPA's under the same autocast."""
    ref, ours = pair()
    ids = ids_of(2, 23)
    exact = ref(ids, labels=ids).loss
    exact.backward()
    want = [p.grad.clone() for p in ref.parameters()]
    ref.zero_grad()
    results = []
    for model in (ref, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (l_sdpa, g_sdpa), (l_ours, g_ours) = results
    assert abs(l_ours - exact).item() <= 2 * abs(l_sdpa - exact).item() + 1e-3
    for w, gs, go in zip(want, g_sdpa, g_ours):
        assert (go - w).abs().max() <= 4 * (gs - w).abs().max() + 1e-3 * w.abs().max()


def test_meta_tensors_through_the_mask_and_attention_functions():
    """Deferred initialisation runs layers on meta tensors: no data is read, shapes come out."""
    from transformers import masking_utils as mu
    q, k = torch.empty(2, 4, 9, 16, device="meta"), torch.empty(2, 2, 9, 16, device="meta")
    pad = torch.ones(2, 9, dtype=torch.bool, device="meta")
    vis = _hf_masks.build(2, q_length=9, kv_length=9, mask_function=mu.causal_mask_function, attention_mask=pad)
    out, _ = sst.attention_forward(_Module(True, 2), q, k, k, vis, position_ids=torch.empty(1, 9, device="meta"))
    assert out.is_meta and out.shape == (2, 9, 4, 16)


@pytest.mark.skipif(VERSION < (5, 0), reason="transformers 4.5x's rotary embedding opens an autocast region on the "
                    "meta device, which torch refuses (before any attention runs)")
def test_meta_device_forward_gives_shapes():
    """Deferred initialisation: a model moved to the meta device runs its forward (shapes only)."""
    sst.register()
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attn_implementation="splitsoftmax"))
    model.to("meta")
    out = model(ids_of(2, 11).to("meta"), attention_mask=torch.ones(2, 11, dtype=torch.long, device="meta")).logits
    assert out.is_meta and out.shape == (2, 11, VOCAB)


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
    from transformers import masking_utils as mu
    ref, ours = pair()
    ids = ids_of(2, 12)
    holes = torch.ones(2, 12, dtype=torch.long)
    holes[0, 4:6] = 0  # padding inside a sequence: not one key interval
    with pytest.raises(ValueError, match="not one contiguous run"):
        ours(ids, attention_mask=holes)
    packed = torch.cat((torch.arange(5), torch.arange(7))).unsqueeze(0).expand(2, -1)
    with pytest.raises(ValueError, match="restart within a row"):  # a cache: transformers masks no packing
        ours(ids, position_ids=packed, use_cache=True)
    qkv = [torch.randn(1, 2, 4, 8) for _ in range(3)]
    with pytest.raises(ValueError, match="explicit attention mask"):
        sst.attention_forward(_Module(True, 1), *qkv, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    custom = _hf_masks.build(1, q_length=4, kv_length=4, mask_function=mu.or_masks(
        mu.causal_mask_function, lambda b, h, q, kv: kv == 0))
    with pytest.raises(ValueError, match="union of mask patterns"):
        sst.attention_forward(_Module(True, 1), *qkv, custom)
    with pytest.raises(ValueError, match="attention weights"):
        sst.attention_forward(_Module(True, 1), *qkv, None, output_attentions=True)
    _, drop = pair(attention_dropout=0.1)
    drop.train()
    with pytest.raises(ValueError, match="dropout"):
        drop(ids)


def test_refusal_waits_for_the_layer_that_needs_it():
    """A mask that cannot be expressed is refused by the layer that uses it, not while it is built."""
    from transformers import masking_utils as mu
    vis = _hf_masks.build(2, q_length=5, kv_length=5, mask_function=mu.and_masks(
        mu.causal_mask_function, lambda b, h, q, kv: kv != 2))
    assert vis.refused and "mask pattern" in vis.refused
    assert vis.ndim == 4 and vis.shape == (2, 1, 5, 5)


def test_shard_inputs_single_process_and_layouts():
    """Zigzag shards of the inputs; labels shifted once on the full sequence; contiguous refused."""
    from splitsoftmax.distributed import LoopbackWorld
    ids = ids_of(2, 10)
    labels = ids.clone()
    labels[0, 4] = -100

    def rank(comm):
        with pytest.raises(ValueError, match="layout='contiguous'"):
            sst.shard_inputs(ids, group=comm, layout="contiguous")
        return sst.shard_inputs(ids, labels=labels, group=comm)

    zig = LoopbackWorld(2).run(rank)
    full_shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    chunks = torch.tensor_split(torch.arange(10), 4)
    for r, got in enumerate(zig):
        idx = torch.cat((chunks[r], chunks[3 - r]))
        assert torch.equal(got["input_ids"], ids[:, idx]) and torch.equal(got["position_ids"], idx.expand(2, -1))
        assert torch.equal(got["shift_labels"], full_shift[:, idx]) and got["labels"] is got["shift_labels"]
        assert got["num_items_in_batch"] == int((full_shift != -100).sum())
        assert "cu_seq_lens_q" not in got


def test_register_defaults_to_every_process_on_its_own_batch():
    assert sst.register() == "splitsoftmax" and sst._CONFIG == {"group": None, "sequence_parallel": False}
    with pytest.raises(TypeError, match="sequence_parallel"):
        sst.register(None, sequence_parallel="yes")


def case_data_parallel(group):
    """Gloo worker, plain data parallelism (register() as is): each rank's batch equals one process
    on that batch, and DDP's averaged gradients equal one process on the whole batch."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, ours = _bert_pair() if _bert_supported() else pair()
    ids = ids_of(2 * world, 13)
    mine = ids[2 * rank:2 * rank + 2]
    want = _main_output(ref(ids))
    ddp = torch.nn.parallel.DistributedDataParallel(ours)  # kept: its reducer averages in the backward
    got = _main_output(ddp(mine))
    torch.testing.assert_close(got, want[2 * rank:2 * rank + 2].detach(), **CLOSE)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))
    (want * w).sum().div(world).backward()
    (got * w[2 * rank:2 * rank + 2]).sum().backward()
    assert_grads_close(ref, ours, rel=5e-5)


def _main_output(out):
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits


def _bert_supported() -> bool:
    """BertModel goes through transformers' attention interface (transformers 5; 4.5x has its own)."""
    return getattr(transformers.BertModel, "_supports_attention_backend", False)


def _bert_pair():
    sst.register()
    torch.manual_seed(0)
    kw = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
              attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    ref = transformers.BertModel(transformers.BertConfig(**kw, attn_implementation="sdpa"),
                                 add_pooling_layer=False).eval()  # every parameter used: DDP reduces them all
    ours = transformers.BertModel(transformers.BertConfig(**kw, attn_implementation="splitsoftmax"),
                                  add_pooling_layer=False).eval()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.mark.distributed
def test_data_parallel_gloo_matches_one_process():
    assert_ok(spawn(2, "tests/test_transformers.py:case_data_parallel", timeout=240,
                    env={"SPLITSOFTMAX_TIMEOUT": "60"}), "transformers data parallel on 2 Gloo ranks")


def case_sharded(group):
    """Gloo worker: zigzag-sharded forward/backward equals the single-process sdpa run."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    ref, ours = pair()
    sst.register(sequence_parallel=True)
    ids = ids_of(2, 29)
    w = torch.randn(2, 29, VOCAB, generator=torch.Generator().manual_seed(2))
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
    # under autocast, as Trainer(bf16=True) runs it (float32 q/k from RoPE, bfloat16 v): cast like SDPA
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = ours(input_ids=inp["input_ids"], position_ids=inp["position_ids"]).logits
        low_sdpa = ss.shard(ref(ids).logits.detach(), 1, layout="zigzag")
    exact = ss.shard(full.detach(), 1, layout="zigzag")
    assert (low.float() - exact).abs().max() <= 2 * (low_sdpa.float() - exact).abs().max() + 1e-3
    with pytest.raises(ValueError, match="zigzag shards"):  # unsharded positions are refused on every rank
        ours(input_ids=inp["input_ids"], position_ids=torch.arange(inp["input_ids"].shape[1]).unsqueeze(0))
    _sharded_packed(group)  # in the same processes: their start-up is most of the time


def _sharded_packed(group):
    """Packed documents (and a window) zigzagged per document across the ranks equal
    the single-process reference, forward and backward; the losses sum to its loss."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    for family in ("Llama", "Mistral"):
        ref, ours = pair() if family == "Llama" else family_pair(family)
        sst.register(sequence_parallel=True)
        lengths = [9, 1, 0, 12, 3]  # one empty document, one shorter than 2P
        ids, pos = ids_of(1, sum(lengths)), packed_positions(lengths)
        want = ref(ids, position_ids=pos, labels=ids, use_cache=False)
        want.loss.backward()
        cu = torch.tensor([0, 9, 10, 10, 22, 25])
        # Llama: the documents from position_ids (which cannot show the empty one); Mistral: as cu_seqlens
        inp = sst.shard_inputs(ids, pos, labels=ids) if family == "Llama" else \
            sst.shard_inputs(ids, labels=ids, cu_seqlens=cu)
        if family == "Llama":
            cu = torch.tensor([0, 9, 10, 22, 25])
        assert torch.equal(inp["cu_seq_lens_q"].cpu().long(), cu)
        got = ours(**inp, use_cache=False)
        torch.testing.assert_close(got.logits, ss.shard(want.logits.detach(), 1, layout="zigzag", cu_seqlens=cu),
                                   **CLOSE)
        got.loss.backward()
        loss = got.loss.detach().reshape(1)
        dist.all_reduce(loss)
        torch.testing.assert_close(loss[0], want.loss.detach(), **CLOSE)
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            g = q.grad.clone()
            dist.all_reduce(g)
            err, scale = (g - p.grad).abs().max().item(), max(1.0, p.grad.abs().max().item())
            assert err <= 5e-5 * scale, f"{family} {name}: {err:.3g} of {scale:.3g}"
        sst.register()


@pytest.mark.distributed
@pytest.mark.parametrize("size", [2, 3])
def test_sharded_gloo_matches_single_process_sdpa(size):
    assert_ok(spawn(size, "tests/test_transformers.py:case_sharded", timeout=300,
                    env={"SPLITSOFTMAX_TIMEOUT": "60"}), f"transformers sharded on {size} Gloo ranks")


def _raises_fast(match: str, fn, **kw):
    """``fn(**kw)`` raises ValueError matching ``match`` within 5 s (the peers' timeout is 60 s)."""
    import time
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        fn(**kw)
    assert time.monotonic() - start < 5, f"took {time.monotonic() - start:.1f} s"


def case_sharded_refusals(group):
    """Gloo worker, 2 ranks, sequence parallel: what one rank refuses reaches the other with the real
    reason within seconds; ranks given different batches, or too short a sequence, refused on both."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    rank = dist.get_rank()
    _, ours = pair()
    sst.register(sequence_parallel=True)
    ids = ids_of(2, 12)
    inp = sst.shard_inputs(ids, labels=ids)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[:, 10:] = 0  # right padding: in rank 0's zigzag chunks (9..11) only
    reason = r"\(sequence-parallel\) does not take padding masks"
    _raises_fast(reason if rank == 0 else rf"rank\(s\) \[0\] rejected their arguments \(rank 0: .*{reason}", ours,
                 input_ids=inp["input_ids"], position_ids=inp["position_ids"],
                 attention_mask=ss.shard(mask, 1, layout="zigzag"))
    _raises_fast(r"shard: input_ids differs across ranks \(rank\(s\) \[0\] hold copy 1; rank\(s\) \[1\] hold copy 2\)",
                 sst.shard_inputs, input_ids=ids_of(2, 12, seed=1 + rank))  # each rank its own batch
    _raises_fast(r"shard: labels differs across ranks", sst.shard_inputs, input_ids=ids, labels=ids_of(2, 12, rank))
    packed = packed_positions([5, 7], rows=2)
    if rank == 1:
        packed[1] = torch.arange(12)
    reason = "the rows of position_ids pack different documents"
    _raises_fast(reason if rank == 1 else rf"rank\(s\) \[1\] rejected their arguments \(rank 1: shard_inputs: {reason}",
                 sst.shard_inputs, input_ids=ids, position_ids=packed)
    _raises_fast(r"shard_inputs: a sequence of 1 positions leaves rank\(s\) \[1\] of 2 an empty zigzag shard",
                 sst.shard_inputs, input_ids=ids[:, :1])
    out = ours(**sst.shard_inputs(ids, labels=ids))  # the group is still in step
    assert out.logits.shape == (2, 6, VOCAB) and torch.isfinite(out.loss)


@pytest.mark.distributed
def test_sharded_refusals_reach_every_rank_gloo():
    assert_ok(spawn(2, "tests/test_transformers.py:case_sharded_refusals", timeout=240,
                    env={"SPLITSOFTMAX_TIMEOUT": "60"}), "transformers sharded refusals on 2 Gloo ranks")
