"""The masked-NaN tests of tests/test_masked_nan.py on the Triton kernels (interpreter)."""
import pytest

from test_masked_nan import *  # noqa: F401,F403

pytestmark = pytest.mark.interpreter
