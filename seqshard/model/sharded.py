"""The model in its one shard_map: the loss (and, by ``jax.grad``, its gradients) and the
logits of a batch, on any mesh.

    loss_fn(weights, tokens, is_seq_start, cfg, mesh)             mean next-token loss
    batch_loss_terms(weights, batch, cfg, mesh, pipeline)         (summed loss, positions counted)
    logits_fn(weights, tokens, is_seq_start, cfg, mesh)           'B/dp L/c V/t' logits

Which program runs inside the shard_map: on a mesh with p > 1 the pipelined layers
(:mod:`seqshard.model.pipeline.pipelined`); else transformer.py's forward, whose gradient is
the hand-written backward (:mod:`seqshard.model.backward`, ``model.backward=explicit``) or
autodiff's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from seqshard.batch import TokenBatch, token_batch
from seqshard.mesh import axis_size
from seqshard.model.backward import explicit_terms_and_aux
from seqshard.model.config import ModelConfig
from seqshard.model.context import sequence_rows
from seqshard.model.layers import aux_type
from seqshard.model.pipeline.pipelined import pipelined_terms_and_aux
from seqshard.model.pipeline.schedule import Pipeline
from seqshard.model.transformer import final_hidden, forward_terms_and_aux, unembed
from seqshard.model.vocab import next_token_nll
from seqshard.model.weights import Weights, check_mesh, weights_type
from seqshard.shardlib import shardops
from seqshard.shardlib.shardtypes import f32, typed_shard_map

__all__ = [
    "batch_loss_terms",
    "batch_terms_and_aux",
    "logits_fn",
    "loss_fn",
    "next_token_scores",
    "loss_sum_and_count",
]


def _typed(body, weights: type, out):
    """``body(w, batch)`` with the annotations typed_shard_map reads: ``w`` of the config's
    weights class (:func:`~seqshard.model.weights.weights_type`), ``out`` its result's type."""

    def fn(w, batch):
        return body(w, batch)

    fn.__annotations__ = {"w": weights, "batch": TokenBatch, "return": out}
    fn.__qualname__ = body.__qualname__
    return fn


@functools.lru_cache(maxsize=64)
def _sharded(cfg: ModelConfig, mesh: Mesh, output: str, pipeline: Pipeline):
    check_mesh(cfg, dict(mesh.shape))
    weights = weights_type(cfg)

    def loss_terms(w, batch: TokenBatch):
        if axis_size(mesh, "p") > 1:
            return pipelined_terms_and_aux(cfg, pipeline, w, batch)
        if cfg.backward == "explicit":
            # The same forward value; jax.grad runs backward.py's hand-written backward.
            return explicit_terms_and_aux(cfg, w, batch)
        return forward_terms_and_aux(cfg, w, batch)

    def logits(w, batch: TokenBatch):
        rows = sequence_rows(batch.tokens, batch.is_seq_start)
        out = unembed(cfg, w, final_hidden(cfg, w, rows))
        # Back to the natural order of the batch: gathered over c, reordered, split (all the
        # identity when c = 1). For tests and evaluation: training never gathers logits.
        out = shardops.all_gather("B/dp L@zigzag/c V/t -> B/dp L@zigzag V/t", out)
        out = shardops.reorder("B/dp L@zigzag V/t -> B/dp L V/t", out)
        return shardops.split("B/dp L V/t -> B/dp L/c V/t", out)

    def token_scores(w, batch: TokenBatch):
        rows = sequence_rows(batch.tokens, batch.is_seq_start)
        logits = unembed(cfg, w, final_hidden(cfg, w, rows))
        nll, _, sum_exp = next_token_nll(logits, rows.targets)
        # The target is the argmax exactly when its logit is the max (nll = log sum_exp).
        out = jnp.stack([nll, (nll == jnp.log(sum_exp)).astype(jnp.float32)])
        out = shardops.all_gather("2 B/dp L@zigzag/c -> 2 B/dp L@zigzag", out)
        out = shardops.reorder("2 B/dp L@zigzag -> 2 B/dp L", out)
        return shardops.split("2 B/dp L -> 2 B/dp L/c", out)

    terms_type = (f32["2"], aux_type(cfg))
    body, out = {
        "loss_terms": (loss_terms, terms_type),
        "logits": (logits, f32[b"B/dp L/c V/t"]),
        "token_scores": (token_scores, f32[b"2 B/dp L/c"]),
    }[output]
    return typed_shard_map(_typed(body, weights, out), mesh=mesh)


def batch_terms_and_aux(
    weights: Weights,
    batch: TokenBatch,
    cfg: ModelConfig,
    mesh: Mesh,
    pipeline: Pipeline | None = None,
) -> tuple[jax.Array, dict]:
    """(:func:`batch_loss_terms`, the stacks' auxiliary outputs of the batch,
    ``{stack: {block: {field: [layers, ...]}}}`` in the stored stacks' order, empty without
    any: :func:`~seqshard.model.layers.aux_type`). On a mesh with p > 1 the microbatches are
    the pipeline's: the outputs add up over them (``mean`` fields their mean) and the loss
    holds each microbatch's loss fields (:mod:`seqshard.model.pipeline.pipelined`)."""
    if pipeline is None or axis_size(mesh, "p") == 1:
        pipeline = Pipeline()  # one compiled program whatever the (unused) pipeline says
    terms, aux = _sharded(cfg, mesh, "loss_terms", pipeline)(weights, batch)
    return terms, aux


def batch_loss_terms(
    weights: Weights,
    batch: TokenBatch,
    cfg: ModelConfig,
    mesh: Mesh,
    pipeline: Pipeline | None = None,
) -> jax.Array:
    """f32[2]: the summed next-token loss over ``batch`` and the number of positions counted.

    Gradient accumulation adds these over microbatches and divides once, which gives exactly
    the full-batch mean even when packed documents make counts differ between microbatches.
    On a mesh with p > 1 the layers are pipelined (:mod:`seqshard.model.pipeline.pipelined`): the
    batch runs as ``pipeline.microbatches`` microbatches through the stages by
    ``pipeline.schedule``; ``pipeline`` is ignored at p = 1.
    """
    return batch_terms_and_aux(weights, batch, cfg, mesh, pipeline)[0]


def loss_sum_and_count(
    weights: Weights,
    tokens: jax.Array,
    is_seq_start: jax.Array,
    cfg: ModelConfig,
    mesh: Mesh,
    loss_mask: jax.Array | None = None,
) -> jax.Array:
    """:func:`batch_loss_terms` of ``token_batch(tokens, is_seq_start, loss_mask)``: f32[2]."""
    return batch_loss_terms(weights, token_batch(tokens, is_seq_start, loss_mask), cfg, mesh)


def loss_fn(
    weights: Weights,
    tokens: jax.Array,
    is_seq_start: jax.Array,
    cfg: ModelConfig,
    mesh: Mesh,
    loss_mask: jax.Array | None = None,
) -> jax.Array:
    """f32[]: mean next-token cross-entropy over the counted positions: whose next token is in
    the same document and masked in by ``loss_mask`` (None: every token counts).

    ``tokens: i32['B L']``, ``is_seq_start`` and ``loss_mask: bool['B L']`` are global arrays
    in any sharding; B must be divisible by the mesh's d axis.
    """
    total, count = loss_sum_and_count(weights, tokens, is_seq_start, cfg, mesh, loss_mask)
    return total / jnp.maximum(count, 1.0)


def next_token_scores(
    weights: Weights, batch: TokenBatch, cfg: ModelConfig, mesh: Mesh
) -> jax.Array:
    """f32['2 B L']: at each position, ``-log p(next token)`` and whether the next token is
    the argmax (1.0) or not, for scoring tasks (:mod:`seqshard.evals`): the forward, the
    head's logits over the vocabulary split across t reduced to those two numbers per
    position inside the shard_map (no logits leave it). Positions whose next token starts a
    document are scored too: the caller reads the ones it wants. Needs p = 1 (as
    :func:`logits_fn`)."""
    if axis_size(mesh, "p") != 1:
        raise ValueError(
            f"next_token_scores runs every layer on each device and needs mesh axis p = 1, got "
            f"p={axis_size(mesh, 'p')}. Restore the weights on a mesh with p = 1 (checkpoints "
            f"restore on any mesh)."
        )
    return _sharded(cfg, mesh, "token_scores", Pipeline())(weights, batch)


def logits_fn(
    weights: Weights, tokens: jax.Array, is_seq_start: jax.Array, cfg: ModelConfig, mesh: Mesh
) -> jax.Array:
    """f32['B L V']: next-token logits, sharded 'B/dp L/c V/t' as they come out of the shard_map.

    On a mesh with p = 1: each device runs every layer (a stage's block alone would give
    another model's logits)."""
    if axis_size(mesh, "p") != 1:
        raise ValueError(
            f"logits_fn runs every layer on each device and needs mesh axis p = 1, got "
            f"p={axis_size(mesh, 'p')}. Restore or place the weights on a mesh with p = 1 "
            f"(checkpoints restore on any mesh), or use batch_loss_terms, which pipelines."
        )
    return _sharded(cfg, mesh, "logits", Pipeline())(weights, token_batch(tokens, is_seq_start))
