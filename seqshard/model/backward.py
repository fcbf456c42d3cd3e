"""The hand-written backward pass of transformer.py's model (seed 001, Parts 3-4), in shardops.

    cfg = ModelConfig(..., backward="explicit")                     # model.backward=explicit
    jax.grad(loss_fn)(weights, tokens, is_seq_start, cfg, mesh)     # runs the backward below

Inside the model's shard_map, :func:`explicit_terms_and_stats` is a ``jax.custom_vjp`` over the
whole model. Its value is transformer.py's forward pass, unchanged (so eval and generation
are the same programs whichever backward is chosen); under differentiation its forward keeps
per layer what ``cfg.remat`` says (:func:`kept_activations`), and its backward is written out here, layer
by layer in reverse under ``lax.scan``, in the same notation as the forward. Gradients come
out in the weights' own layouts, as a :class:`~seqshard.model.weights.Weights`.

Dimensions and mesh axes as in transformer.py: B, L (Qlen, Klen), M, F, V, Q, K, D; d (FSDP:
batch and weight rows), t (tensor). Every weight's gradient follows one pattern, the
transpose of the forward's all_gather -> einsum:

    w = all_gather('M/d/e/c F/t -> M F/t', w)                          # again, as FSDP does
    dw = einsum_unreduced('B/d/e L@zigzag/c M, B/d/e L@zigzag/c F/t -> M F/t{U_d,e,c}', nx, dy)   # sums this B/d/e only
    dw = psum_scatter('M F/t{U_d,e,c} -> M/d/e/c F/t', dw)                 # FSDP's reduce-scatter

Communication per layer, backward pass (``remat=saved``; each line is the transpose of a
forward collective, or the forward's own collective repeated to recompute what is not kept):

    all_gather over t,d   ln1, ln2                       recomputed (tiny)
    all_gather over t     x, h                           recomputed: the norms' inputs
    all_gather over d     w_q, w_kv, w_o, w_gate, w_up, w_down   recomputed, as FSDP does
    all_gather over t     dL/dh, dL/dout                 transposes of the output psum_scatters
    psum_scatter over d   the six matrices' gradients    transposes of their gathers
    psum_scatter over t,d ln1, ln2 gradients             transposes of their gathers
    psum_scatter over t   dL/dx twice                    transposes of the residual's gathers
    psum over t,d,e,c     q_norm, k_norm gradients       model.qk_norm only: the gains rest replicated
    with c > 1:           allgather: k, v gathered over c again (recomputed) and dk, dv
                          reduce-scattered over c (their transposes); ring: the backward's
                          own ring (c-1 shifts of k and v, c of dk and dv; context.py)

(d in the weights' gathers and reduce-scatters stands for (d, c): weights are split over both.)

``remat=full`` recomputes the attention output's psum_scatter too (h is not kept);
``remat=none`` keeps every activation, gathered weights included, and recomputes nothing.
Outside the layers: the loss needs no collective (the per-position max and sums over the
vocab blocks were all-reduced in the forward and are kept), the unembedding and the three
norms reduce-scatter their gradients, and the embedding gathers dL/dx over t and
reduce-scatters its table over d. So the step holds exactly autodiff's collectives
(tests/model/test_backward.py counts them in the compiled HLO).

How the seed's open questions are resolved:

* **Residual 'B/d/e L@zigzag/c M' or 'B/d/e L@zigzag/c M/t'.** The forward's residual between blocks
  (``model.residual``: 'B/d/e L@zigzag/c M/t', or 'B/d/e L/t M' under sequence parallelism; every spec
  below that names the residual reads ``cfg.residual_spec``): the scan carries dL/dx split over t, and the seed's 'B/d/e L@zigzag/c M' gradient exists only
  inside a block, gathered over t just before the output projections' backward (the
  transposes of the forward's psum_scatters). Keeping 'B/d/e L@zigzag/c M' through the layer would need
  an all-reduce over t where the norms' partial sums meet the residual (the same bytes as
  reduce-scatter + all-gather) and t times the memory for the carry.
* **Where the sums over t happen.** Einsums that contract a t-split dimension (F/t into the
  FFN norm, K/t into the attention norm, V/t into the final norm) leave dL/d(normed input)
  owing a sum over t. The RMSNorm backward is linear in its cotangent (the gathered input it
  also reads is whole), so it runs on the partial sums, and the one reduce-scatter that
  transposes the residual's all_gather does the sum over t and lands it split over t: no
  all-reduce, nowhere.
* **Norm gains.** dL/dgain sums dy * x / rms(x) over this device's B/d/e rows of a dy that owes
  a sum over t: 'M{U_t,d,e,c}', reduced by one psum_scatter over (t, d) straight into
  'd_model/t/d/e/c', t major, the one order weights.py declares for all three norms (ln1, ln2,
  final_norm) and their forward all_gathers read.
* **Why gather a weight only to reduce-scatter its gradient (the seed's TODO at unembed).**
  The table rests split 'V/t M/d/e/c' (FSDP); the logits contract all of M, so it is gathered
  over d. Each d shard then holds other batch rows, so its gradient of the whole gathered
  table is a partial sum over d: the psum_scatter adds the shards' partials and hands each
  one its own M/d/e/c block, the layout the optimizer updates. It is the gather's transpose and
  the gradient's only communication (the same for every matrix).
* **index_add.** :func:`seqshard.shardlib.shardops.index_add`, the transpose of ``index_unreduced``:
  each t shard scatter-adds the rows of its vocab block, owing the other d shards' rows, and
  a psum_scatter over d lands the table gradient 'V/t M/d/e/c'.
* **Fused attention.** For ``attention_impl`` cudnn, xla and splash the backward calls the
  implementation's own VJP (``jax.vjp``) for the attention core only (softmax(q k^T) v); it
  re-runs the kernel's forward for its residuals, as those kernels do. Einsum attention
  (and everything around every core) is hand-written.

Numerics mirror autodiff of the forward: cotangents of compute-dtype values are in the
compute dtype (so matrix gradients are reduce-scattered in it, as autodiff transposes the
gather of the cast weight), norms, softmax, logits and the loss are in f32, and every gradient
is cast to f32, the weights' dtype. In f32 the gradients equal autodiff's to rounding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import operator
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from seqshard.batch import TokenBatch
from seqshard.model import attention_block, moe
from seqshard.model.attention import apply_rope, attention_vjp, resolve_impl
from seqshard.model.block import Activations as BlockActivations
from seqshard.model.block import kept
from seqshard.model.config import ModelConfig
from seqshard.model.context import SequenceRows, ring_backward, sequence_rows
from seqshard.model.moe import ExpertFfnWeights, RouterStats
from seqshard.model.transformer import (
    HEAD,
    embed,
    final_norm,
    forward_terms_and_stats,
    layer_forward,
    loss_terms_and_softmax,
    moe_layer_forward,
    rope_and_mask,
    run_layers,
    run_moe_layers,
    unembed,
    with_balancing_terms,
)
from seqshard.model.weights import LAYER_BLOCKS, MOE_LAYER_BLOCKS, Layer, MoELayer, Weights
from seqshard.shardlib import collective_log, shardops
from seqshard.shardlib.collective_log import part
from seqshard.shardlib.dataflow import varying_over_stages
from seqshard.shardlib.shapecheck import block_axes, block_axes_scope, shape_scope

__all__ = [
    "ACTIVATIONS",
    "attention_backward",
    "embed_backward",
    "explicit_run_moe_layers",
    "explicit_terms_and_stats",
    "explicit_run_layers",
    "head_backward",
    "head_forward",
    "kept_activations",
    "layer_activations",
    "layer_backward",
    "moe_layer_backward",
    "swiglu_backward",
    "attention_half_backward",
    "norm_backward",
    "normed_projections_backward",
    "output_projection_backward",
    "projections_backward",
    "qk_norm_backward",
    "rms_norm_backward",
]

Activations = dict[str, jax.Array]

ACTIVATIONS: tuple[str, ...] = tuple(
    a.name for block in LAYER_BLOCKS for a in block.activations if a.needed
)
"""One layer's activations in the order of its forward pass: everything its backward reads
(declared with the blocks: :data:`seqshard.model.attention_block.ATTENTION`,
:data:`seqshard.model.swiglu.SWIGLU`)."""


def kept_activations(cfg: ModelConfig, c: int = 1) -> tuple[str, ...]:
    """What the forward pass keeps per layer under ``cfg.remat`` on a mesh whose context axis
    has size ``c`` (:func:`seqshard.model.block.kept` of the layer's blocks): ``saved`` the
    values the blocks mark, ``full`` the layer input, ``none`` everything the backward reads
    (fused attention has no probabilities, only the ring a logsumexp, and with c = 1 the keys
    are k itself)."""
    return kept(LAYER_BLOCKS, cfg, c)


def _einsum_attention(cfg: ModelConfig) -> bool:
    """Attention whose backward is written here; fused kernels bring their own VJP."""
    return resolve_impl(cfg.attention_impl) == "einsum"


# ---------------------------------------------------------------------------------------------
# One layer: its forward as named activations, and its backward


def layer_activations(
    cfg: ModelConfig,
    rows: SequenceRows,
    rope,
    mask: jax.Array | None,
    w: Layer,
    kept_values: Mapping[str, jax.Array],
) -> Activations:
    """One layer's activations for its backward: transformer.py's layer forward itself
    (:func:`~seqshard.model.transformer.layer_forward`), taking what the forward pass kept
    (at least the input ``x``) as it is and computing every other value the backward reads
    from the ones before it, nothing more (not the down projection: no backward reads it)."""
    a = BlockActivations(LAYER_BLOCKS, kept_values, explicit=True, only_needed=True)
    layer_forward(cfg, rows, rope, mask, w, a)
    return a.values


def norm_backward(
    cfg: ModelConfig, x: jax.Array, gain: jax.Array, d_n: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The transpose of ``normed(cfg, x, gain)`` and of the gather in ``norm_input``: dL/d(the
    residual) in its layout (compute dtype) and the gain's gradient 'M/t/d/e/c' (f32), from
    ``d_n``, dL/d(normed rows) 'B/d/e L@zigzag/c M' owing a sum over t (the projections contracted a
    t-split dimension). ``x`` is what :func:`~seqshard.model.transformer.norm_input` gave."""
    dt, residual = jnp.dtype(cfg.compute_dtype), cfg.residual_spec
    if cfg.residual == "M/t":
        # The norm's backward is linear in its cotangent (and reads the gathered x, whole), so
        # it runs on the partial sums; the transpose of the residual's gather over t sums them
        # as it scatters.
        d_x, d_gain = rms_norm_backward(x, gain, d_n, cfg.norm_eps)
        d_x = shardops.psum_scatter(f"B/d/e L@zigzag/c M{{U_t}} -> {residual}", d_x.astype(dt))
    else:
        # The transpose of the gather of the normed rows: summed over t, each shard its own
        # rows; then the norm's backward on them, local.
        d_n = shardops.psum_scatter(f"B/d/e L@zigzag/c M{{U_t}} -> {residual}", d_n.astype(dt))
        d_x, d_gain = rms_norm_backward(x, gain, d_n, cfg.norm_eps)
        d_x = d_x.astype(dt)
    # Summed over this device's rows, partial over t (partial sums, or other rows): one
    # reduce-scatter over both, into the gain's 'M/t/d/e/c' (the transpose of its gather).
    return d_x, shardops.psum_scatter("M{U_t,d,e,c} -> M/t/d/e/c", d_gain)


def rms_norm_backward(
    x: jax.Array, gain: jax.Array, dy: jax.Array, eps: float
) -> tuple[jax.Array, jax.Array]:
    """The VJP of :func:`~seqshard.model.transformer.rms_norm`, in f32: (dL/dx, dL/dgain).

    ``x`` is the norm's whole input (all of the last dimension), ``dy`` the cotangent of its
    output; dL/dgain is summed over every leading dimension. Both are linear in ``dy``, so a
    ``dy`` that owes a sum over a mesh axis gives results that owe the same sum.
    """
    x, dy = x.astype(jnp.float32), dy.astype(jnp.float32)
    inv_rms = lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    normed = x * inv_rms
    d_gain = jnp.sum(dy * normed, axis=tuple(range(x.ndim - 1)))
    d_normed = dy * gain.reshape((1,) * (x.ndim - 1) + gain.shape)
    # d/dx of x / rms(x): take out the component of d_normed along normed, then / rms(x).
    along = jnp.mean(d_normed * normed, axis=-1, keepdims=True)
    return (d_normed - normed * along) * inv_rms, d_gain


def attention_backward(
    cfg: ModelConfig, rows: SequenceRows, mask: jax.Array | None, a: Activations, d_attn: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dL/dq 'B/d/e L@zigzag/c Q K/t D' and dL/dk, dL/dv 'B/d/e L@zigzag/c K/t D' from dL/dattn; per device (each t
    shard holds whole kv heads and their query heads), no communication.

    Einsum attention: written out. Fused kernels (cudnn, xla, splash): the implementation's
    own VJP for this core only (:func:`seqshard.model.attention.attention_vjp`: cudnn and xla
    re-run their forward for its residuals; splash's backward re-runs its kernel itself).
    """
    q, c, causal_only = a["q"], shardops.axis_size("c"), cfg.attention_mask == "causal"
    if cfg.ring_over(c):  # its own backward: k, v and their gradients around the ring again
        with part("context"):
            args = (a["k"], a["v"], a["attn"], a["lse"], rows.segments, causal_only, d_attn)
            return ring_backward(q, *args)
    k, v = a["keys"], a["values"]
    if not _einsum_attention(cfg):
        impl = cfg.attention_impl
        dq, dk, dv = attention_vjp(q, k, v, mask, impl, causal_only and c == 1, d_attn)
    else:
        dq, dk, dv = _einsum_attention_backward(a["probs"], q, k, v, d_attn)
    # Each c shard's queries reached every key: the transposes of the gathers over c sum the
    # shards' partial gradients, each keeping its own positions (nothing moves when c = 1).
    with part("context"):
        spec = "B/d/e L@zigzag K/t D{U_c} -> B/d/e L@zigzag/c K/t D"
        return dq, shardops.psum_scatter(spec, dk), shardops.psum_scatter(spec, dv)


def _einsum_attention_backward(probs, q, k, v, d_attn):
    """dq and the gathered keys' dk, dv (owing a sum over c) of attention.py's einsum
    attention, from its probabilities."""
    # attn = probs . v
    d_probs = shardops.einsum_unreduced(
        "B/d/e Qlen@zigzag/c Q K/t D, B/d/e Klen@zigzag K/t D -> B/d/e K/t Q Qlen@zigzag/c Klen@zigzag",
        d_attn,
        v,
        out_dtype=jnp.float32,
    )
    dv = shardops.einsum_unreduced(
        "B/d/e K/t Q Qlen@zigzag/c Klen@zigzag, B/d/e Qlen@zigzag/c Q K/t D -> B/d/e Klen@zigzag K/t D",
        probs.astype(v.dtype),
        d_attn,
    )
    # softmax over Klen, in f32. A masked key has probability exactly 0, so its score's
    # gradient is 0 too: the mask needs no second application.
    d_scores = probs * (d_probs - jnp.sum(probs * d_probs, axis=-1, keepdims=True))
    d_scores = (d_scores * (1 / math.sqrt(q.shape[-1]))).astype(q.dtype)
    # scores = q . k (each kv head's gradient sums over its Q query heads)
    dq = shardops.einsum_unreduced(
        "B/d/e K/t Q Qlen@zigzag/c Klen@zigzag, B/d/e Klen@zigzag K/t D -> B/d/e Qlen@zigzag/c Q K/t D",
        d_scores,
        k,
    )
    dk = shardops.einsum_unreduced(
        "B/d/e K/t Q Qlen@zigzag/c Klen@zigzag, B/d/e Qlen@zigzag/c Q K/t D -> B/d/e Klen@zigzag K/t D",
        d_scores,
        q,
    )
    return dq, dk, dv


# A block's rows, as its projections see them (a microbatch's, zigzagged over c).
_ROWS = "B/d/e L@zigzag/c"


def projections_backward(
    x: jax.Array,
    projections: Sequence[tuple[str, str, jax.Array, jax.Array]],
    part_name: str,
) -> tuple[jax.Array, list[jax.Array]]:
    """The backward of projections ``y_i = x . w_i`` of one normed input ``x``
    'B/d/e L@zigzag/c M', each given as (y's spec, the gathered weight's spec, dL/dy_i, w_i):
    dL/dx, which owes the sum over t of the contracted t-split dims, and each weight's
    gradient in its FSDP layout 'M/d/e/c ...'::

        dx  = sum_i einsum_unreduced('Y_i, W_i -> B/d/e L@zigzag/c M{U_t}', dy_i, w_i)
        dw_i = einsum_unreduced('B/d/e L@zigzag/c M, Y_i -> W_i{U_d,e,c}', x, dy_i)
        dw_i = psum_scatter('W_i{U_d,e,c} -> W_i with M/d/e/c', dw_i)
    """
    rows = f"{_ROWS} M"
    d_x = functools.reduce(
        operator.add,
        (
            shardops.einsum_unreduced(f"{y}, {w} -> {rows}{{U_t}}", dy, weight)
            for y, w, dy, weight in projections
        ),
    )
    d_ws = [
        shardops.einsum_unreduced(f"{rows}, {y} -> {w}{{U_d,e,c}}", x, dy)
        for y, w, dy, _ in projections
    ]
    # Each d shard summed over its own B/d/e rows: sum the shards, keep FSDP's M/d/e/c.
    with part(part_name):
        d_ws = [
            shardops.psum_scatter(f"{w}{{U_d,e,c}} -> {w.replace('M', 'M/d/e/c', 1)}", dw)
            for (_, w, _, _), dw in zip(projections, d_ws, strict=True)
        ]
    return d_x, d_ws


# The activations of a block's input side (x, norm(x)), its gain and the norm's part.
_ATTENTION_INPUT = ("gx", "nx", "ln1", "attn_norm")
_FFN_INPUT = ("gh", "nh", "ln2", "ffn_norm")


def normed_projections_backward(
    cfg: ModelConfig,
    a: Activations,
    norm: tuple[str, str, str, str],
    projections: Sequence[tuple[str, str, jax.Array]],
    part_name: str,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The backward of a block's input side, ``y_i = norm(x) . w_i``: ``norm`` names the
    activations x and norm(x), the gain and the norm's part (``_ATTENTION_INPUT``); each
    projection is (its weight's name, the gathered weight's spec 'W_i', dL/dy_i), y_i's spec
    being W_i with M replaced by the rows. Returns dL/dx (whole: the norm's backward sums the
    t shards) and the gradients {gain, w_i} (the w_i in f32)."""
    x, normed, gain, norm_part = norm
    d_n, d_ws = projections_backward(
        a[normed],
        [(w.replace("M", _ROWS, 1), w, dy, a[n]) for n, w, dy in projections],
        part_name,
    )
    # d_n still owes the sum over t of the contracted t-split dims.
    with part(norm_part):
        d_x, d_gain = norm_backward(cfg, a[x], a[gain], d_n)
    named = {name: dw.astype(jnp.float32) for (name, *_), dw in zip(projections, d_ws, strict=True)}
    return d_x, {gain: d_gain, **named}


def output_projection_backward(
    cfg: ModelConfig, d_out: jax.Array, x: jax.Array, w: jax.Array, dims: str, part_name: str
) -> tuple[jax.Array, jax.Array]:
    """The backward of an output projection ``out = psum_scatter(x . w)`` (attention's o, the
    FFN's down) of ``x`` 'B/d/e L@zigzag/c X' (``dims`` is X, t-split) and the gathered ``w``
    'M X': (dL/dx, dL/dw in FSDP's layout 'M/d/e/c X'). The forward reduce-scattered over t;
    its transpose gathers dL/d(out) over t, so each t shard has all of M against its X::

        g  = all_gather('<residual> -> B/d/e L@zigzag/c M', d_out)
        dx = einsum_unreduced('B/d/e L@zigzag/c M, M X -> B/d/e L@zigzag/c X', g, w)
        dw = einsum_unreduced('B/d/e L@zigzag/c X, B/d/e L@zigzag/c M -> M X{U_d,e,c}', x, g)
        dw = psum_scatter('M X{U_d,e,c} -> M/d/e/c X', dw)
    """
    with part(part_name):
        g = shardops.all_gather(f"{cfg.residual_spec} -> {_ROWS} M", d_out)
        d_x = shardops.einsum_unreduced(f"{_ROWS} M, M {dims} -> {_ROWS} {dims}", g, w)
        d_w = shardops.einsum_unreduced(f"{_ROWS} {dims}, {_ROWS} M -> M {dims}{{U_d,e,c}}", x, g)
        # Each d shard summed over its own B/d/e rows: sum the shards, keep FSDP's M/d/e/c.
        d_w = shardops.psum_scatter(f"M {dims}{{U_d,e,c}} -> M/d/e/c {dims}", d_w)
    return d_x, d_w


def swiglu_backward(
    cfg: ModelConfig, a: Activations, d_out: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The SwiGLU block's backward: dL/dh (a residual) and its weights' gradients (f32, in
    their layouts), from its activations and dL/d(output) ``d_out``."""
    f32 = jnp.float32
    # --- out = h + psum_scatter(swiglu(nh) . w_down) --------------------------------------
    # The forward reduce-scattered the down projection over t; its transpose gathers the
    # gradient over t, so each t shard has all of M against its slice of F.
    d_y, d_w_down = output_projection_backward(cfg, d_out, a["y"], a["w_down"], "F/t", "down")
    gate, up = a["gate"], a["up"]
    # y = silu(gate) * up, silu(z) = z * sigmoid(z)
    sig = jax.nn.sigmoid(gate)
    d_up = d_y * (gate * sig)
    d_gate = d_y * up * (sig * (1 + gate * (1 - sig)))
    d_gh, grads = normed_projections_backward(
        cfg, a, _FFN_INPUT, [("w_gate", "M F/t", d_gate), ("w_up", "M F/t", d_up)], "gate_up"
    )
    return d_out + d_gh, {**grads, "w_down": d_w_down.astype(f32)}


def attention_half_backward(
    cfg: ModelConfig,
    rows: SequenceRows,
    rope,
    mask: jax.Array | None,
    a: Activations,
    d_h: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The attention block's backward: dL/dx (a residual) and its weights' gradients (f32, in
    their layouts), from its activations and dL/dh ``d_h``."""
    f32 = jnp.float32
    cos, sin = rope
    # --- h = x + psum_scatter(attn . w_o) --------------------------------------------------
    # As for the down projection: the transpose of the output's psum_scatter over t.
    d_attn, d_w_o = output_projection_backward(cfg, d_h, a["attn"], a["w_o"], "Q K/t D", "o")
    d_q, d_k, d_v = attention_backward(cfg, rows, mask, a, d_attn)
    # RoPE is a rotation per position: its transpose rotates back (sin -> -sin).
    d_q = apply_rope(d_q, cos, -sin)
    d_k = apply_rope(d_k, cos, -sin)
    if cfg.qk_norm:
        d_q, d_k, qk_grads = qk_norm_backward(cfg, a, d_q, d_k)
    else:
        # The gains are [0]: so are their gradients, typed as the layer's weights are (varying
        # over p in a pipeline stage).
        empty = varying_over_stages(jnp.zeros((0,), f32))
        qk_grads = {"q_norm": empty, "k_norm": empty}
    d_kv = jnp.stack([d_k, d_v])
    d_gx, grads = normed_projections_backward(
        cfg, a, _ATTENTION_INPUT, [("w_q", "M Q K/t D", d_q), ("w_kv", "2 M K/t D", d_kv)], "q_kv"
    )
    return d_h + d_gx, {**grads, "w_o": d_w_o.astype(f32), **qk_grads}


def qk_norm_backward(
    cfg: ModelConfig, a: Activations, d_q: jax.Array, d_k: jax.Array
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """The transpose of ``model.qk_norm``'s head norms: dL/d(q before its norm)
    'B/d/e L@zigzag/c Q K/t D' and dL/d(k before it) 'B/d/e L@zigzag/c K/t D' (compute dtype),
    from the cotangents of the normed q and k, and the gains' gradients 'D' (f32)."""
    dt = jnp.dtype(cfg.compute_dtype)
    with part("qk_norm"):
        d_q, d_q_norm = rms_norm_backward(a["q_proj"], a["q_norm"], d_q, cfg.norm_eps)
        d_k, d_k_norm = rms_norm_backward(a["k_proj"], a["k_norm"], d_k, cfg.norm_eps)
        # Each gain's gradient summed over this device's rows (B/d/e, L/c) and heads (K/t):
        # summed over every device, the gains rest replicated.
        d_q_norm = shardops.psum("D{U_t,d,e,c} -> D", d_q_norm)
        d_k_norm = shardops.psum("D{U_t,d,e,c} -> D", d_k_norm)
    return d_q.astype(dt), d_k.astype(dt), {"q_norm": d_q_norm, "k_norm": d_k_norm}


def layer_backward(
    cfg: ModelConfig,
    rows: SequenceRows,
    rope,
    mask: jax.Array | None,
    a: Activations,
    d_out: jax.Array,
) -> tuple[jax.Array, Layer]:
    """dL/dx (a residual) and the layer's weight gradients (a :class:`Layer`, each field in its
    own sharded layout, f32), from the layer's activations and dL/d(output) ``d_out``: the
    SwiGLU block's backward, then the attention block's."""
    d_h, ffn = swiglu_backward(cfg, a, d_out)
    d_x, attention = attention_half_backward(cfg, rows, rope, mask, a, d_h)
    return d_x, Layer(**attention, **ffn)


def moe_layer_backward(
    cfg: ModelConfig,
    rows: SequenceRows,
    rope,
    mask: jax.Array | None,
    w: MoELayer,
    a: Activations,
    d_out: jax.Array,
    d_balancing: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, MoELayer]:
    """dL/dx and the MoE layer's gradients. Its FFN (the routing, the exchanges over e and the
    grouped matmuls) is differentiated by ``jax.vjp`` from its input h: its forward re-runs
    there (logged as recomputed, with the transposes of its collectives as the backward's:
    :func:`seqshard.shardlib.collective_log.vjp_in_backward`); ``d_balancing`` is (dL/d(the
    layer's aux term), dL/d(its z term)). Then the attention block's hand-written backward."""
    ffn_fields = [f.name for f in dataclasses.fields(ExpertFfnWeights)]

    def ffn(h, w_ffn):
        moe_w = dataclasses.replace(w, **w_ffn)
        out, stats = moe.moe_ffn(cfg, moe_w, BlockActivations(MOE_LAYER_BLOCKS, {"h": h}))
        return out, (stats.aux, stats.z)

    with (
        jax.named_scope(_RECOMPUTE),
        collective_log.phase("recompute"),
        collective_log.vjp_in_backward(),
    ):
        _, pullback = jax.vjp(ffn, a["h"], {name: getattr(w, name) for name in ffn_fields})
    with collective_log.vjp_in_backward():
        d_h, d_ffn = pullback((d_out, d_balancing))
    # The router bias is no trained weight: the forward reads it without a gradient.
    d_x, attention = attention_half_backward(cfg, rows, rope, mask, a, d_h)
    d_ffn = {k: v.astype(jnp.float32) for k, v in d_ffn.items()}
    return d_x, MoELayer(**attention, **d_ffn)


# ---------------------------------------------------------------------------------------------
# Outside the layers: the final norm, unembedding and loss; the embedding


def head_forward(
    cfg: ModelConfig, w: Weights, x: jax.Array, rows: SequenceRows
) -> tuple[jax.Array, Activations]:
    """transformer.py's final_norm, unembed and loss on the last residual: the loss terms f32[2]
    and what the backward keeps of them (everything it reads, as autodiff keeps outside the
    scanned layers): the head's activations (:data:`~seqshard.model.transformer.HEAD`) and
    the softmax's pieces."""
    a = BlockActivations((HEAD,))
    logits = unembed(cfg, w, final_norm(cfg, w, x, a), a)
    terms, exp, sum_exp = loss_terms_and_softmax(logits, rows.targets, rows.counted)
    return terms, {**a.values, "exp": exp, "sum_exp": sum_exp}


def head_backward(
    cfg: ModelConfig, kept: Activations, rows: SequenceRows, d_total: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dL/dx of the last residual and the gradients of ``final_norm`` and
    ``unembed`` in their layouts, given dL/d(summed loss) ``d_total`` (a scalar)."""
    dt, f32 = jnp.dtype(cfg.compute_dtype), jnp.float32
    targets, counted = rows.targets, rows.counted
    # The loss psum over (d, c) transposes to each shard taking d_total for its own positions.
    d_nll = d_total * counted.astype(f32)
    # nll = log(sum_exp) + shift - target_logit. The psum over t of sum_exp and target_logit
    # transposes to each t shard taking the whole cotangent for its vocab block: dL/dlogits is
    # softmax - onehot(target) on the block, no communication. (shift only stabilizes.)
    exp, sum_exp = kept["exp"], kept["sum_exp"]
    vocab_block = exp.shape[-1]
    local_target = targets - shardops.axis_index("t") * vocab_block
    is_target = jnp.arange(vocab_block)[None, None, :] == local_target[..., None]  # none elsewhere
    d_logits = (d_nll / sum_exp)[..., None] * exp - jnp.where(is_target, d_nll[..., None], 0.0)
    d_logits = d_logits.astype(dt)
    # unembed: logits = nx . table^T, the table gathered over d.
    ln, gx, nx, table = kept["ln"], kept["gx"], kept["nx"], kept["table"]
    d_nx = shardops.einsum_unreduced(
        "B/d/e L@zigzag/c V/t, V/t M -> B/d/e L@zigzag/c M{U_t}", d_logits, table
    )
    d_table = shardops.einsum_unreduced(
        "B/d/e L@zigzag/c M, B/d/e L@zigzag/c V/t -> V/t M{U_d,e,c}", nx, d_logits
    )
    # Each d shard summed over its own B/d/e rows: sum the shards, keep FSDP's M/d/e/c.
    with part("logits"):
        d_unembed = shardops.psum_scatter("V/t M{U_d,e,c} -> V/t M/d/e/c", d_table).astype(f32)
    # final_norm, with d_nx owing the sum over the vocab blocks (as in layer_backward).
    with part("final_norm"):
        d_x, d_final_norm = norm_backward(cfg, gx, ln, d_nx)
    return d_x, d_final_norm, d_unembed


@part("embed")
def embed_backward(cfg: ModelConfig, tokens: jax.Array, d_x: jax.Array) -> jax.Array:
    """The embedding table's gradient 'V/t M/d/e/c' (f32) from dL/dx of the first
    residual: the transpose of transformer.py's ``embed``."""
    # The forward's psum_scatter summed the vocab shards' lookups over t; its transpose gives
    # every t shard the gradient of all of M.
    g = shardops.all_gather(f"{cfg.residual_spec} -> B/d/e L@zigzag/c M", d_x)
    # index_unreduced's transpose: each t shard adds up the rows of its vocab block, over its
    # own B/d/e rows only.
    d_table = shardops.index_add(
        "B/d/e L@zigzag/c M, B/d/e L@zigzag/c -> V/t M{U_d,e,c}", g, tokens, vocab=cfg.vocab
    )
    # Each d shard summed its own rows: sum the shards, keep FSDP's M/d/e/c (the gather's transpose).
    return shardops.psum_scatter("V/t M{U_d,e,c} -> V/t M/d/e/c", d_table).astype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# The whole model, as a custom VJP inside the shard_map


_RECOMPUTE = "rematted_computation"


def explicit_terms_and_stats(
    cfg: ModelConfig, w: Weights, batch: TokenBatch
) -> tuple[jax.Array, RouterStats | None]:
    """:func:`~seqshard.model.transformer.forward_terms_and_stats`, whose gradient is the
    hand-written backward pass of this module (the MoE layers' FFN differentiated by
    ``jax.vjp`` inside it: :func:`moe_layer_backward`)."""
    axes = block_axes()
    if axes is None:
        raise ValueError(
            "explicit_terms_and_stats runs on per-device blocks, inside the model's shard_map "
            "(loss_fn, batch_loss_terms); it was called outside one."
        )
    sizes = (tuple(axes.sizes.items()), axes.manual)
    return _with_explicit_backward(cfg, sizes, w, batch)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _with_explicit_backward(cfg, axes, w, batch):
    # Not differentiated (eval): the model's forward pass itself.
    return forward_terms_and_stats(cfg, w, batch)


def _layers_keeping(cfg: ModelConfig, rows: SequenceRows, x: jax.Array, layers: Layer):
    """The residual through the stacked ``layers`` (inside ``hand_differentiated``): the
    output and, per layer, what ``cfg.remat`` keeps for :func:`_layers_backward`."""
    keep = kept_activations(cfg, shardops.axis_size("c"))
    rope, mask = rope_and_mask(cfg, rows)

    def layer(x, w_layer):
        a = BlockActivations(LAYER_BLOCKS, {"x": x}, explicit=True)
        out = layer_forward(cfg, rows, rope, mask, w_layer, a)
        return out, {name: a[name] for name in keep}

    return collective_log.scan("layers", layer, x, layers)


def _moe_layers_keeping(cfg: ModelConfig, rows: SequenceRows, x: jax.Array, layers: MoELayer):
    """The residual through the MoE stack: (the output, per layer what ``cfg.remat`` keeps of
    its attention block (its FFN keeps nothing: its backward re-runs it), per layer its
    routing statistics)."""
    keep = kept(MOE_LAYER_BLOCKS, cfg, shardops.axis_size("c"))
    rope, mask = rope_and_mask(cfg, rows)

    def layer(x, w_layer):
        a = BlockActivations(MOE_LAYER_BLOCKS, {"x": x}, explicit=True)
        out, stats = moe_layer_forward(cfg, rows, rope, mask, w_layer, a)
        return out, ({name: a[name] for name in keep}, stats)

    x, (kept_values, stats) = collective_log.scan("moe_layers", layer, x, layers)
    return x, kept_values, stats


def _layers_backward(cfg: ModelConfig, rows: SequenceRows, layers: Layer, kept, d_out: jax.Array):
    """(dL/d(the layers' input), the layers' gradients): the layers in reverse, each one's
    activations rebuilt from what it kept (inside the backward's scopes)."""
    rope, mask = rope_and_mask(cfg, rows)

    def layer(d_out, w_and_kept):
        w_layer, kept_layer = w_and_kept
        # Named as JAX names remat's recomputation, so HLO audits (seqshard.shardlib.comms) put its
        # re-gathers in the 'recompute' phase, as for autodiff.
        with jax.named_scope(_RECOMPUTE), collective_log.phase("recompute"):
            a = layer_activations(cfg, rows, rope, mask, w_layer, kept_layer)
        return layer_backward(cfg, rows, rope, mask, a, d_out)

    return collective_log.scan("layers", layer, d_out, (layers, kept), reverse=True)


def _moe_layers_backward(cfg, rows, layers: MoELayer, kept, d_out: jax.Array, d_balancing):
    """The MoE stack in reverse: (dL/d(its input), its layers' gradients). ``d_balancing``:
    (dL/d aux, dL/d z), each f32[moe_layers], one per layer."""
    rope, mask = rope_and_mask(cfg, rows)

    def layer(d_out, w_and_kept):
        w_layer, kept_layer, d_balancing = w_and_kept
        with jax.named_scope(_RECOMPUTE), collective_log.phase("recompute"):
            a = BlockActivations(MOE_LAYER_BLOCKS, kept_layer, explicit=True, only_needed=True)
            attention_block.attention_inputs(cfg, w_layer, a, rope)
            attention_block.attention_core(cfg, a, rows, mask)
            attention_block.attention_output(cfg, w_layer, a)
        return moe_layer_backward(cfg, rows, rope, mask, w_layer, a, d_out, d_balancing)

    return collective_log.scan(
        "moe_layers", layer, d_out, (layers, kept, d_balancing), reverse=True
    )


def _stack_size(layers) -> tuple[int]:
    """(the number of layers in a stack,)."""
    return jax.tree.leaves(layers)[0].shape[:1]


def _forward(cfg: ModelConfig, axes, w: Weights, batch: TokenBatch):
    """The forward pass for differentiation: the loss terms, the MoE layers' statistics, and
    what the backward reads."""
    sizes = cfg.dim_sizes()
    with collective_log.hand_differentiated():  # _backward logs its own collectives
        rows = sequence_rows(batch.tokens, batch.is_seq_start, batch.loss_mask)
        x = embed(cfg, w, rows.tokens)
        kept_layers = kept_moe = stats = None
        if sizes["layers"]:
            x, kept_layers = _layers_keeping(cfg, rows, x, w.layers)
        if cfg.moe.enabled:
            x, kept_moe, stats = _moe_layers_keeping(cfg, rows, x, w.moe_layers)
        terms, head = head_forward(cfg, w, x, rows)
        terms = with_balancing_terms(terms, stats)
    # The weights are kept as they are (FSDP shards): the backward gathers them again.
    return (terms, stats), (w, rows, kept_layers, kept_moe, head, terms[1])


def _backward(cfg: ModelConfig, axes, residuals, cotangents):
    """The backward pass: Weights of gradients in their own layouts; the batch (ids, starts
    and the loss mask) gets none."""
    w, rows, kept_layers, kept_moe, head, count = residuals
    d_total = cotangents[0][0]
    sizes, manual = axes
    grads = {}
    # Traced when JAX transposes the shard_map, after the body's scopes closed: reopen them.
    with block_axes_scope(dict(sizes), manual), shape_scope(), collective_log.phase("backward"):
        d_x, grads["final_norm"], grads["unembed"] = head_backward(cfg, head, rows, d_total)
        if kept_moe is not None:
            # The balancing terms joined the summed loss times the positions counted.
            d_balancing = jnp.broadcast_to(d_total * count, _stack_size(w.moe_layers))
            d_x, grads["moe_layers"] = _moe_layers_backward(
                cfg, rows, w.moe_layers, kept_moe, d_x, (d_balancing, d_balancing)
            )
        if kept_layers is not None:
            d_x, grads["layers"] = _layers_backward(cfg, rows, w.layers, kept_layers, d_x)
        else:  # no dense layers: an empty stack's gradient
            grads["layers"] = jax.tree.map(jnp.zeros_like, w.layers)
        grads["embed"] = embed_backward(cfg, rows.tokens, d_x)
    return type(w)(**grads), None


_with_explicit_backward.defvjp(_forward, _backward)


# ---------------------------------------------------------------------------------------------
# A pipeline stage's layers


def _stage_static(name: str):
    """What a stage's custom VJP needs to reopen its scopes: (the block's axes, the log's
    place). ``name``, the entry point, runs inside the model's shard_map only."""
    axes = block_axes()
    if axes is None:
        raise ValueError(f"{name} runs inside the model's shard_map.")
    return ((tuple(axes.sizes.items()), axes.manual), collective_log.place())


@contextlib.contextmanager
def _stage_scopes(static, scope: contextlib.AbstractContextManager):
    """The scopes of a stage's forward or backward, where JAX traces it after the tick loop's
    body closed them: the block's axes and shapes, the log's place, and ``scope`` (the log's
    hand-differentiated marker or its backward phase)."""
    (sizes, manual), where = static
    with block_axes_scope(dict(sizes), manual), shape_scope(), collective_log.at(where), scope:
        yield


def explicit_run_layers(
    cfg: ModelConfig, rows: SequenceRows, x: jax.Array, layers: Layer
) -> jax.Array:
    """:func:`~seqshard.model.transformer.run_layers` (the residual through a stack of
    layers: a pipeline stage's block), whose gradient is this module's layer backward, the
    layers in reverse. ``rows`` are the rows' ids and positions (no gradient)."""
    static = _stage_static("explicit_run_layers")
    return _stage_with_explicit_backward(cfg, static, layers, x, rows)


def explicit_run_moe_layers(
    cfg: ModelConfig, rows: SequenceRows, x: jax.Array, layers: MoELayer
) -> tuple[jax.Array, RouterStats]:
    """:func:`~seqshard.model.transformer.run_moe_layers` (a pipeline stage's MoE layers:
    the residual and their stacked statistics), whose gradient is this module's MoE layer
    backward, the layers in reverse; the statistics' aux and z take their cotangents (the
    loss adds them), the rest (counts) have none."""
    static = _stage_static("explicit_run_moe_layers")
    return _stage_with_explicit_backward(cfg, static, layers, x, rows)


# A stage's layers: the MoE layers when the model has experts (the stage's whole stack then,
# see pipelined._stack), else the dense ones.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _stage_with_explicit_backward(cfg, static, layers, x, rows):
    with collective_log.hand_differentiated(), collective_log.custom_vjp_primal():
        return (run_moe_layers if cfg.moe.enabled else run_layers)(cfg, rows, x, layers)


def _stage_forward(cfg: ModelConfig, static, layers, x: jax.Array, rows: SequenceRows):
    # Traced when JAX differentiates the tick loop (the stage's scopes closed): reopen them.
    with _stage_scopes(static, collective_log.hand_differentiated()):
        if cfg.moe.enabled:
            y, kept_values, stats = _moe_layers_keeping(cfg, rows, x, layers)
            return (y, stats), (layers, rows, kept_values)
        y, kept_values = _layers_keeping(cfg, rows, x, layers)
    return y, (layers, rows, kept_values)


def _stage_backward(cfg: ModelConfig, static, residuals, cotangents):
    layers, rows, kept_values = residuals
    # Traced when JAX transposes the tick loop, after the body's scopes closed: reopen them.
    with _stage_scopes(static, collective_log.phase("backward")):
        if cfg.moe.enabled:
            d_y, d_stats = cotangents
            d_x, d_layers = _moe_layers_backward(
                cfg, rows, layers, kept_values, d_y, (d_stats.aux, d_stats.z)
            )
        else:
            d_x, d_layers = _layers_backward(cfg, rows, layers, kept_values, cotangents)
    # rows: ids and positions, no gradient (the router bias, read without one, is among the
    # layers: its own update is the train step's).
    return d_layers, d_x, None


_stage_with_explicit_backward.defvjp(_stage_forward, _stage_backward)
