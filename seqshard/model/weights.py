"""The model's weights: each layout declared once, in its field type, and made in place.

Weights at rest are fully sharded: rows (``d_model``) over d and c (FSDP groups over both:
``d_model/d/e/c``), heads / ``d_ff`` / ``vocab`` over t (Megatron). Norm weights are split over
all three, t major: ``'d_model/t/d/e/c'``, the same order for all three (the seed mixes ``d/t``
and ``t/d``).

A layer's weights are its blocks' (:data:`LAYER_BLOCKS`): each block module declares its
fields, with their init, decay, gather dtype and Hugging Face names beside its math
(:mod:`seqshard.model.attention_block`, :mod:`seqshard.model.swiglu`); :class:`Layer` is their
fields side by side, flat (``layers.w_q``, the checkpoints' paths). The weights outside the
layers are declared here, the same way.

Initial values (std of a normal, zero mean), chosen so every residual-stream contribution
starts at unit scale and the residual stream grows like sqrt(layers), as in GPT-2 / Llama:

    embed                      1                      (RMSNorm follows, so its scale is free)
    w_q, w_kv, w_gate, w_up    1/sqrt(d_model)        (fan-in)
    w_o                        1/sqrt(n_heads*d_head) / sqrt(2 n_layers)
    w_down                     1/sqrt(d_ff) / sqrt(2 n_layers)
    unembed                    1/sqrt(d_model)
    ln1, ln2, final_norm       ones
    q_norm, k_norm             ones                   ([d_head] with model.qk_norm, else [0])
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from seqshard.mesh import axis_sizes, describe_sizes
from seqshard.model.attention_block import ATTENTION, AttentionWeights
from seqshard.model.block import Block, Weight, gain, weight, weight_info
from seqshard.model.config import DIM_KEYS, ModelConfig
from seqshard.model.moe import MOE, ExpertFfnWeights
from seqshard.model.swiglu import SWIGLU, SwigluWeights
from seqshard.shardlib.shardtypes import (
    Array,
    ArrayType,
    f32,
    pytree_dataclass,
    shape_dtype_structs,
    type_tree,
)

__all__ = [
    "LAYER_BLOCKS",
    "MOE_LAYER_BLOCKS",
    "STACKS",
    "Layer",
    "MoELayer",
    "MoEWeights",
    "Weights",
    "check_mesh",
    "init_weights",
    "param_count",
    "weight_info_by_path",
    "weight_structs",
    "weights_type",
]


def layer_type(name: str, *parts: type) -> type:
    """A flat pytree dataclass holding the fields of ``parts`` (block weight dataclasses), in
    order, each with its type and declaration."""
    annotations, namespace = {}, {"__module__": __name__}
    for part in parts:
        hints = typing.get_type_hints(part)
        for f in dataclasses.fields(part):
            annotations[f.name] = hints[f.name]
            namespace[f.name] = dataclasses.field(metadata=f.metadata)
    namespace["__annotations__"] = annotations
    namespace["__doc__"] = (
        f"One layer's weights: the fields of {', '.join(p.__name__ for p in parts)}."
    )
    return pytree_dataclass(type(name, (), namespace))


LAYER_BLOCKS: tuple[Block, ...] = (ATTENTION, SWIGLU)
"""The blocks of one (dense) layer, in the order the layer runs them."""

Layer = layer_type("Layer", AttentionWeights, SwigluWeights)

MOE_LAYER_BLOCKS: tuple[Block, ...] = (ATTENTION, MOE)
"""The blocks of one mixture-of-experts layer."""

MoELayer = layer_type("MoELayer", AttentionWeights, ExpertFfnWeights)


def _fan_in(cfg: ModelConfig) -> float:
    return 1 / math.sqrt(cfg.d_model)


@pytree_dataclass
class Weights:
    """All weights; ``layers`` holds every Layer field with a leading ``layers`` dimension."""

    embed: f32["vocab/t d_model/d/e/c"] = weight(
        1.0, hf="model.embed_tokens.weight", layout="vocab d_model"
    )
    layers: Array["layers/p", Layer] = dataclasses.field()  # stage s of p: the s-th block
    final_norm: f32["d_model/t/d/e/c"] = gain("model.norm.weight")
    unembed: f32["vocab/t d_model/d/e/c"] = weight(
        _fan_in, hf="lm_head.weight", layout="vocab d_model"
    )


@pytree_dataclass
class MoEWeights:
    """All weights of a model with experts (``model.moe.n_experts > 0``): ``layers`` the first
    ``moe.n_dense_layers`` (dense) layers, ``moe_layers`` the rest."""

    embed: f32["vocab/t d_model/d/e/c"] = weight(
        1.0, hf="model.embed_tokens.weight", layout="vocab d_model"
    )
    layers: Array["layers/p", Layer] = dataclasses.field()
    moe_layers: Array["moe_layers/p", MoELayer] = dataclasses.field()
    final_norm: f32["d_model/t/d/e/c"] = gain("model.norm.weight")
    unembed: f32["vocab/t d_model/d/e/c"] = weight(
        _fan_in, hf="lm_head.weight", layout="vocab d_model"
    )


def weights_type(cfg: ModelConfig) -> type:
    """The weights' dataclass of ``cfg``: :class:`Weights`, or :class:`MoEWeights` with experts."""
    return MoEWeights if cfg.moe.enabled else Weights


STACKS: dict[str, tuple[type, tuple[Block, ...]]] = {
    "layers": (Layer, LAYER_BLOCKS),
    "moe_layers": (MoELayer, MOE_LAYER_BLOCKS),
}
"""Each stacked field of the weights: its layer type and the blocks a layer of it runs."""


def weight_info_by_path(cls: type = Weights) -> dict[str, Weight]:
    """``'embed'``, ``'layers.w_q'``, ``'moe_layers.w_gate'``, ... -> each weight's declaration
    in the weights dataclass ``cls`` (:class:`Weights` or :class:`MoEWeights`), in Hugging
    Face's file order (the fields' order)."""
    out = {}
    outer = weight_info(cls)
    for f in dataclasses.fields(cls):
        if f.name in STACKS:
            layer = STACKS[f.name][0]
            out.update({f"{f.name}.{k}": v for k, v in weight_info(layer).items()})
        else:
            out[f.name] = outer[f.name]
    return out


def weight_structs(cfg: ModelConfig, mesh: Mesh | None = None) -> Weights:
    """``jax.ShapeDtypeStruct`` per weight, sharded on ``mesh`` when given (orbax restore, eval_shape)."""
    if mesh is not None:
        check_mesh(cfg, dict(mesh.shape))
    return shape_dtype_structs(weights_type(cfg), cfg.dim_sizes(), mesh)


def check_mesh(cfg: ModelConfig, mesh_sizes: Mapping[str, int]) -> None:
    """Raise ValueError, before anything compiles, if a mesh of these axis sizes (e.g.
    ``{'d': 4, 't': 2}``, missing axes 1) cannot split the model's weights: a weight dimension
    not divisible by the mesh axes its type splits it over: ``embed: 'vocab/t d_model/d/e/c'`` needs ``vocab % t == 0`` and ``d_model % d == 0``.

    Dimensions are named after config fields, so the message names the field to change."""
    sizes, mesh = cfg.dim_sizes(), axis_sizes(mesh_sizes)
    where = describe_sizes(mesh)
    leaves = jax.tree_util.tree_flatten_with_path(
        type_tree(weights_type(cfg)), is_leaf=lambda x: isinstance(x, ArrayType)
    )[0]
    if mesh["e"] > 1 and not cfg.moe.enabled:
        raise ValueError(
            f"mesh axis e={mesh['e']} splits the routed experts, but the model has none "
            f"(model.moe.n_experts=0) on a {where} mesh. Set mesh.e=1 (use mesh.d for data "
            f"parallelism), or give the model experts (model.moe.n_experts divisible by e)."
        )
    if mesh["p"] > 1 and cfg.moe.enabled and cfg.moe.n_dense_layers:
        # Both stacks split over p, stage s would run dense block s, then MoE block s: not
        # every dense layer before every MoE layer (seqshard.model.pipeline.pipelined).
        raise ValueError(
            f"a model with experts pipelines only MoE layers: model.moe.n_dense_layers="
            f"{cfg.moe.n_dense_layers} dense first layers with mesh.p={mesh['p']} would run out "
            f"of the model's order (each stage its dense block, then its MoE block) on a {where} "
            f"mesh. Set model.moe.n_dense_layers=0 to pipeline, or mesh.p=1."
        )
    for path, t in leaves:
        for dim in t.shape.dims:
            n = math.prod(mesh[a] for a in dim.axes)
            if dim.label in sizes and sizes[dim.label] % n:
                name = jax.tree_util.keystr(path).lstrip(".")
                key = DIM_KEYS.get(dim.label, dim.label)
                raise ValueError(
                    f"model.{key}={sizes[dim.label]} is not divisible by mesh axis "
                    f"{'*'.join(dim.axes)} = {n} on a {where} mesh ({name} is {t!r}: "
                    f"{dim.label} is split over {'/'.join(dim.axes)}). Choose model.{key} "
                    f"divisible by {n}, or another mesh."
                )


def _init_stds(cfg: ModelConfig) -> Weights:
    """The std of each weight's normal init, or "ones" for the norm gains (their declarations)."""
    cls = weights_type(cfg)
    stacks = {
        name: layer(**{k: w.std(cfg) for k, w in weight_info(layer).items()})
        for name, (layer, _) in STACKS.items()
        if name in {f.name for f in dataclasses.fields(cls)}
    }
    outer = {k: w.std(cfg) for k, w in weight_info(cls).items()}
    return cls(**stacks, **outer)


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
        # A key per weight the config has: a zero-size one (q_norm without model.qk_norm)
        # takes none, so adding such a field leaves every other weight's draw as it was.
        keys = iter(jax.random.split(key, sum(math.prod(s.shape) > 0 for s in leaves)))
        out = []
        for s, std in zip(leaves, stds, strict=True):
            k = next(keys) if math.prod(s.shape) > 0 else None
            if k is None:
                out.append(jnp.zeros(s.shape, s.dtype))
            elif std == "ones":
                out.append(jnp.ones(s.shape, s.dtype))
            else:
                out.append(std * jax.random.normal(k, s.shape, s.dtype))
        return treedef.unflatten(out)

    return jax.jit(make, out_shardings=jax.tree.map(lambda s: s.sharding, structs))


def param_count(cfg: ModelConfig) -> int:
    """The number of weights (embed and unembed counted separately: they are untied)."""
    return sum(math.prod(s.shape) for s in jax.tree.leaves(weight_structs(cfg)))
