"""FP8 matmul operands with per-tensor scales, the scale of a sharded tensor reduced in the
notation.

A tensor goes to FP8 as ``bits = saturate(x / scale).astype(fp8)`` and comes back as
``bits.astype(dtype) * scale``: the value on the format's grid at that scale, in the compute
dtype. That quantize-dequantize pair around a ``dot_general`` is the pattern XLA's GPU compiler
rewrites into one cuBLASLt FP8 GEMM (the operands' bits and scales go to the GEMM; the
dequantized copy is never made); other backends run the program as written (CPU: slowly, with
the same numbers, which is how this module is tested).

Two formats (OCP FP8), as Transformer Engine and torchtitan use them::

    FORWARD   float8_e4m3fn   weights and activations   3 mantissa bits, |x| <= 448
    BACKWARD  float8_e5m2     gradients                 2 mantissa bits, |x| <= 57344

*Current scaling*: the scale is the least power of two at which amax, the largest |x| of the
whole tensor, fits the format (amax / scale in (max/2, max]); a power of two so that the
division is exact and the scale does not move with the last bits of the amax (docs/fp8.md:
with amax / max instead, FP8's grid turned f32 rounding differences into different roundings
everywhere). A sharded tensor's amax is a property of the whole tensor, so each device's
local max is reduced over the mesh axes its layout splits it over, one checked all-reduce
written in the notation and logged like every other collective::

    amax = pmax('(){U_dp,c,t} -> ()', max|x|)      # x 'B/dp L@zigzag/c F/t'

Every device then quantizes with the same scale, and the sharded model equals the single-
device reference run in FP8 (``seqshard.model.reference``) to f32 rounding. An all-zero tensor
(amax 0) or a non-finite amax keeps scale 1; values beyond the format's range saturate to
+-max (e4m3fn has no infinity: an unclipped overflow would be NaN).

*Delayed scaling* (:func:`delayed_scale`): the scale of the largest amax of past steps, which
:mod:`seqshard.model.fp8_scaling` keeps per tensor; the functions below take such a scale
``s`` instead of their current one.

The three ways a model uses it, each a no-op unless FP8 is on:

    quantized(spec, x)            x on e4m3's grid; its gradient passes straight through
    gradient_quantized(spec, y)   y unchanged; ITS COTANGENT goes on e5m2's grid (the matmul
                                  transposes then multiply FP8 by FP8, as the forward did)
    gather_quantized(spec, w)     an FSDP all_gather of w's e4m3 bits (1 byte an element:
                                  half of bf16's) and the scale; dequantized after it

Under autodiff the last two carry a custom VJP whose backward rule runs the cotangent's
collectives (its amax's pmax; the weight gradient's reduce-scatter, in the cotangent's dtype)
and logs them in the backward phase where the forward ran. The hand-written backward
(:mod:`seqshard.model.grads`) calls :func:`cotangent_on_grid` itself.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from seqshard.shardlib import collective_log, shardops
from seqshard.shardlib.notation import parse_op, parse_shape
from seqshard.shardlib.shapecheck import block_axes, block_axes_scope, shape_scope
from seqshard.shardlib.vma import varying_axes

__all__ = [
    "BACKWARD",
    "FORWARD",
    "Fp8Mode",
    "amax",
    "cotangent_on_grid",
    "delayed_scale",
    "gather_quantized",
    "gradient_quantized",
    "local_gradient_quantized",
    "local_quantized",
    "local_weight_quantized",
    "on_grid",
    "quantized",
    "scale",
    "weight_spec",
]

Fp8Mode = Literal["none", "current", "delayed"]

FORWARD = jnp.dtype(jnp.float8_e4m3fn)
"""The forward operands' format: weights and activations (more mantissa)."""
BACKWARD = jnp.dtype(jnp.float8_e5m2)
"""The gradients' format (more range)."""


def _largest(fmt: jnp.dtype) -> float:
    return float(jnp.finfo(fmt).max)


def amax(spec: str, x: jax.Array, *, invariant: bool = False) -> jax.Array:
    """The largest |x| of the whole tensor ``x`` of layout ``spec``, f32, the same on every
    device: this block's max, reduced over the axes ``spec`` splits it over (one pmax; none
    where they all have size 1). ``invariant``: over every axis but p that x varies over too
    (those hold copies: the same max), so that the result is typed replicated, as a block's
    auxiliary outputs are. No gradient flows through it."""
    local = jnp.max(jnp.abs(lax.stop_gradient(x))).astype(jnp.float32)
    axes = parse_shape(spec).split_axes
    if invariant:
        copies = varying_axes(local) - {"p"} - set(axes)
        axes = (*axes, *(a for a in ("d", "e", "c", "t") if a in copies))
    if not axes:
        return local
    # Each device holds one block of the tensor: its amax is the max over every block.
    return shardops.pmax(f"(){{U_{','.join(axes)}}} -> ()", local)


def delayed_scale(history: jax.Array, current: jax.Array, fmt: jnp.dtype) -> jax.Array:
    """Delayed scaling: the :func:`scale` of the largest amax in ``history`` (past steps'),
    or of the ``current`` amax while the history is empty (all zero: the first step)."""
    past = jnp.max(history).astype(jnp.float32)
    return scale(jnp.where(past > 0, past, current), fmt)


def scale(tensor_amax: jax.Array, fmt: jnp.dtype) -> jax.Array:
    """Current scaling: the least power of two at which ``amax`` fits ``fmt``'s range (amax /
    scale in (max/2, max]); 1 for an all-zero tensor or a non-finite amax (whose values then
    saturate). A power of two, so that x / scale and the dequantization are exact, and a scale
    that does not move with the last bits of its amax (see the module docstring)."""
    ok = (tensor_amax > 0) & jnp.isfinite(tensor_amax)
    mantissa, exponent = jnp.frexp(jnp.where(ok, tensor_amax, 1.0) / _largest(fmt))
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)  # already a power of two
    return jnp.where(ok, jnp.ldexp(jnp.float32(1), exponent), 1.0).astype(jnp.float32)


def on_grid(x: jax.Array, s: jax.Array, fmt: jnp.dtype) -> jax.Array:
    """``x`` on ``fmt``'s grid at scale ``s``, in x's dtype: ``saturate(x / s).astype(fmt)``
    times ``s`` (the quantize-dequantize XLA's GPU compiler fuses into an FP8 GEMM)."""
    bits = _bits(x, s, fmt)
    return bits.astype(x.dtype) * s.astype(x.dtype)


def _bits(x: jax.Array, s: jax.Array, fmt: jnp.dtype) -> jax.Array:
    top = _largest(fmt)
    return jnp.clip(x.astype(jnp.float32) / s, -top, top).astype(fmt)


# --- the forward operands: on e4m3's grid, gradient straight through ------------------------


@jax.custom_vjp
def _straight_through(x: jax.Array, s: jax.Array) -> jax.Array:
    return on_grid(x, s, FORWARD)


def _straight_through_fwd(x, s):
    return on_grid(x, s, FORWARD), None


def _straight_through_bwd(_, ct):
    # The rounding's gradient is taken as 1 (the straight-through estimator, as every FP8
    # recipe does); the scale is a statistic of the tensor, no path for the gradient.
    return ct, None


_straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)


def quantized(mode: Fp8Mode, spec: str, x: jax.Array, s: jax.Array | None = None) -> jax.Array:
    """``x`` (layout ``spec``) on e4m3's grid at scale ``s`` (default: its current scale), or
    x itself (mode ``none``). Its gradient passes through unchanged."""
    if mode == "none":
        return x
    if s is None:
        s = scale(amax(spec, x), FORWARD)
    return _straight_through(x, s)


def local_quantized(mode: Fp8Mode, x: jax.Array, s: jax.Array | None = None) -> jax.Array:
    """:func:`quantized` of a whole tensor on one device (the reference model's)."""
    if mode == "none":
        return x
    if s is None:
        s = scale(_local_amax(lax.stop_gradient(x)), FORWARD)
    return _straight_through(x, s)


def local_weight_quantized(mode: Fp8Mode, w: jax.Array, dtype, s: jax.Array | None = None):
    """:func:`gather_quantized`'s value for a whole weight on one device (the reference
    model's): w's e4m3 bits at scale ``s`` (default: its own), dequantized to ``dtype``;
    gradient straight through."""
    if mode == "none":
        return w.astype(dtype)
    if s is None:
        s = scale(_local_amax(lax.stop_gradient(w)), FORWARD)
    value = _bits(lax.stop_gradient(w), s, FORWARD).astype(dtype) * s.astype(dtype)
    return _straight_through_value(w.dtype.name, w, value)


# --- the gradients: the cotangent on e5m2's grid ---------------------------------------------


def cotangent_on_grid(mode: Fp8Mode, spec: str, ct: jax.Array) -> jax.Array:
    """A cotangent ``ct`` (layout ``spec``) on e5m2's grid at its current scale (the hand-
    written backward's call, in place of autodiff's :func:`gradient_quantized`), or ct."""
    if mode == "none":
        return ct
    return on_grid(ct, scale(amax(spec, ct), BACKWARD), BACKWARD)


def _local_amax(ct: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(ct)).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cotangent_quantized(amax_of: Callable, y: jax.Array) -> jax.Array:
    return y


def _cotangent_quantized_fwd(amax_of, y):
    return y, None


def _cotangent_quantized_bwd(amax_of, _, ct):
    return (on_grid(ct, scale(amax_of(ct), BACKWARD), BACKWARD),)


_cotangent_quantized.defvjp(_cotangent_quantized_fwd, _cotangent_quantized_bwd)


def _where_now() -> tuple:
    """What a backward rule needs to run shardops and log where the forward ran: the block's
    mesh axes and the forward's place in the log."""
    axes = block_axes()
    sizes = () if axes is None else tuple(axes.sizes.items())
    manual = frozenset() if axes is None else axes.manual
    return sizes, manual, collective_log.place()


@contextlib.contextmanager
def _in_backward_rule(where: tuple) -> Iterator[None]:
    """The scopes a custom VJP's backward rule reopens (JAX traces it when it transposes the
    shard_map, after the forward's scopes closed): its collectives logged in the backward
    phase, in the scans and operation the forward ran in."""
    sizes, manual, place = where
    with (
        block_axes_scope(dict(sizes), manual),
        shape_scope(),
        collective_log.backward_rule(place),
    ):
        yield


def _sharded_amax(spec: str, where: tuple, ct: jax.Array) -> jax.Array:
    with _in_backward_rule(where):
        return amax(spec, ct)


def gradient_quantized(mode: Fp8Mode, spec: str, y: jax.Array) -> jax.Array:
    """``y`` (layout ``spec``, a projection's output) unchanged; under autodiff its cotangent
    goes on e5m2's grid at the cotangent's current scale (pmax over the axes ``spec`` splits
    it over, in the backward), so the matmul's transposes multiply FP8 operands (mode
    ``current``; ``none``: y, nothing more)."""
    if mode == "none":
        return y
    return _cotangent_quantized(functools.partial(_sharded_amax, spec, _where_now()), y)


def local_gradient_quantized(mode: Fp8Mode, y: jax.Array) -> jax.Array:
    """:func:`gradient_quantized` of a whole tensor on one device (the reference model's)."""
    if mode == "none":
        return y
    return _cotangent_quantized(_local_amax, y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _straight_through_value(w_dtype: str, w: jax.Array, value: jax.Array) -> jax.Array:
    return value


def _straight_through_value_fwd(w_dtype, w, value):
    return value, None


def _straight_through_value_bwd(w_dtype, _, ct):
    return ct.astype(w_dtype), None


_straight_through_value.defvjp(_straight_through_value_fwd, _straight_through_value_bwd)


# --- FSDP's weight gather in e4m3 --------------------------------------------------------------


def weight_spec(gather: str) -> str:
    """The layout a gather ``'M/fsdp F/t -> M F/t'`` reads: ``'M/d/e/c F/t'``."""
    return str(parse_op(gather).inputs[0])


def _transposed(spec: str) -> str:
    """The reduce-scatter that transposes gather ``spec``: ``'M/fsdp F/t -> M F/t'`` ->
    ``'M F/t{U_d,e,c} -> M/d/e/c F/t'`` (each dimension loses minor axes only)."""
    op = parse_op(spec)
    src, dst = op.inputs[0], op.output
    removed: list[str] = []
    for a, b in zip(src.dims, dst.dims, strict=True):
        if tuple(a.axes[: len(b.axes)]) != tuple(b.axes):
            raise ValueError(
                f"gather_quantized: {spec!r} gathers a major axis of {a.label}; only gathers "
                f"that drop minor axes ('M/fsdp F/t -> M F/t') are supported."
            )
        removed += list(a.axes[len(b.axes) :])
    return f"{dst}{{U_{','.join(removed)}}} -> {src}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _straight_through_gather(spec: str, where: tuple, w_dtype: str, w, gathered: jax.Array):
    return gathered


def _straight_through_gather_fwd(spec, where, w_dtype, w, gathered):
    return gathered, None


def _straight_through_gather_bwd(spec, where, w_dtype, _, ct):
    # The gradient of the gathered weight goes to its shard as without FP8: the transpose of
    # the gather, a reduce-scatter in the cotangent's dtype (the e4m3 bits carry none).
    with _in_backward_rule(where):
        d_w = shardops.psum_scatter(_transposed(spec), ct)
    return d_w.astype(w_dtype), None


_straight_through_gather.defvjp(_straight_through_gather_fwd, _straight_through_gather_bwd)


def gather_quantized(
    mode: Fp8Mode, spec: str, w: jax.Array, dtype, s: jax.Array | None = None
) -> jax.Array:
    """``all_gather(spec, w.astype(dtype))`` (mode ``none``), or the gather of w's e4m3 bits
    at scale ``s`` (default: the whole weight's current scale), dequantized to ``dtype`` after
    it: a weight gathered in 1 byte an element. The scale's pmax and the gather are logged as
    the weight's (re-run by every remat policy that re-gathers weights); the gradient is the
    gather's transpose, as without FP8."""
    if mode == "none":
        return shardops.all_gather(spec, w.astype(dtype))
    if s is None:
        with collective_log.of_weight():
            s = scale(amax(weight_spec(spec), w), FORWARD)
    bits = shardops.all_gather(spec, _bits(lax.stop_gradient(w), s, FORWARD))
    gathered = bits.astype(dtype) * s.astype(dtype)
    return _straight_through_gather(spec, _where_now(), w.dtype.name, w, gathered)
