"""The oracle: the same model in plain single-device JAX, written to be obviously right.

No shard_map, no seqshard ops, no scan, no remat: a Python loop over layers, full-vocabulary
log-softmax, RoPE as a complex rotation. Casts to ``compute_dtype`` happen at the same points
as in the sharded model (matmul inputs), so with ``compute_dtype='float32'`` the two agree to
f32 rounding; with bfloat16 they agree only to bf16 rounding (see the tests' tolerances).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from seqshard.model.config import ModelConfig
from seqshard.model.weights import Weights

__all__ = ["reference_logits_fn", "reference_loss_fn"]


def _norm(x, gain, eps):
    x = x.astype(jnp.float32)
    return x / jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + eps) * gain[None, None, :]


def _positions(is_seq_start):
    """Position within the document, by a plain loop over the sequence."""
    positions, current = [], jnp.zeros(is_seq_start.shape[0], jnp.int32)
    for i in range(is_seq_start.shape[1]):
        current = jnp.where(is_seq_start[:, i], 0, current + (i > 0))
        positions.append(current)
    return jnp.stack(positions, axis=1)


def _rope(x, positions, theta):
    """x: [B, L, heads..., D]; pairs (i, i + D/2) rotate as complex numbers."""
    half = x.shape[-1] // 2
    freq = 1.0 / theta ** (jnp.arange(half) * 2 / x.shape[-1])
    angle = positions[:, :, None].astype(jnp.float32) * freq[None, None, :]  # [B, L, D/2]
    angle = angle.reshape(angle.shape[:2] + (1,) * (x.ndim - 3) + (half,))
    xf = x.astype(jnp.float32)
    z = (xf[..., :half] + 1j * xf[..., half:]) * jnp.exp(1j * angle)
    return jnp.concatenate([z.real, z.imag], axis=-1).astype(x.dtype)


def _mask(is_seq_start, mode):
    length = is_seq_start.shape[1]
    doc = jnp.cumsum(is_seq_start, axis=1)
    same_doc = doc[:, :, None] == doc[:, None, :]
    causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
    return causal[None] & (same_doc if mode == "document" else True)


def reference_logits_fn(weights: Weights, tokens, is_seq_start, cfg: ModelConfig) -> jax.Array:
    """f32[B, L, vocab] logits of the model, computed on one device."""
    dt = jnp.dtype(cfg.compute_dtype)
    tokens = jnp.asarray(tokens).astype(jnp.int32)
    is_seq_start = jnp.asarray(is_seq_start).astype(bool)
    positions = _positions(is_seq_start)
    mask = _mask(is_seq_start, cfg.attention_mask)
    x = weights.embed.astype(dt)[tokens]
    for i in range(cfg.n_layers):
        w = jax.tree.map(lambda a, i=i: a[i], weights.layers)
        nx = _norm(x, w.ln1, cfg.norm_eps).astype(dt)
        q = jnp.einsum("blm,mqkd->blqkd", nx, w.w_q.astype(dt))
        k = jnp.einsum("blm,mkd->blkd", nx, w.w_kv[0].astype(dt))
        v = jnp.einsum("blm,mkd->blkd", nx, w.w_kv[1].astype(dt))
        q, k = _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta)
        scores = jnp.einsum("bsqkd,btkd->bqkst", q, k, preferred_element_type=jnp.float32)
        scores = scores / jnp.sqrt(cfg.d_head)
        scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        attn = jnp.einsum("bqkst,btkd->bsqkd", probs, v)
        x = x + jnp.einsum("blqkd,mqkd->blm", attn, w.w_o.astype(dt))
        nx = _norm(x, w.ln2, cfg.norm_eps).astype(dt)
        gate = nx @ w.w_gate.astype(dt)
        up = nx @ w.w_up.astype(dt)
        x = (x + (jax.nn.silu(gate) * up) @ w.w_down.astype(dt).T).astype(dt)
    nx = _norm(x, weights.final_norm, cfg.norm_eps).astype(dt)
    return jnp.einsum(
        "blm,vm->blv", nx, weights.unembed.astype(dt), preferred_element_type=jnp.float32
    )


def reference_loss_fn(weights: Weights, tokens, is_seq_start, cfg: ModelConfig) -> jax.Array:
    """f32[]: mean next-token cross-entropy over positions whose next token is in the same document."""
    tokens = jnp.asarray(tokens).astype(jnp.int32)
    is_seq_start = jnp.asarray(is_seq_start).astype(bool)
    logits = reference_logits_fn(weights, tokens, is_seq_start, cfg)[:, :-1]
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]
    counted = ~is_seq_start[:, 1:]
    return jnp.sum(jnp.where(counted, nll, 0.0)) / jnp.maximum(jnp.sum(counted), 1)
