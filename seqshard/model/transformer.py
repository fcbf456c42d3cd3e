"""The sharded forward pass: the embedding, the layers, the head and the loss, every transfer
written in the notation. The layer's blocks are their own modules (attention_block.py,
swiglu.py), each with its declarations beside its math; :mod:`seqshard.model.sharded` runs
this forward (or the hand-written backward, or the pipeline) in the model's one shard_map.

Dimensions (one vocabulary, two registers): weight types use config names (``d_model``,
``d_ff``, ``vocab``, ``n_q_per_kv``, ``n_kv``, ``d_head``); op specs use B (batch),
L (sequence), M (d_model), F (d_ff), V (vocab), Q (q heads per kv head), K (kv heads),
D (head dim); Qlen/Klen are L on the query and key side. Mesh axes: d (FSDP: batch and weight
rows), c (context: the sequence, in zigzag order ``L@zigzag/c``, and weight rows as d; see
context.py) and t (tensor: heads, d_ff, vocab, and the residual's M or L).

Per device, a layer holds the residual ``x`` and, per weight, one all-gather over (d, c) just
before use. The residual's layout is ``model.residual`` (``cfg.residual_spec``): Megatron's
sequence parallelism ``'B/d/e L@zigzag/c/t M'`` (``L/t``, the default) or
``'B/d/e L@zigzag/c M/t'`` (``M/t``). Each block gathers it over t to ``'B/d/e L@zigzag/c M'``
around its norm (after the norm for ``L/t``, which holds all of M per row; before it for
``M/t``) and reduce-scatters its output back: one model, other spec strings. Communication per
layer, forward (``remat=saved`` repeats the gathers in the backward pass, whose transposes add
the reduce-scatters of FSDP; ``model.backward=explicit`` writes that backward pass out, in
backward.py):

    all_gather over t,d,c  ln1, ln2                       (norm gains, tiny)
    all_gather over t      the residual around each norm (2) (activations: B/d/e L@zigzag/c M)
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

from seqshard.batch import TokenBatch
from seqshard.model import attention_block, moe, swiglu
from seqshard.model.attention import attention_mask, rope_frequencies, rope_tables
from seqshard.model.block import Activation, Activations, Block, elementwise, matmul
from seqshard.model.config import ModelConfig
from seqshard.model.context import SequenceRows, context_mask, sequence_rows
from seqshard.model.moe import RouterStats
from seqshard.model.norm import norm_input, norm_op, normed, rms_norm
from seqshard.model.weights import LAYER_BLOCKS, MOE_LAYER_BLOCKS, Layer, MoELayer, Weights
from seqshard.shardlib import collective_log, shardops
from seqshard.shardlib.collective_log import part
from seqshard.shardlib.dataflow import after
from seqshard.shardlib.remat import explicit_activation_checkpointing
from seqshard.shardlib.vma import varying_axes

__all__ = [
    "EMBED",
    "HEAD",
    "attention_inputs",
    "attention_output",
    "embed",
    "ffn",
    "final_hidden",
    "final_norm",
    "all_layers",
    "forward_terms_and_stats",
    "moe_layer",
    "moe_layer_forward",
    "run_moe_layers",
    "with_balancing_terms",
    "layer",
    "layer_forward",
    "loss_terms_and_softmax",
    "norm_input",
    "normed",
    "rms_norm",
    "rope_and_mask",
    "run_layers",
    "unembed",
]


EMBED = Block(
    name="embed",
    activations=(),
    ops=(
        # A lookup (each t shard selecting the rows of its vocab block is not counted); the
        # backward scatter-adds each token's cotangent into its row.
        elementwise("embed", "token", "B/d/e L M", lambda m: 0, lambda m: m.d_model),
        # angle = position * frequency, cos, sin, on D/2. Positions and masks (integer and
        # boolean work, once per step) are not counted.
        elementwise("rope_tables", "token", "B/d/e L D", lambda m: 3 * m.d_head // 2, lambda m: 0),
    ),
)
"""The operations before the layers (outside the checkpointed layer scan: never re-run)."""

HEAD = Block(
    name="head",
    activations=(
        Activation("ln", "M", "f32", "final_norm"),  # the final norm's gain, gathered
        Activation("gx", "B/d/e L/c M", "compute", "final_norm"),  # the residual with all of M
        Activation("nx", "B/d/e L/c M", "compute", "final_norm"),  # normed: the logits' input
        Activation("table", "V/t M", "compute", "logits"),  # the unembedding, gathered over d, c
    ),
    ops=(
        norm_op("final_norm", consumers=1),
        matmul(
            "logits", "token", "B/d/e L M, V/t M -> B/d/e L V/t", lambda m: 2 * m.d_model * m.vocab
        ),
        # logsumexp over the vocabulary: max, subtract, exp, sum (the per-position scalars
        # after it are not counted); backward softmax(logits) - onehot(target): 2 per logit.
        elementwise("loss", "token", "B/d/e L V/t", lambda m: 4 * m.vocab, lambda m: 2 * m.vocab),
    ),
)
"""The final norm, the unembedding and the loss, after the layers (never re-run)."""


def embed(cfg: ModelConfig, w: Weights, tokens: jax.Array) -> jax.Array:
    """'B/d/e L@zigzag/c' ids -> the residual (``cfg.residual_spec``) in compute dtype."""
    with part("embed"):
        table = shardops.all_gather(
            "V/t M/d/e/c -> V/t M", w.embed.astype(jnp.dtype(cfg.compute_dtype))
        )
        x = shardops.index_unreduced(
            "[V/t] M, B/d/e L@zigzag/c -> B/d/e L@zigzag/c M", table, tokens
        )
        # Each t shard looked up only the rows of its vocab block: sum the shards, scattered
        # into the residual's layout.
        return shardops.psum_scatter(f"B/d/e L@zigzag/c M -> {cfg.residual_spec}", x)


def layer_forward(
    cfg: ModelConfig, rows: SequenceRows, rope, mask: jax.Array | None, w: Layer, a: Activations
) -> jax.Array | None:
    """One pre-norm layer on the residual ``a['x']``, its blocks in order, every value written
    through ``a``: the forward (``a`` marks what remat keeps), and the hand-written backward
    rebuilding a layer from what its forward kept (:mod:`seqshard.model.backward`)."""
    attention_block.attention_inputs(cfg, w, a, rope)
    attention_block.attention_core(cfg, a, rows, mask)
    attention_block.attention_output(cfg, w, a)
    return swiglu.ffn(cfg, w, a)


def layer(cfg: ModelConfig, rows, rope, mask, x: jax.Array, w: Layer) -> tuple[jax.Array, None]:
    """One layer as a scan body: the residual in and out, what remat=saved keeps marked."""
    a = Activations(LAYER_BLOCKS, {"x": x}, mark=True)
    return layer_forward(cfg, rows, rope, mask, w, a), None


def attention_inputs(cfg: ModelConfig, w: Layer, x: jax.Array, rope) -> tuple[jax.Array, ...]:
    """The attention block's q, k, v of the residual ``x`` (generation's KV cache reads them)."""
    return attention_block.attention_inputs(cfg, w, Activations(LAYER_BLOCKS, {"x": x}), rope)


def attention_output(cfg: ModelConfig, w: Layer, x: jax.Array, attn: jax.Array) -> jax.Array:
    """The attention block's output projection of ``attn`` plus the residual ``x``: h."""
    a = Activations(LAYER_BLOCKS, {"x": x, "attn": attn})
    return attention_block.attention_output(cfg, w, a)


def ffn(cfg: ModelConfig, w: Layer | MoELayer, h: jax.Array) -> jax.Array:
    """A layer's FFN block on the residual ``h`` (SwiGLU, or the MoE FFN of a
    :class:`MoELayer`, its routing statistics dropped): a residual in compute dtype."""
    if isinstance(w, MoELayer):
        return moe.moe_ffn(cfg, w, Activations(MOE_LAYER_BLOCKS, {"h": h}))[0]
    return swiglu.ffn(cfg, w, Activations(LAYER_BLOCKS, {"h": h}))


def final_norm(
    cfg: ModelConfig, w: Weights, x: jax.Array, a: Activations | None = None
) -> jax.Array:
    """The residual -> final RMSNorm 'B/d/e L@zigzag/c M' in compute dtype (its values named in
    ``a`` when given: the hand-written backward keeps them)."""
    a = a or Activations((HEAD,))
    ln = a("ln", lambda: shardops.all_gather("M/t/d/e/c -> M", w.final_norm))
    gx = a("gx", lambda: norm_input(cfg, x))
    return a("nx", lambda: normed(cfg, gx, ln))


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
    body = functools.partial(layer, cfg, rows, rope, mask)
    body = explicit_activation_checkpointing(body, cfg.remat)
    x, _ = collective_log.scan("layers", body, x, layers)
    return x


def moe_layer_forward(
    cfg: ModelConfig, rows: SequenceRows, rope, mask: jax.Array | None, w: MoELayer, a: Activations
) -> tuple[jax.Array | None, RouterStats]:
    """One mixture-of-experts layer: the attention block, then the MoE FFN
    (:mod:`seqshard.model.moe`): (the residual, the layer's routing statistics)."""
    attention_block.attention_inputs(cfg, w, a, rope)
    attention_block.attention_core(cfg, a, rows, mask)
    attention_block.attention_output(cfg, w, a)
    return moe.moe_ffn(cfg, w, a)


def moe_layer(cfg: ModelConfig, rows, rope, mask, x: jax.Array, w: MoELayer):
    """One MoE layer as a scan body: the residual in and out, the layer's statistics out."""
    return moe_layer_forward(
        cfg, rows, rope, mask, w, Activations(MOE_LAYER_BLOCKS, {"x": x}, mark=True)
    )


def run_moe_layers(
    cfg: ModelConfig, rows: SequenceRows, x: jax.Array, layers: MoELayer
) -> tuple[jax.Array, RouterStats]:
    """The residual through the stacked MoE layers, scanned under ``cfg.remat``: (a residual,
    the :class:`RouterStats` of each layer, stacked)."""
    rope, mask = rope_and_mask(cfg, rows)
    body = functools.partial(moe_layer, cfg, rows, rope, mask)
    body = explicit_activation_checkpointing(body, cfg.remat)
    return collective_log.scan("moe_layers", body, x, layers)


@jax.custom_vjp
def gradients_after_input(w, x: jax.Array):
    """``(w, x)`` unchanged; in the backward pass, ``w``'s gradient is made to read ``x``'s
    (:func:`seqshard.shardlib.dataflow.after`, each leaf typed to allow it).

    Two layer stacks are two loops, and the backward pass of the first (the dense stack) runs
    after the MoE stack's has made its weights' gradients. The optimizer's global norm then
    all-reduces those gradients outside the shard_map, reading nothing of the later loop:
    XLA's CPU runtime may start it on one device while another is still in the loop's
    collectives (:mod:`seqshard.shardlib.collective_order`). Reading ``x``'s gradient, made
    by that loop, orders them."""
    return w, x


def _gradients_after_input_forward(w, x):
    return (w, x), None


def _gradients_after_input_backward(_, g):
    g_w, g_x = g
    typed = varying_axes(g_x)
    return jax.tree.map(lambda a: after(a, g_x) if typed <= varying_axes(a) else a, g_w), g_x


gradients_after_input.defvjp(_gradients_after_input_forward, _gradients_after_input_backward)


def all_layers(cfg: ModelConfig, w: Weights, rows: SequenceRows, x: jax.Array):
    """The residual through every layer: the dense stack (``layers``, if it has any) and, with
    experts, the MoE stack: (a residual, the MoE layers' stacked :class:`RouterStats` or None)."""
    if not cfg.moe.enabled:
        return run_layers(cfg, rows, x, w.layers), None
    moe_layers = w.moe_layers
    if cfg.dim_sizes()["layers"]:
        moe_layers, x = gradients_after_input(moe_layers, x)
        x = run_layers(cfg, rows, x, w.layers)
    return run_moe_layers(cfg, rows, x, moe_layers)


def with_balancing_terms(terms: jax.Array, stats: RouterStats | None) -> jax.Array:
    """The loss terms f32[2] with the MoE layers' balancing terms added, each once per
    microbatch weighted by its counted positions (see :mod:`seqshard.model.moe`)."""
    if stats is None:
        return terms
    return terms.at[0].add(terms[1] * jnp.sum(stats.aux + stats.z))


def final_hidden(cfg: ModelConfig, w: Weights, rows: SequenceRows) -> jax.Array:
    """Embedding, the scanned layers and the final norm: 'B/d/e L@zigzag/c M' in compute dtype."""
    x, _ = all_layers(cfg, w, rows, embed(cfg, w, rows.tokens))
    return final_norm(cfg, w, x)


def unembed(cfg: ModelConfig, w: Weights, nx: jax.Array, a: Activations | None = None) -> jax.Array:
    """'B/d/e L@zigzag/c M' -> logits 'B/d/e L@zigzag/c V/t' f32: each t shard computes the logits
    of its vocab block."""
    a = a or Activations((HEAD,))
    dt = jnp.dtype(cfg.compute_dtype)
    table = a("table", lambda: shardops.all_gather("V/t M/d/e/c -> V/t M", w.unembed.astype(dt)))
    return shardops.einsum_unreduced(
        "B/d/e L@zigzag/c M, V/t M -> B/d/e L@zigzag/c V/t",
        nx,
        table,
        out_dtype=jnp.float32,
    )


@part("loss")
def loss_terms_and_softmax(
    logits: jax.Array, targets: jax.Array, counted: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The loss terms f32[2], and the softmax's pieces the hand-written backward reuses:
    ``exp(logits - max)`` 'B/d/e L@zigzag/c V/t' and its sum over the whole vocab
    'B/d/e L@zigzag/c'. ``targets`` and ``counted`` are :class:`SequenceRows`'s: each position's
    next token and whether it counts (found on the whole row, before the split over c)."""
    # A stable logsumexp over the vocab split across t. The max only shifts the exponent, so it
    # needs no gradient (and pmax has none): take it of the stop-gradiented local max.
    local_max = jnp.max(logits, axis=-1)
    shift = shardops.pmax("B/d/e L@zigzag/c{U_t} -> B/d/e L@zigzag/c", lax.stop_gradient(local_max))
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
        "2 B/d/e L@zigzag/c{U_t} -> 2 B/d/e L@zigzag/c", jnp.stack([sum_exp, target_logit])
    )
    nll = jnp.log(sum_exp) + shift - target_logit
    counted = counted.astype(jnp.float32)
    local = jnp.stack([jnp.sum(nll * counted), jnp.sum(counted)])
    # Each (d, c) shard summed its own rows and positions of the batch: add them up.
    return shardops.psum("2{U_d,e,c} -> 2", local), exp, sum_exp


def forward_terms_and_stats(
    cfg: ModelConfig, w: Weights, batch: TokenBatch
) -> tuple[jax.Array, RouterStats | None]:
    """The forward pass on the per-device blocks 'B/d/e L/c' of ``batch`` (inside the
    shard_map): (f32[2], the summed loss, balancing terms included, and the positions counted;
    the MoE layers' routing statistics, or None without experts)."""
    rows = sequence_rows(batch.tokens, batch.is_seq_start, batch.loss_mask)
    x, stats = all_layers(cfg, w, rows, embed(cfg, w, rows.tokens))
    logits = unembed(cfg, w, final_norm(cfg, w, x))
    terms = loss_terms_and_softmax(logits, rows.targets, rows.counted)[0]
    return with_balancing_terms(terms, stats), stats
