"""Newton-Schulz orthogonalization (Muon's core) of stacked matrices that rest sharded.

Muon replaces a matrix's momentum ``G`` by the nearest semi-orthogonal matrix, about ``U V^T``
of its SVD, through a few iterations of an odd polynomial (Keller Jordan's coefficients, as
``optax.contrib.muon``'s default)::

    X = G / (||G||_F + eps)             (transposed first when it has more rows than columns)
    repeat steps:  A = X X^T;  X = a X + (b A + c A A) X

The iteration needs whole matrices, and seqshard's weights rest split: a stacked weight
``'layers/p M/fsdp F/t'`` holds on each device a block of every layer's matrix. So
:func:`orthogonalized` moves the matrices' splits onto the stacked dimension, each device then
holding whole matrices of some layers, iterates locally, and moves them back, two
``all_to_all`` each way, written in the notation::

    S/p M/fsdp F/t  ->  S/p/fsdp M F/t  ->  S/p/fsdp/t M F      (whole matrices)
    newton_schulz on each                                         (no communication)
    S/p/fsdp/t M F  ->  S/p/fsdp M F/t  ->  S/p M/fsdp F/t

Where a matrix is far wider than tall (``steps * M < F/t``), moving its columns would send more
than keeping them split: its Gram ``X X^T`` is then the column blocks' ``einsum_unreduced``
summed by a ``psum`` over their axes in each step, and only the rows move (the rule:
:func:`_gram_over_split_columns`; the projections of a transformer are never that wide).

A device's block of the stack must split evenly over the moved axes: where the layers do not
divide (3 layers on fsdp x t = 8 devices), the stack is padded with zero matrices, which stay
zero (``0 / (0 + eps) = 0``), and cut back after. The bytes moved: each all_to_all sends
(n-1)/n of the block, twice each way.

The optimizer that calls it, one shard_map over every weight matrix: :mod:`seqshard.train.muon`
(docs/muon.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from seqshard.shardlib import shardops
from seqshard.shardlib.notation import parse_shape

__all__ = ["COEFFICIENTS", "newton_schulz", "orthogonalized"]

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of the quintic iteration: Keller Jordan's, ``optax.contrib.muon``'s default."""


def newton_schulz(
    g: jax.Array, steps: int = 5, coefficients=COEFFICIENTS, eps: float = 1e-8
) -> jax.Array:
    """Whole matrices ``g [..., m, n]`` -> about ``U V^T`` of each (f32): plain JAX, the single-
    device reference and each device's step in :func:`orthogonalized`."""
    a, b, c = coefficients
    x = g.astype(jnp.float32)
    tall = x.shape[-2] > x.shape[-1]
    if tall:  # iterate on the smaller Gram matrix
        x = jnp.swapaxes(x, -1, -2)
    norm = jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True))
    x = x / (norm + eps)
    for _ in range(steps):
        gram = x @ jnp.swapaxes(x, -1, -2)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return jnp.swapaxes(x, -1, -2) if tall else x


def _gram_over_split_columns(m: int, n_local: int, axes, steps: int) -> bool:
    """Whether a matrix of ``m`` rows whose columns stay split over ``axes`` (``n_local`` each)
    iterates with its Gram all-reduced (``steps`` all-reduces of m x m: 2 steps m^2 (k-1)/k
    sent) rather than moving its columns onto the stack (there and back: 2 m n_local (k-1)/k):
    when steps * m < n_local, only for matrices far wider than tall (k = the axes' devices)."""
    return m <= n_local * shardops.axis_size(list(axes)) and steps * m < n_local


def _split_columns_iteration(spec, col_axes, x, steps, coefficients, eps):
    """:func:`newton_schulz` of whole-row, column-split matrices ``x`` 'Sp M F/t' (spec): the
    Gram X X^T of each is its column blocks' products summed over t, the rest local::

        sq   = psum('Sp{U_t} -> Sp', sum of this block's squares)     # ||X||_F^2
        gram = psum('Sp M N{U_t} -> Sp M N', einsum_unreduced('Sp M F/t, Sp N F/t -> ...'))
    """
    a, b, c = coefficients
    s_dim, m_label, f_dim = spec.split()
    t = ",".join(col_axes)
    x = x.astype(jnp.float32)
    sq = shardops.psum(f"{s_dim}{{U_{t}}} -> {s_dim}", jnp.sum(x * x, axis=(-2, -1)))
    x = x / (jnp.sqrt(sq)[:, None, None] + eps)
    for _ in range(steps):
        partial = shardops.einsum_unreduced(
            f"{spec}, {s_dim} N {f_dim} -> {s_dim} {m_label} N{{U_{t}}}", x, x
        )
        # Each device multiplied its own columns: the Gram is the sum over their split.
        gram = shardops.psum(f"{s_dim} {m_label} N{{U_{t}}} -> {s_dim} {m_label} N", partial)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def orthogonalized(
    spec: str, g: jax.Array, steps: int = 5, coefficients=COEFFICIENTS, eps: float = 1e-8
) -> jax.Array:
    """:func:`newton_schulz` of each matrix of the stack ``g``, inside a shard_map: ``spec`` is
    its layout, the stacked dimension then the matrix's rows and columns (``'S/p M/d/e/c F/t'``;
    other labels alike), the result in that layout (f32). See the module docstring."""
    stack, rows, cols = parse_shape(spec).dims
    split_rows = [a for a in rows.axes if shardops.axis_size(a) > 1]
    split_cols = [a for a in cols.axes if shardops.axis_size(a) > 1]
    m = g.shape[-2] * (shardops.axis_size(split_rows) if split_rows else 1)
    gram = bool(split_cols) and _gram_over_split_columns(m, g.shape[-1], split_cols, steps)
    # The axes moved onto the stack (the columns' stay put on the Gram path): a device's block
    # of the stack must split evenly over them.
    moved = split_rows + ([] if gram else split_cols)
    ways = shardops.axis_size(moved) if moved else 1
    local = g.shape[0]
    padded = -(-local // ways) * ways
    x = g.astype(jnp.float32)
    if padded != local:  # zero matrices, which stay zero
        x = jnp.pad(x, ((0, padded - local), (0, 0), (0, 0)))
    if moved:
        # XLA:CPU splits an all_to_all into its operand's parts, which it traces back through
        # a pad, a concatenate or a transpose to operands its verifier then rejects ("operands
        # with different shapes"): one materialized array to it.
        x = jax.lax.optimization_barrier(x)
    # The padded stack is labelled Sp: its size is not the declared stack's.
    labels = ("Sp", rows.label, cols.label)

    def layout(*axes: tuple[str, ...]) -> str:
        return " ".join("/".join((label, *a)) for label, a in zip(labels, axes, strict=True))

    st, ra, ca = tuple(stack.axes), tuple(rows.axes), tuple(cols.axes)
    rows_moved = layout((*st, *ra), (), ca)
    if ra:  # the rows' split onto the stack
        x = shardops.all_to_all(f"{layout(st, ra, ca)} -> {rows_moved}", x)
    if gram:
        x = _split_columns_iteration(rows_moved, ca, x, steps, coefficients, eps)
    else:  # the columns' split onto the stack too: whole matrices
        whole = layout((*st, *ra, *ca), (), ())
        if ca:
            x = shardops.all_to_all(f"{rows_moved} -> {whole}", x)
        x = newton_schulz(x, steps, coefficients, eps)
        if ca:
            x = shardops.all_to_all(f"{whole} -> {rows_moved}", x)
    if ra:
        x = shardops.all_to_all(f"{rows_moved} -> {layout(st, ra, ca)}", x)
    return x[:local]
