"""The sequence split over the context axis c: rows in zigzag order, and attention across them.

With ``mesh.c > 1`` each device holds ``L/c`` positions of every row it holds. A causal mask
gives later positions more keys, so a contiguous split would hand the last shard c times the
first one's attention work. The model's rows are laid out in *zigzag* order instead
(:mod:`seqshard.shardlib.notation`: the row cut into 2c chunks, shard i holding chunks i and 2c-1-i),
written in every spec as ``'B/dp L@zigzag/c ...'``: each shard then holds one early and one
late chunk, and the same amount of work.

The batch arrives in the natural order, ``TokenBatch`` 'B/dp L/c'. :func:`sequence_rows`
gathers its ids and document starts over c (int32 and bool, one row of each per step: a few
KB against the megabytes of activations a layer moves), computes everything
position-dependent on the whole row (document positions for RoPE, segment ids, each
position's next-token target and whether it counts, which lives on the next shard for a
shard's last position), and keeps this device's zigzag chunks of each::

    ids   = all_gather('B/dp L/c -> B/dp L', tokens)              # over c
    local = split('B/dp L@zigzag -> B/dp L@zigzag/c', reorder('B/dp L -> B/dp L@zigzag', x))

Attention across the split (``model.context_impl``):

    allgather   k, v = all_gather('B/dp L@zigzag/c K/t D -> B/dp L@zigzag K/t D')   one each
                over c, inside the layer; queries stay local; the mask compares true
                positions. Backward: the gathers' transposes, reduce-scatters over c.
    ring        k, v blocks travel around the c ring (ring_shift, a collective-permute over
                c) in a ``lax.scan`` of c - 1 steps; an online softmax (running max and sum,
                f32) folds each block in. Each device's rows and each visiting block are two
                chunks; a pair of chunks entirely masked (a later key chunk, or other
                documents) is skipped by ``lax.cond``: in zigzag order every step but the
                first computes exactly half of its block. Backward (:func:`ring_backward`):
                k, v travel the ring again with their gradients, which one more shift brings
                home. Per layer: forward c - 1 shifts of k and of v; backward c - 1 of k and v
                and c of dk and dv.

With c = 1 every gather, reorder and split here is the identity and emits nothing: the
model is the one it was before c existed.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from seqshard.model.attention import attention, document_positions
from seqshard.shardlib import collective_log, shardops
from seqshard.shardlib.shapecheck import block_axes, block_axes_scope, shape_scope
from seqshard.shardlib.vma import vary_like

__all__ = [
    "SequenceRows",
    "TokensAhead",
    "tokens_ahead",
    "attend",
    "gathered_kv",
    "context_mask",
    "ring_attention",
    "next_token_targets",
    "ring_backward",
    "ring_forward",
    "sequence_rows",
]


class TokensAhead(NamedTuple):
    """Per device, for multi-token prediction module k = 1 .. depth (``model.mtp``), at each
    of this device's positions i: 'D B/dp L@zigzag/c' each, D the depth."""

    tokens: jax.Array  # i32: token i + k, the one module k embeds (0 past the row's end)
    targets: jax.Array  # i32: token i + k + 1, the one it predicts
    counted: jax.Array  # bool: i + k + 1 is in i's document (no start between) and counts


class SequenceRows(NamedTuple):
    """Per device: this device's positions of its rows (zigzag chunks) and whole-row facts."""

    tokens: jax.Array  # i32 'B/dp L@zigzag/c': the ids to embed
    targets: jax.Array  # i32 'B/dp L@zigzag/c': each position's next token
    counted: jax.Array  # bool 'B/dp L@zigzag/c': the next token is in the same document
    #   and counts (its loss_mask)
    positions: jax.Array  # i32 'B/dp L@zigzag/c': position within its document (RoPE)
    is_seq_start: jax.Array  # bool 'B/dp L/c' (natural order, as the batch has it)
    segments: jax.Array  # i32 'B/dp L': document number along the whole row (masks)
    ahead: TokensAhead | None = None  # multi-token prediction's (model.mtp), or none


def _local(x: jax.Array) -> jax.Array:
    """A whole row 'B/dp L' -> this device's zigzag chunks 'B/dp L@zigzag/c' (local)."""
    return shardops.split(
        "B/dp L@zigzag -> B/dp L@zigzag/c", shardops.reorder("B/dp L -> B/dp L@zigzag", x)
    )


def next_token_targets(
    tokens: jax.Array, is_seq_start: jax.Array, loss_mask: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """The next token at each position and whether it counts: ``[B, L]`` each.

    A position counts when a next token exists in the same document (the last position of a
    row and the last token of each packed document have no target) and, with a
    ``loss_mask``, that next token is masked in.
    """
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    counts = ~is_seq_start[:, 1:] if loss_mask is None else ~is_seq_start[:, 1:] & loss_mask[:, 1:]
    has_next = jnp.concatenate([counts, jnp.zeros_like(is_seq_start[:, :1])], axis=1)
    return targets, has_next


def tokens_ahead(
    whole: jax.Array, starts: jax.Array, loss_mask: jax.Array | None, depth: int
) -> TokensAhead:
    """:class:`TokensAhead` of whole rows 'B/dp L' (ids, document starts, loss mask), as
    'D B/dp L' (the caller keeps its zigzag chunks). Module k's target i + k + 1 counts when
    it lies in the row, in i's document (so no module reads or predicts across a packed
    document's boundary at a counted position) and is masked in."""
    segments = jnp.cumsum(starts, axis=-1, dtype=jnp.int32)

    def shifted(x: jax.Array, by: int, fill) -> jax.Array:  # x[:, i + by], ``fill`` past the end
        pad = jnp.full(x.shape[:-1] + (by,), fill, x.dtype)
        return jnp.concatenate([x[..., by:], pad], axis=-1)

    tokens, targets, counted = [], [], []
    for k in range(1, depth + 1):
        tokens.append(shifted(whole, k, 0))
        targets.append(shifted(whole, k + 1, 0))
        same = shifted(segments, k + 1, -1) == segments
        if loss_mask is not None:
            same = same & shifted(loss_mask, k + 1, False)
        counted.append(same)
    return TokensAhead(jnp.stack(tokens), jnp.stack(targets), jnp.stack(counted))


def sequence_rows(
    tokens: jax.Array,
    is_seq_start: jax.Array,
    loss_mask: jax.Array | None = None,
    ahead: int = 0,
) -> SequenceRows:
    """The batch's 'B/dp L/c' ids, document starts and loss mask (None: all counted) ->
    :class:`SequenceRows` (inside the model's shard_map). One all-gather over c of the ids and
    one of the starts and mask, packed in one int8 (none when c = 1). ``ahead``: the depth of
    multi-token prediction, whose tokens ahead (:func:`tokens_ahead`) are read off the same
    gathered rows: the token k positions ahead of a position may live on another c shard
    (zigzag order), and it arrives with that gather, no activation moving."""
    whole = shardops.all_gather("B/dp L/c -> B/dp L", tokens)
    if loss_mask is None:
        starts = shardops.all_gather("B/dp L/c -> B/dp L", is_seq_start)
        mask = None
    else:
        flags = is_seq_start.astype(jnp.int8) | (loss_mask.astype(jnp.int8) << 1)
        flags = shardops.all_gather("B/dp L/c -> B/dp L", flags)
        starts, mask = (flags & 1).astype(bool), (flags & 2).astype(bool)
    targets, counted = next_token_targets(whole, starts, mask)
    return SequenceRows(
        tokens=_local(whole),
        targets=_local(targets),
        counted=_local(counted),
        positions=_local(document_positions(starts)),
        is_seq_start=is_seq_start,
        segments=jnp.cumsum(starts, axis=-1, dtype=jnp.int32),
        ahead=_ahead_local(tokens_ahead(whole, starts, mask, ahead)) if ahead else None,
    )


def _ahead_local(ahead: TokensAhead) -> TokensAhead:
    return TokensAhead(*(jnp.stack([_local(x) for x in field]) for field in ahead))


def context_mask(rows: SequenceRows, causal_only: bool) -> jax.Array:
    """``[B, Lq, Lk]`` bool for all-gathered keys: this device's query rows (zigzag chunks)
    against every key in zigzag order, causal by true position and (unless ``causal_only``)
    within one document."""
    # The natural position of every key (zigzag order) and of this device's queries.
    k_index = shardops.reorder(
        "L -> L@zigzag", jnp.arange(rows.segments.shape[-1], dtype=jnp.int32)
    )
    q_index = shardops.split("L@zigzag -> L@zigzag/c", k_index)
    mask = (k_index[None, :] <= q_index[:, None])[None]
    if causal_only:
        return jnp.broadcast_to(mask, (rows.segments.shape[0], *mask.shape[1:]))
    k_segments = shardops.reorder("B/dp L -> B/dp L@zigzag", rows.segments)
    q_segments = shardops.split("B/dp L@zigzag -> B/dp L@zigzag/c", k_segments)
    return mask & (q_segments[:, :, None] == k_segments[:, None, :])


# ---------------------------------------------------------------------------------------------
# The model's entry points


def attend(cfg, q, k, v, mask, rows: SequenceRows) -> jax.Array:
    """Attention of this device's queries 'B/dp L@zigzag/c Q K/t D' over the whole row: the
    output 'B/dp L@zigzag/c Q K/t D'. ``mask`` is the model's
    (:func:`~seqshard.model.transformer.rope_and_mask`)."""
    c, causal_only = shardops.axis_size("c"), cfg.attention_mask == "causal"
    if cfg.ring_over(c):
        with collective_log.part("context"):
            return ring_attention(q, k, v, rows.segments, causal_only)[0]
    with collective_log.part("context"):
        keys, values = gathered_kv(k, v)
    return attention(q, keys, values, mask, cfg.attention_impl, causal_only and c == 1)


def gathered_kv(k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """k 'B/dp L@zigzag K/t D' and v 'B/dp L@zigzag K/t Dv' gathered over c (``allgather``;
    nothing moves when c = 1). Dv, v's head, is D but for MLA's v_head_dim."""
    k = shardops.all_gather("B/dp L@zigzag/c K/t D -> B/dp L@zigzag K/t D", k)
    return k, shardops.all_gather("B/dp L@zigzag/c K/t Dv -> B/dp L@zigzag K/t Dv", v)


# ---------------------------------------------------------------------------------------------
# Ring attention


def _chunks(x: jax.Array) -> jax.Array:
    """A block of two zigzag chunks 'B/dp L@zigzag/c ...' -> '2 B/dp C ...' (C = L / 2c)."""
    b, n2 = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, 2, n2 // 2, *x.shape[2:]), 1, 0)


def _unchunk(x: jax.Array) -> jax.Array:
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _chunk_ids(shard: jax.Array, c: int) -> jax.Array:
    """The natural chunk numbers of shard ``shard``'s two zigzag chunks."""
    return jnp.stack([shard, 2 * c - 1 - shard])


class _Pair(NamedTuple):
    """One (query chunk, key chunk) pair's mask [B, C, C] and whether any of it is visible."""

    mask: jax.Array
    visible: jax.Array


def _pair(segments, q_chunk, k_chunk, size: int, causal_only: bool) -> _Pair:
    q_index = q_chunk * size + jnp.arange(size, dtype=jnp.int32)
    k_index = k_chunk * size + jnp.arange(size, dtype=jnp.int32)
    mask = (k_index[None, :] <= q_index[:, None])[None]
    if causal_only:
        mask = jnp.broadcast_to(mask, (segments.shape[0], size, size))
    else:
        q_seg = lax.dynamic_slice_in_dim(segments, q_chunk * size, size, axis=1)
        k_seg = lax.dynamic_slice_in_dim(segments, k_chunk * size, size, axis=1)
        mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])
    return _Pair(mask, jnp.any(mask))


def _pairs(segments, mine, theirs, size: int, causal_only: bool):
    """(query chunk a, key chunk b, their :class:`_Pair`) for this device's two query chunks
    ``mine`` and a visiting block's two key chunks ``theirs``."""
    for a in range(2):
        for b in range(2):
            yield a, b, _pair(segments, mine[a], theirs[b], size, causal_only)


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """One chunk pair's scores, f32 'B/dp K/t Q Qc Kc' (Qc, Kc: a chunk of queries, of keys)."""
    scores = shardops.einsum_unreduced(
        "B/dp Qc Q K/t D, B/dp Kc K/t D -> B/dp K/t Q Qc Kc",
        q,
        k,
        out_dtype=jnp.float32,
    )
    return scores * (1 / math.sqrt(q.shape[-1]))


def _per_query(w: jax.Array, x: jax.Array, d: str = "D") -> jax.Array:
    """A chunk pair's weights times key-side rows, f32 'B/dp Qc Q K/t D': P V (forward, ``d``
    = Dv), dS K (dq)."""
    return shardops.einsum_unreduced(
        f"B/dp K/t Q Qc Kc, B/dp Kc K/t {d} -> B/dp Qc Q K/t {d}",
        w,
        x,
        out_dtype=jnp.float32,
    )


def _per_key(w: jax.Array, x: jax.Array, d: str = "D") -> jax.Array:
    """A chunk pair's weights, transposed, times query-side rows, f32 'B/dp Kc K/t D': P^T dO
    (dv, ``d`` = Dv), dS^T Q (dk)."""
    return shardops.einsum_unreduced(
        f"B/dp K/t Q Qc Kc, B/dp Qc Q K/t {d} -> B/dp Kc K/t {d}",
        w,
        x,
        out_dtype=jnp.float32,
    )


def ring_forward(q, k, v, segments, causal_only: bool):
    """Ring attention's forward: (output 'B/dp L@zigzag/c Q K/t D' in v's dtype, logsumexp
    f32 '2 B/dp K/t Q C' per query chunk). See the module docstring."""
    c, me = shardops.axis_size("c"), shardops.axis_index("c")
    qs = _chunks(q)
    size = qs.shape[2]
    state = (
        vary_like(
            jnp.full((2, q.shape[0], q.shape[3], q.shape[2], size), -1e30, jnp.float32), q, k
        ),
        vary_like(jnp.zeros((2, q.shape[0], q.shape[3], q.shape[2], size), jnp.float32), q, k),
        # The output accumulates v's head size (MLA's v_head_dim may differ from q's).
        vary_like(jnp.zeros(qs.shape[:-1] + v.shape[-1:], jnp.float32), q, k, v),
    )
    mine = _chunk_ids(me, c)

    def fold(state, ks, vs, source):
        """Fold the key chunks of shard ``source`` into the running softmax of each query chunk."""
        for a, b, pair in _pairs(segments, mine, _chunk_ids(source, c), size, causal_only):

            def add(state, a=a, b=b, pair=pair):
                m, total, acc = state
                s = jnp.where(pair.mask[:, None, None], _scores(qs[a], ks[b]), -1e30)
                m_new = jnp.maximum(m[a], jnp.max(s, axis=-1))
                p = jnp.where(pair.mask[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
                scale = jnp.exp(m[a] - m_new)
                pv = _per_query(p.astype(vs.dtype), vs[b], "Dv")
                rescale = jnp.swapaxes(scale, -1, -3)[..., None]  # 'B/dp Qc Q K/t 1'
                total_new = total[a] * scale + jnp.sum(p, axis=-1)
                acc = acc.at[a].set(acc[a] * rescale + pv)
                return m.at[a].set(m_new), total.at[a].set(total_new), acc

            state = lax.cond(pair.visible, add, lambda s: s, state)
        return state

    spec, spec_v = "B/dp L@zigzag/c K/t D", "B/dp L@zigzag/c K/t Dv"

    def step(carry, _):
        state, k, v, source = carry
        # Send this block on while folding it in: the transfer can overlap the arithmetic.
        k_next, v_next = shardops.ring_shift(spec, k, "c"), shardops.ring_shift(spec_v, v, "c")
        state = fold(state, _chunks(k), _chunks(v), source)
        return (state, k_next, v_next, (source - 1) % c), None

    carry = (state, k, v, me)
    (state, k, v, source), _ = collective_log.scan("ring", step, carry, None, length=c - 1)
    state = fold(state, _chunks(k), _chunks(v), source)  # the last block: nothing to send on
    m, total, acc = state
    out = acc / jnp.swapaxes(total, -1, -3)[..., None]
    return _unchunk(out).astype(v.dtype), m + jnp.log(total)


def ring_backward(q, k, v, out, lse, segments, causal_only: bool, g):
    """dq, dk, dv of :func:`ring_forward` given the output's cotangent ``g`` (flash attention's
    backward, block by block around the ring): k, v and their gradients travel together; one
    last shift brings each dk, dv home."""
    c, me = shardops.axis_size("c"), shardops.axis_index("c")
    qs, gs = _chunks(q), _chunks(g)
    size = qs.shape[2]
    # D = rowsum(g * out): the softmax backward's correction per query row, '2 B/dp K/t Q C'.
    delta = jnp.sum(gs.astype(jnp.float32) * _chunks(out).astype(jnp.float32), axis=-1)
    delta = jnp.swapaxes(delta, -1, -3)
    mine = _chunk_ids(me, c)
    dq = vary_like(jnp.zeros(qs.shape, jnp.float32), q, k, v, g)

    def fold(dq, ks, vs, dks, dvs, source):
        for a, b, pair in _pairs(segments, mine, _chunk_ids(source, c), size, causal_only):

            def add(grads, a=a, b=b, pair=pair):
                dq, dks, dvs = grads
                s = _scores(qs[a], ks[b])
                p = jnp.where(pair.mask[:, None, None], jnp.exp(s - lse[a][..., None]), 0.0)
                dvs = dvs.at[b].add(_per_key(p.astype(g.dtype), gs[a], "Dv"))
                dp = shardops.einsum_unreduced(
                    "B/dp Qc Q K/t Dv, B/dp Kc K/t Dv -> B/dp K/t Q Qc Kc",
                    gs[a],
                    vs[b],
                    out_dtype=jnp.float32,
                )
                ds = p * (dp - delta[a][..., None]) * (1 / math.sqrt(q.shape[-1]))
                dq = dq.at[a].add(_per_query(ds.astype(q.dtype), ks[b]))
                dks = dks.at[b].add(_per_key(ds.astype(q.dtype), qs[a]))
                return dq, dks, dvs

            dq, dks, dvs = lax.cond(pair.visible, add, lambda x: x, (dq, dks, dvs))
        return dq, dks, dvs

    spec, spec_v = "B/dp L@zigzag/c K/t D", "B/dp L@zigzag/c K/t Dv"
    zeros_k = vary_like(jnp.zeros(k.shape, jnp.float32), q, k, v, g)
    zeros_v = vary_like(jnp.zeros(v.shape, jnp.float32), q, k, v, g)

    def visit(dq, k, v, dk, dv, source):
        """Fold in the block of shard ``source``: dq, and that block's dk, dv."""
        dq, dks, dvs = fold(dq, _chunks(k), _chunks(v), _chunks(dk), _chunks(dv), source)
        return dq, _unchunk(dks), _unchunk(dvs)

    def step(carry, _):
        dq, k, v, dk, dv, source = carry
        # k and v go on while this block is folded in; its gradients follow once complete.
        k_next, v_next = shardops.ring_shift(spec, k, "c"), shardops.ring_shift(spec_v, v, "c")
        dq, dk, dv = visit(dq, k, v, dk, dv, source)
        dk, dv = shardops.ring_shift(spec, dk, "c"), shardops.ring_shift(spec_v, dv, "c")
        return (dq, k_next, v_next, dk, dv, (source - 1) % c), None

    carry = (dq, k, v, zeros_k, zeros_v, me)
    (dq, k, v, dk, dv, source), _ = collective_log.scan("ring", step, carry, None, length=c - 1)
    dq, dk, dv = visit(dq, k, v, dk, dv, source)
    # The last block's gradients belong to the next shard along the ring: one more shift.
    dk, dv = shardops.ring_shift(spec, dk, "c"), shardops.ring_shift(spec_v, dv, "c")
    return _unchunk(dq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def ring_attention(q, k, v, segments, causal_only: bool):
    """Ring attention with its hand-written backward (a ``jax.custom_vjp``; both passes log
    their own collectives, the backward in the scans the forward ran in): (output, lse)."""
    axes = block_axes()
    static = (causal_only, (tuple(axes.sizes.items()), axes.manual), collective_log.place())
    return _ring(static, q, k, v, segments)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(static, q, k, v, segments):
    with collective_log.hand_differentiated(), collective_log.custom_vjp_primal():
        return ring_forward(q, k, v, segments, static[0])


def _ring_fwd(static, q, k, v, segments):
    # Traced when JAX differentiates, maybe outside the caller's scans: log it where it runs.
    with collective_log.at(static[2]), collective_log.hand_differentiated():
        out, lse = ring_forward(q, k, v, segments, static[0])
    return (out, lse), (q, k, v, out, lse, segments)


def _ring_bwd(static, residuals, cotangents):
    q, k, v, out, lse, segments = residuals
    causal_only, (sizes, manual), where = static
    # Traced when JAX transposes the shard_map, after the body's scopes closed: reopen them.
    with (
        block_axes_scope(dict(sizes), manual),
        shape_scope(),
        collective_log.at(where),
        collective_log.phase("backward"),
    ):
        dq, dk, dv = ring_backward(q, k, v, out, lse, segments, causal_only, cotangents[0])
    return dq, dk, dv, None


_ring.defvjp(_ring_fwd, _ring_bwd)
