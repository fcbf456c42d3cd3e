"""Pipelined execution over mesh axis p, per device inside a shard_map (one SPMD program).

Each stage holds its layer blocks (``'layers/p ...'``: stage s the s-th contiguous block, or
for the circular schedule blocks s, s + p, ...) and runs the ticks of
:mod:`seqshard.model.pipeline.schedule` in a ``lax.scan``. What is in flight between stages is one
microbatch's activation per stage, ``'S/p ...'`` with S = p: each tick every stage applies its
block to its own, then one ``shardops.ring_shift`` over p hands it to the next stage (and,
for 1F1B, another hands cotangents back to the previous one).

    ys = circular_forward(stage_fn, blocks, xs)              # gpipe (v = 1) and circular
    loss, d_block, d_head, d_xs = one_f_one_b(stage_fn, head_fn, block, head, xs)

A stage may also return a value beside its activation that stays on the stage (an MoE
layer's routing statistics): ``circular_forward_with_aux`` and ``one_f_one_b_with_aux`` take
a ``stage_fn`` returning ``(y, aux)`` and return every task's aux, one per (round,
microbatch), kept where it was made (never shifted); 1F1B's backward of microbatch i gives
the stage's aux the cotangent ``aux_cotangent(i)`` (the loss reads it directly).

``circular_forward`` is differentiated by JAX: the transpose of the scan runs the ticks in
reverse and each forward ring_shift's transpose is the shift back, which is GPipe's (and the
circular schedule's) backward. ``one_f_one_b`` writes its backward itself: each tick one
forward and one backward per stage, the backward a ``jax.vjp`` of the stage's block on the
input it stashed at that microbatch's forward (so the stage's forward runs twice, as under
full rematerialization), keeping at most 2(p - s) - 1 stashed inputs on stage s.

Ticks where a stage has no task compute on whatever they hold and their results are masked:
the SPMD program is the same on every stage; a masked result never reaches a kept one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from seqshard.shardlib import collective_log, shardops
from seqshard.shardlib.dataflow import after, varying_over_stages
from seqshard.shardlib.shapecheck import shape_scope

__all__ = [
    "circular_forward",
    "circular_forward_with_aux",
    "one_f_one_b",
    "one_f_one_b_with_aux",
]

StageFn = Callable[[Any, jax.Array, jax.Array], jax.Array]
"""``stage_fn(block, x, i) -> y``: one stage's layer block on microbatch ``i``'s activation
(``i`` a traced int32: positions and masks differ between microbatches); y has x's shape."""


def _shift(x: jax.Array, offset: int) -> jax.Array:
    """One microbatch's block ``'S/p ...'`` to the stage ``offset`` along the ring over p."""
    # The leading dim is the microbatch's rows: B (an activation, not a weight's gather, to
    # the collective log), its size that of one microbatch (a scope of its own).
    spec = "S/p B" + "".join(f" X{k}" for k in range(1, x.ndim))
    with shape_scope():
        return shardops.ring_shift(spec, x[None], "p", offset)[0]


def _put(buffer: jax.Array, i: jax.Array, x: jax.Array, when: jax.Array) -> jax.Array:
    """``buffer`` with row ``i`` set to ``x`` where ``when``, else unchanged."""
    return jnp.where(when, lax.dynamic_update_index_in_dim(buffer, x, i, 0), buffer)


AuxStageFn = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]
"""``stage_fn(block, x, i) -> (y, aux)``: a :data:`StageFn` that also returns ``aux``, a
pytree the stage keeps (it is not handed to the next stage)."""


def _with_no_aux(stage_fn: StageFn) -> AuxStageFn:
    return lambda block, x, i: (stage_fn(block, x, i), None)


def _stage_of_round(stage_fn: AuxStageFn, blocks: Any, r: jax.Array, x: jax.Array, i: jax.Array):
    """``stage_fn`` on round ``r``'s block. With one block it is the loop-invariant ``blocks``
    itself; with several, the indexing is rematerialized: either way the backward of the tick
    loop keeps no per-tick copy of the stage's weights."""
    if jax.tree.leaves(blocks)[0].shape[0] == 1:
        return stage_fn(jax.tree.map(lambda b: b[0], blocks), x, i)

    def indexed(blocks, r, x, i):
        block = jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, r, keepdims=False), blocks)
        return stage_fn(checkpoint_name(block, _BLOCK), x, i)

    policy = jax.checkpoint_policies.save_anything_except_these_names(_BLOCK)
    return jax.checkpoint(indexed, policy=policy, prevent_cse=False)(blocks, r, x, i)


_BLOCK = "pipeline_stage_block"


def circular_forward(stage_fn: StageFn, blocks: Any, xs: jax.Array) -> jax.Array:
    """:func:`circular_forward_with_aux` of a stage that returns its activation alone: ys."""
    return circular_forward_with_aux(_with_no_aux(stage_fn), blocks, xs, None)[0]


def circular_forward_with_aux(
    stage_fn: AuxStageFn, blocks: Any, xs: jax.Array, aux_like: Any
) -> tuple[jax.Array, Any]:
    """The pipelined forward of every microbatch ``xs[i]`` through all stages' blocks.

    ``blocks``: this stage's v layer blocks (a pytree of arrays with leading dim v; v = 1 is
    GPipe); ``stage_fn(block, x, i) -> y`` of x's shape. ``xs: [m, ...]``, read on stage 0.
    Returns ``[m, ...]``: the outputs of the last block, on stage p - 1 (zeros elsewhere).
    Microbatch i's round r is on stage s at tick r·m + i + s (v > 1 needs m >= p).

    ``stage_fn`` returns ``(y, aux)``; ``aux_like`` is a pytree of zeros shaped as one aux
    (None: none). Also returns this stage's auxs ``[v·m, ...]``: round r of microbatch i at
    r·m + i (the ticks a stage idles leave zeros)."""
    p, s = shardops.axis_size("p"), shardops.axis_index("p")
    v = jax.tree.leaves(blocks)[0].shape[0]
    m = xs.shape[0]
    if v > 1 and m < p:
        raise ValueError(f"the circular schedule needs m >= p microbatches, got m={m}, p={p}.")
    zeros = jnp.zeros_like(xs[0])

    def tick(carry, t):
        held, returned, ys, auxs = carry
        j = t - s  # this stage's task: round j // m of microbatch j % m
        valid = (j >= 0) & (j < v * m)
        jc = jnp.clip(j, 0, v * m - 1)
        r, i = jc // m, jc % m
        first = lax.dynamic_index_in_dim(xs, i, keepdims=False)
        again = lax.dynamic_index_in_dim(returned, i, keepdims=False)
        x = jnp.where(s == 0, jnp.where(r == 0, first, again), held)
        y, aux = _stage_of_round(stage_fn, blocks, r, x, i)
        y = jnp.where(valid, y, 0)
        ys = _put(ys, i, y, valid & (s == p - 1) & (r == v - 1))
        auxs = jax.tree.map(lambda acc, a: _put(acc, jc, a, valid), auxs, aux)
        arrived = _shift(y, 1)
        # Stage 0 keeps what the last stage finished for its next round: that task was t-(p-1).
        back = t - (p - 1)
        returned = _put(returned, back % m, arrived, (s == 0) & (back >= 0) & (back < (v - 1) * m))
        return (arrived, returned, ys, auxs), None

    auxs = jax.tree.map(lambda a: jnp.zeros((v * m, *a.shape), a.dtype), aux_like)
    init = varying_over_stages((zeros, jnp.zeros_like(xs), jnp.zeros_like(xs), auxs))
    (_, _, ys, auxs), _ = collective_log.scan("ticks", tick, init, jnp.arange(v * m + p - 1))
    return ys, auxs


def one_f_one_b(
    stage_fn: StageFn,
    head_fn: Callable[[Any, jax.Array, jax.Array], jax.Array],
    block: Any,
    head: Any,
    xs: jax.Array,
) -> tuple[jax.Array, Any, Any, jax.Array]:
    """:func:`one_f_one_b_with_aux` of a stage that returns its activation alone."""
    out = one_f_one_b_with_aux(_with_no_aux(stage_fn), head_fn, block, head, xs, None, None)
    return out[:4]


def one_f_one_b_with_aux(
    stage_fn: AuxStageFn,
    head_fn: Callable[[Any, jax.Array, jax.Array], jax.Array],
    block: Any,
    head: Any,
    xs: jax.Array,
    aux_like: Any,
    aux_cotangent: Callable[[jax.Array], Any] | None,
    head_aux_like: Any = None,
) -> tuple[jax.Array, Any, Any, jax.Array, Any, Any]:
    """1F1B: (the loss summed over microbatches, this stage's block's gradient, the head's
    gradient, the gradient of each microbatch input ``[m, ...]``).

    ``head_fn(head, y, i) -> f32[]``: microbatch i's loss from the last block's output, with
    the head's own weights ``head`` (run on the last stage). Microbatch i's forward is on stage
    s at tick i + s, its backward at tick i + 2(p-1) - s. Only the last stage's loss and head
    gradient and stage 0's input gradients are non-zero (zeros elsewhere): the caller sums
    over p what it needs replicated.

    ``stage_fn`` returns ``(y, aux)`` (``aux_like``: zeros shaped as one aux, or None); the
    backward of microbatch i differentiates the loss plus whatever the caller adds of its aux,
    whose gradient is ``aux_cotangent(i)`` (a pytree like aux). Also returns this stage's
    auxs ``[m, ...]``, one per microbatch, as its forward made them.

    ``head_aux_like`` (zeros shaped as one, or None): ``head_fn`` returns ``(loss, aux)``,
    its aux reported, not differentiated; the last returned value is each microbatch's
    ``[m, ...]`` (on the last stage; zeros elsewhere), or None."""
    p, s = shardops.axis_size("p"), shardops.axis_index("p")
    m = xs.shape[0]
    slots = min(m, 2 * p - 1)  # the most inputs a stage holds (stage 0)
    # Per stage: a weight replicated over p would have its per-stage gradients summed over p
    # by autodiff inside every tick (the idle stages' too).
    block, head = varying_over_stages((block, head))
    last = s == p - 1

    def tick(carry, t):
        held, cotangent, stash, loss, d_block, d_head, d_xs, auxs, head_auxs = carry
        i = t - s
        forward = (i >= 0) & (i < m)
        ic = jnp.clip(i, 0, m - 1)
        x = jnp.where(s == 0, lax.dynamic_index_in_dim(xs, ic, keepdims=False), held)
        stash = _put(stash, ic % slots, x, forward)
        with collective_log.hand_differentiated():  # its backward is the vjp below
            y, aux = stage_fn(block, x, ic)
        auxs = jax.tree.map(lambda acc, a: _put(acc, ic, a, forward), auxs, aux)
        b = t - 2 * (p - 1) + s
        backward = (b >= 0) & (b < m)
        bc = jnp.clip(b, 0, m - 1)
        # The tick runs in one order on every device: forward, head, shift forward, backward,
        # shift back, each reading what the one before made (:func:`after`).
        # On the last stage the backward is of the microbatch it just ran forward (b == i).
        counts = last & backward
        if head_aux_like is None:
            value, (d_h, d_y) = jax.value_and_grad(head_fn, argnums=(0, 1))(head, y, bc)
        else:
            grad = jax.value_and_grad(head_fn, argnums=(0, 1), has_aux=True)
            (value, head_aux), (d_h, d_y) = grad(head, y, bc)
            head_auxs = jax.tree.map(
                lambda acc, a: _put(acc, bc, lax.stop_gradient(a), counts), head_auxs, head_aux
            )
        loss = loss + jnp.where(counts, value, 0.0)
        d_head = jax.tree.map(lambda acc, g: acc + jnp.where(counts, g, 0), d_head, d_h)
        sent = _shift(after(y, value, d_h, d_y), 1)
        g = jnp.where(last, d_y, cotangent)
        x_b = after(lax.dynamic_index_in_dim(stash, bc % slots, keepdims=False), sent)
        _, vjp = jax.vjp(lambda w, h: stage_fn(w, h, bc), block, x_b)
        d_aux = None if aux_cotangent is None else varying_over_stages(aux_cotangent(bc))
        d_aux = jax.tree.map(lambda a: jnp.where(backward, a, 0), d_aux)
        d_w, d_x = vjp((jnp.where(backward, g, 0), d_aux))
        d_block = jax.tree.map(jnp.add, d_block, d_w)
        d_xs = _put(d_xs, bc, d_x, backward & (s == 0))
        carry = (sent, _shift(d_x, -1), stash, loss, d_block, d_head, d_xs, auxs, head_auxs)
        return carry, None

    zeros = jnp.zeros_like(xs[0])
    init = varying_over_stages(
        (
            zeros,
            zeros,
            jnp.broadcast_to(zeros, (slots, *xs.shape[1:])),
            jnp.zeros((), jnp.float32),
            jax.tree.map(jnp.zeros_like, block),
            jax.tree.map(jnp.zeros_like, head),
            jnp.zeros_like(xs),
            jax.tree.map(lambda a: jnp.zeros((m, *a.shape), a.dtype), aux_like),
            jax.tree.map(lambda a: jnp.zeros((m, *a.shape), a.dtype), head_aux_like),
        )
    )
    ticks = jnp.arange(m + 2 * (p - 1))
    (_, _, _, loss, d_block, d_head, d_xs, auxs, head_auxs), _ = collective_log.scan(
        "ticks", tick, init, ticks
    )
    return loss, d_block, d_head, d_xs, auxs, head_auxs
