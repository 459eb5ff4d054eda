"""Real model shapes through attn_implementation="splitsoftmax" on one process: packed documents,
padding, sliding windows, softcap and sinks, with KV caches (across ranks: test_transformers.py);
tiny random configs built here (no downloads), logits and gradients against "sdpa" or "eager"."""
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _hf_util import (CLOSE, FAMILIES, assert_grads_close, family_pair, ids_of,  # noqa: E402
                      packed_positions, pair)

from splitsoftmax.integrations import transformers as sst  # noqa: E402


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


@pytest.mark.parametrize("family", ["Llama", "Mistral"])
def test_packed_position_ids_match_sdpa(family):
    """Documents of 5, 1, 7 and 3 tokens in one row (position_ids restart): no attention across them."""
    ref, ours = pair() if family == "Llama" else family_pair(family)
    pos = packed_positions([5, 1, 7, 3])
    loss_and_grads(ref, ours, ids_of(1, 16), position_ids=pos, use_cache=False)


def test_rows_packed_differently_match_sdpa():
    ref, ours = pair()
    pos = torch.cat((packed_positions([5, 1, 7, 3]), packed_positions([9, 7])))
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
    c = ours(ids, labels=labels, use_cache=False, **kw)  # (the documents from cu_seq_lens_q alone)
    torch.testing.assert_close(c.logits, a.logits, **CLOSE)
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
