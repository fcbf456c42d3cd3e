"""The model's weight matrices as the declarations give them (``Weight.matrix``): each weight a
stack of linear maps, its type's dims split into the stacked ones (S), the maps' inputs (In)
and outputs (Out). Muon orthogonalizes these (:mod:`seqshard.train.muon`); the planner counts
their Newton-Schulz FLOPs (:func:`newton_schulz_flops`)::

    layers.w_q    'layers/p d_model/fsdp n_q_per_kv n_kv/t d_head'   ->  'S/p In/d/e/c Out/t'
                   S = layers,  In = d_model,  Out = n_q_per_kv n_kv d_head
    layers.w_kv   'layers/p 2 d_model/fsdp n_kv/t d_head'            S = layers 2 (k's and v's)
    moe.w_gate    'moe_layers/p experts/e d_model/d/c d_expert/t'    S = moe_layers experts
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from seqshard.model.config import ModelConfig
from seqshard.model.weights import weight_info_by_path, weight_types, weights_type
from seqshard.shardlib.notation import Dim
from seqshard.shardlib.shardtypes import ArrayType

__all__ = ["MatrixStack", "flat_spec", "matrix_stacks", "newton_schulz_flops"]


@dataclasses.dataclass(frozen=True)
class MatrixStack:
    """One weight as a stack of matrices: its type, and which of its dims are stacked (S), the
    matrices' inputs (In) and outputs (Out), by position."""

    path: str  # 'layers.w_q'
    type: ArrayType
    stacked: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    def _dims(self, which: tuple[int, ...]) -> list[Dim]:
        return [self.type.shape.dims[i] for i in which]

    def _axes(self, which: tuple[int, ...]) -> tuple[str, ...]:
        return tuple(a for d in self._dims(which) for a in d.axes)

    @property
    def axes(self) -> tuple[tuple[str, ...], ...]:
        """The mesh axes splitting S, In and Out (``(('p',), ('d', 'e', 'c'), ('t',))``)."""
        return tuple(self._axes(dims) for dims in self._order())

    @property
    def spec(self) -> str:
        """Its layout flattened to three dims: ``'S/p In/d/e/c Out/t'``."""
        return flat_spec(*self.axes)

    def sizes(self, dim_sizes: dict[str, int]) -> tuple[int, int, int]:
        """(matrices, fan in, fan out) of the whole weight."""
        shape = self.type.global_shape(dim_sizes)
        return tuple(math.prod(shape[i] for i in dims) for dims in self._order())

    def _order(self) -> tuple[tuple[int, ...], ...]:
        return self.stacked, self.inputs, self.outputs

    def flattened(self, x: jax.Array) -> jax.Array:
        """This device's block ``x`` as 'S In Out' (its dims regrouped, then merged)."""
        perm = self.stacked + self.inputs + self.outputs
        y = jnp.transpose(x, perm)
        return y.reshape([math.prod(x.shape[i] for i in dims) for dims in self._order()])

    def unflattened(self, y: jax.Array, block_shape: tuple[int, ...]) -> jax.Array:
        """:meth:`flattened`'s inverse, back to a block of shape ``block_shape``."""
        perm = self.stacked + self.inputs + self.outputs
        y = y.reshape([block_shape[i] for i in perm])
        return jnp.transpose(y, [perm.index(i) for i in range(len(perm))])


def matrix_stacks(cfg: ModelConfig) -> dict[str, MatrixStack]:
    """Each weight of ``cfg`` that declares a ``matrix``, by path: the weights Muon takes."""
    cls = weights_type(cfg)
    types = dict(weight_types(cfg))
    out = {}
    for path, info in weight_info_by_path(cls).items():
        if info.matrix is None or path not in types:
            continue
        t = types[path]
        labels = [d.label for d in t.shape.dims]
        ins, outs = (tuple(labels.index(x) for x in part.split()) for part in info.matrix)
        stacked = tuple(i for i in range(len(labels)) if i not in ins + outs)
        out[path] = MatrixStack(path, t, stacked, ins, outs)
    return out


def flat_spec(stack: tuple[str, ...], inputs: tuple[str, ...], outputs: tuple[str, ...]) -> str:
    """``'S/p In/d/e/c Out/t'`` from the axes splitting each."""
    parts = zip(("S", "In", "Out"), (stack, inputs, outputs), strict=True)
    return " ".join("/".join((label, *axes)) for label, axes in parts)


def newton_schulz_flops(cfg: ModelConfig, steps: int) -> int:
    """The matmul FLOPs of ``steps`` Newton-Schulz iterations on every matrix of ``cfg`` (all
    devices; the zero matrices a stack is padded with not counted): per matrix of m <= n, each
    step's ``X X^T`` (2 m^2 n), ``A A`` (2 m^3) and ``(b A + c A A) X`` (2 m^2 n)."""
    total = 0
    for s in matrix_stacks(cfg).values():
        count, fan_in, fan_out = s.sizes(cfg.dim_sizes())
        m, n = sorted((fan_in, fan_out))
        total += count * steps * (4 * m * m * n + 2 * m**3)
    return total
