"""The one table between seqshard's weights and a Hugging Face checkpoint's tensors.

Each row names a seqshard weight, its Hugging Face tensor (``{i}``: the layer, ``{x}``: the
expert) and that tensor's layout written in seqshard's dimension names, the names of the weight types
(:mod:`seqshard.model.weights`). The seqshard side of a row is its weight type with the mesh
axes left out (and the ``layers`` dimension, which is ``{i}``); einops moves between the two::

    seqshard weight  type                                     Hugging Face tensor                         its layout
    embed            f32['vocab/t d_model/fsdp']               model.embed_tokens.weight                   vocab d_model
    layers.ln1       f32['d_model/t/fsdp']                     model.layers.{i}.input_layernorm.weight     d_model
    layers.w_q       f32['d_model/fsdp n_q_per_kv n_kv/t d_head']  model.layers.{i}.self_attn.q_proj.weight  (n_kv n_q_per_kv d_head) d_model
    layers.w_kv[0]   f32['2 d_model/fsdp n_kv/t d_head'] [0]   model.layers.{i}.self_attn.k_proj.weight    (n_kv d_head) d_model
    layers.w_kv[1]                                     [1]   model.layers.{i}.self_attn.v_proj.weight    (n_kv d_head) d_model
    layers.w_o       f32['d_model/fsdp n_q_per_kv n_kv/t d_head']  model.layers.{i}.self_attn.o_proj.weight  d_model (n_kv n_q_per_kv d_head)
    layers.ln2       f32['d_model/t/fsdp']                     model.layers.{i}.post_attention_layernorm.weight  d_model
    layers.w_gate    f32['d_model/fsdp d_ff/t']                model.layers.{i}.mlp.gate_proj.weight       d_ff d_model
    layers.w_up      f32['d_model/fsdp d_ff/t']                model.layers.{i}.mlp.up_proj.weight         d_ff d_model
    layers.w_down    f32['d_model/fsdp d_ff/t']                model.layers.{i}.mlp.down_proj.weight       d_model d_ff
    final_norm       f32['d_model/t/fsdp']                     model.norm.weight                           d_model
    unembed          f32['vocab/t d_model/fsdp']               lm_head.weight                              vocab d_model

With ``model.qk_norm`` (Qwen3, Qwen3-MoE), each layer also has::

    layers.q_norm    f32['d_head']                              model.layers.{i}.self_attn.q_norm.weight    d_head
    layers.k_norm    f32['d_head']                              model.layers.{i}.self_attn.k_norm.weight    d_head

(without it the model has no such weights, and no tensor is read or written for them).
With experts (the MoE stack, :func:`seqshard.model.layers.stacks`), the layers from
``moe.n_dense_layers`` on are ``moe_layers`` (Hugging Face layer ``{i}`` = n_dense_layers + its
index there), their FFN one tensor per expert ``{x}`` (Qwen3-MoE's names; Mixtral's below)::

    moe_layers.router  f32['d_model/fsdp experts']             model.layers.{i}.mlp.gate.weight            experts d_model
    moe_layers.w_gate  f32['experts/e d_model/d/c d_expert/t'] model.layers.{i}.mlp.experts.{x}.gate_proj.weight  d_expert d_model
    moe_layers.w_up    (as w_gate)                             model.layers.{i}.mlp.experts.{x}.up_proj.weight    d_expert d_model
    moe_layers.w_down  (as w_gate)                             model.layers.{i}.mlp.experts.{x}.down_proj.weight  d_model d_expert

Mixtral calls ``mlp.gate`` ``block_sparse_moe.gate`` and the experts' ``gate_proj``, ``up_proj``,
``down_proj`` ``block_sparse_moe.experts.{x}.w1``, ``w3``, ``w2`` (:data:`RENAMES`). transformers 5
holds each layer's experts fused in memory (``experts.gate_up_proj``) but ``save_pretrained``
writes and ``from_pretrained`` reads these per-expert tensors, as the published checkpoints
have them. ``router_bias`` (``moe.balance=bias``) and the shared experts have no tensor there:
import makes the bias zeros (Mixtral and Qwen3-MoE choose by the router's logits alone) and
export refuses a nonzero one (:mod:`seqshard.hf.export`).

DeepSeek-V3 (``model.attention: mla``) has the MLA block's tensors in each layer's attention
(declared in :class:`seqshard.model.mla.MLAWeights`; ``w_q`` without the query latent, ``w_q_a``,
``q_a_norm``, ``w_q_b`` with it)::

    layers.w_q       f32['d_model/fsdp n_q_per_kv n_kv/t d_head']  self_attn.q_proj.weight            (n_kv n_q_per_kv d_head) d_model
    layers.w_q_a     f32['d_model/fsdp q_lora']                self_attn.q_a_proj.weight           q_lora d_model
    layers.q_a_norm  f32['q_lora']                             self_attn.q_a_layernorm.weight      q_lora
    layers.w_q_b     f32['q_lora/fsdp n_q_per_kv n_kv/t d_head']  self_attn.q_b_proj.weight         (n_kv n_q_per_kv d_head) q_lora
    layers.w_kv_a    f32['d_model/fsdp kv_a']                  self_attn.kv_a_proj_with_mqa.weight kv_a d_model
    layers.kv_a_norm f32['kv_lora']                            self_attn.kv_a_layernorm.weight     kv_lora
    layers.w_kv_b    f32['kv_lora/fsdp n_kv/t d_kv_b']         self_attn.kv_b_proj.weight          (n_kv d_kv_b) kv_lora
    layers.w_o       f32['d_model/fsdp n_q_per_kv n_kv/t d_v'] self_attn.o_proj.weight             d_model (n_kv n_q_per_kv d_v)

its dense layers' FFN as Llama's, its experts as Qwen3-MoE's, and (:data:`EXTRA`: weights the
other families have no tensor for) the router bias and the shared experts::

    moe_layers.router_bias  f32['experts']                     mlp.gate.e_score_correction_bias    experts
    moe_layers.s_gate  f32['d_model/fsdp d_shared/t']          mlp.shared_experts.gate_proj.weight d_shared d_model
    moe_layers.s_up    (as s_gate)                             mlp.shared_experts.up_proj.weight   d_shared d_model
    moe_layers.s_down  (as s_gate)                             mlp.shared_experts.down_proj.weight d_model d_shared

and its multi-token prediction modules (``model.mtp``: the stack ``mtp``, declared in
:class:`seqshard.model.mtp_block.MTPWeights`), module k as the layer ``{i}`` = n_layers + k
after the model's, as DeepSeek's checkpoints hold them::

    mtp.enorm        f32['d_model/t/fsdp']                     model.layers.{i}.enorm.weight       d_model
    mtp.hnorm        f32['d_model/t/fsdp']                     model.layers.{i}.hnorm.weight       d_model
    mtp.w_eh         f32['d_model/fsdp mtp_in/t']              model.layers.{i}.eh_proj.weight     d_model mtp_in
    mtp.head_norm    f32['d_model/t/fsdp']                     model.layers.{i}.shared_head.norm.weight  d_model
    mtp.ln1, mtp.w_q_a, ..., mtp.router, mtp.w_gate, ...       the layer's self_attn.*, mlp.*, input_layernorm,
                                                               post_attention_layernorm, as the model's layers'
    embed    (a copy, :data:`COPIES`)                          model.layers.{i}.embed_tokens.weight       vocab d_model
    unembed  (a copy)                                          model.layers.{i}.shared_head.head.weight   vocab d_model

``eh_proj``'s input is ``[enorm(embedding) | hnorm(hidden)]`` (DeepSeek's order, seqshard's
``mtp_in``), so it is copied as it is. The modules' FFN is the MoE's when the model has
experts (their layer index is past first_k_dense_replace), else the dense one. The last two
rows are no weights of seqshard's: each module shares the model's embedding and output head,
which DeepSeek's files hold again per module. Export writes them; import checks they equal
the model's own (``lm_head.weight``; ``embed_tokens`` when tied) and reads nothing from them.

MLA's rows are copied as they are in either RoPE pairing (``mla.rope_interleave``): seqshard
rotates the rope part as transformers' DeepSeek-V3 does, gathering interleaved pairs (2i, 2i+1)
into halves first, for queries and keys alike (:func:`seqshard.model.mla.mla_rope`).

Transpositions: Hugging Face linear weights are ``[out, in]`` (``y = x @ W.T``); seqshard's are
``[d_model, ...]`` for every projection, so q, k, v, gate and up are transposed and o and down
are not (their ``in`` is the wide side already).

Head order: Hugging Face's query head ``h`` reads kv head ``h // n_q_per_kv`` (``repeat_kv``),
so its flat head index is ``(n_kv n_q_per_kv)``, kv head major; seqshard keeps the two apart,
and a t shard holds whole kv heads with their query heads.

RoPE pairing: seqshard rotates pairs (i, i + d_head/2) of each head, as Hugging Face's
``rotate_half`` does, so q and k rows are copied as they are. Hugging Face Llama checkpoints
are in that convention (``convert_llama_weights_to_hf.py`` permutes Meta's q and k rows into it);
Meta's original ``consolidated.*.pth`` files pair (2i, 2i+1) and are not read here (convert them
with transformers' script first). How we know: tests/hf/test_load.py holds seqshard's logits to
transformers' ``LlamaForCausalLM`` within 1e-5 both ways, and shows that the other pairing
moves them by orders of magnitude more.

Tied embeddings (``tie_word_embeddings: true``: no ``lm_head.weight`` in the files) import as a
copy: seqshard's ``unembed`` is its own weight from then on.
"""

from __future__ import annotations

import dataclasses
import functools

import einops
import numpy as np

from seqshard.hf.hf_config import DEEPSEEK_V3, LLAMA, MIXTRAL
from seqshard.model.config import MLAConfig, ModelConfig, MoEConfig, MTPConfig
from seqshard.model.layers import MTP_STACK, STACK_NAMES
from seqshard.model.weights import (
    Weights,
    stack_layer_types,
    weight_info_by_path,
    weights_type,
)
from seqshard.shardlib.notation import Shape
from seqshard.shardlib.shardtypes import ArrayType, type_tree

__all__ = [
    "COPIES",
    "EXTRA",
    "RENAMES",
    "TABLE",
    "TensorRow",
    "hf_tensor_names",
    "row_of",
    "table",
]

RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    MIXTRAL: (
        (".mlp.gate.", ".block_sparse_moe.gate."),
        (".mlp.experts.{x}.gate_proj.", ".block_sparse_moe.experts.{x}.w1."),
        (".mlp.experts.{x}.up_proj.", ".block_sparse_moe.experts.{x}.w3."),
        (".mlp.experts.{x}.down_proj.", ".block_sparse_moe.experts.{x}.w2."),
    ),
}
"""An architecture's tensor names where they differ from the declared (Llama, Qwen3) ones."""

_MOE_LAYER = "model.layers.{i}.mlp."
EXTRA: dict[str, dict[str, tuple[str, str]]] = {
    DEEPSEEK_V3: {
        "router_bias": (_MOE_LAYER + "gate.e_score_correction_bias", "experts"),
        "s_gate": (_MOE_LAYER + "shared_experts.gate_proj.weight", "d_shared d_model"),
        "s_up": (_MOE_LAYER + "shared_experts.up_proj.weight", "d_shared d_model"),
        "s_down": (_MOE_LAYER + "shared_experts.down_proj.weight", "d_model d_shared"),
    },
}
"""An architecture's tensors for a layer's weights that declare none, because the other
architectures have no such tensor (the weight's name in its layer -> tensor name, layout):
DeepSeek-V3's router bias and shared experts, in the MoE layers and the multi-token
prediction modules alike."""

COPIES: dict[str, dict[str, str]] = {
    DEEPSEEK_V3: {
        "embed": "model.layers.{i}.embed_tokens.weight",
        "unembed": "model.layers.{i}.shared_head.head.weight",
    },
}
"""An architecture's tensors that each multi-token prediction module's layer ``{i}`` holds as
a copy of a weight outside the layers (weight -> tensor name, in the weight's layout):
DeepSeek-V3's checkpoints hold the embedding and the output head again per module, which
seqshard's modules share with the model."""


@dataclasses.dataclass(frozen=True)
class TensorRow:
    """One seqshard weight (or one part of it: ``part`` indexes a leading literal dimension,
    ``w_kv``'s k and v; an expert's block of an expert weight) and the Hugging Face tensor it is."""

    field: str  # 'embed', 'layers.w_q', 'moe_layers.w_gate', 'mtp.w_eh', ...
    hf_name: str  # '{i}' stands for the layer, '{x}' for the expert
    hf_layout: str  # the Hugging Face tensor's dims in seqshard's names (einops)
    part: int | None = None
    # the seqshard weight's type, for one layer if stacked: f32['d_model/fsdp d_ff/t']
    weight_type: ArrayType | None = dataclasses.field(default=None, compare=False, repr=False)
    # a multi-token prediction module's copy of the (unstacked) weight ``field`` (COPIES)
    copy: bool = False

    @property
    def stack(self) -> str | None:
        """The stacked field it is one layer's weight of (``'layers'``, ``'moe_layers'``,
        ``'mtp'``)."""
        head = self.field.split(".")[0]
        return head if head in (*STACK_NAMES, MTP_STACK) else None

    @property
    def stacked(self) -> bool:
        """Whether the weight is one of the scanned layers' (``{i}`` in the HF name)."""
        return self.stack is not None

    @property
    def per_expert(self) -> bool:
        """Whether each expert is a tensor of its own (``{x}`` in the HF name)."""
        return "{x}" in self.hf_name

    @property
    def block_type(self) -> ArrayType:
        """One Hugging Face tensor's block of the weight: the type with the part or expert dim
        dropped (``w_kv[0]``: ``f32['d_model/fsdp n_kv/t d_head']``)."""
        t = self.weight_type
        dropped = (self.part is not None) + self.per_expert
        return ArrayType(t.dtype, Shape(t.shape.dims[dropped:]), t.dtype_name)

    @property
    def layout(self) -> str:
        """The seqshard side in einops form: ``'d_model n_kv d_head'``."""
        return " ".join(d.label for d in self.block_type.shape.dims)

    def of(self, weights: Weights):
        """The weight this row names in ``weights`` (whole: every layer, every part)."""
        obj = weights
        for name in self.field.split("."):
            obj = getattr(obj, name)
        return obj

    def hf_name_of(self, layer: int | None, expert: int | None = None) -> str:
        return self.hf_name.format(i=layer, x=expert) if "{i}" in self.hf_name else self.hf_name

    def hf_shape(self, cfg: ModelConfig) -> tuple[int, ...]:
        """The Hugging Face tensor's shape for ``cfg``: ``q_proj`` is ``(n_heads*d_head, d_model)``."""
        sizes = cfg.dim_sizes()
        return tuple(
            int(np.prod([sizes[name] for name in group.strip("()").split()]))
            for group in _groups(self.hf_layout)
        )

    def to_hf(self, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        """seqshard's block (one layer, one part) -> the Hugging Face tensor (a view if it can be)."""
        return einops.rearrange(x, f"{self.layout} -> {self.hf_layout}")

    def from_hf(self, x: np.ndarray, cfg: ModelConfig) -> np.ndarray:
        """The Hugging Face tensor -> seqshard's block (one layer, one part)."""
        sizes = {k: v for k, v in cfg.dim_sizes().items() if k in self.layout.split()}
        return einops.rearrange(x, f"{self.hf_layout} -> {self.layout}", **sizes)


def _groups(layout: str) -> list[str]:
    """``'(n_kv d_head) d_model'`` -> ``['(n_kv d_head)', 'd_model']``."""
    out, depth, word = [], 0, ""
    for ch in layout + " ":
        if ch == " " and depth == 0:
            if word:
                out.append(word)
            word = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        word += ch
    return out


def _types(cls: type) -> dict[str, ArrayType]:
    """``'embed'``, ``'layers.w_q'``, ``'moe_layers.w_gate'`` (one layer's type) -> the type
    of each weight of the weights dataclass ``cls``."""
    out = {}
    tree, layers = type_tree(cls), stack_layer_types(cls)
    for field, t in tree.__dict__.items():
        if field in layers:  # one layer's types
            out.update({f"{field}.{k}": v for k, v in type_tree(layers[field]).__dict__.items()})
        else:
            out[field] = t
    return out


@functools.cache
def _every_weight(moe: bool, attention: str) -> tuple[type, ...]:
    """The weights' dataclasses of configs that together hold every weight a Hugging Face
    family may have: q and k norms (grouped-query attention), the query latent and the direct
    query projection and the multi-token prediction modules (multi-head latent attention: two
    configs), and with ``moe`` a dense stack and an MoE one (shared experts too)."""
    experts = MoEConfig(n_experts=2, top_k=1, d_ff=8, n_shared=1, n_dense_layers=1)
    base = ModelConfig(n_layers=2, moe=experts if moe else MoEConfig())
    if attention == "gqa":
        return (weights_type(dataclasses.replace(base, qk_norm=True)),)
    mla = dataclasses.replace(
        base, attention="mla", n_q_per_kv=1, d_head=48, mla=MLAConfig(), mtp=MTPConfig(depth=1)
    )
    latent = dataclasses.replace(mla, mla=MLAConfig(q_lora_rank=16))
    return weights_type(latent), weights_type(mla)


def _merged(orders: list[list[str]]) -> list[str]:
    """The fields of several weights dataclasses once each, each new one after the field it
    follows in its own class (the declared order: Hugging Face's file order)."""
    out: list[str] = []
    for order in orders:
        for i, name in enumerate(order):
            if name not in out:
                before = [out.index(p) for p in order[:i] if p in out]
                out.insert(max(before, default=-1) + 1, name)
    return out


@functools.cache
def table(moe: bool = False, architecture: str = LLAMA) -> tuple[TensorRow, ...]:
    """Every seqshard weight with a Hugging Face tensor once (``w_kv`` as its two parts), in
    Hugging Face's file order, in ``architecture``'s names: every weight a dense model (with
    ``moe``, one with dense and MoE layers; with experts or not, the multi-token prediction
    modules of an architecture that has them) may have. Read off the weights' declarations
    (each block declares its weights' Hugging Face names beside its math), :data:`EXTRA`, and
    the module's copies of the embedding and the head (:data:`COPIES`, after the weight)."""
    classes = _every_weight(moe, "mla" if architecture == DEEPSEEK_V3 else "gqa")
    infos = [weight_info_by_path(cls) for cls in classes]
    types = {k: v for cls in reversed(classes) for k, v in _types(cls).items()}
    extra, copies = EXTRA.get(architecture, {}), COPIES.get(architecture, {})
    rows = []
    for field in _merged([list(info) for info in infos]):
        info = next(i[field] for i in infos if field in i)
        name = field.split(".")[-1]
        stacked = "." in field  # a layer's weight (EXTRA names those)
        hf = info.hf or ((extra[name],) if stacked and name in extra else ())
        for part, (hf_name, hf_layout) in enumerate(hf):
            for ours, theirs in RENAMES.get(architecture, ()):
                hf_name = hf_name.replace(ours, theirs)
            part_of = part if len(hf) > 1 else None
            rows.append(TensorRow(field, hf_name, hf_layout, part_of, types[field]))
            if field in copies:
                rows.append(TensorRow(field, copies[field], hf_layout, None, types[field], True))
    return tuple(rows)


TABLE: tuple[TensorRow, ...] = table()
"""The dense model's rows in Llama's and Qwen3's names."""


def row_of(
    hf_name: str, rows: tuple[TensorRow, ...] = TABLE
) -> tuple[TensorRow, int | None] | None:
    """The row and layer of a Hugging Face tensor name among ``rows``, or None if no row has it
    (the first row that has it: a DeepSeek-V3 layer's names are its modules' too)."""
    for row in rows:
        if "{i}" not in row.hf_name:
            if hf_name == row.hf_name:
                return row, None
            continue
        head, tail = row.hf_name.split("{i}")
        middle = hf_name[len(head) : len(hf_name) - len(tail)]
        if hf_name.startswith(head) and hf_name.endswith(tail) and middle.isdigit():
            return row, int(middle)
    return None


def hf_tensor_names(
    cfg: ModelConfig, architecture: str = LLAMA
) -> list[tuple[TensorRow, tuple[int, ...], str]]:
    """(row, where in the seqshard weight, Hugging Face name) of every tensor of ``cfg``'s
    model in ``architecture``'s names, in file order: the embedding, then each layer's tensors,
    then each multi-token prediction module's (layer n_layers + k: the copy of the embedding,
    its weights, the copy of the head), then the final norm and the unembedding. Where: ``()``
    for a weight outside the layers (and a copy of one), else (the layer's index in its stack,
    [the expert,] [the part]). A weight with no element the config leaves off (``q_norm``
    without ``model.qk_norm``) has no tensor."""
    present = set(weight_info_by_path(weights_type(cfg)))
    # The modules' FFN is the MoE's whenever the model has experts, with MoE layers or not.
    rows = [
        r
        for r in table(cfg.moe.enabled, architecture)
        if r.field in present and np.prod(r.hf_shape(cfg)) > 0
    ]
    sizes = cfg.dim_sizes()
    n_dense = sizes["layers"]

    def layer(stack: str, j: int, i: int) -> list[tuple[TensorRow, tuple[int, ...], str]]:
        out = []
        for r in rows:
            if r.copy and stack == MTP_STACK:
                out.append((r, (), r.hf_name_of(i)))
            if r.stack != stack:
                continue
            part = () if r.part is None else (r.part,)
            experts = range(sizes["experts"]) if r.per_expert else [None]
            for x in experts:
                where = (j, *(() if x is None else (x,)), *part)
                out.append((r, where, r.hf_name_of(i, x)))
        return out

    outer = [r for r in rows if not r.stacked and not r.copy]
    first = [(r, (), r.hf_name) for r in outer if r.field == "embed"]
    layers = []
    for i in range(cfg.n_layers):
        layers += layer("layers", i, i) if i < n_dense else layer("moe_layers", i - n_dense, i)
    for k in range(cfg.mtp.depth):
        layers += layer(MTP_STACK, k, cfg.n_layers + k)
    last = [(r, (), r.hf_name) for r in outer if r.field != "embed"]
    return first + layers + last
