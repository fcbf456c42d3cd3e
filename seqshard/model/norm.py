"""RMSNorm on the residual, in whichever layout ``model.residual`` gives it (transformer.py's
docstring): the norm needs all of M per row, the projections after it every row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from seqshard.model.block import Op, elementwise
from seqshard.model.config import ModelConfig
from seqshard.shardlib import shardops
from seqshard.shardlib.remat import RematName

__all__ = ["norm_input", "norm_op", "normed", "rms_norm"]


def norm_op(name: str, consumers: int, recomputed_by: tuple[RematName, ...] = ()) -> Op:
    """RMSNorm's FLOPs on the gathered residual 'B/dp L M' (its work is repeated on each t
    shard): forward x*x, sum, / M, + eps, rsqrt, x * r, * gain (4 M + 3); backward, seed 004's
    fused form for RMS: the gain's gradient (2 M), the input's (6 M), and when its output feeds
    several matmuls the sum of their cotangents ((consumers - 1) M)."""
    return elementwise(
        name,
        "token",
        "B/dp L M",
        lambda m: 4 * m.d_model + 3,
        lambda m: 8 * m.d_model + (consumers - 1) * m.d_model,
        recomputed_by,
    )


def rms_norm(x: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * gain over the last dimension, in f32."""
    x = x.astype(jnp.float32)
    gain = gain.reshape((1,) * (x.ndim - 1) + gain.shape)
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def norm_input(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """What the pre-norm normalizes: the residual with all of M. A residual split over M
    (``'B/dp L@zigzag/c M/t'``) is gathered over t; one split over L (``'B/dp L@zigzag/c/t M'``)
    already holds all of M for its rows and is normalized as it is (:func:`normed`)."""
    if cfg.residual == "M/t":
        return shardops.all_gather(f"{cfg.residual_spec} -> B/dp L@zigzag/c M", x)
    return x


def normed(cfg: ModelConfig, x: jax.Array, gain: jax.Array) -> jax.Array:
    """RMSNorm of :func:`norm_input`'s ``x`` with the gathered ``gain`` 'M', as
    'B/dp L@zigzag/c M' in compute dtype: the projections need every row. Under
    ``model.residual=L/t`` each device normalizes its own rows (t times less work than on
    gathered rows), then the rows are gathered over t (Megatron's sequence parallelism)."""
    n = rms_norm(x, gain, cfg.norm_eps).astype(jnp.dtype(cfg.compute_dtype))
    if cfg.residual == "M/t":
        return n
    return shardops.all_gather(f"{cfg.residual_spec} -> B/dp L@zigzag/c M", n)
