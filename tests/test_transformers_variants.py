"""Real model shapes through attn_implementation="splitsoftmax": packed documents, padding,
sliding windows, softcap and sinks, with KV caches and across ranks; tiny random configs built
here (no downloads), logits and gradients against transformers' "sdpa" or "eager"."""
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist_util import assert_ok, spawn  # noqa: E402
from _hf_util import CLOSE, assert_grads_close, classes, ids_of, pair  # noqa: E402

import splitsoftmax as ss  # noqa: E402
from splitsoftmax.integrations import transformers as sst  # noqa: E402

WINDOW = dict(sliding_window=4)
# family -> (reference implementation, config overrides); sdpa has no softcap or sinks: eager there
FAMILIES = {
    "Mistral": ("sdpa", WINDOW),
    "Qwen2": ("sdpa", dict(WINDOW, use_sliding_window=True, max_window_layers=1)),
    "Gemma2": ("eager", dict(WINDOW, attn_logit_softcapping=3.0, final_logit_softcapping=None,
                             query_pre_attn_scalar=16)),
    "Gemma3Text": ("sdpa", dict(WINDOW, query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])),
    "GptOss": ("eager", dict(WINDOW, num_local_experts=2, num_experts_per_tok=1)),
}


def family_pair(family: str, **extra):
    if classes(family) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {family} model")
    impl, kw = FAMILIES[family]
    return pair(family, impl, **{**kw, **extra})


def loss_and_grads(ref, ours, ids, **kw):
    """Forward both with the same arguments; logits equal, then gradients of the model's loss."""
    a, b = ref(ids, labels=ids, **kw), ours(ids, labels=ids, **kw)
    torch.testing.assert_close(b.logits, a.logits, **CLOSE)
    a.loss.backward()
    b.loss.backward()
    assert_grads_close(ref, ours)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_window_softcap_sinks_match_the_reference(family):
    """Mistral (window on every layer), Qwen2 (window on some), Gemma-2 (softcap + window),
    Gemma-3 (window), gpt-oss (sinks + window): 13 tokens, longer than the window of 4."""
    ref, ours = family_pair(family)
    loss_and_grads(ref, ours, ids_of(2, 13))


def test_window_at_least_as_long_as_the_keys_is_plain_causal():
    """Gemma-2 builds its sliding masks even when the window covers every key: accepted, equal."""
    ref, ours = family_pair("Gemma2", sliding_window=64)
    loss_and_grads(ref, ours, ids_of(1, 11))


def _packed_positions(lengths, rows=1):
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).expand(rows, -1).contiguous()


@pytest.mark.parametrize("family", ["Llama", "Mistral"])
def test_packed_position_ids_match_sdpa(family):
    """Documents of 5, 1, 7 and 3 tokens in one row (position_ids restart): no attention across them."""
    ref, ours = pair() if family == "Llama" else family_pair(family)
    pos = _packed_positions([5, 1, 7, 3])
    loss_and_grads(ref, ours, ids_of(1, 16), position_ids=pos, use_cache=False)


def test_rows_packed_differently_match_sdpa():
    ref, ours = pair()
    pos = torch.cat((_packed_positions([5, 1, 7, 3]), _packed_positions([9, 7])))
    loss_and_grads(ref, ours, ids_of(2, 16), position_ids=pos, use_cache=False)


def test_flattening_collator_matches_sdpa():
    """DataCollatorWithFlattening with FlashAttention's keywords: cu_seq_lens_q/k and position_ids."""
    ref, ours = pair()
    feats = [{"input_ids": ids_of(1, n, seed=n)[0].tolist()} for n in (6, 2, 9)]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(feats)
    assert "cu_seq_lens_q" in batch
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    kw = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    a = ref(ids, labels=labels, position_ids=pos, use_cache=False)
    b = ours(ids, labels=labels, position_ids=pos, use_cache=False, **kw)
    torch.testing.assert_close(b.logits, a.logits, **CLOSE)
    a.loss.backward()
    b.loss.backward()
    assert_grads_close(ref, ours)
    bad = dict(kw, cu_seq_lens_q=torch.tensor([0, 8, 17], dtype=torch.int32))
    bad["cu_seq_lens_k"] = bad["cu_seq_lens_q"]
    with pytest.raises(ValueError, match="documents of position_ids and of cu_seq_lens_q differ"):
        ours(ids, position_ids=pos, use_cache=False, **bad)


def _padded(b, s, left: bool):
    mask = torch.ones(b, s, dtype=torch.long)
    for r in range(b):
        n = 2 * r + 1
        if left:
            mask[r, :n] = 0
        else:
            mask[r, s - n:] = 0
    return mask


@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("family", ["Llama", "Mistral"])
def test_padding_matches_sdpa(family, left):
    ref, ours = pair() if family == "Llama" else family_pair(family)
    ids, mask = ids_of(3, 12), _padded(3, 12, left)
    labels = ids.masked_fill(mask == 0, -100)
    a = ref(ids, attention_mask=mask, labels=labels)
    b = ours(ids, attention_mask=mask, labels=labels)
    real = mask.bool()
    torch.testing.assert_close(b.logits[real], a.logits[real], **CLOSE)
    a.loss.backward()
    b.loss.backward()
    assert_grads_close(ref, ours)


@pytest.mark.skipif(not getattr(transformers.BertModel, "_supports_attention_backend", False),
                    reason="this transformers' BertModel has its own attention classes")
def test_bidirectional_padding_matches_sdpa():
    """An encoder: padding hides keys from every query (kv_range), on either side."""
    torch.manual_seed(0)
    kw = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
              attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    sst.register()
    ref = transformers.BertModel(transformers.BertConfig(**kw, attn_implementation="sdpa"), add_pooling_layer=False)
    ours = transformers.BertModel(transformers.BertConfig(**kw, attn_implementation="splitsoftmax"),
                                  add_pooling_layer=False)
    ours.load_state_dict(ref.state_dict())
    ids = ids_of(3, 12)
    for left in (True, False):
        mask = _padded(3, 12, left)
        a = ref(ids, attention_mask=mask).last_hidden_state
        b = ours(ids, attention_mask=mask).last_hidden_state
        real = mask.bool()
        torch.testing.assert_close(b[real], a[real], **CLOSE)
        w = torch.randn(a.shape, generator=torch.Generator().manual_seed(3)) * real[..., None]
        (a * w).sum().backward()
        (b * w).sum().backward()
    assert_grads_close(ref, ours)


def _generate(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=0, **kw)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["Llama", "Mistral", "Gemma2"])
def test_padded_batch_generation_matches(family, cache):
    """Left-padded prompts of different lengths, greedy decoding past the window, with a dynamic or
    a static cache: the same tokens and scores as the reference implementation."""
    ref, ours = pair() if family == "Llama" else family_pair(family)
    ids, mask = ids_of(3, 7), _padded(3, 7, left=True)
    kw = dict(attention_mask=mask, **({"cache_implementation": "static"} if cache == "static" else {}))
    a, b = _generate(ref, ids, **kw), _generate(ours, ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.scores, b.scores):
        torch.testing.assert_close(y, x, **CLOSE)


def case_sharded_packed(group):
    """Gloo worker: packed documents (and a window) zigzagged per document across the ranks equal
    the single-process reference, forward and backward; the losses sum to its loss."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    for family in ("Llama", "Mistral"):
        ref, ours = pair() if family == "Llama" else family_pair(family)
        sst.register(sequence_parallel=True)
        lengths = [9, 1, 0, 12, 3]  # one empty document, one shorter than 2P
        ids, pos = ids_of(1, sum(lengths)), _packed_positions(lengths)
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
def test_sharded_packed_gloo_matches_one_process(size):
    assert_ok(spawn(size, "tests/test_transformers_variants.py:case_sharded_packed", timeout=300,
                    env={"SPLITSOFTMAX_TIMEOUT": "60"}), f"transformers packed sharded on {size} Gloo ranks")
