"""Pallas' GPU flash attention with segment ids, hosted in the model's checked shard_map: packed
documents on GPU without a dense ``[B, L, L]`` mask (``model.attention_impl=pallas``, which
``auto`` picks on GPU for the ``document`` mask).

Per device, as every implementation in :mod:`seqshard.model.attention`: ``q: 'B/dp L Q K/t D'``,
``k, v: 'B/dp L K/t D'``, and the documents as segment ids ``'B/dp L'`` int32 (keys attend within
their own segment; None: causal only).

The kernel: ``jax.experimental.pallas.ops.gpu.attention.mha``, the flash attention (Triton,
through Pallas) that ships inside JAX. Why this one:

* It takes ``segment_ids`` and ``causal=True`` together, and masks them per block, so the
  document mask costs a compare per score and no ``[L, L]`` array; its loops stop at the
  diagonal as causal attention's do (blocks of other documents below it still run: the same
  work as the causal mask, not less).
* It has a VJP (a ``jax.custom_vjp``: its forward keeps the logsumexp, its backward is a
  preprocessing kernel and one fused dq / dk / dv kernel), and runs in Pallas interpret mode on
  CPU, which is how the tests hold it to einsum attention.
* It is public JAX (``jax.experimental``, as splash is) and on the GPU machine already: no
  wheel to add. The alternatives: ``jax.nn.dot_product_attention`` takes no segment ids (its
  ``query_seq_lengths`` / ``key_value_seq_lengths`` are one padding length per row, not
  packing), so documents go to cuDNN as a dense mask; cuDNN's packed-sequence offsets are
  reachable only through JAX's private cuDNN module; tokamax (whose flash attention takes
  segment ids) needs Python >= 3.12 against this project's 3.11, and brings its own
  dependencies to a machine that downloads nothing; the Mosaic GPU kernel
  (``attention_mgpu``, Hopper's wgmma) takes no segment ids and has no causal backward.

The layout needs almost no change: the kernel takes ``[B, L, H, D]``, seqshard's own order.
Grouped queries: the kernel wants one kv head per q head, so it is vmapped over Q with k, v
and the segment ids unbatched; Pallas turns that vmap into one more grid axis whose index map
ignores it for k and v, so every q head of a group reads its kv head where it lies (no copy of
k, v per q head). The backward's dk, dv come per q head and are summed over Q (by vmap, in k's
dtype). The vmapped axis comes out first, so the output (and in the backward its cotangent) is
transposed back to 'B L Q K D': one pass over it each. q is not scaled: the kernel takes
``sm_scale = 1/sqrt(D)``. q, k and v must share a head size: MLA's v (``v_head_dim``) is
zero-padded to q's and the output cut back.

Blocks: the kernel's own defaults (``BlockSizes.get_default()``: 128 x 128 forward, 32 x 32
backward; not tuned here, no GPU was at hand to measure), each cut to
``gcd(L, block)``: L must be a multiple of 16, Triton's smallest matmul tile.

Context parallelism: with the row split over c (``allgather``), a device's queries are two
zigzag chunks against every key, and the kernel has no query offset (its causal mask compares
query and key indices from 0) and one segment array for both, so it cannot take them. The model
then passes a dense mask (:func:`seqshard.model.context.context_mask`) and
:func:`seqshard.model.attention.attention` runs that with cuDNN (einsum off GPU), as before;
``context_impl=ring`` masks its chunk pairs itself. The same holds for generation's dense masks.

Off GPU the kernel runs in Pallas interpret mode: equal to einsum attention to f32 rounding,
slow. Hosting and cost: as splash's (:mod:`seqshard.model.pallas_hosting`; the backward re-runs
the kernel's forward for its logsumexp, then the preprocessing and backward kernels, so nothing
beyond q, k, v and the segment ids is kept for it).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as flash

from seqshard.model.pallas_hosting import hosted_attention, hosted_attention_vjp

__all__ = ["BLOCKS", "MIN_BLOCK", "block_sizes", "pallas_attention", "pallas_attention_vjp"]

BLOCKS = flash.BlockSizes.get_default()
"""The kernel's blocks before :func:`block_sizes` fits them to L: its own defaults, untuned."""
MIN_BLOCK = 16
"""Triton's smallest matmul tile: every block is a power of two at least this long."""


def block_sizes(length: int) -> flash.BlockSizes:
    """:data:`BLOCKS`, each cut to ``gcd(length, block)`` so that it divides the sequence."""
    if length % MIN_BLOCK:
        raise ValueError(
            f"model.attention_impl=pallas (which 'auto' picks on GPU for the document mask) "
            f"needs the sequence length (train.seq_len) to be a multiple of {MIN_BLOCK}, its "
            f"kernel's smallest block; got seq_len={length}. Use a seq_len that is (e.g. "
            f"{max(MIN_BLOCK, length // MIN_BLOCK * MIN_BLOCK)}), or model.attention_impl=cudnn."
        )
    fields = (f.name for f in dataclasses.fields(BLOCKS) if f.name.startswith("block_"))
    return dataclasses.replace(BLOCKS, **{f: math.gcd(length, getattr(BLOCKS, f)) for f in fields})


def pallas_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None
) -> jax.Array:
    """Causal softmax(q k^T / sqrt(D)) v within segments: 'B/dp L Q K/t Dv' out (Dv: v's head).

    ``segment_ids: 'B/dp L'`` int32, or None for a causal mask across the whole row. Inside a
    shard_map the kernel is hosted (:func:`~seqshard.model.pallas_hosting.hosted_attention`).
    """
    return hosted_attention(_local_attention, _local_attention_vjp, q, k, v, segment_ids)


def pallas_attention_vjp(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, g: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv of :func:`pallas_attention` given its output's cotangent ``g``, hosted as
    its backward is (the kernel's own VJP), without running the forward kernel first: for a
    hand-written backward (``model.backward=explicit``), which has q, k, v at hand."""
    return hosted_attention_vjp(_local_attention_vjp, q, k, v, segment_ids, g)


# ---------------------------------------------------------------------------------------------
# The kernel on one device's blocks (what pallas_hosting runs)


def _local_attention(q, k, v, segment_ids):
    out = _kernel(q.shape[-1], segment_ids)(*_same_heads(q, k, v))
    return jnp.moveaxis(out, 0, 2)[..., : v.shape[-1]]


def _local_attention_vjp(q, k, v, segment_ids, g):
    """The cotangents of q, k, v given the output's ``g``: jax.vjp of the kernel."""
    padded = _same_heads(q, k, v)
    _, pullback = jax.vjp(_kernel(q.shape[-1], segment_ids), *padded)
    grads = pullback(_pad_heads(jnp.moveaxis(g, 2, 0), padded[0].shape[-1]))
    return tuple(d[..., : x.shape[-1]] for d, x in zip(grads, (q, k, v), strict=True))


def _same_heads(q, k, v):
    """q, k, v zero-padded to one head size (MLA's v_head_dim may differ from q's): zeros in q
    and k add nothing to a score, zeros in v give output columns that are cut off."""
    width = max(q.shape[-1], v.shape[-1])
    return _pad_heads(q, width), _pad_heads(k, width), _pad_heads(v, width)


def _pad_heads(x, width: int):
    if x.shape[-1] == width:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _kernel(d_head: int, segment_ids):
    """(q 'B L Q K W', k, v 'B L K W') -> 'Q B L K W': the kernel vmapped over Q, its scores
    scaled by 1/sqrt(``d_head``) (W: the common, padded head size), within ``segment_ids``."""

    def kernel(q, k, v):
        mha = functools.partial(
            flash.mha,
            sm_scale=1 / math.sqrt(d_head),
            causal=True,
            block_sizes=block_sizes(q.shape[1]),
            interpret=jax.default_backend() != "gpu",
        )
        # Q is an axis of q only: k, v and the segment ids are shared by a group's q heads.
        # Pallas puts the vmapped axis first (out_axes=0: no transpose inside the kernel).
        return jax.vmap(mha, in_axes=(2, None, None, None))(q, k, v, segment_ids)

    return kernel
