"""Generation for multi-head latent attention (:mod:`seqshard.model.mla`): a cache of the
compressed latents, decoded in the absorbed form. :mod:`seqshard.model.generate` runs it.

Letters are mla.py's (K heads with Q = 1, D = Dn + P the query/key head, Dv the value head,
R the kv latent, P its rope key, A = R + P, Dkv = Dn + Dv), generate.py's (S the cache's
positions, L the fed positions: the prompt in prefill, 1 in a decode step), and Dn, the
no-rope part of a query/key head (``qk_nope_head_dim``). Per layer the cache keeps, for each
position, only what the block computes before the heads: the normed kv latent and the rotated
rope key, ``[latent | k_rope]``::

    cache     'all_layers B/dp S A'   replicated over t (every head reads all of it)
    bytes     A x compute bytes per position and layer (GQA: 2 K D x compute bytes, split over t)

Prefill runs the block's ordinary forward over the prompt (up-projected keys and values, any
``attention_impl``) and keeps the latents it made. A decode step never up-projects the cache:
with ``w_kv_b`` = [w_k 'R K/t Dn' | w_v 'R K/t Dv'], per head

    q_nope . k_nope = q_nope . (latent . w_k) = (q_nope . w_k^T) . latent
    probs . v       = probs . (latent . w_v)  = (probs . latent) . w_v

so the query moves into the latent space once, ``q_latent = q_nope . w_k^T`` 'B/dp L Q K/t R',
scores are ``[q_latent | q_rope] . [latent | k_rope]`` over the cache 'B/dp S A' (times
1/sqrt(D); q already carries :func:`~seqshard.model.mla.softmax_mscale`, as in the block), and
the softmax-weighted latents 'B/dp L Q K/t R' are up-projected once by w_v to 'B/dp L Q K/t Dv'.
The block's output projection and residual follow (attention_block's), then the layer's FFN.

The trade-off, per decode step, layer, row and cached position, all heads (FLOPs; numbers read):

    absorbed (here)           2 K (A + R)       A, once for all heads
    up-projecting the cache   2 K (D + Dv) + 2 R K (Dn + Dv)    A
    a cache of k and v        2 K (D + Dv)      K (D + Dv)

plus per step 2 K R (Dn + Dv) for the absorption itself, independent of S. DeepSeek-V3
(K = 128, R = 512, P = 64, Dn = Dv = 128): 278,528 FLOPs and 576 numbers per position,
against 81,920 FLOPs and 40,960 numbers for a k, v cache: 3.4x the FLOPs, 1/71 of the bytes.
Decoding reads the whole cache per token and does little work on each number, so it is bound
by memory bandwidth, and bytes decide (242 FLOPs per bf16 byte, under an H100's ~295 at t = 1;
a t split divides the FLOPs but not the replicated cache). In prefill every query meets every
key, and the up-projection is paid once per key: the unabsorbed form is the cheaper one there.

Communication per decode step is the training forward's with L = 1 (generate.py), the same
collectives as GQA's on a t-only mesh (over d, MLA gathers its five weight matrices where GQA
gathers three). Nothing moves the cache: every t shard computes the same latents (mla.py
replicates them over t) and writes them itself. So that their type says so, the block's norm
reads its gain and the residual through all-gathers over t typed replicated
(:func:`cache_entry`): the block's own two gathers, emitted as before.

Multi-token prediction (``model.mtp``, :mod:`seqshard.model.mtp`): its modules, module k
predicting the token k + 1 ahead, could draft tokens for speculative decoding (DeepSeek-V3
reports 85-90% acceptance of the second token): the main model would verify the drafts in one
forward over them against this cache (a prefill of a few positions), keeping the longest
agreeing prefix. Generation does not use them: it runs the main model, one token per step,
and ignores the modules' weights.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from seqshard.model.attention_block import attention_output
from seqshard.model.block import Activations
from seqshard.model.config import ModelConfig
from seqshard.model.mla import mla_inputs
from seqshard.shardlib import shardops

__all__ = [
    "CACHE_SPEC",
    "absorbed_attention",
    "cache_bytes_per_token",
    "cache_entry",
    "decode_attention",
]

CACHE_SPEC = "all_layers B/dp S A"
"""The cache: each layer's [latent | k_rope] at each position, replicated over t."""


def cache_bytes_per_token(cfg: ModelConfig) -> int:
    """Bytes one position of one row adds to one layer's cache: kv_lora_rank + qk_rope_head_dim
    numbers in compute dtype (held whole by every t shard)."""
    return (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * cfg.compute_bytes


def cache_entry(cfg: ModelConfig, w, a: Activations, rope) -> jax.Array:
    """The block's inputs of the positions ``a['x']`` (q, k, v and the latents, left in ``a``)
    and what the cache keeps of them: [latent | k_rope] 'B/dp L A' in compute dtype.

    In a decode step k and v go unused (the scores read the cache): dead code in the jitted
    step, which XLA drops."""
    # The cache is replicated over t, and every t shard computes the same latent: so that its
    # type says so, the norm reads the residual and its gain, and the latent its projection
    # and gain, through the block's own all-gathers over t, typed replicated (the same
    # collectives; generation's residual is M/t).
    x, gather = a["x"], "B/dp L@zigzag/c M/t -> B/dp L@zigzag/c M"
    a("ln1", lambda: shardops.all_gather("M/t/fsdp -> M", w.ln1, to="invarying"))
    a("gx", lambda: shardops.all_gather(gather, x, to="invarying"))
    # And the latent's projection and norm gain, whose rows rest split over t as well.
    dt = jnp.dtype(cfg.compute_dtype)
    a(
        "w_kv_a",
        lambda: shardops.all_gather("M/t/fsdp A -> M A", w.w_kv_a.astype(dt), to="invarying"),
    )
    a("kv_a_norm", lambda: shardops.all_gather("R/t/fsdp -> R", w.kv_a_norm, to="invarying"))
    mla_inputs(cfg, w, a, rope)
    return jnp.concatenate([a["latent"], a["k_rope"]], axis=-1).astype(dt)


def absorbed_attention(
    cfg: ModelConfig, q: jax.Array, cache: jax.Array, w_kv_b: jax.Array, mask: jax.Array
) -> jax.Array:
    """Attention of the fed queries q 'B/dp L@zigzag/c Q K/t D' (rope part rotated, times
    softmax_mscale) over one layer's cache 'B/dp S A' under ``mask`` bool[B, L, S], with
    ``w_kv_b`` 'R K/t Dkv' folded into the query and the output: 'B/dp L@zigzag/c Q K/t Dv',
    the block's attention on the up-projected keys and values. Scores and softmax in f32."""
    nope, r = cfg.mla.qk_nope_head_dim, cfg.mla.kv_lora_rank
    w_k, w_v = w_kv_b[..., :nope], w_kv_b[..., nope:]
    # Each head's no-rope query into the latent space: once per step, not once per position.
    q_latent = shardops.einsum_unreduced(
        "B/dp L@zigzag/c Q K/t Dn, R K/t Dn -> B/dp L@zigzag/c Q K/t R", q[..., :nope], w_k
    )
    # [q_latent | q_rope] against the cache's [latent | k_rope]: both parts of a score in one dot.
    scores = shardops.einsum_unreduced(
        "B/dp L@zigzag/c Q K/t A, B/dp S A -> B/dp K/t Q L@zigzag/c S",
        jnp.concatenate([q_latent, q[..., nope:]], axis=-1),
        cache,
        out_dtype=jnp.float32,
    )
    # The block's scale: 1/sqrt(D), D the whole query/key head (attention.py's einsum_probabilities).
    scores = jnp.where(mask[:, None, None], scores * (1 / math.sqrt(q.shape[-1])), -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(cache.dtype)
    # Weight the latents, then up-project the one mixture per head to the value head.
    mixed = shardops.einsum_unreduced(
        "B/dp K/t Q L@zigzag/c S, B/dp S R -> B/dp L@zigzag/c Q K/t R", probs, cache[..., :r]
    )
    return shardops.einsum_unreduced(
        "B/dp L@zigzag/c Q K/t R, R K/t Dv -> B/dp L@zigzag/c Q K/t Dv", mixed, w_v
    )


def decode_attention(
    cfg: ModelConfig, w, a: Activations, cache: jax.Array, mask: jax.Array
) -> jax.Array:
    """The block's output h for the fed positions whose q and gathered ``w_kv_b`` ``a`` holds
    (:func:`cache_entry`), attending over one layer's cache 'B/dp S A' in the absorbed form."""
    a("attn", lambda: absorbed_attention(cfg, a["q"], cache, a["w_kv_b"], mask))
    return attention_output(cfg, w, a)
