"""The test suite's own ``--each-value`` (tests/conftest.py): every test function runs, and of a
parametrized one the cases that bring a parameter value not run yet, counted after ``-m`` and ``-k``."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.once

CASES = '''
import pytest

@pytest.mark.parametrize("a", ["x", "y", "z"])
@pytest.mark.parametrize("b", [0, 1])
def test_grid(a, b):
    pass

@pytest.mark.parametrize("n", range(3))
def test_line(n):
    pass

def test_plain():
    pass
'''


def _collected(tmp_path: Path, *args: str) -> list:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(CASES)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                          "test_cases.py", *args], cwd=tmp_path, capture_output=True, text=True, check=True)
    return [line.split("::")[1] for line in out.stdout.splitlines() if "::" in line]


def test_each_value_keeps_every_value_not_every_combination(tmp_path):
    assert len(_collected(tmp_path)) == 10
    # test_grid's six cases: 0-x 0-y 0-z 1-x 1-y 1-z; 1-x is the first with b=1, 1-y and 1-z bring nothing
    assert _collected(tmp_path, "--each-value") == [
        "test_grid[0-x]", "test_grid[0-y]", "test_grid[0-z]", "test_grid[1-x]",
        "test_line[0]", "test_line[1]", "test_line[2]", "test_plain"]


def test_each_value_counts_after_k(tmp_path):
    """``-k`` leaves test_grid's b=1 cases only: the first of them brings both values, the next two
    a new ``a`` each, so all three run."""
    got = _collected(tmp_path, "-k", "1-x or 1-y or 1-z or line or plain", "--each-value")
    assert got == ["test_grid[1-x]", "test_grid[1-y]", "test_grid[1-z]", "test_line[0]", "test_line[1]",
                   "test_line[2]", "test_plain"], got
