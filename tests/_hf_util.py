"""Tiny random transformers models for the integration tests (built here, nothing downloaded)."""
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers  # noqa: E402

from splitsoftmax.integrations import transformers as sst  # noqa: E402

VOCAB = 97
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
CLOSE = dict(atol=2e-5, rtol=2e-5)
VERSION = tuple(int(p) for p in transformers.__version__.split(".")[:2])


# families whose causal-LM class is not named after their config
_LM = {"Gemma3Text": "Gemma3ForCausalLM"}


def classes(family: str):
    """``(Config, ForCausalLM)`` of a model family, or None where this transformers has none."""
    cfg = getattr(transformers, f"{family}Config", None)
    model = getattr(transformers, _LM.get(family, f"{family}ForCausalLM"), None)
    return None if cfg is None or model is None else (cfg, model)


def pair(family: str = "Llama", ref_impl: str = "sdpa", **overrides):
    """The same random weights under ``ref_impl`` and ``splitsoftmax`` (registered for one process)."""
    sst.register()
    config_cls, model_cls = classes(family)
    torch.manual_seed(0)
    kw = {**SMALL, **overrides}
    ref = model_cls(config_cls(**kw, attn_implementation=ref_impl)).eval()
    ours = model_cls(config_cls(**kw, attn_implementation="splitsoftmax")).eval()
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == "splitsoftmax"
    return ref, ours


def ids_of(b, s, seed=1):
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def assert_grads_close(ref, ours, rel: float = 2e-5):
    """Every parameter's gradient: max abs error at most ``rel`` times the gradient's largest entry
    (at least 1), the float32 summation error of one backward."""
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        if p.grad is None:
            assert q.grad is None or not q.grad.any(), name
            continue
        err, scale = (q.grad - p.grad).abs().max().item(), max(1.0, p.grad.abs().max().item())
        assert err <= rel * scale, f"{name}: max abs error {err:.3g}, largest gradient entry {scale:.3g}"


WINDOW = dict(sliding_window=4)
# family -> (reference implementation, config overrides); sdpa has no softcap or sinks: eager there
FAMILIES = {
    "Mistral": ("sdpa", WINDOW),
    "Qwen2": ("sdpa", dict(WINDOW, use_sliding_window=True, max_window_layers=1)),
    "Gemma2": ("eager", dict(WINDOW, attn_logit_softcapping=3.0, final_logit_softcapping=None,
                             query_pre_attn_scalar=16)),
    "Gemma3Text": ("sdpa", dict(WINDOW, query_pre_attn_scalar=16,
                                layer_types=["sliding_attention", "full_attention"])),
    "GptOss": ("eager", dict(WINDOW, num_local_experts=2, num_experts_per_tok=1)),
}


def family_pair(family: str, **extra):
    """The reference and splitsoftmax models of a family with a window (and softcap or sinks)."""
    if classes(family) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {family} model")
    impl, kw = FAMILIES[family]
    return pair(family, impl, **{**kw, **extra})


def packed_positions(lengths, rows=1):
    """position_ids of documents of ``lengths`` packed in one row (restarting at 0), ``rows`` times."""
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).expand(rows, -1).contiguous()
