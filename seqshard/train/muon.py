"""Muon on sharded weights (``train.optimizer=muon``): each weight matrix's momentum
orthogonalized on whole matrices, every transfer in the notation; AdamW for the rest.

Which weights, and as what matrices, their declarations say (a :class:`~seqshard.model.block.Weight`
with ``matrix=(input dims, output dims)``): the attention, FFN, expert, latent-attention and
multi-token projections. Every other dim of the weight's type stacks matrices::

    layers.w_q    'layers/p d_model/fsdp n_q_per_kv n_kv/t d_head'
                   S = layers,  In = d_model,  Out = n_q_per_kv n_kv d_head
    layers.w_kv   'layers/p 2 d_model/fsdp n_kv/t d_head'       S = layers 2 (k's and v's)
    moe.w_gate    'moe_layers/p experts/e d_model/d/c d_expert/t'  S = moe_layers experts

Each is flattened per device to 'S/p In/fsdp Out/t' (its block's dims in that order: a
permutation of the rows and columns, which the iteration commutes with) and handed to
:func:`seqshard.shardlib.newton_schulz.orthogonalized`, which moves the In and Out splits
onto S by all_to_all, iterates whole matrices, and moves them back (or keeps a far-wide
matrix's columns split and all-reduces its Gram; a stack that does not divide is padded with
zero matrices). Weights whose flattened blocks rest alike share one call
(:func:`orthogonalize_all`). All of it in one ``shard_map``, phase ``update`` of the collective
log, part ``muon <weights>``. MuonClip (``train.muon.qk_clip``) follows the step:
:func:`qk_clipped`. The embeddings, the head, the norm gains, the router (a d_model x experts scorer,
gathered in f32 every step; its top-k choice is not a direct linear output) and FP8 state
keep AdamW, with ``train.beta1``, ``beta2``, ``eps`` as before.

Per matrix leaf, as ``optax.contrib.muon`` (``scale_by_muon``; checked equal in the tests)::

    mu    = momentum * mu + (1 - momentum) * g                  (f32, sharded as the weight)
    m_hat = momentum * mu / (1 - momentum^(k+1)) + (1 - momentum) * g / (1 - momentum^k)
            (nesterov; else mu / (1 - momentum^k))
    o     = newton_schulz(m_hat) * rms * sqrt(max(in, out))    (scale=rms; width: sqrt(max(1, out/in)))
    w    -= lr * (o + weight_decay * w)                         (decay where declared)

What differs from optax's ``muon``: its Adam side is NAdam when ``nesterov`` and decays every
non-matrix weight; here the non-matrix weights get the AdamW that ``train.optimizer=adamw``
runs (the same betas, epsilon, decay mask).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from seqshard.config import Config, MuonConfig
from seqshard.model.config import ModelConfig
from seqshard.model.layers import aux_stacks
from seqshard.model.matrices import flat_spec, matrix_stacks
from seqshard.model.weights import Weights
from seqshard.shardlib import collective_log
from seqshard.shardlib.newton_schulz import orthogonalized
from seqshard.shardlib.shapecheck import shape_scope
from seqshard.shardlib.shardtypes import typed_shard_map

__all__ = [
    "ShardedMuonState",
    "muon_labels",
    "qk_clipped",
    "orthogonalize_all",
    "scale_by_sharded_muon",
    "sharded_muon",
]


def muon_labels(cfg: ModelConfig):
    """``params -> the same tree of 'muon' / 'adamw'`` (for ``optax.partition``)."""
    matrices = matrix_stacks(cfg)

    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda p, _: "muon" if jax.tree_util.keystr(p).lstrip(".") in matrices else "adamw",
            params,
        )

    return labels


def orthogonalize_all(
    cfg: ModelConfig, mesh: Mesh, muon: MuonConfig, momenta: dict[str, jax.Array]
) -> dict[str, jax.Array]:
    """Newton-Schulz of every matrix of each weight in ``momenta`` (path -> global array, in
    the weight's layout), in one shard_map over ``mesh``; f32, in the same layouts.

    Weights whose matrices rest alike go through one call of
    :func:`~seqshard.shardlib.newton_schulz.orthogonalized`, their stacks one after another:
    the same layout 'S In Out' and block shape, a matrix taken transposed where that makes it
    so (``newton_schulz(X^T) = newton_schulz(X)^T``: w_down 'In/t Out/fsdp' joins w_gate and
    w_up 'In/fsdp Out/t', w_o joins w_q). Fewer, larger all_to_alls, and stacks that divide
    over the moved axes more often (less padding)."""
    stacks = matrix_stacks(cfg)
    paths = sorted(momenta)
    types = [stacks[p].type for p in paths]

    def body(*blocks):
        groups: dict[tuple, list[tuple[str, jax.Array, bool]]] = {}
        for path, x in zip(paths, blocks, strict=True):
            s, y = stacks[path], stacks[path].flattened(x)
            st, ins, outs = s.axes
            flip = ins > outs  # one orientation per pair of layouts
            if flip:
                y, ins, outs = jnp.swapaxes(y, 1, 2), outs, ins
            groups.setdefault((flat_spec(st, ins, outs), y.shape[1:]), []).append((path, y, flip))
        done = {}
        for (spec, _), members in groups.items():
            names = "+".join(path for path, _, _ in members)
            stacked = (
                jnp.concatenate([y for _, y, _ in members]) if len(members) > 1 else members[0][1]
            )
            # S, In, Out: the group's own sizes; its collectives the update's, named by it
            with (
                shape_scope(),
                collective_log.phase("update"),
                collective_log.part(f"muon {names}"),
            ):
                o = orthogonalized(spec, stacked, muon.ns_steps, tuple(muon.ns_coefficients))
            start = 0
            for path, y, flip in members:
                part = o[start : start + y.shape[0]]
                start += y.shape[0]
                done[path] = jnp.swapaxes(part, 1, 2) if flip else part
        return tuple(
            stacks[p].unflattened(done[p], x.shape) for p, x in zip(paths, blocks, strict=True)
        )

    run = typed_shard_map(body, mesh=mesh, types=(types, tuple(types)))
    results = run(*(momenta[p].astype(jnp.float32) for p in paths))
    return dict(zip(paths, results, strict=True))


class ShardedMuonState(NamedTuple):
    """Muon's state: the step count and each matrix's momentum (sharded as its weight)."""

    count: jax.Array  # i32[]
    mu: optax.Updates


def _scale(muon: MuonConfig, fan_in: int, fan_out: int) -> float:
    if muon.scale == "rms":
        return muon.rms * math.sqrt(max(fan_in, fan_out))
    return math.sqrt(max(1.0, fan_out / fan_in))


def scale_by_sharded_muon(
    cfg: ModelConfig, mesh: Mesh, muon: MuonConfig
) -> optax.GradientTransformation:
    """Momentum, orthogonalized and scaled (the module docstring), for the matrix leaves of a
    weights tree (the others may be ``optax.MaskedNode``: ``optax.partition`` hands them so)."""
    stacks = matrix_stacks(cfg)
    sizes = cfg.dim_sizes()
    beta = muon.momentum

    def init(params):
        mu = jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), params)
        return ShardedMuonState(count=jnp.zeros([], jnp.int32), mu=mu)

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        if muon.nesterov:
            mu_hat = jax.tree.map(
                lambda m, g: beta * m + (1 - beta) * g,
                optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                optax.tree.bias_correction(updates, beta, count),
            )
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        flat, treedef = jax.tree_util.tree_flatten_with_path(mu_hat)
        paths = [jax.tree_util.keystr(p).lstrip(".") for p, _ in flat]
        by_path = dict(zip(paths, (x for _, x in flat), strict=True))
        unknown = sorted(set(by_path) - set(stacks))
        if unknown:
            raise ValueError(
                f"Muon was handed {unknown}, which declare no matrix (seqshard.model.block.Weight "
                f"matrix=...); label only declared matrices 'muon' (seqshard.train.muon.muon_labels)."
            )
        ortho = orthogonalize_all(cfg, mesh, muon, by_path)
        out = [ortho[path] * _scale(muon, *stacks[path].sizes(sizes)[1:]) for path in paths]
        return treedef.unflatten(out), ShardedMuonState(count=count, mu=mu)

    return optax.GradientTransformation(init, update)


def qk_clipped(cfg: Config, weights: Weights, aux: dict) -> tuple[Weights, jax.Array]:
    """MuonClip's query-key clipping (Kimi K2; ``train.muon.qk_clip`` = tau > 0): after the
    optimizer step, each attention head h whose largest logit S_h of the step (``model.max_logit``'s
    auxiliary output) passed tau gets its logits scaled by gamma_h = tau / S_h, through its
    weights. Grouped-query heads share their key head: of each group, the key head is scaled by
    sqrt(g), g the group's smallest gamma, and each query head by gamma_h / sqrt(g), so that
    head h's logits (linear in both, RoPE included) scale by gamma_h exactly::

        w_q[l, :, q, k, :]   *= gamma[l, q, k] / sqrt(g[l, k])
        w_kv[l, 0, :, k, :]  *= sqrt(g[l, k])              (k's half; v is left as it is)

    Returns (the weights, the number of heads clipped). Elementwise on the weights' shards
    (the factors are per head, replicated): no communication."""
    tau, clipped = cfg.train.muon.qk_clip, jnp.zeros((), jnp.int32)
    for stack in aux_stacks(cfg.model):
        logits = aux.get(stack.name, {}).get("attention", {}).get("max_logit")
        if logits is None:
            continue
        over = logits > tau  # [layers, Q, K]
        gamma = jnp.where(over, tau / jnp.where(over, logits, 1.0), 1.0)
        group = jnp.sqrt(jnp.min(gamma, axis=1))  # [layers, K]
        layers = getattr(weights, stack.name)
        w_q = layers.w_q * (gamma / group[:, None, :])[:, None, :, :, None]
        w_kv = layers.w_kv.at[:, 0].multiply(group[:, None, :, None])
        weights = dataclasses.replace(
            weights, **{stack.name: dataclasses.replace(layers, w_q=w_q, w_kv=w_kv)}
        )
        clipped = clipped + jnp.sum(over)
    return weights, clipped


def sharded_muon(
    cfg: ModelConfig,
    mesh: Mesh,
    muon: MuonConfig,
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: float,
    decay_mask,
    adamw: optax.GradientTransformation,
) -> optax.GradientTransformation:
    """Muon for the declared matrices, ``adamw`` for the rest (``optax.partition``)."""
    matrices = optax.chain(
        scale_by_sharded_muon(cfg, mesh, muon),
        optax.add_decayed_weights(weight_decay, decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )
    return optax.partition({"muon": matrices, "adamw": adamw}, muon_labels(cfg))
