"""The sharded forward pass: the embedding, the layers, the head and the loss, every transfer
written in the notation. The layers are stacks of blocks (:mod:`seqshard.model.layers`; each
block kind its own module with its declarations beside its math: attention_block.py,
swiglu.py, moe.py); :mod:`seqshard.model.sharded` runs
this forward (or the hand-written backward, or the pipeline) in the model's one shard_map.

Dimensions (one vocabulary, two registers): weight types use config names (``d_model``,
``d_ff``, ``vocab``, ``n_q_per_kv``, ``n_kv``, ``d_head``); op specs use B (batch),
L (sequence), M (d_model), F (d_ff), V (vocab), Q (q heads per kv head), K (kv heads),
D (head dim); Qlen/Klen are L on the query and key side. Mesh axes: d (FSDP: batch and weight
rows), e (experts; batch and weight rows as d outside the routed experts: moe.py), c
(context: the sequence, in zigzag order ``L@zigzag/c``, and weight rows as d; see context.py),
t (tensor: heads, d_ff, vocab, and the residual's M or L), and p (pipeline stages:
pipeline/pipelined.py).

Per device, a layer holds the residual ``x`` and, per weight, one all-gather over (d, e, c)
just before use. The residual's layout is ``model.residual`` (``cfg.residual_spec``): Megatron's
sequence parallelism ``'B/dp L@zigzag/c/t M'`` (``L/t``, the default) or
``'B/dp L@zigzag/c M/t'`` (``M/t``). Each block gathers it over t to ``'B/dp L@zigzag/c M'``
around its norm (after the norm for ``L/t``, which holds all of M per row; before it for
``M/t``) and reduce-scatters its output back: one model, other spec strings. Communication per
layer, forward (``remat=saved`` repeats the gathers in the backward pass, whose transposes add
the reduce-scatters of FSDP; ``model.backward=explicit`` writes that backward pass out, in
backward.py):

    all_gather over t,d,c  ln1, ln2                       (norm gains, tiny)
    all_gather over t      the residual around each norm (2) (activations: B/dp L@zigzag/c M)
    all_gather over d,c    w_q, w_kv, w_o, w_gate, w_up, w_down
    all_gather over c      k, v (allgather), or c-1 ring_shifts of each (ring)   (c > 1)
    psum_scatter over t    attention and FFN outputs (2)   (they contract a t-split dim)

With c = 1 (and any axis of size 1) the ops emit nothing over it: the program is the one
without the axis.

Matmuls take ``compute_dtype`` inputs; norms, attention scores, softmax, logits and the loss
are f32. The loss never gathers the vocabulary: each t shard holds ``V/t`` logits and only
per-position scalars (max, sum of exponentials, target logit) cross devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from seqshard.batch import TokenBatch
from seqshard.model.block import Activation, Activations, Block, elementwise, matmul
from seqshard.model.config import ModelConfig
from seqshard.model.context import SequenceRows, sequence_rows
from seqshard.model.layers import (
    gradients_after_input,
    layer_forward,
    rope_and_mask,
    run_stacks,
    with_aux_losses,
)
from seqshard.model.mtp import mtp_before_head, with_mtp
from seqshard.model.norm import norm_input, norm_op, normed, rms_norm
from seqshard.model.vocab import (
    embed_lookup,
    embed_table,
    loss_terms_and_softmax,
    unembed_table,
)
from seqshard.model.weights import Weights
from seqshard.shardlib import shardops
from seqshard.shardlib.collective_log import part
from seqshard.shardlib.dataflow import after

__all__ = [
    "EMBED",
    "HEAD",
    "after_attention",
    "embed",
    "final_hidden",
    "final_norm",
    "forward_terms_and_aux",
    "loss_terms_and_softmax",
    "norm_input",
    "normed",
    "rms_norm",
    "rope_and_mask",
    "unembed",
]


EMBED = Block(
    name="embed",
    activations=(),
    ops=(
        # A lookup (each t shard selecting the rows of its vocab block is not counted); the
        # backward scatter-adds each token's cotangent into its row.
        elementwise("embed", "token", "B/dp L M", lambda m: 0, lambda m: m.d_model),
        # angle = position * frequency, cos, sin, on D/2. Positions and masks (integer and
        # boolean work, once per step) are not counted.
        elementwise("rope_tables", "token", "B/dp L D", lambda m: 3 * m.d_head // 2, lambda m: 0),
    ),
)
"""The operations before the layers (outside the checkpointed layer scan: never re-run)."""

HEAD = Block(
    name="head",
    activations=(
        Activation("ln", "M", "f32", "final_norm"),  # the final norm's gain, gathered
        Activation("gx", "B/dp L/c M", "compute", "final_norm"),  # the residual with all of M
        Activation("nx", "B/dp L/c M", "compute", "final_norm"),  # normed: the logits' input
        Activation("table", "V/t M", "compute", "logits"),  # the unembedding, gathered over d, c
    ),
    ops=(
        norm_op("final_norm", consumers=1),
        matmul(
            "logits", "token", "B/dp L M, V/t M -> B/dp L V/t", lambda m: 2 * m.d_model * m.vocab
        ),
        # logsumexp over the vocabulary: max, subtract, exp, sum (the per-position scalars
        # after it are not counted); backward softmax(logits) - onehot(target): 2 per logit.
        elementwise("loss", "token", "B/dp L V/t", lambda m: 4 * m.vocab, lambda m: 2 * m.vocab),
    ),
)
"""The final norm, the unembedding and the loss, after the layers (never re-run)."""


def embed(cfg: ModelConfig, w: Weights, tokens: jax.Array) -> jax.Array:
    """'B/dp L@zigzag/c' ids -> the residual (``cfg.residual_spec``) in compute dtype."""
    with part("embed"):
        return embed_lookup(cfg, embed_table(cfg, w), tokens)


def after_attention(cfg: ModelConfig, blocks: tuple[Block, ...], w, h: jax.Array) -> jax.Array:
    """The blocks of a layer after its attention block on the residual ``h`` (generation runs
    them on the new positions): a residual in compute dtype, auxiliary outputs dropped."""
    rest = blocks[1:]
    a = Activations(rest, {rest[0].input: h})
    return layer_forward(cfg, rest, None, w, a)[0]


def final_norm(
    cfg: ModelConfig, w: Weights, x: jax.Array, a: Activations | None = None
) -> jax.Array:
    """The residual -> final RMSNorm 'B/dp L@zigzag/c M' in compute dtype (its values named in
    ``a`` when given: the hand-written backward keeps them)."""
    a = a or Activations((HEAD,))
    ln = a("ln", lambda: shardops.all_gather("M/t/fsdp -> M", w.final_norm))
    gx = a("gx", lambda: norm_input(cfg, x))
    return a("nx", lambda: normed(cfg, gx, ln))


def final_hidden(cfg: ModelConfig, w: Weights, rows: SequenceRows) -> jax.Array:
    """Embedding, the scanned layers and the final norm: 'B/dp L@zigzag/c M' in compute dtype."""
    x, _ = run_stacks(cfg, w, rows, embed(cfg, w, rows.tokens))
    return final_norm(cfg, w, x)


def unembed(cfg: ModelConfig, w: Weights, nx: jax.Array, a: Activations | None = None) -> jax.Array:
    """'B/dp L@zigzag/c M' -> logits 'B/dp L@zigzag/c V/t' f32: each t shard computes the logits
    of its vocab block."""
    a = a or Activations((HEAD,))
    table = a("table", lambda: unembed_table(cfg, w))
    return shardops.einsum_unreduced(
        "B/dp L@zigzag/c M, V/t M -> B/dp L@zigzag/c V/t",
        nx,
        table,
        out_dtype=jnp.float32,
    )


def forward_terms_and_aux(
    cfg: ModelConfig, w: Weights, batch: TokenBatch
) -> tuple[jax.Array, dict]:
    """The forward pass on the per-device blocks 'B/dp L/c' of ``batch`` (inside the
    shard_map): (f32[2], the summed loss, the blocks' loss terms included, and the positions
    counted; the stacks' auxiliary outputs, :func:`~seqshard.model.layers.run_stacks`)."""
    rows = sequence_rows(batch.tokens, batch.is_seq_start, batch.loss_mask, cfg.mtp.depth)
    x, aux = run_stacks(cfg, w, rows, embed(cfg, w, rows.tokens))
    a = Activations((HEAD,))
    if cfg.mtp.depth:
        # The multi-token prediction modules and the head both read the last residual. The
        # head's gathered inputs (its gain, table and the residual with all of M) are made
        # here, their gradients reading the modules' (one loop): so the reductions of those
        # gradients follow the modules' backward loop on every device, and the modules'
        # loop runs before the head's forward collectives (which read its result).
        a("ln", lambda: shardops.all_gather("M/t/fsdp -> M", w.final_norm))
        a("table", lambda: unembed_table(cfg, w))
        a("gx", lambda: norm_input(cfg, x))
        head, x = gradients_after_input((a["ln"], a["table"], a["gx"]), x)
        a.values.update(zip(("ln", "table", "gx"), head, strict=True))
    x, mtp, mtp_aux = mtp_before_head(cfg, w, rows, x)
    if mtp is not None:
        a.values["gx"] = after(a["gx"], mtp)
    logits = unembed(cfg, w, final_norm(cfg, w, x, a), a)
    terms = loss_terms_and_softmax(logits, rows.targets, rows.counted)[0]
    return with_mtp(with_aux_losses(cfg, terms, aux), mtp), {**aux, **mtp_aux}
