"""The training state and its layout: weights, optimizer state, step, all sharded from the types.

``guard`` records the steps whose loss or gradient norm was not finite, or whose gradient
norm was exactly zero (training that stands still: a weight so large that it saturates every
softmax, an lr so large that the next step is NaN). Such a step applies no update (the train step keeps the weights and optimizer state it was given, on device), so a
state is finite whenever its first state was; the loop reads the guard with the metrics it
fetches anyway and stops or goes on as ``train.nonfinite`` says.

The optimizer state holds copies of the weight tree (AdamW's two moments); each copy takes
the sharding its weight's type declares, and scalars (counts) are replicated. The same
shardings serve init, the jitted step's in/out shardings, and checkpoint restore targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from seqshard.model.config import ModelConfig
from seqshard.model.layers import STACK_NAMES
from seqshard.model.weights import Weights, init_weights, weight_structs
from seqshard.shardlib.shardtypes import i32, pytree_dataclass, shape_dtype_structs

if TYPE_CHECKING:
    from seqshard.config import Config

__all__ = [
    "NONFINITE_KINDS",
    "NonfiniteGuard",
    "TrainState",
    "init_train_state",
    "layer_order",
    "no_nonfinite",
    "nonfinite_kind",
    "relayered",
    "step_is_healthy",
    "train_state_structs",
]


@pytree_dataclass
class NonfiniteGuard:
    """Steps whose loss or gradient norm was not finite or whose gradient norm was zero;
    none of them applied an update. (The name is the checkpoint's: kept.)"""

    in_a_row: i32[()]  # non-finite steps since the last finite one
    total: i32[()]  # non-finite steps in the whole run
    last_step: i32[()]  # the latest of them (steps count from 1; 0: none yet)
    last_loss: i32[()]  # what its loss and gradient norm were: NONFINITE_KINDS[value]
    last_grad_norm: i32[()]


NONFINITE_KINDS = ("finite", "nan", "inf", "-inf", "zero")
"""How the guard records a value: by kind, so the guard itself stays finite (a checkpoint
holds only finite numbers). ``zero`` is only recorded for the gradient norm."""


def nonfinite_kind(x: jax.Array, zero_is_bad: bool = False) -> jax.Array:
    """i32[]: the index of ``x``'s kind in :data:`NONFINITE_KINDS` (``zero`` only if
    ``zero_is_bad``)."""
    cases = [jnp.isnan(x), x == jnp.inf, x == -jnp.inf, zero_is_bad & (x == 0)]
    return jnp.select(cases, [1, 2, 3, 4], 0).astype(jnp.int32)


def step_is_healthy(loss: jax.Array, grad_norm: jax.Array) -> jax.Array:
    """bool[]: the loss and gradient norm are finite and the gradient norm is not zero.

    A gradient norm of exactly zero means no weight can move: a weight so large that it
    saturates the softmaxes it feeds (a corrupt import: 1e30 in one matrix trained 40 steps at
    loss ln(vocab) with grad_norm 0), or a step so large that the next one is NaN. Adam would
    turn a zero gradient into a zero update, so the run would go on standing still; it is a
    fault like a NaN, under the same ``train.nonfinite`` policy."""
    return jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (grad_norm != 0)


@pytree_dataclass
class TrainState:
    step: jax.Array  # i32[], the number of steps taken (batches consumed)
    weights: Weights
    opt_state: optax.OptState
    guard: NonfiniteGuard


def train_state_structs(
    cfg: ModelConfig, mesh: Mesh, opt: optax.GradientTransformation
) -> TrainState:
    """``jax.ShapeDtypeStruct`` of every array of the state, each with its sharding on ``mesh``.

    ``jax.eval_shape(opt.init, ...)`` drops shardings, so they are put back from the weights'.
    """
    weights = weight_structs(cfg, mesh)
    step = shape_dtype_structs(i32[()], {}, mesh)  # a replicated scalar
    guard = shape_dtype_structs(NonfiniteGuard, {}, mesh)
    abstract = jax.eval_shape(opt.init, weights)

    def like_weight(s, w):
        if isinstance(s, optax.MaskedNode):  # another optimizer's weight (optax.partition)
            return s
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=w.sharding)

    opt_state = optax.tree_map_params(
        opt,
        like_weight,
        abstract,
        weights,
        # Counts and other scalars: replicated, like the step.
        transform_non_params=lambda s: jax.ShapeDtypeStruct(
            s.shape, s.dtype, sharding=step.sharding
        ),
        is_leaf=lambda x: isinstance(x, optax.MaskedNode),
    )
    return TrainState(step=step, weights=weights, opt_state=opt_state, guard=guard)


def no_nonfinite() -> NonfiniteGuard:
    """The guard of a run with no non-finite step yet."""
    # One array per field: the step donates its state, and one buffer donated twice is an error.
    zeros = (jnp.zeros((), jnp.int32) for _ in range(5))
    return NonfiniteGuard(*zeros)


def shardings_of(structs):
    """The sharding tree of a tree of ShapeDtypeStructs."""
    return jax.tree.map(lambda s: s.sharding, structs)


def init_train_state(
    cfg: ModelConfig,
    mesh: Mesh,
    opt: optax.GradientTransformation,
    key: jax.Array,
    weights: Weights | None = None,
) -> TrainState:
    """Step 0: ``weights`` (default: fresh random ones from ``key``, created in place in their
    sharded layouts) and a fresh optimizer state."""
    if weights is None:
        weights = init_weights(cfg, mesh, key)
    out = shardings_of(train_state_structs(cfg, mesh, opt))
    return jax.jit(
        lambda w: TrainState(
            step=jnp.zeros((), jnp.int32), weights=w, opt_state=opt.init(w), guard=no_nonfinite()
        ),
        out_shardings=out,
    )(weights)


def layer_order(cfg: Config, p: int) -> tuple[int, ...]:
    """The model's layer at each position of the stored layer stack of ``cfg`` on a mesh with
    ``p`` stages (:meth:`seqshard.model.pipeline.schedule.Pipeline.layer_order`): the identity but
    for the circular schedule, whose stages hold every p-th block."""
    return cfg.train.pipeline().layer_order(p, cfg.model.n_layers)


def relayered(tree, saved: Sequence[int], wanted: Sequence[int]):
    """``tree`` (weights, a train state: any tree whose layer stacks sit under a field of
    :data:`~seqshard.model.layers.STACK_NAMES`), its layer stacks stored in order ``saved`` rearranged into order ``wanted`` (each
    a :func:`layer_order`), every array keeping its sharding; the tree itself when the orders
    agree. One jitted gather per stacked array (over p when the stack is split over it)."""
    saved, wanted = tuple(saved), tuple(wanted)
    if saved == wanted:
        return tree
    position = {layer: i for i, layer in enumerate(saved)}
    take = np.array([position[layer] for layer in wanted], np.int32)

    def move(path, x):
        stacked = any(getattr(k, "name", getattr(k, "key", None)) in STACK_NAMES for k in path)
        # Only a one-stack model pipelines (ModelConfig.check_mesh_kinds): whenever the orders
        # differ that stack holds every layer. Nothing to move in a zero-size array (and XLA
        # would not split its output).
        if not stacked or x.size == 0:
            return x
        return jax.jit(lambda a: jnp.take(a, take, axis=0), out_shardings=x.sharding)(x)

    return jax.tree_util.tree_map_with_path(move, tree)
