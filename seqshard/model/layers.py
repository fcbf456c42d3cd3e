"""The model's layers: a sequence of stacks, each a scanned run of identical layers, each layer a
sequence of blocks (:class:`~seqshard.model.block.Block`); one forward and one auxiliary-output
path for any of them.

    stacks(cfg)                        e.g. (Stack('layers', (ATTENTION, SWIGLU), 1),
                                             Stack('moe_layers', (ATTENTION, MOE), 1))
    x, aux = run_stacks(cfg, w, rows, x)    the residual through every stack, scanned
    terms = with_aux_losses(cfg, terms, aux)

Stack ``s`` is the weights' field ``s.name`` (``layers``, ``moe_layers``: the checkpoints'
paths), typed ``Array['<name>/p', <its layer type>]``: every present weight field of its
blocks, side by side, with a leading layer dimension (split over p when pipelined). A layer
runs its blocks in order, each reading its ``input`` activation and making its ``output``
(the next block's input), through one :class:`~seqshard.model.block.Activations` recorder.

Auxiliary outputs are per stack, per block: ``aux[stack][block][field]``, one value per layer
(the block's :class:`~seqshard.model.block.Aux` declares them), replicated. The loss adds the
declared ``loss`` fields once per microbatch, weighted by its counted positions.

Which blocks make a layer is this module's table (:data:`ATTENTION_KINDS`, :data:`FFN_KINDS`,
:func:`stacks`): every layer's attention block is ``model.attention`` (grouped-query or
multi-head latent attention), the FFN of dense layers is ``model.ffn`` (a name in
:data:`FFN_KINDS`; :func:`register_ffn` adds one), the mixture-of-experts stack follows the
dense one when ``model.moe`` has experts. The multi-token prediction modules (``model.mtp``)
are a stack of their own (:func:`mtp_stack`), run beside the head by :mod:`seqshard.model.mtp`.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import typing
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from seqshard.model.attention import attention_mask
from seqshard.model.attention import rope as rope_cos_sin
from seqshard.model.attention_block import ATTENTION
from seqshard.model.block import Activations, Block, LayerInputs, has_aux, weight_info
from seqshard.model.config import ModelConfig
from seqshard.model.context import SequenceRows, context_mask
from seqshard.model.mla import MLA
from seqshard.model.moe import MOE
from seqshard.model.mtp_block import MTP_ENTRY
from seqshard.model.swiglu import SWIGLU
from seqshard.shardlib import collective_log, shardops
from seqshard.shardlib.dataflow import after
from seqshard.shardlib.remat import explicit_activation_checkpointing
from seqshard.shardlib.shardtypes import f32, pytree_dataclass, shape_dtype_structs
from seqshard.shardlib.vma import varying_axes

__all__ = [
    "attention_block",
    "ATTENTION_KINDS",
    "aux_losses",
    "aux_stacks",
    "aux_type",
    "FFN_KINDS",
    "gradients_after_input",
    "known_blocks",
    "Layer",
    "layer_forward",
    "layer_inputs",
    "MTP_STACK",
    "mtp_stack",
    "read_after",
    "register_ffn",
    "rope_and_mask",
    "run_stack",
    "run_stacks",
    "runs",
    "Stack",
    "STACK_NAMES",
    "stacks",
    "with_aux_losses",
    "zero_aux",
]


FFN_KINDS: dict[str, Block] = {"swiglu": SWIGLU}
"""``model.ffn`` -> the FFN block of the dense layers."""


def register_ffn(block: Block) -> Block:
    """Add a block kind as a choice of ``model.ffn`` (under ``block.name``): it reads the
    residual ``h`` the attention block makes and makes ``out``. Returns ``block``."""
    if block.input != ATTENTION.output:
        raise ValueError(
            f"an FFN block reads the attention block's output {ATTENTION.output!r}, but "
            f"{block.name!r} reads {block.input!r}: set its input to {ATTENTION.output!r}."
        )
    FFN_KINDS[block.name] = block
    return block


class Layer:
    """The base of every layer type :func:`layer_type` makes (one per stack and config)."""


@functools.cache
def _layer_class(name: str, fields: tuple[tuple[str, typing.Any, typing.Any], ...]) -> type:
    annotations, namespace = {}, {"__module__": __name__}
    for field_name, annotation, field in fields:
        annotations[field_name] = annotation
        namespace[field_name] = dataclasses.field(metadata=field.metadata)
    namespace["__annotations__"] = annotations
    namespace["__doc__"] = f"One layer's weights of the stack {name!r}."
    cls = type("Layer", (Layer,), namespace)
    cls.__qualname__ = f"Layer[{name}]"
    return pytree_dataclass(cls)


def layer_type(name: str, blocks: tuple[Block, ...], cfg: ModelConfig) -> type:
    """The flat pytree dataclass of one layer of stack ``name``: the fields its blocks'
    weights declare that ``cfg`` has (a weight a config leaves off is absent), in order."""
    fields = []
    for block in blocks:
        if block.weights is None:
            continue
        hints = typing.get_type_hints(block.weights)
        info = weight_info(block.weights)
        for f in dataclasses.fields(block.weights):
            if f.name in info and not info[f.name].present(cfg):
                continue
            fields.append((f.name, hints[f.name], f))
    names = [f[0] for f in fields]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(
            f"the blocks of stack {name!r} ({', '.join(b.name for b in blocks)}) both declare "
            f"the weights {twice}: rename one block's fields (a layer holds them side by side)."
        )
    return _layer_class(name, tuple(fields))


@dataclasses.dataclass(frozen=True)
class Stack:
    """A run of ``n_layers`` identical layers of ``blocks``, stored in the weights' field
    ``name`` as ``layer_type`` with a leading ``name`` dimension."""

    name: str
    blocks: tuple[Block, ...]
    n_layers: int
    layer_type: type
    aux_names: tuple[str, ...] = ()  # the blocks that return auxiliary outputs (has_aux)

    @property
    def aux_blocks(self) -> tuple[Block, ...]:
        """Its blocks that return auxiliary outputs."""
        return tuple(b for b in self.blocks if b.name in self.aux_names)


def runs(cfg: ModelConfig, block: Block) -> bool:
    """Whether a layer of ``cfg``'s model runs ``block`` (the planner's and ``show``'s
    figures of one block kind: the MoE block's exchange buffers, its routed work)."""
    return any(block in s.blocks for s in stacks(cfg))


def known_blocks() -> tuple[Block, ...]:
    """Every block kind a layer of any config may run (each once)."""
    return (*ATTENTION_KINDS.values(), *FFN_KINDS.values(), MOE, MTP_ENTRY)


def _ffn(cfg: ModelConfig) -> Block:
    if cfg.ffn not in FFN_KINDS:
        raise ValueError(
            f"model.ffn={cfg.ffn!r} names no FFN block kind; the kinds are "
            f"{sorted(FFN_KINDS)} (seqshard.model.layers.register_ffn adds one)."
        )
    return FFN_KINDS[cfg.ffn]


ATTENTION_KINDS: dict[str, Block] = {"gqa": ATTENTION, "mla": MLA}
"""``model.attention`` -> the attention block of every layer."""


def attention_block(cfg: ModelConfig) -> Block:
    """The attention block kind of ``cfg``'s layers (``model.attention``)."""
    return ATTENTION_KINDS[cfg.attention]


_STACK_KINDS = (
    ("layers", lambda cfg: (attention_block(cfg), _ffn(cfg))),
    ("moe_layers", lambda cfg: (attention_block(cfg), MOE)),
)

STACK_NAMES: tuple[str, ...] = tuple(name for name, _ in _STACK_KINDS)
"""The weights' fields a layer stack may sit in, in the order the stacks run."""


def stacks(cfg: ModelConfig) -> tuple[Stack, ...]:
    """The model's layer stacks in the order they run, the empty ones left out: the dense
    layers (attention, then ``model.ffn``), then with experts the MoE layers (attention,
    then the MoE FFN). Their sizes are ``cfg.dim_sizes()``'s ``layers`` and ``moe_layers``."""
    sizes = cfg.dim_sizes()
    out = []
    for name, kind in _STACK_KINDS:
        if sizes.get(name, 0) > 0:
            blocks = kind(cfg)
            for before, block in zip(blocks, blocks[1:], strict=False):
                if before.output != block.input:
                    raise ValueError(
                        f"stack {name!r}: block {block.name!r} reads {block.input!r}, but the "
                        f"block before it, {before.name!r}, makes {before.output!r}."
                    )
            out.append(_stack(cfg, name, blocks, sizes[name]))
    return tuple(out)


MTP_STACK = "mtp"
"""The weights' field of the multi-token prediction modules (``model.mtp``)."""


def mtp_stack(cfg: ModelConfig) -> Stack | None:
    """The multi-token prediction modules as a stack of ``model.mtp.depth`` layers (None
    without): each the entry block (:mod:`seqshard.model.mtp_block`), then one layer of the
    model's last stack's kind (as DeepSeek-V3's: an MoE layer when the model has experts).
    Not run by :func:`run_stacks`: :mod:`seqshard.model.mtp` runs it beside the head. Its
    weights rest replicated over p (the last stage runs it)."""
    if cfg.mtp.depth == 0:
        return None
    blocks = (MTP_ENTRY, *stacks(cfg)[-1].blocks)
    return _stack(cfg, MTP_STACK, blocks, cfg.mtp.depth)


def _stack(cfg: ModelConfig, name: str, blocks: tuple[Block, ...], n_layers: int) -> Stack:
    aux = tuple(b.name for b in blocks if has_aux(b, cfg))
    return Stack(name, blocks, n_layers, layer_type(name, blocks, cfg), aux)


def aux_stacks(cfg: ModelConfig) -> tuple[Stack, ...]:
    """Every stack whose layers may make auxiliary outputs: :func:`stacks` and the
    multi-token prediction modules'."""
    mtp = mtp_stack(cfg)
    return stacks(cfg) + ((mtp,) if mtp is not None else ())


# -- the forward ----------------------------------------------------------------------------


def rope_and_mask(cfg: ModelConfig, rows: SequenceRows):
    """RoPE's (cos, sin) tables at each of this device's positions (within its document), and
    the attention mask for ``cfg``: with c = 1 :func:`~seqshard.model.attention.attention_mask`'s
    (splash: segment ids); with the sequence split over c, ``allgather``'s mask of this device's
    queries against every key (:func:`~seqshard.model.context.context_mask`), and none for the
    ring, which masks its own blocks. Per batch, cheap."""
    rope = rope_cos_sin(cfg, rows.positions)
    c = shardops.axis_size("c")
    if c == 1:
        return rope, attention_mask(rows.is_seq_start, cfg.attention_mask, cfg.attention_impl)
    if cfg.ring_over(c):
        return rope, None
    return rope, context_mask(rows, cfg.attention_mask == "causal")


def layer_inputs(cfg: ModelConfig, rows: SequenceRows) -> LayerInputs:
    """What every layer reads of the microbatch's rows (:func:`rope_and_mask`)."""
    rope, mask = rope_and_mask(cfg, rows)
    return LayerInputs(rows, rope, mask)


def layer_forward(
    cfg: ModelConfig, blocks: tuple[Block, ...], inputs: LayerInputs, w, a: Activations
) -> tuple[jax.Array | None, dict[str, dict[str, jax.Array]]]:
    """One layer on the residual ``a[blocks[0].input]``, its blocks in order, every value
    written through ``a``: (the last block's output, {block: its auxiliary outputs})."""
    aux, out = {}, None
    for block in blocks:
        out = block.forward(cfg, inputs, w, a)
        if has_aux(block, cfg):
            out, aux[block.name] = out
    return out, aux


def _layer(cfg: ModelConfig, blocks: tuple[Block, ...], inputs: LayerInputs, x, w):
    """One layer as a scan body: the residual in and out, what remat=saved keeps marked."""
    a = Activations(blocks, {blocks[0].input: x}, mark=True)
    return layer_forward(cfg, blocks, inputs, w, a)


def run_stack(cfg: ModelConfig, stack: Stack, rows: SequenceRows, x: jax.Array, w):
    """The residual ``x`` through the stacked layers ``w`` of ``stack`` (all of them, or a
    pipeline stage's block), scanned, each layer under ``cfg.remat``: (a residual, each
    layer's auxiliary outputs, stacked)."""
    body = functools.partial(_layer, cfg, stack.blocks, layer_inputs(cfg, rows))
    body = explicit_activation_checkpointing(body, cfg.remat)
    return collective_log.scan(stack.name, body, x, w)


@jax.custom_vjp
def gradients_after_input(w, x: jax.Array):
    """``(w, x)`` unchanged; in the backward pass, ``w``'s gradient is made to read ``x``'s
    (:func:`seqshard.shardlib.dataflow.after`, each leaf typed to allow it).

    Several layer stacks are several loops, and the backward pass of the first runs after
    the later stacks' have made their weights' gradients. The optimizer's global norm then
    all-reduces those gradients outside the shard_map, reading nothing of the later loop:
    XLA's CPU runtime may start it on one device while another is still in the loop's
    collectives (:mod:`seqshard.shardlib.collective_order`). Reading ``x``'s gradient, made
    by that loop, orders them."""
    return w, x


def _gradients_after_input_forward(w, x):
    return (w, x), None


def _gradients_after_input_backward(_, g):
    g_w, g_x = g
    return read_after(g_w, g_x), g_x


def read_after(tree, x: jax.Array):
    """``tree``'s arrays made to read ``x`` (:func:`seqshard.shardlib.dataflow.after`), each
    that varies over every mesh axis ``x`` does (the others as they are): the gradients of a
    stack whose backward loop ran before a later one's, tied to that loop's result
    (:func:`gradients_after_input`)."""
    typed = varying_axes(x)
    return jax.tree.map(lambda a: after(a, x) if typed <= varying_axes(a) else a, tree)


gradients_after_input.defvjp(_gradients_after_input_forward, _gradients_after_input_backward)


def run_stacks(cfg: ModelConfig, w, rows: SequenceRows, x: jax.Array):
    """The residual through every stack in order: (a residual, {stack: {block: auxiliary
    outputs}} of the stacks that have any)."""
    order = stacks(cfg)
    later = {s.name: getattr(w, s.name) for s in order[1:]}
    if later:
        later, x = gradients_after_input(later, x)
    aux = {}
    for s in order:
        x, out = run_stack(cfg, s, rows, x, later.get(s.name, getattr(w, s.name)))
        if out:
            aux[s.name] = out
    return x, aux


# -- auxiliary outputs ----------------------------------------------------------------------


def aux_type(cfg: ModelConfig) -> dict:
    """The type of the stacks' auxiliary outputs, ``{stack: {block: {field: f32['<stack> ...']}}}``
    (empty without any): replicated, one value per layer."""
    return {
        s.name: {
            b.name: {f: f32[f"{s.name} {dims}".strip()] for f, dims in b.aux.fields_of(cfg).items()}
            for b in s.aux_blocks
        }
        for s in aux_stacks(cfg)
        if s.aux_blocks
    }


def zero_aux(cfg: ModelConfig) -> dict:
    """Zeros shaped as the stacks' auxiliary outputs: what accumulation starts from."""
    structs = shape_dtype_structs(aux_type(cfg), cfg.dim_sizes())
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), structs)


def aux_losses(cfg: ModelConfig, aux: Mapping) -> list[jax.Array]:
    """Per layer, the sum of the ``loss`` fields of each block that declares any: one
    array [layers, ...] per (stack, block) of ``aux`` (any leading dims: a pipeline stage's
    [rounds, microbatches, layers])."""
    out = []
    for s in aux_stacks(cfg):
        for b in s.aux_blocks:
            if b.aux.loss and s.name in aux:
                values = aux[s.name][b.name]
                out.append(functools.reduce(operator.add, [values[f] for f in b.aux.loss]))
    return out


def with_aux_losses(cfg: ModelConfig, terms: jax.Array, aux: Mapping) -> jax.Array:
    """The loss terms f32[2] with the blocks' loss fields added (every layer's), each once
    per microbatch weighted by its counted positions."""
    parts = [jnp.sum(per_layer) for per_layer in aux_losses(cfg, aux)]
    if not parts:
        return terms
    return terms.at[0].add(terms[1] * functools.reduce(operator.add, parts))
