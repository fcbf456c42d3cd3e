"""The mesh axes seqshard knows: one table of each axis's name, meaning and link.

    MESH_AXES   p d e c t, outermost first (the order of a mesh's devices)
    link        'outer': spans the machine, across its slower links (p, d: their transfers can
                wait behind compute); 'inner': kept inside one fast domain, a node's NVLink or a
                slice's ICI (e, c, t: their transfers sit on each layer's critical path)
    groups      the axis groups the axis belongs to (below)

An *axis group* names what a split means; the table says which axes make it up (each row lists
its groups). A spec may write a group wherever it may write an axis, and it parses as its axes
in table order (major to minor)::

    dp     d e      batch rows            'B/dp L M'       == 'B/d/e L M'
    fsdp   d e c    weight rows at rest   'd_model/fsdp'   == 'd_model/d/e/c'
                                          'M F/t{U_fsdp}'  == 'M F/t{U_d,e,c}'

:data:`GROUPS` maps each group to its axes and :func:`group` looks one up.

Every consumer reads this table: spec parsing and the typed shard_map (an axis a mesh lacks has
size 1), the meshes seqshard builds (:mod:`seqshard.mesh`), the config's ``mesh`` section
(:class:`seqshard.config.MeshConfig`, one field per axis) and the planner's links. Adding an
axis is one row here (with the groups it joins), plus the model's specs that split over it.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Mapping
from typing import Literal

__all__ = [
    "AXES",
    "AXIS_GROUPS",
    "GROUPS",
    "MESH_AXES",
    "MeshAxis",
    "describe_groups",
    "full_axis_sizes",
    "group",
    "group_size",
]


@dataclasses.dataclass(frozen=True)
class MeshAxis:
    """One mesh axis: its name in specs (``'B/d'``), what splitting over it means, the link
    class its collectives cross, and the axis groups (:data:`AXIS_GROUPS`) it belongs to."""

    name: str
    meaning: str
    link: Literal["outer", "inner"]
    groups: tuple[str, ...] = ()


MESH_AXES: tuple[MeshAxis, ...] = (
    MeshAxis(
        "p",
        "pipeline: stages of the layer stack (layers/p); microbatches flow between them",
        "outer",
    ),
    MeshAxis(
        "d", "data / FSDP: batch rows, and weight rows (d_model) at rest", "outer", ("dp", "fsdp")
    ),
    MeshAxis(
        "e",
        "expert: routed experts (experts/e); elsewhere data parallelism, batch rows and weight "
        "rows as d",
        "inner",
        ("dp", "fsdp"),
    ),
    MeshAxis(
        "c",
        "context: the sequence, in zigzag order (L@zigzag/c); weight rows as d",
        "inner",
        ("fsdp",),
    ),
    MeshAxis(
        "t", "tensor (Megatron): heads, d_ff, vocab, and the residual's d_model or rows", "inner"
    ),
)
"""Every mesh axis seqshard knows, outermost first (the order of a mesh's devices)."""

AXES: tuple[str, ...] = tuple(a.name for a in MESH_AXES)

AXIS_GROUPS: Mapping[str, str] = types.MappingProxyType(
    {
        "dp": "batch rows: the batch is split over every data-parallel axis",
        "fsdp": "weight rows at rest: a weight's rows are split over every axis that shards them",
    }
)
"""Each axis group's name and meaning; its axes are the rows of :data:`MESH_AXES` naming it."""

GROUPS: Mapping[str, tuple[str, ...]] = types.MappingProxyType(
    {g: tuple(a.name for a in MESH_AXES if g in a.groups) for g in AXIS_GROUPS}
)
"""Each axis group's axes, in table order (major to minor): ``{'dp': ('d', 'e'), ...}``."""


def _check_groups() -> None:
    """The table's groups are well formed: each is declared, has axes, and its name is an
    identifier that is no axis's name (a spec could not tell them apart)."""
    for a in MESH_AXES:
        undeclared = [g for g in a.groups if g not in AXIS_GROUPS]
        if undeclared:
            raise ValueError(
                f"mesh axis {a.name!r} names undeclared groups {undeclared}: declare them in "
                f"AXIS_GROUPS (its groups are {list(AXIS_GROUPS)})."
            )
    for g, axes in GROUPS.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", g) or g in AXES:
            raise ValueError(
                f"axis group {g!r} must be an identifier that is not a mesh axis ({AXES})."
            )
        if not axes:
            raise ValueError(f"axis group {g!r} has no axes: add it to a MESH_AXES row's groups.")


_check_groups()


def group(name: str) -> tuple[str, ...]:
    """The axes of axis group ``name``, major to minor: ``group('fsdp') == ('d', 'e', 'c')``."""
    if name not in GROUPS:
        raise ValueError(f"unknown axis group {name!r}: the groups are {describe_groups()}.")
    return GROUPS[name]


def group_size(sizes: Mapping[str, int], name: str) -> int:
    """The devices group ``name`` splits over on a mesh of axis ``sizes`` (missing axes 1):
    ``group_size({'d': 4, 'e': 2, 't': 2}, 'dp') == 8``, the ways the batch rows are split."""
    n = 1
    for axis in group(name):
        n *= sizes.get(axis, 1)
    return n


def describe_groups() -> str:
    """The groups for messages: ``'dp = d/e, fsdp = d/e/c'``."""
    return ", ".join(f"{g} = {'/'.join(axes)}" for g, axes in GROUPS.items())


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
