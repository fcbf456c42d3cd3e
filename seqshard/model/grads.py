"""The backward of what every block kind is built from, written in the notation: a norm over
the gathered residual, projections of its normed rows (FSDP weights gathered over d, e, c),
and an output projection reduce-scattered over t into the residual. The block kinds' own
backwards (:mod:`seqshard.model.attention_block`, :mod:`seqshard.model.swiglu`) are these
pieces in the order of their forward; :mod:`seqshard.model.backward` runs them for the model.

Every weight's gradient follows one pattern, the transpose of the forward's all_gather ->
einsum::

    w = all_gather('M/fsdp F/t -> M F/t', w)                          # again, as FSDP does
    dw = einsum_unreduced('B/dp L@zigzag/c M, B/dp L@zigzag/c F/t -> M F/t{U_dp,c}', nx, dy)
    dw = psum_scatter('M F/t{U_fsdp} -> M/fsdp F/t', dw)             # FSDP's reduce-scatter

Numerics mirror autodiff of the forward: cotangents of compute-dtype values are in the
compute dtype, norms in f32, every weight gradient cast to f32 (the weights' dtype).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from seqshard.model.config import ModelConfig
from seqshard.shardlib import fp8, shardops
from seqshard.shardlib.collective_log import part
from seqshard.shardlib.fp8 import Fp8Mode

__all__ = [
    "norm_backward",
    "normed_projections_backward",
    "output_projection_backward",
    "projections_backward",
    "rms_norm_backward",
]

Activations = Mapping[str, jax.Array]

_ROWS = "B/dp L@zigzag/c"


def rms_norm_backward(
    x: jax.Array, gain: jax.Array, dy: jax.Array, eps: float
) -> tuple[jax.Array, jax.Array]:
    """The VJP of :func:`~seqshard.model.norm.rms_norm`, in f32: (dL/dx, dL/dgain).

    ``x`` is the norm's whole input (all of the last dimension), ``dy`` the cotangent of its
    output; dL/dgain is summed over every leading dimension. Both are linear in ``dy``, so a
    ``dy`` that owes a sum over a mesh axis gives results that owe the same sum.
    """
    x, dy = x.astype(jnp.float32), dy.astype(jnp.float32)
    inv_rms = lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    normed = x * inv_rms
    d_gain = jnp.sum(dy * normed, axis=tuple(range(x.ndim - 1)))
    d_normed = dy * gain.reshape((1,) * (x.ndim - 1) + gain.shape)
    # d/dx of x / rms(x): take out the component of d_normed along normed, then / rms(x).
    along = jnp.mean(d_normed * normed, axis=-1, keepdims=True)
    return (d_normed - normed * along) * inv_rms, d_gain


def norm_backward(
    cfg: ModelConfig, x: jax.Array, gain: jax.Array, d_n: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The transpose of ``normed(cfg, x, gain)`` and of the gather in ``norm_input``: dL/d(the
    residual) in its layout (compute dtype) and the gain's gradient 'M/t/fsdp' (f32), from
    ``d_n``, dL/d(normed rows) 'B/dp L@zigzag/c M' owing a sum over t (the projections contracted a
    t-split dimension). ``x`` is what :func:`~seqshard.model.norm.norm_input` gave."""
    dt, residual = jnp.dtype(cfg.compute_dtype), cfg.residual_spec
    if cfg.residual == "M/t":
        # The norm's backward is linear in its cotangent (and reads the gathered x, whole), so
        # it runs on the partial sums; the transpose of the residual's gather over t sums them
        # as it scatters.
        d_x, d_gain = rms_norm_backward(x, gain, d_n, cfg.norm_eps)
        d_x = shardops.psum_scatter(f"B/dp L@zigzag/c M{{U_t}} -> {residual}", d_x.astype(dt))
    else:
        # The transpose of the gather of the normed rows: summed over t, each shard its own
        # rows; then the norm's backward on them, local.
        d_n = shardops.psum_scatter(f"B/dp L@zigzag/c M{{U_t}} -> {residual}", d_n.astype(dt))
        d_x, d_gain = rms_norm_backward(x, gain, d_n, cfg.norm_eps)
        d_x = d_x.astype(dt)
    # Summed over this device's rows, partial over t (partial sums, or other rows): one
    # reduce-scatter over both, into the gain's 'M/t/fsdp' (the transpose of its gather).
    return d_x, shardops.psum_scatter("M{U_t,fsdp} -> M/t/fsdp", d_gain)


def projections_backward(
    x: jax.Array,
    projections: Sequence[tuple[str, str, jax.Array, jax.Array]],
    part_name: str,
    fp8_mode: Fp8Mode = "none",
) -> tuple[jax.Array, list[jax.Array]]:
    """The backward of projections ``y_i = x . w_i`` of one normed input ``x``
    'B/dp L@zigzag/c M', each given as (y's spec, the gathered weight's spec, dL/dy_i, w_i):
    dL/dx, which owes the sum over t of the contracted t-split dims, and each weight's
    gradient in its FSDP layout 'M/fsdp ...'. With ``fp8_mode`` each dL/dy_i goes on e5m2's
    grid first (a pmax of its amax over the axes Y_i splits it over), as autodiff's
    :func:`seqshard.shardlib.fp8.gradient_quantized` does::

        dy_i = fp8.cotangent_on_grid(mode, 'Y_i', dy_i)
        dx  = sum_i einsum_unreduced('Y_i, W_i -> B/dp L@zigzag/c M{U_t}', dy_i, w_i)
        dw_i = einsum_unreduced('B/dp L@zigzag/c M, Y_i -> W_i{U_dp,c}', x, dy_i)
        dw_i = psum_scatter('W_i{U_fsdp} -> W_i with M/fsdp', dw_i)
    """
    rows = f"{_ROWS} M"
    projections = [
        (y, w, fp8.cotangent_on_grid(fp8_mode, y, dy), weight) for y, w, dy, weight in projections
    ]
    d_x = functools.reduce(
        operator.add,
        (
            shardops.einsum_unreduced(f"{y}, {w} -> {rows}{{U_t}}", dy, weight)
            for y, w, dy, weight in projections
        ),
    )
    d_ws = [
        shardops.einsum_unreduced(f"{rows}, {y} -> {w}{{U_dp,c}}", x, dy)
        for y, w, dy, _ in projections
    ]
    # Each d shard summed over its own B/dp rows: sum the shards, keep FSDP's M/fsdp.
    with part(part_name):
        d_ws = [
            shardops.psum_scatter(f"{w}{{U_fsdp}} -> {w.replace('M', 'M/fsdp', 1)}", dw)
            for (_, w, _, _), dw in zip(projections, d_ws, strict=True)
        ]
    return d_x, d_ws


# The activations of a block's input side (x, norm(x)), its gain and the norm's part.


def normed_projections_backward(
    cfg: ModelConfig,
    a: Activations,
    norm: tuple[str, str, str, str],
    projections: Sequence[tuple[str, str, jax.Array]],
    part_name: str,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The backward of a block's input side, ``y_i = norm(x) . w_i``: ``norm`` names the
    activations x and norm(x), the gain and the norm's part (``_ATTENTION_INPUT``); each
    projection is (its weight's name, the gathered weight's spec 'W_i', dL/dy_i), y_i's spec
    being W_i with M replaced by the rows. Returns dL/dx (whole: the norm's backward sums the
    t shards) and the gradients {gain, w_i} (the w_i in f32)."""
    x, normed, gain, norm_part = norm
    d_n, d_ws = projections_backward(
        a[normed],
        [(w.replace("M", _ROWS, 1), w, dy, a[n]) for n, w, dy in projections],
        part_name,
        cfg.fp8,
    )
    # d_n still owes the sum over t of the contracted t-split dims.
    with part(norm_part):
        d_x, d_gain = norm_backward(cfg, a[x], a[gain], d_n)
    named = {name: dw.astype(jnp.float32) for (name, *_), dw in zip(projections, d_ws, strict=True)}
    return d_x, {gain: d_gain, **named}


def output_projection_backward(
    cfg: ModelConfig, d_out: jax.Array, x: jax.Array, w: jax.Array, dims: str, part_name: str
) -> tuple[jax.Array, jax.Array]:
    """The backward of an output projection ``out = psum_scatter(x . w)`` (attention's o, the
    FFN's down) of ``x`` 'B/dp L@zigzag/c X' (``dims`` is X, t-split) and the gathered ``w``
    'M X': (dL/dx, dL/dw in FSDP's layout 'M/fsdp X'). The forward reduce-scattered over t;
    its transpose gathers dL/d(out) over t, so each t shard has all of M against its X (with
    ``model.fp8``, g on e5m2's grid; ``x`` is then the forward's operand on e4m3's)::

        g  = all_gather('<residual> -> B/dp L@zigzag/c M', d_out)
        g  = fp8.cotangent_on_grid(mode, 'B/dp L@zigzag/c M', g)
        dx = einsum_unreduced('B/dp L@zigzag/c M, M X -> B/dp L@zigzag/c X', g, w)
        dw = einsum_unreduced('B/dp L@zigzag/c X, B/dp L@zigzag/c M -> M X{U_dp,c}', x, g)
        dw = psum_scatter('M X{U_fsdp} -> M/fsdp X', dw)
    """
    with part(part_name):
        g = shardops.all_gather(f"{cfg.residual_spec} -> {_ROWS} M", d_out)
        g = fp8.cotangent_on_grid(cfg.fp8, f"{_ROWS} M", g)
        d_x = shardops.einsum_unreduced(f"{_ROWS} M, M {dims} -> {_ROWS} {dims}", g, w)
        d_w = shardops.einsum_unreduced(f"{_ROWS} {dims}, {_ROWS} M -> M {dims}{{U_dp,c}}", x, g)
        # Each d shard summed over its own B/dp rows: sum the shards, keep FSDP's M/fsdp.
        d_w = shardops.psum_scatter(f"M {dims}{{U_fsdp}} -> M/fsdp {dims}", d_w)
    return d_x, d_w
