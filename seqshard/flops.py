"""FLOP, parameter and memory accounting for the decoder (seed 004).

Conventions, used by every count here:

* **2 FLOPs per multiply-add.** A matmul ``[m, n] @ [n, p]`` costs ``2 m n p``.
* **Matmuls only.** RMSNorm, softmax, RoPE, SwiGLU's ``swish(gate) * up``, residual adds,
  masking and the loss are excluded (seed 004 counts them too; they are ``O(L M)`` per layer
  and token-wise cheap next to the ``O(M^2)`` matmuls). The embedding is a lookup: 0 FLOPs,
  forward and backward. The unembedding (LM head, ``M -> V``) is a matmul and is counted.
* **Attention is counted unmasked**: ``q . k^T`` and ``probs . v`` over all ``L x L``
  (query, key) pairs, the usual convention (PaLM appendix B, seqax). It is what the einsum
  path computes; a causal / document-masked fused kernel skips up to about half of it.
* **Backward = 2 x forward** for every matmul: one matmul for the gradient w.r.t. each
  operand (inputs and weights; for ``q . k^T`` and ``probs . v`` both operands are
  activations). So model FLOPs per token = 3 x forward = ``6 N + 12 n_layers L Q K D``
  with ``N`` the matmul weights (all but embed and norms).
* **Model vs hardware FLOPs.** :func:`flops_per_token` counts what the model needs
  ("model FLOPs", the numerator of MFU): recomputation from activation checkpointing is NOT
  counted. :func:`hardware_flops_per_token` adds the matmuls that ``cfg.remat`` re-runs in
  the backward pass (see there for exactly which).

Per-token forward FLOPs of one layer, in the dimension letters of ``shardops``
(M d_model, F d_ff, V vocab, Q q heads per kv head, K kv heads, D head dim, L sequence)::

    qkv          2 M (Q K + 2 K) D      'B L M, M Q K D -> B L Q K D' and the same for k, v
    attn_scores  2 L Q K D              'B Lq Q K D, B Lk K D -> B Lq Lk Q K'
    attn_values  2 L Q K D              'B Lq Lk Q K, B Lk K D -> B Lq Q K D'
    out_proj     2 Q K D M              'B L Q K D, M Q K D -> B L M'
    ffn          6 M F                  gate, up 'B L M, M F -> B L F'; down 'B L F, M F -> B L M'
    lm_head      2 M V                  once, after the last layer

Memory (:func:`memory_per_device`) is an estimate of what lives on one device of a
``d x t`` mesh through a training step: f32 master weights, f32 grads and AdamW's two f32
moments, all fully sharded over ``d*t``; the activations each layer saves for the backward
pass under ``cfg.remat``; and the f32 logits.

What ``cfg.remat`` recomputes and keeps is the policy's to say (:mod:`seqshard.remat`):

    policy = remat_policy(cfg.remat)
    policy.recompute_flops(matmul_flops_per_token(cfg, seq_len))               # per layer
    policy.saved_bytes(layer_bytes(cfg, d=d, t=t, batch=batch, seq_len=seq_len))  # per layer

Parameter counts are read off the weight types (:mod:`seqshard.model.weights`), not a formula.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax

from seqshard.remat import remat_policy

if TYPE_CHECKING:  # only its fields are read; importing seqshard.flops stays light
    from seqshard.model.config import ModelConfig

__all__ = [
    "FlopsPerToken",
    "LayerBytes",
    "MatmulFlops",
    "MemoryEstimate",
    "flops_per_token",
    "format_bytes",
    "hardware_flops_per_token",
    "layer_bytes",
    "matmul_flops_per_token",
    "memory_per_device",
    "mfu",
    "param_bytes",
    "param_count",
]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


# ---------------------------------------------------------------------------------------------
# FLOPs


@dataclasses.dataclass(frozen=True)
class MatmulFlops:
    """Forward matmul FLOPs per token: the per-layer parts, and the LM head (once)."""

    qkv: int  # per layer: q = nx . w_q and k, v = nx . w_kv
    attn_scores: int  # per layer: q . k^T over all L keys (unmasked)
    attn_values: int  # per layer: probs . v over all L keys (unmasked)
    out_proj: int  # per layer: attention output . w_o
    ffn: int  # per layer: gate, up and down projections (SwiGLU)
    lm_head: int  # once: final normed x . unembed
    n_layers: int

    @property
    def attention(self) -> int:
        """Per layer: qkv + scores + values + output projection."""
        return self.qkv + self.attn_scores + self.attn_values + self.out_proj

    @property
    def ffn_down(self) -> int:
        """Per layer: the down projection, one of SwiGLU's three equal ``2 M F`` matmuls."""
        return self.ffn // 3

    @property
    def layer(self) -> int:
        """Per layer: attention + FFN."""
        return self.attention + self.ffn

    @property
    def total(self) -> int:
        """All layers plus the LM head: the forward FLOPs per token."""
        return self.n_layers * self.layer + self.lm_head


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
    """FLOPs per token of one training step; ``recompute`` is 0 for model FLOPs."""

    forward: int
    backward: int
    recompute: int = 0

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.recompute


def _check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}.")


def matmul_flops_per_token(cfg: ModelConfig, seq_len: int) -> MatmulFlops:
    """Forward FLOPs per token, by part, at sequence length ``seq_len`` (attention unmasked)."""
    _check_seq_len(seq_len)
    m, f, v = cfg.d_model, cfg.d_ff, cfg.vocab
    n_heads, k, d = cfg.n_heads, cfg.n_kv, cfg.d_head
    return MatmulFlops(
        qkv=2 * m * (n_heads + 2 * k) * d,
        # Each query meets all seq_len keys: the unmasked count.
        attn_scores=2 * seq_len * n_heads * d,
        attn_values=2 * seq_len * n_heads * d,
        out_proj=2 * n_heads * d * m,
        ffn=3 * 2 * m * f,
        lm_head=2 * m * v,
        n_layers=cfg.n_layers,
    )


def flops_per_token(cfg: ModelConfig, seq_len: int) -> FlopsPerToken:
    """Model FLOPs per token of a training step: forward, backward = 2 x forward, no remat."""
    forward = matmul_flops_per_token(cfg, seq_len).total
    return FlopsPerToken(forward=forward, backward=2 * forward)


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int) -> FlopsPerToken:
    """:func:`flops_per_token` plus the matmuls ``cfg.remat`` re-runs in the backward pass.

    ``recompute`` is ``n_layers`` times the policy's
    :meth:`~seqshard.remat.RematPolicy.recompute_flops` per layer: 0 for ``none``,
    ``attn_scores`` for ``saved``, the layer but ``ffn_down`` for ``full`` (each policy's
    docstring in :mod:`seqshard.remat` says why). The LM head runs outside the checkpointed
    layer scan and is never recomputed.
    """
    per_layer = remat_policy(cfg.remat).recompute_flops(matmul_flops_per_token(cfg, seq_len))
    model = flops_per_token(cfg, seq_len)
    return dataclasses.replace(model, recompute=cfg.n_layers * per_layer)


def mfu(tokens_per_s: float, cfg: ModelConfig, peak_flops: float, *, seq_len: int) -> float:
    """Model FLOPs utilization: ``tokens_per_s * flops_per_token(cfg, seq_len).total / peak_flops``.

    ``tokens_per_s`` and ``peak_flops`` must describe the same devices: the whole job's
    throughput with the sum of its chips' peaks, or one device's share with one chip's peak
    (e.g. 989e12 for an H100 SXM's dense bf16). Recompute is not credited (model FLOPs).
    """
    if not peak_flops > 0:
        raise ValueError(f"mfu: peak_flops must be positive, got {peak_flops!r}.")
    if not tokens_per_s >= 0:
        raise ValueError(f"mfu: tokens_per_s must be >= 0, got {tokens_per_s!r}.")
    return tokens_per_s * flops_per_token(cfg, seq_len).total / peak_flops


# ---------------------------------------------------------------------------------------------
# Parameters


def param_count(cfg: ModelConfig) -> int:
    """Number of weight elements, read off the weight types (:class:`seqshard.model.Weights`):
    embed, unembed, final norm and, per layer, w_q, w_kv, w_o, w_gate, w_up, w_down, ln1, ln2."""
    return sum(math.prod(s.shape) for s in _weight_structs(cfg))


def param_bytes(cfg: ModelConfig, dtype: str | None = None) -> int:
    """Bytes of all weights: in their declared dtypes (the f32 master copy) by default, or
    all in ``dtype`` (``'float32'``, ``'bfloat16'``)."""
    if dtype is not None:
        return param_count(cfg) * _dtype_bytes(dtype)
    return sum(math.prod(s.shape) * s.dtype.itemsize for s in _weight_structs(cfg))


def _weight_structs(cfg: ModelConfig) -> list[jax.ShapeDtypeStruct]:
    """Every weight's global ``jax.ShapeDtypeStruct``, from the types."""
    # Imported here: seqshard.model loads the whole model (attention, generation, data).
    from seqshard.model.weights import weight_structs

    return jax.tree.leaves(weight_structs(cfg))


def _dtype_bytes(dtype: str) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPE_BYTES)}.")
    return _DTYPE_BYTES[dtype]


# ---------------------------------------------------------------------------------------------
# Memory


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one device through a training step (see :func:`memory_per_device`)."""

    weights: int  # f32 master weights, sharded over d*t
    grads: int  # f32 gradients, sharded like the weights
    optimizer: int  # AdamW: two f32 moments, sharded like the weights
    activations_per_layer: int  # saved for the backward pass, one layer
    activations: int  # n_layers * activations_per_layer
    logits: int  # f32 'B/d L V/t', once

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits

    def summary(self) -> str:
        parts = ("weights", "grads", "optimizer", "activations", "logits")
        body = ", ".join(f"{p} {format_bytes(getattr(self, p))}" for p in parts)
        return f"{format_bytes(self.total)} per device ({body})"


@dataclasses.dataclass(frozen=True)
class LayerBytes:
    """Bytes on one device of each array one layer's forward pass makes, for a remat policy
    to choose from (:meth:`seqshard.remat.RematPolicy.saved_bytes`).

    Per device: the batch split over d (b = batch/d rows), heads / d_ff / d_model over t;
    c = bytes of ``cfg.compute_dtype``. See :func:`layer_bytes`."""

    # What the layer marks with save_for_backward, and its input; all in c.
    x: int  # the layer input 'b L M/t'
    q: int  # after RoPE 'b L Q K/t D'
    k: int  # after RoPE 'b L K/t D'
    v: int  # 'b L K/t D'
    attn: int  # the attention output before w_o 'b L Q K/t D'
    h: int  # the post-attention residual 'b L M/t'
    gate: int  # 'b L F/t'
    up: int  # 'b L F/t'
    # Unmarked: an upper estimate of what autodiff keeps of the rest without remat.
    # The gathered w_q, w_kv, w_o 'M Q|2 K/t D' and w_gate, w_up, w_down 'M F/t' in c;
    # ln1, ln2 'M' in f32.
    weights: int
    block_inputs: int  # gathered and normalized input of both blocks: 4 x 'b L M' in c
    q_k_before_rope: int  # 'b L Q K/t D' + 'b L K/t D' in c
    probs: int  # 'b L L Q K/t' in f32, plus its c copy (the probs . v operand) when c is not f32
    swiglu: int  # swish(gate) and swish(gate) * up: 2 x 'b L F/t' in c


def layer_bytes(cfg: ModelConfig, *, d: int, t: int, batch: int, seq_len: int) -> LayerBytes:
    """The per-device arrays of one layer on a ``d x t`` mesh, global batch ``batch`` of
    ``seq_len`` tokens (raises ValueError if the mesh cannot split the model or the batch)."""
    _check_step(cfg, d=d, t=t, batch=batch, seq_len=seq_len)
    c = _dtype_bytes(cfg.compute_dtype)
    b, L = batch // d, seq_len
    m, f, q, k_t, dh = cfg.d_model, cfg.d_ff, cfg.n_q_per_kv, cfg.n_kv // t, cfg.d_head

    # Elements of one per-device activation of each shape.
    x_el = b * L * (m // t)  # 'b L M/t'
    q_el = b * L * q * k_t * dh  # 'b L Q K/t D'
    kv_el = b * L * k_t * dh  # 'b L K/t D'
    ff_el = b * L * (f // t)  # 'b L F/t'
    probs_el = b * L * L * q * k_t  # 'b L L Q K/t'
    return LayerBytes(
        x=c * x_el,
        q=c * q_el,
        k=c * kv_el,
        v=c * kv_el,
        attn=c * q_el,
        h=c * x_el,
        gate=c * ff_el,
        up=c * ff_el,
        weights=c * (2 * m * q * k_t * dh + 2 * m * k_t * dh + 3 * m * (f // t)) + 4 * 2 * m,
        block_inputs=c * 4 * b * L * m,
        q_k_before_rope=c * (q_el + kv_el),
        probs=(4 + (c if c != 4 else 0)) * probs_el,
        swiglu=c * 2 * ff_el,
    )


def memory_per_device(
    cfg: ModelConfig, *, d: int, t: int, batch: int, seq_len: int
) -> MemoryEstimate:
    """Estimate per-device memory on a ``d x t`` mesh for global batch ``batch`` of ``seq_len``.

    Weights, grads and AdamW moments are f32 and fully sharded: ``param_bytes / (d*t)`` each
    (x2 for the moments). Activations per layer are what the remat policy keeps of the
    layer's arrays (:func:`layer_bytes`; b = batch/d, c = bytes of ``cfg.compute_dtype``):

    * ``full``: the layer input x ``'b L M/t'`` only.
    * ``saved``: x and the marked q, k, v, attention output, h, gate and up, all in c.
    * ``none``: everything ``saved`` keeps, plus the gathered weights, the blocks' normalized
      inputs, the f32 attention probabilities ``'b L L Q K/t'`` and the SwiGLU products
      (see :class:`LayerBytes`).

    Plus the logits ``'b L V/t'`` in f32, once. Not included: one layer's transient working
    set while it runs or recomputes (under ``saved``/``full`` that includes its ``'b L L Q K/t'``
    scores on the einsum path, and its gathered weights), gradients in flight, collective
    buffers, XLA temporaries and allocator fragmentation: leave headroom.
    """
    per_layer = remat_policy(cfg.remat).saved_bytes(
        layer_bytes(cfg, d=d, t=t, batch=batch, seq_len=seq_len)
    )
    weights = -(-param_bytes(cfg) // (d * t))  # ceil: exact whenever check_mesh passes
    return MemoryEstimate(
        weights=weights,
        grads=weights,
        optimizer=2 * weights,
        activations_per_layer=per_layer,
        activations=cfg.n_layers * per_layer,
        logits=4 * (batch // d) * seq_len * (cfg.vocab // t),
    )


def _check_step(cfg: ModelConfig, *, d: int, t: int, batch: int, seq_len: int) -> None:
    for name, value in (("d", d), ("t", t), ("batch", batch), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    cfg.check_mesh({"d": d, "t": t})
    if batch % d:
        raise ValueError(
            f"batch={batch} is not divisible by mesh axis d={d} (the batch "
            f"is split 'B/d'). Choose a batch divisible by {d}."
        )


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``: binary units, two decimals; ``'512 B'`` below 1 KiB."""
    if n < 0:
        return "-" + format_bytes(-n)
    if n < 1024:
        return f"{int(n)} B"
    units = ("KiB", "MiB", "GiB", "TiB", "PiB")
    i = 0
    n /= 1024
    while n >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.2f} {units[i]}"
