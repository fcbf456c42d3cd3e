"""The sharded forward pass and loss: one shard_map, every transfer written in the notation.

Dimensions (one vocabulary, two registers): weight types use config names (``d_model``,
``d_ff``, ``vocab``, ``n_q_per_kv``, ``n_kv``, ``d_head``); op specs use B (batch),
L (sequence), M (d_model), F (d_ff), V (vocab), Q (q heads per kv head), K (kv heads),
D (head dim); Qlen/Klen are L on the query and key side. Mesh axes: d (FSDP: batch and weight
rows), c (context: the sequence, in zigzag order ``L@zigzag/c``, and weight rows as d; see
context.py) and t (tensor: heads, d_ff, vocab, and the residual's M or L).

Per device, a layer holds the residual ``x`` and, per weight, one all-gather over (d, c) just
before use. The residual's layout is ``model.residual`` (``cfg.residual_spec``): Megatron's
sequence parallelism ``'B/d L@zigzag/c/t M'`` (``L/t``, the default) or
``'B/d L@zigzag/c M/t'`` (``M/t``). Each block gathers it over t to ``'B/d L@zigzag/c M'``
around its norm (after the norm for ``L/t``, which holds all of M per row; before it for
``M/t``) and reduce-scatters its output back: one model, other spec strings. Communication per
layer, forward (``remat=saved`` repeats the gathers in the backward pass, whose transposes add
the reduce-scatters of FSDP; ``model.backward=explicit`` writes that backward pass out, in
backward.py):

    all_gather over t,d,c  ln1, ln2                       (norm gains, tiny)
    all_gather over t      the residual around each norm (2) (activations: B/d L@zigzag/c M)
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

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from seqshard.batch import TokenBatch, token_batch
from seqshard.model.attention import apply_rope, attention_mask, rope_frequencies, rope_tables
from seqshard.model.config import ModelConfig
from seqshard.model.context import SequenceRows, attend, context_mask, sequence_rows
from seqshard.model.pipeline.schedule import Pipeline
from seqshard.model.remat import explicit_activation_checkpointing, save_for_backward
from seqshard.model.weights import Layer, Weights
from seqshard.shardlib import collective_log, shardops
from seqshard.shardlib.collective_log import part
from seqshard.shardlib.shardtypes import f32, typed_shard_map

__all__ = [
    "attention_inputs",
    "attention_output",
    "batch_loss_terms",
    "embed",
    "ffn",
    "final_norm",
    "forward_loss_terms",
    "logits_fn",
    "loss_fn",
    "loss_terms_and_softmax",
    "loss_sum_and_count",
    "next_token_targets",
    "norm_input",
    "normed",
    "rms_norm",
    "rope_and_mask",
    "run_layers",
    "unembed",
]


def rms_norm(x: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * gain over the last dimension, in f32."""
    x = x.astype(jnp.float32)
    gain = gain.reshape((1,) * (x.ndim - 1) + gain.shape)
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def norm_input(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """What the pre-norm normalizes: the residual with all of M. A residual split over M
    (``'B/d L@zigzag/c M/t'``) is gathered over t; one split over L (``'B/d L@zigzag/c/t M'``) already holds all of
    M for its rows and is normalized as it is (:func:`normed`)."""
    if cfg.residual == "M/t":
        return shardops.all_gather(f"{cfg.residual_spec} -> B/d L@zigzag/c M", x)
    return x


def normed(cfg: ModelConfig, x: jax.Array, gain: jax.Array) -> jax.Array:
    """RMSNorm of :func:`norm_input`'s ``x`` with the gathered ``gain`` 'M', as 'B/d L@zigzag/c M' in
    compute dtype: the projections need every row. Under ``model.residual=L/t`` each device
    normalizes its own rows (t times less work than on gathered rows), then the rows are
    gathered over t (Megatron's sequence parallelism)."""
    n = rms_norm(x, gain, cfg.norm_eps).astype(jnp.dtype(cfg.compute_dtype))
    if cfg.residual == "M/t":
        return n
    return shardops.all_gather(f"{cfg.residual_spec} -> B/d L@zigzag/c M", n)


def next_token_targets(tokens: jax.Array, is_seq_start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The next token at each position and whether it counts: ``[B, L]`` each.

    A position counts when a next token exists in the same document (the last position of a
    row and the last token of each packed document have no target).
    """
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    has_next = jnp.concatenate([~is_seq_start[:, 1:], jnp.zeros_like(is_seq_start[:, :1])], axis=1)
    return targets, has_next


def embed(cfg: ModelConfig, w: Weights, tokens: jax.Array) -> jax.Array:
    """'B/d L@zigzag/c' ids -> the residual (``cfg.residual_spec``) in compute dtype."""
    with part("embed"):
        table = shardops.all_gather(
            "V/t M/d/c -> V/t M", w.embed.astype(jnp.dtype(cfg.compute_dtype))
        )
        x = shardops.index_unreduced("[V/t] M, B/d L@zigzag/c -> B/d L@zigzag/c M", table, tokens)
        # Each t shard looked up only the rows of its vocab block: sum the shards, scattered
        # into the residual's layout.
        return shardops.psum_scatter(f"B/d L@zigzag/c M -> {cfg.residual_spec}", x)


def attention_inputs(cfg: ModelConfig, w: Layer, x: jax.Array, rope) -> tuple[jax.Array, ...]:
    """Pre-norm, then q 'B/d L@zigzag/c Q K/t D' and k, v 'B/d L@zigzag/c K/t D', q and k rotated by RoPE."""
    dt = jnp.dtype(cfg.compute_dtype)
    cos, sin = rope
    # The norm needs all of M; the projections, every row (norm_input, normed).
    with part("attn_norm"):
        ln1 = shardops.all_gather("M/t/d/c -> M", w.ln1)
        nx = normed(cfg, norm_input(cfg, x), ln1)
    with part("q"):
        w_q = shardops.all_gather("M/d/c Q K/t D -> M Q K/t D", w.w_q.astype(dt))
        q = shardops.einsum_unreduced(
            "B/d L@zigzag/c M, M Q K/t D -> B/d L@zigzag/c Q K/t D", nx, w_q
        )
    with part("kv"):
        w_kv = shardops.all_gather("2 M/d/c K/t D -> 2 M K/t D", w.w_kv.astype(dt))
        k, v = shardops.einsum_unreduced(
            "B/d L@zigzag/c M, 2 M K/t D -> 2 B/d L@zigzag/c K/t D", nx, w_kv
        )
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_output(cfg: ModelConfig, w: Layer, x: jax.Array, attn: jax.Array) -> jax.Array:
    """The output projection of attn 'B/d L@zigzag/c Q K/t D' plus the residual x: h, a residual."""
    dt = jnp.dtype(cfg.compute_dtype)
    with part("o"):
        w_o = shardops.all_gather("M/d/c Q K/t D -> M Q K/t D", w.w_o.astype(dt))
        out = shardops.einsum_unreduced(
            "B/d L@zigzag/c Q K/t D, M Q K/t D -> B/d L@zigzag/c M", attn, w_o
        )
        # Each t shard contracted only its own heads (K/t): sum the shards, scattered into the
        # residual's layout.
        out = shardops.psum_scatter(f"B/d L@zigzag/c M -> {cfg.residual_spec}", out)
    return x + out


def ffn(cfg: ModelConfig, w: Layer, h: jax.Array) -> jax.Array:
    """The pre-norm SwiGLU FFN plus the residual h: a residual in compute dtype."""
    dt = jnp.dtype(cfg.compute_dtype)
    with part("ffn_norm"):
        ln2 = shardops.all_gather("M/t/d/c -> M", w.ln2)
        nh = normed(cfg, norm_input(cfg, h), ln2)
    with part("gate"):
        w_gate = shardops.all_gather("M/d/c F/t -> M F/t", w.w_gate.astype(dt))
        gate = save_for_backward(
            shardops.einsum_unreduced("B/d L@zigzag/c M, M F/t -> B/d L@zigzag/c F/t", nh, w_gate)
        )
    with part("up"):
        w_up = shardops.all_gather("M/d/c F/t -> M F/t", w.w_up.astype(dt))
        up = save_for_backward(
            shardops.einsum_unreduced("B/d L@zigzag/c M, M F/t -> B/d L@zigzag/c F/t", nh, w_up)
        )
    y = jax.nn.silu(gate) * up
    with part("down"):
        w_down = shardops.all_gather("M/d/c F/t -> M F/t", w.w_down.astype(dt))
        out = shardops.einsum_unreduced("B/d L@zigzag/c F/t, M F/t -> B/d L@zigzag/c M", y, w_down)
        # Each t shard contracted only its own slice of F (F/t): sum the shards, scattered into
        # the residual's layout.
        out = shardops.psum_scatter(f"B/d L@zigzag/c M -> {cfg.residual_spec}", out)
    return (h + out).astype(dt)


def _layer(cfg: ModelConfig, rows, rope, mask, x: jax.Array, w: Layer) -> tuple[jax.Array, None]:
    """One pre-norm layer on the residual, marking what the backward pass keeps."""
    q, k, v = (save_for_backward(a) for a in attention_inputs(cfg, w, x, rope))
    attn = save_for_backward(attend(cfg, q, k, v, mask, rows))
    # Kept, so that only the 'full' policy repeats the attention psum_scatter to rebuild h.
    h = save_for_backward(attention_output(cfg, w, x, attn))
    return ffn(cfg, w, h), None


def final_norm(cfg: ModelConfig, w: Weights, x: jax.Array) -> jax.Array:
    """The residual -> final RMSNorm 'B/d L@zigzag/c M' in compute dtype."""
    with part("final_norm"):
        ln = shardops.all_gather("M/t/d/c -> M", w.final_norm)
        return normed(cfg, norm_input(cfg, x), ln)


def rope_and_mask(cfg: ModelConfig, rows: SequenceRows):
    """RoPE's (cos, sin) tables at each of this device's positions (within its document), and
    the attention mask for ``cfg``: with c = 1 :func:`~seqshard.model.attention.attention_mask`'s
    (splash: segment ids); with the sequence split over c, ``allgather``'s mask of this device's
    queries against every key (:func:`~seqshard.model.context.context_mask`), and none for the
    ring, which masks its own blocks. Per batch, cheap."""
    rope = rope_tables(rows.positions, rope_frequencies(cfg))
    c = shardops.axis_size("c")
    if c == 1:
        return rope, attention_mask(rows.is_seq_start, cfg.attention_mask, cfg.attention_impl)
    if cfg.ring_over(c):
        return rope, None
    return rope, context_mask(rows, cfg.attention_mask == "causal")


def run_layers(cfg: ModelConfig, rows: SequenceRows, x: jax.Array, layers: Layer) -> jax.Array:
    """The residual ``x`` through the stacked ``layers`` (all of them, or a pipeline stage's
    block), scanned, each layer under ``cfg.remat``: a residual."""
    rope, mask = rope_and_mask(cfg, rows)
    body = functools.partial(_layer, cfg, rows, rope, mask)
    body = explicit_activation_checkpointing(body, cfg.remat)
    x, _ = collective_log.scan("layers", body, x, layers)
    return x


def _final_hidden(cfg: ModelConfig, w: Weights, rows: SequenceRows) -> jax.Array:
    """Embedding, the scanned layers and the final norm: 'B/d L@zigzag/c M' in compute dtype."""
    x = run_layers(cfg, rows, embed(cfg, w, rows.tokens), w.layers)
    return final_norm(cfg, w, x)


def unembed(cfg: ModelConfig, w: Weights, nx: jax.Array) -> jax.Array:
    """'B/d L@zigzag/c M' -> logits 'B/d L@zigzag/c V/t' f32: each t shard computes the logits of its vocab block."""
    with part("logits"):
        table = shardops.all_gather(
            "V/t M/d/c -> V/t M", w.unembed.astype(jnp.dtype(cfg.compute_dtype))
        )
    return shardops.einsum_unreduced(
        "B/d L@zigzag/c M, V/t M -> B/d L@zigzag/c V/t",
        nx,
        table,
        preferred_element_type=jnp.float32,
    )


@part("loss")
def loss_terms_and_softmax(
    logits: jax.Array, targets: jax.Array, counted: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The loss terms f32[2], and the softmax's pieces the hand-written backward reuses:
    ``exp(logits - max)`` 'B/d L@zigzag/c V/t' and its sum over the whole vocab
    'B/d L@zigzag/c'. ``targets`` and ``counted`` are :class:`SequenceRows`'s: each position's
    next token and whether it counts (found on the whole row, before the split over c)."""
    # A stable logsumexp over the vocab split across t. The max only shifts the exponent, so it
    # needs no gradient (and pmax has none): take it of the stop-gradiented local max.
    local_max = jnp.max(logits, axis=-1)
    shift = shardops.pmax("B/d L@zigzag/c{U_t} -> B/d L@zigzag/c", lax.stop_gradient(local_max))
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
        "2 B/d L@zigzag/c{U_t} -> 2 B/d L@zigzag/c", jnp.stack([sum_exp, target_logit])
    )
    nll = jnp.log(sum_exp) + shift - target_logit
    counted = counted.astype(jnp.float32)
    local = jnp.stack([jnp.sum(nll * counted), jnp.sum(counted)])
    # Each (d, c) shard summed its own rows and positions of the batch: add them up.
    return shardops.psum("2{U_d,c} -> 2", local), exp, sum_exp


def forward_loss_terms(
    cfg: ModelConfig, w: Weights, tokens: jax.Array, is_seq_start: jax.Array
) -> jax.Array:
    """The forward pass on per-device blocks 'B/d L/c' (inside the shard_map): f32[2], the
    summed loss and the positions counted."""
    rows = sequence_rows(tokens, is_seq_start)
    logits = unembed(cfg, w, _final_hidden(cfg, w, rows))
    return loss_terms_and_softmax(logits, rows.targets, rows.counted)[0]


@functools.lru_cache(maxsize=64)
def _sharded(cfg: ModelConfig, mesh: Mesh, output: str, pipeline: Pipeline):
    cfg.check_mesh(dict(mesh.shape))

    @functools.partial(typed_shard_map, mesh=mesh)
    def loss_terms(w: Weights, batch: TokenBatch) -> f32["2"]:
        if mesh.shape["p"] > 1:
            from seqshard.model.pipeline.pipelined import (
                pipelined_loss_terms,  # it imports this module
            )

            return pipelined_loss_terms(cfg, pipeline, w, batch.tokens, batch.is_seq_start)
        if cfg.backward == "explicit":
            # The same forward value; jax.grad runs backward.py's hand-written backward.
            from seqshard.model.backward import explicit_loss_terms  # it imports this module

            return explicit_loss_terms(cfg, w, batch.tokens, batch.is_seq_start)
        return forward_loss_terms(cfg, w, batch.tokens, batch.is_seq_start)

    @functools.partial(typed_shard_map, mesh=mesh)
    def logits(w: Weights, batch: TokenBatch) -> f32[b"B/d L/c V/t"]:
        rows = sequence_rows(batch.tokens, batch.is_seq_start)
        out = unembed(cfg, w, _final_hidden(cfg, w, rows))
        # Back to the natural order of the batch: gathered over c, reordered, split (all the
        # identity when c = 1). For tests and evaluation: training never gathers logits.
        out = shardops.all_gather("B/d L@zigzag/c V/t -> B/d L@zigzag V/t", out)
        out = shardops.reorder("B/d L@zigzag V/t -> B/d L V/t", out)
        return shardops.split("B/d L V/t -> B/d L/c V/t", out)

    return {"loss_terms": loss_terms, "logits": logits}[output]


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
    if pipeline is None or mesh.shape["p"] == 1:
        pipeline = Pipeline()  # one compiled program whatever the (unused) pipeline says
    return _sharded(cfg, mesh, "loss_terms", pipeline)(weights, batch)


def loss_sum_and_count(
    weights: Weights, tokens: jax.Array, is_seq_start: jax.Array, cfg: ModelConfig, mesh: Mesh
) -> jax.Array:
    """:func:`batch_loss_terms` of ``token_batch(tokens, is_seq_start)``: f32[2]."""
    return batch_loss_terms(weights, token_batch(tokens, is_seq_start), cfg, mesh)


def loss_fn(
    weights: Weights, tokens: jax.Array, is_seq_start: jax.Array, cfg: ModelConfig, mesh: Mesh
) -> jax.Array:
    """f32[]: mean next-token cross-entropy over positions whose next token is in the same document.

    ``tokens: i32['B L']`` and ``is_seq_start: bool['B L']`` are global arrays in any sharding;
    B must be divisible by the mesh's d axis.
    """
    total, count = loss_sum_and_count(weights, tokens, is_seq_start, cfg, mesh)
    return total / jnp.maximum(count, 1.0)


def logits_fn(
    weights: Weights, tokens: jax.Array, is_seq_start: jax.Array, cfg: ModelConfig, mesh: Mesh
) -> jax.Array:
    """f32['B L V']: next-token logits, sharded 'B/d L/c V/t' as they come out of the shard_map.

    On a mesh with p = 1: each device runs every layer (a stage's block alone would give
    another model's logits)."""
    if mesh.shape["p"] != 1:
        raise ValueError(
            f"logits_fn runs every layer on each device and needs mesh axis p = 1, got "
            f"p={mesh.shape['p']}. Restore or place the weights on a mesh with p = 1 "
            f"(checkpoints restore on any mesh), or use batch_loss_terms, which pipelines."
        )
    return _sharded(cfg, mesh, "logits", Pipeline())(weights, token_batch(tokens, is_seq_start))
