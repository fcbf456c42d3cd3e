"""The one table between seqshard's weights and a Hugging Face Llama checkpoint's tensors.

Each row names a seqshard weight, its Hugging Face tensor (``{i}``: the layer) and that tensor's
layout written in seqshard's dimension names, the names of the weight types
(:mod:`seqshard.model.weights`). The seqshard side of a row is its weight type with the mesh
axes left out (and the ``layers`` dimension, which is ``{i}``); einops moves between the two::

    seqshard weight  type                                     Hugging Face tensor                         its layout
    embed            f32['vocab/t d_model/d/e/c']               model.embed_tokens.weight                   vocab d_model
    layers.ln1       f32['d_model/t/d/e/c']                     model.layers.{i}.input_layernorm.weight     d_model
    layers.w_q       f32['d_model/d/e/c n_q_per_kv n_kv/t d_head']  model.layers.{i}.self_attn.q_proj.weight  (n_kv n_q_per_kv d_head) d_model
    layers.w_kv[0]   f32['2 d_model/d/e/c n_kv/t d_head'] [0]   model.layers.{i}.self_attn.k_proj.weight    (n_kv d_head) d_model
    layers.w_kv[1]                                     [1]   model.layers.{i}.self_attn.v_proj.weight    (n_kv d_head) d_model
    layers.w_o       f32['d_model/d/e/c n_q_per_kv n_kv/t d_head']  model.layers.{i}.self_attn.o_proj.weight  d_model (n_kv n_q_per_kv d_head)
    layers.ln2       f32['d_model/t/d/e/c']                     model.layers.{i}.post_attention_layernorm.weight  d_model
    layers.w_gate    f32['d_model/d/e/c d_ff/t']                model.layers.{i}.mlp.gate_proj.weight       d_ff d_model
    layers.w_up      f32['d_model/d/e/c d_ff/t']                model.layers.{i}.mlp.up_proj.weight         d_ff d_model
    layers.w_down    f32['d_model/d/e/c d_ff/t']                model.layers.{i}.mlp.down_proj.weight       d_model d_ff
    final_norm       f32['d_model/t/d/e/c']                     model.norm.weight                           d_model
    unembed          f32['vocab/t d_model/d/e/c']               lm_head.weight                              vocab d_model

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
with transformers' script first). How we know: tests/test_hf.py holds seqshard's logits to
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

from seqshard.model.config import ModelConfig
from seqshard.model.weights import Layer, Weights, weight_info_by_path
from seqshard.shardlib.notation import Shape
from seqshard.shardlib.shardtypes import ArrayType, type_tree

__all__ = ["TABLE", "TensorRow", "hf_tensor_names", "row_of"]


@dataclasses.dataclass(frozen=True)
class TensorRow:
    """One seqshard weight (or one part of it: ``part`` indexes a leading literal dimension,
    ``w_kv``'s k and v) and the Hugging Face tensor it is."""

    field: str  # 'embed', 'layers.w_q', ...
    hf_name: str  # '{i}' stands for the layer
    hf_layout: str  # the Hugging Face tensor's dims in seqshard's names (einops)
    part: int | None = None

    @property
    def stacked(self) -> bool:
        """Whether the weight is one of the scanned layers' (``{i}`` in the HF name)."""
        return self.field.startswith("layers.")

    @property
    def weight_type(self) -> ArrayType:
        """The seqshard weight's type, for one layer if stacked: ``f32['d_model/d/e/c d_ff/t']``."""
        return _types()[self.field]

    @property
    def block_type(self) -> ArrayType:
        """One Hugging Face tensor's block of the weight: the type with the part dim dropped
        (``w_kv[0]``: ``f32['d_model/d/e/c n_kv/t d_head']``)."""
        t = self.weight_type
        return ArrayType(
            t.dtype, Shape(t.shape.dims[0 if self.part is None else 1 :]), t.dtype_name
        )

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

    def hf_name_of(self, layer: int | None) -> str:
        return self.hf_name.format(i=layer) if self.stacked else self.hf_name

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


@functools.cache
def _types() -> dict[str, ArrayType]:
    """``'embed'`` and ``'layers.w_q'`` (one layer's type) -> the weight's type."""
    weights, layer = type_tree(Weights), type_tree(Layer)
    out = {
        f.name: getattr(weights, f.name) for f in dataclasses.fields(Weights) if f.name != "layers"
    }
    out.update({f"layers.{f.name}": getattr(layer, f.name) for f in dataclasses.fields(Layer)})
    return out


TABLE: tuple[TensorRow, ...] = tuple(
    TensorRow(field, hf_name, hf_layout, part=part if len(info.hf) > 1 else None)
    for field, info in weight_info_by_path().items()
    for part, (hf_name, hf_layout) in enumerate(info.hf)
)
"""Every seqshard weight once (``w_kv`` as its two parts), in Hugging Face's file order: read
off the weights' declarations (each block declares its weights' Hugging Face names beside its
math: :mod:`seqshard.model.attention_block`, :mod:`seqshard.model.swiglu`, and
:mod:`seqshard.model.weights` for the embedding and the head)."""


def row_of(hf_name: str) -> tuple[TensorRow, int | None] | None:
    """The row and layer of a Hugging Face tensor name, or None if no row has it."""
    for row in TABLE:
        if not row.stacked:
            if hf_name == row.hf_name:
                return row, None
            continue
        head, tail = row.hf_name.split("{i}")
        middle = hf_name[len(head) : len(hf_name) - len(tail)]
        if hf_name.startswith(head) and hf_name.endswith(tail) and middle.isdigit():
            return row, int(middle)
    return None


def hf_tensor_names(cfg: ModelConfig) -> list[tuple[TensorRow, int | None, str]]:
    """(row, layer, Hugging Face name) of every tensor of ``cfg``'s model, in file order: the
    embedding, then each layer's tensors, then the final norm and the unembedding."""
    first = [(r, None, r.hf_name) for r in TABLE if not r.stacked and r.field == "embed"]
    layers = [(r, i, r.hf_name_of(i)) for i in range(cfg.n_layers) for r in TABLE if r.stacked]
    last = [(r, None, r.hf_name) for r in TABLE if not r.stacked and r.field != "embed"]
    return first + layers + last
