"""The batch, declared in the notation like any weight: ``TokenBatch``.

    @pytree_dataclass
    class TokenBatch:
        tokens: i32[b'B/dp L/c']          # packed token ids: rows over d, positions over c
        is_seq_start: bool_[b'B/dp L/c']  # True at the first token of each packed document
        loss_mask: bool_[b'B/dp L/c']     # True where the token counts as a prediction target

The next-token pair (position ``i - 1`` predicts token ``i``) counts in the loss iff token
``i`` is in the same document (``not is_seq_start[i]``) and ``loss_mask[i]``: fine-tuning data
masks out its prompts (``seqshard prepare`` of prompt/completion or chat records); pretraining
data counts every token (all True). The loss is the sum over the counted pairs of the whole
global batch (every microbatch, every device) divided by their number, never a mean of means.

Every batch sharding comes from these types: the loader's arrays
(``shardings(TokenBatch, mesh)``), the train and eval steps' in_shardings, the model's
shard_map in_specs, ``seqshard show``'s abstract inputs (:func:`batch_structs`), and the
gradient-accumulation split (:func:`split_microbatches`, typed
``Array['microbatches', TokenBatch]``: ``'microbatches B/dp L/c'``).

The positions are in their natural order, split contiguously over the context axis c (the
loader's layout); the model reorders them into its zigzag layout itself
(:mod:`seqshard.model.context`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from seqshard.shardlib.shardtypes import (
    Array,
    bool_,
    i32,
    pytree_dataclass,
    shape_dtype_structs,
    shardings,
)

__all__ = ["TokenBatch", "batch_structs", "split_microbatches", "token_batch"]


@pytree_dataclass
class TokenBatch:
    """One global batch of packed rows, ``[B, L]`` each, rows split over d, positions over c."""

    tokens: i32[b"B/dp L/c"]
    is_seq_start: bool_[b"B/dp L/c"]
    loss_mask: bool_[b"B/dp L/c"]

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape


def token_batch(tokens, is_seq_start, loss_mask=None) -> TokenBatch:
    """A TokenBatch from any arrays of ids, starts and loss mask (None: every token counts),
    cast to int32 and bool, checked.

    Raises TypeError for non-integer ids and ValueError for shapes that are not one [B, L]."""
    tokens, is_seq_start = jnp.asarray(tokens), jnp.asarray(is_seq_start)
    loss_mask = jnp.ones(tokens.shape, bool) if loss_mask is None else jnp.asarray(loss_mask)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be integer ids, got dtype {tokens.dtype}.")
    if not tokens.shape == is_seq_start.shape == loss_mask.shape or tokens.ndim != 2:
        raise ValueError(
            f"tokens, is_seq_start and loss_mask must all be [batch, seq_len]; got "
            f"{tokens.shape}, {is_seq_start.shape} and {loss_mask.shape}."
        )
    return TokenBatch(
        tokens=tokens.astype(jnp.int32),
        is_seq_start=is_seq_start.astype(jnp.bool_),
        loss_mask=loss_mask.astype(jnp.bool_),
    )


def batch_structs(batch_size: int, seq_len: int, mesh: Mesh | None = None) -> TokenBatch:
    """``jax.ShapeDtypeStruct`` of each field, sharded as the types say on ``mesh`` (for lowering
    a step without data, e.g. ``seqshard show``)."""
    return shape_dtype_structs(TokenBatch, {"B": batch_size, "L": seq_len}, mesh)


def split_microbatches(batch: TokenBatch, k: int, mesh: Mesh) -> TokenBatch:
    """``'B/dp L/c'`` -> ``'microbatches B/dp L/c'``: row i goes to microbatch i % k.

    Each device's block of ``B/dp`` rows already holds its share of every microbatch (rows
    i, i+k, ... of a block stay on it), so with the layout pinned to the stacked type's
    sharding the split moves no data."""
    rows, length = batch.shape
    if rows % k:
        raise ValueError(f"a batch of {rows} rows does not split into {k} microbatches.")
    stacked = shardings(Array["microbatches", TokenBatch], mesh)

    def split(x: jax.Array, sharding) -> jax.Array:
        x = jnp.swapaxes(x.reshape(rows // k, k, length), 0, 1)
        return jax.lax.with_sharding_constraint(x, sharding)

    return jax.tree.map(split, batch, stacked)
