"""Every matmul of the model, and the one decision of what it accumulates in.

:data:`ACCUMULATE` maps a backend and an operand dtype to the dtype the backend should be
asked to sum the products in, where that differs from the operands' (bf16 on CPU: f32). :func:`einsum` and :func:`ragged_dot` (the model's only matmuls:
:func:`seqshard.shardlib.shardops.einsum_unreduced` calls the first; the MoE grouped matmul and
the single-device reference call them directly) ask the backend for that accumulation
(``preferred_element_type``) and cast the result to ``out_dtype``, by default the operands'
dtype, which is what the next op reads::

    y = einsum('blm,mf->blf', x, w)            # bf16 x bf16, summed in f32, y in bf16
    s = einsum('bqd,bkd->bqk', q, k, out_dtype=jnp.float32)   # scores stay f32

Why bf16 products are summed in f32 on CPU, measured (2048^3, one device, JAX 0.10.2, best of
5; ``seqshard.hardware.matmul_paths``, also printed by ``scripts/bench_step.py``):

    ===================================  ====================  =====================
    GFLOP/s                              Intel Xeon with AMX   AMD EPYC, avx512_bf16
    ===================================  ====================  =====================
    bf16 x bf16 -> bf16  (``a @ b``)              218                   154
    bf16 x bf16 -> f32   (this module)          1,176                   376
    f32  x f32  -> f32                            264                   209
    ===================================  ====================  =====================

XLA:CPU runs only the f32-output form on the CPU's bf16 instructions; a bf16-output dot it
upcasts to f32 x f32. The value is the same or better: the f32 sum rounded once to bf16.
On GPU, cuBLAS sums bf16 products in f32 whatever the output type (the same value), and the
bf16 output was as fast or faster on every shape but one (H200, TFLOP/s, bf16 out against f32
summed and cast: 8192^3 694.5 / 643.8, the up projection's 685.6 / 559.2; docs/benchmarks.md,
"bf16 matmul paths"): GPUs keep JAX's default. TPUs too (the MXU sums in f32; not measured
here). f32 operands are left exactly as they were (no cast, no custom derivative): f32 runs
are bit-identical to plain ``jnp.einsum``.

Autodiff's own transpose of ``einsum(..., preferred_element_type=f32).astype(bf16)`` would
not keep the fast path: the cast's transpose hands the matmul an f32 cotangent, and JAX's
transpose then multiplies f32 by the other (upcast) bf16 operand, the f32 x f32 path.
So both functions carry a custom VJP that casts the cotangent to the operands' dtype first
(as the hand-written backward does with ``d_logits`` and ``d_scores``), and runs each
cotangent matmul through the same decision: bf16 x bf16 summed in f32, cast to the operand's
dtype. A test counts the dots of a compiled bf16 train step by their dtypes
(``tests/shardlib/test_matmul.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax

from seqshard.shardlib.vma import vary_like

__all__ = ["ACCUMULATE", "ROW_TILES", "accumulation", "einsum", "ragged_dot"]

ACCUMULATE: Mapping[str, Mapping[jnp.dtype, jnp.dtype]] = {
    "cpu": {
        jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.float32),
        jnp.dtype(jnp.float16): jnp.dtype(jnp.float32),
    },
}
"""Backend (``jax.default_backend()``) -> operand dtype -> the dtype to ask the backend to sum
matmul products in (see the module docstring). A backend or dtype not listed gets JAX's
default: the operands' dtype out, however the backend sums."""


def accumulation(*operands: jax.Array, platform: str | None = None) -> jnp.dtype | None:
    """The dtype to ask ``platform``'s backend (default: this process's) to sum a matmul of
    ``operands`` in, when :data:`ACCUMULATE` lists one (all operands of one dtype), else None."""
    dtypes = {jnp.dtype(x.dtype) for x in operands}
    table = ACCUMULATE.get(platform or jax.default_backend(), {})
    return table.get(dtypes.pop()) if len(dtypes) == 1 else None


def _same_vma(*operands: jax.Array) -> tuple[jax.Array, ...]:
    """The operands made to vary over the same mesh axes (inside a checked shard_map), as a
    matmul would make them implicitly: a custom VJP's cotangents must match its inputs'."""
    return tuple(vary_like(x, *operands) for x in operands)


def einsum(equation: str, a: jax.Array, b: jax.Array, *, out_dtype=None) -> jax.Array:
    """``jnp.einsum(equation, a, b)`` of two operands, accumulated as :data:`ACCUMULATE` says
    and cast to ``out_dtype`` (default: the operands' result type). ``equation`` is explicit
    (``'ab,bc->ac'``): single letters, no ellipsis."""
    acc = accumulation(a, b)
    if acc is None:
        return jnp.einsum(equation, a, b, preferred_element_type=out_dtype)
    out = jnp.dtype(out_dtype or jnp.result_type(a, b))
    return _einsum_fast(equation, out, *_same_vma(a, b))


def _terms(equation: str) -> tuple[str, str, str]:
    inputs, out = equation.replace(" ", "").split("->")
    a, b = inputs.split(",")
    for term, other in ((a, b + out), (b, a + out)):
        alone = set(term) - set(other)
        if alone:
            raise ValueError(
                f"einsum {equation!r}: operand {term!r} sums {sorted(alone)} alone, which this "
                f"function's transpose does not handle; sum them before the matmul."
            )
    return a, b, out


def _accumulated(equation: str, x: jax.Array, y: jax.Array, out: jnp.dtype) -> jax.Array:
    acc = accumulation(x, y)
    return jnp.einsum(equation, x, y, preferred_element_type=acc).astype(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _einsum_fast(equation: str, out: jnp.dtype, a: jax.Array, b: jax.Array) -> jax.Array:
    _terms(equation)
    return _accumulated(equation, a, b, out)


def _einsum_fast_fwd(equation, out, a, b):
    return _einsum_fast(equation, out, a, b), (a, b)


def _einsum_fast_bwd(equation, out, res, ct):
    a, b = res
    ta, tb, to = _terms(equation)
    ct = ct.astype(a.dtype)  # the cotangent in the operands' dtype: the fast path (docstring)
    return (
        _accumulated(f"{to},{tb}->{ta}", ct, b, a.dtype),
        _accumulated(f"{ta},{to}->{tb}", a, ct, b.dtype),
    )


_einsum_fast.defvjp(_einsum_fast_fwd, _einsum_fast_bwd)


ROW_TILES: Mapping[str, int] = {"cpu": 128}
"""Backend -> rows per tile for :func:`ragged_dot` where the backend has no grouped matmul.

XLA:CPU lowers ``lax.ragged_dot`` to one dense matmul of every group against every row (each
masked to its group), G times the grouped work; a mixture of experts' exchange buffer is also
sized for the worst case, mostly empty rows. There :func:`ragged_dot` walks the rows actually
in a group, ``ROW_TILES`` at a time, one ``[tile, M] x [M, N]`` matmul with that group's matrix
each (a ``lax.while_loop`` that stops after the last group's rows): the work is the rows the
groups hold, rounded up to a tile per group. Measured (``scripts/bench_moe.py``, 8 fake CPU
devices, 2 cores): the MoE train step on e2 d2 t2, dropless, 1,934 -> 8,762 tokens/s, from
0.55x to 1.52x the plain-jit GSPMD baseline; tiles of 64 / 128 / 256 rows within 4% of each
other. GPU and TPU have grouped kernels (megablox, cuBLAS grouped GEMM) and keep
``lax.ragged_dot``."""


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, out_dtype=None) -> jax.Array:
    """``lax.ragged_dot(x, w, group_sizes)``: x 'T M' (rows sorted by group), w 'G M N',
    ``group_sizes`` 'G' -> 'T N', each group's rows times its own matrix (rows past the last
    group's: 0), accumulated as :data:`ACCUMULATE` says and cast to ``out_dtype`` (default:
    the operands' result type); in row tiles where :data:`ROW_TILES` lists the backend."""
    acc = accumulation(x, w)
    tile = ROW_TILES.get(jax.default_backend())
    if acc is None and tile is None:
        return lax.ragged_dot(x, w, group_sizes, preferred_element_type=out_dtype)
    out = jnp.dtype(out_dtype or jnp.result_type(x, w))
    x, w = _same_vma(x, w)
    if tile is None:
        return _ragged_fast(out, x, w, group_sizes)
    return _ragged_tiled(out, tile, x, w, group_sizes)


# The weight gradient: for each group g, x_g^T . ct_g, i.e. x 'T M' and ct 'T N' contracted
# over T, which is ragged (split into the groups): out 'G M N'.
_RAGGED_CONTRACT_T = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ragged_fast(out: jnp.dtype, x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    acc = accumulation(x, w)
    return lax.ragged_dot(x, w, sizes, preferred_element_type=acc).astype(out)


def _ragged_fast_fwd(out, x, w, sizes):
    return _ragged_fast(out, x, w, sizes), (x, w, sizes)


def _ragged_fast_bwd(out, res, ct):
    x, w, sizes = res
    acc = accumulation(x, w)
    ct = ct.astype(x.dtype)  # the cotangent in the operands' dtype: the fast path (docstring)
    dx = lax.ragged_dot(ct, jnp.swapaxes(w, 1, 2), sizes, preferred_element_type=acc)
    dw = lax.ragged_dot_general(x, ct, sizes, _RAGGED_CONTRACT_T, preferred_element_type=acc)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


_ragged_fast.defvjp(_ragged_fast_fwd, _ragged_fast_bwd)


def _tile_walk(sizes: jax.Array, tile: int, body, init):
    """Fold ``body(g, start, valid, carry)`` over the row tiles of the groups: tile after tile
    of group g's rows (``start`` its first row, ``valid`` i32 the rows of the tile in g), empty
    groups skipped, until the last group's rows are done."""
    ends = jnp.cumsum(sizes.astype(jnp.int32))
    total = ends[-1]
    n_groups = sizes.shape[0]

    def next_group(g, start):  # the first group ending after row `start`
        return lax.while_loop(lambda g: (g < n_groups - 1) & (ends[g] <= start), lambda g: g + 1, g)

    def step(state):
        g, start, carry = state
        g = next_group(g, start)
        valid = jnp.minimum(ends[g] - start, tile)
        return g, start + valid, body(g, start, valid, carry)

    zero = vary_like(jnp.zeros((), jnp.int32), sizes)
    _, _, carry = lax.while_loop(lambda s: s[1] < total, step, (zero, zero, init))
    return carry


def _padded(x: jax.Array, tile: int) -> jax.Array:
    """``x`` with ``tile`` zero rows after its last: a tile read at any start row fits."""
    return jnp.concatenate([x, jnp.zeros((tile, *x.shape[1:]), x.dtype)])


def _tiled_product(x: jax.Array, w: jax.Array, sizes: jax.Array, tile: int, out) -> jax.Array:
    """x 'T M' sorted by group, w 'G M N' -> 'T N': each tile's rows times its group's matrix."""
    acc = accumulation(x, w)
    rows, n = x.shape[0], w.shape[-1]
    xp = _padded(x, tile)
    init = vary_like(jnp.zeros((rows + tile, n), out), x, w, sizes)

    def body(g, start, valid, y):
        xt = lax.dynamic_slice_in_dim(xp, start, tile)
        wg = lax.dynamic_index_in_dim(w, g, keepdims=False)
        yt = jnp.dot(xt, wg, preferred_element_type=acc).astype(out)
        keep = (jnp.arange(tile) < valid)[:, None]
        old = lax.dynamic_slice_in_dim(y, start, tile)
        return lax.dynamic_update_slice_in_dim(y, jnp.where(keep, yt, old), start, 0)

    return _tile_walk(sizes, tile, body, init)[:rows]


def _tiled_weight_grad(x: jax.Array, ct: jax.Array, sizes: jax.Array, tile: int, out):
    """x 'T M', ct 'T N' sorted by group -> 'G M N': each group's x_g^T . ct_g, tile by tile."""
    acc = accumulation(x, ct)
    n_groups, m, n = sizes.shape[0], x.shape[1], ct.shape[1]
    xp, cp = _padded(x, tile), _padded(ct, tile)
    init = vary_like(jnp.zeros((n_groups, m, n), jnp.float32 if acc else out), x, ct, sizes)

    def body(g, start, valid, dw):
        keep = (jnp.arange(tile) < valid)[:, None]
        xt = jnp.where(keep, lax.dynamic_slice_in_dim(xp, start, tile), 0)
        part = jnp.dot(xt.T, lax.dynamic_slice_in_dim(cp, start, tile), preferred_element_type=acc)
        old = lax.dynamic_index_in_dim(dw, g, keepdims=True)
        return lax.dynamic_update_index_in_dim(dw, old + part.astype(dw.dtype)[None], g, 0)

    return _tile_walk(sizes, tile, body, init).astype(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ragged_tiled(out: jnp.dtype, tile: int, x: jax.Array, w: jax.Array, sizes: jax.Array):
    return _tiled_product(x, w, sizes, tile, out)


def _ragged_tiled_fwd(out, tile, x, w, sizes):
    return _ragged_tiled(out, tile, x, w, sizes), (x, w, sizes)


def _ragged_tiled_bwd(out, tile, res, ct):
    x, w, sizes = res
    ct = ct.astype(x.dtype)  # the cotangent in the operands' dtype: the fast path (docstring)
    dx = _tiled_product(ct, jnp.swapaxes(w, 1, 2), sizes, tile, x.dtype)
    dw = _tiled_weight_grad(x, ct, sizes, tile, w.dtype)
    return dx, dw, None


_ragged_tiled.defvjp(_ragged_tiled_fwd, _ragged_tiled_bwd)
