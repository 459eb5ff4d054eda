"""Sequence parallelism as a property of a model (attn_implementation="splitsoftmax_sp") beside local
models in the same process; generation refused there with the way out; shard_inputs' loss scale
under DDP (data x sequence parallel) against one process; the Trainer recipe; packed sequences and
use_cache in the README."""
import os
import re
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist_util import ROOT, VENV_BIN, _collect, _start, assert_ok, spawn, worker_env  # noqa: E402
from _hf_util import CLOSE, SMALL, VOCAB, classes, ids_of, packed_positions, pair  # noqa: E402

import splitsoftmax as ss  # noqa: E402
from splitsoftmax.integrations import transformers as sst  # noqa: E402


def _models(*impls):
    """Tiny Llamas with the same random weights, one per attention implementation."""
    config_cls, model_cls = classes("Llama")
    torch.manual_seed(0)
    models = [model_cls(config_cls(**SMALL, attn_implementation=impl)).eval() for impl in impls]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    return models


def _to_local(model):
    """Switch a model to local attention, as the refusal tells the user to."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("splitsoftmax")
    else:  # transformers 4.53 has no set_attn_implementation; the layers read the config on every call
        model.config._attn_implementation = "splitsoftmax"


def _generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)


def test_register_adds_a_sequence_parallel_name_and_keeps_the_plain_one():
    from transformers import AttentionInterface
    assert sst.register() == "splitsoftmax" and sst._CONFIG == {"group": None, "sequence_parallel": False}
    assert AttentionInterface._global_mapping["splitsoftmax_sp"] is sst.sharded_attention_forward
    assert AttentionInterface._global_mapping["splitsoftmax"] is sst.attention_forward


def test_sequence_parallel_name_without_a_group_is_refused():
    """One process, no torch.distributed group: the sequence-parallel model says what it needs."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a default group is initialised in this process")
    sst.register()
    (sp,) = _models("splitsoftmax_sp")
    with pytest.raises(ValueError, match="splitsoftmax_sp.*initialised torch.distributed group"):
        sp(ids_of(1, 8))


def case_per_model_modes(group):
    """Gloo worker: a sequence-parallel model and local models side by side in one process; the
    sequence-parallel one refuses generate() saying what to do, and after the switch generates as
    sdpa does; register(sequence_parallel=True) still makes the plain name sequence-parallel."""
    torch.set_num_threads(1)
    sst.register()
    ref, local, sp = _models("sdpa", "splitsoftmax", "splitsoftmax_sp")
    ids = ids_of(2, 21)
    full = ref(ids).logits.detach()
    inp = sst.shard_inputs(ids, labels=ids)
    got = sp(input_ids=inp["input_ids"], position_ids=inp["position_ids"]).logits
    torch.testing.assert_close(got, ss.shard(full, 1, layout="zigzag"), **CLOSE)
    torch.testing.assert_close(local(ids).logits, full, **CLOSE)  # the whole sequence on this rank: local
    prompt = ids_of(1, 7, seed=4)
    with pytest.raises(ValueError, match=r"cannot generate.*attn_implementation='splitsoftmax' or 'sdpa'") as err:
        _generate(sp, prompt)
    assert "shard_inputs" not in str(err.value)
    switch = "set_attn_implementation" if hasattr(sp, "set_attn_implementation") else "_attn_implementation ="
    assert switch in str(err.value), str(err.value)
    # a decode step after a sharded prefill (a cache of shards): refused the same way
    with torch.no_grad():
        out = sp(input_ids=inp["input_ids"], position_ids=inp["position_ids"], use_cache=True)
        with pytest.raises(ValueError, match="cannot generate"):
            sp(input_ids=ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
    _to_local(sp)
    assert torch.equal(_generate(sp, prompt), _generate(ref, prompt))
    # the older spelling: the plain name sequence-parallel for every model that uses it
    sst.register(sequence_parallel=True)
    (plain,) = _models("splitsoftmax")
    got = plain(input_ids=inp["input_ids"], position_ids=inp["position_ids"]).logits
    torch.testing.assert_close(got, ss.shard(full, 1, layout="zigzag"), **CLOSE)
    sst.register()


@pytest.mark.distributed
def test_sequence_parallel_is_per_model_and_refuses_generation():
    assert_ok(spawn(2, "tests/test_transformers_parallel.py:case_per_model_modes", timeout=240,
                    env={"SPLITSOFTMAX_TIMEOUT": "60"}), "per-model sequence parallelism on 2 Gloo ranks")


def _ddp_step(sp_group, dp_group, ids, labels, ref):
    """DDP over every rank, each on its replica's rows and its shard: loss * loss_scale, backward;
    the averaged gradients must be one process's on the whole batch."""
    import torch.distributed as dist
    sst.register(sp_group)
    (ours,) = _models("splitsoftmax_sp")
    dp_rank = 0 if dp_group is None else dist.get_rank(dp_group)
    dp = 1 if dp_group is None else dist.get_world_size(dp_group)
    rows = ids.shape[0] // dp
    part = slice(dp_rank * rows, (dp_rank + 1) * rows)
    inputs = sst.shard_inputs(ids[part], labels=labels[part], dp_group=dp_group)
    assert inputs.loss_scale == dist.get_world_size()
    assert inputs["num_items_in_batch"] == int((labels[:, 1:] != -100).sum())  # every replica's tokens
    ddp = torch.nn.parallel.DistributedDataParallel(ours)
    (ddp(**inputs).loss * inputs.loss_scale).backward()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        err, scale = (q.grad - p.grad).abs().max().item(), max(1.0, p.grad.abs().max().item())
        assert err <= 5e-5 * scale, f"{name}: {err:.3g} of {scale:.3g}"


def case_loss_scale(group):
    """Gloo worker, 2 ranks: data parallel (2 replicas of one rank each) and sequence parallel (one
    replica over both ranks), DDP over both; replicas with different token counts (padding labels)."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    (ref,) = _models("sdpa")
    ids = ids_of(4, 19)
    labels = ids.clone()
    labels[2:, 11:] = -100  # the second replica predicts fewer tokens: the mean is over the global count
    ref(ids, labels=labels).loss.backward()
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    _ddp_step(singles[dist.get_rank()], dist.group.WORLD, ids, labels, ref)  # dp 2 x sp 1
    _ddp_step(None, None, ids, labels, ref)  # dp 1 x sp 2
    sst.register()


@pytest.mark.distributed
def test_shard_inputs_loss_scale_under_ddp_matches_one_process():
    assert_ok(spawn(2, "tests/test_transformers_parallel.py:case_loss_scale", timeout=240,
                    env={"SPLITSOFTMAX_TIMEOUT": "60"}), "shard_inputs loss scale on 2 Gloo ranks")


def test_shard_inputs_loss_scale_on_one_process():
    from splitsoftmax.distributed import LoopbackWorld
    got = LoopbackWorld(2).run(lambda comm: sst.shard_inputs(ids_of(1, 9), labels=ids_of(1, 9), group=comm))
    assert [g.loss_scale for g in got] == [2, 2] and all(isinstance(g, dict) for g in got)


@pytest.mark.distributed
@pytest.mark.parametrize("dp", [1, 2])
def test_trainer_recipe_matches_one_process(dp):
    """examples/trainer_sp_example.py: transformers.Trainer, two SGD steps, sp 2 (and dp 2 x sp 2)."""
    pytest.importorskip("accelerate")
    exe = os.path.join(VENV_BIN, "torchrun")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "torch.distributed.run"]
    env = worker_env({"TORCHELASTIC_ERROR_FILE": os.devnull, "HF_HUB_OFFLINE": "1", "SPLITSOFTMAX_TIMEOUT": "60"})
    example = os.path.join(ROOT, "examples", "trainer_sp_example.py")
    p, log = _start([*cmd, "--standalone", f"--nproc-per-node={2 * dp}", "--max-restarts=0", example,
                     "--dp", str(dp)], env)
    results = _collect([p], [log], timeout=300)
    assert_ok(results, f"torchrun trainer_sp_example.py --dp {dp}")
    out = results[0][1]
    assert f"{2 * dp} ranks as dp={dp} x sp=2, Trainer, 2 SGD steps" in out, out
    assert "OK: the Trainer with sequence parallelism equals one process" in out, out


def test_packed_sequences_need_use_cache_false_in_a_hand_written_loop():
    """With the model's default use_cache=True transformers builds no packed mask: sdpa attends
    across the documents, splitsoftmax refuses naming use_cache=False, and with use_cache=False
    both attend per document. The README's tour says so."""
    ref, ours = pair()
    ids, pos = ids_of(1, 16), packed_positions([5, 4, 7])
    per_doc = torch.cat([ref(ids[:, a:b]).logits for a, b in ((0, 5), (5, 9), (9, 16))], dim=1)
    torch.testing.assert_close(ref(ids, position_ids=pos, use_cache=False).logits, per_doc, **CLOSE)
    assert not torch.allclose(ref(ids, position_ids=pos).logits, per_doc, **CLOSE)  # the trap
    with pytest.raises(ValueError, match="use_cache=False"):
        ours(ids, position_ids=pos)
    torch.testing.assert_close(ours(ids, position_ids=pos, use_cache=False).logits, per_doc, **CLOSE)
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    tour = readme[readme.index("## Hugging Face transformers"):]
    assert re.search(r"packed[^\n]*\n?[^\n]*use_cache=False", tour, re.I), "README: packed needs use_cache=False"
    assert "splitsoftmax_sp" in tour and "loss_scale" in tour and "trainer_sp_example.py" in tour
