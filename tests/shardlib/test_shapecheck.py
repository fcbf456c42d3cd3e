"""Tests of seqshard.shardlib.shapecheck: one size per dimension name within a scope, blocks and global
arrays checked against specs, and the block axes the ops see."""

from __future__ import annotations

import pytest

from seqshard.shardlib.notation import parse_shape
from seqshard.shardlib.shapecheck import (
    ShapeError,
    block_axes,
    check_block,
    check_global,
    check_shape,
    shape_scope,
)

MESH = {"d": 2, "t": 4}


def test_a_block_binds_global_sizes():
    with shape_scope() as scope:
        sizes = check_block(parse_shape("B M/t/d"), (6, 5), MESH, "x")
        assert sizes == {"B": 6, "M": 40}
        assert check_shape(parse_shape("B M"), (6, 40), MESH, "y", scope, per_device=False) == sizes


def test_one_name_one_size_within_a_scope():
    with shape_scope():
        check_global(parse_shape("B M/t"), (6, 8), MESH, "x")
        with pytest.raises(
            ShapeError, match=r"y: dimension 'B' has global size 7, but x gave it size 6"
        ):
            check_global(parse_shape("B"), (7,), MESH, "y")
    with shape_scope():  # a new scope forgets
        check_global(parse_shape("B"), (7,), MESH, "y")


def test_a_global_size_the_axes_do_not_divide():
    with shape_scope(), pytest.raises(ShapeError) as e:
        check_global(parse_shape("B/d M/t"), (6, 10), MESH, "w")
    assert "dimension M of spec 'B/d M/t' has size 10" in str(e.value)
    assert "(t=4 = 4 shards)" in str(e.value)


def test_rank_literals_and_unknown_axes():
    with shape_scope():
        with pytest.raises(ShapeError, match="2 dimensions"):
            check_global(parse_shape("B M"), (6,), MESH, "r")
        with pytest.raises(ShapeError, match="fixes dimension 2 at size 2"):
            check_global(parse_shape("2 M"), (3, 4), MESH, "l")
        with pytest.raises(ShapeError, match="mesh axis 'x'"):
            check_global(parse_shape("M/x"), (4,), MESH, "a")


def test_no_block_axes_outside_a_shard_map():
    assert block_axes() is None
