"""seqshard.shardlib.collective_order: a collective that may overtake a loop's collectives, found in
compiled HLO, and seqshard.shardlib.dataflow.after, which orders it behind the loop. (Filed
under collective_order.py, the main one; spmd.py's own tests: tests/model/pipeline/test_spmd.py.)

hlo         hand-written modules: a loop of collectives then an independent collective is
            found; one that reads the loop's result (through other instructions), a loop
            without collectives, and collectives in a loop's callees are told apart
compiled    a shard_map with two independent scans of psums is found; with after() making
            the second read the first it is not, and the values are unchanged (NaN included)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from seqshard.shardlib.collective_order import Unordered, unordered_after_loops
from seqshard.shardlib.dataflow import after
from seqshard.testing import compiled_hlo, fake_cpu_mesh

_MODULE = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4] get-tuple-element(%t), index=1
  %r = f32[4] all-reduce(%x), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  ROOT %o = (s32[], f32[4]) tuple(%i, %r)
}

%quiet (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]) parameter(0)
  %x = f32[4] get-tuple-element(%t), index=1
  %n = f32[4] negate(%x)
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %o = (s32[], f32[4]) tuple(%i, %n)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: f32[4], y: f32[4]) -> (f32[4], f32[4]) {
  %x = f32[4] parameter(0)
  %y = f32[4] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]) tuple(%zero, %x)
  %loop = (s32[], f32[4]) while(%init), condition=%cond, body=%BODY
  %out = f32[4] get-tuple-element(%loop), index=1
  %later = f32[4] LATER
  ROOT %root = (f32[4], f32[4]) tuple(%out, %later)
}
"""


def _module(body: str, later: str) -> str:
    return _MODULE.replace("%BODY", body).replace("LATER", later)


REDUCE = "all-reduce({}), channel_id=2, replica_groups={{0,1}}, to_apply=%add"


def test_a_collective_that_does_not_read_the_loop_is_found():
    found = unordered_after_loops(_module("%body", REDUCE.format("%y")))
    assert found == [Unordered("main", "loop", "later", "all-reduce")]


def test_one_that_reads_the_loop_through_other_instructions_is_not():
    assert unordered_after_loops(_module("%body", REDUCE.format("%out"))) == []


def test_a_loop_without_collectives_orders_nothing():
    assert unordered_after_loops(_module("%quiet", REDUCE.format("%y"))) == []


def test_a_later_loop_of_collectives_counts_as_a_collective():
    later = "(s32[], f32[4]) while(%init), condition=%cond, body=%body"
    module = _module("%body", later).replace("%later = f32[4]", "%later =")
    assert unordered_after_loops(module) == [Unordered("main", "loop", "later", "while")]


# -- a compiled program -----------------------------------------------------------------------


@functools.cache
def _mesh():
    return fake_cpu_mesh((2,), ("d",))


def _program(ordered: bool):
    """Per device: two scans of psums over d, on x and on y, independent (one of them comes
    first, and the other may overtake its psums) unless ``after`` makes the second read the
    first's result."""

    def psums(c):
        def step(c, _):
            return lax.pcast(lax.psum(c, "d"), "d", to="varying") * 0.5, None

        return lax.scan(step, c, None, length=3)[0]

    def body(x, y):
        a = psums(x)
        return a, psums(after(y, a) if ordered else y)

    spec = jax.sharding.PartitionSpec("d")
    return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(spec, spec), out_specs=spec))


@pytest.mark.parametrize("ordered", [False, True])
def test_after_puts_the_collective_behind_the_loop_and_changes_no_value(ordered):
    x = jnp.arange(8.0)
    y = jnp.array([1.0, jnp.nan, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    program = _program(ordered)
    found = unordered_after_loops(compiled_hlo(program, x, y))
    assert (found == []) == ordered, found
    _, got = program(x, y)
    want = y.reshape(2, 4).sum(0) / 2  # each psum's sum of the two halves, halved
    np.testing.assert_array_equal(np.asarray(got), np.tile(want, 2))
    assert np.isnan(got[1]) and np.isnan(got[5])


def test_after_refuses_a_dependency_that_would_change_the_values_type():
    def body(x):
        return after(lax.psum(x, "d"), x)  # replicated over d, its dependency is not

    spec = jax.sharding.PartitionSpec("d")
    program = jax.shard_map(body, mesh=_mesh(), in_specs=spec, out_specs=spec)
    with pytest.raises(ValueError, match=r"varies over mesh axes \['d'\]"):
        jax.eval_shape(program, jnp.zeros(8))
