"""The import contract of the package's folders (the layers of README.md's "Layout"), walked with ``ast``.

Every ``import`` / ``from .. import`` of every module counts, at module level and inside functions
alike (a late import is still a dependency). Each module belongs to one layer (:data:`LAYERS`, first
match wins); :data:`MAY_IMPORT` says which layers a layer may import; no module may take part in an
import circle.
"""
from __future__ import annotations

import ast
import fnmatch
import math
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "splitsoftmax"

# the host files of a family: what users call (api), its custom ops and autograd (op), the sharded
# functions and their schedules; every other module of a family folder is one of its kernel files
# (Triton kernels and launchers, the torch twin, the device math)
HOST_FILES = ("api", "op", "sharded", "schedules", "schedules.*", "context", "flow")
ALGEBRA_FAMILIES = ("merge", "softmax")

# (layer, module patterns): the first layer with a matching pattern is the module's
LAYERS = (
    ("root", ("splitsoftmax",)),
    ("tools", ("splitsoftmax.__main__", "splitsoftmax.tools", "splitsoftmax.tools.*")),
    ("core", ("splitsoftmax.core", "splitsoftmax.core.*")),
    ("planning", ("splitsoftmax.planning", "splitsoftmax.planning.*")),
    ("layout", ("splitsoftmax.distributed.layout",)),
    ("distributed", ("splitsoftmax.distributed", "splitsoftmax.distributed.*")),
    ("settings", ("splitsoftmax.ops._triton.configs",)),
    ("triton", ("splitsoftmax.ops._triton", "splitsoftmax.ops._triton.*")),
    ("registry", ("splitsoftmax.ops", "splitsoftmax.ops._registry")),
    ("host", tuple(f"splitsoftmax.ops.*.{name}" for name in HOST_FILES)),
    ("kernel", ("splitsoftmax.ops.*",)),
    ("integrations", ("splitsoftmax.integrations", "splitsoftmax.integrations.*")),
)

# layer -> the layers it may import (planning: the cost model and planner behind ``plan_attention``,
# pure host arithmetic on profiles and lengths; the root exports it, tools' commands drive it and
# the transformers integration's plan="auto" loads its profiles; it imports nothing else of the package
# but the layout, so that planning a run never loads a kernel. layout: distributed/layout.py, how a
# sequence maps to ranks, pure functions on the standard library alone; the planner prices the
# balanced layout with that module's placement (``balanced_owners``), so the placement has one home,
# and the module imports nothing of the package, so it loads no kernel either. Importing it runs
# distributed/__init__.py, whose modules may import only distributed and core:
# ``test_planning_loads_no_kernel`` checks the import at run time) ("own family": any module of the
# importer's family folder, "own family kernels": its kernel files, "algebra families": any module of
# merge/ and softmax/). The settings (configs.py: tile sizes and algorithm sizes as data) are read by
# host and kernel files alike.
MAY_IMPORT = {
    "root": {"core", "layout", "distributed", "registry", "host", "kernel", "integrations", "planning"},
    "tools": {"root", "tools", "core", "planning", "layout", "distributed", "settings", "triton", "registry", "host",
              "kernel", "integrations"},
    "core": {"core"},
    "planning": {"planning", "layout"},
    "layout": set(),
    "distributed": {"distributed", "layout", "core"},
    "settings": {"core"},
    "triton": {"settings", "triton", "core"},
    "registry": {"registry", "core"},
    "host": {"own family", "algebra families", "registry", "distributed", "layout", "settings", "core"},
    "kernel": {"own family kernels", "algebra families", "settings", "triton", "core"},
    "integrations": {"integrations", "root", "host", "distributed", "layout", "core", "planning"},
}

# (importer, imported) -> why it is still there; each entry must still be a violation
ALLOWED: dict = {}
# modules of a circle (frozenset) -> why it is still there
ALLOWED_CIRCLES: dict = {}


def layer(module: str) -> str:
    for name, patterns in LAYERS:
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return name
    raise AssertionError(f"module {module} belongs to no layer of LAYERS")


def family(module: str):
    """The family folder of a module of ``splitsoftmax.ops.<family>``, else None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "ops" and not parts[2].startswith("_") else None


def allowed(src: str, dst: str) -> bool:
    """Whether module ``src`` may import module ``dst`` under :data:`MAY_IMPORT`."""
    rules, kind = MAY_IMPORT[layer(src)], layer(dst)
    if kind in rules:
        return True
    same = family(src) is not None and family(src) == family(dst)
    if same and ("own family" in rules or ("own family kernels" in rules and kind == "kernel")):
        return True
    return "algebra families" in rules and family(dst) in ALGEBRA_FAMILIES and kind in ("host", "kernel")


def modules(root: pathlib.Path = ROOT) -> dict:
    """Module name -> (path, is a package) of every module of the package."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _targets(module: str, is_pkg: bool, node, known) -> list:
    """The package's modules an import node names (a name imported from a package that is a module
    of it counts as that module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    if node.level:
        base = base[:len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]


def import_graph(root: pathlib.Path = ROOT) -> dict:
    """Module -> {imported module of the package: first line importing it}, late imports included."""
    known = modules(root)
    graph = {}
    for module, (path, is_pkg) in known.items():
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for t in _targets(module, is_pkg, node, known):
                    if t != module and (t == PACKAGE or t.startswith(PACKAGE + ".")):
                        assert t in known, f"{module}:{node.lineno} imports {t}, which is no module of the package"
                        edges.setdefault(t, node.lineno)
    return graph


def violations(graph: dict) -> dict:
    """(importer, imported) -> line, for each import :data:`MAY_IMPORT` does not allow."""
    return {(src, dst): line for src, edges in graph.items() for dst, line in edges.items() if not allowed(src, dst)}


def circles(graph: dict) -> list:
    """The import circles: strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _report(found: dict) -> str:
    return "\n".join(f"  {s} ({layer(s)}) imports {d} ({layer(d)}) at line {line}"
                     for (s, d), line in sorted(found.items()))


def test_every_import_follows_the_layers():
    found = violations(import_graph())
    new = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not new, "imports against the layers:\n" + _report(new)


def test_no_import_circle():
    new = [sorted(c) for c in circles(import_graph()) if c not in ALLOWED_CIRCLES]
    assert not new, "import circles:\n" + "\n".join(f"  {' <-> '.join(c)}" for c in new)


def test_allow_lists_hold_only_what_is_still_there():
    found, found_circles = violations(import_graph()), set(circles(import_graph()))
    stale = [k for k in ALLOWED if k not in found] + [sorted(c) for c in ALLOWED_CIRCLES if c not in found_circles]
    assert not stale, f"allowed but gone (take them off the list): {stale}"


def test_every_module_has_a_layer():
    for module in modules():
        assert layer(module) in MAY_IMPORT, module


FAKE = {
    "splitsoftmax.core.state": {"splitsoftmax.ops._registry": 3},  # core reaching up
    "splitsoftmax.ops._registry": {"splitsoftmax.core.state": 1},
    "splitsoftmax.ops.attention.fwd": {"splitsoftmax.ops._triton.configs": 1, "splitsoftmax.ops.merge.kernel": 2,
                                       "splitsoftmax.ops.attention.api": 3},  # kernel -> host
    "splitsoftmax.ops.attention.api": {"splitsoftmax.ops.vocab.api": 5, "splitsoftmax.ops.softmax.api": 6,
                                       "splitsoftmax.distributed.comm": 7, "splitsoftmax.ops.attention.fwd": 8},
    "splitsoftmax.ops.vocab.api": {"splitsoftmax.tools.cli": 9},
    "splitsoftmax.distributed.comm": {"splitsoftmax.core.state": 1, "splitsoftmax.ops.attention.fwd": 4},
    "splitsoftmax.tools.cli": {"splitsoftmax.ops.vocab.api": 1},
    "splitsoftmax.integrations.transformers": {"splitsoftmax.ops.attention.fwd": 2},
    "splitsoftmax.planning.work": {"splitsoftmax.distributed.layout": 1, "splitsoftmax.distributed.plan": 2,
                                   "splitsoftmax.distributed": 3},  # the layout alone of distributed
    "splitsoftmax.distributed.layout": {"splitsoftmax.core.state": 1},  # the layout imports nothing of the package
}


def test_the_check_finds_a_violating_graph():
    """The checks themselves: a made-up graph with one break of each kind is caught, and nothing else."""
    assert set(violations(FAKE)) == {
        ("splitsoftmax.core.state", "splitsoftmax.ops._registry"),
        ("splitsoftmax.ops.attention.fwd", "splitsoftmax.ops.attention.api"),
        ("splitsoftmax.ops.attention.api", "splitsoftmax.ops.vocab.api"),
        ("splitsoftmax.ops.vocab.api", "splitsoftmax.tools.cli"),
        ("splitsoftmax.distributed.comm", "splitsoftmax.ops.attention.fwd"),
        ("splitsoftmax.integrations.transformers", "splitsoftmax.ops.attention.fwd"),
        ("splitsoftmax.planning.work", "splitsoftmax.distributed.plan"),
        ("splitsoftmax.planning.work", "splitsoftmax.distributed"),
        ("splitsoftmax.distributed.layout", "splitsoftmax.core.state"),
    }
    assert set(circles(FAKE)) == {
        frozenset({"splitsoftmax.core.state", "splitsoftmax.ops._registry"}),
        frozenset({"splitsoftmax.ops.attention.fwd", "splitsoftmax.ops.attention.api",
                   "splitsoftmax.distributed.comm"}),
        frozenset({"splitsoftmax.ops.vocab.api", "splitsoftmax.tools.cli"}),
    }


@pytest.mark.parametrize("source, late", [("from ..ops import _registry\n", False),
                                          ("def f():\n    from ..ops._registry import op\n", True)])
def test_the_walk_sees_module_and_late_imports(tmp_path, source, late):
    pkg = tmp_path / PACKAGE
    for sub in ("core", "ops"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "ops" / "_registry.py").write_text("")
    (pkg / "core" / "state.py").write_text(source)
    graph = import_graph(tmp_path)
    assert graph["splitsoftmax.core.state"] == {"splitsoftmax.ops._registry": 2 if late else 1}
    assert set(violations(graph)) == {("splitsoftmax.core.state", "splitsoftmax.ops._registry")}


# imports the planner with the root package's __init__ left out (the root exports the ops, so it
# loads kernels by design), plans a balanced layout, and prints the package's modules then loaded
PLANNING_ALONE = """
import sys, types
root = types.ModuleType("splitsoftmax")
root.__path__ = [sys.argv[1]]
sys.modules["splitsoftmax"] = root
from splitsoftmax.planning import work
from splitsoftmax.planning.model import Tiles
work.split("balanced", 4, (1500, 300, 200, 1200, 250, 180), True, Tiles(128))
print(" ".join(sorted(m for m in sys.modules if m.startswith("splitsoftmax."))))
"""


def test_planning_loads_no_kernel():
    """Run, not read: importing the planner and pricing a balanced layout (which takes its placement
    from ``distributed.layout``, running ``distributed/__init__.py``) loads no module of ``ops``, only
    planning and the distributed package, whose own imports the layers keep to distributed and core."""
    out = subprocess.run([sys.executable, "-c", PLANNING_ALONE, str(ROOT / PACKAGE)], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout.split()
    assert "splitsoftmax.distributed.layout" in out and "splitsoftmax.planning.work" in out, out
    assert not [m for m in out if m.startswith("splitsoftmax.ops")], out
    assert {layer(m) for m in out} <= {"planning", "layout", "distributed", "core"}, out


# the one module that defines log2(e) for kernels and host code alike
ALGEBRA_HOME = "splitsoftmax/ops/_triton/algebra.py"


def _name(node) -> str:
    """The last part of a name or attribute (``math.e`` -> ``e``), else ``""``."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def log2e_definitions(source: str) -> list:
    """Line numbers where the code of ``source`` writes ``log2(e)`` itself: a float within 1e-9 of
    it (any spelling, ``log2(e) / 2`` too), ``math.log2(math.e)``, ``1 / math.log(2)``, or a name
    holding ``LOG2E`` assigned."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, float) and any(
                abs(node.value - k * math.log2(math.e)) < 1e-9 for k in (1, 0.5)):
            found.add(node.lineno)
        elif isinstance(node, ast.Call) and _name(node.func) == "log2" and [_name(a) for a in node.args] == ["e"]:
            found.add(node.lineno)
        elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Call)
              and _name(node.right.func) == "log" and [ast.unparse(a) for a in node.right.args] == ["2"]):
            found.add(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and "LOG2E" in t.id.upper() for t in targets):
                found.add(node.lineno)
    return sorted(found)


def test_log2e_has_one_home():
    """``log2(e)`` is written only in :data:`ALGEBRA_HOME`; kernels and host code import it."""
    found = {str(path.relative_to(ROOT)): lines for path in sorted((ROOT / PACKAGE).rglob("*.py"))
             if (lines := log2e_definitions(path.read_text())) and path.relative_to(ROOT).as_posix() != ALGEBRA_HOME}
    assert not found, f"log2(e) written outside {ALGEBRA_HOME} (import LOG2E from there): {found}"
    assert log2e_definitions((ROOT / ALGEBRA_HOME).read_text()), "the home of LOG2E defines it no more"


@pytest.mark.parametrize("source, lines", [
    ("x = y * 1.4426950408889634\n", [1]),
    ("\nLOG2E = tl.constexpr(1.442695040888963)\n", [2]),
    ("_LOG2E: float = 1.44269504089\n", [1]),
    ("k = v * (1.0 + 0.7213475204444817 * v)\n", [1]),
    ("import math\nc = math.log2(math.e)\n", [2]),
    ("import math\nc = 1 / math.log(2)\n", [2]),
    ("def f(t):\n    \"\"\"c = log2(e) / T, the factor\"\"\"\n    return t  # log2(e) in words\n", []),
    ("from ..ops._triton.algebra import LOG2E\nqk = scale * LOG2E.value\nln2 = 0.6931471805599453\n", []),
])
def test_the_log2e_check_finds_each_spelling(source, lines):
    assert log2e_definitions(source) == lines
