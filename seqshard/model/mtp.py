"""Multi-token prediction (``model.mtp: {depth, loss_weight}``; DeepSeek-V3): sequential modules
after the layers, module k predicting the token k + 1 ahead of each position, their mean loss
weighted into the training loss.

    h^0 = the last layer's residual (before the final norm)
    for k in 1 .. depth:                                   (a scan over the stacked modules)
        x   = mtp_entry(h^{k-1}, embed(token i + k))       (seqshard.model.mtp_block)
        h^k = one transformer layer on x                   (the model's attention kind; MoE
                                                            with experts, as DeepSeek-V3)
        sum_k, count_k = cross-entropy of unembed(norm(h^k, head_norm)) against token i + k + 1
    summed loss += count x (loss_weight / depth x sum_k sum_k / count_k + the modules' MoE terms)

``count`` is the main loss's counted positions: the step's mean loss adds each module's mean
once per microbatch, as the MoE balancing terms are (:func:`seqshard.model.layers.with_aux_losses`).
The modules run before the head, which reads their result (:func:`mtp_before_head`).
The embedding and the output head are the model's own (shared, one gradient each); the tokens
ahead come with the batch's ids, gathered over c once (:func:`seqshard.model.context.sequence_rows`):
under zigzag context parallelism the token k ahead of a position may sit on another device, and
it arrives in that gather (int32 ids, no activation moving; MaxText refuses load-balanced
context parallelism with multi-token prediction instead). A target beyond the row or across a
packed document's boundary is not counted, so no counted position reads another document.

Per module, communication: the entry's (mtp_block.py), the transformer layer's, the head's
(the unembedding gathered once for all modules, the loss's two reductions per module).

Differentiation: under autodiff, the scan as the layers'. Under the explicit backward,
:mod:`seqshard.model.backward` re-runs :func:`mtp_loss` under ``jax.vjp`` (as a block without a
hand-written backward): the modules' gradients, and their share of dL/d(last residual), of the
embedding's and of the unembedding's. On a pipeline the last stage runs the modules beside the
head. Generation ignores them; they could draft depth tokens for speculative decoding (module
k's argmax as the guess of token i + k + 1), which seqshard does not do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from seqshard.model.block import Activations
from seqshard.model.config import ModelConfig
from seqshard.model.context import SequenceRows
from seqshard.model.layers import MTP_STACK, layer_forward, layer_inputs, mtp_stack
from seqshard.model.mtp_block import MTP_ENTRY
from seqshard.model.norm import norm_input, normed
from seqshard.model.vocab import (
    embed_lookup,
    embed_table,
    loss_terms_and_softmax,
    unembed_table,
)
from seqshard.shardlib import collective_log, shardops
from seqshard.shardlib.collective_log import part
from seqshard.shardlib.dataflow import after
from seqshard.shardlib.remat import explicit_activation_checkpointing

__all__ = ["gathered_tables", "mtp_before_head", "mtp_loss", "with_mtp"]


def mtp_loss(
    cfg: ModelConfig,
    w,
    rows: SequenceRows,
    x: jax.Array,
    remat: bool = True,
    tables: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, dict]:
    """(what the modules add to the mean loss, f32[]: loss_weight / depth x the sum of their
    mean losses, plus their MoE balancing terms; their auxiliary outputs ``{'mtp': {block:
    {field: [depth, ...]}}}``) from the last residual ``x``. ``remat``: each module under
    ``cfg.remat`` (autodiff); off where the caller's ``jax.vjp`` is itself the backward's
    re-run (the explicit backward), which would otherwise run each module a third time.
    ``tables``: the embedding and unembedding already gathered 'V/t M' (the explicit
    backward differentiates with respect to them), else gathered here."""
    stack = mtp_stack(cfg)
    inputs = layer_inputs(cfg, rows)
    modules = getattr(w, MTP_STACK)
    # Outside the modules' loop, once: the shared tables and every module's head-norm gain.
    table, out_table = tables or gathered_tables(cfg, w)
    with part("mtp_head"):
        gains = shardops.all_gather("Mtp M/t/fsdp -> Mtp M", modules.head_norm)

    def layer(h, emb, w_k):
        """The entry and the transformer layer: under ``cfg.remat`` as the model's layers."""
        a = Activations(stack.blocks, {"h_prev": h, "emb": emb}, mark=True)
        return layer_forward(cfg, stack.blocks, inputs, w_k, a)

    if remat:
        layer = explicit_activation_checkpointing(layer, cfg.remat)

    def module(h, xs):
        # The lookup and the head stay out of the checkpointed layer: autodiff keeps what
        # their backward reads, as it does the model's embedding's and head's.
        w_k, gain, tokens, targets, counted = xs
        with part("embed"):
            # Read after h: with one module (a loop XLA inlines) the lookup would otherwise
            # float ahead of the layers' loops (seqshard.shardlib.collective_order).
            emb = after(embed_lookup(cfg, table, tokens), h)
        h_new, aux = layer(h, emb, w_k)
        with part("mtp_head"):
            nx = normed(cfg, norm_input(cfg, h_new), gain)
            logits = shardops.einsum_unreduced(
                "B/dp L@zigzag/c M, V/t M -> B/dp L@zigzag/c V/t",
                nx,
                out_table,
                out_dtype=jnp.float32,
            )
        terms = loss_terms_and_softmax(logits, targets, counted)[0]
        aux[MTP_ENTRY.name] = {"loss": terms[0] / jnp.maximum(terms[1], 1.0)}
        return h_new, (terms, aux)

    ahead = rows.ahead
    xs = (modules, gains, ahead.tokens, ahead.targets, ahead.counted)
    _, (terms, aux) = collective_log.scan(MTP_STACK, module, x, xs)
    means = terms[:, 0] / jnp.maximum(terms[:, 1], 1.0)
    value = cfg.mtp.loss_weight / cfg.mtp.depth * jnp.sum(means)
    for b in stack.aux_blocks:  # the modules' MoE balancing terms, as the layers'
        for f in b.aux.loss:
            value = value + jnp.sum(aux[b.name][f])
    return value, {MTP_STACK: aux}


def gathered_tables(cfg: ModelConfig, w) -> tuple[jax.Array, jax.Array]:
    """The embedding and the unembedding 'V/t M' in compute dtype, gathered over d, e, c (the
    model's own gathers of them: one value each to XLA)."""
    with part("embed"):
        table = embed_table(cfg, w)
    with part("logits"):
        out_table = unembed_table(cfg, w)
    return table, out_table


def mtp_before_head(
    cfg: ModelConfig, w, rows: SequenceRows, x: jax.Array
) -> tuple[jax.Array, jax.Array | None, dict]:
    """The modules run on the last residual ``x`` before the head: (``x`` for the head, made to
    read their result, so that the head's collectives follow the modules' loop on every
    device (:mod:`seqshard.shardlib.collective_order`); :func:`mtp_loss`'s value and
    auxiliary outputs), or (``x``, None, {}) without ``model.mtp``."""
    if cfg.mtp.depth == 0:
        return x, None, {}
    value, aux = mtp_loss(cfg, w, rows, x)
    return after(x, value), value, aux


def with_mtp(terms: jax.Array, value: jax.Array | None) -> jax.Array:
    """The loss terms f32[2] with the modules' mean-loss ``value`` added once per counted
    position (the step's mean then adds it once per microbatch, as the MoE terms)."""
    if value is None:
        return terms
    return terms.at[0].add(jax.lax.stop_gradient(terms[1]) * value)
