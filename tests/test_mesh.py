"""Tests of seqshard.mesh: the table of mesh axes, sizes for any subset, meshes with Auto axes."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import AxisType

from seqshard.config import ConfigError, MeshConfig, load_config
from seqshard.mesh import AXES, MESH_AXES, axis_sizes, mesh_from_devices, mesh_of_sizes


def test_the_table_names_every_axis_once_with_a_meaning():
    assert AXES == tuple(a.name for a in MESH_AXES) == ("d", "t")
    assert all(a.meaning for a in MESH_AXES)
    assert len(set(AXES)) == len(AXES)


def test_mesh_config_has_a_field_per_axis_in_table_order():
    """MeshConfig is the config side of the table: one size per known axis."""
    import dataclasses

    assert tuple(f.name for f in dataclasses.fields(MeshConfig)) == AXES


@pytest.mark.parametrize(
    "given, full",
    [
        ({}, {"d": 1, "t": 1}),
        ({"t": 2}, {"d": 1, "t": 2}),
        ({"d": 4, "t": 2}, {"d": 4, "t": 2}),
        ({"t": 2, "d": 4}, {"d": 4, "t": 2}),  # table order, whatever the given order
    ],
)
def test_missing_axes_have_size_one(given, full):
    assert axis_sizes(given) == full
    assert list(axis_sizes(given)) == list(AXES)


def test_unknown_axis_and_bad_sizes_are_errors_that_name_them():
    with pytest.raises(ValueError, match=r"unknown mesh axes \['x'\].*d \(data / FSDP"):
        axis_sizes({"x": 2})
    for bad in (0, -1, 1.5, True):
        with pytest.raises(
            ValueError, match=rf"mesh axis t must have an integer size >= 1, got {bad!r}"
        ):
            axis_sizes({"t": bad})


def test_mesh_of_sizes_has_every_axis_with_auto_types():
    mesh = mesh_of_sizes({"t": 4})
    assert dict(mesh.shape) == {"d": 1, "t": 4}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert list(mesh.devices.flat) == jax.devices()[:4]


def test_a_mesh_larger_than_the_devices_says_how_to_get_more():
    with pytest.raises(
        RuntimeError, match=r"needs 16 CPU devices but this process has 8.*XLA_FLAGS"
    ):
        mesh_of_sizes({"d": 8, "t": 2})
    with pytest.raises(RuntimeError, match="needs 2"):
        mesh_from_devices((2,), ("d",), jax.devices()[:1])


def test_config_mesh_sizes_and_description():
    cfg = load_config(None, ["mesh.t=2", "data.vocab_size=64", "model.vocab=64"])
    assert cfg.mesh.sizes() == {"d": 1, "t": 2}
    assert cfg.mesh.n_devices == 2 and cfg.mesh.describe() == "d=1 x t=2"
    with pytest.raises(ConfigError, match="mesh axis d must have an integer size >= 1, got 0"):
        load_config(None, ["mesh.d=0"])
