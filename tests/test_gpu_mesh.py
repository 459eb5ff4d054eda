"""2-D meshes on CUDA: the loopback mesh cases on one GPU (CUDA tensors, Triton kernels inside the
ring over the sequence group), and on NCCL with one rank per GPU (a 2 x 2 DeviceMesh and a tuple of
groups, the handshake over the default group)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from _dist_util import ROOT, assert_ok, spawn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_loopback_mesh_on_cuda():
    """tests/test_mesh_cases.py and tests/test_mesh_overlap.py (the heads exchanges overlapping the
    ring, q arriving in head chunks into the Triton kernels) with their tensors on the GPU
    (SPLITSOFTMAX_TEST_DEVICE=cuda)."""
    env = {**os.environ, "SPLITSOFTMAX_TEST_DEVICE": "cuda"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_mesh_cases.py",
                          "tests/test_mesh_overlap.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


def test_nccl_mesh():
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs")
    assert_ok(spawn(4, "tests/test_mesh_gloo.py:case_gloo", timeout=300, env={"SPLITSOFTMAX_TIMEOUT": "60"},
                    backend="nccl"), "nccl world of 4")
