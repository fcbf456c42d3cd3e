"""Tests for seqshard/testing.py: fake CPU meshes and HLO collective counting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from seqshard.testing import (
    COLLECTIVE_KINDS,
    Collective,
    assert_collectives,
    compiled_hlo,
    count_collectives,
    fake_cpu_mesh,
    list_collectives,
)


@pytest.fixture(scope="module")
def mesh():
    return fake_cpu_mesh((2, 4), ("d", "t"))


def test_fake_cpu_mesh_has_auto_axes(mesh):
    assert dict(mesh.shape) == {
        "d": 2,
        "t": 4,
        "e": 1,
        "c": 1,
        "p": 1,
    }  # seqshard's other axes added
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert all(d.platform == "cpu" for d in mesh.devices.flat)
    assert fake_cpu_mesh((2,), ("d",)).devices.size == 2


def test_fake_cpu_mesh_too_many_devices_names_xla_flags():
    with pytest.raises(RuntimeError) as info:
        fake_cpu_mesh((4, 4), ("d", "t"))
    message = str(info.value)
    assert "needs 16 CPU devices" in message and "has 8" in message
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=16" in message


def test_fake_cpu_mesh_needs_one_name_per_axis():
    with pytest.raises(ValueError, match="one name per axis"):
        fake_cpu_mesh((2, 4), ("d",))


def _gather(mesh):
    return jax.jit(
        jax.shard_map(
            lambda x: lax.all_gather(x, "t", axis=0, tiled=True),
            mesh=mesh,
            in_specs=P("t", None),
            out_specs=P(),
            check_vma=False,
        )
    )


def _psum_and_scatter(mesh):
    def body(x):
        return lax.psum(x, "d"), lax.psum_scatter(x, "t", scatter_dimension=0, tiled=True)

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=(P(), P("t")), check_vma=False)
    )


def test_count_collectives(mesh):
    x = np.zeros((8, 3), np.float32)
    assert count_collectives(_gather(mesh), x) == {
        "all-gather": 1,
        "reduce-scatter": 0,
        "all-reduce": 0,
        "all-to-all": 0,
        "collective-permute": 0,
    }
    counts = count_collectives(_psum_and_scatter(mesh), x)
    assert counts["all-reduce"] == 1 and counts["reduce-scatter"] == 1
    assert set(counts) == set(COLLECTIVE_KINDS)
    # a function without communication, jitted by count_collectives itself
    assert sum(count_collectives(lambda x: x * 2, x).values()) == 0


def test_assert_collectives(mesh):
    x = np.zeros((8, 3), np.float32)
    counts = assert_collectives(_psum_and_scatter(mesh), x, all_reduce=1, reduce_scatter=1)
    assert counts["all-gather"] == 0
    with pytest.raises(
        AssertionError, match=r"expected \{'all_gather': 1\}, got \{'all_gather': 0\}"
    ):
        assert_collectives(_psum_and_scatter(mesh), x, all_gather=1)
    with pytest.raises(TypeError, match="unknown kinds"):
        assert_collectives(_gather(mesh), x, allgather=1)


def test_list_collectives_shapes(mesh):
    x = np.zeros((8, 3), np.float32)
    (gather,) = list_collectives(_gather(mesh), x)
    assert isinstance(gather, Collective)
    assert gather.kind == "all-gather"
    assert gather.result_shapes[-1] == (8, 3)  # the per-device block (2, 3), gathered over t=4
    assert gather.replica_groups == "{{0,1,2,3},{4,5,6,7}}"  # the t axis: devices d*4 + t
    kinds = [c.kind for c in list_collectives(_psum_and_scatter(mesh), x)]
    assert sorted(kinds) == ["all-reduce", "reduce-scatter"]
    (scatter,) = [
        c for c in list_collectives(_psum_and_scatter(mesh), x) if c.kind == "reduce-scatter"
    ]
    assert scatter.result_shapes[-1] == (2, 3)


def test_collective_result_shapes_of_tuple_types():
    c = Collective("all-reduce", "(f32[4,3]{1,0}, bf16[7]{0}, s32[])", "{{0,1}}")
    assert c.result_shapes == [(4, 3), (7,), ()]


def test_compiled_hlo_is_text():
    text = compiled_hlo(jax.jit(lambda x: jnp.sin(x)), np.zeros(3, np.float32))
    assert "HloModule" in text and "sine" in text
