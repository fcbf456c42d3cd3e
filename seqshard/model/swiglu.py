"""The SwiGLU feed-forward block: pre-norm, gate and up projections, ``silu(gate) * up``, the
down projection and the residual add. Its weights, activations and operations are declared
once here (:data:`SWIGLU`, :class:`SwigluWeights`); its math is :func:`ffn`, written through an
:class:`~seqshard.model.block.Activations` recorder.

Per device, forward:

    all_gather over t,d,c  ln2                        (the norm gain)
    all_gather over t      the residual, around the norm
    all_gather over d,c    w_gate, w_up, w_down (model.fp8: their e4m3 bits, after a pmax of
                           each one's amax over d, c, t)
    pmax over d,c(,t)      model.fp8: the amax of nh, y; in the backward, of each cotangent
    psum_scatter over t    the down projection (it contracts F/t)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from seqshard.model.block import (
    Activation,
    Activations,
    Block,
    LayerInputs,
    elementwise,
    gain,
    matmul,
    weight,
)
from seqshard.model.config import ModelConfig
from seqshard.model.fp8_scaling import Fp8Sites, Scaling, delayed, history_weight
from seqshard.model.grads import normed_projections_backward, output_projection_backward
from seqshard.model.norm import norm_input, norm_op, normed
from seqshard.shardlib import fp8, shardops
from seqshard.shardlib.shardtypes import f32, pytree_dataclass

__all__ = ["SWIGLU", "SwigluWeights", "ffn", "swiglu_backward"]

_LAYER = "model.layers.{i}."
_IN, _OUT = ("d_model", "d_ff"), ("d_ff", "d_model")  # gate and up's map; down's


def _fan_in(cfg: ModelConfig) -> float:
    return 1 / math.sqrt(cfg.d_model)


def _w_down_std(cfg: ModelConfig) -> float:
    """Each residual-stream contribution at unit scale, the stream growing like sqrt(layers)."""
    return 1 / math.sqrt(cfg.d_ff) / math.sqrt(2 * cfg.n_layers)


@pytree_dataclass
class SwigluWeights:
    """The SwiGLU block's weights (one layer's)."""

    ln2: f32["d_model/t/fsdp"] = gain(_LAYER + "post_attention_layernorm.weight")
    w_gate: f32["d_model/fsdp d_ff/t"] = weight(
        _fan_in, hf=_LAYER + "mlp.gate_proj.weight", layout="d_ff d_model", matrix=_IN
    )
    w_up: f32["d_model/fsdp d_ff/t"] = weight(
        _fan_in, hf=_LAYER + "mlp.up_proj.weight", layout="d_ff d_model", matrix=_IN
    )
    w_down: f32["d_model/fsdp d_ff/t"] = weight(
        _w_down_std, hf=_LAYER + "mlp.down_proj.weight", layout="d_model d_ff", matrix=_OUT
    )
    # model.fp8=delayed: each FP8 site's amaxes of past steps (seqshard.model.fp8_scaling).
    swiglu_fp8_history: f32["5 fp8_history"] = history_weight()


FP8 = Fp8Sites("swiglu", ("nh", "w_gate", "w_up", "y", "w_down"), "swiglu_fp8_history")
"""The tensors the block puts on e4m3's grid with model.fp8 (seqshard.model.fp8_scaling)."""


_R = "B/dp L/c M/t"
_ROWS = "B/dp L@zigzag/c"
_SAVED_FULL = frozenset({"saved", "full"})
_FULL = frozenset({"full"})


def ffn(cfg: ModelConfig, w, a: Activations, sc: Scaling | None = None) -> jax.Array | None:
    """The pre-norm SwiGLU FFN plus the residual ``h``: a residual in compute dtype (None when
    ``a`` rebuilds a layer for its backward, which never reads it). ``sc``: the block's FP8
    scaling."""
    dt = jnp.dtype(cfg.compute_dtype)
    sc = sc or FP8.scaling(cfg, w)
    h = a["h"]
    ln2 = a("ln2", lambda: shardops.all_gather("M/t/fsdp -> M", w.ln2))
    gh = a("gh", lambda: norm_input(cfg, h))
    # model.fp8: the projections' operands on e4m3's grid, their outputs' cotangents on e5m2's
    # (seqshard.shardlib.fp8; each a no-op with fp8=none).
    nh = a("nh", lambda: sc.quantized("nh", f"{_ROWS} M", normed(cfg, gh, ln2)))

    # FSDP: each matrix is gathered over d and c just before use (in e4m3 with model.fp8).
    def gathered(name: str):
        return sc.gathered(name, "M/fsdp F/t -> M F/t", getattr(w, name), dt)

    def projected(x: jax.Array, w_x: jax.Array) -> jax.Array:
        y = shardops.einsum_unreduced(f"{_ROWS} M, M F/t -> {_ROWS} F/t", x, w_x)
        return fp8.gradient_quantized(cfg.fp8, f"{_ROWS} F/t", y)

    w_gate = a("w_gate", lambda: gathered("w_gate"))
    gate = a("gate", lambda: projected(nh, w_gate))
    w_up = a("w_up", lambda: gathered("w_up"))
    up = a("up", lambda: projected(nh, w_up))
    y = a("y", lambda: sc.quantized("y", f"{_ROWS} F/t", jax.nn.silu(gate) * up))
    w_down = a("w_down", lambda: gathered("w_down"))

    def down() -> jax.Array:
        out = shardops.einsum_unreduced(f"{_ROWS} F/t, M F/t -> {_ROWS} M", y, w_down)
        out = fp8.gradient_quantized(cfg.fp8, f"{_ROWS} M", out)
        # Each t shard contracted only its own slice of F (F/t): sum the shards, scattered into
        # the residual's layout.
        return shardops.psum_scatter(f"{_ROWS} M -> {cfg.residual_spec}", out)

    out = a("down", down)
    return a("out", lambda: (h + out).astype(dt))


# The activations of the block's input side (h, norm(h)), its gain and the norm's part.
_FFN_INPUT = ("gh", "nh", "ln2", "ffn_norm")


def swiglu_backward(
    cfg: ModelConfig, inputs: LayerInputs, w, a: Activations, d_out: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The SwiGLU block's backward: dL/dh (a residual) and its weights' gradients (f32, in
    their layouts), from its activations and dL/d(output) ``d_out``."""
    f32 = jnp.float32
    # --- out = h + psum_scatter(swiglu(nh) . w_down) --------------------------------------
    # The forward reduce-scattered the down projection over t; its transpose gathers the
    # gradient over t, so each t shard has all of M against its slice of F.
    d_y, d_w_down = output_projection_backward(cfg, d_out, a["y"], a["w_down"], "F/t", "down")
    gate, up = a["gate"], a["up"]
    # y = silu(gate) * up, silu(z) = z * sigmoid(z)
    sig = jax.nn.sigmoid(gate)
    d_up = d_y * (gate * sig)
    d_gate = d_y * up * (sig * (1 + gate * (1 - sig)))
    d_gh, grads = normed_projections_backward(
        cfg, a, _FFN_INPUT, [("w_gate", "M F/t", d_gate), ("w_up", "M F/t", d_up)], "gate_up"
    )
    history = FP8.no_history_gradient(cfg, w)
    return d_out + d_gh, {**grads, "w_down": d_w_down.astype(f32), **history}


def swiglu_forward(cfg: ModelConfig, inputs: LayerInputs, w, a: Activations) -> jax.Array | None:
    """The block on the residual ``a['h']``: :func:`ffn` (and, with model.fp8=delayed, its
    FP8 sites' amaxes)."""
    sc = FP8.scaling(cfg, w)
    out = ffn(cfg, w, a, sc)
    return (out, sc.aux()) if delayed(cfg) else out


SWIGLU = Block(
    name="swiglu",
    activations=(
        Activation("ln2", "M", "f32", "ffn_norm"),
        Activation("gh", "B/dp L/c M", "compute", "ffn_norm"),  # h with all of M
        Activation("nh", "B/dp L/c M", "compute", "ffn_norm"),  # the normed input of gate, up
        Activation("w_gate", "M F/t", "compute", "gate"),  # gathered over d, c
        Activation("w_up", "M F/t", "compute", "up"),
        Activation("w_down", "M F/t", "compute", "down"),
        Activation("gate", "B/dp L/c F/t", "compute", "gate", saved=True),
        Activation("up", "B/dp L/c F/t", "compute", "up", saved=True),
        Activation("y", "B/dp L/c F/t", "compute", "swiglu"),  # silu(gate) * up
        # The down projection, into the residual: read by no backward.
        Activation("down", _R, "compute", "down", needed=False),
        Activation("out", _R, "compute", "ffn_residual", needed=False),
    ),
    ops=(
        norm_op("ffn_norm", consumers=2, recomputed_by=_SAVED_FULL),  # feeds gate and up
        matmul(
            "gate",
            "token",
            "B/dp L M, M F/t -> B/dp L F/t",
            lambda m: 2 * m.d_model * m.d_ff,
            _FULL,
            fp8=True,
        ),
        matmul(
            "up",
            "token",
            "B/dp L M, M F/t -> B/dp L F/t",
            lambda m: 2 * m.d_model * m.d_ff,
            _FULL,
            fp8=True,
        ),
        # s = sigmoid(gate), gate * s, * up. Backward: d up = g * gate * s (1); d gate =
        # g * up * s * (1 + gate * (1 - s)) (6).
        elementwise(
            "swiglu",
            "token",
            "B/dp L F/t",
            lambda m: 3 * m.d_ff,
            lambda m: 7 * m.d_ff,
            _SAVED_FULL,
        ),
        # Nothing in the backward needs the down projection's output nor the layer's: no
        # policy re-runs them (XLA drops them from remat=full's recomputation too).
        matmul(
            "down",
            "token",
            "B/dp L F/t, M F/t -> B/dp L M",
            lambda m: 2 * m.d_ff * m.d_model,
            fp8=True,
        ),
        elementwise(
            "ffn_residual", "token", "B/dp L M/t", lambda m: m.d_model, lambda m: m.d_model
        ),
    ),
    weights=SwigluWeights,
    forward=swiglu_forward,
    backward=swiglu_backward,
    aux=FP8.aux(),
    fp8_sites=FP8.names,
)
"""The SwiGLU block's declarations: remat=saved keeps the gate and up projections."""
