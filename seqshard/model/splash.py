"""Splash attention (Pallas' TPU flash-attention kernel), hosted in the model's checked shard_map.

Per device, as every implementation in :mod:`seqshard.model.attention`: ``q: 'B/dp L Q K/t D'``,
``k, v: 'B/dp L K/t D'``, and the documents as segment ids ``'B/dp L'`` int32 (keys attend within
their own segment; None: causal only). The kernel takes heads-major blocks per batch row,
``q [K*Q, L, D]`` (kv-major: q head n uses kv head n // Q, as GQA) and ``k, v [K, L, D]``, and
is vmapped over B. It does not scale q: q is multiplied by 1/sqrt(D) first.

Blocks are ``gcd(L, 512)`` long (512, 256 or 128): L must be a multiple of 128, the kernel's
lane width. Off TPU the kernel runs in Pallas interpret mode: its program evaluated step by step
by XLA, equal to einsum attention to f32 rounding and slow (seconds to compile and run at
L=128), which is how the CPU tests run it.

Hosting: the kernel, forward and backward, runs in an unchecked region inside a
``jax.custom_vjp`` (:mod:`seqshard.model.pallas_hosting`, which says why and why it is sound).

Cost: the backward pass re-runs the kernel's forward (``jax.vjp`` of the kernel, for its
logsumexp) before the dq and dkv kernels, so nothing beyond q, k, v and the segment ids is kept
for it; under ``remat=none`` that is one attention forward more than a kernel that kept its
logsumexp.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from seqshard.model.pallas_hosting import hosted_attention, hosted_attention_vjp

__all__ = ["block_size", "splash_attention", "splash_attention_vjp"]

LANES = 128
"""Splash blocks are multiples of the TPU lane width: L must be one too."""
MAX_BLOCK = 512


def block_size(length: int) -> int:
    """The kernel's block along L (queries and keys): 512, 256 or 128, dividing ``length``."""
    if length % LANES:
        raise ValueError(
            f"model.attention_impl=splash (which 'auto' picks on TPU) needs the sequence length "
            f"(train.seq_len) to be a multiple of {LANES}, its kernel's block; got seq_len="
            f"{length}. Use a seq_len that is (e.g. {max(LANES, length // LANES * LANES)}), or "
            f"model.attention_impl=einsum."
        )
    return math.gcd(length, MAX_BLOCK)


def splash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None
) -> jax.Array:
    """Causal softmax(q k^T / sqrt(D)) v within segments: 'B/dp L Q K/t D' out.

    ``segment_ids: 'B/dp L'`` int32, or None for a causal mask across the whole row. Inside a
    shard_map the kernel is hosted (:func:`~seqshard.model.pallas_hosting.hosted_attention`).
    """
    return hosted_attention(_local_attention, _local_attention_vjp, q, k, v, segment_ids)


def splash_attention_vjp(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, g: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv of :func:`splash_attention` given its output's cotangent ``g``, hosted as
    its backward is (the kernel's own VJP), without running the forward kernel first: for a
    hand-written backward (``model.backward=explicit``), which has q, k, v at hand. Each
    cotangent is typed as varying over the axes its inputs vary over."""
    return hosted_attention_vjp(_local_attention_vjp, q, k, v, segment_ids, g)


# ---------------------------------------------------------------------------------------------
# The kernel on one device's blocks (what pallas_hosting runs)


def _local_attention(q, k, v, segment_ids):
    qh, kh, vh = _heads_major(q, k, v)
    # The output has v's head size (MLA's v_head_dim may differ from q's).
    out_shape = q.shape[:-1] + v.shape[-1:]
    return _from_heads_major(_kernel(q.shape, segment_ids)(qh, kh, vh), out_shape)


def _local_attention_vjp(q, k, v, segment_ids, g):
    """The cotangents of q, k, v given the output's ``g``: jax.vjp of the kernel."""
    qh, kh, vh = _heads_major(q, k, v)
    _, pullback = jax.vjp(_kernel(q.shape, segment_ids), qh, kh, vh)
    dqh, dkh, dvh = pullback(_to_heads_major(g))
    # q was scaled on the way in (see _heads_major): so is its cotangent.
    dq = _from_heads_major(dqh, q.shape) * (1 / math.sqrt(q.shape[-1]))
    return dq.astype(q.dtype), jnp.swapaxes(dkh, 1, 2), jnp.swapaxes(dvh, 1, 2)


def _heads_major(q, k, v):
    """'B L Q K D' q scaled by 1/sqrt(D) -> [B, K*Q, L, D]; 'B L K D' k, v -> [B, K, L, D]."""
    scaled = (q.astype(jnp.float32) * (1 / math.sqrt(q.shape[-1]))).astype(q.dtype)
    return _to_heads_major(scaled), jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)


def _to_heads_major(x):
    batch, length, n_q, n_kv, d_head = x.shape
    return jnp.transpose(x, (0, 3, 2, 1, 4)).reshape(batch, n_kv * n_q, length, d_head)


def _from_heads_major(x, shape):
    batch, length, n_q, n_kv, d_head = shape
    return jnp.transpose(x.reshape(batch, n_kv, n_q, length, d_head), (0, 3, 2, 1, 4))


# Every block size of the kernel's forward and backward (block_q, block_kv_dkv, ...).
_BLOCK_FIELDS = tuple(
    f.name for f in dataclasses.fields(splash.BlockSizes) if f.name.startswith("block_")
)


def _kernel(q_shape, segment_ids):
    """The splash kernel for q of ``q_shape``, vmapped over B: (qh, kh, vh) -> out heads-major."""
    _, length, n_q, n_kv, _ = q_shape
    block = block_size(length)
    blocks = splash.BlockSizes(**dict.fromkeys(_BLOCK_FIELDS, block))  # one size for all
    causal = splash.MultiHeadMask([splash.CausalMask((length, length))] * (n_kv * n_q))
    kernel = splash.make_splash_mha(
        causal,
        block_sizes=blocks,
        head_shards=1,
        q_seq_shards=1,
        interpret=jax.default_backend() != "tpu",
    )
    if segment_ids is None:
        return jax.vmap(kernel)

    def row(qh, kh, vh, ids):
        return kernel(qh, kh, vh, segment_ids=splash.SegmentIds(q=ids, kv=ids))

    return lambda qh, kh, vh: jax.vmap(row)(qh, kh, vh, segment_ids)
