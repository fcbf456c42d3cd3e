"""The model's weights: each layout declared once, in its field type, and made in place.

Weights at rest are fully sharded: rows (``d_model``) over d and c (FSDP groups over both:
``d_model/d/c``), heads / ``d_ff`` / ``vocab`` over t (Megatron). Norm weights are split over
all three, t major: ``'d_model/t/d/c'``,
the same order for all three (the seed mixes ``d/t`` and ``t/d``).

Initial values (std of a normal, zero mean), chosen so every residual-stream contribution
starts at unit scale and the residual stream grows like sqrt(layers), as in GPT-2 / Llama:

    embed                      1                      (RMSNorm follows, so its scale is free)
    w_q, w_kv, w_gate, w_up    1/sqrt(d_model)        (fan-in)
    w_o                        1/sqrt(n_heads*d_head) / sqrt(2 n_layers)
    w_down                     1/sqrt(d_ff) / sqrt(2 n_layers)
    unembed                    1/sqrt(d_model)
    ln1, ln2, final_norm       ones
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from seqshard.mesh import axis_sizes, describe_sizes
from seqshard.model.config import ModelConfig
from seqshard.shardlib.shardtypes import (
    Array,
    ArrayType,
    f32,
    pytree_dataclass,
    shape_dtype_structs,
    type_tree,
)

__all__ = [
    "Layer",
    "Weights",
    "check_weights_split",
    "init_weights",
    "param_count",
    "weight_structs",
]


@pytree_dataclass
class Layer:
    """One transformer layer (pre-norm attention, then pre-norm SwiGLU FFN)."""

    ln1: f32["d_model/t/d/c"]  # pre-attention RMSNorm gain
    w_q: f32["d_model/d/c n_q_per_kv n_kv/t d_head"]
    w_kv: f32["2 d_model/d/c n_kv/t d_head"]  # [0] makes k, [1] makes v
    w_o: f32["d_model/d/c n_q_per_kv n_kv/t d_head"]
    ln2: f32["d_model/t/d/c"]  # pre-FFN RMSNorm gain
    w_gate: f32["d_model/d/c d_ff/t"]
    w_up: f32["d_model/d/c d_ff/t"]
    w_down: f32["d_model/d/c d_ff/t"]


@pytree_dataclass
class Weights:
    """All weights; ``layers`` holds every Layer field with a leading ``layers`` dimension."""

    embed: f32["vocab/t d_model/d/c"]
    layers: Array["layers/p", Layer]  # stage s of p holds the s-th block of layers
    final_norm: f32["d_model/t/d/c"]
    unembed: f32["vocab/t d_model/d/c"]


def weight_structs(cfg: ModelConfig, mesh: Mesh | None = None) -> Weights:
    """``jax.ShapeDtypeStruct`` per weight, sharded on ``mesh`` when given (orbax restore, eval_shape)."""
    if mesh is not None:
        cfg.check_mesh(dict(mesh.shape))
    return shape_dtype_structs(Weights, cfg.dim_sizes(), mesh)


def check_weights_split(cfg: ModelConfig, mesh_sizes: Mapping[str, int]) -> None:
    """Raise ValueError if a weight dimension is not divisible by the mesh axes its type splits
    it over: ``embed: 'vocab/t d_model/d/c'`` needs ``vocab % t == 0`` and ``d_model % d == 0``.

    Dimensions are named after config fields, so the message names the field to change."""
    sizes, mesh = cfg.dim_sizes(), axis_sizes(mesh_sizes)
    where = describe_sizes(mesh)
    leaves = jax.tree_util.tree_flatten_with_path(
        type_tree(Weights), is_leaf=lambda x: isinstance(x, ArrayType)
    )[0]
    for path, t in leaves:
        for dim in t.shape.dims:
            n = math.prod(mesh[a] for a in dim.axes)
            if dim.label in sizes and sizes[dim.label] % n:
                name = jax.tree_util.keystr(path).lstrip(".")
                raise ValueError(
                    f"model.{dim.label}={sizes[dim.label]} is not divisible by mesh axis "
                    f"{'*'.join(dim.axes)} = {n} on a {where} mesh ({name} is {t!r}: "
                    f"{dim.label} is split over {'/'.join(dim.axes)}). Choose model.{dim.label} "
                    f"divisible by {n}, or another mesh."
                )


def _init_stds(cfg: ModelConfig) -> Weights:
    """The std of each weight's normal init, or "ones" for the norm gains."""
    depth = 1 / math.sqrt(2 * cfg.n_layers)
    fan_in = 1 / math.sqrt(cfg.d_model)
    layer = Layer(
        ln1="ones",
        w_q=fan_in,
        w_kv=fan_in,
        w_o=depth / math.sqrt(cfg.n_heads * cfg.d_head),
        ln2="ones",
        w_gate=fan_in,
        w_up=fan_in,
        w_down=depth / math.sqrt(cfg.d_ff),
    )
    return Weights(embed=1.0, layers=layer, final_norm="ones", unembed=fan_in)


def init_weights(cfg: ModelConfig, mesh: Mesh, key: jax.Array) -> Weights:
    """Random initial weights, each created directly in its sharded layout on ``mesh``.

    One jitted function with ``out_shardings`` from the types: XLA partitions the random
    number generation, so no device ever holds the whole model.
    """
    return _initializer(cfg, mesh)(key)


@functools.lru_cache(maxsize=16)
def _initializer(cfg: ModelConfig, mesh: Mesh):
    """The jitted ``key -> Weights`` for a config and mesh, compiled once and reused."""
    structs = weight_structs(cfg, mesh)
    leaves, treedef = jax.tree.flatten(structs)
    stds = treedef.flatten_up_to(_init_stds(cfg))

    def make(key: jax.Array) -> Weights:
        keys = jax.random.split(key, len(leaves))
        out = []
        for k, s, std in zip(keys, leaves, stds, strict=True):
            if std == "ones":
                out.append(jnp.ones(s.shape, s.dtype))
            else:
                out.append(std * jax.random.normal(k, s.shape, s.dtype))
        return treedef.unflatten(out)

    return jax.jit(make, out_shardings=jax.tree.map(lambda s: s.sharding, structs))


def param_count(cfg: ModelConfig) -> int:
    """The number of weights (embed and unembed counted separately: they are untied)."""
    return sum(math.prod(s.shape) for s in jax.tree.leaves(weight_structs(cfg)))
