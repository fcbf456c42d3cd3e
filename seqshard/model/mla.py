"""Multi-head latent attention (``model.attention: mla``; DeepSeek-V2/V3), a block kind beside
grouped-query attention (:mod:`seqshard.model.attention_block`), the fields ``model.mla``'s.

Per token, keys and values come from one latent, compressed from the residual and RMS
normalized, up-projected per head; RoPE acts on ``qk_rope_head_dim`` extra numbers, one key
head shared by all heads. Letters: K heads (``n_kv``; MLA has no grouped heads, Q = 1),
D = nope + rope the query/key head (``d_head``), Dv the value head, R the kv latent
(``kv_lora_rank``), P its rope part, A = R + P, Rq the query latent (``q_lora_rank``)::

    q      = [norm(nx . w_q_a) . w_q_b]  or  nx . w_q        'B/dp L/c Q K/t D'
    kv_a   = nx . w_kv_a = [latent | k_rope]                 'B/dp L/c A'
    [k_nope | v] = norm(latent) . w_kv_b                     'B/dp L/c K/t (D-P + Dv)'
    k      = [k_nope | rope(k_rope) on every head],  q = [q_nope | rope(q_rope)] x mscale^2
    h      = x + attention(q, k, v) . w_o                    (attention_block's core and output)

Layouts: heads split over t as GQA's (each t shard holds whole heads: attention needs no
communication); weight rows at rest split over fsdp (d, e, c) and gathered before use. The
latents are replicated over t: every t shard computes the down projections ``w_q_a`` and
``w_kv_a`` for the rows it holds (t x their 2 M (Rq + A) FLOPs per token). Their weights and
the latents' norm gains rest split over t as well ('M/t/fsdp A', 'R/t/fsdp') and are gathered
whole, as the router's and the norm gains' are: the gradient is then the gathers' transposes,
reduce-scatters over t,d,e,c, no implicit all-reduce. Splitting the latents over t instead
would add an all-gather of the latent per layer and save the repeated down projections (a few
% of a layer's FLOPs at DeepSeek-V3's sizes).

Context parallelism: the up-projected k and v are what travel (allgather: gathered over c;
ring: passed around it), so no key is up-projected twice; the latent would be smaller on the
wire (A numbers per token against K/t (D + Dv)), but every device would then up-project every
key of the row. Packing masks, the ring and fused kernels are attention_block's: the core takes
q, k, v of any head sizes (v's Dv may differ from D).

Backward: none hand-written. The model's explicit backward differentiates this block by
``jax.vjp`` of its forward, re-run from the layer input (:func:`seqshard.model.backward.
layer_activations`): MLA is a chain of projections and norms whose transposes autodiff writes
as the hand-written GQA backward would, with the same collectives (the gathers' transposes:
reduce-scatters of the weight gradients over fsdp, the output's psum_scatter's all-gather).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from seqshard.model.attention import apply_rope, yarn_mscale
from seqshard.model.attention_block import (
    _FULL,
    _R,
    _SAVED_FULL,
    _einsum,
    _gathered,
    attention_backward,
    attention_core,
    attention_output,
    head_norm,
)
from seqshard.model.block import (
    Activation,
    Activations,
    Block,
    LayerInputs,
    Op,
    elementwise,
    gain,
    matmul,
    weight,
)
from seqshard.model.config import ModelConfig
from seqshard.model.grads import output_projection_backward
from seqshard.model.norm import norm_input, norm_op, normed
from seqshard.shardlib import collective_log, shardops
from seqshard.shardlib.shardtypes import f32, pytree_dataclass

__all__ = [
    "MLA",
    "MLAWeights",
    "mla_backward",
    "mla_forward",
    "mla_inputs",
    "mla_latent",
    "softmax_mscale",
]

_LAYER = "model.layers.{i}."
_ATTN = _LAYER + "self_attn."


def _fan_in(cfg: ModelConfig) -> float:
    return 1 / math.sqrt(cfg.d_model)


def _q_fan_in(cfg: ModelConfig) -> float:
    return 1 / math.sqrt(cfg.mla.q_lora_rank)


def _kv_fan_in(cfg: ModelConfig) -> float:
    return 1 / math.sqrt(cfg.mla.kv_lora_rank)


def _w_o_std(cfg: ModelConfig) -> float:
    return 1 / math.sqrt(cfg.n_heads * cfg.mla.v_head_dim) / math.sqrt(2 * cfg.n_layers)


def _q_latent(cfg: ModelConfig) -> bool:
    return cfg.mla.q_lora_rank > 0


def _q_direct(cfg: ModelConfig) -> bool:
    return cfg.mla.q_lora_rank == 0


@pytree_dataclass
class MLAWeights:
    """The MLA block's weights (one layer's), as DeepSeek-V3's checkpoints hold them."""

    ln1: f32["d_model/t/fsdp"] = gain(_LAYER + "input_layernorm.weight")
    # q_lora_rank = 0: queries straight from the residual.
    w_q: f32["d_model/fsdp n_q_per_kv n_kv/t d_head"] = weight(
        _fan_in,
        hf=_ATTN + "q_proj.weight",
        layout="(n_kv n_q_per_kv d_head) d_model",
        present=_q_direct,
        matrix=("d_model", "n_q_per_kv n_kv d_head"),
    )
    # q_lora_rank > 0: through a normed latent, computed whole on every t shard: its
    # projection's rows (and its norm's gain) rest split over t as well and are gathered
    # whole, as the router's and the norm gains' are.
    w_q_a: f32["d_model/t/fsdp q_lora"] = weight(
        _fan_in,
        hf=_ATTN + "q_a_proj.weight",
        layout="q_lora d_model",
        present=_q_latent,
        matrix=("d_model", "q_lora"),
    )
    q_a_norm: f32["q_lora/t/fsdp"] = gain(
        _ATTN + "q_a_layernorm.weight", layout="q_lora", present=_q_latent
    )
    w_q_b: f32["q_lora/fsdp n_q_per_kv n_kv/t d_head"] = weight(
        _q_fan_in,
        hf=_ATTN + "q_b_proj.weight",
        layout="(n_kv n_q_per_kv d_head) q_lora",
        present=_q_latent,
        matrix=("q_lora", "n_q_per_kv n_kv d_head"),
    )
    # The kv latent and the shared rope key, [latent | k_rope], whole on every t shard.
    w_kv_a: f32["d_model/t/fsdp kv_a"] = weight(
        _fan_in,
        hf=_ATTN + "kv_a_proj_with_mqa.weight",
        layout="kv_a d_model",
        matrix=("d_model", "kv_a"),
    )
    kv_a_norm: f32["kv_lora/t/fsdp"] = gain(_ATTN + "kv_a_layernorm.weight", layout="kv_lora")
    # Per head [k_nope | v] from the normed latent.
    w_kv_b: f32["kv_lora/fsdp n_kv/t d_kv_b"] = weight(
        _kv_fan_in,
        hf=_ATTN + "kv_b_proj.weight",
        layout="(n_kv d_kv_b) kv_lora",
        matrix=("kv_lora", "n_kv d_kv_b"),
    )
    w_o: f32["d_model/fsdp n_q_per_kv n_kv/t d_v"] = weight(
        _w_o_std,
        hf=_ATTN + "o_proj.weight",
        layout="d_model (n_kv n_q_per_kv d_v)",
        matrix=("n_q_per_kv n_kv d_v", "d_model"),
    )


def softmax_mscale(cfg: ModelConfig) -> float:
    """What q is multiplied by before attention's 1/sqrt(D): YaRN's mscale(rope_factor,
    rope_mscale_all_dim)^2 with ``rope_type: yarn`` and ``rope_mscale_all_dim`` set
    (DeepSeek-V3's softmax scale), else 1."""
    if cfg.rope_type == "yarn" and cfg.rope_mscale_all_dim:
        return yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return 1.0


def mla_rope(cfg: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on the rope part ``x [B, L, ..., P]``; with ``mla.rope_interleave`` the pairs are
    (0, 1), (2, 3), ... and come out as (evens, odds) rotated, as Hugging Face's
    DeepSeek-V3 writes it (queries and keys alike, so their products are the interleaved
    rotation's)."""
    if cfg.mla.rope_interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, cos, sin)


def mla_latent(cfg: ModelConfig, w, a: Activations, rope) -> tuple[jax.Array, jax.Array]:
    """The kv latent, normed, 'B/dp L@zigzag/c R', and the rope key after RoPE
    'B/dp L@zigzag/c P' of the normed input ``a['nx']``: what the decoding cache holds."""
    dt = jnp.dtype(cfg.compute_dtype)
    cos, sin = rope
    nx, r = a["nx"], cfg.mla.kv_lora_rank
    w_kv_a = a("w_kv_a", lambda: shardops.all_gather("M/t/fsdp A -> M A", w.w_kv_a.astype(dt)))
    kv_a = a(
        "kv_a",
        lambda: shardops.einsum_unreduced(
            "B/dp L@zigzag/c M, M A -> B/dp L@zigzag/c A", nx, w_kv_a
        ),
    )
    kv_a_norm = a("kv_a_norm", lambda: shardops.all_gather("R/t/fsdp -> R", w.kv_a_norm))
    latent = a("latent", lambda: head_norm(cfg, kv_a[..., :r], kv_a_norm))
    k_rope = a("k_rope", lambda: mla_rope(cfg, kv_a[..., r:], cos, sin))
    return latent, k_rope


def _queries(cfg: ModelConfig, w, a: Activations) -> jax.Array:
    """q before RoPE, 'B/dp L@zigzag/c Q K/t D'."""
    dt = jnp.dtype(cfg.compute_dtype)
    nx = a["nx"]
    if cfg.mla.q_lora_rank == 0:
        w_q = a("w_q", lambda: shardops.all_gather("M/fsdp Q K/t D -> M Q K/t D", w.w_q.astype(dt)))
        return a(
            "q_proj",
            lambda: shardops.einsum_unreduced(
                "B/dp L@zigzag/c M, M Q K/t D -> B/dp L@zigzag/c Q K/t D", nx, w_q
            ),
        )
    w_q_a = a("w_q_a", lambda: shardops.all_gather("M/t/fsdp Rq -> M Rq", w.w_q_a.astype(dt)))
    q_a = a(
        "q_a",
        lambda: shardops.einsum_unreduced(
            "B/dp L@zigzag/c M, M Rq -> B/dp L@zigzag/c Rq", nx, w_q_a
        ),
    )
    q_a_norm = a("q_a_norm", lambda: shardops.all_gather("Rq/t/fsdp -> Rq", w.q_a_norm))
    q_latent = a("q_latent", lambda: head_norm(cfg, q_a, q_a_norm))
    w_q_b = a(
        "w_q_b", lambda: shardops.all_gather("Rq/fsdp Q K/t D -> Rq Q K/t D", w.w_q_b.astype(dt))
    )
    return a(
        "q_proj",
        lambda: shardops.einsum_unreduced(
            "B/dp L@zigzag/c Rq, Rq Q K/t D -> B/dp L@zigzag/c Q K/t D", q_latent, w_q_b
        ),
    )


def mla_inputs(cfg: ModelConfig, w, a: Activations, rope) -> tuple[jax.Array, ...]:
    """Pre-norm, then q 'B/dp L@zigzag/c Q K/t D' (times :func:`softmax_mscale`), k
    'B/dp L@zigzag/c K/t D' and v 'B/dp L@zigzag/c K/t Dv' for attention_block's core. ``a``
    holds the layer input ``x``."""
    dt = jnp.dtype(cfg.compute_dtype)
    cos, sin = rope
    mla = cfg.mla
    nope = mla.qk_nope_head_dim
    x = a["x"]
    ln1 = a("ln1", lambda: shardops.all_gather("M/t/fsdp -> M", w.ln1))
    gx = a("gx", lambda: norm_input(cfg, x))
    a("nx", lambda: normed(cfg, gx, ln1))
    q_proj = _queries(cfg, w, a)
    latent, k_rope = mla_latent(cfg, w, a, rope)
    w_kv_b = a(
        "w_kv_b", lambda: shardops.all_gather("R/fsdp K/t Dkv -> R K/t Dkv", w.w_kv_b.astype(dt))
    )
    kv = a(
        "kv",
        lambda: shardops.einsum_unreduced(
            "B/dp L@zigzag/c R, R K/t Dkv -> B/dp L@zigzag/c K/t Dkv", latent, w_kv_b
        ),
    )
    scale = softmax_mscale(cfg)

    def queries() -> jax.Array:
        q = jnp.concatenate([q_proj[..., :nope], mla_rope(cfg, q_proj[..., nope:], cos, sin)], -1)
        return q if scale == 1.0 else (q.astype(jnp.float32) * scale).astype(dt)

    def keys_and_values() -> tuple[jax.Array, jax.Array]:
        k_nope = kv[..., :nope]
        shared = jnp.broadcast_to(k_rope[..., None, :], k_nope.shape[:-1] + k_rope.shape[-1:])
        return jnp.concatenate([k_nope, shared], axis=-1), kv[..., nope:]

    q = a("q", queries)
    k, v = a.several(("k", "v"), keys_and_values)
    return q, k, v


def mla_forward(cfg: ModelConfig, inputs: LayerInputs, w, a: Activations) -> jax.Array:
    """The block on the residual ``a['x']``: q, k, v from the latents, attention over the row
    (attention_block's core: einsum, fused, allgather or ring), the output projection plus
    the residual: h. Rebuilt for the explicit backward (``a.only_needed``), q, k, v come
    from :func:`_inputs_pullback`'s ``jax.vjp``, whose pullback :func:`mla_backward` uses."""
    if a.only_needed:
        _inputs_pullback(cfg, inputs, w, a)
    else:
        mla_inputs(cfg, w, a, inputs.rope)
    attention_core(cfg, a, inputs.rows, inputs.mask)
    return attention_output(cfg, w, a)


_PULLBACK = "mla_inputs_pullback"  # where the rebuilt recorder holds the input side's pullback


def _input_fields(w) -> list[str]:
    """The fields of the layer ``w`` that make q, k, v (every MLA weight but w_o)."""
    have = {f.name for f in dataclasses.fields(w)}
    return [f.name for f in dataclasses.fields(MLAWeights) if f.name != "w_o" and f.name in have]


def _inputs_pullback(cfg: ModelConfig, inputs: LayerInputs, w, a: Activations) -> None:
    """The input side, x -> q, k, v (norm, latents, projections, RoPE), re-run from the layer
    input under ``jax.vjp`` (its collectives and their transposes the backward's): q, k, v
    into ``a`` where the forward did not keep them, the pullback beside them."""
    fields = _input_fields(w)

    def q_k_v(x, w_in):
        fresh = Activations((MLA,), {"x": x})
        return mla_inputs(cfg, dataclasses.replace(w, **w_in), fresh, inputs.rope)

    with collective_log.vjp_in_backward():
        qkv, pullback = jax.vjp(q_k_v, a["x"], {f: getattr(w, f) for f in fields})
    for name, value in zip(("q", "k", "v"), qkv, strict=True):
        a.values.setdefault(name, value)
    a.values[_PULLBACK] = pullback


def mla_backward(
    cfg: ModelConfig, inputs: LayerInputs, w, a: Activations, d_h: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The block's backward: the output projection's and the attention core's hand-written
    backwards (attention_block's, on the q, k, v, attention output and h the forward kept),
    then the input side's ``jax.vjp`` pullback (:func:`_inputs_pullback`): (dL/dx, the
    weights' gradients, f32, in their layouts). The core (scores, softmax, values over the
    row) is never re-run: only the projections, norms and RoPE are."""
    rows, _, mask = inputs
    d_attn, d_w_o = output_projection_backward(cfg, d_h, a["attn"], a["w_o"], "Q K/t Dv", "o")
    d_q, d_k, d_v = attention_backward(cfg, rows, mask, a, d_attn)
    with collective_log.vjp_in_backward():
        d_x, grads = a[_PULLBACK]((d_q, d_k, d_v))
    grads = {k: g.astype(jnp.float32) for k, g in grads.items()}
    return d_h + d_x.astype(d_h.dtype), {**grads, "w_o": d_w_o.astype(jnp.float32)}


def _heads(m: ModelConfig) -> int:
    return m.n_heads


def _latent_norm_op(name: str, size) -> Op:
    """A latent's RMSNorm (norm_op's counts over its ``size(m)`` numbers, one consumer)."""
    return elementwise(
        name,
        "token",
        "B/dp L",
        lambda m: 4 * size(m) + 3,
        lambda m: 8 * size(m),
        _FULL,
        present=lambda m: size(m) > 0,
    )


MLA = Block(
    name="mla",
    activations=(
        Activation("x", _R, "compute", "x", saved=True),
        Activation("ln1", "M", "f32", "attn_norm", needed=False),
        Activation("gx", "B/dp L/c M", "compute", "attn_norm", needed=False),
        Activation("nx", "B/dp L/c M", "compute", "attn_norm", needed=False),
        Activation("w_q", "M Q K/t D", "compute", "q", present=lambda m, c: _q_direct(m), needed=False),
        Activation("w_q_a", "M Rq", "compute", "q_a", present=lambda m, c: _q_latent(m), needed=False),
        Activation("q_a", "B/dp L/c Rq", "compute", "q_a", present=lambda m, c: _q_latent(m), needed=False),
        Activation("q_a_norm", "Rq", "f32", "q_a", present=lambda m, c: _q_latent(m), needed=False),
        Activation("q_latent", "B/dp L/c Rq", "compute", "q_a", present=lambda m, c: _q_latent(m), needed=False),
        Activation("w_q_b", "Rq Q K/t D", "compute", "q", present=lambda m, c: _q_latent(m), needed=False),
        Activation("q_proj", "B/dp L/c Q K/t D", "compute", "q", needed=False),
        Activation("w_kv_a", "M A", "compute", "kv_a", needed=False),
        Activation("kv_a", "B/dp L/c A", "compute", "kv_a", needed=False),
        Activation("kv_a_norm", "R", "f32", "kv_a", needed=False),
        Activation("latent", "B/dp L/c R", "compute", "kv_a", needed=False),
        Activation("k_rope", "B/dp L/c P", "compute", "kv_a", needed=False),
        Activation("w_kv_b", "R K/t Dkv", "compute", "kv_b", needed=False),
        Activation("kv", "B/dp L/c K/t Dkv", "compute", "kv_b", needed=False),
        Activation("q", "B/dp L/c Q K/t D", "compute", "q", saved=True),
        Activation("k", "B/dp L/c K/t D", "compute", "kv_b", saved=True),
        Activation("v", "B/dp L/c K/t Dv", "compute", "kv_b", saved=True),
        Activation("keys", "B/dp L K/t D", "compute", "context", present=_gathered),
        Activation("values", "B/dp L K/t Dv", "compute", "context", present=_gathered),
        Activation("probs", "B/dp K/t Q L/c Lk", "f32", "attn", present=_einsum),
        Activation("attn", "B/dp L/c Q K/t Dv", "compute", "attn", saved=True),
        Activation(
            "lse", "B/dp L/c Q K/t", "f32", "context", saved=True,
            present=lambda m, c: m.ring_over(c),
        ),
        Activation("w_o", "M Q K/t Dv", "compute", "o"),
        Activation("h", _R, "compute", "o", saved=True),
    ),
    ops=(
        norm_op("attn_norm", consumers=2, recomputed_by=_SAVED_FULL),  # feeds q and kv_a
        # Down projections: on every t shard (the latents are replicated over t).
        Op("q_a", "matmul", "token", "B/dp L M, M Rq -> B/dp L Rq",
           lambda m: 2 * m.d_model * m.mla.q_lora_rank,
           lambda m: 4 * m.d_model * m.mla.q_lora_rank, _FULL, present=_q_latent),
        _latent_norm_op("q_a_norm", lambda m: m.mla.q_lora_rank),
        matmul("q", "token", "B/dp L Rq, Rq Q K/t D -> B/dp L Q K/t D",
               lambda m: 2 * (m.mla.q_lora_rank or m.d_model) * _heads(m) * m.d_head, _FULL),
        matmul("kv_a", "token", "B/dp L M, M A -> B/dp L A",
               lambda m: 2 * m.d_model * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim), _FULL),
        _latent_norm_op("kv_a_norm", lambda m: m.mla.kv_lora_rank),
        matmul("kv_b", "token", "B/dp L R, R K/t Dkv -> B/dp L K/t Dkv",
               lambda m: 2 * m.mla.kv_lora_rank * _heads(m)
               * (m.mla.qk_nope_head_dim + m.mla.v_head_dim), _FULL),
        # RoPE on q's rope part per head and the one shared rope key (6 per pair).
        elementwise("rope", "token", "B/dp L Q K/t P",
                    lambda m: 3 * (_heads(m) + 1) * m.mla.qk_rope_head_dim,
                    lambda m: 3 * (_heads(m) + 1) * m.mla.qk_rope_head_dim, _FULL),
        Op("context", "transfer", "token", "B/dp L K/t D", lambda m: 0, lambda m: 0, _SAVED_FULL),
        matmul("scores", "pair", "B/dp Lq Q K/t D, B/dp Lk K/t D -> B/dp Lq Lk Q K/t",
               lambda m: 2 * m.d_head, _SAVED_FULL),
        elementwise("mask", "pair", "B/dp Lq Lk Q K/t", lambda m: 2, lambda m: 2, _SAVED_FULL),
        elementwise("softmax", "pair", "B/dp Lq Lk Q K/t", lambda m: 5, lambda m: 4, _SAVED_FULL),
        matmul("values", "pair", "B/dp Lq Lk Q K/t, B/dp Lk K/t Dv -> B/dp Lq Q K/t Dv",
               lambda m: 2 * m.mla.v_head_dim, _FULL),
        matmul("o", "token", "B/dp L Q K/t Dv, M Q K/t Dv -> B/dp L M",
               lambda m: 2 * _heads(m) * m.mla.v_head_dim * m.d_model, _FULL),
        elementwise("attn_residual", "token", "B/dp L M/t", lambda m: m.d_model,
                    lambda m: m.d_model, _FULL),
    ),
    weights=MLAWeights,
    forward=mla_forward,
    backward=mla_backward,
    input="x",
    output="h",
)  # fmt: skip
"""The MLA block's declarations. ``saved`` marks what remat=saved keeps (q, k, v, the
attention output, h); the input side's activations are never read by the explicit backward
(``needed=False``: its ``jax.vjp`` re-runs them from x)."""
