"""seqshard uses public JAX API only: no source file imports JAX's private modules."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Built from parts so that this file's own text names none of them.
PRIVATE = tuple(
    ".".join(parts)
    for parts in (("jax", "_src"), ("jax", "experimental", "shard_map"), ("jax", "interpreters"))
)


def _source_files() -> list[pathlib.Path]:
    files = []
    for folder in ("seqshard", "scripts", "tests"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def _private_imports(tree: ast.AST) -> list[str]:
    """Modules named by import statements that are, or live under, a private JAX module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from jax import <private>` names the private module too
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [n for n in names if any(n == p or n.startswith(p + ".") for p in PRIVATE)]
    return found


def test_there_are_files_to_scan():
    names = {p.name for p in _source_files()}
    assert {"shardops.py", "shardtypes.py", "test_no_private_jax.py"} <= names


@pytest.mark.parametrize("path", _source_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_jax(path):
    text = path.read_text()
    imports = _private_imports(ast.parse(text, filename=str(path)))
    assert not imports, f"{path.relative_to(ROOT)} imports private JAX modules: {imports}"
    # Also names in strings (importlib, getattr chains): plain text search.
    mentioned = [p for p in PRIVATE if p in text]
    assert not mentioned, f"{path.relative_to(ROOT)} mentions private JAX modules: {mentioned}"


def test_the_checker_catches_private_imports():
    samples = [
        "import " + PRIVATE[0] + ".core",
        "from " + PRIVATE[1] + " import shard_map",
        "from jax import " + PRIVATE[2].split(".")[1],
        "from " + PRIVATE[0].split(".")[0] + " import " + PRIVATE[0].split(".")[1],
    ]
    for sample in samples:
        assert _private_imports(ast.parse(sample)), sample
    assert not _private_imports(ast.parse("import jax\nfrom jax import lax, shard_map"))
