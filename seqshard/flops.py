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
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only its fields are read; importing seqshard.flops stays light
    from seqshard.model.config import ModelConfig

__all__ = [
    "FlopsPerToken",
    "MatmulFlops",
    "MemoryEstimate",
    "flops_per_token",
    "format_bytes",
    "hardware_flops_per_token",
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

    Per layer, per token, ``recompute`` is:

    * ``none``: 0.
    * ``saved``: ``attn_scores``. q, k, v, the attention output before ``w_o``, the
      post-attention residual and gate/up are saved, so the backward re-runs ``q . k^T``
      (and softmax, RoPE, norms, ``swish(gate) * up``: not matmuls) to get the probabilities
      that the softmax and ``probs . v`` backward need. ``probs . v`` itself is not re-run:
      its output is saved.
    * ``full``: the layer forward except the FFN down projection: ``qkv + attn_scores +
      attn_values + out_proj + 2/3 ffn``. Nothing in the backward pass needs the down
      projection's output (only its input and weight), so JAX / XLA drop it from the
      recomputation (checked against XLA's count in tests/test_flops.py).

    Fused attention kernels (cudnn) recompute ``q . k^T`` in their own backward whatever the
    policy; that is not included. The LM head runs outside the checkpointed layer scan and is
    never recomputed.
    """
    parts = matmul_flops_per_token(cfg, seq_len)
    if cfg.remat == "none":
        per_layer = 0
    elif cfg.remat == "saved":
        per_layer = parts.attn_scores
    elif cfg.remat == "full":
        per_layer = parts.attention + 2 * 2 * cfg.d_model * cfg.d_ff
    else:  # ModelConfig validates remat; keep this loud if a policy is added there.
        raise ValueError(
            f"hardware_flops_per_token: no recompute count for remat={cfg.remat!r}; "
            f"known: 'none', 'saved', 'full'."
        )
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
    """Number of weight elements: embed, unembed, final norm and, per layer, w_q, w_kv, w_o,
    w_gate, w_up, w_down, ln1, ln2."""
    m, v = cfg.d_model, cfg.vocab
    qkd = cfg.n_heads * cfg.d_head
    per_layer = (
        m * qkd  # w_q    'd_model n_q_per_kv n_kv d_head'
        + 2 * m * cfg.n_kv * cfg.d_head  # w_kv   '2 d_model n_kv d_head'
        + m * qkd  # w_o    'd_model n_q_per_kv n_kv d_head'
        + 3 * m * cfg.d_ff  # w_gate, w_up, w_down 'd_model d_ff'
        + 2 * m  # ln1, ln2
    )
    return 2 * v * m + cfg.n_layers * per_layer + m


def param_bytes(cfg: ModelConfig, dtype: str = "float32") -> int:
    """Bytes of all weights in ``dtype`` (the master copy is float32)."""
    return param_count(cfg) * _dtype_bytes(dtype)


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


def memory_per_device(
    cfg: ModelConfig, *, d: int, t: int, batch: int, seq_len: int
) -> MemoryEstimate:
    """Estimate per-device memory on a ``d x t`` mesh for global batch ``batch`` of ``seq_len``.

    Weights, grads and AdamW moments are f32 and fully sharded: ``param_bytes / (d*t)`` each
    (x2 for the moments). Activations are per device with the batch split over d and
    heads / d_ff / d_model over t (b = batch/d, c = bytes of ``cfg.compute_dtype``); per layer:

    * ``full``: the layer input x ``'b L M/t'`` only.
    * ``saved``: x; q ``'b L Q K/t D'``; k and v ``'b L K/t D'`` each; the attention output
      before ``w_o`` ``'b L Q K/t D'``; the post-attention residual h ``'b L M/t'``; gate and
      up ``'b L F/t'`` each. All in c.
    * ``none`` (an upper estimate of what autodiff keeps without remat): everything ``saved``
      keeps, plus the layer's gathered weights (``w_q, w_kv, w_o`` ``'M Q|2 K/t D'``, ``w_gate,
      w_up, w_down`` ``'M F/t'`` in c, ``ln1, ln2`` ``'M'`` f32); the gathered and the
      normalized input of both blocks ``'b L M'`` (4 arrays, c); RoPE'd q and k (c); the
      attention probabilities ``'b L L Q K/t'`` in f32, plus their c copy (the ``probs . v``
      operand) when c is not f32; ``swish(gate)`` and ``swish(gate) * up`` ``'b L F/t'`` (c).

    Plus the logits ``'b L V/t'`` in f32, once. Not included: one layer's transient working
    set while it runs or recomputes (under ``saved``/``full`` that includes its ``'b L L Q K/t'``
    scores on the einsum path, and its gathered weights), gradients in flight, collective
    buffers, XLA temporaries and allocator fragmentation: leave headroom.
    """
    for name, value in (("d", d), ("t", t), ("batch", batch), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"memory_per_device: {name} must be a positive integer, got {value!r}."
            )
    cfg.check_mesh(d, t)
    if batch % d:
        raise ValueError(
            f"memory_per_device: batch={batch} is not divisible by mesh axis d={d} (the batch "
            f"is split 'B/d'). Choose a batch divisible by {d}."
        )
    c = _dtype_bytes(cfg.compute_dtype)
    b, L = batch // d, seq_len
    m, f, q, k_t, dh = cfg.d_model, cfg.d_ff, cfg.n_q_per_kv, cfg.n_kv // t, cfg.d_head

    # Elements of one per-device activation of each shape.
    x_el = b * L * (m // t)  # 'b L M/t'
    q_el = b * L * q * k_t * dh  # 'b L Q K/t D'
    kv_el = b * L * k_t * dh  # 'b L K/t D'
    ff_el = b * L * (f // t)  # 'b L F/t'
    full_m_el = b * L * m  # 'b L M'
    probs_el = b * L * L * q * k_t  # 'b L L Q K/t'

    if cfg.remat == "full":
        per_layer = c * x_el
    else:
        # x, q, k, v, attention output, h, gate, up: what the layer marks save_for_backward.
        per_layer = c * (2 * x_el + 2 * q_el + 2 * kv_el + 2 * ff_el)
        if cfg.remat == "none":
            gathered = c * (2 * m * q * k_t * dh + 2 * m * k_t * dh + 3 * m * (f // t)) + 4 * 2 * m
            inputs = c * 4 * full_m_el  # gathered x and normed x, for attention and FFN
            roped = c * (q_el + kv_el)
            probs = (4 + (c if c != 4 else 0)) * probs_el
            swiglu = c * 2 * ff_el
            per_layer += gathered + inputs + roped + probs + swiglu
        elif cfg.remat != "saved":
            raise ValueError(
                f"memory_per_device: no activation estimate for remat={cfg.remat!r}; "
                f"known: 'none', 'saved', 'full'."
            )

    weights = -(-param_bytes(cfg) // (d * t))  # ceil: exact whenever check_mesh passes
    return MemoryEstimate(
        weights=weights,
        grads=weights,
        optimizer=2 * weights,
        activations_per_layer=per_layer,
        activations=cfg.n_layers * per_layer,
        logits=4 * b * L * (cfg.vocab // t),
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
