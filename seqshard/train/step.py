"""One training step: loss and gradients over microbatches, then the optimizer update.

Gradient accumulation sums, over microbatches, the summed next-token loss, the number of
positions counted, and the gradient of the summed loss; it divides once at the end. That is
exactly the full-batch mean gradient even when packed documents give microbatches different
token counts (a mean of microbatch means would weight them wrongly).

Microbatch m takes rows m, m+k, m+2k, ... of the global batch, so every device's block of
``B/d/e`` rows already holds its share of each microbatch: splitting moves no data.
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
from seqshard.model.moe import RouterStats, zero_stats
from seqshard.model.sharded import batch_loss_terms, batch_terms_and_stats
from seqshard.model.weights import Weights
from seqshard.shardlib import collective_log
from seqshard.shardlib.shardtypes import shardings
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

__all__ = ["LossTerms", "grads_and_loss", "make_eval_step", "make_train_step"]


LossTerms = Callable[[Weights, TokenBatch], Any]
"""``(weights, batch) -> f32[2]``: the summed next-token loss and the positions counted; or
``(f32[2], RouterStats | None)``, with the MoE layers' routing statistics."""


def grads_and_loss(
    weights: Weights,
    batch: TokenBatch,
    cfg: Config,
    mesh: Mesh,
    loss_terms: LossTerms | None = None,
) -> tuple[Weights, jax.Array, jax.Array, RouterStats | None]:
    """(mean gradient, mean loss, positions counted, the MoE layers' routing statistics or
    None) over ``train.microbatches`` slices.

    ``loss_terms`` defaults to the sharded model's (:func:`batch_terms_and_stats`). On a mesh
    with p > 1 the microbatches are the pipeline's: one call runs them all through the
    stages (``train.pipeline_schedule``), so nothing is accumulated here. The statistics add
    up over microbatches (loads, drops, tokens); the balancing terms are their mean (the
    pipelined model returns them so)."""
    pipelined = mesh.shape.get("p", 1) > 1
    k = 1 if pipelined else cfg.train.microbatches
    no_stats = None
    if loss_terms is None:
        loss_terms = functools.partial(
            batch_terms_and_stats, cfg=cfg.model, mesh=mesh, pipeline=cfg.train.pipeline()
        )
        no_stats = zero_stats(cfg.model)

    def summed(w, b):
        out = loss_terms(w, b)
        (total, count), stats = out if isinstance(out, tuple) else (out, None)
        return total, (count, stats)  # differentiate the sum; carry the rest along

    grad_of_sum = jax.value_and_grad(summed, has_aux=True)
    if k == 1:
        (total, (count, stats)), grads = grad_of_sum(weights, batch)
    else:

        def accumulate(acc, micro: TokenBatch):
            (total, (count, stats)), grads = grad_of_sum(weights, micro)
            return jax.tree.map(jnp.add, acc, (total, count, grads, stats)), None

        zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, weights), no_stats)
        micro = split_microbatches(batch, k, mesh)
        (total, count, grads, stats), _ = collective_log.scan(
            "microbatches", accumulate, zeros, micro
        )
        if stats is not None:  # the balancing terms: each microbatch's, their mean
            stats = dataclasses.replace(stats, aux=stats.aux / k, z=stats.z / k)
    divisor = jnp.maximum(count, 1.0)  # a batch with nothing counted: loss 0, gradient 0
    return jax.tree.map(lambda g: g / divisor, grads), total / divisor, count, stats


def moe_metrics(cfg: Config, stats: RouterStats, weights, p: int = 1) -> dict[str, jax.Array]:
    """The MoE layers' figures for the log: the expert load's max over its mean (1: balanced),
    of the worst layer and of each layer (``.../<layer>``), each expert's share of the layer's token copies (``seqshard plot``
    draws them as a heatmap), the dropped fraction, the aux and z losses, and the router
    bias's range (max - min over experts and layers). Layers are named by their place in the
    model: ``stats`` follow the stored MoE stack (as its router bias), which the circular
    pipeline schedule over ``p`` stages reorders (:func:`~seqshard.train.state.layer_order`)."""
    moe = cfg.model.moe
    copies = stats.tokens * moe.top_k  # [layers]
    share = stats.load / copies[:, None]
    out = {
        "moe_aux_loss": jnp.sum(stats.aux),
        "moe_z_loss": jnp.sum(stats.z),
        "moe_dropped_fraction": jnp.sum(stats.dropped) / jnp.sum(copies),
        "moe_bias_range": jnp.max(weights.moe_layers.router_bias)
        - jnp.min(weights.moe_layers.router_bias),
        "moe_load_max_over_mean": jnp.max(share) * moe.n_experts,  # the worst layer's
    }
    # The model's layer at each stored position of the MoE stack (it follows the dense one;
    # with p > 1 there is none).
    names = layer_order(cfg, p)[cfg.model.dim_sizes()["layers"] :]
    for i, layer in enumerate(names):
        out[f"moe_load_max_over_mean/{layer}"] = jnp.max(share[i]) * moe.n_experts
        for j in range(moe.n_experts):
            out[f"moe_load/{layer}/{j}"] = share[i, j]
    return out


def balanced_bias(cfg: Config, weights, stats: RouterStats):
    """The weights with each MoE layer's router bias moved by ``moe.bias_rate`` towards
    balance (DeepSeek-V3): up for the experts loaded below the layer's mean, down above it,
    from the whole step's load (every microbatch, every device)."""
    rate = cfg.model.moe.bias_rate
    load = stats.load
    step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    layers = dataclasses.replace(
        weights.moe_layers, router_bias=weights.moe_layers.router_bias + step
    )
    return dataclasses.replace(weights, moe_layers=layers)


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
        if stats is not None and cfg.model.moe.balance == "bias":
            weights = balanced_bias(cfg, weights, stats)
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
        if stats is not None:
            metrics.update(moe_metrics(cfg, stats, weights, mesh.shape.get("p", 1)))
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
