"""Types in the notation: dtype annotations, pytree dataclasses, and what derives from them.

A weight's dtype, shape and sharding are declared once, in a field type::

    @pytree_dataclass
    class Layer:
        w_up: f32['d_model/d d_ff/t']       # rows split over d (FSDP), columns over t

    @pytree_dataclass
    class Weights:
        layers: Array['layers', Layer]      # every field of Layer with a leading 'layers' dim

From the annotations alone come ``partition_specs`` (``P('d', 't')``), ``shardings`` for a
mesh, and ``shape_dtype_structs`` for given sizes (for ``jax.eval_shape``, orbax restore, and
init directly in the sharded layout). ``typed_shard_map`` runs a function whose parameters
and return value are annotated this way under ``jax.shard_map``, checking every block. Mesh
axes of size 1 are not manual there (a 1x1 mesh runs without shard_map), so the ops in it
emit no collective over them.

Scalars are ``f32[()]``. Activation types may be written with bytes, as in the seed:
``bf16[b'B/d L M/t']``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from seqshard.shardlib.axes import AXES, describe_groups, full_axis_sizes
from seqshard.shardlib.notation import Shape, parse_shape
from seqshard.shardlib.shapecheck import (
    ShapeError,
    ShapeScope,
    block_axes_scope,
    check_block,
    check_global,
    shape_scope,
)
from seqshard.shardlib.vma import replication_checked, varying_axes

__all__ = [
    "Array",
    "ArrayType",
    "Stacked",
    "bf16",
    "block_shape",
    "bool_",
    "f16",
    "f32",
    "i32",
    "manual_axes",
    "partition_specs",
    "per_device_unchecked",
    "pytree_dataclass",
    "shape_dtype_structs",
    "shardings",
    "type_tree",
    "typed_shard_map",
    "u32",
    "with_unsplit_dims",
]


@dataclasses.dataclass(frozen=True)
class ArrayType:
    """The type of one array: a dtype and a shape spec, e.g. ``f32['d_model/d d_ff/t']``."""

    dtype: Any
    shape: Shape
    dtype_name: str

    @property
    def partition_spec(self) -> PartitionSpec:
        """``'d_model/t/d n'`` -> ``P(('t', 'd'), None)``; an unsplit dimension is None."""
        return PartitionSpec(*(_axes_entry(d.axes) for d in self.shape.dims))

    def global_shape(self, sizes: Mapping[str, int], where: str = "") -> tuple[int, ...]:
        """The global shape, with names looked up in ``sizes`` (e.g. ``{'d_model': 256}``)."""
        out = []
        for dim in self.shape.dims:
            if dim.literal is not None:
                out.append(dim.literal)
            elif dim.label in sizes:
                out.append(int(sizes[dim.label]))
            else:
                raise ShapeError(
                    f"{where or repr(self)}: no size given for dimension {dim.label!r}; the "
                    f"sizes known are {sorted(sizes)}. Add {dim.label!r} to the sizes."
                )
        return tuple(out)

    def __repr__(self) -> str:
        spec = str(self.shape)
        return f"{self.dtype_name}[{'()' if spec == '()' else repr(spec)}]"


def _axes_entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _block_spec(t: ArrayType, sizes: Mapping[str, int]) -> PartitionSpec:
    """``t.partition_spec`` without axes of size 1: a dimension split over one shard is laid
    out as if unsplit (``'M/t/d'`` is ``P('d')`` when t = 1)."""
    return PartitionSpec(
        *(_axes_entry(tuple(a for a in d.axes if sizes.get(a) != 1)) for d in t.shape.dims)
    )


class _DtypeAnnotation:
    """``f32['M/d F/t']`` makes an :class:`ArrayType`; ``f32[()]`` is a scalar."""

    def __init__(self, name: str, dtype: Any):
        self.name, self.dtype = name, dtype

    def __getitem__(self, spec: str | bytes | tuple) -> ArrayType:
        if spec == ():
            return ArrayType(self.dtype, Shape(()), self.name)
        if isinstance(spec, bytes):
            spec = spec.decode()
        return ArrayType(self.dtype, parse_shape(spec), self.name)

    def __repr__(self) -> str:
        return self.name


f32 = _DtypeAnnotation("f32", jnp.float32)
bf16 = _DtypeAnnotation("bf16", jnp.bfloat16)
f16 = _DtypeAnnotation("f16", jnp.float16)
i32 = _DtypeAnnotation("i32", jnp.int32)
u32 = _DtypeAnnotation("u32", jnp.uint32)
bool_ = _DtypeAnnotation("bool_", jnp.bool_)


@dataclasses.dataclass(frozen=True)
class Stacked:
    """``Array['layers', X]``: every array of ``X`` with leading dimensions ``prefix``."""

    prefix: Shape
    inner: Any


class _ArrayAnnotation:
    def __getitem__(self, args: tuple) -> Stacked:
        if not isinstance(args, tuple) or len(args) != 2:
            raise TypeError(f"write Array['layers', X] with a prefix spec and a type; got {args!r}")
        prefix, inner = args
        return Stacked(parse_shape(prefix.decode() if isinstance(prefix, bytes) else prefix), inner)


Array = _ArrayAnnotation()


def pytree_dataclass(cls: type) -> type:
    """A frozen dataclass registered as a JAX pytree; every field is data (a child)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    jax.tree_util.register_dataclass(cls, data_fields=names, meta_fields=[])
    cls.__seqshard_pytree__ = True
    return cls


def _is_pytree_dataclass(t: Any) -> bool:
    return isinstance(t, type) and getattr(t, "__seqshard_pytree__", False)


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def type_tree(annotation: Any) -> Any:
    """The pytree of :class:`ArrayType` leaves that ``annotation`` describes.

    ``annotation`` is an ArrayType, a ``@pytree_dataclass`` class (giving an instance of it with
    ArrayType fields), ``Array['layers', X]``, or a tuple/list/dict of these.
    """
    if isinstance(annotation, ArrayType):
        return annotation
    if isinstance(annotation, Stacked):
        return jax.tree.map(
            lambda t: ArrayType(
                t.dtype, Shape(annotation.prefix.dims + t.shape.dims), t.dtype_name
            ),
            type_tree(annotation.inner),
            is_leaf=_is_type_leaf,
        )
    if _is_pytree_dataclass(annotation):
        return annotation(**{k: type_tree(v) for k, v in _field_types(annotation).items()})
    if isinstance(annotation, (tuple, list)):
        return type(annotation)(type_tree(a) for a in annotation)
    if isinstance(annotation, dict):
        return {k: type_tree(v) for k, v in annotation.items()}
    origin = typing.get_origin(annotation)
    if origin is tuple:
        return tuple(type_tree(a) for a in typing.get_args(annotation))
    raise TypeError(
        f"{annotation!r} is not a seqshard type: use f32['...'] (or bf16, i32, ...), a "
        f"@pytree_dataclass class, Array['layers', X], or a tuple of these."
    )


def _is_type_leaf(x: Any) -> bool:
    return isinstance(x, ArrayType)


def _map_types(fn: Callable[[ArrayType], Any], annotation: Any) -> Any:
    return jax.tree.map(fn, type_tree(annotation), is_leaf=_is_type_leaf)


def partition_specs(annotation: Any) -> Any:
    """The tree of ``PartitionSpec`` for ``annotation`` (see :func:`type_tree`)."""
    return _map_types(lambda t: t.partition_spec, annotation)


def shardings(annotation: Any, mesh: Mesh) -> Any:
    """The tree of ``NamedSharding`` on ``mesh``. A mesh built by hand may lack some of
    seqshard's axes (:mod:`seqshard.shardlib.axes`): they have size 1, and split nothing."""
    full_axis_sizes(dict(mesh.shape))  # an unknown axis name is an error
    return _map_types(lambda t: _named_sharding(t, mesh), annotation)


def _named_sharding(t: ArrayType, mesh: Mesh) -> NamedSharding:
    """``t``'s sharding on ``mesh``, the axes the mesh lacks (size 1) left out."""
    for axis in t.shape.split_axes:
        if axis not in AXES:
            raise ShapeError(
                f"{t!r} names mesh axis {axis!r}, which seqshard does not know (its axes: "
                f"{', '.join(AXES)}; its axis groups: {describe_groups()}); the mesh has axes "
                f"{dict(mesh.shape)}."
            )
    if all(axis in mesh.shape for axis in t.shape.split_axes):
        return NamedSharding(mesh, t.partition_spec)
    return NamedSharding(
        mesh,
        PartitionSpec(
            *(_axes_entry(tuple(a for a in d.axes if a in mesh.shape)) for d in t.shape.dims)
        ),
    )


def shape_dtype_structs(annotation: Any, sizes: Mapping[str, int], mesh: Mesh | None = None) -> Any:
    """The tree of ``jax.ShapeDtypeStruct``, sharded on ``mesh`` when given.

    ``sizes`` maps dimension names to global sizes, e.g. ``{'layers': 4, 'd_model': 256}``.
    Sizes are checked for divisibility by the mesh axes that split them.
    """

    def struct(path, t: ArrayType) -> jax.ShapeDtypeStruct:
        where = f"{jax.tree_util.keystr(path) or 'array'} {t!r}"
        shape = t.global_shape(sizes, where)
        if mesh is None:
            return jax.ShapeDtypeStruct(shape, t.dtype)
        check_global(t.shape, shape, full_axis_sizes(dict(mesh.shape)), where, scope=ShapeScope())
        return jax.ShapeDtypeStruct(shape, t.dtype, sharding=_named_sharding(t, mesh))

    return jax.tree_util.tree_map_with_path(struct, type_tree(annotation), is_leaf=_is_type_leaf)


def _signature_types(f: Callable) -> tuple[list[str], list[Any], Any]:
    try:
        hints = typing.get_type_hints(f)
    except NameError as e:
        raise TypeError(
            f"typed_shard_map: cannot resolve the annotations of {f.__qualname__}: {e}. Its types "
            f"must be importable names (define weight classes at module level)."
        ) from e
    params = list(inspect.signature(f).parameters.values())
    names, types = [], []
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            raise TypeError(
                f"typed_shard_map: {f.__qualname__} parameter {p.name!r} must be positional."
            )
        if p.name not in hints:
            raise TypeError(
                f"typed_shard_map: parameter {p.name!r} of {f.__qualname__} has no type; annotate "
                f"it (e.g. f32['B/d L M/t']) or bind it with functools.partial first."
            )
        names.append(p.name)
        types.append(hints[p.name])
    if "return" not in hints:
        raise TypeError(f"typed_shard_map: {f.__qualname__} needs a return annotation.")
    return names, types, hints["return"]


def _leaves_with_types(value: Any, annotation: Any, where: str) -> list[tuple[str, Any, ArrayType]]:
    """Pair each array of ``value`` with its ArrayType, checking the tree structures agree."""
    types = type_tree(annotation)
    type_leaves, type_def = jax.tree_util.tree_flatten_with_path(types, is_leaf=_is_type_leaf)
    try:
        value_leaves = type_def.flatten_up_to(value)
    except (ValueError, TypeError) as e:
        raise TypeError(
            f"{where}: the value's structure does not match its type {annotation!r}: {e}"
        ) from None
    return [
        (f"{where}{jax.tree_util.keystr(path)}", v, t)
        for (path, t), v in zip(type_leaves, value_leaves, strict=True)
    ]


def _check_dtype(where: str, value: Any, t: ArrayType) -> None:
    if jnp.dtype(value.dtype) != jnp.dtype(t.dtype):
        raise TypeError(
            f"{where}: expected dtype {jnp.dtype(t.dtype).name} ({t!r}) but got "
            f"{jnp.dtype(value.dtype).name}. Cast it with .astype(jnp.{jnp.dtype(t.dtype).name})."
        )


def _check_explicit_sharding(where: str, value: Any, t: ArrayType, mesh: Mesh) -> None:
    """On Explicit-axis meshes shard_map rejects mismatched inputs: say so in our words."""
    explicit = [
        n
        for n, ty in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if ty == jax.sharding.AxisType.Explicit
    ]
    sharding = getattr(value, "sharding", None)
    if not explicit or not isinstance(sharding, NamedSharding):
        return
    want = PartitionSpec(*t.partition_spec, *([None] * (value.ndim - len(t.partition_spec))))
    have = PartitionSpec(*sharding.spec, *([None] * (value.ndim - len(sharding.spec))))

    def layout(spec: PartitionSpec) -> tuple:  # axes of size 1 split nothing
        entries = ((e,) if isinstance(e, str) else tuple(e or ()) for e in spec)
        return tuple(tuple(a for a in e if mesh.shape.get(a) != 1) for e in entries)

    if layout(want) != layout(have):
        raise ShapeError(
            f"{where}: on a mesh with Explicit axes {explicit} the array must already be "
            f"sharded as its type {t!r} says, {want}, but it is sharded {have}. Reshard it with "
            f"jax.sharding.reshard(x, {want}) or use a mesh with AxisType.Auto axes."
        )


def typed_shard_map(
    f: Callable | None = None,
    /,
    *,
    mesh: Mesh,
    check_vma: bool = True,
    types: tuple[Sequence[Any], Any] | None = None,
) -> Callable:
    """Run ``f`` under ``jax.shard_map`` with in/out specs derived from its annotations.

    ``f`` takes per-device blocks and its parameters and return value are seqshard types::

        @functools.partial(typed_shard_map, mesh=mesh)
        def ffn(x: bf16[b'B/d L M'], w: f32['M/d F/t']) -> bf16[b'B/d L F/t']: ...

    Before anything runs, global arguments are checked: rank, dtype, one global size per name,
    every split dimension divisible by its mesh axes. Inside, each block is checked again and
    a shape scope is open, so the shardops in ``f`` check against the argument types.

    Returning a value declared replicated over an axis (``f32['M F/t']`` after a gather over
    ``d``) needs a value that is *invariant* over that axis when replication is checked
    (``check_vma=True``): produce it with ``shardops.psum`` or
    ``shardops.all_gather(..., to='invarying')``. A plain gather stays varying (its gradient is
    a reduce-scatter) and is rejected here with an error that says so.

    Only the mesh axes of size > 1 are manual (``axis_names`` of ``jax.shard_map``), and the
    specs name only those: an axis of size 1 splits nothing, nothing varies over it, and the
    shardops emit no collective over it. With no axis of size > 1 (a 1x1 mesh) ``f`` runs
    directly on the whole arrays, under whatever jit the caller has, with no shard_map.

    ``types=(argument types, return type)`` gives the types instead of annotations, for a
    function whose types are known only at run time (the optimizer's: one per weight).
    """
    if f is None:
        return functools.partial(typed_shard_map, mesh=mesh, check_vma=check_vma, types=types)
    if types is None:
        names, in_types, out_type = _signature_types(f)
    else:
        in_types, out_type = list(types[0]), types[1]
        names = [f"arg{i}" for i in range(len(in_types))]
    sizes = full_axis_sizes(dict(mesh.shape))  # a mesh built by hand: missing axes have size 1
    manual = frozenset(a for a, n in sizes.items() if n > 1)
    block_spec = functools.partial(_block_spec, sizes=sizes)
    in_specs = tuple(_map_types(block_spec, annotation) for annotation in in_types)
    out_specs = _map_types(block_spec, out_type)
    fname = f.__qualname__

    def body(*blocks):
        with shape_scope() as scope, block_axes_scope(sizes, manual):
            for name, block, t in zip(names, blocks, in_types, strict=True):
                for where, leaf, lt in _leaves_with_types(block, t, f"{fname} argument {name!r}"):
                    check_block(lt.shape, leaf.shape, sizes, where, scope)
                    scope.remember_layout(leaf, lt.shape)
            out = f(*blocks)
            checked = replication_checked()
            for where, leaf, lt in _leaves_with_types(out, out_type, f"{fname} output"):
                leaf = jnp.asarray(leaf)
                _check_dtype(where, leaf, lt)
                check_block(lt.shape, leaf.shape, sizes, where, scope)
                extra = varying_axes(leaf) - set(lt.shape.split_axes) if checked else set()
                if extra:
                    raise TypeError(
                        f"{where}: declared {lt!r}, replicated over mesh axes {sorted(extra)}, but "
                        f"the value varies over them. A tiled all_gather stays varying (its "
                        f"gradient is a reduce-scatter); to return a replicated value, gather it "
                        f"with shardops.all_gather(spec, x, to='invarying') or reduce it with "
                        f"shardops.psum."
                    )
        return out

    if manual:
        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=manual,
            check_vma=check_vma,
        )
    else:  # one device: each block is the whole array (axis_names=frozenset() means all axes)

        def mapped(*args):
            return body(*jax.tree.map(jnp.asarray, args))

    @functools.wraps(f)
    def wrapper(*args):
        if len(args) != len(names):
            raise TypeError(
                f"{fname} takes {len(names)} arguments ({', '.join(names)}), got {len(args)}."
            )
        with shape_scope() as scope:
            for name, arg, t in zip(names, args, in_types, strict=True):
                for where, leaf, lt in _leaves_with_types(arg, t, f"{fname} argument {name!r}"):
                    if not hasattr(leaf, "shape"):
                        leaf = jnp.asarray(leaf)
                    _check_dtype(where, leaf, lt)
                    check_global(lt.shape, leaf.shape, sizes, where, scope)
                    _check_explicit_sharding(where, leaf, lt, mesh)
        return mapped(*args)

    wrapper.in_specs, wrapper.out_specs = in_specs, out_specs
    return wrapper


def with_unsplit_dims(sharding: NamedSharding, ndim: int, at: int, count: int) -> NamedSharding:
    """The layout of ``sharding`` (of an ``ndim``-dimensional array) with ``count`` unsplit
    dimensions inserted before dimension ``at``: ``'B/d M/t'`` -> ``'B/d 1 M/t'`` for a reshape
    that splits a dimension without moving data."""
    spec = (*sharding.spec, *(None,) * (ndim - len(sharding.spec)))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[:at], *(None,) * count, *spec[at:]))


def block_shape(
    t: ArrayType, sizes: Mapping[str, int], mesh_axes: Mapping[str, int]
) -> tuple[int, ...]:
    """The per-device block shape of ``t`` for global ``sizes`` on a mesh with ``mesh_axes``."""
    return tuple(
        size // math.prod(mesh_axes[a] for a in dim.axes)
        for dim, size in zip(t.shape.dims, t.global_shape(sizes), strict=True)
    )


def manual_axes() -> tuple[str, ...]:
    """The manual mesh axes of the shard_map being traced, in mesh order (none outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == jax.sharding.AxisType.Manual
    )


def per_device_unchecked(fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` on each device's own blocks, with replication checking off, inside the
    shard_map being traced: a shard_map nested over its manual axes with every dim unsplit
    (``P()`` in and out), so no data moves. For kernels that state no replication type
    (Pallas); what comes back is typed invariant over every axis, which the caller must
    correct (``lax.pcast(..., to='varying')``)."""
    inner = jax.shard_map(
        fn,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=PartitionSpec(),
        out_specs=PartitionSpec(),
        axis_names=frozenset(manual_axes()),
        check_vma=False,
    )
    return inner(*args)
