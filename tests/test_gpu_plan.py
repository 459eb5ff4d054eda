"""GPU lane: the shipped planning profile of this GPU (h100 / h200) against ``ss.attention`` measured
here by ``calibrate``'s kernel tables (both profiles' rates were measured once: this checks that they
still hold for the kernels of this tree), and a measured profile the planner reads."""
from __future__ import annotations

import pytest
import torch

import splitsoftmax as ss
from splitsoftmax.planning import load_profile
from splitsoftmax.planning.model import interp_rate
from splitsoftmax.tools import calibrate

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _shipped():
    name = torch.cuda.get_device_name()
    for kind in ("H100", "H200"):
        if kind in name:
            return load_profile(kind.lower())
    pytest.skip(f"no shipped profile for {name}")


def test_shipped_profile_matches_the_kernel_measured_here():
    """Full and causal, forward and forward+backward, at 4k and 16k: within 15% of the profile."""
    prof = _shipped()
    sizes = dict(calibrate.GPU_SIZES, lengths=(4096, 16384), reps=5)
    measured = calibrate.kernel_tables(torch.device("cuda"), sizes)
    for pas in ("fwd", "fwd_bwd"):
        for mask in ("full", "causal"):
            for s, rate in measured[pas][mask]:
                want = float(interp_rate(prof.data["kernel"][pas][mask], s))
                assert abs(rate / want - 1) < 0.15, (prof.name, pas, mask, s, rate, want)


def test_a_measured_profile_plans():
    sizes = dict(calibrate.GPU_SIZES, lengths=(2048, 8192), reps=3)
    measured = calibrate.measure(0, 1, torch.device("cuda"), sizes)
    prof = calibrate.profile_from(measured, "h100", torch.device("cuda"), 1)
    assert prof["kernel"]["source"].startswith("measured") and prof["sms"] == torch.cuda.get_device_properties(0).multi_processor_count
    plan = ss.plan_attention(64, seq_len=1 << 20, heads=32, kv_heads=8, head_dim=128, profile=prof)
    assert plan.best.efficiency > 0.5
