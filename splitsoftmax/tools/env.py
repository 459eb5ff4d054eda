"""``python -m splitsoftmax env``: versions, devices, backends, launchers, settings, and whether Triton kernels run."""
from __future__ import annotations

import os
import platform
import shutil
import sys

import torch

from ..core.runtime import interpreting, triton_available


def _version(module: str) -> str:
    try:
        return getattr(__import__(module), "__version__", "installed")
    except ImportError:
        return "not installed"


def _mpi() -> str:
    try:
        from mpi4py import MPI
    except ImportError:
        return "mpi4py not installed"
    return f"mpi4py {_version('mpi4py')}, {MPI.Get_library_version().splitlines()[0].strip()}"


def _launchers() -> str:
    """Where ``mpirun`` and ``torchrun`` are: beside this interpreter (a venv's bin/) or on PATH."""
    here = os.path.dirname(sys.executable)
    found = []
    for name in ("mpirun", "torchrun"):
        local = os.path.join(here, name)
        path = local if os.access(local, os.X_OK) else shutil.which(name)
        found.append(f"{name} {path}" if path else f"{name} not found")
    return "; ".join(found)


def _settings() -> str:
    """The environment variables splitsoftmax reads, with the value in force."""
    from ..distributed.comm import timeout_s
    try:
        timeout = f"{timeout_s():g} s"
    except ValueError as e:
        timeout = f"invalid ({e})"
    source = "" if os.environ.get("SPLITSOFTMAX_TIMEOUT") else " (default)"
    log = os.environ.get("SPLITSOFTMAX_LOG", "") or "unset (warnings only)"
    host = os.environ.get("SPLITSOFTMAX_HOST", "") or "unset (the host name)"
    return f"SPLITSOFTMAX_TIMEOUT {timeout}{source}; SPLITSOFTMAX_LOG {log}; SPLITSOFTMAX_HOST {host}"


def _devices() -> list[str]:
    if not torch.cuda.is_available():
        return ["no CUDA device"]
    return [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]


def _backends() -> str:
    """The torch.distributed backends usable here; each other one with why not (NCCL needs a GPU)."""
    dist = torch.distributed
    if not dist.is_available():
        return "unavailable (torch built without torch.distributed)"
    parts = []
    for name, built in (("NCCL", dist.is_nccl_available()), ("Gloo", dist.is_gloo_available()),
                        ("MPI (torch)", dist.is_mpi_available())):
        if not built:
            parts.append(f"{name} unavailable (torch built without it)")
        elif name == "NCCL" and not torch.cuda.is_available():
            parts.append(f"{name} unavailable (no CUDA device)")
        else:
            parts.append(name)
    return "; ".join(sorted(parts, key=lambda p: "unavailable" in p))


def report() -> str:
    cuda = torch.cuda.is_available()
    kernels = ("yes (CUDA)" if cuda and triton_available() else
               "yes (interpreter, TRITON_INTERPRET=1)" if interpreting() and triton_available() else
               "no: CPU tensors use the torch path" + ("" if triton_available() else " (Triton not installed)"))
    rows = [
        ("splitsoftmax", _version("splitsoftmax")),
        ("python", platform.python_version()),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda})"),
        ("triton", _version("triton")),
        ("numpy", _version("numpy")),
        ("transformers", _version("transformers")),
        ("devices", "; ".join(_devices())),
        ("torch.distributed", _backends()),
        ("MPI", _mpi()),
        ("launchers", _launchers()),
        ("settings", _settings()),
        ("Triton kernels run", kernels),
    ]
    return "\n".join(f"{k:<20} {v}" for k, v in rows)
