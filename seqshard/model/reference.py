"""The oracle: the same model in plain single-device JAX, written to be obviously right.

No shard_map, no seqshard ops, no scan, no remat: a Python loop over layers, full-vocabulary
log-softmax, RoPE as a complex rotation. Casts to ``compute_dtype`` happen at the same points
as in the sharded model (matmul inputs), so with ``compute_dtype='float32'`` the two agree to
f32 rounding; with bfloat16 they agree only to bf16 rounding (see the tests' tolerances).
Every matmul is :func:`seqshard.shardlib.matmul.einsum`, as every one of the sharded model's
is: the same accumulation (bf16 products summed in f32) and the same output dtypes, here and
in the benchmarks' baselines below.

The pieces are public so that one copy of this math also serves as the benchmarks' plain-jit
baselines (``scripts/bench_step.py``, ``scripts/bench_gpu.py``), which scan
:func:`reference_layer` under ``jax.checkpoint`` and annotate shardings or swap the attention
kernel through its hooks::

    x = reference_embed(cfg, weights, tokens)
    for i in range(cfg.n_layers):
        x = reference_layer(cfg, layer_i, x, positions, mask)   # mark=, constrain= identity,
                                                                # attend=reference_attention
    logits = reference_unembed(cfg, weights, x)
    total, count = reference_loss_terms(logits, tokens, is_seq_start)

Shapes: B batch, L sequence, M d_model, F d_ff, V vocab, Q query heads per kv head, K kv heads,
D head dim (the letters of ``seqshard/model/transformer.py``, unsharded here).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from seqshard.model.attention import rope_attention_factor, rope_frequencies
from seqshard.model.config import AttentionMask, ModelConfig
from seqshard.model.mla import softmax_mscale
from seqshard.model.weights import Layer, Weights
from seqshard.shardlib import fp8
from seqshard.shardlib.matmul import einsum

__all__ = [
    "Attend",
    "reference_attention",
    "reference_attention_half",
    "reference_embed",
    "reference_layer",
    "reference_logits_fn",
    "reference_loss_fn",
    "reference_loss_terms",
    "reference_mask",
    "reference_moe_layer",
    "reference_mtp",
    "reference_norm",
    "reference_positions",
    "reference_unembed",
]


Attend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
"""``(q, k, v, mask) -> attn``: softmax(q k^T / sqrt(D), masked) v, for :func:`reference_layer`'s
``attend`` hook. q [B, L, Q, K, D], k and v [B, L, K, D], mask bool[B or 1, Lq, Lk]; the output
is shaped like q, in v's dtype."""


def _identity(x: jax.Array) -> jax.Array:
    return x


def reference_norm(x: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last dimension of [B, L, M], in f32."""
    x = x.astype(jnp.float32)
    return x / jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + eps) * gain[None, None, :]


def _head_norm(x, gain, eps):
    """RMSNorm over the last dimension (a head's D) of x [B, L, heads..., D], in f32."""
    x = x.astype(jnp.float32)
    gain = gain.reshape((1,) * (x.ndim - 1) + gain.shape)
    return x / jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + eps) * gain


def _rope(x, positions, freq, factor: float = 1.0):
    """x: [B, L, heads..., D]; pairs (i, i + D/2) rotate as complex numbers by position * freq
    (and scale by YaRN's attention ``factor``)."""
    half = x.shape[-1] // 2
    angle = positions[:, :, None].astype(jnp.float32) * freq[None, None, :]  # [B, L, D/2]
    angle = angle.reshape(angle.shape[:2] + (1,) * (x.ndim - 3) + (half,))
    xf = x.astype(jnp.float32)
    z = (xf[..., :half] + 1j * xf[..., half:]) * (factor * jnp.exp(1j * angle))
    return jnp.concatenate([z.real, z.imag], axis=-1).astype(x.dtype)


def reference_mask(is_seq_start: jax.Array, mode: AttentionMask) -> jax.Array:
    """bool[B or 1, Lq, Lk]: the key is at or before the query (and, ``document``, in its document)."""
    length = is_seq_start.shape[1]
    doc = jnp.cumsum(is_seq_start, axis=1)
    same_doc = doc[:, :, None] == doc[:, None, :]
    causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
    return causal[None] & (same_doc if mode == "document" else True)


def reference_positions(is_seq_start: jax.Array) -> jax.Array:
    """i32[B, L]: each token's position in its document, the number of its document's tokens
    before it in the row (a row may begin mid-document: it counts from 0 there).

    Counted off the document mask, not by a loop over L: the benchmark's GSPMD baseline would
    unroll a loop into L partitioned ops, seconds of compile time."""
    return (jnp.sum(reference_mask(is_seq_start, "document"), axis=-1) - 1).astype(jnp.int32)


def reference_embed(cfg: ModelConfig, weights: Weights, tokens: jax.Array) -> jax.Array:
    """i32[B, L] ids -> the residual stream [B, L, M] in compute dtype."""
    return weights.embed.astype(jnp.dtype(cfg.compute_dtype))[tokens]


def reference_layer(
    cfg: ModelConfig,
    w: Layer,
    x: jax.Array,
    positions: jax.Array,
    mask: jax.Array,
    *,
    mark: Callable[[jax.Array], jax.Array] = _identity,
    constrain: Callable[[jax.Array], jax.Array] = _identity,
    attend: Attend | None = None,
) -> jax.Array:
    """One pre-norm layer (GQA attention with RoPE, then SwiGLU): residual [B, L, M] -> same.

    ``w`` is one layer's weights (no ``layers`` dim). The hooks change no value:
    ``mark`` tags the values a scanned, rematerialized caller keeps for the backward pass (the
    ones ``seqshard/model/transformer.py`` marks with ``save_for_backward``: q and k after
    RoPE, v, the attention output, the mid-layer residual, gate and up); ``constrain`` is
    applied to the residual stream after each residual add (e.g. a sharding constraint);
    ``attend`` replaces :func:`reference_attention` (the default) by another kernel of the same
    math, e.g. a fused one (``scripts/bench_gpu.py``'s cuDNN baseline).
    """
    x = reference_attention_half(
        cfg, w, x, positions, mask, mark=mark, constrain=constrain, attend=attend
    )
    dt = jnp.dtype(cfg.compute_dtype)
    sites = _Sites(cfg, getattr(w, "swiglu_fp8_history", None))  # nh w_gate w_up y w_down
    nx = sites.operand(0, reference_norm(x, w.ln2, cfg.norm_eps).astype(dt))
    gate = mark(sites.project("blm,mf->blf", nx, 1, w.w_gate))
    up = mark(sites.project("blm,mf->blf", nx, 2, w.w_up))
    down = sites.project("blf,mf->blm", sites.operand(3, jax.nn.silu(gate) * up), 4, w.w_down)
    return constrain((x + down).astype(dt))


class _Sites:
    """A block's FP8 sites (model.fp8; seqshard.model.fp8_scaling), each a whole tensor: on
    e4m3's grid at its own amax's scale (current) or its history's (delayed, ``history``
    [sites, fp8_history]); projections' cotangents on e5m2's grid."""

    def __init__(self, cfg: ModelConfig, history: jax.Array | None):
        self.cfg, self.history = cfg, history

    def _scale(self, site: int, x: jax.Array) -> jax.Array | None:
        if self.cfg.fp8 != "delayed":
            return None  # the current amax's: the fp8 functions take it
        now = jnp.max(jnp.abs(jax.lax.stop_gradient(x))).astype(jnp.float32)
        past = jax.lax.stop_gradient(self.history[site])
        return fp8.delayed_scale(past, now, fp8.FORWARD)

    def operand(self, site: int, x: jax.Array) -> jax.Array:
        """A projection's input ``x``, site ``site``."""
        return fp8.local_quantized(self.cfg.fp8, x, self._scale(site, x))

    def project(self, equation: str, x: jax.Array, site: int, w: jax.Array) -> jax.Array:
        """The projection ``x . w`` of an input made by :meth:`operand` and the weight ``w``
        (site ``site``) in compute dtype, as the sharded model's gathers and backward do."""
        dt = jnp.dtype(self.cfg.compute_dtype)
        if self.cfg.fp8 == "none":
            return einsum(equation, x, w.astype(dt))
        w = fp8.local_weight_quantized(self.cfg.fp8, w, dt, self._scale(site, w))
        return fp8.local_gradient_quantized(self.cfg.fp8, einsum(equation, x, w))


def reference_attention_half(
    cfg: ModelConfig,
    w: Layer,
    x: jax.Array,
    positions: jax.Array,
    mask: jax.Array,
    *,
    mark: Callable[[jax.Array], jax.Array] = _identity,
    constrain: Callable[[jax.Array], jax.Array] = _identity,
    attend: Attend | None = None,
) -> jax.Array:
    """The residual [B, L, M] after a layer's attention block (hooks as :func:`reference_layer`'s;
    ``scripts/bench_moe.py``'s baseline puts its own MoE FFN after it)."""
    dt = jnp.dtype(cfg.compute_dtype)
    nx = reference_norm(x, w.ln1, cfg.norm_eps).astype(dt)
    if cfg.attention == "mla":
        q, k, v = _reference_mla_inputs(cfg, w, nx, positions)
        q, k, v = mark(q), mark(k), mark(v)
        attn = mark((attend or reference_attention)(q, k, v, mask))
        return mark(constrain(x + einsum("blqkd,mqkd->blm", attn, w.w_o.astype(dt))))
    sites = _Sites(cfg, getattr(w, "attention_fp8_history", None))  # nx w_q w_kv o_in w_o
    if cfg.fp8 == "none":
        q = einsum("blm,mqkd->blqkd", nx, w.w_q.astype(dt))
        k = einsum("blm,mkd->blkd", nx, w.w_kv[0].astype(dt))
        v = einsum("blm,mkd->blkd", nx, w.w_kv[1].astype(dt))
    else:  # k and v as one tensor, as the sharded model's w_kv (one scale for both)
        nx = sites.operand(0, nx)
        q = sites.project("blm,mqkd->blqkd", nx, 1, w.w_q)
        k, v = sites.project("blm,smkd->sblkd", nx, 2, w.w_kv)
    if cfg.qk_norm:  # Qwen3: each head RMS-normalized over D, before RoPE
        q = _head_norm(q, w.q_norm, cfg.norm_eps).astype(dt)
        k = _head_norm(k, w.k_norm, cfg.norm_eps).astype(dt)
    v = mark(v)
    factor = rope_attention_factor(cfg)
    q = mark(_rope(q, positions, rope_frequencies(cfg), factor))
    k = mark(_rope(k, positions, rope_frequencies(cfg), factor))
    attn = mark((attend or reference_attention)(q, k, v, mask))
    out = sites.project("blqkd,mqkd->blm", sites.operand(3, attn), 4, w.w_o)
    return mark(constrain(x + out))


def _reference_mla_inputs(cfg: ModelConfig, w: Layer, nx: jax.Array, positions: jax.Array):
    """Multi-head latent attention's q [B, L, 1, K, D], k [B, L, K, D] and v [B, L, K, Dv]
    from the normed input, as Hugging Face's DeepSeek-V3 writes them: latents RMS normalized,
    the rope parts rotated (interleaved pairs gathered as evens then odds first), one rope
    key shared by every head, q times YaRN's softmax mscale^2."""
    mla, dt = cfg.mla, jnp.dtype(cfg.compute_dtype)
    nope, r = mla.qk_nope_head_dim, mla.kv_lora_rank
    freq = rope_frequencies(cfg)
    factor = rope_attention_factor(cfg)

    def rotate(x):
        if mla.rope_interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return _rope(x, positions, freq, factor)

    if mla.q_lora_rank:
        q_a = einsum("blm,mr->blr", nx, w.w_q_a.astype(dt))
        q_a = _head_norm(q_a, w.q_a_norm, cfg.norm_eps).astype(dt)
        q = einsum("blr,rqkd->blqkd", q_a, w.w_q_b.astype(dt))
    else:
        q = einsum("blm,mqkd->blqkd", nx, w.w_q.astype(dt))
    q = jnp.concatenate([q[..., :nope], rotate(q[..., nope:])], axis=-1)
    scale = softmax_mscale(cfg)
    if scale != 1.0:
        q = (q.astype(jnp.float32) * scale).astype(dt)
    kv_a = einsum("blm,ma->bla", nx, w.w_kv_a.astype(dt))
    latent = _head_norm(kv_a[..., :r], w.kv_a_norm, cfg.norm_eps).astype(dt)
    k_rope = rotate(kv_a[..., r:])
    kv = einsum("blr,rke->blke", latent, w.w_kv_b.astype(dt))
    k_nope, v = kv[..., :nope], kv[..., nope:]
    shared = jnp.broadcast_to(k_rope[:, :, None, :], k_nope.shape[:-1] + k_rope.shape[-1:])
    return q, jnp.concatenate([k_nope, shared], axis=-1), v


def reference_moe_layer(
    cfg: ModelConfig, w: Layer, x: jax.Array, positions: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One mixture-of-experts layer, the routing written densely: every expert applied to
    every token, weighted by the router's sparse gates (0 for the experts not chosen), no
    dispatch. (residual [B, L, M], this layer's balancing terms f32[]: its aux and z losses
    over the batch, as :mod:`seqshard.model.moe` defines them)."""
    moe = cfg.moe
    dt = jnp.dtype(cfg.compute_dtype)
    x = reference_attention_half(cfg, w, x, positions, mask)
    nx = reference_norm(x, w.ln2, cfg.norm_eps).astype(dt)
    logits = jnp.einsum("blm,me->ble", nx.astype(jnp.float32), w.router)
    # Softmax scores (Mixtral, Qwen3-MoE) or sigmoid ones (DeepSeek-V3); the aux loss averages
    # them normalized to sum 1 (a no-op on a softmax's, up to rounding).
    scores = (jax.nn.softmax if moe.router == "softmax" else jax.nn.sigmoid)(logits)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    bias = jnp.broadcast_to(jax.lax.stop_gradient(w.router_bias), scores.shape)
    choice = scores + bias
    if moe.n_group > 1:  # DeepSeek-V3: only the experts of the topk_group best groups
        size = moe.n_experts // moe.n_group
        group = jnp.arange(moe.n_experts) // size  # each expert's group
        # A group's score: its best expert's plus its second best's.
        in_group = group[None, :] == jnp.arange(moe.n_group)[:, None]  # [G, E]
        per_group = jnp.where(in_group[None, None], choice[..., None, :], -jnp.inf)  # [B, L, G, E]
        ranked = jnp.sort(per_group, axis=-1)
        group_scores = ranked[..., -1] + ranked[..., -2]  # [B, L, G]
        # The topk_group highest-scoring groups (ties to the lower index, as lax.top_k).
        order = jnp.argsort(-group_scores, axis=-1, stable=True)[..., : moe.topk_group]
        groups = jnp.arange(moe.n_group)[None, None, None, :]
        kept = jnp.any(order[..., :, None] == groups, axis=-2)  # [B, L, G]
        choice = jnp.where(kept[..., group], choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, moe.top_k)
    chosen = jax.nn.one_hot(ids, moe.n_experts, dtype=jnp.float32).sum(axis=-2)  # [B, L, E]
    gates = scores * chosen
    if moe.norm_topk_prob:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    gates = gates * moe.routed_scaling_factor
    gate = einsum("blm,emx->blex", nx, w.w_gate.astype(dt))
    up = einsum("blm,emx->blex", nx, w.w_up.astype(dt))
    experts = einsum("blex,emx->blem", jax.nn.silu(gate) * up, w.w_down.astype(dt))
    y = einsum("blem,ble->blm", experts, gates.astype(dt))
    if moe.n_shared:
        s_gate = einsum("blm,ms->bls", nx, w.s_gate.astype(dt))
        shared = jax.nn.silu(s_gate) * einsum("blm,ms->bls", nx, w.s_up.astype(dt))
        y = y + einsum("bls,ms->blm", shared, w.s_down.astype(dt))
    tokens = logits.shape[0] * logits.shape[1]
    f = chosen.sum(axis=(0, 1)) / (tokens * moe.top_k)
    weight = moe.aux_loss_weight if moe.balance == "aux_loss" else 0.0
    aux = weight * moe.n_experts * jnp.sum(f * probs.mean(axis=(0, 1)))
    z = moe.z_loss_weight * jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return (x + y).astype(dt), aux + z


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked softmax(q k^T / sqrt(D)) v per (q head, kv head) pair, scores and softmax in f32:
    q [B, L, Q, K, D], k and v [B, L, K, D], mask bool[B or 1, Lq, Lk] -> [B, L, Q, K, D]."""
    scores = einsum("bsqkd,btkd->bqkst", q, k, out_dtype=jnp.float32)
    scores = scores / jnp.sqrt(q.shape[-1])
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return einsum("bqkst,btkd->bsqkd", probs, v)


def reference_unembed(cfg: ModelConfig, weights: Weights, x: jax.Array) -> jax.Array:
    """The residual [B, L, M] -> final RMSNorm -> f32[B, L, V] logits."""
    dt = jnp.dtype(cfg.compute_dtype)
    nx = reference_norm(x, weights.final_norm, cfg.norm_eps).astype(dt)
    return einsum("blm,vm->blv", nx, weights.unembed.astype(dt), out_dtype=jnp.float32)


def _ffn_layer(cfg: ModelConfig, w: Layer, x, positions, mask, moe: bool):
    """A layer: (residual, its balancing terms f32[]: 0 for a dense one)."""
    if moe:
        return reference_moe_layer(cfg, w, x, positions, mask)
    return reference_layer(cfg, w, x, positions, mask), jnp.zeros((), jnp.float32)


def _shifted(x: jax.Array, by: int, fill) -> jax.Array:
    """x[:, i + by] at each i of [B, L], ``fill`` past the row's end."""
    return jnp.concatenate([x[:, by:], jnp.full((x.shape[0], by), fill, x.dtype)], axis=1)


def reference_mtp(cfg: ModelConfig, weights: Weights, x, tokens, is_seq_start, loss_mask=None):
    """DeepSeek-V3's multi-token prediction on the last residual ``x`` [B, L, M]: (the modules'
    loss, loss_weight / depth x the sum of each module's mean cross-entropy, f32[]; their
    balancing terms summed). Module k reads [norm(embed(token i + k)) | norm(h^{k-1}_i)]
    projected by w_eh, runs one layer, and predicts token i + k + 1 through its head norm and
    the shared unembedding; a target counts inside the row and i's document (and loss mask)."""
    positions = reference_positions(is_seq_start)
    mask = reference_mask(is_seq_start, cfg.attention_mask)
    dt = jnp.dtype(cfg.compute_dtype)
    segments = jnp.cumsum(is_seq_start, axis=1)
    means, balancing = [], jnp.zeros((), jnp.float32)
    h = x
    for k in range(1, cfg.mtp.depth + 1):
        w = jax.tree.map(lambda a, k=k: a[k - 1], weights.mtp)
        emb = reference_embed(cfg, weights, _shifted(tokens, k, 0))
        both = jnp.concatenate(
            [
                reference_norm(emb, w.enorm, cfg.norm_eps).astype(dt),
                reference_norm(h, w.hnorm, cfg.norm_eps).astype(dt),
            ],
            axis=-1,
        )
        h = einsum("bln,mn->blm", both, w.w_eh.astype(dt))
        # One layer as the model's last (an MoE layer when the model has experts).
        h, terms = _ffn_layer(cfg, w, h, positions, mask, cfg.dim_sizes()["moe_layers"] > 0)
        balancing = balancing + terms
        nx = reference_norm(h, w.head_norm, cfg.norm_eps).astype(dt)
        logits = einsum("blm,vm->blv", nx, weights.unembed.astype(dt), out_dtype=jnp.float32)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(log_probs, _shifted(tokens, k + 1, 0)[..., None], axis=-1)
        counted = _shifted(segments, k + 1, -1) == segments
        if loss_mask is not None:
            counted = counted & _shifted(jnp.asarray(loss_mask, bool), k + 1, False)
        total = jnp.sum(jnp.where(counted, nll[..., 0], 0.0))
        means.append(total / jnp.maximum(jnp.sum(counted, dtype=jnp.float32), 1.0))
    return cfg.mtp.loss_weight / cfg.mtp.depth * sum(means), balancing


def _logits_and_balancing(weights, tokens, is_seq_start, cfg: ModelConfig, loss_mask=None):
    """(f32[B, L, vocab] logits, the MoE layers' balancing terms summed, plus the multi-token
    prediction modules' loss and balancing terms with ``model.mtp``)."""
    tokens = jnp.asarray(tokens).astype(jnp.int32)
    is_seq_start = jnp.asarray(is_seq_start).astype(bool)
    positions = reference_positions(is_seq_start)
    mask = reference_mask(is_seq_start, cfg.attention_mask)
    x = reference_embed(cfg, weights, tokens)
    sizes = cfg.dim_sizes()
    balancing = jnp.zeros((), jnp.float32)
    for stack in ("layers", "moe_layers"):
        for i in range(sizes[stack]):
            w = jax.tree.map(lambda a, i=i: a[i], getattr(weights, stack))
            x, terms = _ffn_layer(cfg, w, x, positions, mask, stack == "moe_layers")
            balancing = balancing + terms
    if cfg.mtp.depth:
        mtp, terms = reference_mtp(cfg, weights, x, tokens, is_seq_start, loss_mask)
        balancing = balancing + mtp + terms
    return reference_unembed(cfg, weights, x), balancing


def reference_logits_fn(weights: Weights, tokens, is_seq_start, cfg: ModelConfig) -> jax.Array:
    """f32[B, L, vocab] logits of the model, computed on one device."""
    return _logits_and_balancing(weights, tokens, is_seq_start, cfg)[0]


def reference_loss_terms(
    logits: jax.Array, tokens: jax.Array, is_seq_start: jax.Array, loss_mask=None
) -> jax.Array:
    """f32[2]: (summed next-token cross-entropy, positions counted) over the batch.

    A position counts when its next token is in the same document and masked in by
    ``loss_mask`` (None: every token counts)."""
    log_probs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]
    counted = ~is_seq_start[:, 1:]
    if loss_mask is not None:
        counted = counted & jnp.asarray(loss_mask, bool)[:, 1:]
    return jnp.stack([jnp.sum(jnp.where(counted, nll, 0.0)), jnp.sum(counted, dtype=jnp.float32)])


def reference_loss_fn(
    weights: Weights, tokens, is_seq_start, cfg: ModelConfig, loss_mask=None
) -> jax.Array:
    """f32[]: mean next-token cross-entropy over the counted positions (the next token in the
    same document and masked in), plus the MoE layers' balancing terms over the batch (with
    experts)."""
    tokens = jnp.asarray(tokens).astype(jnp.int32)
    is_seq_start = jnp.asarray(is_seq_start).astype(bool)
    logits, balancing = _logits_and_balancing(weights, tokens, is_seq_start, cfg, loss_mask)
    total, count = reference_loss_terms(logits, tokens, is_seq_start, loss_mask)
    return total / jnp.maximum(count, 1.0) + balancing
