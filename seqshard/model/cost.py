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
  Fused kernels (cudnn, splash, pallas) skip most masked blocks, and re-run ``q . k^T`` and the
  softmax in their backward whatever the policy: not counted.
* **Recompute** is asked of the remat policy, per layer operation
  (each operation's declared ``recomputed_by``, :func:`recomputes`): its forward FLOPs again, in the backward
  pass. The embedding, final norm, logits and loss run outside the checkpointed layer scan
  and are never recomputed.
* **Model vs hardware FLOPs.** :func:`flops_per_token` is the matmul rows, forward and
  backward, attention computed over all pairs: "model FLOPs", the numerator of MFU, which
  credits no recomputation and no elementwise work. :func:`hardware_flops_per_token` adds
  the matmuls remat re-runs. So model FLOPs per token = 3 x forward = ``6 N + 12 n_layers L
  Q K D`` with ``N`` the matmul weights (all but embed and norms).

Checked (tests/model/test_cost.py): seed 004's standard layer (MHA, ``d_ff = 4h``, no gate) built
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
``d x e x c x t`` mesh through a training step: f32 master weights, f32 grads and AdamW's two
f32 moments, all fully sharded over ``d*e*c*t``; the activations each layer saves for the backward
pass under ``cfg.remat``; and the f32 logits.

What ``cfg.remat`` recomputes and keeps is declared with the blocks (:mod:`seqshard.model.block`):

    recomputes(cfg.remat, 'softmax')                                           # per layer op
    saved_bytes(cfg, layer_bytes(cfg, d=d, t=t, batch=batch, seq_len=seq_len))  # per layer

Parameter counts are read off the weight types (:mod:`seqshard.model.weights`), not a formula.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Mapping
from typing import Literal

import jax
import numpy as np

from seqshard.model.block import Block, Op, activation_bytes, kept, recomputed
from seqshard.model.config import DTYPE_BYTES, ModelConfig
from seqshard.model.layers import known_blocks, mtp_stack, stacks
from seqshard.model.matrices import matrix_stacks, newton_schulz_flops
from seqshard.model.transformer import EMBED, HEAD
from seqshard.model.weights import (
    check_mesh,
    param_count,
    weight_structs,
    weight_types,
)
from seqshard.shardlib.notation import parse_op, parse_shape
from seqshard.shardlib.shardtypes import ArrayType, block_shape
from seqshard.shardlib.tables import format_bytes

__all__ = [
    "OPTIMIZER_FLOPS_PER_PARAM",
    "FlopsPerToken",
    "LayerBytes",
    "MatmulFlops",
    "MemoryEstimate",
    "OpFlops",
    "OpKind",
    "PHASES",
    "ParamCounts",
    "Phase",
    "StepFlops",
    "flops_per_token",
    "hardware_flops_per_token",
    "layer_bytes",
    "matmul_flops_per_token",
    "memory_per_device",
    "mfu",
    "param_bytes",
    "optimizer_bytes_per_device",
    "param_bytes_per_device",
    "param_count",
    "param_counts",
    "recomputes",
    "saved_bytes",
    "stacks",
    "step_flops",
]


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
    spec: str  # e.g. 'B/dp L M, M F/t -> B/dp L F/t' or 'B/dp L M'
    runs: int  # times one pass over the batch runs it: n_layers for a layer's operations, else 1
    in_layer: bool  # one of the scanned layer's operations
    per: str  # its FLOPs scale with: 'token', 'pair' (query, key, head), 'parameter'
    forward: int = 0
    backward: int = 0
    recompute: int = 0  # forward FLOPs the remat policy re-runs in the backward pass
    update: int = 0  # the optimizer step
    fp8: bool = False  # runs in FP8 (an FP8 projection with model.fp8 on)

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
        the gathered ``'B/dp L M'`` residual run whole on each t shard."""
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
        fp8: bool | None = None,
    ) -> int:
        """FLOPs of ``phase`` (``'total'``: all four) over the rows of ``kind`` (or both kinds)
        and, when given, of those ``names`` and those that do (or do not) run in ``fp8``:
        ``s.sum('forward', 'matmul', {'q', 'k', 'v'})``, ``s.sum(fp8=True)``."""
        return sum(
            getattr(op, phase)
            for op in self.ops
            if (kind is None or op.kind == kind)
            and (names is None or op.name in names)
            and (fp8 is None or op.fp8 == fp8)
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


def _optimizer_op(microbatches: int) -> Op:
    """The update, per parameter: every weight (and its moments) is split over both d and t."""
    update = OPTIMIZER_FLOPS_PER_PARAM + (microbatches if microbatches > 1 else 0)
    return Op(
        "optimizer",
        "elementwise",
        _PARAM,
        "d_model/fsdp d_ff/t",
        lambda m: 0,
        lambda m: 0,
        update=lambda m: update,
    )


def recomputes(remat: str, op: str) -> bool:
    """Whether one layer's backward under ``remat`` re-runs the layer operation ``op`` (its
    declaration's ``recomputed_by``, in whichever layer stack declares it; ``op`` named as in
    :func:`step_flops`, or ``context``)."""
    return op in recomputed(known_blocks(), remat)


def step_flops(
    cfg: ModelConfig,
    *,
    batch: int,
    seq_len: int,
    causal: bool = False,
    microbatches: int = 1,
    newton_schulz_steps: int = 0,
) -> StepFlops:
    """The FLOPs of a training step of ``batch`` rows of ``seq_len`` tokens (all devices), per
    operation: forward, backward, recompute (``cfg.remat``) and update.

    ``causal``: count attention (scores, mask, softmax, values) over the ``L (L+1) / 2``
    (query, key) pairs per row a causal mask keeps, the useful work, instead of all ``L^2``
    the einsum path computes. ``microbatches`` only adds the gradient accumulation's adds.
    ``newton_schulz_steps``: Muon's iterations (``train.optimizer=muon``): a ``newton_schulz``
    matmul row in the update (:func:`seqshard.model.matrices.newton_schulz_flops`)."""
    for name, value in (("batch", batch), ("seq_len", seq_len), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return _step_flops(cfg, batch, seq_len, bool(causal), microbatches, newton_schulz_steps)


@functools.lru_cache(maxsize=256)
def _step_flops(
    cfg: ModelConfig,
    batch: int,
    seq_len: int,
    causal: bool,
    microbatches: int,
    newton_schulz_steps: int = 0,
) -> StepFlops:
    pairs_per_row = seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len
    units = {
        _TOKEN: batch * seq_len,
        _PAIR: batch * pairs_per_row * cfg.n_heads,
        _PARAM: param_count(cfg),
    }

    def row(op: Op, in_layer: bool, runs: int = 1) -> OpFlops:
        n = runs * units[op.per]
        forward = n * op.forward(cfg)
        return OpFlops(
            name=op.name,
            kind=op.kind,
            spec=op.spec,
            runs=runs,
            in_layer=in_layer,
            per=op.per,
            forward=forward,
            backward=n * op.backward(cfg),
            recompute=forward if in_layer and cfg.remat in op.recomputed_by else 0,
            update=n * op.update(cfg),
            fp8=op.fp8 and cfg.fp8 != "none",
        )

    def rows(blocks: tuple[Block, ...], in_layer: bool, runs: int = 1) -> list[OpFlops]:
        # A transfer moves data and computes nothing the table counts; an operation the config
        # has not (model.qk_norm's) gets no row.
        return [
            row(op, in_layer, runs)
            for b in blocks
            for op in b.ops
            if op.kind != "transfer" and op.present(cfg)
        ]

    layers: dict[str, OpFlops] = {}
    for stack in stacks(cfg):
        n, blocks = stack.n_layers, stack.blocks
        for op in rows(blocks, in_layer=True, runs=n):
            # An operation both stacks run (attention, the FFN's norm) is one row over both.
            layers[op.name] = _merged(layers[op.name], op) if op.name in layers else op
    mtp = mtp_stack(cfg)
    modules = []
    if mtp is not None:
        # Each multi-token prediction module: its entry and layer (as the layers', remat
        # included), then its head (the final norm's, the logits', the loss's), its own rows.
        for op in (*rows(mtp.blocks, True, mtp.n_layers), *rows((HEAD,), False, mtp.n_layers)):
            modules.append(dataclasses.replace(op, name=_MTP_ROW + op.name))
    ops = (
        *rows((EMBED,), in_layer=False),
        *layers.values(),
        *rows((HEAD,), in_layer=False),
        *modules,
        row(_optimizer_op(microbatches), in_layer=False),
    )
    if newton_schulz_steps:  # whole matrices on each device: the work split as the weights
        ops += (
            OpFlops(
                "newton_schulz",
                "matmul",
                "d_model/fsdp d_ff/t",
                runs=1,
                in_layer=False,
                per=_PARAM,
                update=newton_schulz_flops(cfg, newton_schulz_steps),
            ),
        )
    return StepFlops(ops=ops, batch=batch, seq_len=seq_len, causal=causal)


_MTP_ROW = "mtp."
"""The prefix of the multi-token prediction modules' rows (``mtp.q``, ``mtp.logits``)."""


def _merged(a: OpFlops, b: OpFlops) -> OpFlops:
    """One row for an operation two layer stacks run: their runs and FLOPs added."""
    if (a.kind, a.spec, a.per) != (b.kind, b.spec, b.per):
        raise ValueError(
            f"operation {a.name!r} is declared twice, as {a.kind} {a.spec!r} per {a.per} and "
            f"{b.kind} {b.spec!r} per {b.per}: name the second one otherwise."
        )
    phases = {p: getattr(a, p) + getattr(b, p) for p in PHASES}
    return dataclasses.replace(a, runs=a.runs + b.runs, **phases)


# ---------------------------------------------------------------------------------------------
# FLOPs per token: sums of the table's matmul rows


_QKV = ("q_a", "q", "k", "v", "kv_a", "kv_b")
"""The attention block's input projections: GQA's q, k, v; MLA's q (with q_a) and kv_a, kv_b."""


@dataclasses.dataclass(frozen=True)
class MatmulFlops:
    """Forward matmul FLOPs per token: the per-layer parts, and the LM head (once)."""

    qkv: int  # per layer: q = nx . w_q and k, v = nx . w_kv (MLA: its latents' projections)
    attn_scores: int  # per layer: q . k^T over all L keys (unmasked)
    attn_values: int  # per layer: probs . v over all L keys (unmasked)
    out_proj: int  # per layer: attention output . w_o
    ffn: int  # per layer: gate, up, down (SwiGLU); with experts the mean over the layers of
    # every FFN matmul (router, the k routed experts', the shared experts')
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
        (``lambda op: recomputes(cfg.remat, op)``). ``qkv`` lumps q, k and v, so a
        policy must re-run all three or none of them."""
        total = 0
        for flops, names in (
            (self.qkv, _QKV),
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

    names = {op.name for op in s.ops}
    qkv = [n for n in _QKV if n in names]
    attention = (*_QKV, "scores", "values", "o")
    ffn = [
        op.name
        for op in s.ops
        if op.in_layer and op.kind == "matmul" and not op.name.startswith(_MTP_ROW)
    ]
    return MatmulFlops(
        qkv=per_layer(*qkv),
        attn_scores=per_layer("scores"),
        attn_values=per_layer("values"),
        out_proj=per_layer("o"),
        ffn=per_layer(*(n for n in ffn if n not in attention)),
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
    the down projection for ``full`` (each policy's docstring in :mod:`seqshard.shardlib.remat` says
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


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """Weights of the model: ``total``, and ``active``, those one token's forward reads (every
    weight but the routed experts', of which it reads ``top_k`` of ``n_experts``): the ``N``
    of "6 N FLOPs per token" (MFU on active parameters, as MoE papers report it)."""

    total: int
    active: int
    routed: int  # the routed experts' weights, all of them
    embedding: int  # the input embedding table (a lookup: no FLOPs)


def _is_routed(t: ArrayType) -> bool:
    """A routed expert's weight: its type has the experts' hidden dimension ``d_expert``
    (one slice of ``experts`` per expert; the router's ``experts`` is its output)."""
    return "d_expert" in t.shape.labels


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Total and active parameters, read off the weight types (:class:`ParamCounts`)."""
    sizes = cfg.dim_sizes()
    total = routed = embedding = 0
    for name, t in weight_types(cfg):
        n = math.prod(t.global_shape(sizes))
        total += n
        routed += n if _is_routed(t) else 0
        embedding += n if name == "embed" else 0
    # A token's k routed experts of n_experts (no routed weights: every weight is active).
    moe = cfg.moe
    active = total - routed + (routed * moe.top_k // moe.n_experts if routed else 0)
    return ParamCounts(total=total, active=active, routed=routed, embedding=embedding)


def param_bytes_per_device(
    cfg: ModelConfig, mesh_sizes: Mapping[str, int], matrices_only: bool = False
) -> int:
    """f32 bytes of every weight's block on one device of a mesh of these axis sizes (missing
    axes 1), each split as its type says (a weight no axis splits is whole on every device);
    ``matrices_only``: of the weight matrices Muon takes (:mod:`seqshard.model.matrices`)."""
    sizes = cfg.dim_sizes()
    mesh = {a: mesh_sizes.get(a, 1) for a in ("p", "d", "e", "c", "t")}
    matrices = matrix_stacks(cfg)
    return sum(
        math.prod(block_shape(t, sizes, mesh)) * np.dtype(t.dtype).itemsize
        for path, t in weight_types(cfg)
        if path in matrices or not matrices_only
    )


def optimizer_bytes_per_device(
    cfg: ModelConfig, mesh_sizes: Mapping[str, int], optimizer: str = "adamw"
) -> int:
    """f32 bytes of the optimizer state on one device, sharded as the weights: AdamW's two
    moments of every weight; with ``optimizer='muon'`` one momentum for the weight matrices."""
    state = 2 * param_bytes_per_device(cfg, mesh_sizes)
    if optimizer == "muon":
        state -= param_bytes_per_device(cfg, mesh_sizes, matrices_only=True)
    return state


def param_bytes(cfg: ModelConfig, dtype: str | None = None) -> int:
    """Bytes of all weights: in their declared dtypes (the f32 master copy) by default, or
    all in ``dtype`` (``'float32'``, ``'bfloat16'``)."""
    if dtype is not None:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}.")
        return param_count(cfg) * DTYPE_BYTES[dtype]
    return sum(math.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(weight_structs(cfg)))


# ---------------------------------------------------------------------------------------------
# Memory


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one device through a training step (see :func:`memory_per_device`)."""

    weights: int  # f32 master weights, each split as its type says (over d*e*c*t)
    grads: int  # f32 gradients, sharded like the weights
    optimizer: int  # AdamW: two f32 moments, sharded like the weights (Muon: one for matrices)
    activations_per_layer: int  # saved for the backward pass, one layer (the largest kind)
    activations: int  # summed over every layer of every stack
    logits: int  # f32 'B/dp L V/t', once

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits

    def summary(self) -> str:
        parts = ("weights", "grads", "optimizer", "activations", "logits")
        body = ", ".join(f"{p} {format_bytes(getattr(self, p))}" for p in parts)
        return f"{format_bytes(self.total)} per device ({body})"


LayerBytes = Mapping[str, int]
"""Bytes on one device of each activation one layer's forward makes (:func:`layer_bytes`)."""


def layer_bytes(
    cfg: ModelConfig,
    *,
    d: int,
    t: int,
    batch: int,
    seq_len: int,
    c: int = 1,
    e: int = 1,
    blocks: tuple[Block, ...] | None = None,
) -> LayerBytes:
    """Each activation of one layer made of ``blocks`` (the first stack's by default), its bytes
    on one device of a ``d x e x c x t`` mesh, global batch ``batch`` of ``seq_len`` tokens
    (raises ValueError if the mesh cannot split the model or the batch): read off the blocks'
    declarations (:func:`seqshard.model.block.activation_bytes`), the activations the layer
    makes on that mesh (probabilities only for einsum attention over gathered keys, a
    logsumexp only for the ring, keys gathered over c only for allgather)."""
    _check_step(cfg, d=d, t=t, batch=batch, seq_len=seq_len, c=c, e=e)
    blocks = stacks(cfg)[0].blocks if blocks is None else blocks
    return activation_bytes(
        blocks, cfg, {"d": d, "e": e, "c": c, "t": t}, batch=batch, seq_len=seq_len
    )


def saved_bytes(
    cfg: ModelConfig, layer: LayerBytes, c: int = 1, blocks: tuple[Block, ...] | None = None
) -> int:
    """Bytes on one device one layer of ``blocks`` keeps for its backward under
    ``cfg.remat``: what the blocks declare it keeps (:func:`seqshard.model.block.kept`)."""
    blocks = stacks(cfg)[0].blocks if blocks is None else blocks
    return sum(layer[name] for name in kept(blocks, cfg, c))


def memory_per_device(
    cfg: ModelConfig,
    *,
    d: int,
    t: int,
    batch: int,
    seq_len: int,
    c: int = 1,
    e: int = 1,
    optimizer: str = "adamw",
) -> MemoryEstimate:
    """Estimate per-device memory on a ``d x e x c x t`` mesh for global batch ``batch`` of
    ``seq_len`` (c splits the sequence, and the weights as d does; e splits the routed experts
    and, elsewhere, the batch and the weights as d does).

    Weights, grads and AdamW moments are f32 and fully sharded, each weight as its type says
    (:func:`param_bytes_per_device`: ``param_bytes / (d*e*c*t)`` but for the few a type leaves
    whole along some axis, the router's bias); x2 for the moments (``optimizer='muon'``: one
    momentum for the weight matrices, AdamW's two for the rest). Activations per layer are
    what the remat policy keeps of the layer's arrays (:func:`layer_bytes`, each stack's layer
    with its blocks; b = batch/(d e), c = bytes of ``cfg.compute_dtype``):

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
    kept_by_stack = [
        (s.n_layers, saved_bytes(cfg, layer_bytes(cfg, d=d, t=t, batch=batch, seq_len=seq_len,
                                                  c=c, e=e, blocks=s.blocks), c, s.blocks))
        for s in stacks(cfg)
    ]  # fmt: skip
    mesh = {"d": d, "e": e, "c": c, "t": t}
    weights = param_bytes_per_device(cfg, mesh)
    return MemoryEstimate(
        weights=weights,
        grads=weights,
        optimizer=optimizer_bytes_per_device(cfg, mesh, optimizer),
        activations_per_layer=max(per_layer for _, per_layer in kept_by_stack),
        activations=sum(n * per_layer for n, per_layer in kept_by_stack),
        logits=4 * (batch // (d * e)) * (seq_len // c) * (cfg.vocab // t),
    )


def _check_step(
    cfg: ModelConfig, *, d: int, t: int, batch: int, seq_len: int, c: int = 1, e: int = 1
) -> None:
    for name, value in (
        ("d", d), ("e", e), ("c", c), ("t", t), ("batch", batch), ("seq_len", seq_len),
    ):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    check_mesh(cfg, {"d": d, "e": e, "c": c, "t": t})
    if c > 1 and seq_len % (2 * c):
        raise ValueError(
            f"seq_len={seq_len} is not divisible by 2c = {2 * c} (the zigzag layout over c "
            f"cuts each row into 2c chunks). Choose a seq_len divisible by {2 * c}."
        )
    if batch % (d * e):
        raise ValueError(
            f"batch={batch} is not divisible by mesh axes d x e = {d} x {e} (the batch "
            f"is split 'B/dp'). Choose a batch divisible by {d * e}."
        )
