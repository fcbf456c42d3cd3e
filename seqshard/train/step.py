"""One training step: loss and gradients over microbatches, then the optimizer update.

Gradient accumulation sums, over microbatches, the summed next-token loss, the number of
positions counted, and the gradient of the summed loss; it divides once at the end. That is
exactly the full-batch mean gradient even when packed documents give microbatches different
token counts (a mean of microbatch means would weight them wrongly).

Microbatch m takes rows m, m+k, m+2k, ... of the global batch, so every device's block of
``B/dp`` rows already holds its share of each microbatch: splitting moves no data.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from seqshard.batch import TokenBatch, split_microbatches
from seqshard.config import Config
from seqshard.model.layers import MTP_STACK, aux_stacks, zero_aux
from seqshard.model.mtp_block import MTP_ENTRY
from seqshard.model.sharded import batch_loss_terms, batch_terms_and_aux
from seqshard.model.weights import Weights
from seqshard.shardlib import collective_log
from seqshard.shardlib.shardtypes import shardings
from seqshard.train.muon import qk_clipped
from seqshard.train.optimizer import lr_schedule
from seqshard.train.state import (
    NonfiniteGuard,
    TrainState,
    layer_order,
    nonfinite_kind,
    shardings_of,
    step_is_healthy,
    train_state_structs,
)

__all__ = [
    "LossTerms",
    "aux_metrics",
    "grads_and_loss",
    "make_eval_step",
    "make_train_step",
    "updated_by_aux",
]


LossTerms = Callable[[Weights, TokenBatch], Any]
"""``(weights, batch) -> f32[2]``: the summed next-token loss and the positions counted; or
``(f32[2], aux)``, with the layer stacks' auxiliary outputs
(:func:`~seqshard.model.sharded.batch_terms_and_aux`)."""


def grads_and_loss(
    weights: Weights,
    batch: TokenBatch,
    cfg: Config,
    mesh: Mesh,
    loss_terms: LossTerms | None = None,
) -> tuple[Weights, jax.Array, jax.Array, dict]:
    """(mean gradient, mean loss, positions counted, the layer stacks' auxiliary outputs of
    the step, empty without any) over ``train.microbatches`` slices.

    ``loss_terms`` defaults to the sharded model's (:func:`batch_terms_and_aux`). On a mesh
    with p > 1 the microbatches are the pipeline's: one call runs them all through the
    stages (``train.pipeline_schedule``), so nothing is accumulated here. The auxiliary
    outputs add up over microbatches, except each block's ``mean`` fields (their mean: the
    pipelined model returns them so), and the ``max`` fields their largest."""
    pipelined = mesh.shape.get("p", 1) > 1
    k = 1 if pipelined else cfg.train.microbatches
    no_stats = {}
    if loss_terms is None:
        loss_terms = functools.partial(
            batch_terms_and_aux, cfg=cfg.model, mesh=mesh, pipeline=cfg.train.pipeline()
        )
        no_stats = zero_aux(cfg.model)

    def summed(w, b):
        out = loss_terms(w, b)
        (total, count), stats = out if isinstance(out, tuple) else (out, {})
        return total, (count, stats)  # differentiate the sum; carry the rest along

    grad_of_sum = jax.value_and_grad(summed, has_aux=True)
    if k == 1:
        (total, (count, stats)), grads = grad_of_sum(weights, batch)
    else:

        def accumulate(acc, micro: TokenBatch):
            (total, (count, stats)), grads = grad_of_sum(weights, micro)
            acc_total, acc_count, acc_grads, acc_stats = acc
            summed = jax.tree.map(jnp.add, (acc_total, acc_count, acc_grads), (total, count, grads))
            return (*summed, _aux_accumulated(cfg, acc_stats, stats)), None

        zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, weights), no_stats)
        micro = split_microbatches(batch, k, mesh)
        (total, count, grads, stats), _ = collective_log.scan(
            "microbatches", accumulate, zeros, micro
        )
        stats = _mean_fields_averaged(cfg, stats, k)
    divisor = jnp.maximum(count, 1.0)  # a batch with nothing counted: loss 0, gradient 0
    return jax.tree.map(lambda g: g / divisor, grads), total / divisor, count, stats


def _aux_accumulated(cfg: Config, acc: dict, new: dict) -> dict:
    """The auxiliary outputs of the microbatches so far and of one more: each field added, or
    its largest kept (a block's ``max`` fields: FP8's amaxes)."""
    out = {}
    for stack in aux_stacks(cfg.model):
        if stack.name not in acc:
            continue
        out[stack.name] = {
            b.name: {
                f: (jnp.maximum if f in b.aux.max else jnp.add)(v, new[stack.name][b.name][f])
                for f, v in acc[stack.name][b.name].items()
            }
            for b in stack.aux_blocks
        }
    return out


def _mean_fields_averaged(cfg: Config, aux: dict, k: int) -> dict:
    """The auxiliary outputs summed over ``k`` microbatches, each block's ``mean`` fields
    divided by k (the rest stay sums)."""
    out = {}
    for stack in aux_stacks(cfg.model):
        if stack.name not in aux:
            continue
        out[stack.name] = {
            b.name: {f: v / k if f in b.aux.mean else v for f, v in aux[stack.name][b.name].items()}
            for b in stack.aux_blocks
        }
    return out


def aux_metrics(cfg: Config, aux: dict, weights, p: int = 1) -> dict[str, jax.Array]:
    """The log's figures of each block that declares them (:class:`~seqshard.model.block.Aux`
    ``metrics``), from the step's auxiliary outputs. Layers are named by their place in the
    model: the outputs follow the stored stacks (as their weights), which the circular
    pipeline schedule over ``p`` stages reorders (:func:`~seqshard.train.state.layer_order`)."""
    names, start, out = layer_order(cfg, p), 0, {}
    for stack in aux_stacks(cfg.model):
        if stack.name == MTP_STACK:  # after the layers: named by the model's layer count on
            stack_names = tuple(cfg.model.n_layers + k for k in range(stack.n_layers))
        else:
            stack_names = names[start : start + stack.n_layers]
            start += stack.n_layers
        for b in stack.aux_blocks:
            if b.aux.metrics is not None and stack.name in aux:
                w = getattr(weights, stack.name)
                figures = b.aux.metrics(cfg.model, aux[stack.name][b.name], stack_names, w)
                if stack.name == MTP_STACK and b is not MTP_ENTRY:
                    # A module's MoE: its own figures beside the layers' (mtp_moe_aux_loss, ...)
                    figures = {f"mtp_{k}": v for k, v in figures.items()}
                out.update(figures)
    return out


def updated_by_aux(cfg: Config, weights, aux: dict):
    """The weights after each block's per-step state update (:class:`~seqshard.model.block.Aux`
    ``update``: the router bias) from the step's auxiliary outputs."""
    for stack in aux_stacks(cfg.model):
        for b in stack.aux_blocks:
            if b.aux.update is not None and stack.name in aux:
                layers = b.aux.update(
                    cfg.model, getattr(weights, stack.name), aux[stack.name][b.name]
                )
                weights = dataclasses.replace(weights, **{stack.name: layers})
    return weights


def make_train_step(
    cfg: Config, mesh: Mesh, opt: optax.GradientTransformation, loss_terms: LossTerms | None = None
):
    """``step(state, batch) -> (state, metrics)``, jitted once, state donated.

    ``loss_terms`` swaps the model (the benchmark's plain-jit baseline uses the same step)."""
    schedule = lr_schedule(cfg.train)
    state_shardings = shardings_of(train_state_structs(cfg.model, mesh, opt))

    def step(state: TrainState, batch: TokenBatch):
        grads, loss, count, stats = grads_and_loss(state.weights, batch, cfg, mesh, loss_terms)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = opt.update(grads, state.opt_state, state.weights)
        weights = optax.apply_updates(state.weights, updates)
        weights = updated_by_aux(cfg, weights, stats)
        clips = {}
        if cfg.train.optimizer == "muon" and cfg.train.muon.qk_clip:
            weights, clips["qk_clipped"] = qk_clipped(cfg, weights, stats)
        # A step whose loss or gradient norm is not finite, or whose gradient is zero, applies
        # no update: the state stays as it was, on device, and the guard records the step for
        # the loop to act on.
        # A batch whose loss mask counts nothing (fine-tuning rows of prompts alone) has a zero
        # gradient by right, not by fault: no update, no guard record.
        nothing_counted = count == 0
        idle = nothing_counted & jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        finite = step_is_healthy(loss, grad_norm) | idle
        apply = finite & ~nothing_counted & _may_update(state.guard, cfg.train)
        keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(apply, new, old))
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": schedule(state.step),
            "tokens_counted": count,
        }
        metrics.update(aux_metrics(cfg, stats, weights, mesh.shape.get("p", 1)), **clips)
        new_state = TrainState(
            step=state.step + 1,
            weights=keep(weights, state.weights),
            opt_state=keep(opt_state, state.opt_state),
            guard=_guard_after(state.guard, finite, state.step + 1, loss, grad_norm),
        )
        return new_state, metrics

    return jax.jit(
        step,
        in_shardings=(state_shardings, shardings(TokenBatch, mesh)),
        out_shardings=(state_shardings, None),
        donate_argnums=(0,),
    )


def _may_update(guard: NonfiniteGuard, train_cfg) -> jax.Array:
    """Whether a finite step may still update: under ``stop``, not after any non-finite step
    (the loop stops when it reads the guard); under ``skip``, not once
    ``max_nonfinite_skips`` came in a row (the loop stops then too)."""
    if train_cfg.nonfinite == "stop":
        return guard.total == 0
    return guard.in_a_row < train_cfg.max_nonfinite_skips


def _guard_after(
    guard: NonfiniteGuard, finite: jax.Array, step: jax.Array, loss: jax.Array, grad_norm: jax.Array
) -> NonfiniteGuard:
    """The guard after a step that was (or was not) finite."""
    bad = ~finite
    return NonfiniteGuard(
        in_a_row=jnp.where(bad, guard.in_a_row + 1, 0),
        total=guard.total + bad,
        last_step=jnp.where(bad, step, guard.last_step),
        last_loss=jnp.where(bad, nonfinite_kind(loss), guard.last_loss),
        last_grad_norm=jnp.where(bad, nonfinite_kind(grad_norm, True), guard.last_grad_norm),
    )


def make_eval_step(cfg: Config, mesh: Mesh):
    """``eval(weights, batch) -> f32[2]`` (summed loss, positions counted)."""
    return jax.jit(
        functools.partial(batch_loss_terms, cfg=cfg.model, mesh=mesh, pipeline=cfg.train.pipeline())
    )
