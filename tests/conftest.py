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
        from splitsoftmax.kernels import configs
        monkeypatch.setattr(configs, "LAUNCH_VERIFY", True)


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def pytest_addoption(parser):
    parser.addoption("--alternate-cases", action="store_true",
                     help="every test function, but of a parametrized one only its first, third, ... case")


def pytest_configure(config):
    if config.getoption("--alternate-cases"):
        config.pluginmanager.register(_AlternateCases(), "alternate-cases")


def pytest_collection_modifyitems(config, items):
    """Tests without a lane marker belong to the cpu lane; gpu tests skip without CUDA."""
    lanes = {"cpu", "interpreter", "distributed", "mpi", "gpu"}
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if not lanes & {m.name for m in item.iter_markers()}:
            item.add_marker(pytest.mark.cpu)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


class _AlternateCases:
    """``--alternate-cases``: of the tests left after ``-m`` and ``-k``, every other case of each test
    function is deselected (its first kept, so every function still runs)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        seen: dict = {}
        kept, dropped = [], []
        for item in items:
            fn = item.nodeid.split("[")[0]
            seen[fn] = seen.get(fn, -1) + 1
            (dropped if seen[fn] % 2 else kept).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
