"""The accuracy half of ``python -m splitsoftmax bench model`` on a tiny Llama on CPU: the bf16 model
against its float32 truth (small, nonzero), a perturbed model (large), and a truth that follows the
model's buffers (the rotary frequencies live outside the state dict)."""
import argparse
import os

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from splitsoftmax.tools.bench import model as bm  # noqa: E402
from splitsoftmax.integrations.transformers import register  # noqa: E402

S, B = 128, 2
# initializer_range 0.1: attention logits of order 1 (0.02 at hidden 64 leaves it near uniform)
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1)


@pytest.fixture
def model():
    register()
    args = argparse.Namespace(vocab=97, intermediate=96, layers=2, shapes=[(S, B)])
    return bm.build(args, "cpu", **TINY)


@pytest.fixture
def ids():
    return torch.randint(0, 97, (B, S), generator=torch.Generator().manual_seed(1))


def _noise(model, frac: float) -> None:
    """Add ``frac`` of each weight's standard deviation as Gaussian noise (fixed seed)."""
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((frac * p.float().std() * torch.randn(p.shape, generator=gen)).to(p.dtype))


def test_build_is_bf16_with_float32_rotary_frequencies(model):
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("impl", ["sdpa", "splitsoftmax"])
def test_bf16_against_float32_truth_is_small_but_nonzero(model, ids, impl):
    ref = bm.truth(model, ids)
    sdpa = bm.errors(model, ids, "sdpa", ref)
    got = bm.errors(model, ids, impl, ref)
    assert 1e-3 < got["grad_rel_err"] < 3e-2, got
    assert got["grad_rel_err"] < 1.5 * sdpa["grad_rel_err"], (got, sdpa)
    assert got["loss_err"] < 2e-3, got


def test_perturbed_model_gives_a_large_difference(model, ids):
    ref = bm.truth(model, ids)
    _noise(model, 0.3)
    got = bm.errors(model, ids, "sdpa", ref)
    assert got["grad_rel_err"] > 0.2, got


def test_truth_follows_the_models_buffers_and_keeps_its_config(model, ids):
    """Frequencies scaled by 1.5 in the bf16 model: a truth rebuilt from the config and the state dict
    would keep the original ones (a large difference); the copied truth keeps the metric small."""
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.mul_(1.5)
    bm._use(model, "splitsoftmax")
    ref = bm.truth(model, ids)
    assert model.config._attn_implementation == "splitsoftmax"
    got = bm.errors(model, ids, "sdpa", ref)
    assert got["grad_rel_err"] < 3e-2, got


def test_truths_of_several_batches_are_each_batchs_truth(model, ids):
    """One float32 copy serves every batch: each truth equals the one a copy of its own gives."""
    other = torch.randint(0, 97, (B, S), generator=torch.Generator().manual_seed(3))
    refs = bm.truths(model, [ids, other])
    for got, want in zip(refs, (bm.truth(model, ids), bm.truth(model, other))):
        assert got[0] == want[0] and torch.equal(got[1], want[1])
    assert refs[0][0] != refs[1][0]


def test_errors_over_batches_are_each_batchs_errors_and_their_means(model, ids):
    other = torch.randint(0, 97, (B, S), generator=torch.Generator().manual_seed(3))
    batches = [ids, other]
    refs = bm.truths(model, batches)
    got = bm.errors_over(model, batches, "splitsoftmax", refs)
    each = [bm.errors(model, x, "splitsoftmax", ref) for x, ref in zip(batches, refs)]
    assert got["loss_err"] == each[0]["loss_err"] and got["grad_rel_err"] == each[0]["grad_rel_err"]
    assert got["loss_err_batches"] == [e["loss_err"] for e in each]
    assert got["loss_err_mean"] == pytest.approx((each[0]["loss_err"] + each[1]["loss_err"]) / 2, rel=1e-12)
    assert got["grad_rel_err_mean"] == pytest.approx((each[0]["grad_rel_err"] + each[1]["grad_rel_err"]) / 2,
                                                     rel=1e-12)
    assert each[0]["loss_err"] != each[1]["loss_err"]


def test_run_shape_takes_the_errors_then_times_each_under_its_own_attention(model, monkeypatch):
    """``run_shape``'s error phase over three batches on CPU; its timing phase needs CUDA events, so
    ``timed`` is replaced by a record of what it was given."""
    seen = []

    def timed(m, ids, impl, steps):
        seen.append((impl, m.config._attn_implementation, ids.shape))
        return {"ms": 1.0}
    monkeypatch.setattr(bm, "timed", timed)
    monkeypatch.setattr(bm, "IMPLS", ("sdpa", "splitsoftmax"))
    rec = bm.run_shape(model, S, B, steps=1, error_batches=3)
    # each implementation timed under its own attention (the error phase left the last one's set)
    assert seen == [("sdpa", "sdpa", (B, S)), ("splitsoftmax", "splitsoftmax", (B, S))]
    for impl in ("sdpa", "splitsoftmax"):
        assert len(rec[impl]["loss_err_batches"]) == 3 and rec[impl]["ms"] == 1.0
        assert rec[impl]["loss_err_batches"][0] == rec[impl]["loss_err"]


def test_run_shape_without_errors_times_alone(model, monkeypatch):
    """``error_batches = 0`` (lengths whose float32 truth does not fit): no truth is taken, each
    implementation is timed, and the table shows its time with no errors."""
    def no_truth(*a):
        raise AssertionError("no float32 truth with error_batches = 0")
    monkeypatch.setattr(bm, "truths", no_truth)
    monkeypatch.setattr(bm, "timed", lambda m, ids, impl, steps: {"ms": 2.0, "peak_gib": 0.5})
    monkeypatch.setattr(bm, "IMPLS", ("sdpa_cudnn", "splitsoftmax"))
    rec = bm.run_shape(model, S, B, steps=1, error_batches=0)
    assert rec["sdpa_cudnn"] == rec["splitsoftmax"] == {"ms": 2.0, "peak_gib": 0.5} and "loss_fp32" not in rec
    lines = bm.table([rec]).splitlines()
    assert len(lines) == 3 and lines[2].split("|")[1].split()[:3] == ["splitsoftmax", "2.0", "0.50"]
    assert lines[2].rstrip().endswith("1.00x")
