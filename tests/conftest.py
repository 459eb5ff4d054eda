"""Shared test fixtures: NaN-poisoned allocations, lane markers, deterministic seeds."""
from __future__ import annotations

import functools

import pytest
import torch


def _poisoned(alloc):
    @functools.wraps(alloc)
    def wrapper(*args, **kwargs):
        t = alloc(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t
    return wrapper


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """Every ``torch.empty``/``empty_like`` the library makes is NaN-filled: an unwritten
    element of an output cannot pass a test."""
    monkeypatch.setattr(torch, "empty", _poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))


@pytest.fixture(autouse=True)
def verify_launches(request, monkeypatch):
    """GPU tests check every launch the kernels' launch caches make against Triton's own lookup."""
    if request.node.get_closest_marker("gpu"):
        from splitsoftmax.ops._triton import configs
        monkeypatch.setattr(configs, "LAUNCH_VERIFY", True)


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def pytest_addoption(parser):
    parser.addoption("--each-value", action="store_true",
                     help="of a parametrized test function only the cases that bring a parameter value it has "
                          "not run yet (every value of every parameter, not every combination)")


def pytest_configure(config):
    if config.getoption("--each-value"):
        config.pluginmanager.register(_EachValue(), "each-value")


def pytest_collection_modifyitems(config, items):
    """Tests without a lane marker belong to the cpu lane; gpu tests skip without CUDA."""
    lanes = {"cpu", "interpreter", "distributed", "mpi", "gpu"}
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if not lanes & {m.name for m in item.iter_markers()}:
            item.add_marker(pytest.mark.cpu)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


class _EachValue:
    """``--each-value``: of the tests left after ``-m`` and ``-k``, each test function keeps the cases
    that bring a parameter value it has not run yet, in collection order: every value of every
    parameter (every path, dtype, rank count) still runs, and every function."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        seen: dict = {}  # test function -> the (parameter, value) pairs of its kept cases
        kept, dropped = [], []
        for item in items:
            values = seen.setdefault(item.nodeid.split("[")[0], set())
            params = item.callspec.params.items() if hasattr(item, "callspec") else ()
            new = {(k, repr(v)) for k, v in params} - values
            values |= new
            (kept if new or not params else dropped).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
