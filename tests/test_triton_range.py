"""The triton range pyproject.toml declares is the one `make test` runs the interpreter lane on.

`make test-interpreter-oldest` installs Makefile's ``TRITON_OLDEST`` beside the venv and sets
``SPLITSOFTMAX_TEST_TRITON`` to it, so that lane can check it really imported that triton (a
PYTHONPATH that missed would run the venv's triton twice and prove nothing about the oldest).
"""
from __future__ import annotations

import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def declared_range() -> tuple[str, str]:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"triton>=([0-9.]+),<([0-9.]+)', text)
    assert m, "pyproject.toml declares no triton range"
    return m.group(1), m.group(2)


def test_makefile_tests_the_lowest_declared_triton():
    low, high = declared_range()
    m = re.search(r"^TRITON_OLDEST\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert m, "Makefile sets no TRITON_OLDEST"
    assert tuple(map(int, m.group(1).split("."))) == tuple(map(int, (low + ".0.0").split(".")[:3])), \
        f"Makefile tests triton {m.group(1)}, pyproject.toml declares >={low},<{high}"


@pytest.mark.interpreter
def test_the_lane_runs_the_triton_it_names():
    want = os.environ.get("SPLITSOFTMAX_TEST_TRITON")
    if not want:
        pytest.skip("SPLITSOFTMAX_TEST_TRITON unset: the lane runs the venv's triton")
    import triton
    assert triton.__version__ == want, f"imported triton {triton.__version__} from {triton.__file__}"


@pytest.mark.interpreter
def test_the_venv_triton_is_in_the_declared_range():
    if os.environ.get("SPLITSOFTMAX_TEST_TRITON"):
        pytest.skip("this lane runs a triton named by SPLITSOFTMAX_TEST_TRITON")
    import triton
    low, high = declared_range()
    version = tuple(int(p) for p in re.findall(r"\d+", triton.__version__)[:2])
    assert tuple(map(int, low.split(".")[:2])) <= version < tuple(map(int, high.split(".")[:2])), \
        f"triton {triton.__version__} outside >={low},<{high}"
