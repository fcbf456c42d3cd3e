"""The model's weights: each layout declared once, in its field type, and made in place.

Weights at rest are fully sharded: rows (``d_model``) over d, e and c (the FSDP group:
``d_model/fsdp``; routed experts split over e instead, their rows over d and c), heads /
``d_ff`` / ``vocab`` over t (Megatron). Norm weights are split over all of them, t major:
``'d_model/t/fsdp'``, the same order for every norm (the seed mixes ``d/t`` and ``t/d``).

A layer's weights are its blocks' (:func:`seqshard.model.layers.stacks`): each block module
declares its fields, with their init, decay, gather dtype, Hugging Face names and whether a
config has them, beside its math (:mod:`seqshard.model.attention_block`,
:mod:`seqshard.model.swiglu`, :mod:`seqshard.model.moe`); a stack's layer type is their fields
side by side, flat (``layers.w_q``, ``moe_layers.w_gate``: the checkpoints' paths). The
weights outside the layers are declared here, the same way. A weight the config leaves off
(``q_norm`` without ``model.qk_norm``) is absent from the tree, as is an empty stack.

Initial values (std of a normal, zero mean), chosen so every residual-stream contribution
starts at unit scale and the residual stream grows like sqrt(layers), as in GPT-2 / Llama:

    embed                      1                      (RMSNorm follows, so its scale is free)
    w_q, w_kv, w_gate, w_up    1/sqrt(d_model)        (fan-in)
    w_o                        1/sqrt(n_heads*d_head) / sqrt(2 n_layers)
    w_down                     1/sqrt(d_ff) / sqrt(2 n_layers)
    unembed                    1/sqrt(d_model)
    ln1, ln2, final_norm       ones
    q_norm, k_norm             ones                   (with model.qk_norm only)
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
from seqshard.model.block import Weight, gain, weight, weight_info
from seqshard.model.config import DIM_KEYS, ModelConfig
from seqshard.model.layers import MTP_STACK, Layer, mtp_stack, stacks
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
    "check_mesh",
    "init_weights",
    "param_count",
    "stack_layer_types",
    "weight_info_by_path",
    "weight_structs",
    "weight_types",
    "weights_type",
]


def _fan_in(cfg: ModelConfig) -> float:
    return 1 / math.sqrt(cfg.d_model)


class Weights:
    """All weights of a model: ``embed``, then each layer stack (``layers``, ``moe_layers``,
    ...: :func:`seqshard.model.layers.stacks`), then ``final_norm`` and ``unembed``. Each
    config's is a dataclass of this class made by :func:`weights_type` (its stacks and the
    weights its blocks have differ between configs); these are the fields outside the
    layers, declared once."""

    embed: f32["vocab/t d_model/fsdp"] = weight(
        1.0, hf="model.embed_tokens.weight", layout="vocab d_model"
    )
    final_norm: f32["d_model/t/fsdp"] = gain("model.norm.weight")
    unembed: f32["vocab/t d_model/fsdp"] = weight(
        _fan_in, hf="lm_head.weight", layout="vocab d_model"
    )


_OUTER = ("embed", "final_norm", "unembed")


@functools.cache
def _weights_class(layer_stacks: tuple[tuple[str, type], ...]) -> type:
    hints = typing.get_type_hints(Weights)
    annotations: dict = {"embed": hints["embed"]}
    namespace: dict = {"__module__": __name__, "embed": Weights.__dict__["embed"]}
    for name, layer in layer_stacks:
        # stage s of p: the s-th block of the stack's layers; the multi-token prediction
        # modules rest replicated over p (the last stage runs them, beside the head)
        annotations[name] = Array[name if name == MTP_STACK else f"{name}/p", layer]
        namespace[name] = dataclasses.field()
    for name in _OUTER[1:]:
        annotations[name] = hints[name]
        namespace[name] = Weights.__dict__[name]
    namespace["__annotations__"] = annotations
    namespace["__doc__"] = Weights.__doc__
    namespace["stacks"] = tuple(name for name, _ in layer_stacks)
    cls = type("Weights", (Weights,), namespace)
    cls.__qualname__ = "Weights"
    return pytree_dataclass(cls)


def weights_type(cfg: ModelConfig) -> type:
    """The weights' dataclass of ``cfg``: :class:`Weights` with a field per layer stack (the
    multi-token prediction modules' ``mtp`` last among them)."""
    mtp = mtp_stack(cfg)
    every = stacks(cfg) + ((mtp,) if mtp is not None else ())
    return _weights_class(tuple((s.name, s.layer_type) for s in every))


def stack_layer_types(cls: type) -> dict[str, type]:
    """Each layer stack field of the weights dataclass ``cls`` -> its layer type."""
    hints = typing.get_type_hints(cls)
    return {name: hints[name].inner for name in cls.stacks}


def weight_info_by_path(cls: type) -> dict[str, Weight]:
    """``'embed'``, ``'layers.w_q'``, ``'moe_layers.w_gate'``, ... -> each weight's declaration
    in the weights dataclass ``cls`` (:func:`weights_type` of a config), in Hugging Face's
    file order (the fields' order)."""
    out = {}
    outer = weight_info(cls)
    layers = stack_layer_types(cls)
    for f in dataclasses.fields(cls):
        if f.name in layers:
            out.update({f"{f.name}.{k}": v for k, v in weight_info(layers[f.name]).items()})
        else:
            out[f.name] = outer[f.name]
    return out


def weight_types(cfg: ModelConfig) -> list[tuple[str, ArrayType]]:
    """(path, type) of every weight of ``cfg``'s weights dataclass, in its fields' order:
    ``('layers.w_q', f32['layers/p d_model/d/e/c n_q_per_kv n_kv/t d_head'])``."""
    leaves = jax.tree_util.tree_flatten_with_path(
        type_tree(weights_type(cfg)), is_leaf=lambda x: isinstance(x, ArrayType)
    )[0]
    return [(jax.tree_util.keystr(path).lstrip("."), t) for path, t in leaves]


def weight_structs(cfg: ModelConfig, mesh: Mesh | None = None) -> Weights:
    """``jax.ShapeDtypeStruct`` per weight, sharded on ``mesh`` when given (orbax restore, eval_shape)."""
    if mesh is not None:
        check_mesh(cfg, dict(mesh.shape))
    return shape_dtype_structs(weights_type(cfg), cfg.dim_sizes(), mesh)


def check_mesh(cfg: ModelConfig, mesh_sizes: Mapping[str, int]) -> None:
    """Raise ValueError, before anything compiles, if a mesh of these axis sizes (e.g.
    ``{'d': 4, 't': 2}``, missing axes 1) cannot split the model's weights: a weight dimension
    not divisible by the mesh axes its type splits it over: ``embed: 'vocab/t d_model/fsdp'`` needs ``vocab % t == 0`` and ``d_model % d == 0``.

    Dimensions are named after config fields, so the message names the field to change."""
    sizes, mesh = cfg.dim_sizes(), axis_sizes(mesh_sizes)
    where = describe_sizes(mesh)
    leaves = jax.tree_util.tree_flatten_with_path(
        type_tree(weights_type(cfg)), is_leaf=lambda x: isinstance(x, ArrayType)
    )[0]
    cfg.check_mesh_kinds(mesh, where)
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


def _init_stds(cfg: ModelConfig):
    """The std of each weight's normal init, "ones" for the norm gains, "zeros" for state that
    starts empty (their declarations)."""
    cls = weights_type(cfg)
    stacked = {
        name: layer(**{k: w.std(cfg) for k, w in weight_info(layer).items()})
        for name, layer in stack_layer_types(cls).items()
    }
    return cls(**stacked, **{k: w.std(cfg) for k, w in weight_info(cls).items()})


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
        # A key per drawn weight: a zero-size one or a "zeros" one (state, such as FP8's amax
        # history) takes none, so adding such a field leaves every other weight's draw as it
        # was (as does an absent one).
        drawn = [
            math.prod(s.shape) > 0 and std != "zeros" for s, std in zip(leaves, stds, strict=True)
        ]
        keys = iter(jax.random.split(key, sum(drawn)))
        out = []
        for s, std, draw in zip(leaves, stds, drawn, strict=True):
            k = next(keys) if draw else None
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
