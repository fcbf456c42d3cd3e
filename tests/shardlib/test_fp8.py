"""seqshard/shardlib/fp8.py: per-tensor scales (powers of two, saturating), a sharded tensor
quantized at the whole tensor's scale (bit for bit the single-device value), gradients
straight through / on e5m2's grid, finite at a zero amax and past the format's range, and the
FSDP gather of e4m3 bits (logged and counted at one byte an element)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from seqshard.shardlib import collective_log, fp8
from seqshard.shardlib.comms import Collective
from seqshard.testing import fake_cpu_mesh

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


@pytest.fixture(scope="module")
def mesh():
    return fake_cpu_mesh((2, 4), ("d", "t"))


@pytest.mark.parametrize(
    "amax, want",
    [(448.0, 1.0), (449.0, 2.0), (224.0, 0.5), (1.0, 2.0**-8), (3e-3, 2.0**-17), (0.0, 1.0)],
)
def test_scale_is_the_least_power_of_two_at_which_amax_fits(amax, want):
    s = float(fp8.scale(jnp.float32(amax), fp8.FORWARD))
    assert s == want
    if amax:
        assert E4M3_MAX / 2 < amax / s <= E4M3_MAX


@pytest.mark.parametrize("amax", [np.inf, np.nan])
def test_a_non_finite_amax_keeps_scale_one(amax):
    assert float(fp8.scale(jnp.float32(amax), fp8.BACKWARD)) == 1.0


def test_values_past_the_range_saturate():
    x = jnp.array([1.0, -500.0, 1000.0, 448.0, np.inf, 3.0], jnp.float32)
    s = jnp.float32(1.0)
    y = fp8.on_grid(x, s, fp8.FORWARD)
    np.testing.assert_array_equal(y, [1.0, -448.0, 448.0, 448.0, 448.0, 3.0])
    # e4m3 keeps 3 mantissa bits: 17 lies between 16 and 18 (ties to even: 16).
    np.testing.assert_array_equal(fp8.on_grid(jnp.array([17.0, 19.0]), s, fp8.FORWARD), [16, 20])


def _shard_map(mesh, f, in_specs, out_specs):
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def test_a_sharded_tensor_is_quantized_at_the_whole_tensor_scale(mesh):
    """Each device's block on e4m3's grid at the whole tensor's scale: the sharded result is
    the single-device one bit for bit, though each block's own amax differs."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 8)).astype(np.float32) * np.geomspace(1e-3, 10, 8)
    x[0, 0, 7] = 300.0  # one block holds the amax
    f = _shard_map(
        mesh,
        lambda x: fp8.quantized("current", "B/d L M/t", x),
        P("d", None, "t"),
        P("d", None, "t"),
    )
    want = fp8.local_quantized("current", jnp.asarray(x))
    np.testing.assert_array_equal(jax.jit(f)(x), want)
    assert not np.array_equal(want, x)  # FP8 did something
    log = collective_log.traced(f, x)
    (c,) = log.calls
    assert (c.op, c.kind, c.axes, c.result_shape) == ("pmax", "all-reduce", ("d", "t"), ())


def test_mode_none_is_the_identity_and_logs_nothing(mesh):
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    f = _shard_map(mesh, lambda x: fp8.quantized("none", "B/d M/t", x), P("d", "t"), P("d", "t"))
    np.testing.assert_array_equal(f(x), x)
    assert collective_log.traced(f, x).calls == []


def test_the_gradient_of_an_operand_passes_straight_through(mesh):
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    ct = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    f = _shard_map(mesh, lambda x: fp8.quantized("current", "B/d M/t", x), P("d", "t"), P("d", "t"))
    _, pull = jax.vjp(f, x)
    np.testing.assert_array_equal(pull(ct)[0], ct)


def test_a_cotangent_goes_on_e5m2s_grid_at_its_whole_scale(mesh):
    rng = np.random.default_rng(3)
    y = rng.standard_normal((4, 8)).astype(np.float32)
    ct = (rng.standard_normal((4, 8)) * 1e-4).astype(np.float32)
    ct[3, 1] = 2e-2
    f = _shard_map(
        mesh, lambda y: fp8.gradient_quantized("current", "B/d M/t", y), P("d", "t"), P("d", "t")
    )
    out, pull = jax.vjp(f, y)
    np.testing.assert_array_equal(out, y)  # the forward is untouched
    got = pull(ct)[0]
    np.testing.assert_array_equal(got, fp8.cotangent_on_grid("current", "B M", jnp.asarray(ct)))
    _, local_pull = jax.vjp(functools.partial(fp8.local_gradient_quantized, "current"), y)
    np.testing.assert_array_equal(got, local_pull(ct)[0])
    assert len(np.unique(np.abs(got) / np.max(np.abs(got)))) < len(np.unique(np.abs(ct)))
    # The backward rule logs its pmax in the backward phase.
    log = collective_log.traced(lambda y: pull(y)[0], ct)
    assert [(c.op, c.phase, c.axes) for c in log.calls] == [("pmax", "backward", ("d", "t"))]


def test_gradients_are_finite_at_a_zero_amax_and_past_the_range(mesh):
    def both(x):
        return fp8.gradient_quantized("current", "B/d M/t", fp8.quantized("current", "B/d M/t", x))

    f = _shard_map(mesh, both, P("d", "t"), P("d", "t"))
    zeros = np.zeros((4, 8), np.float32)
    out, pull = jax.vjp(f, zeros)
    np.testing.assert_array_equal(out, zeros)
    np.testing.assert_array_equal(pull(zeros)[0], zeros)
    huge = np.full((4, 8), 3e38, np.float32)
    huge[0, 0] = np.inf  # the amax overflows: scale 1, every value saturates
    out, pull = jax.vjp(f, huge)
    assert np.all(np.isfinite(out)) and np.all(np.abs(out) == E4M3_MAX)
    grad = pull(huge)[0]
    assert np.all(np.isfinite(grad)) and np.all(np.abs(grad) == E5M2_MAX)


def test_a_weight_is_gathered_as_e4m3_bits(mesh):
    """FSDP's gather of w 'M/d F/t' as e4m3 (one byte an element, logged as such) at the whole
    weight's scale: the single-device value; its gradient is the plain gather's (a reduce-
    scatter in the cotangent's dtype, logged by the backward rule)."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((8, 16)).astype(np.float32)

    def gathered(mode, w):  # each d shard's copy, along a leading dimension
        return fp8.gather_quantized(mode, "M/d F/t -> M F/t", w, jnp.float32)[None]

    f = _shard_map(mesh, functools.partial(gathered, "current"), P("d", "t"), P("d", None, "t"))
    want = fp8.local_weight_quantized("current", jnp.asarray(w), jnp.float32)
    np.testing.assert_array_equal(jax.jit(f)(w), np.stack([want, want]))
    log = collective_log.traced(f, w)
    gather = [c for c in log.calls if c.kind == "all-gather"]
    assert [(c.dtype, c.result_bytes) for c in gather] == [("float8_e4m3fn", 8 * 4)]
    assert all(c.weight for c in log.calls)  # the amax's pmax counts as the weight's
    assert collective_log.transpose(gather[0]) is None  # the bits carry no gradient

    def loss(mode, w):
        ct = jnp.asarray(rng.standard_normal((2, 8, 16)), jnp.float32)
        g = _shard_map(mesh, functools.partial(gathered, mode), P("d", "t"), P("d", None, "t"))
        return jnp.sum(g(w) * lax.stop_gradient(ct))

    rng = np.random.default_rng(5)
    want_grad = jax.grad(functools.partial(loss, "none"))(w)
    rng = np.random.default_rng(5)
    np.testing.assert_array_equal(jax.grad(functools.partial(loss, "current"))(w), want_grad)
    with collective_log.recording() as log:
        jax.eval_shape(jax.grad(functools.partial(loss, "current")), w)
    back = [c for c in log.calls if c.phase == "backward"]
    assert [(c.kind, c.axes, c.dtype) for c in back] == [("reduce-scatter", ("d",), "float32")]


def test_hlo_fp8_types_are_counted_at_one_byte():
    gather = Collective("all-gather", "f8e4m3fn[8,4]{1,0}", "", group_size=4)
    assert gather.result_shapes == [(8, 4)] and gather.result_bytes == 32
    scatter = Collective("reduce-scatter", "f8e5m2[2,4]{1,0}", "", group_size=4)
    assert scatter.result_bytes == 8
