"""Tests of seqshard/__init__.py: the public names load on first use, each from its module."""

import subprocess
import sys

import pytest

import seqshard


@pytest.mark.parametrize("name", seqshard.__all__)
def test_every_public_name_loads(name):
    exec(f"from seqshard import {name}", {})


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'seqshard' has no attribute 'nope'"):
        seqshard.nope  # noqa: B018


def test_importing_seqshard_loads_no_jax():
    """`seqshard train` installs its signal handlers before JAX loads (seconds)."""
    probe = "import sys, seqshard; print(sorted(m for m in sys.modules if m.startswith('jax')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
