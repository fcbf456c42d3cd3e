"""Shape-check scopes: one size per dimension name, mesh axes checked, blocks divisible.

A scope binds each dimension name to its *global* size. A per-device block of ``'M/t'`` on a
mesh with ``t=4`` whose local size is 64 binds ``M = 256``; a later ``'M'`` of size 128 in the
same scope is an error naming both places. ``typed_shard_map`` opens a scope around its body,
so every op inside checks against the argument types; without one, each op checks its own spec
alone. Scopes also remember the layout an array was declared with (a ``typed_shard_map``
argument, or an op's output), so an op whose spec disagrees with it is an error.

:func:`block_axes` tells the ops which mesh axes a block lives on: every axis's size, those of
size 1 included, and which axes are manual. ``typed_shard_map`` makes only the axes of size > 1
manual (a 1x1 mesh: none, and no shard_map at all) and states the rest with
:func:`block_axes_scope`; inside a plain ``jax.shard_map`` they come from the abstract mesh.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping, Sequence

import jax

from seqshard.shardlib.axes import describe_groups
from seqshard.shardlib.notation import Shape

__all__ = [
    "BlockAxes",
    "ShapeError",
    "ShapeScope",
    "block_axes",
    "block_axes_scope",
    "check_block",
    "check_global",
    "check_shape",
    "current_scope",
    "shape_scope",
]


class ShapeError(ValueError):
    """An array's shape does not fit its spec (wrong rank, size, divisibility, or mesh axis)."""


@dataclasses.dataclass
class ShapeScope:
    """Global sizes bound so far (name -> (size, where bound)) and known layouts of arrays."""

    sizes: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    # id(array) -> (array, declared shape); the array is kept so its id is not reused.
    layouts: dict[int, tuple[object, Shape]] = dataclasses.field(default_factory=dict)

    def bind(self, name: str, size: int, where: str) -> None:
        if name in self.sizes and self.sizes[name][0] != size:
            bound, first = self.sizes[name]
            raise ShapeError(
                f"{where}: dimension {name!r} has global size {size}, but {first} gave it size "
                f"{bound}. One name means one size within a scope: rename one of them, or fix "
                f"the array's shape."
            )
        self.sizes.setdefault(name, (size, where))

    def remember_layout(self, array: object, shape: Shape) -> None:
        self.layouts[id(array)] = (array, shape)

    def known_layout(self, array: object) -> Shape | None:
        entry = self.layouts.get(id(array))
        return entry[1] if entry is not None and entry[0] is array else None


_SCOPE: contextvars.ContextVar[ShapeScope | None] = contextvars.ContextVar(
    "seqshard_scope", default=None
)


def current_scope() -> ShapeScope:
    """The innermost open scope, or a fresh throwaway one when none is open."""
    scope = _SCOPE.get()
    return scope if scope is not None else ShapeScope()


@contextlib.contextmanager
def shape_scope(sizes: Mapping[str, int] | None = None) -> Iterator[ShapeScope]:
    """Open a scope in which each dimension name has one global size.

    ``sizes`` pre-binds names, e.g. ``{'d_model': 256}`` from a config.
    """
    scope = ShapeScope()
    for name, size in (sizes or {}).items():
        scope.bind(name, int(size), "the sizes given to shape_scope")
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


@dataclasses.dataclass(frozen=True)
class BlockAxes:
    """The mesh axes a per-device block lives on: each one's size (size 1 included), in mesh
    order, and the manual ones (those ``lax`` collectives and ``lax.axis_index`` may name)."""

    sizes: Mapping[str, int]
    manual: frozenset[str]


_BLOCK_AXES: contextvars.ContextVar[BlockAxes | None] = contextvars.ContextVar(
    "seqshard_block_axes", default=None
)


@contextlib.contextmanager
def block_axes_scope(sizes: Mapping[str, int], manual: frozenset[str]) -> Iterator[BlockAxes]:
    """State the block's mesh axes while tracing a body (``typed_shard_map`` does)."""
    axes = BlockAxes(dict(sizes), frozenset(manual))
    token = _BLOCK_AXES.set(axes)
    try:
        yield axes
    finally:
        _BLOCK_AXES.reset(token)


def block_axes() -> BlockAxes | None:
    """The mesh axes of the block being traced, or None outside any shard_map.

    Inside ``typed_shard_map``: the axes it stated (when the manual axes agree). Else, inside a
    plain ``jax.shard_map``: its manual axes, plus the mesh's other axes of size 1 (one shard
    each, so a block is whole along them).
    """
    mesh = jax.sharding.get_abstract_mesh()
    shape = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    manual = frozenset(
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == jax.sharding.AxisType.Manual
    )
    stated = _BLOCK_AXES.get()
    if stated is not None and stated.manual == manual:
        return stated
    if not manual:
        return None
    return BlockAxes({a: n for a, n in shape.items() if a in manual or n == 1}, manual)


def _check_rank(spec: Shape, shape: Sequence[int], where: str) -> None:
    if len(shape) != len(spec.dims):
        raise ShapeError(
            f"{where}: spec '{spec}' has {len(spec.dims)} dimensions but the array has shape "
            f"{tuple(shape)} ({len(shape)} dimensions). Fix the spec or reshape the array."
        )


def _check_axes(spec: Shape, mesh_axes: Mapping[str, int], where: str) -> None:
    for axis in (*spec.split_axes, *spec.unreduced):
        if axis not in mesh_axes:
            raise ShapeError(
                f"{where}: spec '{spec}' names mesh axis {axis!r}, but the mesh has axes "
                f"{dict(mesh_axes)}. Use one of {tuple(mesh_axes)} or build the mesh with it "
                f"(an axis group stands for its axes: {describe_groups()})."
            )


def _bind_dim(scope: ShapeScope, dim, size: int, spec: Shape, where: str) -> None:
    if dim.literal is not None:
        if size != dim.literal:
            raise ShapeError(
                f"{where}: spec '{spec}' fixes dimension {dim.label} at size {dim.literal}, "
                f"but the array's global size there is {size}."
            )
    else:
        scope.bind(dim.label, size, where)


def _check_order(dim, size: int, mesh_axes: Mapping[str, int], spec: Shape, where: str) -> None:
    """A zigzag dimension is cut into 2c chunks (c the context axis): 2c must divide it."""
    chunks = 2 * mesh_axes.get("c", 1)
    if dim.order == "zigzag" and chunks > 2 and size % chunks:
        raise ShapeError(
            f"{where}: dimension {dim.label} of spec '{spec}' is in zigzag order, cut into "
            f"2c = {chunks} chunks, but its global size {size} is not divisible by {chunks}. "
            f"Choose a sequence length divisible by {chunks} (2 x mesh.c)."
        )


def check_shape(
    spec: Shape,
    shape: Sequence[int],
    mesh_axes: Mapping[str, int],
    where: str,
    scope: ShapeScope | None = None,
    *,
    per_device: bool,
) -> dict[str, int]:
    """Check an array's shape against ``spec``: rank, mesh axes, one global size per name;
    bind and return the global sizes by name.

    ``per_device``: ``shape`` is a per-device block (a dimension split over n shards has
    global size n x block); otherwise it is the global shape, which n must divide."""
    scope = scope if scope is not None else current_scope()
    _check_rank(spec, shape, where)
    _check_axes(spec, mesh_axes, where)
    sizes = {}
    for dim, size in zip(spec.dims, shape, strict=True):
        n_shards = math.prod(mesh_axes[a] for a in dim.axes)
        if per_device:
            size *= n_shards
        elif size % n_shards:
            split = " x ".join(f"{a}={mesh_axes[a]}" for a in dim.axes)
            raise ShapeError(
                f"{where}: dimension {dim.label} of spec '{spec}' has size {size}, which the "
                f"mesh axes splitting it ({split} = {n_shards} shards) do not divide. Choose a "
                f"size divisible by {n_shards} or a mesh whose axes divide {size}."
            )
        _check_order(dim, size, mesh_axes, spec, where)
        _bind_dim(scope, dim, size, spec, where)
        sizes[dim.label] = size
    return sizes


check_block = functools.partial(check_shape, per_device=True)
"""``check_block(spec, block_shape, mesh_axes, where, scope=None)``: a per-device block."""

check_global = functools.partial(check_shape, per_device=False)
"""``check_global(spec, global_shape, mesh_axes, where, scope=None)``: a global array."""
