"""The package's layering, read off the sources and off fresh interpreters.

    core   the notation and what derives from it (types, ops, meshes, the batch, accounting)
    model  seqshard.model.*                   core
    data   seqshard.data.*                    core
    train  seqshard.train.*, config, planner  core, model, data
    app    cli, show, sample                  anything

Each module is imported alone in a fresh interpreter, and every seqshard module it pulled in
must belong to a layer it may use. Importing the model loads neither the data package nor
``tokenizers``. And every sharding is derived from a type: no file but ``shardtypes.py``
builds a ``PartitionSpec`` or ``NamedSharding`` by hand. (Each module also imports alone: the
forked children would fail on an import cycle that only shows when that module comes first.)
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "seqshard"

CORE = {
    "seqshard",
    "seqshard.batch",
    "seqshard.collective_log",
    "seqshard.collective_order",
    "seqshard.comms",
    "seqshard.flops",
    "seqshard.hardware",
    "seqshard.launch",
    "seqshard.mesh",
    "seqshard.notation",
    "seqshard.pipeline",
    "seqshard.pipeline_schedule",
    "seqshard.remat",
    "seqshard.shapecheck",
    "seqshard.shardops",
    "seqshard.shardtypes",
    "seqshard.testing",
    "seqshard.vma",
}
# The planner reads a whole Config (config.py) and the model's weight types: the train layer.
TRAIN = {"seqshard.config", "seqshard.planner", "seqshard.step_comms"}
APP = {"seqshard.cli", "seqshard.show", "seqshard.sample"}
MAY_USE = {
    "core": {"core"},
    "model": {"core", "model"},
    "data": {"core", "data"},
    "train": {"core", "model", "data", "train"},
    "app": {"core", "model", "data", "train", "app"},
}


def layer(module: str) -> str:
    if module in CORE:
        return "core"
    if module in APP:
        return "app"
    if module in TRAIN or module.startswith(("seqshard.train", "seqshard.hf")):
        return "train"
    for name in ("model", "data"):
        if module == f"seqshard.{name}" or module.startswith(f"seqshard.{name}."):
            return name
    raise AssertionError(f"{module} is in no layer: add it to tests/test_layering.py")


def all_modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


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


def imported_by(modules: list[str]) -> dict[str, set[str]]:
    """For each module, the seqshard (and tokenizers) modules a fresh interpreter holds after
    importing it alone."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout.splitlines()[-1])
    failed = [m for m, pulled in results.items() if pulled is None]
    assert not failed, f"importing these alone failed: {failed}"
    return {m: set(pulled) for m, pulled in results.items()}


def test_every_module_has_a_layer():
    for module in all_modules():
        layer(module)


@pytest.fixture(scope="module")
def imports() -> dict[str, set[str]]:
    return imported_by(all_modules())


def test_each_module_imports_only_the_layers_below_it(imports):
    wrong = {}
    for module, pulled in imports.items():
        allowed = MAY_USE[layer(module)]
        bad = sorted(m for m in pulled if m.startswith("seqshard") and layer(m) not in allowed)
        if bad:
            wrong[module] = (layer(module), bad)
    assert not wrong, f"modules importing layers above them: {wrong}"


def test_the_model_loads_neither_data_nor_tokenizers(imports):
    for module in ("seqshard.model", "seqshard.config"):
        pulled = imports[module]
        assert not [m for m in pulled if m.startswith(("seqshard.data", "tokenizers"))], module


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
    assert not found, f"build these from types (seqshard.shardtypes.shardings): {found}"


def test_the_source_check_finds_a_hand_made_sharding(tmp_path):
    """The check above is not vacuous."""
    bad = tmp_path / "hand_made.py"
    bad.write_text("from jax.sharding import PartitionSpec as P\nx = P('d', None)\n")
    assert _hand_made_shardings(bad) == ["hand_made.py:2 P(...)"]
