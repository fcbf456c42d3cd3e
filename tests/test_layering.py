"""The package's layering, read from the sources: every import counts, at module level, inside
a function, or under ``TYPE_CHECKING`` (an import hidden in a function to dodge a circle is a
circle). The layers, lowest first, and what each may import besides itself:

    shardlib  seqshard.shardlib.*: the notation core                        -
    core      mesh, batch, hardware, launch, testing                        shardlib
    model     seqshard.model.* (with its cost model and pipelining)          shardlib, core
    data      seqshard.data.*                                               shardlib, core
    evals     seqshard.evals.* (downstream tasks and their scoring)         shardlib, core, model, data
    hf        seqshard.hf.* (Hugging Face tables, import, export)           shardlib, core, model, data
    config    seqshard.config (the run's YAML)                              shardlib, core, model, evals
    train     seqshard.train.*                                              shardlib, core, model, data, evals, config
    sample    seqshard.sample (text in, text out)                           shardlib, core, model, data
    harness   seqshard.harness (the lm-evaluation-harness model)             all of the above but hf
    plan      seqshard.plan.* (step_comms, planner, show)                   all of the above
    cli       seqshard.cli                                                  everything

(model and data are independent of each other, and so are train and hf, and config and hf:
the CLI wires a run to an import or an export, and a config to the Hugging Face directory
that fills its model sizes.) No module sits in a circle. Besides: each module imports alone in
a fresh interpreter (the model loads neither the data package nor ``tokenizers``), and every
sharding is derived from a type: no file but ``shardtypes.py`` builds a ``PartitionSpec`` or
``NamedSharding`` by hand. A companion test shows the source check catches each kind of
wrong import.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "seqshard"

LAYERS: dict[str, tuple[str, ...]] = {
    "shardlib": ("seqshard.shardlib",),
    "core": (
        "seqshard",
        "seqshard.mesh",
        "seqshard.batch",
        "seqshard.hardware",
        "seqshard.launch",
        "seqshard.testing",
    ),
    "model": ("seqshard.model",),
    "data": ("seqshard.data",),
    "evals": ("seqshard.evals",),
    "hf": ("seqshard.hf",),
    "config": ("seqshard.config",),
    "train": ("seqshard.train",),
    "sample": ("seqshard.sample",),
    "harness": ("seqshard.harness",),
    "plan": ("seqshard.plan",),
    "cli": ("seqshard.cli",),
}
MAY_USE: dict[str, set[str]] = {
    "shardlib": set(),
    "core": {"shardlib"},
    "model": {"shardlib", "core"},
    "data": {"shardlib", "core"},
    "evals": {"shardlib", "core", "model", "data"},
    "hf": {"shardlib", "core", "model", "data"},
    "config": {"shardlib", "core", "model", "evals"},
    "train": {"shardlib", "core", "model", "data", "evals", "config"},
    "sample": {"shardlib", "core", "model", "data"},
    "harness": {"shardlib", "core", "model", "data", "evals", "config", "train", "sample"},
    "plan": {"shardlib", "core", "model", "data", "hf", "config", "train"},
    "cli": set(LAYERS),
}


def layer_of(module: str, layers: Mapping[str, tuple[str, ...]] = LAYERS) -> str:
    """The layer of ``module``: the one naming it or its longest enclosing package."""
    best, best_len = None, -1
    for name, prefixes in layers.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = name, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to tests/test_layering.py")
    return best


def source_modules(package: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of ``package`` (a directory)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def source_imports(package: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module of the package: the line of its first import}, for every
    import in the source: module level, in functions, under TYPE_CHECKING, relative ones, and
    ``importlib.import_module('...')`` with a literal name."""
    modules = source_modules(package)
    root = package.name

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        while parts:  # `from seqshard.model import cost` -> seqshard.model.cost
            if ".".join(parts) in modules:
                return ".".join(parts)
            parts.pop()
        return None

    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        found: dict[str, int] = {}
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from pkg import mod` imports pkg.mod; `from mod import name`, mod itself.
                names = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names = [node.args[0].value]
            for name in names:
                if name == root or name.startswith(root + "."):
                    target = resolve(name)
                    if target is not None and target != module:
                        found.setdefault(target, node.lineno)
        graph[module] = found
    return graph


def wrong_imports(
    graph: Mapping[str, Mapping[str, int]],
    layers: Mapping[str, tuple[str, ...]] = LAYERS,
    may_use: Mapping[str, set[str]] = MAY_USE,
) -> list[str]:
    """``'a.b:12 imports c.d (layer x may not use layer y)'`` for every import up or across."""
    out = []
    for module, targets in graph.items():
        mine = layer_of(module, layers)
        for target, line in targets.items():
            theirs = layer_of(target, layers)
            # A package's __init__ may re-export its own modules.
            if theirs != mine and theirs not in may_use[mine]:
                out.append(f"{module}:{line} imports {target} ({mine} may not use {theirs})")
    return out


def circles(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return source_imports(PACKAGE)


def test_every_module_has_a_layer(graph):
    for module in graph:
        layer_of(module)


def test_no_import_runs_up_or_across_a_layer(graph):
    assert not wrong_imports(graph)


def test_no_circles(graph):
    assert not circles(graph)


def test_the_source_check_catches_each_kind_of_wrong_import(tmp_path):
    """A toy package with one wrong import of each kind: the checks above find each one."""
    pkg = tmp_path / "toy"
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/base.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from toy.high import app  # under TYPE_CHECKING
            """,
        "low/ops.py": """
            def f():
                from toy.high.app import run  # inside a function
                import importlib
                importlib.import_module("toy.high.app")
            """,
        "low/a.py": "from toy.low import b\n",
        "low/b.py": "from . import a  # relative, closing a circle\n",
        "high/__init__.py": "",
        "high/app.py": "import toy.low.base\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(textwrap.dedent(text))
    layers = {"low": ("toy", "toy.low"), "high": ("toy.high",)}
    may_use = {"low": set(), "high": {"low"}}
    found = source_imports(pkg)
    assert found["toy.low.ops"] == {"toy.high.app": 3}  # the function's and importlib's
    assert sorted(wrong_imports(found, layers, may_use)) == [
        "toy.low.base:4 imports toy.high.app (low may not use high)",
        "toy.low.ops:3 imports toy.high.app (low may not use high)",
    ]
    assert ["toy.low.a", "toy.low.b"] in circles(found)
    assert ["toy.high.app", "toy.low.base"] in circles(found)


# -- each module alone, in a fresh interpreter --------------------------------------------------

_PROBE = """
import importlib, json, os, sys
# Third-party packages every module needs, loaded once; each module is then imported in a
# forked child, a fresh interpreter as far as seqshard (and tokenizers) go.
import jax, numpy, optax, omegaconf, orbax.checkpoint, yaml  # noqa: F401
assert not [m for m in sys.modules if m.startswith(("seqshard", "tokenizers"))]
results = {}
for name in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        importlib.import_module(name)
        pulled = sorted(m for m in sys.modules if m.startswith(("seqshard", "tokenizers")))
        os.write(write, json.dumps(pulled).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        results[name] = json.loads(f.read() or "null")
    os.waitpid(pid, 0)
print(json.dumps(results))
"""


def test_each_module_imports_alone_and_the_model_loads_no_data():
    """Each module imports alone (a cycle that shows only when one module comes first fails
    here); the model and the config load neither the data package nor ``tokenizers``."""
    modules = list(source_modules(PACKAGE))
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout.splitlines()[-1])
    assert not [m for m, pulled in results.items() if pulled is None]
    for module in ("seqshard.model", "seqshard.config"):
        pulled = results[module]
        assert not [m for m in pulled if m.startswith(("seqshard.data", "tokenizers"))], module


# -- shardings come from types ------------------------------------------------------------------


def _hand_made_shardings(path: Path) -> list[str]:
    """``PartitionSpec(...)``, ``P(...)`` and ``NamedSharding(...)`` calls in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("PartitionSpec", "NamedSharding", "P"):
                found.append(f"{path.name}:{node.lineno} {name}(...)")
    return found


def test_shardings_come_from_types():
    """Every PartitionSpec / NamedSharding is derived from a type, in shardtypes.py."""
    files = [*PACKAGE.rglob("*.py"), *(REPO / "scripts").glob("*.py")]
    found = [
        hit for path in files if path.name != "shardtypes.py" for hit in _hand_made_shardings(path)
    ]
    assert not found, f"build these from types (seqshard.shardlib.shardtypes.shardings): {found}"


def test_the_source_check_finds_a_hand_made_sharding(tmp_path):
    """The check above is not vacuous."""
    bad = tmp_path / "hand_made.py"
    bad.write_text("from jax.sharding import PartitionSpec as P\nx = P('d', None)\n")
    assert _hand_made_shardings(bad) == ["hand_made.py:2 P(...)"]
