"""Tests for seqshard/shardlib/vma.py: the axes a value varies over, and whether that is tracked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from seqshard.shardlib.vma import replication_checked, varying_axes
from seqshard.testing import fake_cpu_mesh


def _run(body, mesh, in_spec, x, check_vma, axis_names=None):
    """Run ``body`` under shard_map (manual over ``axis_names``) and return what it recorded."""
    seen = []

    def wrapped(x):
        seen.append(body(x))
        return x

    kwargs = {} if axis_names is None else {"axis_names": frozenset(axis_names)}
    f = jax.shard_map(
        wrapped, mesh=mesh, in_specs=in_spec, out_specs=in_spec, check_vma=check_vma, **kwargs
    )
    jax.eval_shape(f, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return seen[0]


def test_varying_axes():
    mesh = fake_cpu_mesh((2, 4), ("d", "t"))
    x = np.zeros((4, 8), np.float32)
    got = _run(lambda b: (varying_axes(b), varying_axes(jnp.sum(b))), mesh, P("d", None), x, True)
    assert got == (frozenset({"d"}), frozenset({"d"}))
    got = _run(lambda b: varying_axes(lax.psum(b, "d")), mesh, P("d", None), x, True)
    assert got == frozenset()
    assert _run(varying_axes, mesh, P("d", "t"), x, False) == frozenset()
    assert varying_axes(jnp.ones(3)) == frozenset()


@pytest.mark.parametrize("check_vma", [True, False])
def test_replication_checked_follows_check_vma(check_vma):
    mesh = fake_cpu_mesh((2, 4), ("d", "t"))
    x = np.zeros((4, 8), np.float32)
    assert _run(lambda b: replication_checked(), mesh, P("d", "t"), x, check_vma) == check_vma
    assert _run(lambda b: replication_checked(["t"]), mesh, P("d", "t"), x, check_vma) == check_vma


def test_replication_checked_probes_a_manual_axis_above_size_one():
    """With t (size 1, first) left out of the manual axes, the probe must use d, not t."""
    mesh = fake_cpu_mesh((1, 8), ("t", "d"))
    x = np.zeros((8,), np.float32)
    for check_vma in (True, False):
        got = _run(lambda b: replication_checked(), mesh, P("d"), x, check_vma, {"d"})
        assert got == check_vma
    # asked about t only, there is no manual axis of size > 1 to probe
    assert _run(lambda b: replication_checked(["t"]), mesh, P("d"), x, True, {"d"}) is False


def test_replication_checked_without_an_axis_above_size_one():
    """Nothing can be refused over axes of size 1, so with none larger it reports False."""
    mesh = fake_cpu_mesh((1, 1), ("d", "t"))
    x = np.zeros((4,), np.float32)
    assert _run(lambda b: replication_checked(), mesh, P("d"), x, True) is False
    assert replication_checked() is False
    with jax.set_mesh(fake_cpu_mesh((2, 4), ("d", "t"))):
        assert replication_checked() is False  # Auto axes, none manual: outside shard_map
