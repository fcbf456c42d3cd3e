"""seqshard/shardlib/newton_schulz.py: the iteration makes matrices about orthogonal, as
optax.contrib.muon's does; on sharded stacks (d, t, d x t, layers that do not divide) it equals
the single-device iteration, two all_to_alls each way."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from seqshard.shardlib import collective_log
from seqshard.shardlib.newton_schulz import newton_schulz, orthogonalized
from seqshard.testing import fake_cpu_mesh

RNG = np.random.default_rng(0)
STACK = RNG.standard_normal((3, 16, 32)).astype(np.float32)  # 3 layers of 16 x 32


@pytest.mark.parametrize("shape", [(16, 32), (32, 16)])
def test_singular_values_come_out_near_one(shape):
    """Muon's quintic pushes every singular value into about [0.68, 1.13] in 5 steps."""
    g = RNG.standard_normal(shape).astype(np.float32)
    s = np.linalg.svd(np.asarray(newton_schulz(jnp.asarray(g))), compute_uv=False)
    assert s.min() > 0.6 and s.max() < 1.2
    u, _, vt = np.linalg.svd(g, full_matrices=False)
    assert np.abs(np.asarray(newton_schulz(jnp.asarray(g))) - u @ vt).max() < 0.35


def test_a_muon_step_of_optax_is_this_iteration():
    """optax.contrib.muon with lr 1, no momentum and no decay moves a matrix by its gradient's
    iteration times a shape factor: the same directions, entry for entry."""
    g = RNG.standard_normal((16, 32)).astype(np.float32)
    opt = optax.contrib.muon(1.0, beta=0.0, nesterov=False, weight_decay=0.0)
    params = {"w": jnp.zeros((16, 32))}
    updates, _ = opt.update({"w": jnp.asarray(g)}, opt.init(params), params)
    ours = np.asarray(newton_schulz(jnp.asarray(g)))
    ratio = -np.asarray(updates["w"]) / ours
    np.testing.assert_allclose(ratio, ratio.flat[0], rtol=1e-4)


@pytest.mark.parametrize(
    "mesh_shape, spec, pspec",
    [
        ((2, 4), "S M/d F/t", P(None, "d", "t")),
        ((8, 1), "S M/d F", P(None, "d", None)),
        ((1, 8), "S M F/t", P(None, None, "t")),
        ((4, 2), "S M/t/d F", P(None, ("t", "d"), None)),
    ],
    ids=["d2t4", "d8", "t8", "rows-t-then-d"],
)
def test_sharded_equals_the_single_device_iteration(mesh_shape, spec, pspec):
    """3 layers on 2 to 8 devices: padded to a multiple, whole matrices per device, cut back."""
    mesh = fake_cpu_mesh(mesh_shape, ("d", "t"))
    f = jax.shard_map(
        functools.partial(orthogonalized, spec),
        mesh=mesh,
        in_specs=pspec,
        out_specs=pspec,
    )
    want = np.asarray(newton_schulz(jnp.asarray(STACK)))
    np.testing.assert_allclose(np.asarray(jax.jit(f)(STACK)), want, rtol=1e-5, atol=1e-5)
    log = collective_log.traced(f, STACK)
    kinds = [c.kind for c in log.calls]
    moves = 2 if "/" in spec.split()[1] and "/" in spec.split()[2] else 1
    assert kinds == ["all-to-all"] * (2 * moves)


def test_far_wider_matrices_keep_their_columns_split_and_all_reduce_the_gram():
    """4 x 256 matrices, columns over t = 4 (64 each): 5 steps x 4 rows < 64, so moving the
    columns would send more than five 4 x 4 all-reduces: the Gram is summed over t instead,
    only the rows move (over d), and the result is the single-device iteration's."""
    wide = RNG.standard_normal((3, 4, 256)).astype(np.float32)
    mesh = fake_cpu_mesh((2, 4), ("d", "t"))
    pspec = P(None, "d", "t")
    f = jax.shard_map(
        functools.partial(orthogonalized, "S M/d F/t"), mesh=mesh, in_specs=pspec, out_specs=pspec
    )
    want = np.asarray(newton_schulz(jnp.asarray(wide)))
    np.testing.assert_allclose(np.asarray(jax.jit(f)(wide)), want, rtol=1e-5, atol=1e-5)
    calls = [(c.kind, c.axes) for c in collective_log.traced(f, wide).calls]
    gram = [("all-reduce", ("t",))] * 6  # the norm, then one per step
    assert calls == [("all-to-all", ("d",)), *gram, ("all-to-all", ("d",))]
