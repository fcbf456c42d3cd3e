"""Checkpoint checksums: each array's hash of its bits, reduced over the *global* array on
device, so the same state gives the same checksums on every mesh and sharding.

    checksums, finite = state_digest(state)   # {"state.weights.layers.w_up": 0x1234abcd, ...},
                                              # {"state.weights.layers.w_up": True, ...}

:class:`~seqshard.train.checkpoint.Checkpointer` records them when it saves and checks them
after it restores (:func:`_checksum` says why a changed bit always shows); a large array is
hashed in parts (:func:`_plan`) so the hashing's temporaries stay small.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from seqshard.shardlib.shardtypes import shardings, u32, with_unsplit_dims

__all__ = ["state_digest"]


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's finalizer: a bijection of u32 in which every input bit flips ~half the
    output bits."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _as_u32(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as u32 words (one per element; two for a 64-bit one, last axis)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}.get(x.dtype.itemsize)
    if uint is None:
        raise TypeError(f"checkpoint checksums: unsupported dtype {x.dtype}.")
    return jax.lax.bitcast_convert_type(x, uint).astype(jnp.uint32)


def _hash_sum(
    x: jax.Array, first: jax.Array, strides: Sequence[int]
) -> tuple[jax.Array, jax.Array]:
    """(u32[] checksum, bool[] all finite) of ``x``, a part of an array whose u32 word
    [i, j, ...] is word ``first + i * strides[0] + j * strides[1] + ...`` of the array."""
    bits = _as_u32(x)
    position = jnp.zeros(bits.shape, jnp.uint32) + first  # (mod 2^32)
    for axis, stride in enumerate(strides):
        iota = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
        position = position + iota * jnp.uint32(stride % 2**32)
    checksum = jnp.sum(_fmix32(bits ^ (position * jnp.uint32(0x9E3779B9))), dtype=jnp.uint32)
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.array(True)
    return checksum, finite


def _row_major(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[axis + 1 :]) for axis in range(len(shape))]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How to hash one array: whole, or in ``parts`` parts (see :func:`_checksum`)."""

    parts: int = 1
    shards: int = 1  # how many blocks the leading dim is split into
    sharding: NamedSharding | None = None  # of the (shards, parts, rows per part, ...) view


_PART_BYTES = 2 << 20  # per device: about what one part of an array's hashing holds at once


def _plan(x: Any) -> _Plan:
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or x.ndim == 0:
        return _Plan()
    block = sharding.shard_shape(x.shape)  # this device's
    block_bytes = math.prod(block) * x.dtype.itemsize
    rows = block[0]
    if block_bytes <= _PART_BYTES or rows == 1:
        return _Plan()
    parts = min(
        (p for p in range(2, rows + 1) if rows % p == 0 and block_bytes <= _PART_BYTES * p),
        default=rows,
    )
    per_part = 1 if rows > parts else 0  # see _checksum
    view = with_unsplit_dims(sharding, x.ndim, at=1, count=1 + per_part)
    return _Plan(parts, x.shape[0] // rows, view)


def _checksum(x: jax.Array, plan: _Plan) -> tuple[jax.Array, jax.Array]:
    """(u32[], bool[]): the wrapping sum over the array of fmix32(bits ^ position * golden
    ratio), and whether it is all finite.

    Each term is a bijection of the element's bits, so any change to one element (a flipped
    bit) always changes the sum; the position makes a swap of two elements change it too
    (but for a 2^-32 chance). The sum is over the *global* array: XLA reduces each device's
    block and adds the partial sums, and wrapping u32 addition is associative and commutative,
    so the result is the same, bit for bit, on every mesh and sharding.

    XLA on CPU writes the hashed words to a temporary before reducing them, as large as the
    array's block on each device and, for arrays hashed side by side, all of them at once.
    A large array is hashed in ``plan.parts`` parts instead, one after the other in a loop,
    so the temporary is one part's: its rows viewed as ``(shards, parts, rows per part)``,
    a free reshape that leaves each device its own rows, part ``j`` being the ``j``-th run of
    consecutive rows of every device's block."""
    bits_shape = jax.eval_shape(_as_u32, jax.ShapeDtypeStruct(x.shape, x.dtype)).shape
    if plan.parts == 1:
        return _hash_sum(x, jnp.uint32(0), _row_major(bits_shape))
    shards, parts = plan.shards, plan.parts
    per_part = x.shape[0] // shards // parts  # rows
    row = math.prod(bits_shape[1:])  # u32 words
    # The words of part j's [s, i, ...] are at ((s * parts + j) * per_part + i) * row + ...
    # (A dim of 1 row per part is left out: XLA on CPU copies the whole view for it.)
    rows = [per_part] if per_part > 1 else []
    view = x.reshape(shards, parts, *rows, *x.shape[1:])
    view = jax.lax.with_sharding_constraint(view, plan.sharding)
    strides = [parts * per_part * row, *[row] * len(rows), *_row_major(bits_shape[1:])]

    def add_part(j, total):
        part = jax.lax.dynamic_index_in_dim(view, j, axis=1, keepdims=False)
        first = j.astype(jnp.uint32) * jnp.uint32(per_part * row % 2**32)
        checksum, finite = _hash_sum(part, first, strides)
        return total[0] + checksum, total[1] & finite

    return jax.lax.fori_loop(0, parts, add_part, (jnp.uint32(0), jnp.array(True)))


def _digest(leaves: Sequence[jax.Array], plans: tuple[_Plan, ...]) -> tuple[jax.Array, jax.Array]:
    """(u32[n] checksums, bool[n] all finite) of ``leaves``."""
    sums, finite = zip(*(_checksum(x, p) for x, p in zip(leaves, plans, strict=True)), strict=True)
    return jnp.stack(sums), jnp.stack(finite)


@functools.cache
def _jitted_digest(mesh: Mesh | None):
    if mesh is None:
        return jax.jit(_digest, static_argnums=1)
    # A few scalars, replicated: every process can read them.
    return jax.jit(_digest, static_argnums=1, out_shardings=shardings(u32["n"], mesh))


def _leaf_names(state: Any) -> list[str]:
    """``state.weights.layers.w_up``, ``state.opt_state[1][0].mu.embed``, ...: every array."""
    return [
        "state" + jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_leaves_with_path(state)
    ]


def state_digest(state: Any) -> tuple[dict[str, int], dict[str, bool]]:
    """Each array's checksum and whether it is finite, by name, in one jitted call on device.

    Nothing but the 5 bytes per array comes to the host; the checksum does not depend on the
    arrays' sharding (see :func:`_checksum`). A zero-size array (a weight the config has
    not) holds nothing to check and is left out, so checkpoints written before the weight
    existed check the same."""
    named = [(n, x) for n, x in zip(_leaf_names(state), jax.tree.leaves(state), strict=True)]
    named = [(n, x) for n, x in named if getattr(x, "size", 1) != 0]
    names, leaves = [n for n, _ in named], [x for _, x in named]
    shardings = [getattr(x, "sharding", None) for x in leaves]
    mesh = next((s.mesh for s in shardings if isinstance(s, NamedSharding)), None)
    plans = tuple(_plan(x) for x in leaves)
    sums, finite = jax.device_get(_jitted_digest(mesh)(leaves, plans))
    return (
        dict(zip(names, (int(c) for c in sums), strict=True)),
        dict(zip(names, (bool(f) for f in finite), strict=True)),
    )
