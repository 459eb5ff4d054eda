"""K/V in two hops under the heads schedule: where a heads group spans machines and each kv head's
readers share one, each rank's shard of a kv head goes to one of its readers and the readers pass the
shards on among themselves (their dK/dV summed among them, then sent home once, in the inputs'
dtype). The results are bit for bit those of one hop; fewer bytes cross machines.

Machines are the loopback world's ``hosts``.
"""
from __future__ import annotations

import pytest
import torch

from splitsoftmax import sharded_attention
from splitsoftmax.distributed import LoopbackWorld
from splitsoftmax.ops.attention.schedules import heads
from splitsoftmax.ops.attention.schedules.heads import TAG_GRAD, TAG_QKV, TAG_RELAY, head_split, relay_groups
from test_heads_cases import _inputs, case_random_mixes, case_shapes, case_variants, sinks_of
from test_mesh_cases import case_shapes as mesh_case_shapes


def test_relay_groups():
    """Two hops only where every rank reads at most one kv head, some kv head has several readers,
    each kv head's readers share a machine and the group spans several."""
    assert relay_groups(head_split(4, 2, 4), 2, (0, 0, 1, 1)) == ((0, 1), (2, 3))
    assert relay_groups(head_split(2, 1, 4), 1, (0, 0, 1, 1)) == ((0, 1),)  # ranks 2, 3 read none
    assert relay_groups(head_split(8, 2, 8), 2, (7,) * 4 + (9,) * 4) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert relay_groups(head_split(4, 2, 4), 2, (0, 0, 0, 0)) is None  # one machine
    assert relay_groups(head_split(4, 2, 4), 2, (0, 1, 0, 1)) is None  # a kv head's readers on two
    assert relay_groups(head_split(4, 4, 4), 4, (0, 0, 1, 1)) is None  # one reader each
    assert relay_groups(head_split(6, 2, 4), 2, (0, 0, 1, 1)) is None  # a rank reads two kv heads


def _case(group):
    for case in (case_shapes, case_variants, case_random_mixes):
        case(group)


@pytest.mark.parametrize("hosts", [(0, 0, 1, 1), (3, 3, 3, 5, 5), (1, 1, 2, 2, 3, 3)], ids=str)
def test_relay_against_the_oracle(hosts):
    """Every head split, layout, keyword mix and random mix of the heads cases, on ranks spread over
    machines: against the float64 oracle (the splits whose kv heads' readers share a machine take
    two hops)."""
    world = LoopbackWorld(len(hosts), hosts)
    world.run(_case)
    assert world.sends[TAG_RELAY] > 0


def test_mesh_relay_against_the_oracle():
    """A 2 x 4 mesh whose heads groups each span two machines."""
    world = LoopbackWorld(8, (0, 0, 1, 1, 2, 2, 3, 3))
    world.run(lambda c: mesh_case_shapes(c.mesh(2, 4)))
    assert world.sends[TAG_RELAY] > 0


@pytest.mark.parametrize("h, hkv, hosts, lens", [(4, 2, (0, 0, 1, 1), [3, 5, 0, 4]),
                                                   (8, 2, (0,) * 4 + (1,) * 4, [2, 3, 1, 0, 4, 2, 2, 3]),
                                                   (2, 1, (0, 0, 1, 1), [4, 1, 3, 2])], ids=str)
def test_relay_bit_for_bit(h, hkv, hosts, lens, monkeypatch):
    """bfloat16 with sinks, causal: out, lse, dq, dk, dv and the sinks' gradient equal one hop's (the
    same machines, the relay turned off) bit for bit; K/V and dK/dV cross machines once per kv head's
    shard (dK/dV in bfloat16, not float32), so fewer bytes cross on the K/V and gradient tags, and
    the readers' passes stay inside machines."""
    p = len(hosts)
    q, k, v, dout, _ = _inputs(9, sum(lens), h, hkv, torch.bfloat16)
    sinks = sinks_of(h).float()

    def run(c):
        mine = [t.split(lens, 2)[c.rank].clone().requires_grad_() for t in (q, k, v)]
        sk = sinks.clone().requires_grad_()
        out, lse = sharded_attention(*mine, causal=True, group=c, schedule="heads", sinks=sk, return_lse=True)
        out.backward(dout.split(lens, 2)[c.rank])
        return [out, lse, *(t.grad for t in mine), sk.grad]

    assert relay_groups(head_split(h, hkv, p), hkv, hosts) is not None
    two = LoopbackWorld(p, hosts)
    got = two.run(run)
    monkeypatch.setattr(heads, "relay_groups", lambda *a: None)
    one = LoopbackWorld(p, hosts)
    want = one.run(run)
    for r in range(p):
        for a, b in zip(got[r], want[r]):
            assert torch.equal(a, b), r
    assert not one.sends.get(TAG_RELAY) and two.across[TAG_RELAY] == 0 < two.bytes[TAG_RELAY]
    for t in (TAG_QKV, TAG_GRAD):
        assert two.across[t] < one.across[t], (t, two.across[t], one.across[t])


def case_two_machines(group):
    """The heads cases over real process groups (Gloo, NCCL) whose ranks count as machines of two
    ranks each (``SPLITSOFTMAX_HOST``), the two-hop path counted."""
    import os

    import torch.distributed as dist
    os.environ["SPLITSOFTMAX_HOST"] = f"machine {dist.get_rank() // 2}"
    calls = []
    relay_kv = heads._relay_kv
    heads._relay_kv = lambda *a: calls.append(1) or relay_kv(*a)
    try:
        for case in (case_shapes, case_variants):
            case(group)
    finally:
        heads._relay_kv = relay_kv
    assert calls


@pytest.mark.distributed
def test_gloo_relay():
    from _dist_util import assert_ok, spawn
    assert_ok(spawn(4, "tests/test_heads_relay.py:case_two_machines", timeout=240, env={"SPLITSOFTMAX_TIMEOUT": "60"}),
              "gloo world of 4 on two machines")
