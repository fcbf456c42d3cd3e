"""The attention block: pre-norm, q/k/v projections with RoPE, attention across the row, the
output projection and the residual add. Its weights, activations and operations are declared
once here (:data:`ATTENTION`, :class:`AttentionWeights`); its math is :func:`attention_inputs`,
:func:`attention_core` and :func:`attention_output`, written through an
:class:`~seqshard.model.block.Activations` recorder that the forward, generation and the
hand-written backward (rebuilding what it did not keep) all use.

With ``model.qk_norm`` (Qwen3) each q and k head is RMS-normalized over D by the gains
``q_norm``, ``k_norm`` after its projection and before RoPE; the gains, d_head numbers each,
rest replicated (their gradient: one all-reduce over t,d,e,c in the backward).

Per device, forward (``model.residual`` gives the residual's layout; c > 1 splits the row):

    all_gather over t,d,c  ln1                        (the norm gain)
    all_gather over t      the residual, around the norm
    all_gather over d,c    w_q, w_kv, w_o
    all_gather over c      k, v (allgather), or c-1 ring_shifts of each (ring)
    psum_scatter over t    the output projection (it contracts the K/t heads)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from seqshard.model.attention import (
    apply_rope,
    attention,
    attention_vjp,
    einsum_probabilities,
    einsum_values,
    max_logits,
    resolve_impl,
)
from seqshard.model.block import (
    Activation,
    Activations,
    Aux,
    Block,
    LayerInputs,
    Op,
    combined_aux,
    elementwise,
    gain,
    matmul,
    weight,
)
from seqshard.model.config import ModelConfig
from seqshard.model.context import (
    SequenceRows,
    gathered_kv,
    ring_attention,
    ring_backward,
    ring_forward,
)
from seqshard.model.fp8_scaling import Fp8Sites, Scaling, delayed, history_weight
from seqshard.model.grads import (
    normed_projections_backward,
    output_projection_backward,
    rms_norm_backward,
)
from seqshard.model.norm import norm_input, norm_op, normed, rms_norm
from seqshard.shardlib import fp8, shardops
from seqshard.shardlib.collective_log import part
from seqshard.shardlib.shardtypes import f32, pytree_dataclass

__all__ = [
    "ATTENTION",
    "AttentionWeights",
    "attention_backward",
    "attention_block_backward",
    "attention_block_forward",
    "attention_core",
    "attention_inputs",
    "attention_output",
    "head_norm",
    "qk_norm_backward",
]

_LAYER = "model.layers.{i}."


def _fan_in(cfg: ModelConfig) -> float:
    return 1 / math.sqrt(cfg.d_model)


def _w_o_std(cfg: ModelConfig) -> float:
    """Each residual-stream contribution at unit scale, the stream growing like sqrt(layers)."""
    return 1 / math.sqrt(cfg.n_heads * cfg.d_head) / math.sqrt(2 * cfg.n_layers)


def _has_qk_norm(cfg: ModelConfig) -> bool:
    return cfg.qk_norm


@pytree_dataclass
class AttentionWeights:
    """The attention block's weights (one layer's)."""

    ln1: f32["d_model/t/fsdp"] = gain(_LAYER + "input_layernorm.weight")
    w_q: f32["d_model/fsdp n_q_per_kv n_kv/t d_head"] = weight(
        _fan_in,
        hf=_LAYER + "self_attn.q_proj.weight",
        layout="(n_kv n_q_per_kv d_head) d_model",
        matrix=("d_model", "n_q_per_kv n_kv d_head"),
    )
    w_kv: f32["2 d_model/fsdp n_kv/t d_head"] = weight(  # [0] makes k, [1] makes v
        _fan_in,
        hf=(
            (_LAYER + "self_attn.k_proj.weight", "(n_kv d_head) d_model"),
            (_LAYER + "self_attn.v_proj.weight", "(n_kv d_head) d_model"),
        ),
        matrix=("d_model", "n_kv d_head"),  # k's and v's: two matrices
    )
    w_o: f32["d_model/fsdp n_q_per_kv n_kv/t d_head"] = weight(
        _w_o_std,
        hf=_LAYER + "self_attn.o_proj.weight",
        layout="d_model (n_kv n_q_per_kv d_head)",
        matrix=("n_q_per_kv n_kv d_head", "d_model"),
    )
    # model.qk_norm's gains (absent without it), replicated: each device normalizes whole
    # heads, and d_head numbers are too few to be worth splitting.
    q_norm: f32["d_head"] = gain(
        _LAYER + "self_attn.q_norm.weight", layout="d_head", present=_has_qk_norm
    )
    k_norm: f32["d_head"] = gain(
        _LAYER + "self_attn.k_norm.weight", layout="d_head", present=_has_qk_norm
    )
    # model.fp8=delayed: each FP8 site's amaxes of past steps (seqshard.model.fp8_scaling).
    attention_fp8_history: f32["5 fp8_history"] = history_weight()


def _einsum(cfg: ModelConfig, c: int) -> bool:
    """Einsum attention over gathered keys: the one path that holds the probabilities."""
    return not cfg.ring_over(c) and resolve_impl(cfg.attention_impl) == "einsum"


def _gathered(cfg: ModelConfig, c: int) -> bool:
    """k and v gathered over c (allgather attention; k itself when c = 1)."""
    return c > 1 and not cfg.ring_over(c)


def _qk_norm(cfg: ModelConfig, c: int) -> bool:
    return cfg.qk_norm


def _fp8(cfg: ModelConfig, c: int) -> bool:
    return cfg.fp8 != "none"


FP8 = Fp8Sites("attention", ("nx", "w_q", "w_kv", "o_in", "w_o"), "attention_fp8_history")
"""The tensors the block puts on e4m3's grid with model.fp8 (seqshard.model.fp8_scaling)."""


_R = "B/dp L/c M/t"  # the residual's size per device (either layout of model.residual)
_ROWS = "B/dp L@zigzag/c"  # a block's rows, all of them over t
_SAVED_FULL = frozenset({"saved", "full"})
_FULL = frozenset({"full"})


def attention_inputs(
    cfg: ModelConfig, w, a: Activations, rope, sc: Scaling | None = None
) -> tuple[jax.Array, ...]:
    """Pre-norm, then q 'B/dp L@zigzag/c Q K/t D' and k, v 'B/dp L@zigzag/c K/t D', q and k
    rotated by RoPE. ``a`` holds the layer input ``x``; ``sc`` the block's FP8 scaling."""
    dt = jnp.dtype(cfg.compute_dtype)
    sc = sc or FP8.scaling(cfg, w)
    cos, sin = rope
    x = a["x"]
    # The norm needs all of M, the projections every row: gather the gain, and the residual
    # over t (before the norm for M/t, its output after it for L/t).
    ln1 = a("ln1", lambda: shardops.all_gather("M/t/fsdp -> M", w.ln1))
    gx = a("gx", lambda: norm_input(cfg, x))
    # model.fp8: the projections' operands on e4m3's grid, their outputs' cotangents on e5m2's
    # (seqshard.shardlib.fp8; each a no-op with fp8=none).
    nx = a("nx", lambda: sc.quantized("nx", f"{_ROWS} M", normed(cfg, gx, ln1)))
    # FSDP: each matrix is gathered over d and c just before use (in the backward pass again:
    # only remat=none keeps gathered weights); in e4m3 with model.fp8.
    w_q = a("w_q", lambda: sc.gathered("w_q", "M/fsdp Q K/t D -> M Q K/t D", w.w_q, dt))

    def project_q() -> jax.Array:
        q = shardops.einsum_unreduced(f"{_ROWS} M, M Q K/t D -> {_ROWS} Q K/t D", nx, w_q)
        return fp8.gradient_quantized(cfg.fp8, f"{_ROWS} Q K/t D", q)

    w_kv = a("w_kv", lambda: sc.gathered("w_kv", "2 M/fsdp K/t D -> 2 M K/t D", w.w_kv, dt))

    def project_kv() -> tuple[jax.Array, jax.Array]:
        kv = shardops.einsum_unreduced(f"{_ROWS} M, 2 M K/t D -> 2 {_ROWS} K/t D", nx, w_kv)
        k, v = fp8.gradient_quantized(cfg.fp8, f"2 {_ROWS} K/t D", kv)
        return k, v

    if not cfg.qk_norm:
        q = a("q", lambda: apply_rope(project_q(), cos, sin))

        def k_and_v():
            k, v = project_kv()
            return apply_rope(k, cos, sin), v

        k, v = a.several(("k", "v"), k_and_v)
        return q, k, v
    # Each device holds whole heads (D is never split): the norms are local. Replicated gains,
    # read as they are (no gather).
    q_norm = a("q_norm", lambda: w.q_norm)
    k_norm = a("k_norm", lambda: w.k_norm)
    q_proj = a("q_proj", project_q)
    k_proj, v = a.several(("k_proj", "v"), project_kv)
    q = a("q", lambda: apply_rope(head_norm(cfg, q_proj, q_norm), cos, sin))
    k = a("k", lambda: apply_rope(head_norm(cfg, k_proj, k_norm), cos, sin))
    return q, k, v


def head_norm(cfg: ModelConfig, x: jax.Array, gain: jax.Array) -> jax.Array:
    """model.qk_norm's RMSNorm of each head of q 'B/dp L@zigzag/c Q K/t D' or k
    'B/dp L@zigzag/c K/t D' over D by ``gain`` 'D' (f32), in compute dtype."""
    return rms_norm(x, gain, cfg.norm_eps).astype(jnp.dtype(cfg.compute_dtype))


def attention_core(
    cfg: ModelConfig, a: Activations, rows: SequenceRows, mask: jax.Array | None
) -> jax.Array:
    """This device's queries over the whole row: 'B/dp L@zigzag/c Q K/t D'. With the row split
    over c, the ring passes k and v blocks around (its own backward), or allgather gathers
    them; einsum attention keeps its probabilities as an activation, fused kernels do not."""
    q, k, v = a["q"], a["k"], a["v"]
    c, causal_only = shardops.axis_size("c"), cfg.attention_mask == "causal"
    if cfg.ring_over(c):
        # Under autodiff the ring with its own VJP; in the hand-written backward's forward
        # (itself inside a custom VJP) the ring's plain forward.
        ring = ring_forward if a.explicit else ring_attention
        attn, _ = a.several(
            ("attn", "lse"), lambda: ring(q, k, v, rows.segments, causal_only), "context"
        )
        return attn
    keys, values = a.several(("keys", "values"), lambda: gathered_kv(k, v))
    if _einsum(cfg, c):
        probs = a("probs", lambda: einsum_probabilities(q, keys, mask))
        return a("attn", lambda: einsum_values(probs.astype(v.dtype), values))
    impl, causal_only = cfg.attention_impl, causal_only and c == 1
    return a("attn", lambda: attention(q, keys, values, mask, impl, causal_only))


def attention_output(cfg: ModelConfig, w, a: Activations, sc: Scaling | None = None) -> jax.Array:
    """The output projection of ``attn`` plus the residual ``x``: h, a residual (``sc``: the
    block's FP8 scaling)."""
    dt = jnp.dtype(cfg.compute_dtype)
    sc = sc or FP8.scaling(cfg, w)
    x, attn = a["x"], a["attn"]
    if cfg.fp8 != "none":  # the o projection's operand on e4m3's grid, kept beside attn
        attn = a("o_in", lambda: sc.quantized("o_in", f"{_ROWS} Q K/t Dv", attn))
    w_o = a("w_o", lambda: sc.gathered("w_o", "M/fsdp Q K/t Dv -> M Q K/t Dv", w.w_o, dt))

    def residual() -> jax.Array:
        out = shardops.einsum_unreduced(f"{_ROWS} Q K/t Dv, M Q K/t Dv -> {_ROWS} M", attn, w_o)
        out = fp8.gradient_quantized(cfg.fp8, f"{_ROWS} M", out)
        # Each t shard contracted only its own heads (K/t): sum the shards, scattered into the
        # residual's layout.
        return x + shardops.psum_scatter(f"B/dp L@zigzag/c M -> {cfg.residual_spec}", out)

    return a("h", residual)


def head_max_logits(cfg: ModelConfig, a: Activations, mask: jax.Array) -> jax.Array:
    """model.max_logit: each head's largest logit over the step's rows, f32 'Q K' (the
    same on every device)::

        max_logits(q, keys, mask)                             'K/t Q' on this device's rows
        pmax('Q K/t{U_dp,c} -> Q K/t')                        over the batch and the sequence
        all_gather('Q K/t -> Q K', to='invarying')            every head on every device
    """
    if not _einsum(cfg, shardops.axis_size("c")):
        raise ValueError(
            f"model.max_logit reads each head's logits, which model.attention_impl="
            f"{cfg.attention_impl} runs as {resolve_impl(cfg.attention_impl)} here, a kernel "
            f"that never forms them. Set model.attention_impl=einsum, or model.max_logit=false."
        )
    local = max_logits(a["q"], a["keys"], mask).T
    with part("max_logit"):
        most = shardops.pmax("Q K/t{U_dp,c} -> Q K/t", local)
        return shardops.all_gather("Q K/t -> Q K", most, to="invarying")


def _max_logit_metrics(cfg, aux, layer_names, stack_weights) -> dict[str, jax.Array]:
    return {"max_logit/attention": jnp.max(aux["max_logit"])}


MAX_LOGIT = Aux(
    fields={"max_logit": "n_q_per_kv n_kv"},
    max=("max_logit",),
    metrics=_max_logit_metrics,
    present=lambda cfg: cfg.max_logit,
)
"""model.max_logit's auxiliary output: each layer's heads' largest logits of the step (the
max over microbatches), logged as ``max_logit/attention`` (the largest of all) and read by
train.muon.qk_clip (seqshard.train.muon)."""


def attention_block_forward(cfg: ModelConfig, inputs: LayerInputs, w, a: Activations) -> jax.Array:
    """The block on the residual ``a['x']``: q, k, v, attention over the row, the output
    projection plus the residual: h (and, with model.fp8=delayed, its FP8 sites' amaxes;
    with model.max_logit, its heads' largest logits)."""
    sc = FP8.scaling(cfg, w)
    attention_inputs(cfg, w, a, inputs.rope, sc)
    attention_core(cfg, a, inputs.rows, inputs.mask)
    h = attention_output(cfg, w, a, sc)
    aux = sc.aux() if delayed(cfg) else {}
    if cfg.max_logit:
        aux["max_logit"] = head_max_logits(cfg, a, inputs.mask)
    return (h, aux) if aux else h


# The activations of the block's input side (x, norm(x)), its gain and the norm's part.
_ATTENTION_INPUT = ("gx", "nx", "ln1", "attn_norm")


def attention_block_backward(
    cfg: ModelConfig, inputs: LayerInputs, w, a: Activations, d_h: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The attention block's backward: dL/dx (a residual) and its weights' gradients (f32, in
    their layouts), from its activations and dL/dh ``d_h``."""
    f32 = jnp.float32
    rows, (cos, sin), mask = inputs
    # --- h = x + psum_scatter(attn . w_o) --------------------------------------------------
    # As for the down projection: the transpose of the output's psum_scatter over t.
    o_in = a["o_in"] if cfg.fp8 != "none" else a["attn"]
    d_attn, d_w_o = output_projection_backward(cfg, d_h, o_in, a["w_o"], "Q K/t Dv", "o")
    d_q, d_k, d_v = attention_backward(cfg, rows, mask, a, d_attn)
    # RoPE is a rotation per position: its transpose rotates back (sin -> -sin).
    d_q = apply_rope(d_q, cos, -sin)
    d_k = apply_rope(d_k, cos, -sin)
    qk_grads = {}
    if cfg.qk_norm:
        d_q, d_k, qk_grads = qk_norm_backward(cfg, a, d_q, d_k)
    d_kv = jnp.stack([d_k, d_v])
    d_gx, grads = normed_projections_backward(
        cfg, a, _ATTENTION_INPUT, [("w_q", "M Q K/t D", d_q), ("w_kv", "2 M K/t D", d_kv)], "q_kv"
    )
    history = FP8.no_history_gradient(cfg, w)
    return d_h + d_gx, {**grads, "w_o": d_w_o.astype(f32), **qk_grads, **history}


def attention_backward(
    cfg: ModelConfig, rows: SequenceRows, mask: jax.Array | None, a: Activations, d_attn: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dL/dq 'B/dp L@zigzag/c Q K/t D' and dL/dk, dL/dv 'B/dp L@zigzag/c K/t D' from dL/dattn; per device (each t
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
    if resolve_impl(cfg.attention_impl) != "einsum":  # fused: their own VJP
        impl = cfg.attention_impl
        dq, dk, dv = attention_vjp(q, k, v, mask, impl, causal_only and c == 1, d_attn)
    else:
        dq, dk, dv = _einsum_attention_backward(a["probs"], q, k, v, d_attn)
    # Each c shard's queries reached every key: the transposes of the gathers over c sum the
    # shards' partial gradients, each keeping its own positions (nothing moves when c = 1).
    with part("context"):
        dk = shardops.psum_scatter("B/dp L@zigzag K/t D{U_c} -> B/dp L@zigzag/c K/t D", dk)
        dv = shardops.psum_scatter("B/dp L@zigzag K/t Dv{U_c} -> B/dp L@zigzag/c K/t Dv", dv)
        return dq, dk, dv


def _einsum_attention_backward(probs, q, k, v, d_attn):
    """dq and the gathered keys' dk, dv (owing a sum over c) of attention.py's einsum
    attention, from its probabilities."""
    # attn = probs . v
    d_probs = shardops.einsum_unreduced(
        "B/dp Qlen@zigzag/c Q K/t Dv, B/dp Klen@zigzag K/t Dv -> B/dp K/t Q Qlen@zigzag/c Klen@zigzag",
        d_attn,
        v,
        out_dtype=jnp.float32,
    )
    dv = shardops.einsum_unreduced(
        "B/dp K/t Q Qlen@zigzag/c Klen@zigzag, B/dp Qlen@zigzag/c Q K/t Dv -> B/dp Klen@zigzag K/t Dv",
        probs.astype(v.dtype),
        d_attn,
    )
    # softmax over Klen, in f32. A masked key has probability exactly 0, so its score's
    # gradient is 0 too: the mask needs no second application.
    d_scores = probs * (d_probs - jnp.sum(probs * d_probs, axis=-1, keepdims=True))
    d_scores = (d_scores * (1 / math.sqrt(q.shape[-1]))).astype(q.dtype)
    # scores = q . k (each kv head's gradient sums over its Q query heads)
    dq = shardops.einsum_unreduced(
        "B/dp K/t Q Qlen@zigzag/c Klen@zigzag, B/dp Klen@zigzag K/t D -> B/dp Qlen@zigzag/c Q K/t D",
        d_scores,
        k,
    )
    dk = shardops.einsum_unreduced(
        "B/dp K/t Q Qlen@zigzag/c Klen@zigzag, B/dp Qlen@zigzag/c Q K/t D -> B/dp Klen@zigzag K/t D",
        d_scores,
        q,
    )
    return dq, dk, dv


def qk_norm_backward(
    cfg: ModelConfig, a: Activations, d_q: jax.Array, d_k: jax.Array
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """The transpose of ``model.qk_norm``'s head norms: dL/d(q before its norm)
    'B/dp L@zigzag/c Q K/t D' and dL/d(k before it) 'B/dp L@zigzag/c K/t D' (compute dtype),
    from the cotangents of the normed q and k, and the gains' gradients 'D' (f32)."""
    dt = jnp.dtype(cfg.compute_dtype)
    with part("qk_norm"):
        d_q, d_q_norm = rms_norm_backward(a["q_proj"], a["q_norm"], d_q, cfg.norm_eps)
        d_k, d_k_norm = rms_norm_backward(a["k_proj"], a["k_norm"], d_k, cfg.norm_eps)
        # Each gain's gradient summed over this device's rows (B/dp, L/c) and heads (K/t):
        # summed over every device, the gains rest replicated.
        d_q_norm = shardops.psum("D{U_t,dp,c} -> D", d_q_norm)
        d_k_norm = shardops.psum("D{U_t,dp,c} -> D", d_k_norm)
    return d_q.astype(dt), d_k.astype(dt), {"q_norm": d_q_norm, "k_norm": d_k_norm}


ATTENTION = Block(
    name="attention",
    activations=(
        Activation("x", _R, "compute", "x", saved=True),  # the layer input, the residual
        Activation("ln1", "M", "f32", "attn_norm"),  # the norm gain, gathered
        Activation("gx", "B/dp L/c M", "compute", "attn_norm"),  # norm_input: x with all of M
        Activation("nx", "B/dp L/c M", "compute", "attn_norm"),  # the normed input of q, k, v
        Activation("w_q", "M Q K/t D", "compute", "q"),  # gathered over d, c
        Activation("w_kv", "2 M K/t D", "compute", "kv"),
        # model.qk_norm: the gains, and q and k before their norm (its backward reads them;
        # kept, so that no remat but full repeats the projections).
        Activation("q_norm", "D", "f32", "qk_norm", present=_qk_norm),
        Activation("k_norm", "D", "f32", "qk_norm", present=_qk_norm),
        Activation("q_proj", "B/dp L/c Q K/t D", "compute", "q", saved=True, present=_qk_norm),
        Activation("k_proj", "B/dp L/c K/t D", "compute", "kv", saved=True, present=_qk_norm),
        Activation("q", "B/dp L/c Q K/t D", "compute", "q", saved=True),  # after RoPE
        Activation("k", "B/dp L/c K/t D", "compute", "kv", saved=True),  # after RoPE
        Activation("v", "B/dp L/c K/t D", "compute", "kv", saved=True),
        # k and v gathered over c: every key of the row (allgather attention, c > 1).
        Activation("keys", "B/dp L K/t D", "compute", "context", present=_gathered),
        Activation("values", "B/dp L K/t D", "compute", "context", present=_gathered),
        Activation("probs", "B/dp K/t Q L/c Lk", "f32", "attn", present=_einsum),
        Activation("attn", "B/dp L/c Q K/t D", "compute", "attn", saved=True),
        # The ring's softmax logsumexp per query (ring attention over c > 1 only).
        Activation(
            "lse",
            "B/dp L/c Q K/t",
            "f32",
            "context",
            saved=True,
            present=lambda m, c: m.ring_over(c),
        ),
        # model.fp8: attn on e4m3's grid, the o projection's operand (its backward reads it).
        Activation("o_in", "B/dp L/c Q K/t D", "compute", "o", saved=True, present=_fp8),
        Activation("w_o", "M Q K/t D", "compute", "o"),
        # Kept, so that only remat=full repeats the output projection's psum_scatter.
        Activation("h", _R, "compute", "o", saved=True),
    ),
    ops=(
        norm_op("attn_norm", consumers=2, recomputed_by=_SAVED_FULL),  # feeds q and k, v
        matmul(
            "q",
            "token",
            "B/dp L M, M Q K/t D -> B/dp L Q K/t D",
            lambda m: 2 * m.d_model * m.n_heads * m.d_head,
            _FULL,
            fp8=True,
        ),
        matmul(
            "k",
            "token",
            "B/dp L M, M K/t D -> B/dp L K/t D",
            lambda m: 2 * m.d_model * m.n_kv * m.d_head,
            _FULL,
            fp8=True,
        ),
        matmul(
            "v",
            "token",
            "B/dp L M, M K/t D -> B/dp L K/t D",
            lambda m: 2 * m.d_model * m.n_kv * m.d_head,
            _FULL,
            fp8=True,
        ),
        # model.qk_norm: RMSNorm of each q and k head over D (norm_op's count per head).
        elementwise(
            "qk_norm",
            "token",
            "B/dp L Q K/t D",
            lambda m: (m.n_heads + m.n_kv) * (4 * m.d_head + 3),
            lambda m: (m.n_heads + m.n_kv) * 8 * m.d_head,
            _FULL,
            present=lambda m: m.qk_norm,
        ),
        # q and k: each pair (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), 6 per 2 elements;
        # the backward rotates back, the same 6.
        elementwise(
            "rope",
            "token",
            "B/dp L Q K/t D",
            lambda m: 3 * (m.n_heads + m.n_kv) * m.d_head,
            lambda m: 3 * (m.n_heads + m.n_kv) * m.d_head,
            _FULL,
        ),
        # With the row split over c: k and v gathered over c again, or the ring's forward.
        Op("context", "transfer", "token", "B/dp L K/t D", lambda m: 0, lambda m: 0, _SAVED_FULL),
        matmul(
            "scores",
            "pair",
            "B/dp Lq Q K/t D, B/dp Lk K/t D -> B/dp Lq Lk Q K/t",
            lambda m: 2 * m.d_head,
            _SAVED_FULL,
        ),
        # Scale by 1/sqrt(D), select the masked out; the backward does both to the cotangent.
        elementwise("mask", "pair", "B/dp Lq Lk Q K/t", lambda m: 2, lambda m: 2, _SAVED_FULL),
        # max, subtract, exp, sum, divide; backward p * (g - sum(p * g)): seed 004's 4.
        elementwise("softmax", "pair", "B/dp Lq Lk Q K/t", lambda m: 5, lambda m: 4, _SAVED_FULL),
        matmul(
            "values",
            "pair",
            "B/dp Lq Lk Q K/t, B/dp Lk K/t D -> B/dp Lq Q K/t D",
            lambda m: 2 * m.d_head,
            _FULL,
        ),
        matmul(
            "o",
            "token",
            "B/dp L Q K/t D, M Q K/t D -> B/dp L M",
            lambda m: 2 * m.n_heads * m.d_head * m.d_model,
            _FULL,
            fp8=True,
        ),
        # x + out; the backward sums the cotangents of the residual path and the block's.
        elementwise(
            "attn_residual", "token", "B/dp L M/t", lambda m: m.d_model, lambda m: m.d_model, _FULL
        ),
    ),
    weights=AttentionWeights,
    forward=attention_block_forward,
    backward=attention_block_backward,
    input="x",
    output="h",
    aux=combined_aux(FP8.aux(), MAX_LOGIT),
    fp8_sites=FP8.names,
)
"""The attention block's declarations. ``saved`` marks what remat=saved keeps: the operands
whose recomputation would cost a matmul (q, k, v after RoPE, the attention output) and h."""
