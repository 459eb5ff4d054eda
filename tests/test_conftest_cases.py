"""The test suite's own ``--alternate-cases`` (tests/conftest.py): every test function runs, of a
parametrized one its first, third, ... case, counted after ``-m`` and ``-k``."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

CASES = '''
import pytest

@pytest.mark.parametrize("n", range(5))
def test_five(n):
    pass

@pytest.mark.parametrize("n", range(4))
def test_four(n):
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


def test_alternate_cases_keep_every_function(tmp_path):
    assert len(_collected(tmp_path)) == 10
    assert _collected(tmp_path, "--alternate-cases") == [
        "test_five[0]", "test_five[2]", "test_five[4]", "test_four[0]", "test_four[2]", "test_plain"]


def test_alternate_cases_count_after_k(tmp_path):
    """``-k`` leaves test_five's cases 1-4 and test_four's 3: the first of each left is kept."""
    got = _collected(tmp_path, "-k", "not five[0] and not four[0] and not four[1] and not four[2]",
                     "--alternate-cases")
    assert got == ["test_five[1]", "test_five[3]", "test_four[3]", "test_plain"], got
