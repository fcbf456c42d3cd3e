"""The vocabulary's two ends inside the model's shard_map: the embedding lookup and the loss
over the vocabulary split across t (read by the forward, the pipeline's head and the
multi-token prediction modules: :mod:`seqshard.model.transformer`, :mod:`seqshard.model.mtp`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from seqshard.model.config import ModelConfig
from seqshard.shardlib import shardops
from seqshard.shardlib.collective_log import part

__all__ = [
    "embed_lookup",
    "embed_table",
    "loss_terms_and_softmax",
    "next_token_nll",
    "unembed_table",
]


def embed_table(cfg: ModelConfig, w) -> jax.Array:
    """The embedding 'V/t M' in compute dtype, gathered over d, e, c (FSDP)."""
    return shardops.all_gather("V/t M/fsdp -> V/t M", w.embed.astype(jnp.dtype(cfg.compute_dtype)))


def unembed_table(cfg: ModelConfig, w) -> jax.Array:
    """The unembedding 'V/t M' in compute dtype, gathered over d, e, c (FSDP)."""
    dt = jnp.dtype(cfg.compute_dtype)
    return shardops.all_gather("V/t M/fsdp -> V/t M", w.unembed.astype(dt))


def embed_lookup(cfg: ModelConfig, table: jax.Array, tokens: jax.Array) -> jax.Array:
    """'B/dp L@zigzag/c' ids -> the residual (``cfg.residual_spec``) in compute dtype, from
    :func:`embed_table`'s table."""
    x = shardops.index_unreduced("[V/t] M, B/dp L@zigzag/c -> B/dp L@zigzag/c M", table, tokens)
    # Each t shard looked up only the rows of its vocab block: sum the shards, scattered into
    # the residual's layout.
    return shardops.psum_scatter(f"B/dp L@zigzag/c M -> {cfg.residual_spec}", x)


@part("loss")
def loss_terms_and_softmax(
    logits: jax.Array, targets: jax.Array, counted: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The loss terms f32[2], and the softmax's pieces the hand-written backward reuses:
    ``exp(logits - max)`` 'B/dp L@zigzag/c V/t' and its sum over the whole vocab
    'B/dp L@zigzag/c'. ``targets`` and ``counted`` are :class:`SequenceRows`'s: each position's
    next token and whether it counts (found on the whole row, before the split over c)."""
    nll, exp, sum_exp = next_token_nll(logits, targets)
    counted = counted.astype(jnp.float32)
    local = jnp.stack([jnp.sum(nll * counted), jnp.sum(counted)])
    # Each (d, e, c) shard summed its own rows and positions of the batch: add them up.
    return shardops.psum("2{U_dp,c} -> 2", local), exp, sum_exp


@part("loss")
def next_token_nll(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each position's ``-log p(target)`` 'B/dp L@zigzag/c' (f32) from logits
    'B/dp L@zigzag/c V/t', with ``exp(logits - max)`` and its sum over the whole vocab."""
    # A stable logsumexp over the vocab split across t. The max only shifts the exponent, so it
    # needs no gradient (and pmax has none): take it of the stop-gradiented local max.
    local_max = jnp.max(logits, axis=-1)
    shift = shardops.pmax("B/dp L@zigzag/c{U_t} -> B/dp L@zigzag/c", lax.stop_gradient(local_max))
    exp = jnp.exp(logits - shift[..., None])
    sum_exp = jnp.sum(exp, axis=-1)
    # The target's logit lives on the one t shard whose vocab block holds it; others give 0.
    vocab_block = logits.shape[-1]
    local_target = targets - shardops.axis_index("t") * vocab_block
    here = (local_target >= 0) & (local_target < vocab_block)
    picked = jnp.take_along_axis(
        logits, jnp.clip(local_target, 0, vocab_block - 1)[..., None], axis=-1
    )
    target_logit = jnp.where(here, picked[..., 0], 0.0)
    # Both are partial over the vocab blocks: one all-reduce over t carries the pair.
    sum_exp, target_logit = shardops.psum(
        "2 B/dp L@zigzag/c{U_t} -> 2 B/dp L@zigzag/c", jnp.stack([sum_exp, target_logit])
    )
    return jnp.log(sum_exp) + shift - target_logit, exp, sum_exp
