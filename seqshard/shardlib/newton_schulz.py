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

A device's block of the stack must split evenly over the moved axes: where the layers do not
divide (3 layers on fsdp x t = 8 devices), the stack is padded with zero matrices, which stay
zero (``0 / (0 + eps) = 0``), and cut back after. The bytes moved: each all_to_all sends
(n-1)/n of the block, twice each way.

This module is the sharded operation only (issue 45's item 2, the first part); the optimizer
that uses it is not built yet.
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


def orthogonalized(
    spec: str, g: jax.Array, steps: int = 5, coefficients=COEFFICIENTS, eps: float = 1e-8
) -> jax.Array:
    """:func:`newton_schulz` of each matrix of the stack ``g``, inside a shard_map: ``spec`` is
    its layout, the stacked dimension then the matrix's rows and columns (``'S/p M/d/e/c F/t'``;
    other labels alike), the result in that layout (f32). See the module docstring."""
    stack, rows, cols = parse_shape(spec).dims
    moved = [a for a in (*rows.axes, *cols.axes) if shardops.axis_size(a) > 1]
    ways = shardops.axis_size(moved) if moved else 1
    local = g.shape[0]
    padded = -(-local // ways) * ways
    x = g.astype(jnp.float32)
    if padded != local:  # zero matrices, which stay zero
        x = jnp.concatenate([x, jnp.zeros((padded - local, *x.shape[1:]), x.dtype)])
    # The padded stack is labelled Sp: its size is not the declared stack's.
    labels = ("Sp", rows.label, cols.label)

    def layout(*axes: tuple[str, ...]) -> str:
        return " ".join("/".join((label, *a)) for label, a in zip(labels, axes, strict=True))

    st, ra, ca = tuple(stack.axes), tuple(rows.axes), tuple(cols.axes)
    # The rows' split onto the stack, then the columns': each device holds whole matrices.
    moves = [
        (layout(st, ra, ca), layout((*st, *ra), (), ca), ra),
        (layout((*st, *ra), (), ca), layout((*st, *ra, *ca), (), ()), ca),
    ]
    for src, dst, axes in moves:
        if axes:
            x = shardops.all_to_all(f"{src} -> {dst}", x)
    x = newton_schulz(x, steps, coefficients, eps)
    for src, dst, axes in reversed(moves):
        if axes:
            x = shardops.all_to_all(f"{dst} -> {src}", x)
    return x[:local]
