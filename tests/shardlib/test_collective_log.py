"""seqshard.shardlib.collective_log: what shardops log while tracing, and autodiff's transposes of it,
held against the collectives XLA compiles (seqshard.shardlib.comms), with check_vma on and off."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqshard.shardlib import collective_log, shardops
from seqshard.shardlib.comms import collectives
from seqshard.shardlib.shardtypes import f32, typed_shard_map
from seqshard.testing import fake_cpu_mesh

B, M, F = 8, 16, 8


def _block(mesh, check_vma: bool):
    """gather x over t and w over d, a local einsum, and a psum over t of its partial sums."""

    @functools.partial(typed_shard_map, mesh=mesh, check_vma=check_vma)
    def block(x: f32[b"B/d M/t"], w: f32[b"M/d F/t"]) -> f32[b"B/d"]:
        with collective_log.part("proj"):
            gx = shardops.all_gather("B/d M/t -> B/d M", x)
            gw = shardops.all_gather("M/d F/t -> M F/t", w)
        y = shardops.einsum_unreduced("B/d M, M F/t -> B/d F/t", gx, gw)
        return shardops.psum("B/d{U_t} -> B/d", jnp.sum(y, axis=-1))

    return block


def _args():
    x = jax.ShapeDtypeStruct((B, M), jnp.float32)
    w = jax.ShapeDtypeStruct((M, F), jnp.float32)
    return x, w


def test_each_op_logs_the_collective_it_emits():
    block = _block(fake_cpu_mesh((2, 4), ("d", "t")), check_vma=True)
    log = collective_log.traced(block, *_args())
    got = [(c.op, c.kind, c.axes, c.group_size, c.operand_shape, c.result_shape) for c in log.calls]
    assert got == [
        ("all_gather", "all-gather", ("t",), 4, (4, 4), (4, 16)),
        ("all_gather", "all-gather", ("d",), 2, (8, 2), (16, 2)),
        ("psum", "all-reduce", ("t",), 4, (4,), (4,)),
    ]
    assert [c.part for c in log.calls] == ["proj", "proj", None]
    assert [c.weight for c in log.calls] == [False, True, False]
    assert all(c.phase == "forward" and c.dtype == "float32" and c.checked for c in log.calls)
    assert log.calls[0].result_bytes == 4 * 16 * 4
    # Outside recording() nothing is logged; traced() traces again (no cached trace).
    jax.eval_shape(block, *_args())
    assert collective_log.traced(block, *_args()).calls == log.calls


def test_axes_of_size_one_log_nothing():
    block = _block(fake_cpu_mesh((8, 1), ("d", "t")), check_vma=True)
    log = collective_log.traced(block, *_args())
    assert [(c.kind, c.axes) for c in log.calls] == [("all-gather", ("d",))]


def test_scans_multiply_calls_and_phases_label_them():
    mesh = fake_cpu_mesh((2, 4), ("d", "t"))

    @functools.partial(typed_shard_map, mesh=mesh)
    def stacked(x: f32[b"B/d M/t"]) -> f32[b"B/d M/t"]:
        def body(x, _):
            g = shardops.all_gather("B/d M/t -> B/d M", x)
            return shardops.psum_scatter("B/d M{U_t} -> B/d M/t", g), None

        with collective_log.phase("backward"):
            return collective_log.scan("layers", body, x, None, length=3)[0]

    log = collective_log.traced(stacked, jax.ShapeDtypeStruct((B, M), jnp.float32))
    assert [(c.kind, c.loops, c.calls, c.phase) for c in log.calls] == [
        ("all-gather", (("layers", 3),), 3, "backward"),
        ("reduce-scatter", (("layers", 3),), 3, "backward"),
    ]
    with pytest.raises(ValueError, match="phase must be"):
        collective_log.phase("sideways")


def test_operands_say_whether_a_rerun_reads_the_same_value():
    """A scanned body's inputs log 'input', values marked saved() 'saved', others nothing."""
    mesh = fake_cpu_mesh((2, 4), ("d", "t"))

    @functools.partial(typed_shard_map, mesh=mesh)
    def stacked(x: f32[b"B/d M/t"]) -> f32[b"B/d M/t"]:
        def body(x, _):
            y = 2 * x
            collective_log.saved(y)
            for value in (x, y, 3 * x):
                g = shardops.all_gather("B/d M/t -> B/d M", value)
            return shardops.psum_scatter("B/d M{U_t} -> B/d M/t", g), None

        return collective_log.scan("layers", body, x, None, length=2)[0]

    log = collective_log.traced(stacked, jax.ShapeDtypeStruct((B, M), jnp.float32))
    assert [c.operand for c in log.calls] == ["input", "saved", "", ""]


def _compiled_backward(block, mesh) -> collections.Counter:
    """The backward-phase collectives of the compiled gradient of ``sum(block(x, w) * c)``:
    (kind, axes) -> count. The weights ``c`` make the cotangent depend on an input: of a
    constant cotangent (``sum(block(x, w))``) XLA can prove every device holds the same
    value, and folds an all-reduce of it into a multiply by the group size."""
    x, w = (np.ones(s.shape, np.float32) for s in _args())
    c = np.arange(B, dtype=np.float32)
    grad = jax.jit(jax.grad(lambda x, w, c: jnp.sum(block(x, w) * c), argnums=(0, 1)))
    hlo = grad.lower(x, w, c).compile().as_text()
    return collections.Counter(
        (c.kind, c.axes) for c in collectives(hlo, mesh) if c.phase == "backward"
    )


@pytest.mark.parametrize("check_vma", [True, False])
def test_transposes_are_what_autodiff_compiles(check_vma):
    """all_gather <-> reduce-scatter; psum: nothing with check_vma=True, an all-reduce with
    check_vma=False (JAX then cannot tell the cotangent is invariant)."""
    mesh = fake_cpu_mesh((2, 4), ("d", "t"))
    block = _block(mesh, check_vma)
    log = collective_log.traced(block, *_args())
    backward = [collective_log.transpose(c) for c in log.calls]
    predicted = collections.Counter((b.kind, b.axes) for b in backward if b is not None)
    expected = {("reduce-scatter", ("t",)): 1, ("reduce-scatter", ("d",)): 1}
    if not check_vma:
        expected[("all-reduce", ("t",))] = 1
    assert predicted == expected
    assert _compiled_backward(block, mesh) == predicted
    gathered_x = backward[0]
    assert (gathered_x.operand_shape, gathered_x.result_shape) == ((4, 16), (4, 4))
    assert gathered_x.phase == "backward"
