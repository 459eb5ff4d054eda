"""The settings chosen by the Triton version (ops/_triton/configs.py) read it from the Triton in use,
and the configuration imports where no Triton does (the torch path's platforms)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _configs(block_triton: bool) -> str:
    """``(TRITON_VERSION, ATTN_FWD_GLUON_OWN_SCALARS)`` as a fresh interpreter imports them."""
    code = ("import sys\n" + ("sys.modules['triton'] = None\n" if block_triton else "") +
            "from splitsoftmax.ops._triton import configs\n"
            "print(configs.TRITON_VERSION, configs.ATTN_FWD_GLUON_OWN_SCALARS)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_version_of_the_triton_in_use():
    triton = pytest.importorskip("triton")
    major, minor = (int(n) for n in triton.__version__.split(".")[:2])
    assert _configs(False) == f"({major}, {minor}) {(major, minor) in ((3, 7), (3, 8))}"


def test_no_triton():
    assert _configs(True) == "(0, 0) False"
