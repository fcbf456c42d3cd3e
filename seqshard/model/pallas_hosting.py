"""Hosting a per-device Pallas attention kernel inside the model's checked shard_map: splash
(:mod:`seqshard.model.splash`, TPU) and Pallas' GPU flash attention
(:mod:`seqshard.model.pallas_gpu`) both run through here.

A kernel module supplies two functions of one device's blocks, ``local(q, k, v, ids) -> out``
and ``local_vjp(q, k, v, ids, g) -> (dq, dk, dv)`` (``ids``: segment ids ``'B/dp L'`` int32,
or None; ``g``: the output's cotangent), and calls :func:`hosted_attention` /
:func:`hosted_attention_vjp` with them.

Why hosting: Pallas kernels state no replication type (which mesh axes a value varies over,
JAX's "vma"), so under ``check_vma=True`` they cannot trace. An inner
``jax.shard_map(check_vma=False)`` alone is not enough: what it returns is typed invariant over
every axis (untrue, and a psum in waiting for autodiff), and differentiating through it pairs
typed primals with untyped cotangents. So the kernel runs, forward and backward, in such an
inner region over the already-manual axes (no data moves: every device passes its own blocks
in and out), inside a ``jax.custom_vjp``, so that autodiff never looks inside, and what comes
out is cast to the inputs' type. See :func:`hosted_attention` for why that is sound.

Values that enter an unchecked region nested in a checked one keep their outer types, while
every op inside it gives untyped results; Pallas interpret mode (its loop carries) and
``jax.vjp`` (primal against cotangent) both compare the two and fail. So ``local`` and
``local_vjp`` are given their arguments as results of an op inside the region, untyped as
everything else there (:func:`_untyped`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from seqshard.shardlib.shardtypes import manual_axes, per_device_unchecked
from seqshard.shardlib.vma import varying_axes

__all__ = ["hosted_attention", "hosted_attention_vjp"]

Local = Callable[..., jax.Array]
"""``(q, k, v, ids) -> out`` on one device's blocks."""
LocalVjp = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
"""``(q, k, v, ids, g) -> (dq, dk, dv)`` on one device's blocks."""


def hosted_attention(
    local: Local, local_vjp: LocalVjp, q: jax.Array, k: jax.Array, v: jax.Array, ids
) -> jax.Array:
    """``local(q, k, v, ids)``: inside a shard_map hosted, and differentiated by ``local_vjp``;
    outside one (or on a 1x1 mesh) as it is, differentiated by autodiff (the kernel's own VJP).

    Inside a shard_map the kernel runs in an unchecked region, which is sound because:

    1. The kernel is per device: no collectives, each device's output block is a function of
       its own input blocks only. So the output varies over at most the axes its inputs vary
       over, U, and claiming it varies over all of U is true (varying means "may differ").
       Over any axis outside U every device computes the same function of the same inputs,
       so the output is truly invariant there, as typed.
    2. The inputs are first cast to vary over all of U (``lax.pcast(..., to='varying')``),
       outside the custom VJP, so JAX's autodiff transposes those casts itself: an input
       invariant over an axis of U gets the sum over that axis of its per-device cotangents.
    3. Inside the custom VJP every primal then has type U, so each cotangent, the per-device
       VJP of the kernel (exact for varying inputs, by 1), is cast to U too: the type of its
       primal, as custom_vjp requires, and no further sum is owed.
    4. The residuals are the (typed) inputs, so nothing that leaves the region untyped is
       kept: everything the region returns is cast to U before anything else sees it.
    """
    manual = manual_axes()
    if not manual:  # outside shard_map (or a 1x1 mesh): nothing to host, autodiff of the kernel
        return local(q, k, v, ids)
    axes = _varying(manual, (q, k, v, ids))
    q, k, v, ids = (None if x is None else _vary(x, axes) for x in (q, k, v, ids))
    return _hosted(local, local_vjp, axes, q, k, v, ids)


def hosted_attention_vjp(
    local_vjp: LocalVjp, q: jax.Array, k: jax.Array, v: jax.Array, ids, g: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv of :func:`hosted_attention` given its output's cotangent ``g``, hosted as its
    backward is (the kernel's own VJP), without running the forward first: for a hand-written
    backward (``model.backward=explicit``), which has q, k, v at hand. Each cotangent is typed
    as varying over the axes its inputs vary over."""
    manual = manual_axes()
    if not manual:
        return local_vjp(q, k, v, ids, g)
    inputs = (q, k, v, ids, g)
    axes = _varying(manual, inputs)
    q, k, v, ids, g = (None if x is None else _vary(x, axes) for x in inputs)
    return _hosted_bwd(None, local_vjp, axes, (q, k, v, ids), g)[:3]


def _varying(manual: tuple[str, ...], arrays) -> tuple[str, ...]:
    """The manual axes (in mesh order) any of ``arrays`` varies over: U."""
    varying = frozenset().union(*(varying_axes(x) for x in arrays if x is not None))
    return tuple(a for a in manual if a in varying)


def _untyped(fn: Callable) -> Callable:
    """``fn`` on its (array or None) arguments padded by nothing, where it runs: an op, so its
    results are untyped as every op's in the region (see the module docstring), that XLA
    removes. (A copy would not do: ``copy`` keeps its operand's type even there, as do the
    reshapes and transposes JAX drops when they change nothing.)"""

    def run(*args):
        return fn(*(None if x is None else _pad_by_nothing(x) for x in args))

    return run


def _pad_by_nothing(x: jax.Array) -> jax.Array:
    return lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] * x.ndim)


def _vary(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``x`` typed as varying over ``axes`` (a cast: the values do not change)."""
    return lax.pcast(x, tuple(a for a in axes if a not in varying_axes(x)), to="varying")


# ---------------------------------------------------------------------------------------------
# The hosting: a custom VJP whose forward and backward each run in an unchecked region


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _hosted(local, local_vjp, axes: tuple[str, ...], q, k, v, ids):
    return _vary(per_device_unchecked(_untyped(local), q, k, v, ids), axes)


def _hosted_fwd(local, local_vjp, axes, q, k, v, ids):
    return _hosted(local, local_vjp, axes, q, k, v, ids), (q, k, v, ids)


def _hosted_bwd(local, local_vjp, axes, residuals, g):
    dq, dk, dv = per_device_unchecked(_untyped(local_vjp), *residuals, g)
    # Each cotangent has its primal's type, U (see hosted_attention); segment ids have none.
    return _vary(dq, axes), _vary(dk, axes), _vary(dv, axes), None


_hosted.defvjp(_hosted_fwd, _hosted_bwd)
