"""The model pipelined over mesh axis p: stages of the layer stack, microbatches between them.

With ``mesh.p > 1`` the stacked layers rest split over p (``layers: Array['layers/p', Layer]``:
stage s holds layers s·L/p to (s+1)·L/p - 1; under the circular schedule, its v blocks of
L/(p·v) layers are the model's blocks s, s + p, ..., in the order
:meth:`~seqshard.model.pipeline.schedule.Pipeline.layer_order` gives, which checkpoints record and
restores convert) and one call runs the local batch as
``train.microbatches`` microbatches through the stages, in the ticks of
:mod:`seqshard.model.pipeline.schedule`, inside the model's one shard_map (per device)::

    rows = sequence_rows(tokens)                      'B/dp L@zigzag/c', every stage
    xs = embed(rows.tokens) as 'm b ...'              the residual, read on stage 0
    ys = circular_forward(stage, layers, xs)          stage s: run_stack on its block, then
                                                      ring_shift('S/p B/dp L@zigzag/c/t M', ., 'p')
    terms = head(ys) on stage p-1; psum('2{U_p} -> 2')   f32[2]: loss sum, positions counted

Microbatch i is local rows i, i + m, i + 2m, ...: the rows ``split_microbatches`` gives
gradient accumulation (which runs at p = 1), so both sum the same terms.

**Where the embedding and the head sit.** ``embed``, ``final_norm`` and ``unembed`` name no p
in their types: they rest replicated over p (each stage a copy, still split over d, e, c and t).
Stage 0 embeds, stage p-1 runs the norm, the unembedding and the loss; their gradients, made on
one stage, are summed over p once per step (``psum('V/t M/fsdp{U_p} -> V/t M/fsdp')`` and the
norm's, written out in both schedules). They are small next to L/p layers per stage, and
splitting them over p would gather them across the pipeline's (slow) links every step.

**Backward.** ``gpipe`` and ``circular``: JAX differentiates the tick scan (each shift's transpose is the shift
back). ``1f1b`` (:func:`seqshard.model.pipeline.spmd.one_f_one_b`): a ``custom_vjp`` whose forward
runs the interleaved forward and backward ticks and keeps the gradients; its backward scales
them by the loss's cotangent. Within a stage, the layers' backward is the hand-written one of
:mod:`seqshard.model.backward` under ``model.backward=explicit`` (a ``custom_vjp`` over the
stage's layer scan: :func:`~seqshard.model.backward.explicit_run_stack`), else autodiff's,
each layer under ``cfg.remat``. The embedding and the head are differentiated by autodiff.

The SPMD program is the same on every stage: a stage's idle ticks compute on zeros and are
masked, and every stage runs the embedding and the head (their results are masked on the
stages that do not own them).

**One stack, any block kinds.** The stages run the model's one layer stack
(:func:`~seqshard.model.layers.stacks`): a model with experts pipelines its MoE stack
(``moe_layers: 'moe_layers/p'``) as a dense model its layers, and needs
``model.moe.n_dense_layers = 0``: with two stacks split over p, stage s would run dense block
s before MoE block s, not every dense layer before every MoE layer (the model's order);
putting all dense layers on the first stages instead would make the stages' blocks differ in
kind and size, one SPMD program no longer fitting them all
(:meth:`~seqshard.model.config.ModelConfig.check_mesh_kinds` says so, with the fix). Each
stage keeps its layers' auxiliary outputs (:class:`~seqshard.model.block.Aux`: an MoE layer's
routing statistics) per microbatch (they never travel between stages); the loss adds each
microbatch's loss fields (every layer's aux + z) times its counted positions, each stage its
own layers' share, summed over p with the head's terms in the one psum; the outputs returned
are the step's (summed over the microbatches, ``mean`` fields their mean, as gradient
accumulation at p = 1 gives them), each stage's layers placed at their positions in the
stored stack and summed over p::

    terms = psum('2{U_p} -> 2', head terms on p-1 + this stage's sum_i count_i (aux + z)_i)
    aux = psum('G{U_p} -> G', this stage's layers' outputs at their positions, else 0)

1F1B's backward gives a stage's loss fields of microbatch i the cotangent ``count_i``
(:func:`~seqshard.model.pipeline.spmd.one_f_one_b_with_aux`); GPipe and circular
differentiate the sum by autodiff.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from seqshard.batch import TokenBatch
from seqshard.model.backward import explicit_run_stack
from seqshard.model.config import ModelConfig
from seqshard.model.context import SequenceRows, sequence_rows
from seqshard.model.layers import (
    MTP_STACK,
    Stack,
    aux_losses,
    mtp_stack,
    run_stack,
    stacks,
    zero_aux,
)
from seqshard.model.mtp import mtp_before_head, with_mtp
from seqshard.model.pipeline.schedule import Pipeline
from seqshard.model.pipeline.spmd import circular_forward_with_aux, one_f_one_b_with_aux
from seqshard.model.transformer import embed, final_norm, loss_terms_and_softmax, unembed
from seqshard.model.weights import Weights, weights_type
from seqshard.shardlib import collective_log, shardops
from seqshard.shardlib.dataflow import cotangent_after, varying_over_stages
from seqshard.shardlib.shapecheck import block_axes, block_axes_scope, shape_scope
from seqshard.shardlib.shardtypes import ArrayType, type_tree

__all__ = [
    "pipelined_terms_and_aux",
    "to_microbatches",
]


class _Head(NamedTuple):
    """The weights the last stage's head reads (``final_norm`` and ``unembed`` read these
    fields of a :class:`~seqshard.model.weights.Weights`); with ``model.mtp`` also the
    embedding and the multi-token prediction modules (:func:`~seqshard.model.mtp.mtp_loss`
    reads ``embed``, ``unembed`` and ``mtp``)."""

    final_norm: jax.Array
    unembed: jax.Array
    embed: jax.Array | None = None
    mtp: Any = None


class _Embed(NamedTuple):
    """The weight the first stage's embedding reads (``embed`` reads this field)."""

    embed: jax.Array


def to_microbatches(x: jax.Array, m: int) -> jax.Array:
    """Per-device rows 'B ...' -> 'm B/m ...': microbatch i holds rows i, i + m, ...
    (:func:`seqshard.batch.split_microbatches`'s rows, per device)."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def _microbatch(tree, i: jax.Array):
    """Microbatch ``i`` (traced) of a tree of 'm ...' arrays."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _head_terms(
    cfg: ModelConfig, head: _Head, y: jax.Array, rows: SequenceRows
) -> tuple[jax.Array, dict]:
    """One microbatch's f32[2] (summed loss, positions counted) from the last layer's output,
    the multi-token prediction modules' loss included, and their auxiliary outputs (empty
    without ``model.mtp``)."""
    with shape_scope():  # B is a microbatch's rows here
        return _head_terms_in_scope(cfg, head, y, rows)


def _head_terms_in_scope(cfg: ModelConfig, head: _Head, y: jax.Array, rows: SequenceRows):
    y, mtp, mtp_aux = mtp_before_head(cfg, head, rows, y)
    logits = unembed(cfg, head, final_norm(cfg, head, y))
    terms = loss_terms_and_softmax(logits, rows.targets, rows.counted)[0]
    return with_mtp(terms, mtp), mtp_aux


def _on_last_stage_summed(terms: jax.Array, own: jax.Array | None = None) -> jax.Array:
    """f32[2] made on stage p-1 (others: masked to 0), plus ``own`` (f32[2], each stage's:
    its layers' loss terms), summed over p: replicated."""
    p, s = shardops.axis_size("p"), shardops.axis_index("p")
    terms = jnp.where(s == p - 1, terms, 0.0)
    if own is not None:
        terms = terms + own
    return shardops.psum("2{U_p} -> 2", terms)


def pipelined_terms_and_aux(
    cfg: ModelConfig, pipe: Pipeline, w: Weights, batch: TokenBatch
) -> tuple[jax.Array, dict]:
    """(the loss terms f32[2], each microbatch's loss terms of the layers included; the step's
    auxiliary outputs in the stored stack's order, replicated), pipelined over p (see the
    module docstring)."""
    if pipe.schedule == "1f1b":
        return _with_one_f_one_b(cfg, pipe, w, batch)
    return _gpipe_terms(cfg, pipe, w, batch)


def _stack(cfg: ModelConfig) -> Stack:
    """The one stack the stages run (:meth:`~seqshard.model.config.ModelConfig.check_mesh_kinds`
    allows no other with p > 1)."""
    (stack,) = stacks(cfg)
    return stack


def _stages(cfg: ModelConfig, pipe: Pipeline, batch: TokenBatch):
    """(the rows, the rows as microbatches 'm b ...', the stage function ``(block, x, i) ->
    (y, the block's auxiliary outputs)``)."""
    rows = sequence_rows(batch.tokens, batch.is_seq_start, batch.loss_mask, cfg.mtp.depth)
    split = functools.partial(to_microbatches, m=pipe.microbatches)
    micro = jax.tree.map(split, rows._replace(ahead=None))
    if rows.ahead is not None:  # 'D B ...' -> 'm D b ...'
        ahead = jax.tree.map(lambda a: split(a.swapaxes(0, 1)).swapaxes(1, 2), rows.ahead)
        micro = micro._replace(ahead=ahead)
    run = explicit_run_stack if cfg.backward == "explicit" else run_stack
    stack = _stack(cfg)

    def stage(block, x, i):
        with shape_scope():  # B is a microbatch's rows here
            return run(cfg, stack, _microbatch(micro, i), x, block)

    return rows, micro, stage


def _block_aux_zeros(cfg: ModelConfig, blocks: int) -> dict:
    """Zeros shaped as one layer block's auxiliary outputs (the stack over ``blocks``
    blocks; empty without any)."""
    stack = _stack(cfg)
    n = stack.n_layers // blocks
    return jax.tree.map(lambda z: z[:n], zero_aux(cfg).get(stack.name, {}))


def _microbatch_counts(micro: SequenceRows) -> jax.Array:
    """f32[m]: each microbatch's positions counted (no gradient), over every device's rows."""
    local = jnp.sum(micro.counted.astype(jnp.float32), axis=tuple(range(1, micro.counted.ndim)))
    with shape_scope():
        # Each (d, e, c) shard counted its own rows: add them up.
        return shardops.psum("m{U_dp,c} -> m", local)


def _over_microbatches(aux, field: str):
    """How a block's auxiliary output ``field`` adds up over microbatches: its mean, its max,
    or (the rest) its sum."""
    return jnp.mean if field in aux.mean else jnp.max if field in aux.max else jnp.sum


def _balancing_and_stats(cfg: ModelConfig, aux: dict, counts: jax.Array):
    """From this stage's auxiliary outputs ``[v, m, b, ...]`` (round, microbatch, layer of the
    block): (f32[2], its layers' loss fields, each microbatch's times its counted positions,
    to add to the loss; the step's outputs, replicated: every stage's layers in the stored
    stack's order)."""
    stack = _stack(cfg)
    blocks = {b.name: b for b in stack.aux_blocks}
    losses = aux_losses(cfg, {stack.name: aux})  # per block with loss fields, [v, m, b]
    v, m, b = jax.tree.leaves(aux)[0].shape[:3]
    balancing = jnp.zeros((2,))
    if losses:
        # [m]: every layer's, summed
        per_microbatch = functools.reduce(jnp.add, [jnp.sum(x, axis=(0, 2)) for x in losses])
        balancing = jnp.stack([jnp.sum(counts * per_microbatch), jnp.zeros(())])
    # As gradient accumulation at p = 1 reports them: summed over the microbatches, the
    # ``mean`` fields their mean.
    step = {
        name: {
            f: _over_microbatches(block.aux, f)(values, axis=1) for f, values in aux[name].items()
        }
        for name, block in blocks.items()
    }
    # This stage holds stored positions s·v·b .. (s+1)·v·b - 1 (round r's block at r·b):
    # placed there in a zero stack, the others' zeros; one psum over p adds the stages'.
    step = jax.tree.map(lambda a: lax.stop_gradient(a.reshape(v * b, *a.shape[2:])), step)
    n, s = shardops.axis_size("p") * v * b, shardops.axis_index("p")
    leaves, tree = jax.tree.flatten(step)
    placed = [
        lax.dynamic_update_slice_in_dim(
            varying_over_stages(jnp.zeros((n, *a.shape[1:]), a.dtype)), a, s * v * b, 0
        ).reshape(-1)
        for a in leaves
    ]
    flat = jnp.concatenate(placed)
    with shape_scope():
        # Each stage filled its own layers' rows (zeros elsewhere): add the stages'.
        flat = shardops.psum("G{U_p} -> G", flat)
    out, start = [], 0
    for a in leaves:
        size = n * math.prod(a.shape[1:])
        out.append(flat[start : start + size].reshape(n, *a.shape[1:]))
        start += size
    return balancing, jax.tree.unflatten(tree, out)


def _embedded(cfg: ModelConfig, pipe: Pipeline, table: jax.Array, rows: SequenceRows):
    """Every microbatch's embedded input 'm b ...' (a residual each)."""
    x = embed(cfg, _Embed(table), rows.tokens)
    return to_microbatches(x, pipe.microbatches)


def _gpipe_terms(cfg: ModelConfig, pipe: Pipeline, w: Weights, batch: TokenBatch):
    """GPipe (and the 1F1B step's value when not differentiated): all forwards, then the
    head over the m outputs, one microbatch at a time (rematerialized: only ys are kept)."""
    rows, micro, stage = _stages(cfg, pipe, batch)
    # The replicated weights, made per stage before use: their gradients are summed over p
    # once, here, not by autodiff once per tick and microbatch.
    axes = block_axes()
    static = (tuple(axes.sizes.items()), axes.manual)
    table = _per_stage((_TABLE, "embed"), static, w.embed)
    head = _Head(
        _per_stage((_GAIN, "final_norm"), static, w.final_norm),
        _per_stage((_TABLE, "logits"), static, w.unembed),
        *_mtp_per_stage(cfg, static, table, w),
    )
    xs = _embedded(cfg, pipe, table, rows)
    # This stage's v layer blocks, one per round (circular; v = 1: gpipe).
    v = pipe.repeats if pipe.schedule == "circular" else 1
    layers = getattr(w, _stack(cfg).name)
    blocks = jax.tree.map(lambda b: b.reshape(v, b.shape[0] // v, *b.shape[1:]), layers)
    aux_like = _block_aux_zeros(cfg, shardops.axis_size("p") * v)
    ys, aux = circular_forward_with_aux(stage, blocks, xs, aux_like)
    per_microbatch = jax.checkpoint(functools.partial(_head_terms, cfg, head))

    def head(_, y_rows):
        return None, per_microbatch(*y_rows)

    _, (terms, head_aux) = collective_log.scan("head", head, None, (ys, micro))
    # The head's backward (a loop that recomputes it) reads these terms, so it runs after the
    # head's forward loop on every device (XLA's CPU runtime orders by data).
    terms = jnp.sum(cotangent_after(terms), axis=0)
    head_aux = _head_step_aux(cfg, head_aux)
    if not aux:
        return _on_last_stage_summed(terms), head_aux
    m = pipe.microbatches
    aux = jax.tree.map(lambda a: a.reshape(v, m, *a.shape[1:]), aux)  # round r·m + i
    balancing, step_aux = _balancing_and_stats(cfg, aux, _microbatch_counts(micro))
    return _on_last_stage_summed(terms, balancing), {_stack(cfg).name: step_aux, **head_aux}


_TABLE, _GAIN = "V/t M/fsdp", "M/t/fsdp"  # the replicated weights' per-device layouts


def _mtp_per_stage(cfg: ModelConfig, static, table: jax.Array, w: Weights) -> tuple:
    """(the embedding, the modules' weights) the last stage's multi-token prediction reads,
    per stage as the head's (each gradient summed over p once), or () without ``model.mtp``.
    ``table``: the embedding already made per stage (its gradient sums both uses)."""
    if cfg.mtp.depth == 0:
        return ()
    types = getattr(type_tree(weights_type(cfg)), MTP_STACK)
    layers = jax.tree.map(
        lambda t, a: _per_stage((str(t.shape), MTP_STACK), static, a),
        types,
        getattr(w, MTP_STACK),
        is_leaf=lambda x: isinstance(x, ArrayType),
    )
    return table, layers


def _head_step_aux(cfg: ModelConfig, head_aux: dict) -> dict:
    """The multi-token prediction modules' auxiliary outputs of the step from each
    microbatch's ``[m, ...]`` (made on the last stage): summed over the microbatches (``mean``
    fields their mean) as gradient accumulation reports them, replicated over p."""
    stack = mtp_stack(cfg)
    if stack is None:
        return {}
    means = {b.name: b.aux.mean for b in stack.aux_blocks}
    step = {
        name: {
            f: (jnp.mean if f in means[name] else jnp.sum)(lax.stop_gradient(v), axis=0)
            for f, v in fields.items()
        }
        for name, fields in head_aux[MTP_STACK].items()
    }
    p, s = shardops.axis_size("p"), shardops.axis_index("p")
    leaves, tree = jax.tree.flatten(step)
    flat = jnp.concatenate([jnp.where(s == p - 1, a, 0.0).reshape(-1) for a in leaves])
    with shape_scope():
        flat = shardops.psum("G{U_p} -> G", flat)  # the last stage's, on every stage
    out, start = [], 0
    for a in leaves:
        out.append(flat[start : start + a.size].reshape(a.shape))
        start += a.size
    return {MTP_STACK: jax.tree.unflatten(tree, out)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _per_stage(layout, axes, w: jax.Array) -> jax.Array:
    """A weight replicated over p, typed per stage (varying over p); its gradient, made on
    one stage, summed over p: ``psum(spec{U_p} -> spec)``. ``layout``: (its per-device spec,
    the model operation that uses it, for the collective log)."""
    return varying_over_stages(w)


def _per_stage_forward(layout, axes, w: jax.Array):
    return varying_over_stages(w), None


def _per_stage_backward(layout, axes, _, g: jax.Array):
    spec, used_by = layout
    sizes, manual = axes
    # Traced when JAX transposes the shard_map, after the body's scopes closed: reopen them.
    with (
        block_axes_scope(dict(sizes), manual),
        shape_scope(),
        collective_log.at(((), used_by)),
        collective_log.phase("backward"),
    ):
        return (shardops.psum(f"{spec}{{U_p}} -> {spec}", g),)


_per_stage.defvjp(_per_stage_forward, _per_stage_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _with_one_f_one_b(cfg, pipe, w, batch):
    # Not differentiated (eval): the forward ticks alone: (terms, auxiliary outputs), the
    # outputs reported, not differentiated (their loss fields reach the gradient through the
    # terms).
    with collective_log.custom_vjp_primal():
        return _gpipe_terms(cfg, pipe, w, batch)


def _one_f_one_b_forward(cfg: ModelConfig, pipe: Pipeline, w: Weights, batch: TokenBatch):
    """The 1F1B ticks: the loss terms and every weight's gradient of the summed loss."""
    rows, micro, stage = _stages(cfg, pipe, batch)
    # Differentiated per stage (stage 0's input gradients are the only non-zero ones): the
    # table's gradient varies over p until summed below.
    table = varying_over_stages(w.embed)
    xs, embed_vjp = jax.vjp(lambda t: _embedded(cfg, pipe, t, rows), table)

    def head_loss(head: _Head, y, i):
        terms, head_aux = _head_terms(cfg, head, y, _microbatch(micro, i))
        return (terms[0], head_aux) if cfg.mtp.depth else terms[0]

    mtp = (w.embed, getattr(w, MTP_STACK)) if cfg.mtp.depth else ()
    head = _Head(w.final_norm, w.unembed, *mtp)
    head_aux_like = None
    if cfg.mtp.depth:
        head_aux_like = {MTP_STACK: zero_aux(cfg)[MTP_STACK]}
    stack = _stack(cfg)
    aux_like = _block_aux_zeros(cfg, shardops.axis_size("p"))
    counts = _microbatch_counts(micro) if aux_like else None
    loss_fields = {b.name: b.aux.loss for b in stack.aux_blocks}

    def aux_cotangent(i):
        # The loss adds microbatch i's loss fields times its counted positions.
        return {
            name: {
                f: jnp.broadcast_to(counts[i], z.shape)
                if f in loss_fields[name]
                else jnp.zeros_like(z)
                for f, z in fields.items()
            }
            for name, fields in aux_like.items()
        }

    loss, d_layers, d_head, d_xs, aux, head_aux = one_f_one_b_with_aux(
        stage, head_loss, getattr(w, stack.name), head, xs, aux_like, aux_cotangent, head_aux_like
    )
    (d_embed,) = embed_vjp(d_xs)
    count = jnp.sum(micro.counted.astype(jnp.float32))
    count = shardops.psum("1{U_dp,c} -> 1", count[None])[0]
    balancing, step_aux = None, {}
    if aux:
        aux = jax.tree.map(lambda a: a[None], aux)  # one round
        balancing, stack_aux = _balancing_and_stats(cfg, aux, counts)
        step_aux = {stack.name: stack_aux}
    loss = _on_last_stage_summed(jnp.stack([loss, 0.0]), balancing)[0]
    if cfg.mtp.depth:
        # The modules read the embedding on the last stage: its share joins stage 0's.
        d_embed = d_embed + d_head.embed
    grads = dict(
        # Made on one stage (zeros on the others): summed over p, as the replicated weights' are.
        embed=shardops.psum(f"{_TABLE}{{U_p}} -> {_TABLE}", d_embed),
        final_norm=shardops.psum(f"{_GAIN}{{U_p}} -> {_GAIN}", d_head.final_norm),
        unembed=shardops.psum(f"{_TABLE}{{U_p}} -> {_TABLE}", d_head.unembed),
    )
    grads[stack.name] = d_layers
    if cfg.mtp.depth:
        types = getattr(type_tree(weights_type(cfg)), MTP_STACK)
        grads[MTP_STACK] = jax.tree.map(
            lambda t, g: _summed_over_stages(str(t.shape), g),
            types,
            d_head.mtp,
            is_leaf=lambda x: isinstance(x, ArrayType),
        )
        step_aux = {**step_aux, **_head_step_aux(cfg, head_aux)}
    return (jnp.stack([loss, count]), step_aux), type(w)(**grads)


def _summed_over_stages(spec: str, g: jax.Array) -> jax.Array:
    """A gradient made on one stage (zeros on the others), summed over p."""
    with collective_log.part(MTP_STACK):
        return shardops.psum(f"{spec}{{U_p}} -> {spec}", g)


def _one_f_one_b_backward(cfg, pipe, grads: Weights, cotangents):
    """The gradients the forward made, times the cotangent of the summed loss (the auxiliary
    outputs' cotangents are dropped: they are reported, not differentiated)."""
    d_terms = cotangents[0]
    return jax.tree.map(lambda g: g * d_terms[0], grads), None


_with_one_f_one_b.defvjp(_one_f_one_b_forward, _one_f_one_b_backward)
