"""The transformers integration on 2-D meshes (sequence x heads) and under ``register(plan="auto")``:
a tiny Llama on 4 Gloo ranks as 2 x 2 (a tuple of groups, a 2-D DeviceMesh; heads+ring and
heads+allgather) against one process; the planner's choice built and run; refusals on a mesh."""
import copy
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist_util import assert_ok, spawn  # noqa: E402
from _hf_util import CLOSE, VOCAB, ids_of, pair  # noqa: E402

import splitsoftmax as ss  # noqa: E402
from splitsoftmax.integrations import transformers as sst  # noqa: E402
from splitsoftmax.planning.model import load_profile  # noqa: E402


def _sum(t):
    import torch.distributed as dist
    t = t.detach().clone()
    dist.all_reduce(t)
    return t


def _matches(mesh, ref, ours, ids, cu=None, what=""):
    """One step on the mesh: shard_inputs gives exactly ``ss.shard``'s pieces; logits are the mesh
    shard of the reference's; the ranks' losses and gradients sum to the one-process ones (float32:
    the tolerances of the 1-D sequence-parallel tests, one backward's summation error)."""
    extra = {} if cu is None else {"cu_seqlens": cu}
    ref.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    pos = None if cu is None else torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])]).view(1, -1)
    want = ref(ids, position_ids=pos, labels=ids, use_cache=False)
    want.loss.backward()
    inp = sst.shard_inputs(ids, labels=ids, **extra)
    shifted = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    full_pos = pos if pos is not None else torch.arange(ids.shape[1]).view(1, -1)
    for name, full in (("input_ids", ids), ("position_ids", full_pos.expand(ids.shape[0], -1)),
                       ("labels", shifted)):
        assert torch.equal(inp[name], ss.shard(full.contiguous(), 1, group=mesh, layout="zigzag", **extra)), \
            (what, name)
    assert inp.loss_scale == 4, what
    got = ours(**inp, use_cache=False)
    torch.testing.assert_close(got.logits, ss.shard(want.logits.detach(), 1, group=mesh, layout="zigzag", **extra),
                               **CLOSE, msg=lambda m: f"{what} logits: {m}")
    got.loss.backward()
    torch.testing.assert_close(_sum(got.loss.reshape(1))[0], want.loss.detach(), **CLOSE)
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        err, scale = (_sum(q.grad) - p.grad).abs().max().item(), max(1.0, p.grad.abs().max().item())
        assert err <= 5e-5 * scale, f"{what} {name}: {err:.3g} of {scale:.3g}"


def _sp_pair(**overrides):
    ref, ours = pair(**overrides)
    if hasattr(ours, "set_attn_implementation"):
        ours.set_attn_implementation("splitsoftmax_sp")
    else:  # transformers 4.53: the layers read the config on every call
        ours.config._attn_implementation = "splitsoftmax_sp"
    return ref, ours


def _mesh_cases():
    """A tuple (seq_group, heads_group) with heads+ring, a 2-D DeviceMesh with heads+allgather;
    plain rows and packed documents; refusals reach every rank of the mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    rank = dist.get_rank()
    groups = [dist.new_group(r) for r in ([0, 2], [1, 3], [0, 1], [2, 3])]
    mesh = (groups[rank % 2], groups[2 + rank // 2])  # sequence rank rank // 2, heads rank rank % 2
    ref, ours = _sp_pair()
    sst.register(mesh)
    assert sst._layers() == (mesh, "heads+ring")
    _matches(mesh, ref, ours, ids_of(2, 29), what="tuple heads+ring")
    _matches(mesh, ref, ours, ids_of(1, 31), cu=torch.tensor([0, 9, 10, 10, 24, 31]), what="tuple packed")
    dm = init_device_mesh("cpu", (2, 2))
    sst.register(dm, schedule="heads+allgather")
    _matches(dm, ref, ours, ids_of(1, 31), cu=torch.tensor([0, 3, 20, 31]), what="DeviceMesh heads+allgather")
    with pytest.raises(ValueError, match=r"leaves rank\(s\) \[1\] of 4 an empty zigzag shard"):
        sst.shard_inputs(ids_of(1, 3))  # zigzag over 2 gives 1 and 2 positions; the first splits as 1 + 0
    inp = sst.shard_inputs(ids_of(2, 12), labels=ids_of(2, 12))
    with pytest.raises(ValueError, match="zigzag shards"):  # positions not sharded: refused on every rank
        ours(input_ids=inp["input_ids"], position_ids=torch.arange(inp["input_ids"].shape[1]).unsqueeze(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[:, 11:] = 0  # right padding: in mesh rank 1's piece only (9..11: sequence shard 0's second half)
    reason = r"\(sequence-parallel\) does not take padding masks"
    with pytest.raises(ValueError, match=reason if rank == 1 else rf"rank\(s\) \[1\] rejected.*{reason}"):
        ours(input_ids=inp["input_ids"], position_ids=inp["position_ids"],
             attention_mask=ss.shard(mask, 1, group=dm, layout="zigzag"))
    out = ours(**inp)  # the mesh is still in step
    assert out.logits.shape == (2, 3, VOCAB) and torch.isfinite(out.loss)


def dear_alltoall_across_hosts() -> dict:
    """The shipped H100 profile with an all-to-all across hosts of 1 GB/s and 5 ms."""
    data = copy.deepcopy(load_profile("h100").data)
    data["links"]["inter"]["alltoall"] = dict(gbs=1.0, latency_us=5000, source="test: made dear")
    return data


def _plan_cases():
    """plan="auto" (LOCAL_WORLD_SIZE=2: two hosts of two) with a profile whose all-to-all across
    hosts is dear: a model of 4 heads of 32 and one sequence of 2048, where the planner's best zigzag
    candidate is a 2 x 2 mesh (the heads' all-to-all inside a host); it is built, run, and kept for
    the next batch. Profiles that differ across ranks are refused on every rank."""
    ref, ours = _sp_pair(num_key_value_heads=4, head_dim=32)
    rank = torch.distributed.get_rank()
    sst.register(plan="auto", profile="h200" if rank == 2 else dear_alltoall_across_hosts())
    with pytest.raises(ValueError, match=r"profile"):
        sst.shard_inputs(ids_of(1, 8), config=ours)
    sst.register(plan="auto", profile=dear_alltoall_across_hosts())
    with pytest.raises(ValueError, match="no plan yet"):
        ours(ids_of(1, 8))
    s = 2048
    plan = ss.plan_attention(4, seq_len=s, heads=4, kv_heads=4, head_dim=32, dtype=torch.float32, gpus_per_host=2,
                             profile=dear_alltoall_across_hosts())
    best = next(r.candidate for r in plan.candidates if r.candidate.layout == "zigzag" or r.candidate.schedule == "heads")
    assert (best.schedule, best.heads_degree) in (("heads+ring", 2), ("heads+allgather", 2)), plan.table()
    ids = ids_of(1, s)
    want = ref(ids, labels=ids)
    want.loss.backward()
    inp = sst.shard_inputs(ids, labels=ids, config=ours)
    chosen = sst.planned()
    assert (chosen["schedule"], chosen["mesh"], chosen["layout"]) == (best.schedule, (2, 2), "zigzag")
    mesh = sst._layers()[0]
    assert isinstance(mesh, tuple) and torch.equal(inp["input_ids"], ss.shard(ids, 1, group=mesh, layout="zigzag"))
    got = ours(**inp)
    got.loss.backward()
    torch.testing.assert_close(_sum(got.loss.reshape(1))[0], want.loss.detach(), **CLOSE)
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        err, scale = (_sum(q.grad) - p.grad).abs().max().item(), max(1.0, p.grad.abs().max().item())
        assert err <= 5e-5 * scale, f"plan {name}: {err:.3g} of {scale:.3g}"
    sst.shard_inputs(ids_of(1, 40))  # a later batch: the same mesh, no new plan
    assert sst._layers()[0] is mesh
    sst.register()


def case_mesh_and_plan(group):
    """Gloo worker, 4 ranks: every case above in one start (process groups are slow to start)."""
    torch.set_num_threads(1)
    _mesh_cases()
    _plan_cases()


@pytest.mark.distributed
def test_mesh_and_plan_gloo_match_one_process():
    assert_ok(spawn(4, "tests/test_transformers_mesh.py:case_mesh_and_plan", timeout=300,
                    env={"SPLITSOFTMAX_TIMEOUT": "60", "LOCAL_WORLD_SIZE": "2"}), "transformers 2x2 mesh and plan")


def test_register_refuses_bad_plan_and_schedules():
    with pytest.raises(ValueError, match=r"plan must be None or 'auto', got 'fast'"):
        sst.register(plan="fast")
    with pytest.raises(ValueError, match="plan must be None or 'auto'"):
        sst.register(plan=True)
    with pytest.raises(ValueError, match=r"plan='auto' chooses.*schedule='ring'"):
        sst.register(plan="auto", schedule="ring")
    with pytest.raises(ValueError, match=r"plan='auto' chooses.*2-D mesh"):
        sst.register((None, None), plan="auto")
    with pytest.raises(ValueError, match=r"schedule='heads\+ring': on a 1-d group"):
        sst.register(schedule="heads+ring")
    with pytest.raises(ValueError, match=r"schedule='ring': on a 2-D mesh.*'heads\+ring', 'heads\+allgather'"):
        sst.register((None, None), schedule="ring")
    with pytest.raises(ValueError, match=r"schedule='tree'"):
        sst.register(schedule="tree")
    with pytest.raises(ValueError, match=r"profile is the planner's: it goes with plan='auto'"):
        sst.register(profile="h100")
    with pytest.raises(ValueError, match=r"profile 'h300': no such file"):
        sst.register(plan="auto", profile="h300")
    sst.register()
    assert sst._layers() == (None, "ring") and sst.planned() is None  # a 1-d group: ring, as before
    sst.register(schedule="heads")
    assert sst._layers() == (None, "heads")
    sst.register()


def test_plan_reads_the_model_and_lays_the_rows_end_to_end():
    """What plan="auto" gives the planner: the model's heads, kv heads, head dim and dtype (from a
    model or its config), and the batch's rows as documents laid end to end."""
    ref, _ = pair(num_key_value_heads=1, head_dim=8)
    assert sst._model_shape(ref) == (4, 1, 8, torch.float32)
    assert sst._model_shape(ref.config)[:3] == (4, 1, 8)
    assert sst._model_shape(ref.to(torch.float64))[3] == torch.float64
    with pytest.raises(ValueError, match="pass config=model.config"):
        sst._model_shape(None)
    assert sst._planned_lengths(1, 9, None) == {"seq_len": 9}
    assert torch.equal(sst._planned_lengths(2, 9, None)["cu_seqlens"], torch.tensor([0, 9, 18]))
    assert torch.equal(sst._planned_lengths(2, 9, torch.tensor([0, 4, 9]))["cu_seqlens"],
                       torch.tensor([0, 4, 9, 13, 18]))
