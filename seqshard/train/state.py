"""The training state and its layout: weights, optimizer state, step, all sharded from the types.

The optimizer state holds copies of the weight tree (AdamW's two moments); each copy takes
the sharding its weight's type declares, and scalars (counts) are replicated. The same
shardings serve init, the jitted step's in/out shardings, and checkpoint restore targets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from seqshard.model.config import ModelConfig
from seqshard.model.weights import Weights, init_weights, weight_structs
from seqshard.shardtypes import i32, pytree_dataclass, shape_dtype_structs

__all__ = ["TrainState", "init_train_state", "train_state_structs"]


@pytree_dataclass
class TrainState:
    step: jax.Array  # i32[], the number of optimizer updates applied
    weights: Weights
    opt_state: optax.OptState


def train_state_structs(
    cfg: ModelConfig, mesh: Mesh, opt: optax.GradientTransformation
) -> TrainState:
    """``jax.ShapeDtypeStruct`` of every array of the state, each with its sharding on ``mesh``.

    ``jax.eval_shape(opt.init, ...)`` drops shardings, so they are put back from the weights'.
    """
    weights = weight_structs(cfg, mesh)
    step = shape_dtype_structs(i32[()], {}, mesh)  # a replicated scalar
    abstract = jax.eval_shape(opt.init, weights)
    opt_state = optax.tree_map_params(
        opt,
        lambda s, w: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=w.sharding),
        abstract,
        weights,
        # Counts and other scalars: replicated, like the step.
        transform_non_params=lambda s: jax.ShapeDtypeStruct(
            s.shape, s.dtype, sharding=step.sharding
        ),
    )
    return TrainState(step=step, weights=weights, opt_state=opt_state)


def shardings_of(structs):
    """The sharding tree of a tree of ShapeDtypeStructs."""
    return jax.tree.map(lambda s: s.sharding, structs)


def init_train_state(
    cfg: ModelConfig, mesh: Mesh, opt: optax.GradientTransformation, key: jax.Array
) -> TrainState:
    """Fresh weights and optimizer state, created in place in their sharded layouts."""
    weights = init_weights(cfg, mesh, key)
    out = shardings_of(train_state_structs(cfg, mesh, opt))
    return jax.jit(
        lambda w: TrainState(step=jnp.zeros((), jnp.int32), weights=w, opt_state=opt.init(w)),
        out_shardings=out,
    )(weights)
