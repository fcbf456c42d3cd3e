"""Grouped-query attention with RoPE and packed-document masks, per device.

Shapes inside the shard_map (per-device blocks): ``q: 'B/dp L@zigzag/c Q K/t D'``, ``k, v: 'B/dp L@zigzag/c K/t D'``.
Each t shard holds whole kv heads and their query heads, so attention needs no communication.

Positions restart at every document start, so a document's logits do not depend on where it
was packed. Implementations (``ModelConfig.attention_impl``):

    einsum   plain einsums, f32 scores and softmax (CPU, and the readable definition)
    cudnn    jax.nn.dot_product_attention(implementation='cudnn'): fused flash attention (GPU)
    xla      jax.nn.dot_product_attention(implementation='xla'): XLA's unfused attention
    splash   Pallas splash attention: TPU flash attention with segment ids (seqshard.model.splash;
             off TPU it runs in Pallas interpret mode, exact but slow); L a multiple of 128
    pallas   Pallas' GPU flash attention with segment ids (seqshard.model.pallas_gpu; off GPU
             in interpret mode); L a multiple of 16
    auto     splash on TPU; on GPU pallas for the document mask, cudnn for the causal one;
             einsum elsewhere

``jax.nn.dot_product_attention`` takes no segment ids, so with cudnn the ``document`` mask is
passed as a dense boolean mask, said to be about 2.2x slower than ``is_causal`` on an H100 at
L=2048 (docs/benchmarks.md). Splash and pallas take the documents as segment ids instead
(:func:`attention_mask` gives them), and skip the blocks above the diagonal as the causal mask
does. ``auto`` keeps cuDNN for the causal mask: its ``is_causal`` kernel reads no mask, and is
the one the recorded GPU runs measured (docs/benchmarks.md). A dense mask (the row split over
c > 1 under ``allgather``, generation's padded prompts) has no segment ids: splash and pallas
hand it to :func:`dense_mask_impl`'s implementation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from seqshard.model.config import AttentionImpl, AttentionMask, ModelConfig
from seqshard.shardlib import shardops

__all__ = [
    "apply_rope",
    "attention",
    "attention_mask",
    "attention_vjp",
    "dense_mask_impl",
    "document_positions",
    "einsum_probabilities",
    "einsum_values",
    "fused_attention",
    "resolve_impl",
    "rope",
    "rope_attention_factor",
    "rope_frequencies",
    "rope_tables",
    "yarn_frequencies",
    "yarn_mscale",
]


def document_positions(is_seq_start: jax.Array) -> jax.Array:
    """Each token's position within its document: ``[B, L] bool -> [B, L] int32``."""
    index = jnp.broadcast_to(
        jnp.arange(is_seq_start.shape[-1], dtype=jnp.int32), is_seq_start.shape
    )
    start = lax.cummax(jnp.where(is_seq_start, index, 0), axis=is_seq_start.ndim - 1)
    return index - start


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """f32[R/2]: the angle per position step of pair (i, i + R/2): rope_theta^(-2i/R), R the
    numbers of a head RoPE rotates (``cfg.rope_dim``: d_head, or MLA's qk_rope_head_dim).

    ``rope_type=llama3`` rescales them as Llama 3.1 (and Hugging Face's ``rope_type: llama3``)
    does, by wavelength 2 pi / f against the original context n = ``rope_original_max_position``:
    longer than n / low_freq_factor: f / rope_factor; shorter than n / high_freq_factor: f;
    between: (1 - s) f / rope_factor + s f with s = (n / wavelength - low) / (high - low).
    ``rope_type=yarn``: :func:`yarn_frequencies`."""
    d = cfg.rope_dim
    freq = cfg.rope_theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2 / d)
    if cfg.rope_type == "default":
        return freq
    if cfg.rope_type == "yarn":
        return yarn_frequencies(cfg, freq)
    n, factor = cfg.rope_original_max_position, cfg.rope_factor
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelength = 2 * math.pi / freq
    s = (n / wavelength - low) / (high - low)
    between = (1 - s) * freq / factor + s * freq
    slowed = jnp.where(wavelength > n / low, freq / factor, between)
    return jnp.where(wavelength < n / high, freq, slowed)


def yarn_frequencies(cfg: ModelConfig, freq: jax.Array) -> jax.Array:
    """YaRN's frequencies (Hugging Face's ``rope_type: yarn``, truncated correction range): pair
    i keeps ``freq[i]`` below the dimension where a head turns ``rope_beta_fast`` times over
    the original context n, is slowed by ``rope_factor`` above the one where it turns
    ``rope_beta_slow`` times, and ramps linearly between."""
    d, n, base = cfg.rope_dim, cfg.rope_original_max_position, cfg.rope_theta

    def dim_of(rotations: float) -> float:  # the pair index turning ``rotations`` times over n
        return d * math.log(n / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_of(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(dim_of(cfg.rope_beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(d // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # 1: the original frequency (extrapolated), 0: slowed (interpolated)
    return freq / cfg.rope_factor * (1 - kept) + freq * kept


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by: 1, or YaRN's attention factor (Hugging Face's
    inference from ``factor``, ``mscale`` and ``mscale_all_dim``)."""
    if cfg.rope_type != "yarn":
        return 1.0
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return yarn_mscale(cfg.rope_factor, cfg.rope_mscale) / yarn_mscale(
            cfg.rope_factor, cfg.rope_mscale_all_dim
        )
    return yarn_mscale(cfg.rope_factor)


def rope(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``[B, L, R/2]`` at ``positions`` for ``cfg`` (:func:`rope_tables` of
    :func:`rope_frequencies`, times :func:`rope_attention_factor`)."""
    cos, sin = rope_tables(positions, rope_frequencies(cfg))
    factor = rope_attention_factor(cfg)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos, sin


def rope_tables(positions: jax.Array, freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin, ``[B, L, D/2]`` f32, for rotating pairs (i, i + D/2) by position * freq[i]
    (``freq = rope_frequencies(cfg)``)."""
    angles = positions.astype(jnp.float32)[..., None] * freq[None, None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x: [B, L, ..., D]`` by the tables ``[B, L, D/2]`` (rotate-half pairing), in f32."""
    extra = x.ndim - 3  # head dims between L and D
    cos = cos.reshape(cos.shape[:2] + (1,) * extra + cos.shape[2:])
    sin = sin.reshape(sin.shape[:2] + (1,) * extra + sin.shape[2:])
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def attention_mask(
    is_seq_start: jax.Array, mode: AttentionMask, impl: AttentionImpl = "einsum"
) -> jax.Array:
    """The mask :func:`attention` takes: ``[B, Lq, Lk]`` bool, key at or before the query and
    (``document``) in its document; for splash and pallas, the segment ids ``[B, L]`` int32
    (documents numbered along the row), which their kernels combine with their own causal
    mask."""
    if resolve_impl(impl, mode) in SEGMENT_IDS:
        return jnp.cumsum(is_seq_start, axis=-1, dtype=jnp.int32)
    length = is_seq_start.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))[None]
    if mode == "causal":
        return jnp.broadcast_to(causal, (is_seq_start.shape[0], length, length))
    segment = jnp.cumsum(is_seq_start, axis=-1)
    return causal & (segment[:, :, None] == segment[:, None, :])


SEGMENT_IDS = ("splash", "pallas")
"""The implementations that take the documents as segment ids ``[B, L]``, not a dense mask."""


def resolve_impl(impl: AttentionImpl, mask: AttentionMask = "document") -> str:
    """The implementation ``auto`` means on this backend for the ``mask`` mode: splash on TPU;
    on GPU pallas for ``document`` (segment ids, no dense mask), cudnn for ``causal``
    (``is_causal``); einsum elsewhere."""
    if impl == "auto":
        backend = jax.default_backend()
        if backend == "gpu":
            return "pallas" if mask == "document" else "cudnn"
        return "splash" if backend == "tpu" else "einsum"
    return impl


def dense_mask_impl(impl: str) -> str:
    """What runs a dense ``[B, Lq, Lk]`` mask for the resolved ``impl``: itself, but for the
    segment-id kernels (:data:`SEGMENT_IDS`), which take none: cudnn on GPU (what ``auto``
    ran before pallas existed), einsum elsewhere."""
    if impl not in SEGMENT_IDS:
        return impl
    return "cudnn" if jax.default_backend() == "gpu" else "einsum"


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    impl: AttentionImpl,
    causal_only: bool,
) -> jax.Array:
    """Softmax(q k^T / sqrt(D), masked) v per (q head, kv head) pair: 'B/dp L@zigzag/c Q K/t D' out.

    ``mask``: :func:`attention_mask`'s for this ``impl``, ``[B, Lq, Lk]`` bool (splash, pallas:
    segment ids ``[B, L]``). ``causal_only`` says the mask is exactly causal, so fused kernels
    may use ``is_causal`` (splash, pallas: no segment ids) instead of reading it.
    """
    impl = _impl_for(impl, mask, causal_only)
    if impl == "splash":
        from seqshard.model.splash import splash_attention  # Pallas: 0.2 s to import

        return splash_attention(q, k, v, None if causal_only else mask)
    if impl == "pallas":
        from seqshard.model.pallas_gpu import pallas_attention  # Pallas, as splash

        return pallas_attention(q, k, v, None if causal_only else mask)
    if impl == "einsum":
        return _einsum_attention(q, k, v, mask)
    if impl in ("cudnn", "xla"):
        return fused_attention(q, k, v, mask, impl, causal_only)
    raise ValueError(
        f"model.attention_impl must be auto, einsum, cudnn, xla, splash or pallas, got {impl!r}."
    )


def _impl_for(impl: AttentionImpl, mask: jax.Array, causal_only: bool) -> str:
    """The implementation that runs ``mask``: ``impl`` resolved, or, given a dense mask (the
    context split over c > 1, generation's padded prompts) where it takes segment ids,
    :func:`dense_mask_impl`'s."""
    impl = resolve_impl(impl, "causal" if causal_only else "document")
    return dense_mask_impl(impl) if mask.ndim == 3 else impl


def _einsum_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    return einsum_values(einsum_probabilities(q, k, mask).astype(v.dtype), v)


def einsum_probabilities(q: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
    """Einsum attention's softmax(q k^T / sqrt(D)) under ``mask`` [B, Lq, Lk]: f32
    'B/dp K/t Q Qlen@zigzag/c Klen@zigzag' (the hand-written backward keeps or rebuilds it).

    Scores and softmax in f32: bf16 scores lose the small differences softmax amplifies.
    Heads major, keys minor: batched dots over (B, K, Q) as XLA lays them out, and a softmax
    along the last axis. With 'B/dp Qlen@zigzag/c Klen Q K/t' the hand-written backward's score-shaped
    fusion ran at 0.8x on CPU."""
    scores = shardops.einsum_unreduced(
        "B/dp Qlen@zigzag/c Q K/t D, B/dp Klen@zigzag K/t D -> B/dp K/t Q Qlen@zigzag/c Klen@zigzag",
        q,
        k,
        out_dtype=jnp.float32,
    )
    scores = jnp.where(mask[:, None, None], scores * (1 / math.sqrt(q.shape[-1])), -1e30)
    return jax.nn.softmax(scores, axis=-1)


def max_logits(q: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
    """Each head's largest logit ``q k / sqrt(D)`` over this device's (query, key) pairs that
    ``mask`` [B, Lq, Lk] allows: f32 'K/t Q' (``model.max_logit``). The scores are
    :func:`einsum_probabilities`' own (the same dot: XLA computes it once); no gradient."""
    q, k = lax.stop_gradient(q), lax.stop_gradient(k)
    scores = shardops.einsum_unreduced(
        "B/dp Qlen@zigzag/c Q K/t D, B/dp Klen@zigzag K/t D -> B/dp K/t Q Qlen@zigzag/c Klen@zigzag",
        q,
        k,
        out_dtype=jnp.float32,
    )
    scores = jnp.where(mask[:, None, None], scores * (1 / math.sqrt(q.shape[-1])), -jnp.inf)
    return jnp.max(scores, axis=(0, 3, 4))


def einsum_values(probs: jax.Array, v: jax.Array) -> jax.Array:
    """The attention output 'B/dp Qlen@zigzag/c Q K/t Dv' from :func:`einsum_probabilities` (in
    v's dtype; Dv, v's head, is D but for MLA's v_head_dim)."""
    return shardops.einsum_unreduced(
        "B/dp K/t Q Qlen@zigzag/c Klen@zigzag, B/dp Klen@zigzag K/t Dv -> B/dp Qlen@zigzag/c Q K/t Dv",
        probs,
        v,
    )


def attention_vjp(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    impl: str,
    causal_only: bool,
    g: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv of :func:`attention` given its output's cotangent ``g``: the
    implementation's own VJP. Splash's and pallas' backward re-run their forward kernel
    themselves (for the logsumexp), so they are called directly; the others through
    ``jax.vjp`` (cudnn's forward keeps softmax statistics its backward reads)."""
    impl = _impl_for(impl, mask, causal_only)
    if impl == "splash":
        from seqshard.model.splash import splash_attention_vjp

        return splash_attention_vjp(q, k, v, None if causal_only else mask, g)
    if impl == "pallas":
        from seqshard.model.pallas_gpu import pallas_attention_vjp

        return pallas_attention_vjp(q, k, v, None if causal_only else mask, g)
    _, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, mask, impl, causal_only), q, k, v)
    return pullback(g)


def fused_attention(q, k, v, mask, impl: str, causal_only: bool) -> jax.Array:
    """``jax.nn.dot_product_attention(implementation=impl)`` on the per-device blocks; the
    ``[B, Lq, Lk]`` mask is read only when not ``causal_only``."""
    batch, length, n_q, n_kv, d_head = q.shape
    # dot_product_attention groups query heads by kv head, kv-major: head n uses kv head n // Q.
    q_heads = jnp.swapaxes(q, 2, 3).reshape(batch, length, n_kv * n_q, d_head)
    out = jax.nn.dot_product_attention(
        q_heads,
        k,
        v,
        mask=None if causal_only else mask[:, None],
        is_causal=causal_only,
        implementation=impl,
    )
    # v's head size may differ from q's and k's (MLA's v_head_dim).
    return jnp.swapaxes(out.reshape(batch, length, n_kv, n_q, v.shape[-1]), 2, 3)
