"""The mesh axes seqshard knows: one table of each axis's name, meaning and link.

    MESH_AXES   p d e c t, outermost first (the order of a mesh's devices)
    link        'outer': spans the machine, across its slower links (p, d: their transfers can
                wait behind compute); 'inner': kept inside one fast domain, a node's NVLink or a
                slice's ICI (e, c, t: their transfers sit on each layer's critical path)

Every consumer reads this table: spec parsing and the typed shard_map (an axis a mesh lacks has
size 1), the meshes seqshard builds (:mod:`seqshard.mesh`), the config's ``mesh`` section
(:class:`seqshard.config.MeshConfig`, one field per axis) and the planner's links. Adding an
axis is one row here, plus the model's specs that split over it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

__all__ = ["AXES", "MESH_AXES", "MeshAxis", "full_axis_sizes"]


@dataclasses.dataclass(frozen=True)
class MeshAxis:
    """One mesh axis: its name in specs (``'B/d'``), what splitting over it means, and the
    link class its collectives cross."""

    name: str
    meaning: str
    link: Literal["outer", "inner"]


MESH_AXES: tuple[MeshAxis, ...] = (
    MeshAxis(
        "p",
        "pipeline: stages of the layer stack (layers/p); microbatches flow between them",
        "outer",
    ),
    MeshAxis("d", "data / FSDP: batch rows, and weight rows (d_model) at rest", "outer"),
    MeshAxis(
        "e",
        "expert: routed experts (experts/e); elsewhere data parallelism, batch rows and weight "
        "rows as d",
        "inner",
    ),
    MeshAxis("c", "context: the sequence, in zigzag order (L@zigzag/c); weight rows as d", "inner"),
    MeshAxis(
        "t", "tensor (Megatron): heads, d_ff, vocab, and the residual's d_model or rows", "inner"
    ),
)
"""Every mesh axis seqshard knows, outermost first (the order of a mesh's devices)."""

AXES: tuple[str, ...] = tuple(a.name for a in MESH_AXES)


def full_axis_sizes(shape: Mapping[str, int], what: str = "the mesh") -> dict[str, int]:
    """Every known axis's size on a mesh of ``shape`` (axis name -> size), in table order; an
    axis the mesh lacks has size 1 (a mesh built by hand with fewer axes). An axis name
    seqshard does not know is an error naming the known ones."""
    unknown = sorted(set(shape) - set(AXES))
    if unknown:
        raise ValueError(
            f"unknown mesh axes {unknown} in {what}: seqshard's mesh axes are "
            + ", ".join(f"{a.name} ({a.meaning})" for a in MESH_AXES)
            + " (an axis left out has size 1)."
        )
    return {name: shape.get(name, 1) for name in AXES}
