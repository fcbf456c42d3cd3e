"""Every matmul of the model, and the one decision of how it is asked for.

:data:`ACCUMULATE` maps a backend (on CPU, the CPU's class: :func:`cpu_matmul`) and an operand
dtype to the :class:`MatmulPath` to ask the backend for, where that differs from JAX's
default: the dtype the operands are multiplied in and the dtype the products are summed in.
:func:`einsum` and :func:`ragged_dot` (the model's only matmuls:
:func:`seqshard.shardlib.shardops.einsum_unreduced` calls the first; the MoE grouped matmul and
the single-device reference call them directly) cast the operands to the first, ask the
backend for the second (``preferred_element_type``) and cast the result to ``out_dtype``, by
default the operands' dtype, which is what the next op reads::

    y = einsum('blm,mf->blf', x, w)            # bf16 x bf16, summed in f32, y in bf16
    s = einsum('bqd,bkd->bqk', q, k, out_dtype=jnp.float32)   # scores stay f32

How bf16 matmuls run on CPU, measured (2048^3, one device, JAX 0.10.2, best of 5;
``seqshard.hardware.matmul_paths``, also printed by ``scripts/bench_step.py``; the avx2 column
is issue 44's):

    ===========================  ===================  =====================  ===================
    GFLOP/s                      Intel Xeon with AMX  AMD EPYC, avx512_bf16  AMD EPYC, avx2 only
    ===========================  ===================  =====================  ===================
    bf16 x bf16 -> bf16 (a @ b)          218                   154                   87.9
    bf16 x bf16 -> f32                 1,176                   376                   68.5
    f32  x f32  -> f32                   264                   209                   99.1
    the model's bf16 matmuls     bf16 x bf16 -> f32   bf16 x bf16 -> f32     upcast, f32 x f32
    CPU class                           'bf16'                'bf16'                 'f32'
    ===========================  ===================  =====================  ===================

A CPU with bf16 dot instructions (``amx_bf16`` or ``avx512_bf16`` among its ``/proc/cpuinfo``
flags: class ``'bf16'``) runs the f32-output form on them, 1.8x to 4.5x its f32 dot; a
bf16-output dot XLA:CPU upcasts to f32 x f32. On a CPU with neither (class ``'f32'``) the
f32-output form is the slowest of the three (avx2 only: seqshard's bf16 step ran at 3,869
tokens/s against 4,884 in f32, mesh 8x1, when it took it). There the operands are upcast to
f32 first and run through the f32 dot, the fastest path measured; the casts are an n^2 cost
against the dot's n^3 (forced on an AMX Xeon, 2048^3: 255 GFLOP/s against its f32 dot's 306,
docs/benchmarks.md, "Per-CPU matmul accumulation"). The value is the same on every path: the
f32 sum of the exact products (a bf16 x bf16 product fits in f32), rounded once to
``out_dtype``; paths differ only in summation order. f16 takes the same path as bf16 (not
measured on avx2; on an AMX Xeon, 2048^3, f16 summed in f32 runs no faster than upcast to an
f32 dot, 257.9 against 260.1 GFLOP/s). Where the flags cannot be read (no ``/proc/cpuinfo``:
macOS; no x86 ``flags`` line: ARM), the class is ``'bf16'``, the decision before it was made
per CPU. ``SEQSHARD_CPU_MATMUL=bf16`` or ``f32`` overrides the flags (to measure one path
against the other on one machine; the tests pin ``bf16``).

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
cotangent matmul through the same decision: on a ``'bf16'`` CPU bf16 x bf16 summed in f32, on
an ``'f32'`` CPU the same upcast f32 dot as the forward's, each cast to the operand's dtype.
Tests count the dots of a compiled bf16 gradient by their dtypes on both CPU classes
(``tests/shardlib/test_matmul.py``; a whole bf16 train step's: ``tests/train/test_step.py``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from seqshard.shardlib.vma import vary_like

__all__ = [
    "ACCUMULATE",
    "CPU_BF16_FLAGS",
    "CPU_MATMUL_ENV",
    "ROW_TILES",
    "MatmulPath",
    "accumulation",
    "cpu_flags",
    "cpu_matmul",
    "einsum",
    "matmul_path",
    "matmul_target",
    "ragged_dot",
]


class MatmulPath(NamedTuple):
    """How to ask a backend for a matmul: the operands cast to ``operands``, their products
    summed in ``sums`` (``preferred_element_type``), the result cast to the output dtype."""

    operands: jnp.dtype
    sums: jnp.dtype

    def __str__(self) -> str:
        short = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
        o, s = (short.get(d.name, d.name) for d in self)
        return f"{o} x {o} -> {s}"


_BF16, _F16, _F32 = (jnp.dtype(t) for t in (jnp.bfloat16, jnp.float16, jnp.float32))

ACCUMULATE: Mapping[str, Mapping[jnp.dtype, MatmulPath]] = {
    # A CPU with bf16 dot instructions: bf16 products summed in f32, on them.
    "cpu/bf16": {_BF16: MatmulPath(_BF16, _F32), _F16: MatmulPath(_F16, _F32)},
    # A CPU without (avx2 only): the operands upcast, XLA:CPU's f32 dot.
    "cpu/f32": {_BF16: MatmulPath(_F32, _F32), _F16: MatmulPath(_F32, _F32)},
}
"""Matmul target (:func:`matmul_target`: the backend, on CPU ``'cpu/'`` and the CPU's class)
-> operand dtype -> the :class:`MatmulPath` to ask for (see the module docstring). A target or
dtype not listed gets JAX's default: the operands as they are, their dtype out, however the
backend sums."""

CPU_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
"""``/proc/cpuinfo`` flags of the x86 instructions XLA:CPU multiplies bf16 with: a CPU with one
is class ``'bf16'``, one with neither ``'f32'`` (:func:`cpu_matmul`)."""

CPU_MATMUL_ENV = "SEQSHARD_CPU_MATMUL"
"""The environment variable that names the CPU class, ``bf16`` or ``f32``, over the flags'."""


def cpu_matmul(flags: Collection[str] | None) -> str:
    """The class of a CPU with ``flags`` (its ``/proc/cpuinfo`` flags): ``'bf16'`` where they
    hold one of :data:`CPU_BF16_FLAGS` or are unknown (None: the decision from before it was
    made per CPU, kept where nothing was measured), ``'f32'`` where they hold neither (avx2
    only)."""
    if flags is None or CPU_BF16_FLAGS & set(flags):
        return "bf16"
    return "f32"


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """This CPU's flags (the first ``flags`` line of ``/proc/cpuinfo``, x86 Linux), or None where
    there is none to read (macOS; ARM Linux names its ``Features`` otherwise)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return None


def matmul_target(platform: str | None = None) -> str:
    """The key of :data:`ACCUMULATE` for ``platform`` (default: this process's backend): the
    backend's name, or on CPU ``'cpu/'`` and this CPU's class (``$SEQSHARD_CPU_MATMUL`` if set
    and not empty, else :func:`cpu_matmul` of :func:`cpu_flags`). A name already holding a
    class passes."""
    platform = platform or jax.default_backend()
    if platform != "cpu":
        return platform
    forced = os.environ.get(CPU_MATMUL_ENV)
    if not forced:
        return f"cpu/{cpu_matmul(cpu_flags())}"
    if f"cpu/{forced}" not in ACCUMULATE:
        classes = sorted(t.removeprefix("cpu/") for t in ACCUMULATE if t.startswith("cpu/"))
        raise ValueError(
            f"{CPU_MATMUL_ENV}={forced!r} names no CPU matmul class; expected one of {classes} "
            f"(bf16: bf16 products summed in f32, for CPUs with {sorted(CPU_BF16_FLAGS)}; f32: "
            f"the operands upcast to an f32 dot, for CPUs with neither). Set one of them, or "
            f"unset it to choose by this CPU's flags ({cpu_matmul(cpu_flags())!r} here)."
        )
    return f"cpu/{forced}"


def matmul_path(*operands: jax.Array, platform: str | None = None) -> MatmulPath | None:
    """The :class:`MatmulPath` to ask ``platform``'s backend (default: this process's) for, for a
    matmul of ``operands``, when :data:`ACCUMULATE` lists one (all operands of one dtype), else
    None: JAX's default."""
    dtypes = {jnp.dtype(x.dtype) for x in operands}
    table = ACCUMULATE.get(matmul_target(platform), {})
    return table.get(dtypes.pop()) if len(dtypes) == 1 else None


def accumulation(*operands: jax.Array, platform: str | None = None) -> jnp.dtype | None:
    """The dtype :func:`matmul_path` sums a matmul of ``operands`` in, or None (JAX's default)."""
    path = matmul_path(*operands, platform=platform)
    return None if path is None else path.sums


def _on_path(*operands: jax.Array) -> tuple:
    """The operands cast to the dtype their :func:`matmul_path` multiplies in, then the dtype it
    sums in (None: JAX's default, the operands untouched): ``x, y, acc = _on_path(x, y)``."""
    path = matmul_path(*operands)
    if path is None:
        return (*operands, None)
    return (*(x.astype(path.operands) for x in operands), path.sums)


def _same_vma(*operands: jax.Array) -> tuple[jax.Array, ...]:
    """The operands made to vary over the same mesh axes (inside a checked shard_map), as a
    matmul would make them implicitly: a custom VJP's cotangents must match its inputs'."""
    return tuple(vary_like(x, *operands) for x in operands)


def einsum(equation: str, a: jax.Array, b: jax.Array, *, out_dtype=None) -> jax.Array:
    """``jnp.einsum(equation, a, b)`` of two operands, asked for as :data:`ACCUMULATE` says
    and cast to ``out_dtype`` (default: the operands' result type). ``equation`` is explicit
    (``'ab,bc->ac'``): single letters, no ellipsis."""
    if matmul_path(a, b) is None:
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
    x, y, acc = _on_path(x, y)
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
    group's: 0), asked for as :data:`ACCUMULATE` says and cast to ``out_dtype`` (default:
    the operands' result type); in row tiles where :data:`ROW_TILES` lists the backend."""
    tile = ROW_TILES.get(jax.default_backend())
    if matmul_path(x, w) is None and tile is None:
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
    x, w, acc = _on_path(x, w)
    return lax.ragged_dot(x, w, sizes, preferred_element_type=acc).astype(out)


def _ragged_fast_fwd(out, x, w, sizes):
    return _ragged_fast(out, x, w, sizes), (x, w, sizes)


def _ragged_fast_bwd(out, res, ct):
    x, w, sizes = res
    ct = ct.astype(x.dtype)  # the cotangent in the operands' dtype: the fast path (docstring)
    xp, wp, cp, acc = _on_path(x, w, ct)
    dx = lax.ragged_dot(cp, jnp.swapaxes(wp, 1, 2), sizes, preferred_element_type=acc)
    dw = lax.ragged_dot_general(xp, cp, sizes, _RAGGED_CONTRACT_T, preferred_element_type=acc)
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
    x, w, acc = _on_path(x, w)
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
    x, ct, acc = _on_path(x, ct)
    n_groups, m, n = sizes.shape[0], x.shape[1], ct.shape[1]
    xp, cp = _padded(x, tile), _padded(ct, tile)
    init = vary_like(jnp.zeros((n_groups, m, n), acc or out), x, ct, sizes)

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
