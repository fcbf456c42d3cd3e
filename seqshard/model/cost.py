"""FLOP, parameter and memory accounting for the decoder (seed 004).

**The table** (:func:`step_flops`): every operation of a training step with its FLOPs over
the whole step (global batch, all layers), forward, backward, what the remat policy re-runs
of its forward in the backward pass, and the optimizer update; each row a matmul or
elementwise. The other FLOP figures here are sums of its rows::

    s = step_flops(cfg, batch=8, seq_len=1024)     # remat from cfg.remat
    s['scores'].forward, s['softmax'].backward, s['swiglu'].recompute
    s.sum('forward', 'matmul'), s.total
    s.per_device({'d': 4, 't': 2})                 # each row over its spec's mesh axes
    step_flops(cfg, batch=8, seq_len=1024, causal=True)   # attention's useful half only

Conventions, used by every count here:

* **2 FLOPs per multiply-add** in a matmul: ``[m, n] @ [n, p]`` costs ``2 m n p``.
* **1 FLOP per elementwise add, multiply, divide, compare-and-select, exp, rsqrt,
  sigmoid**, and per element a reduction (sum, max) takes in (seed 004's convention: its
  GELU counts ``tanh`` as 1). XLA's ``cost_analysis`` counts exp, rsqrt and the like apart,
  as ``transcendentals``.
* **Backward = 2 x forward for every matmul**: one matmul for the gradient w.r.t. each
  operand (inputs and weights; for ``q . k^T`` and ``probs . v`` both are activations).
  Elementwise backward counts are each op's analytic gradient (the formulas beside
  :func:`_layer_ops`), seed 004's where it has one (softmax 4 per element, residual adds
  free but for summing the two paths' cotangents). The embedding is a lookup: 0 FLOPs
  forward, a scatter-add of ``M`` per token backward.
* **Attention computed vs useful.** The einsum path computes ``q . k^T``, the mask, the
  softmax and ``probs . v`` over all ``L x L`` (query, key) pairs (the default, and the
  convention of MFU: PaLM appendix B, seqax); a causal mask makes about half of that
  (``L (L+1) / 2`` pairs per row) useful (``causal=True``; packed documents leave less).
  Fused kernels (cudnn, splash) skip most masked blocks, and re-run ``q . k^T`` and the
  softmax in their backward whatever the policy: not counted.
* **Recompute** is asked of the remat policy, per layer operation
  (:meth:`seqshard.model.remat.RematPolicy.recomputes`): its forward FLOPs again, in the backward
  pass. The embedding, final norm, logits and loss run outside the checkpointed layer scan
  and are never recomputed.
* **Model vs hardware FLOPs.** :func:`flops_per_token` is the matmul rows, forward and
  backward, attention computed over all pairs: "model FLOPs", the numerator of MFU, which
  credits no recomputation and no elementwise work. :func:`hardware_flops_per_token` adds
  the matmuls remat re-runs. So model FLOPs per token = 3 x forward = ``6 N + 12 n_layers L
  Q K D`` with ``N`` the matmul weights (all but embed and norms).

Checked (tests/test_flops.py): seed 004's standard layer (MHA, ``d_ff = 4h``, no gate) built
from the table's rows has its closed forms exactly (forward ``24 b s h^2 + 4 b s^2 h``,
backward ``48 b s h^2 + 8 b s^2 h``); and XLA's ``cost_analysis`` of the compiled forward and
train step (per device, the scanned layer counted once: :meth:`StepFlops.per_run`) is 0.5% to
1% above the table's forward and 2% to 3% above its step, all of it elementwise: XLA counts
what runs (autodiff's unfused gradients, producers fused into several consumers counted in
each), the table each operation's analytic minimum.

Per-layer forward matmul FLOPs per token, in the dimension letters of ``shardops``
(M d_model, F d_ff, V vocab, Q q heads per kv head, K kv heads, D head dim, L sequence;
H = Q K query heads): q ``2 M H D``; k, v ``2 M K D`` each; scores and values ``2 L H D``
each; o ``2 H D M``; gate, up, down ``2 M F`` each; and once, the logits ``2 M V``
(:class:`MatmulFlops` sums them into qkv, attn_scores, attn_values, out_proj, ffn, lm_head).

Memory (:func:`memory_per_device`) is an estimate of what lives on one device of a
``d x t`` mesh through a training step: f32 master weights, f32 grads and AdamW's two f32
moments, all fully sharded over ``d*c*t``; the activations each layer saves for the backward
pass under ``cfg.remat``; and the f32 logits.

What ``cfg.remat`` recomputes and keeps is the policy's to say (:mod:`seqshard.model.remat`):

    policy = remat_policy(cfg.remat)
    policy.recomputes('softmax')                                               # per layer op
    policy.saved_bytes(layer_bytes(cfg, d=d, t=t, batch=batch, seq_len=seq_len))  # per layer

Parameter counts are read off the weight types (:mod:`seqshard.model.weights`), not a formula.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

import jax

from seqshard.model.remat import remat_policy
from seqshard.shardlib.notation import parse_op, parse_shape

if TYPE_CHECKING:  # only its fields are read; importing seqshard.model.cost stays light
    from seqshard.model.config import ModelConfig

__all__ = [
    "OPTIMIZER_FLOPS_PER_PARAM",
    "FlopsPerToken",
    "LayerBytes",
    "MatmulFlops",
    "MemoryEstimate",
    "OpFlops",
    "OpKind",
    "PHASES",
    "Phase",
    "StepFlops",
    "flops_per_token",
    "format_bytes",
    "format_table",
    "hardware_flops_per_token",
    "layer_bytes",
    "matmul_flops_per_token",
    "memory_per_device",
    "mfu",
    "param_bytes",
    "param_count",
    "step_flops",
]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


# ---------------------------------------------------------------------------------------------
# FLOPs: the table of operations

OpKind = Literal["matmul", "elementwise"]
Phase = Literal["forward", "backward", "recompute", "update", "total"]
PHASES: tuple[Phase, ...] = ("forward", "backward", "recompute", "update")
"""The phases of a step an operation's FLOPs are split into (``total`` sums them)."""

OPTIMIZER_FLOPS_PER_PARAM = 25
"""Elementwise FLOPs per parameter of the update ``seqshard.train`` runs after the backward
pass: the mean gradient (divide by the positions counted: 1); the global norm (square and
sum: 2; the ``grad_norm`` metric is the same norm); clipping (scale and select: 2); AdamW's
moments (``b1 mu + (1 - b1) g``: 3; ``b2 nu + (1 - b2) g^2``: 4), their bias corrections (2),
``mu / (sqrt(nu + eps_root) + eps)`` (4), weight decay (2) and the learning rate (1); the add
to the weight (1); and the non-finite guard's select of the new or old weight and moments
(3). With microbatches, each one's gradient is also added into the accumulator (1 each)."""


@dataclasses.dataclass(frozen=True)
class OpFlops:
    """One operation of a training step: its FLOPs summed over the step (all its runs, the
    whole global batch), by phase. ``spec`` is what it computes on, per device, in the
    notation: the mesh axes there split its work (:meth:`per_device`)."""

    name: str  # 'q', 'scores', 'softmax', ...
    kind: OpKind
    spec: str  # e.g. 'B/d L M, M F/t -> B/d L F/t' or 'B/d L M'
    runs: int  # times one pass over the batch runs it: n_layers for a layer's operations, else 1
    in_layer: bool  # one of the scanned layer's operations
    per: str  # its FLOPs scale with: 'token', 'pair' (query, key, head), 'parameter'
    forward: int = 0
    backward: int = 0
    recompute: int = 0  # forward FLOPs the remat policy re-runs in the backward pass
    update: int = 0  # the optimizer step

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.recompute + self.update

    @property
    def split_axes(self) -> tuple[str, ...]:
        """The mesh axes that divide this operation's work: every axis its spec names."""
        if "->" in self.spec:
            op = parse_op(self.spec)
            shapes = (*op.inputs, op.output)
        else:
            shapes = (parse_shape(self.spec),)
        return tuple(dict.fromkeys(a for s in shapes for a in s.split_axes))

    def per_device(self, mesh_sizes: Mapping[str, int]) -> OpFlops:
        """This operation's FLOPs on one device: each phase divided by the sizes of
        :attr:`split_axes` (an axis missing from ``mesh_sizes`` has size 1). Work on a
        dimension not split over an axis is repeated on every device along it: the norms of
        the gathered ``'B/d L M'`` residual run whole on each t shard."""
        n = math.prod(mesh_sizes.get(a, 1) for a in self.split_axes)
        return self._scaled(n, f"over the mesh {dict(mesh_sizes)}")

    def per_run(self) -> OpFlops:
        """One of its :attr:`runs` (one layer's share, for a layer's operation)."""
        return dataclasses.replace(self._scaled(self.runs, f"over its {self.runs} runs"), runs=1)

    def _scaled(self, n: int, what: str) -> OpFlops:
        values = {p: getattr(self, p) for p in PHASES}
        bad = {p: v for p, v in values.items() if v % n}
        if bad:
            raise ValueError(
                f"{self.name} ({self.spec}): {bad} FLOPs do not split evenly {what} ({n} "
                f"parts). Use a batch, and model sizes, that the mesh divides."
            )
        return dataclasses.replace(self, **{p: v // n for p, v in values.items()})


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """The operations of one training step and their FLOPs (:func:`step_flops`)."""

    ops: tuple[OpFlops, ...]
    batch: int
    seq_len: int
    causal: bool  # attention counted over the causal half of the (query, key) pairs only

    def __getitem__(self, name: str) -> OpFlops:
        for op in self.ops:
            if op.name == name:
                return op
        raise KeyError(f"no operation {name!r}; the table has {[o.name for o in self.ops]}.")

    def sum(
        self,
        phase: Phase = "total",
        kind: OpKind | None = None,
        names: Collection[str] | None = None,
    ) -> int:
        """FLOPs of ``phase`` (``'total'``: all four) over the rows of ``kind`` (or both kinds)
        and, when given, of those ``names``: ``s.sum('forward', 'matmul', {'q', 'k', 'v'})``."""
        return sum(
            getattr(op, phase)
            for op in self.ops
            if (kind is None or op.kind == kind) and (names is None or op.name in names)
        )

    @property
    def total(self) -> int:
        return self.sum()

    def per_device(self, mesh_sizes: Mapping[str, int]) -> StepFlops:
        """Each row on one device of a mesh of these axis sizes (:meth:`OpFlops.per_device`)."""
        return dataclasses.replace(self, ops=tuple(op.per_device(mesh_sizes) for op in self.ops))

    def per_run(self) -> StepFlops:
        """Each row's one run: one layer, and everything outside the layers once. XLA's
        ``cost_analysis`` counts a while loop's body once, however many times it runs, so
        this is what it reports for a step whose layers run in ``lax.scan``."""
        return dataclasses.replace(self, ops=tuple(op.per_run() for op in self.ops))


_TOKEN, _PAIR, _PARAM = "token", "pair", "parameter"


@dataclasses.dataclass(frozen=True)
class _Formula:
    """An operation's FLOPs per unit: per token, per (query, key, head) triple of attention,
    or per parameter."""

    name: str
    kind: OpKind
    per: str
    forward: int
    backward: int
    spec: str
    update: int = 0


def _matmul(name: str, per: str, forward: int, spec: str) -> _Formula:
    """A matmul: its backward is one matmul per operand, each the forward's size."""
    return _Formula(name, "matmul", per, forward, 2 * forward, spec)


def _elementwise(name: str, per: str, forward: int, backward: int, spec: str) -> _Formula:
    return _Formula(name, "elementwise", per, forward, backward, spec)


def _norm(cfg: ModelConfig, name: str, consumers: int) -> _Formula:
    """RMSNorm of the gathered residual, ``x / rms(x) * gain`` over M, in f32.

    Forward: x*x, their sum, / M, + eps, rsqrt, x * r, * gain: ``4 M + 3``. Backward, seed
    004's fused LayerNorm form for RMS: the gain's gradient ``sum(dy * xhat)`` over the
    tokens (2 M); ``v = dy * gain``, ``sum(v * xhat)``, ``r * (v - xhat * s / M)`` (6 M);
    and, when its output feeds two matmuls, the sum of their cotangents (M)."""
    m = cfg.d_model
    return _elementwise(name, _TOKEN, 4 * m + 3, 8 * m + (consumers - 1) * m, "B/d L M")


def _layer_ops(cfg: ModelConfig) -> tuple[_Formula, ...]:
    """One layer's operations, in the order transformer.py runs them. The names are what
    :meth:`seqshard.model.remat.RematPolicy.recomputes` is asked about."""
    m, f, h, k, dh = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv, cfg.d_head
    return (
        _norm(cfg, "attn_norm", consumers=2),  # feeds the q and the k, v einsums
        _matmul("q", _TOKEN, 2 * m * h * dh, "B/d L M, M Q K/t D -> B/d L Q K/t D"),
        _matmul("k", _TOKEN, 2 * m * k * dh, "B/d L M, M K/t D -> B/d L K/t D"),
        _matmul("v", _TOKEN, 2 * m * k * dh, "B/d L M, M K/t D -> B/d L K/t D"),
        # q and k: each pair (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), 6 per 2 elements;
        # the backward rotates back, the same 6.
        _elementwise("rope", _TOKEN, 3 * (h + k) * dh, 3 * (h + k) * dh, "B/d L Q K/t D"),
        _matmul("scores", _PAIR, 2 * dh, "B/d Lq Q K/t D, B/d Lk K/t D -> B/d Lq Lk Q K/t"),
        # Scale by 1/sqrt(D), select the masked out; the backward does both to the cotangent.
        _elementwise("mask", _PAIR, 2, 2, "B/d Lq Lk Q K/t"),
        # max, subtract, exp, sum, divide; backward p * (g - sum(p * g)): seed 004's 4.
        _elementwise("softmax", _PAIR, 5, 4, "B/d Lq Lk Q K/t"),
        _matmul("values", _PAIR, 2 * dh, "B/d Lq Lk Q K/t, B/d Lk K/t D -> B/d Lq Q K/t D"),
        _matmul("o", _TOKEN, 2 * h * dh * m, "B/d L Q K/t D, M Q K/t D -> B/d L M"),
        # x + out; the backward sums the cotangents of the residual path and the block's.
        _elementwise("attn_residual", _TOKEN, m, m, "B/d L M/t"),
        _norm(cfg, "ffn_norm", consumers=2),  # feeds gate and up
        _matmul("gate", _TOKEN, 2 * m * f, "B/d L M, M F/t -> B/d L F/t"),
        _matmul("up", _TOKEN, 2 * m * f, "B/d L M, M F/t -> B/d L F/t"),
        # s = sigmoid(gate), gate * s, * up. Backward: d up = g * gate * s (1); d gate =
        # g * up * s * (1 + gate * (1 - s)) (6).
        _elementwise("swiglu", _TOKEN, 3 * f, 7 * f, "B/d L F/t"),
        _matmul("down", _TOKEN, 2 * f * m, "B/d L F/t, M F/t -> B/d L M"),
        _elementwise("ffn_residual", _TOKEN, m, m, "B/d L M/t"),
    )


def _outer_ops(cfg: ModelConfig, microbatches: int) -> tuple[tuple[_Formula, ...], ...]:
    """The operations before the layers, and after them."""
    m, v, dh = cfg.d_model, cfg.vocab, cfg.d_head
    update = OPTIMIZER_FLOPS_PER_PARAM + (microbatches if microbatches > 1 else 0)
    before = (
        # A lookup (each t shard selecting the rows of its vocab block is not counted); the
        # backward scatter-adds each token's cotangent into its row.
        _elementwise("embed", _TOKEN, 0, m, "B/d L M"),
        # angle = position * frequency, cos, sin, on D/2. Positions and masks (integer and
        # boolean work, once per step) are not counted.
        _elementwise("rope_tables", _TOKEN, 3 * dh // 2, 0, "B/d L D"),
    )
    after = (
        _norm(cfg, "final_norm", consumers=1),
        _matmul("logits", _TOKEN, 2 * m * v, "B/d L M, V/t M -> B/d L V/t"),
        # logsumexp over the vocabulary: max, subtract, exp, sum (the per-position scalars
        # after it are not counted); backward softmax(logits) - onehot(target): 2 per logit.
        _elementwise("loss", _TOKEN, 4 * v, 2 * v, "B/d L V/t"),
        # Every weight (and its moments) is split over both d and t.
        _Formula("optimizer", "elementwise", _PARAM, 0, 0, "d_model/d d_ff/t", update),
    )
    return before, after


def step_flops(
    cfg: ModelConfig, *, batch: int, seq_len: int, causal: bool = False, microbatches: int = 1
) -> StepFlops:
    """The FLOPs of a training step of ``batch`` rows of ``seq_len`` tokens (all devices), per
    operation: forward, backward, recompute (``cfg.remat``) and update.

    ``causal``: count attention (scores, mask, softmax, values) over the ``L (L+1) / 2``
    (query, key) pairs per row a causal mask keeps, the useful work, instead of all ``L^2``
    the einsum path computes. ``microbatches`` only adds the gradient accumulation's adds."""
    for name, value in (("batch", batch), ("seq_len", seq_len), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return _step_flops(cfg, batch, seq_len, bool(causal), microbatches)


@functools.lru_cache(maxsize=256)
def _step_flops(
    cfg: ModelConfig, batch: int, seq_len: int, causal: bool, microbatches: int
) -> StepFlops:
    policy = remat_policy(cfg.remat)
    pairs_per_row = seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len
    units = {
        _TOKEN: batch * seq_len,
        _PAIR: batch * pairs_per_row * cfg.n_heads,
        _PARAM: param_count(cfg),
    }

    def row(f: _Formula, in_layer: bool) -> OpFlops:
        runs = cfg.n_layers if in_layer else 1
        n = runs * units[f.per]
        return OpFlops(
            name=f.name,
            kind=f.kind,
            spec=f.spec,
            runs=runs,
            in_layer=in_layer,
            per=f.per,
            forward=n * f.forward,
            backward=n * f.backward,
            recompute=n * f.forward if in_layer and policy.recomputes(f.name) else 0,
            update=n * f.update,
        )

    before, after = _outer_ops(cfg, microbatches)
    ops = (
        *(row(f, in_layer=False) for f in before),
        *(row(f, in_layer=True) for f in _layer_ops(cfg)),
        *(row(f, in_layer=False) for f in after),
    )
    return StepFlops(ops=ops, batch=batch, seq_len=seq_len, causal=causal)


# ---------------------------------------------------------------------------------------------
# FLOPs per token: sums of the table's matmul rows


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

    def recomputed(self, recomputes: Callable[[str], bool]) -> int:
        """The per-layer parts whose operations ``recomputes(name)`` says a policy re-runs
        (:meth:`seqshard.model.remat.RematPolicy.recompute_flops`). ``qkv`` lumps q, k and v, so a
        policy must re-run all three or none of them."""
        total = 0
        for flops, names in (
            (self.qkv, ("q", "k", "v")),
            (self.attn_scores, ("scores",)),
            (self.attn_values, ("values",)),
            (self.out_proj, ("o",)),
        ):
            chosen = {recomputes(n) for n in names}
            if len(chosen) > 1:
                raise ValueError(
                    f"MatmulFlops lumps {', '.join(names)} into one part; a policy that "
                    f"re-runs some of them only needs step_flops' per-operation rows."
                )
            total += flops if chosen == {True} else 0
        return total + sum(self.ffn_down for n in ("gate", "up", "down") if recomputes(n))


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


def _one_row(cfg: ModelConfig, seq_len: int) -> StepFlops:
    """The table for one row of ``seq_len`` tokens: each matmul row is ``seq_len`` times its
    FLOPs per token (the attention rows' ``seq_len`` pairs per token included)."""
    _check_seq_len(seq_len)
    return step_flops(cfg, batch=1, seq_len=seq_len)


def matmul_flops_per_token(cfg: ModelConfig, seq_len: int) -> MatmulFlops:
    """Forward FLOPs per token, by part, at sequence length ``seq_len`` (attention unmasked):
    the table's matmul rows, per layer."""
    s = _one_row(cfg, seq_len)

    def per_layer(*names: str) -> int:
        return sum(s[n].forward for n in names) // (cfg.n_layers * seq_len)

    return MatmulFlops(
        qkv=per_layer("q", "k", "v"),
        attn_scores=per_layer("scores"),
        attn_values=per_layer("values"),
        out_proj=per_layer("o"),
        ffn=per_layer("gate", "up", "down"),
        lm_head=s["logits"].forward // seq_len,
        n_layers=cfg.n_layers,
    )


def flops_per_token(cfg: ModelConfig, seq_len: int) -> FlopsPerToken:
    """Model FLOPs per token of a training step: the table's matmul rows, forward and
    backward (= 2 x forward), attention unmasked, no recompute."""
    s = _one_row(cfg, seq_len)
    return FlopsPerToken(
        forward=s.sum("forward", "matmul") // seq_len,
        backward=s.sum("backward", "matmul") // seq_len,
    )


def hardware_flops_per_token(cfg: ModelConfig, seq_len: int) -> FlopsPerToken:
    """:func:`flops_per_token` plus the matmuls ``cfg.remat`` re-runs in the backward pass
    (the table's matmul recompute): 0 for ``none``, ``q . k^T`` for ``saved``, the layer but
    the down projection for ``full`` (each policy's docstring in :mod:`seqshard.model.remat` says
    why). The LM head runs outside the checkpointed layer scan and is never recomputed."""
    s = _one_row(cfg, seq_len)
    recompute = s.sum("recompute", "matmul") // seq_len
    return dataclasses.replace(flops_per_token(cfg, seq_len), recompute=recompute)


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

    weights: int  # f32 master weights, sharded over d*c*t
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
    to choose from (:meth:`seqshard.model.remat.RematPolicy.saved_bytes`).

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
    # With the sequence split over the context axis: allgather's gathered k and v
    # 'b L K/t D' (2 x, in c), or the ring's visiting block; 0 when the axis has size 1.
    context_kv: int = 0


def layer_bytes(
    cfg: ModelConfig, *, d: int, t: int, batch: int, seq_len: int, c: int = 1
) -> LayerBytes:
    """The per-device arrays of one layer on a ``d x c x t`` mesh, global batch ``batch`` of
    ``seq_len`` tokens (raises ValueError if the mesh cannot split the model or the batch).

    With the sequence split over c each device holds ``L/c`` positions of its rows: every
    activation shrinks by c. Its attention: ``allgather`` holds every key and value of the
    row ('b L K/t D' twice, :attr:`LayerBytes.context_kv`) and probabilities 'b L/c L Q K/t'
    (1/c of c = 1's); the ring holds one visiting block of k and v (as large as its own) and
    the scores of one pair of chunks at a time, 'b L/2c L/2c Q K/t' in f32 (1/c^2)."""
    _check_step(cfg, d=d, t=t, batch=batch, seq_len=seq_len, c=c)
    cb = _dtype_bytes(cfg.compute_dtype)
    b, L, Lc = batch // d, seq_len, seq_len // c
    m, f, q, k_t, dh = cfg.d_model, cfg.d_ff, cfg.n_q_per_kv, cfg.n_kv // t, cfg.d_head
    ring = cfg.ring_over(c)

    # Elements of one per-device activation of each shape.
    x_el = b * Lc * (m // t)  # 'b L/c M/t' (or 'b L/c/t M': the same size)
    q_el = b * Lc * q * k_t * dh  # 'b L/c Q K/t D'
    kv_el = b * Lc * k_t * dh  # 'b L/c K/t D'
    ff_el = b * Lc * (f // t)  # 'b L/c F/t'
    if ring:
        probs = 4 * b * (Lc // 2) ** 2 * q * k_t  # one chunk pair's f32 scores
        context_kv = cb * 2 * kv_el  # the visiting k and v block
    else:
        probs = (4 + (cb if cb != 4 else 0)) * b * Lc * L * q * k_t
        context_kv = cb * 2 * b * L * k_t * dh if c > 1 else 0  # gathered over c
    return LayerBytes(
        x=cb * x_el,
        q=cb * q_el,
        k=cb * kv_el,
        v=cb * kv_el,
        attn=cb * q_el,
        h=cb * x_el,
        gate=cb * ff_el,
        up=cb * ff_el,
        weights=cb * (2 * m * q * k_t * dh + 2 * m * k_t * dh + 3 * m * (f // t)) + 4 * 2 * m,
        block_inputs=cb * 4 * b * Lc * m,
        q_k_before_rope=cb * (q_el + kv_el),
        probs=probs,
        swiglu=cb * 2 * ff_el,
        context_kv=context_kv,
    )


def memory_per_device(
    cfg: ModelConfig, *, d: int, t: int, batch: int, seq_len: int, c: int = 1
) -> MemoryEstimate:
    """Estimate per-device memory on a ``d x c x t`` mesh for global batch ``batch`` of
    ``seq_len`` (c splits the sequence, and the weights as d does).

    Weights, grads and AdamW moments are f32 and fully sharded: ``param_bytes / (d*c*t)`` each
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
        layer_bytes(cfg, d=d, t=t, batch=batch, seq_len=seq_len, c=c)
    )
    weights = -(-param_bytes(cfg) // (d * c * t))  # ceil: exact whenever check_mesh passes
    return MemoryEstimate(
        weights=weights,
        grads=weights,
        optimizer=2 * weights,
        activations_per_layer=per_layer,
        activations=cfg.n_layers * per_layer,
        logits=4 * (batch // d) * (seq_len // c) * (cfg.vocab // t),
    )


def _check_step(cfg: ModelConfig, *, d: int, t: int, batch: int, seq_len: int, c: int = 1) -> None:
    for name, value in (("d", d), ("c", c), ("t", t), ("batch", batch), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    cfg.check_mesh({"d": d, "c": c, "t": t})
    if c > 1 and seq_len % (2 * c):
        raise ValueError(
            f"seq_len={seq_len} is not divisible by 2c = {2 * c} (the zigzag layout over c "
            f"cuts each row into 2c chunks). Choose a seq_len divisible by {2 * c}."
        )
    if batch % d:
        raise ValueError(
            f"batch={batch} is not divisible by mesh axis d={d} (the batch "
            f"is split 'B/d'). Choose a batch divisible by {d}."
        )


def format_table(
    rows: Sequence[Sequence[str]], header: Sequence[str], right: Collection[int] = ()
) -> str:
    """A text table: columns padded to their widest cell, two spaces apart, a dashed line under
    the header; the columns numbered in ``right`` (numbers) aligned right, the others left."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        cells = (
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        return "  ".join(cells).rstrip()

    lines = [line(r) for r in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
