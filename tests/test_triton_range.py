"""The torch and triton ranges pyproject.toml declares are the ones `make test` runs.

The Makefile names the oldest and newest torch, the triton each declared torch pins, and sets
``SPLITSOFTMAX_TEST_TORCH`` / ``SPLITSOFTMAX_TEST_TRITON`` in the lanes that run another than the
venv's, so that each lane can check it really imported them (a PYTHONPATH that missed would run
the venv's triton twice and prove nothing about the others).
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


def declared_torch() -> tuple[tuple, tuple]:
    m = re.search(r'"torch>=([0-9.]+),<([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert m, "pyproject.toml declares no torch range"
    return tuple(map(int, m.group(1).split("."))), tuple(map(int, m.group(2).split(".")))


def makefile(name: str) -> list[str]:
    m = re.search(rf"^{name}\s*:=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, f"Makefile sets no {name}"
    return m.group(1).split()


def test_makefile_tests_the_oldest_and_newest_declared_torch():
    (low, high) = declared_torch()
    oldest, newest = (tuple(map(int, makefile(n)[0].split(".")))[:2] for n in ("TORCH_OLDEST", "TORCH_NEWEST"))
    assert oldest == low[:2], f"Makefile's oldest torch {oldest}, pyproject.toml declares >={low}"
    assert newest == (high[0], high[1] - 1), f"Makefile's newest torch {newest}, pyproject.toml declares <{high}"


def test_makefile_runs_every_pinned_triton():
    """One pin per torch minor that pins its own (oldest first), each within the declared range."""
    pins = makefile("TRITON_PINS")
    assert pins[0] == makefile("TRITON_OLDEST")[0] and pins[1:-1] == makefile("TRITON_BETWEEN"), pins
    low, high = declared_range()
    as_minor = [tuple(map(int, p.split(".")[:2])) for p in pins]
    assert as_minor == sorted(set(as_minor)), pins
    assert tuple(map(int, low.split("."))) <= as_minor[0] and as_minor[-1] < tuple(map(int, high.split("."))), \
        f"pins {pins} outside >={low},<{high}"


def test_the_lane_runs_the_torch_it_names():
    want = os.environ.get("SPLITSOFTMAX_TEST_TORCH")
    if not want:
        pytest.skip("SPLITSOFTMAX_TEST_TORCH unset: the lane runs the venv's torch")
    import torch
    assert torch.__version__.split("+")[0] == want, f"imported torch {torch.__version__} from {torch.__file__}"


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
