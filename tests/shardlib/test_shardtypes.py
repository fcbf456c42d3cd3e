"""Tests for seqshard/shardlib/shardtypes.py: types, what derives from them, and typed_shard_map."""

# Spec strings such as 'd_model/t/d' in annotations parse as Python expressions, so ruff
# reads them as forward references to undefined names.
# ruff: noqa: F821

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from seqshard import Array, ArrayType, bf16, f32, i32, pytree_dataclass, typed_shard_map
from seqshard.shardlib import shardops as so
from seqshard.shardlib.notation import SpecSyntaxError
from seqshard.shardlib.shapecheck import ShapeError
from seqshard.shardlib.shardtypes import (
    block_shape,
    partition_specs,
    shape_dtype_structs,
    shardings,
    type_tree,
)
from seqshard.testing import count_collectives, fake_cpu_mesh


@pytree_dataclass
class Layer:
    ln1: f32["d_model/t/d"]
    w_q: f32["d_model/d n_q_per_kv n_kv/t d_head"]
    w_kv: f32["2 d_model/d n_kv/t d_head"]
    w_up: f32["d_model/d d_ff/t"]


@pytree_dataclass
class Weights:
    embed: f32["vocab/t d_model/d"]
    layers: Array["layers", Layer]
    final: f32["d_model/t/d"]


SIZES = {
    "vocab": 32,
    "d_model": 16,
    "layers": 3,
    "n_q_per_kv": 2,
    "n_kv": 4,
    "d_head": 4,
    "d_ff": 8,
}


@pytest.fixture(scope="module")
def mesh():
    return fake_cpu_mesh((2, 4), ("d", "t"))


# ---------------------------------------------------------------------------------------------
# Types and what derives from them


def test_array_type_partition_spec_and_repr():
    assert f32["d_model/t/d"].partition_spec == P(("t", "d"))
    assert f32["d_model/d d_ff/t"].partition_spec == P("d", "t")
    assert f32["d_model/t/d n"].partition_spec == P(("t", "d"), None)
    assert f32["B L"].partition_spec == P(None, None)
    assert f32[()].partition_spec == P()
    assert bf16[b"B/d L M/t"] == bf16["B/d L M/t"]
    assert repr(bf16[b"B/d L M/t"]) == "bf16['B/d L M/t']"
    assert repr(f32[()]) == "f32[()]"
    assert f32["M"].dtype == jnp.float32 and i32["M"].dtype == jnp.int32


def test_malformed_type_spec_raises_at_declaration():
    with pytest.raises(SpecSyntaxError, match="used twice"):
        f32["M/t/t"]


def test_partition_specs_of_stacked_pytree_dataclass():
    specs = partition_specs(Weights)
    assert specs == Weights(
        embed=P("t", "d"),
        layers=Layer(
            ln1=P(None, ("t", "d")),
            w_q=P(None, "d", None, "t", None),
            w_kv=P(None, None, "d", "t", None),
            w_up=P(None, "d", "t"),
        ),
        final=P(("t", "d")),
    )


def test_type_tree_stacks_the_prefix():
    tree = type_tree(Weights)
    assert isinstance(tree, Weights) and isinstance(tree.layers, Layer)
    assert str(tree.layers.w_kv.shape) == "layers 2 d_model/d n_kv/t d_head"
    assert type_tree((f32["M"], [i32["B"]])) == (f32["M"], [i32["B"]])
    assert type_tree({"x": f32["M"]}) == {"x": f32["M"]}
    with pytest.raises(TypeError, match="is not a seqshard type"):
        type_tree(int)
    with pytest.raises(TypeError, match=r"Array\['layers', X\]"):
        Array["layers"]


def test_pytree_dataclass_is_frozen_pytree():
    w = Layer(ln1=1, w_q=2, w_kv=3, w_up=4)
    assert jax.tree.leaves(w) == [1, 2, 3, 4]
    assert jax.tree.map(lambda x: x * 10, w) == Layer(10, 20, 30, 40)
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.ln1 = 5


def test_shardings(mesh):
    out = shardings(Weights, mesh)
    assert out.layers.w_up == NamedSharding(mesh, P(None, "d", "t"))
    assert out.final == NamedSharding(mesh, P(("t", "d")))
    with pytest.raises(ShapeError, match=r"f32\['M/x'\] names mesh axis 'x'.*'d': 2, 't': 4"):
        shardings(f32["M/x"], mesh)


def test_shape_dtype_structs(mesh):
    structs = shape_dtype_structs(Weights, SIZES)
    assert structs.embed.shape == (32, 16)
    assert structs.layers.w_kv.shape == (3, 2, 16, 4, 4)
    assert structs.layers.ln1.dtype == jnp.float32
    sharded = shape_dtype_structs(Weights, SIZES, mesh)
    assert sharded.layers.w_q.sharding == NamedSharding(mesh, P(None, "d", None, "t", None))
    assert sharded.final.shape == (16,)
    # init directly in the sharded layout
    init = jax.jit(
        lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sharded),
        out_shardings=shardings(Weights, mesh),
    )()
    assert init.layers.w_up.sharding.spec == P(None, "d", "t")


def test_shape_dtype_structs_errors(mesh):
    with pytest.raises(ShapeError) as info:
        shape_dtype_structs(Weights, {**SIZES, "d_model": 12}, mesh)
    message = str(info.value)
    # d_model/t/d: 12 is not divisible by t=4 x d=2
    for word in [".layers.ln1", "dimension d_model", "size 12", "t=4 x d=2 = 8 shards"]:
        assert word in message, (word, message)
    sizes = dict(SIZES)
    del sizes["d_ff"]
    with pytest.raises(ShapeError, match="no size given for dimension 'd_ff'"):
        shape_dtype_structs(Weights, sizes)


def test_block_shape():
    t = f32["layers d_model/d d_ff/t"]
    assert block_shape(t, SIZES, {"d": 2, "t": 4}) == (3, 8, 2)
    assert block_shape(f32["2 d_model/t/d"], SIZES, {"d": 2, "t": 4}) == (2, 2)


# ---------------------------------------------------------------------------------------------
# typed_shard_map


def gather_matmul(x: f32["B/d M/t"], w: f32["M/d F/t"]) -> f32["B/d F/t"]:
    x = so.all_gather("B/d M/t -> B/d M", x)
    w = so.all_gather("M/d F/t -> M F/t", w)
    return so.einsum_unreduced("B/d M, M F/t -> B/d F/t", x, w)


def _ints(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).integers(-3, 4, shape).astype(dtype)


def test_typed_shard_map_runs(mesh):
    f = typed_shard_map(gather_matmul, mesh=mesh)
    assert f.in_specs == (P("d", "t"), P("d", "t")) and f.out_specs == P("d", "t")
    x, w = _ints((4, 8)), _ints((8, 12), seed=1)
    np.testing.assert_array_equal(f(x, w), x @ w)
    assert f.__name__ == "gather_matmul"


def test_typed_shard_map_dtype_mismatch(mesh):
    f = typed_shard_map(gather_matmul, mesh=mesh)
    with pytest.raises(TypeError) as info:
        f(_ints((4, 8), np.int32), _ints((8, 12)))
    message = str(info.value)
    for word in ["argument 'x'", "expected dtype float32", "got int32", ".astype(jnp.float32)"]:
        assert word in message, (word, message)


def test_typed_shard_map_divisibility_checked_before_running(mesh):
    ran = []

    def f(x: f32["B/d M/t"]) -> f32["B/d M/t"]:
        ran.append(True)
        return x

    with pytest.raises(ShapeError) as info:
        typed_shard_map(f, mesh=mesh)(np.zeros((4, 6), np.float32))
    message = str(info.value)
    for word in ["argument 'x'", "dimension M", "'B/d M/t'", "size 6", "t=4 = 4 shards"]:
        assert word in message, (word, message)
    assert not ran


def test_typed_shard_map_one_size_per_name(mesh):
    f = typed_shard_map(gather_matmul, mesh=mesh)
    with pytest.raises(ShapeError) as info:
        f(_ints((4, 8)), _ints((16, 12)))
    message = str(info.value)
    for word in ["argument 'w'", "'M'", "global size 16", "argument 'x'", "size 8"]:
        assert word in message, (word, message)


def test_typed_shard_map_wrong_structure_and_arity(mesh):
    def f(layer: Layer) -> f32["d_model/t/d"]:
        return layer.ln1

    g = typed_shard_map(f, mesh=mesh)
    with pytest.raises(TypeError, match="structure does not match its type"):
        g((np.zeros(16, np.float32),))
    with pytest.raises(TypeError, match=r"takes 1 arguments \(layer\), got 2"):
        g(1, 2)


def test_typed_shard_map_signature_errors(mesh):
    def no_type(x) -> f32["M"]:
        return x

    def no_return(x: f32["M"]):
        return x

    def keyword_only(*, x: f32["M"]) -> f32["M"]:
        return x

    with pytest.raises(TypeError, match="parameter 'x' .* has no type"):
        typed_shard_map(no_type, mesh=mesh)
    with pytest.raises(TypeError, match="needs a return annotation"):
        typed_shard_map(no_return, mesh=mesh)
    with pytest.raises(TypeError, match="must be positional"):
        typed_shard_map(keyword_only, mesh=mesh)


def sum_of_squares(x: f32["B/d M/t"]) -> f32[()]:
    return so.psum("(){U_d,t} -> ()", jnp.sum(x * x))


def test_typed_shard_map_scalar_output(mesh):
    x = _ints((4, 8))
    out = typed_shard_map(sum_of_squares, mesh=mesh)(x)
    assert out.shape == () and out == np.sum(x * x)
    grad = jax.grad(typed_shard_map(sum_of_squares, mesh=mesh))(x)
    np.testing.assert_array_equal(grad, 2 * x)


def two_results(x: f32["B/d M/t"]) -> tuple[f32["B/d M/t"], f32["B/d"]]:
    row_sums = so.psum("B/d{U_t} -> B/d", jnp.sum(x, axis=1))
    return 2 * x, row_sums


def test_typed_shard_map_tuple_return(mesh):
    x = _ints((4, 8))
    doubled, sums = typed_shard_map(two_results, mesh=mesh)(x)
    np.testing.assert_array_equal(doubled, 2 * x)
    np.testing.assert_array_equal(sums, x.sum(1))


def stacked_norms(w: Weights) -> f32["layers"]:
    ln1 = so.all_gather("L M/t/d -> L M", w.layers.ln1, to="invarying")
    return jnp.sum(ln1 * ln1, axis=1)


def test_typed_shard_map_stacked_weights(mesh):
    structs = shape_dtype_structs(Weights, SIZES)
    rng = np.random.default_rng(0)
    w = jax.tree.map(lambda s: rng.integers(-3, 4, s.shape).astype(np.float32), structs)
    out = typed_shard_map(stacked_norms, mesh=mesh)(w)
    np.testing.assert_array_equal(out, np.sum(w.layers.ln1**2, axis=1))


def gather_varying(w: f32["M/d F/t"]) -> f32["M F/t"]:
    return so.all_gather("M/d F/t -> M F/t", w)


def gather_invarying(w: f32["M/d F/t"]) -> f32["M F/t"]:
    return so.all_gather("M/d F/t -> M F/t", w, to="invarying")


def test_returning_a_varying_gather_as_replicated(mesh):
    w = _ints((8, 12))
    with pytest.raises(TypeError) as info:
        typed_shard_map(gather_varying, mesh=mesh)(w)
    message = str(info.value)
    for word in ["output", "f32['M F/t']", "['d']", "varies", "to='invarying'"]:
        assert word in message, (word, message)
    np.testing.assert_array_equal(typed_shard_map(gather_invarying, mesh=mesh)(w), w)
    # without replication checks the plain gather is returned as written (jitted: JAX 0.10's
    # eager shard_map with check_vma=False rejects a mesh with automatic axes, here c = 1)
    unchecked = jax.jit(typed_shard_map(gather_varying, mesh=mesh, check_vma=False))
    np.testing.assert_array_equal(unchecked(w), w)


def test_output_checked_against_its_type(mesh):
    def wrong_dtype(x: f32["B/d M/t"]) -> bf16["B/d M/t"]:
        return x

    def wrong_rank(x: f32["B/d M/t"]) -> f32["B/d M/t"]:
        return x[:, :, None]

    with pytest.raises(TypeError, match=r"output: expected dtype bfloat16 .* got float32"):
        typed_shard_map(wrong_dtype, mesh=mesh)(_ints((4, 8)))
    with pytest.raises(ShapeError, match=r"output: spec 'B/d M/t' has 2 dimensions"):
        typed_shard_map(wrong_rank, mesh=mesh)(_ints((4, 8)))


def test_explicit_mesh_mismatch_is_seqshards_error():
    mesh = jax.make_mesh((2, 4), ("d", "t"))  # Explicit axes by default
    assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)

    def f(x: f32["B/d M/t"]) -> f32["B/d M/t"]:
        return 2 * x

    x = jax.device_put(_ints((4, 8)), NamedSharding(mesh, P("t", None)))
    with pytest.raises(ShapeError) as info:
        typed_shard_map(f, mesh=mesh)(x)
    message = str(info.value)
    for word in ["Explicit axes", "P('d', 't')", "P('t', None)", "jax.sharding.reshard"]:
        assert word in message, (word, message)
    good = jax.device_put(_ints((4, 8)), NamedSharding(mesh, P("d", "t")))
    np.testing.assert_array_equal(typed_shard_map(f, mesh=mesh)(good), 2 * np.asarray(good))


def test_array_type_is_hashable_and_comparable():
    assert {f32["M/d"], f32["M/d"]} == {f32["M/d"]}
    assert f32["M/d"] != bf16["M/d"]
    assert isinstance(f32["M"], ArrayType)


# ---------------------------------------------------------------------------------------------
# Axes of size 1: not manual, no collective over them, one device runs without shard_map


def gather_t(x: f32["B/d M/t"]) -> f32["B/d M"]:
    return so.all_gather("B/d M/t -> B/d M", x)  # a varying gather, over t only


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_returning_replicated_over_a_size_one_axis(check_vma):
    """With t = 1 a gather over t is nothing, and its result may be returned as replicated
    over t even with replication checked: t is not a manual axis, so nothing varies over it."""
    mesh = fake_cpu_mesh((8, 1), ("d", "t"))
    f = jax.jit(typed_shard_map(gather_t, mesh=mesh, check_vma=check_vma))
    x = _ints((8, 4))
    np.testing.assert_array_equal(f(x), x)
    assert sum(count_collectives(f, x).values()) == 0


def test_size_one_axes_leave_the_specs():
    """The specs given to jax.shard_map name only axes of size > 1 ('M/t/d' is P('d') when
    t = 1), and only those are manual in the body."""
    mesh = fake_cpu_mesh((8, 1), ("d", "t"))
    seen = []

    def f(w: Weights, x: f32["B/d M/t"]) -> f32["d_model/t/d"]:
        seen.append(jax.sharding.get_abstract_mesh().axis_types)
        return w.final

    g = typed_shard_map(f, mesh=mesh)
    assert g.in_specs[0].final == P("d") and g.in_specs[0].embed == P(None, "d")
    assert g.in_specs[1] == P("d", None) and g.out_specs == P("d")
    w = jax.tree.map(lambda s: _ints(s.shape), shape_dtype_structs(Weights, SIZES))
    np.testing.assert_array_equal(g(w, _ints((8, 4))), w.final)
    auto, manual = jax.sharding.AxisType.Auto, jax.sharding.AxisType.Manual
    assert seen == [
        (manual, auto, auto, auto, auto)
    ]  # d, t, and seqshard's p, e and c (fake_cpu_mesh adds them)


def psum_and_index(x: f32["B/d M/t"]) -> tuple[f32[()], f32["B/d M/t"]]:
    total = so.psum("(){U_d,t} -> ()", jnp.sum(x * x))
    shifted = x + so.axis_index(("d", "t")).astype(jnp.float32) * so.axis_size("t")
    return total, shifted


@pytest.mark.parametrize("shape", [(8, 1), (1, 8)], ids=["8x1", "1x8"])
def test_psum_over_a_size_one_axis_is_one_all_reduce(shape):
    mesh = fake_cpu_mesh(shape, ("d", "t"))
    f = jax.jit(typed_shard_map(psum_and_index, mesh=mesh))
    x = _ints((8, 8))
    total, shifted = f(x)
    assert total == np.sum(x * x)
    d_index = np.repeat(np.arange(shape[0]), 8 // shape[0])[:, None]
    t_index = np.repeat(np.arange(shape[1]), 8 // shape[1])[None, :]
    np.testing.assert_array_equal(shifted, x + (d_index * shape[1] + t_index) * shape[1])
    counts = count_collectives(f, x)
    assert counts == {**dict.fromkeys(counts, 0), "all-reduce": 1}, counts


def lookup(table: f32["vocab/t d_model/d"], ids: i32[b"B/d L"]) -> f32[b"B/d L d_model"]:
    table = so.all_gather("V/t M/d -> V/t M", table)
    rows = so.index_unreduced("[V/t] M, B/d L -> B/d L M", table, ids)
    return so.psum("B/d L M{U_t} -> B/d L M", rows)


def test_one_device_mesh_runs_without_shard_map():
    """On a 1x1 mesh the body runs on the whole arrays, with no shard_map and no collective;
    axis_index is 0 and axis_size 1, and ops outside it are still refused afterwards."""
    mesh = fake_cpu_mesh((1, 1), ("d", "t"))
    x = _ints((4, 8))
    f = typed_shard_map(psum_and_index, mesh=mesh)
    assert "shard_map" not in str(jax.make_jaxpr(f)(x))
    total, shifted = f(x)
    assert total == np.sum(x * x)
    np.testing.assert_array_equal(shifted, x)
    np.testing.assert_array_equal(jax.grad(lambda x: f(x)[0])(x), 2 * x)
    assert sum(count_collectives(jax.jit(f), x).values()) == 0
    table, ids = _ints((32, 16)), np.random.default_rng(1).integers(0, 32, (2, 3)).astype(np.int32)
    g = jax.jit(typed_shard_map(lookup, mesh=mesh))
    np.testing.assert_array_equal(g(table, ids), table[ids])
    assert sum(count_collectives(g, table, ids).values()) == 0
    with pytest.raises(ShapeError, match="outside one"):
        so.axis_size("t")


def test_explicit_mesh_size_one_axis_is_unsplit():
    """On an Explicit mesh with t = 1, 'B/d M/t' and 'B/d M' are the same layout: either
    sharding is accepted."""
    mesh = jax.make_mesh((8, 1), ("d", "t"))

    def f(x: f32["B/d M/t"]) -> f32["B/d M/t"]:
        return 2 * x

    for spec in (P("d", "t"), P("d", None)):
        x = jax.device_put(_ints((8, 4)), NamedSharding(mesh, spec))
        np.testing.assert_array_equal(typed_shard_map(f, mesh=mesh)(x), 2 * np.asarray(x))
