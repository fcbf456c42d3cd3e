"""How a block of the model is declared, once, beside its math.

A block kind (the attention block, the SwiGLU FFN, the embedding and head around the layers)
is one module holding its math and a :class:`Block`: plain data that every consumer reads.

    Block.activations  each value its forward makes, by name: its per-device spec, its dtype,
                       the operation it belongs to, whether remat=saved keeps it
    Block.ops          each operation: FLOPs per token (or per attention pair) forward and
                       backward, the spec its work is split by, which remat policies re-run it
    weight fields      each weight's type (shape and layout) is its field's annotation in the
                       block's pytree dataclass; :func:`weight` adds the rest: init, decay, the
                       dtype it is gathered in, its Hugging Face tensor(s)

The readers are plain functions over these tables:

    the forward     writes each activation through an :class:`Activations` recorder, which
                    names its collective-log part, marks what remat keeps, and, in the
                    hand-written backward, hands back what the forward kept instead of
                    computing it again (the backward never writes the forward a second time)
    remat           :func:`kept` / :func:`recomputed`: what each policy keeps and re-runs
    cost            :func:`activation_bytes` and the ops' FLOP rows (seqshard.model.cost)
    optimizer, planner, Hugging Face table: :func:`weight_info` of each weight field

Beside these a :class:`Block` carries what runs it: its weights' dataclass, its forward
(written through an :class:`Activations`), its hand-written backward or none (the model's
backward then takes ``jax.vjp`` of the forward), the activation it reads and the one it makes,
and its auxiliary outputs (:class:`Aux`: extra loss terms, logged figures, per-step state).
:mod:`seqshard.model.layers` runs layers of blocks. Adding a block kind is one new module;
an FFN kind is then a choice of ``model.ffn`` by :func:`seqshard.model.layers.register_ffn`
(``tests/model/test_block_kinds.py`` adds one from a test file).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from seqshard.model.config import ModelConfig
from seqshard.shardlib import collective_log
from seqshard.shardlib.notation import parse_shape
from seqshard.shardlib.remat import RematName, save_for_backward

__all__ = [
    "Activation",
    "Activations",
    "Aux",
    "Block",
    "LayerInputs",
    "Op",
    "Weight",
    "activation_bytes",
    "combined_aux",
    "elementwise",
    "has_aux",
    "kept",
    "matmul",
    "recomputed",
    "weight",
    "weight_info",
]

Dtype = Literal["compute", "f32"]
OpKind = Literal["matmul", "elementwise", "transfer"]


@dataclasses.dataclass(frozen=True)
class Weight:
    """What a weight's type does not say. ``init``: the std of its normal init (a number, or
    a function of the config), ``'ones'``, or ``'zeros'`` (state that starts empty: it takes
    no random key, so adding it changes no other weight's draw). ``hf``: its Hugging Face tensors, ``(name,
    layout)`` per part along its leading literal dim (``w_kv``: k then v); ``{i}`` is the
    layer, the layout is in seqshard's dim names (:mod:`seqshard.hf.table`). ``matrix``:
    ``(input dims, output dims)`` of the linear map it is, each a space-separated list of its
    type's dim labels (``w_o``: ``('n_q_per_kv n_kv d_head', 'd_model')``); every other dim of
    its type stacks matrices (the layers, ``w_kv``'s k and v, the experts). Muon
    (``train.optimizer=muon``, :mod:`seqshard.train.muon`) takes exactly the weights that
    declare one; None: AdamW (embeddings, the head, norm gains, the router)."""

    init: float | str | Callable[[ModelConfig], float]
    decay: bool = True  # AdamW's weight decay applies (not to norm gains)
    gathered_in: Dtype = "compute"  # the dtype the forward all-gathers it in
    hf: tuple[tuple[str, str], ...] = ()
    present: Callable[[ModelConfig], bool] = lambda m: True  # absent: not in the tree at all
    matrix: tuple[str, str] | None = None

    def std(self, cfg: ModelConfig) -> float | str:
        return self.init(cfg) if callable(self.init) else self.init


def weight(
    init: float | str | Callable[[ModelConfig], float],
    *,
    hf: tuple[tuple[str, str], ...] | str = (),
    decay: bool = True,
    gathered_in: Dtype = "compute",
    layout: str | None = None,
    present: Callable[[ModelConfig], bool] = lambda m: True,
    matrix: tuple[str, str] | None = None,
) -> Any:
    """A weight field's declaration: ``w_up: f32['d_model/fsdp d_ff/t'] = weight(fan_in,
    hf='model.layers.{i}.mlp.up_proj.weight', layout='d_ff d_model', matrix=('d_model',
    'd_ff'))``. ``present``: whether a config has it (a weight it leaves off is absent from
    the weights' tree); ``matrix``: the linear map's input and output dims (:class:`Weight`)."""
    if isinstance(hf, str):
        hf = ((hf, layout or ""),)
    info = Weight(
        init, decay=decay, gathered_in=gathered_in, hf=tuple(hf), present=present, matrix=matrix
    )
    return dataclasses.field(metadata={"seqshard": info})


def gain(
    hf: str, layout: str = "d_model", present: Callable[[ModelConfig], bool] = lambda m: True
) -> Any:
    """A norm gain: ones at init, no decay, gathered in f32 (``rms_norm`` takes f32 gains);
    ``layout`` its one dimension (``d_head`` for the per-head q and k norms)."""
    return weight("ones", hf=hf, layout=layout, decay=False, gathered_in="f32", present=present)


def weight_info(cls: type) -> dict[str, Weight]:
    """Field name -> :class:`Weight` of a weights dataclass (a block's, a layer's, ``Weights``)."""
    return {
        f.name: f.metadata["seqshard"] for f in dataclasses.fields(cls) if "seqshard" in f.metadata
    }


@dataclasses.dataclass(frozen=True)
class Activation:
    """A value a block's forward makes. ``spec``: per device, in the op letters (B batch, L
    sequence (``L`` the device's positions, ``Lk`` every key of the row), M, F, Q, K, D);
    ``op``: the operation it belongs to (its collective-log part and FLOP row); ``saved``:
    kept under ``remat=saved`` (marked ``save_for_backward``); ``needed``: read by the
    hand-written backward (the ones it does not read are never recomputed there);
    ``present``: whether it exists for a config on a mesh whose context axis has size c."""

    name: str
    spec: str
    dtype: Dtype
    op: str
    saved: bool = False
    needed: bool = True
    present: Callable[[ModelConfig, int], bool] = lambda cfg, c: True


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation's FLOPs: per ``per`` unit (``'token'``, ``'pair'``: one (query, key,
    head) triple of attention, or ``'parameter'``), forward and backward, as functions of the
    config. ``spec``:
    what splits its work per device. ``recomputed_by``: the remat policies whose backward
    re-runs its forward (a ``transfer`` moves data and computes nothing the table counts).
    ``present``: whether the config has it at all (``model.qk_norm``'s norms). ``fp8``: a
    projection that runs in FP8 with ``model.fp8`` (:mod:`seqshard.shardlib.fp8`)."""

    name: str
    kind: OpKind
    per: Literal["token", "pair", "parameter"]
    spec: str
    forward: Callable[[ModelConfig], int]
    backward: Callable[[ModelConfig], int]
    recomputed_by: frozenset[RematName] = frozenset()
    update: Callable[[ModelConfig], int] = lambda m: 0  # the optimizer step's, per parameter
    present: Callable[[ModelConfig], bool] = lambda m: True
    fp8: bool = False


def matmul(
    name: str,
    per: Literal["token", "pair"],
    spec: str,
    forward: Callable[[ModelConfig], int],
    recomputed_by: Iterable[RematName] = (),
    *,
    fp8: bool = False,
) -> Op:
    """A matmul (2 FLOPs per multiply-add): its backward is one matmul per operand, each the
    forward's size. ``fp8``: a projection that runs in FP8 with ``model.fp8``."""
    return Op(
        name,
        "matmul",
        per,
        spec,
        forward,
        lambda m: 2 * forward(m),
        frozenset(recomputed_by),
        fp8=fp8,
    )


def elementwise(
    name: str,
    per: Literal["token", "pair"],
    spec: str,
    forward: Callable[[ModelConfig], int],
    backward: Callable[[ModelConfig], int],
    recomputed_by: Iterable[RematName] = (),
    present: Callable[[ModelConfig], bool] = lambda m: True,
) -> Op:
    """Elementwise work (1 FLOP per add, multiply, exp, ...; seed 004's convention)."""
    return Op(
        name,
        "elementwise",
        per,
        spec,
        forward,
        backward,
        frozenset(recomputed_by),
        present=present,
    )


class LayerInputs(NamedTuple):
    """What every layer of a microbatch reads besides its weights and the residual: the rows'
    ids and positions (:class:`~seqshard.model.context.SequenceRows`), RoPE's (cos, sin) at
    each position, and the attention mask (None where the attention masks its own blocks)."""

    rows: Any
    rope: Any
    mask: Any


@dataclasses.dataclass(frozen=True, eq=False)
class Aux:
    """What a block returns beside its output, per layer, and what becomes of it.

    ``fields``: each value's name and its dims after the layer stack's (``''`` a number per
    layer, ``'experts'`` one per expert): f32, replicated (summed over the mesh inside the
    block). Per training step they are summed over microbatches, except ``mean`` (averaged);
    ``loss`` are added to the microbatch's summed loss, each times its counted positions (so
    the step's mean loss adds each once per microbatch); ``metrics(cfg, aux, layer_names,
    stack_weights) -> {name: value}`` gives the log's figures from the step's values (``aux``:
    field -> [layers, ...], ``layer_names`` each stored layer's place in the model);
    ``update(cfg, stack_weights, aux) -> stack_weights`` is per-step state moved after the
    optimizer step (no gradient reaches it). ``max`` fields are the largest over microbatches
    instead of their sum (FP8's amaxes). ``present(cfg)``: whether a config's block makes them
    at all (its forward then returns the pair; else its output alone)."""

    fields: Mapping[str, str]
    loss: tuple[str, ...] = ()
    mean: tuple[str, ...] = ()
    max: tuple[str, ...] = ()
    metrics: Callable[..., dict[str, Any]] | None = None
    update: Callable[..., Any] | None = None
    present: Callable[[ModelConfig], bool] = lambda m: True
    parts: tuple[Aux, ...] = ()  # set by combined_aux

    def fields_of(self, cfg: ModelConfig) -> dict[str, str]:
        """The fields ``cfg``'s block makes: all of them, or those of its present parts."""
        if not self.parts:
            return dict(self.fields) if self.present(cfg) else {}
        return {f: d for p in self.parts if p.present(cfg) for f, d in p.fields.items()}


def combined_aux(*parts: Aux) -> Aux:
    """One block's auxiliary outputs from independent ``parts`` (FP8's amaxes, the attention's
    largest logits), each present or not by its own ``present``: the fields of the present
    ones, their metrics side by side, their updates one after another."""

    def metrics(cfg, aux, layer_names, stack_weights) -> dict[str, Any]:
        out = {}
        for p in parts:
            if p.present(cfg) and p.metrics is not None:
                out.update(p.metrics(cfg, aux, layer_names, stack_weights))
        return out

    def update(cfg, stack_weights, aux):
        for p in parts:
            if p.present(cfg) and p.update is not None:
                stack_weights = p.update(cfg, stack_weights, aux)
        return stack_weights

    return Aux(
        fields={f: d for p in parts for f, d in p.fields.items()},
        loss=tuple(f for p in parts for f in p.loss),
        mean=tuple(f for p in parts for f in p.mean),
        max=tuple(f for p in parts for f in p.max),
        metrics=metrics,
        update=update,
        present=lambda cfg: any(p.present(cfg) for p in parts),
        parts=parts,
    )


def has_aux(block: Block, cfg: ModelConfig) -> bool:
    """Whether ``block`` returns auxiliary outputs under ``cfg`` (:class:`Aux` ``present``)."""
    return block.aux is not None and block.aux.present(cfg)


Forward = Callable[[ModelConfig, LayerInputs, Any, "Activations"], Any]
Backward = Callable[[ModelConfig, LayerInputs, Any, "Activations", Any], tuple[Any, dict]]


@dataclasses.dataclass(frozen=True, eq=False)
class Block:
    """A block kind's declarations (see the module docstring).

    ``weights``: its weights' pytree dataclass (one layer's; each field declared by
    :func:`weight`), or None (the embedding and head, whose weights are the model's own).
    ``forward(cfg, inputs, w, a)``: its math on the residual ``a[input]`` through the recorder
    ``a``: the residual ``a[output]``, or (it, {aux field: value}) when it declares ``aux``.
    ``backward(cfg, inputs, w, a, d_out)``: its hand-written backward from the activations
    ``a`` its forward rebuilt: (dL/d input, {weight field: gradient, f32, in its layout}); None:
    the hand-written model backward takes ``jax.vjp`` of ``forward`` instead (re-running it).
    ``fp8_sites``: the activations and weights its forward puts on e4m3's grid with
    ``model.fp8``, in order (:mod:`seqshard.model.fp8_scaling`).
    """

    name: str
    activations: tuple[Activation, ...]
    ops: tuple[Op, ...]
    weights: type | None = None
    forward: Forward | None = None
    backward: Backward | None = None
    input: str = "h"
    output: str = "out"
    aux: Aux | None = None
    fp8_sites: tuple[str, ...] = ()

    def activation(self, name: str) -> Activation:
        for a in self.activations:
            if a.name == name:
                return a
        raise KeyError(f"{self.name} makes no activation {name!r}")


# -- readers ----------------------------------------------------------------------------------


def _activations(blocks: Iterable[Block], cfg: ModelConfig, c: int) -> list[Activation]:
    return [a for b in blocks for a in b.activations if a.present(cfg, c)]


def kept(blocks: Iterable[Block], cfg: ModelConfig, c: int = 1) -> tuple[str, ...]:
    """The activations a layer made of ``blocks`` keeps for its backward under ``cfg.remat``
    on a mesh whose context axis has size ``c``: ``saved`` the ones marked saved (the layer
    input among them), ``full`` the input alone, ``none`` every one the backward reads."""
    acts = _activations(blocks, cfg, c)
    if cfg.remat == "none":
        return tuple(a.name for a in acts if a.needed)
    if cfg.remat == "full":
        return (acts[0].name,)
    return tuple(a.name for a in acts if a.saved)


def recomputed(blocks: Iterable[Block], policy: RematName) -> frozenset[str]:
    """The operations of ``blocks`` the backward re-runs under ``policy``."""
    return frozenset(op.name for b in blocks for op in b.ops if policy in op.recomputed_by)


def activation_bytes(
    blocks: Iterable[Block],
    cfg: ModelConfig,
    mesh: Mapping[str, int],
    *,
    batch: int,
    seq_len: int,
) -> dict[str, int]:
    """Bytes on one device of each activation of ``blocks`` present on ``mesh``: its spec's
    sizes (B = batch, L = seq_len, Lk = the keys one device's queries see, C a ring chunk)
    divided by the mesh axes it names, times its dtype's bytes."""
    c = mesh.get("c", 1)
    sizes = {
        "B": batch,
        "L": seq_len,
        "Lk": seq_len // c if cfg.ring_over(c) else seq_len,
        "C": seq_len // (2 * c),
        **{k: v for k, v in _letter_sizes(cfg).items()},
    }
    compute = jnp.dtype(cfg.compute_dtype).itemsize
    out = {}
    for a in _activations(blocks, cfg, c):
        n = 1
        for dim in parse_shape(a.spec).dims:
            size = sizes[dim.label] if dim.label in sizes else int(dim.label)
            n *= size // math.prod(mesh.get(axis, 1) for axis in dim.axes)
        out[a.name] = n * (4 if a.dtype == "f32" else compute)
    return out


def _letter_sizes(cfg: ModelConfig) -> dict[str, int]:
    return {
        "M": cfg.d_model,
        "F": cfg.d_ff,
        "Q": cfg.n_q_per_kv,
        "K": cfg.n_kv,
        "D": cfg.d_head,
        "V": cfg.vocab,
        # Multi-head latent attention (seqshard.model.mla): Dv a value head, Rq and R the
        # query and kv latents, P the rope key, A = R + P, Dkv = D - P + Dv.
        "Dv": cfg.d_v,
        "Rq": cfg.mla.q_lora_rank,
        "R": cfg.mla.kv_lora_rank,
        "P": cfg.mla.qk_rope_head_dim,
        "A": cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim,
        "Dkv": cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim,
        "N": 2 * cfg.d_model,  # a multi-token prediction module's [embedding | hidden]
    }


# -- the recorder the forward writes through --------------------------------------------------


class Activations:
    """The named values of one layer's forward, written as ``x = a('q', lambda: ...)``.

    ``a(name, compute)`` returns the value of activation ``name``: the one given in ``kept``
    (the hand-written backward rebuilding a layer from what its forward kept), or else
    ``compute()``, run inside the collective-log part of the activation's operation and, when
    ``mark`` is set (the forward under autodiff), marked ``save_for_backward`` if its
    declaration says remat=saved keeps it. With ``only_needed`` (rebuilding for the
    backward) an activation the backward never reads is not computed: ``None``.

    ``explicit``: the forward of the hand-written backward (inside its custom VJP), where some
    operations run their plain forward (the ring's, which returns its logsumexp too)."""

    def __init__(
        self,
        blocks: Iterable[Block],
        kept: Mapping[str, jax.Array] | None = None,
        *,
        mark: bool = False,
        explicit: bool = False,
        only_needed: bool = False,
    ):
        self.declared = {a.name: a for b in blocks for a in b.activations}
        self.values: dict[str, jax.Array] = dict(kept or {})
        self.mark, self.explicit, self.only_needed = mark, explicit, only_needed

    def __call__(self, name: str, compute: Callable[[], Any]) -> Any:
        if name in self.values:
            return self.values[name]
        declared = self.declared[name]
        if self.only_needed and not declared.needed:
            return None
        with collective_log.part(declared.op):
            value = compute()
        if self.mark and declared.saved:
            value = save_for_backward(value)
        self.values[name] = value
        return value

    def several(
        self, names: tuple[str, ...], compute: Callable[[], tuple[Any, ...]], op: str | None = None
    ):
        """Activations made together (``k, v = a.several(('k', 'v'), ...)``), inside the part
        of the first one's operation, or of ``op``."""
        if all(n in self.values for n in names):
            return tuple(self.values[n] for n in names)
        with collective_log.part(op or self.declared[names[0]].op):
            values = compute()
        return tuple(self(n, lambda v=v: v) for n, v in zip(names, values, strict=True))

    def __getitem__(self, name: str) -> jax.Array:
        return self.values[name]
