"""Per-device ops and collectives, each specified by a checked op-spec string.

Call them inside ``jax.shard_map`` (or :func:`seqshard.typed_shard_map`); each array is the
per-device block of a global array whose layout the spec states. Each op checks its inputs
against the spec's left side, works out which mesh axes change, and lowers to exactly one
collective per changed dimension (or none), which it logs for :mod:`seqshard.shardlib.collective_log`
(a step's communication predicted from the notation, nothing compiled)::

    w = all_gather('M/d F/t -> M F/t', w)                  # lax.all_gather over d
    y = einsum_unreduced('B/d L M, M F/t -> B/d L F/t', x, w)   # local, no communication
    z = einsum_unreduced('B/d L F/t, M F/t -> B/d L M', y, w)   # contracts F/t: owes a sum over t
    z = psum_scatter('B/d L M -> B/d L M/t', z)            # lax.psum_scatter over t
    s = psum('B/d L{U_t} -> B/d L', s)                     # lax.psum over t
    x = index_unreduced('[V/t] M, B/d L -> B/d L M', table, ids)  # sharded lookup, owes a sum over t
    g = index_add('B/d L M, B/d L -> V/t M{U_d}', dx, ids, vocab=V)  # its transpose, owes d

Axis order matters: ``M/t/d`` (t major) and ``M/d/t`` are different layouts. Ops that leave a
reduction to the caller are named ``*_unreduced`` (and ``index_add``, seed 001's name for the
transpose of ``index_unreduced``); ``psum`` and ``pmax`` need the spec's ``{U_axis}`` marker
to say which axes they reduce, and, when replication is checked (``check_vma=True``), refuse
to reduce over an axis the value does not vary over (where ``lax.psum`` would silently
multiply by the axis size).

An axis of size 1 costs nothing: no op emits a collective over a mesh axis of size 1 (specs
still name it; ``'M/t/d'`` is ``'M/d'`` when t = 1), and ``axis_index`` of it is 0. The one
exception is a plain ``jax.shard_map`` that makes such an axis manual, with ``check_vma=True``:
there ``psum``, ``pmax`` and ``all_gather(..., to='invarying')`` of a value that varies over it
keep their collective, the only way to make the value invariant. ``typed_shard_map`` makes only
axes of size > 1 manual, so inside it none is ever emitted.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from seqshard.shardlib import collective_log, matmul
from seqshard.shardlib.notation import Dim, OpSpec, Shape, parse_op
from seqshard.shardlib.shapecheck import (
    BlockAxes,
    ShapeError,
    block_axes,
    check_block,
    current_scope,
)
from seqshard.shardlib.vma import replication_checked, varying_axes

__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "einsum_unreduced",
    "index_add",
    "index_unreduced",
    "pmax",
    "psum",
    "psum_scatter",
    "reorder",
    "ring_shift",
    "split",
    "zigzag_chunks",
]


# ---------------------------------------------------------------------------------------------
# Shared checking


def _block_axes(where: str) -> BlockAxes:
    """The block's mesh axes (see :func:`seqshard.shardlib.shapecheck.block_axes`), or a clear error."""
    axes = block_axes()
    if axes is None:
        # A mesh set with jax.set_mesh outside shard_map has no manual axes: still not a block.
        mesh = jax.sharding.get_abstract_mesh()
        raise ShapeError(
            f"{where}: shardops run on per-device blocks inside jax.shard_map or "
            f"seqshard.typed_shard_map, but this call is outside one ("
            f"{'no mesh is active' if mesh.empty else f'the mesh {dict(mesh.shape)} has no manual axes'})."
        )
    return axes


class _Call:
    """One op call being checked: its name, spec, the block's mesh axes, the shape scope.

    ``axes`` holds every mesh axis of the block with its size, axes of size 1 included (which
    need not be manual); collectives run only over the axes :meth:`over` keeps.
    """

    def __init__(self, name: str, spec: str, arrays: Sequence[jax.Array], n_inputs: int | None):
        self.name, self.text = name, spec
        self.where = f"{name}({spec!r})"
        self.op: OpSpec = parse_op(spec)
        if n_inputs is not None and len(self.op.inputs) != n_inputs:
            raise ShapeError(
                f"{self.where}: {name} takes {n_inputs} input operand(s) left of '->', the spec "
                f"has {len(self.op.inputs)}."
            )
        if len(arrays) != len(self.op.inputs):
            raise ShapeError(
                f"{self.where}: the spec has {len(self.op.inputs)} input operand(s) but "
                f"{len(arrays)} array(s) were passed."
            )
        self.axes = dict(_block_axes(self.where).sizes)
        self.scope = current_scope()
        self.checked = replication_checked()
        for i, (shape, x) in enumerate(zip(self.op.inputs, arrays, strict=True)):
            where = f"{self.where} input {i}" if len(arrays) > 1 else f"{self.where} input"
            check_block(shape, jnp.shape(x), self.axes, where, self.scope)
            known = self.scope.known_layout(x)
            if known is not None and len(known.dims) == len(shape.dims):
                for dk, ds in zip(known.dims, shape.dims, strict=True):
                    if dk.order != ds.order:
                        raise ShapeError(
                            f"{where}: the array was declared '{known}', but the spec reads it "
                            f"as '{shape}' (dimension {ds.label}: order "
                            f"{dk.order or 'natural'} vs {ds.order or 'natural'}). The order is "
                            f"layout: write the spec as the array is laid out, or change the "
                            f"order with shardops.reorder."
                        )
                    if dk.axes != ds.axes:
                        raise ShapeError(
                            f"{where}: the array was declared '{known}', but the spec reads it "
                            f"as '{shape}' (dimension {ds.label}: {'/'.join(('', *dk.axes)) or 'unsplit'} "
                            f"vs {'/'.join(('', *ds.axes)) or 'unsplit'}). Axis order is layout: "
                            f"write the spec as the array is laid out."
                        )
        for axis in self.op.output.split_axes + self.op.output.unreduced:
            if axis not in self.axes:
                raise ShapeError(
                    f"{self.where}: the output names mesh axis {axis!r}, but the manual mesh "
                    f"axes here are {self.axes}."
                )

    @property
    def src(self) -> Shape:
        return self.op.inputs[0]

    @property
    def dst(self) -> Shape:
        return self.op.output

    def fail(self, problem: str, fix: str) -> ShapeError:
        return ShapeError(f"{self.where}: {problem}. {fix}")

    def require_same_labels(self) -> None:
        if self.src.labels != self.dst.labels:
            raise self.fail(
                f"the dimensions differ: {' '.join(self.src.labels)} -> {' '.join(self.dst.labels)}",
                f"{self.name} changes only how dimensions are split, not which dimensions there are",
            )
        for shape in (self.src, self.dst):
            if any(d.indexed for d in shape.dims):
                raise self.fail(
                    "brackets are only for index_unreduced's table", "remove the brackets"
                )
        if self.name != "reorder":
            for a, b in zip(self.src.dims, self.dst.dims, strict=True):
                if a.order != b.order:
                    raise self.fail(
                        f"dimension {a.label} goes from '{a}' to '{b}': {self.name} keeps the "
                        f"order of every dimension",
                        "change the order with shardops.reorder (on a dimension split over no "
                        "axis of size > 1)",
                    )

    def require_varying(self, x: jax.Array, axes: Sequence[str], why: str) -> None:
        """With replication checked, a block split or unreduced over ``axes`` must vary there
        (over those of size > 1: over one shard, split, partial and whole are all the same)."""
        if not self.checked:
            return
        missing = [a for a in axes if self.axes[a] > 1 and a not in varying_axes(x)]
        if missing:
            raise self.fail(
                f"the spec says the input is {why} over {missing}, but the value does not vary "
                f"over {missing} (JAX tracks this with check_vma=True)",
                "a value the same on every device of an axis is neither split nor a partial sum "
                "over it: fix the spec, or make the value vary over the axis (lax.pcast(x, "
                "axis, to='varying')) if repeating it per device is really meant",
            )

    def over(self, axes: Sequence[str]) -> list[str]:
        """``axes`` less those of size 1, over which a collective would move nothing."""
        return [a for a in axes if self.axes[a] > 1]

    def stuck(self, x: jax.Array, axes: Sequence[str]) -> list[str]:
        """Those of ``axes`` of size 1 that ``x`` varies over: manual axes of a plain
        ``jax.shard_map`` with ``check_vma=True``. ``lax.pcast`` cannot make a value invariant
        (its ``to`` is varying, reduced or unreduced), so only a collective over them can;
        inside ``typed_shard_map`` axes of size 1 are not manual and this is always empty."""
        return [a for a in axes if self.axes[a] == 1 and a in varying_axes(x)]

    def size(self, axes: Sequence[str]) -> int:
        """The number of shards over ``axes``."""
        return math.prod(self.axes[a] for a in axes)

    def require_divisible(self, x: jax.Array, dim: int, axes: Sequence[str]) -> None:
        """The per-device size of ``dim`` must split evenly over ``axes``."""
        n = self.size(axes)
        if x.shape[dim] % n:
            raise self.fail(
                f"dimension {self.src.dims[dim].label} has per-device size {x.shape[dim]}, which "
                f"{'x'.join(axes)} = {n} shards do not divide",
                "choose sizes divisible by the mesh axes",
            )

    def finish(self, y: jax.Array) -> jax.Array:
        check_block(self.dst, jnp.shape(y), self.axes, f"{self.where} output", self.scope)
        self.scope.remember_layout(y, self.dst)
        return y

    def index(self, axes: Sequence[str]) -> jax.Array:
        return _linear_index(axes, self.axes)

    def log(self, kind: str, axes: Sequence[str], x: jax.Array, y: jax.Array, **kw) -> None:
        """Record the collective just emitted (:mod:`seqshard.shardlib.collective_log`)."""
        collective_log.emit(
            self.name, self.text, kind, axes, self.size(axes), x, y, checked=self.checked, **kw
        )


def _cpu_reduce_dtype(x: jax.Array):
    """The dtype a sum over devices runs in: f32 for bf16 on XLA's CPU backend, else x's.

    XLA's CPU backend sums bf16 collectives in f32 anyway; and a bf16 reduce-scatter or
    all-reduce inside a shard_map that leaves a mesh axis automatic (typed_shard_map leaves
    those of size 1, such as c = 1) aborts its compiler ("Invalid binary instruction opcode
    copy", jaxlib 0.10.2). Summing in f32 explicitly gives the same values and compiles."""
    if x.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        return jnp.float32
    return x.dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_summing_wide(x: jax.Array, axes, dim: int) -> jax.Array:
    """A tiled all-gather whose transpose (a reduce-scatter) sums in f32: bf16 on XLA's CPU
    backend (:func:`_cpu_reduce_dtype`). The same values as ``lax.all_gather``'s own."""
    return lax.all_gather(x, axes, axis=dim, tiled=True)


def _gather_summing_wide_fwd(x, axes, dim):
    return _gather_summing_wide(x, axes, dim), None


def _gather_summing_wide_bwd(axes, dim, _, g):
    wide = lax.psum_scatter(g.astype(jnp.float32), axes, scatter_dimension=dim, tiled=True)
    return (wide.astype(g.dtype),)


_gather_summing_wide.defvjp(_gather_summing_wide_fwd, _gather_summing_wide_bwd)


def _linear_index(axes: Sequence[str], sizes: Mapping[str, int]) -> jax.Array:
    """The block index of this device over ``axes`` taken major to minor."""
    index = jnp.int32(0)
    for axis in axes:
        if sizes[axis] > 1:  # over one shard the index is 0 (and the axis may not be manual)
            index = index * sizes[axis] + lax.axis_index(axis)
    return index


def _axis_arg(axes: Sequence[str]) -> str | tuple[str, ...]:
    return axes[0] if len(axes) == 1 else tuple(axes)


def _is_subsequence(short: Sequence[str], long: Sequence[str]) -> bool:
    it = iter(long)
    return all(a in it for a in short)


def _common_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---------------------------------------------------------------------------------------------
# Collectives


def all_gather(
    spec: str, x: jax.Array, *, to: Literal["varying", "invarying"] = "varying"
) -> jax.Array:
    """Gather split dimensions: ``all_gather('M/d F/t -> M F/t', w)`` is one all-gather over d.

    A dimension may lose any of its axes. Losing minor axes (``M/t/d -> M/t``) is one tiled
    all-gather over them in the written order. Losing a major axis while keeping a minor one
    (``M/t/d -> M/d``) gathers over both (``('t', 'd')``) and keeps this device's ``d`` slice:
    the blocks of ``M/d`` live on other ``d`` shards.

    ``to='varying'`` (default) keeps the result varying over the gathered axes, so its gradient
    is a reduce-scatter (FSDP's backward). Axes of size 1 move nothing: gathering over them
    emits no collective. ``to='invarying'`` makes it replicated, as needed to
    return it from a shard_map as replicated; its gradient is then an all-reduce when the
    result meets varying values. Without replication checking, ``invarying`` would give wrong
    gradients, so there it is ignored.
    """
    if to not in ("varying", "invarying"):
        raise ValueError(f"all_gather: to must be 'varying' or 'invarying', got {to!r}.")
    call = _Call("all_gather", spec, [x], 1)
    call.require_same_labels()
    if call.src.unreduced or call.dst.unreduced:
        raise call.fail("a gather does not reduce", "use psum for '{U_..}' partial sums")
    plan = []
    for i, (a, b) in enumerate(zip(call.src.dims, call.dst.dims, strict=True)):
        if not _is_subsequence(b.axes, a.axes):
            raise call.fail(
                f"dimension {a.label} goes from '{a}' to '{b}', but a gather can only remove axes",
                "use all_to_all to move an axis between dimensions, or psum_scatter to add one",
            )
        keep = _common_prefix(a.axes, b.axes)
        if a.axes[keep:]:
            plan.append((i, a.axes, b.axes))
    if not plan:
        raise call.fail(
            "nothing is gathered: input and output have the same layout", "drop the call"
        )
    call.require_varying(x, [ax for _, a, b in plan for ax in a[_common_prefix(a, b) :]], "split")
    # Removed axes of size 1 that x varies over (see _Call.stuck) stay in the invarying gather:
    # it is the only way to make x invariant over them.
    removed = [ax for _, a, b in plan for ax in a if ax not in b]
    stuck = call.stuck(x, removed) if to == "invarying" else []
    mode = "invarying" if (to == "invarying" and (call.checked or stuck)) else "varying"
    y = x
    for dim, a, b in plan:
        # Without axes of size 1 the layouts are the same ('M/t/d' is 'M/d' when t = 1).
        src, dst = call.over(a), call.over(b)
        keep = _common_prefix(src, dst)
        gathered = [ax for ax in a if ax in src[keep:] or ax in stuck]
        if not gathered:
            continue  # one shard: the block is already whole along this dimension
        if mode == "varying" and _cpu_reduce_dtype(y) != y.dtype:
            gathered_y = _gather_summing_wide(y, _axis_arg(gathered), dim)
        else:
            gathered_y = lax.all_gather(y, _axis_arg(gathered), axis=dim, tiled=True, to=mode)
        call.log("all-gather", gathered, y, gathered_y, invarying=mode == "invarying")
        y = gathered_y
        if dst[keep:]:
            size = y.shape[dim] // call.size(dst[keep:])
            y = lax.dynamic_slice_in_dim(y, call.index(dst[keep:]) * size, size, axis=dim)
    return call.finish(y)


def _appended_axes(call: _Call, what: str, example: str) -> list[tuple[int, tuple[str, ...]]]:
    """(dimension, the axes it gains) for each dimension the output splits further; new axes
    may only be appended, minor-most (``what`` and ``example`` word the error)."""
    plan = []
    for i, (a, b) in enumerate(zip(call.src.dims, call.dst.dims, strict=True)):
        if b.axes[: len(a.axes)] != a.axes:
            raise call.fail(
                f"dimension {a.label} goes from '{a}' to '{b}', but {what} can only append "
                f"minor axes",
                f"write the new axes after the existing ones ({example})",
            )
        if b.axes[len(a.axes) :]:
            plan.append((i, b.axes[len(a.axes) :]))
    return plan


def psum_scatter(spec: str, x: jax.Array) -> jax.Array:
    """Sum partial sums over the axes the output adds, scattering the result over them.

    ``psum_scatter('B/d L M -> B/d L M/t', y)`` is one reduce-scatter over t: the input owes a
    sum over t (e.g. an einsum that contracted a t-split dimension) and each t shard keeps its
    block of M. Axes are appended as the minor-most split of a dimension. The input may say
    what it owes with a marker (``'B/d L M{U_t} -> B/d L M/t'``); it must match. Over axes of
    size 1 the value is already reduced: no collective is emitted.
    """
    call = _Call("psum_scatter", spec, [x], 1)
    call.require_same_labels()
    plan = _appended_axes(call, "a reduce-scatter", "M/d -> M/d/t")
    reduced = [axis for _, new in plan for axis in new]
    if not plan:
        raise call.fail(
            "no axis is added, so nothing is reduced", "use psum to reduce without scattering"
        )
    if call.src.unreduced and set(call.src.unreduced) - set(call.dst.unreduced) != set(reduced):
        raise call.fail(
            f"the input owes sums over {list(call.src.unreduced)} but the output scatters over {reduced}",
            "make the marker list exactly the axes being reduced",
        )
    if set(call.dst.unreduced) - set(call.src.unreduced):
        raise call.fail("the output's marker names axes the input did not owe", "fix the markers")
    call.require_varying(x, reduced, "a partial sum")
    y = x
    for dim, new in plan:
        call.require_divisible(y, dim, new)
        if not call.over(new):
            continue  # a sum over one shard: the value is already reduced and in place
        wide = _cpu_reduce_dtype(y)
        scattered = lax.psum_scatter(
            y.astype(wide), _axis_arg(call.over(new)), scatter_dimension=dim, tiled=True
        )
        call.log("reduce-scatter", call.over(new), y.astype(wide), scattered)
        y = scattered.astype(y.dtype)
    return call.finish(y)


def _reduce_plan(call: _Call) -> list[str]:
    if call.src.dims != call.dst.dims:
        raise call.fail(
            f"'{Shape(call.src.dims)}' and '{Shape(call.dst.dims)}' differ",
            f"{call.name} keeps every dimension and its split; it only removes the '{{U_..}}' marker",
        )
    if not call.src.unreduced:
        raise call.fail(
            "the input has no '{U_axis}' marker, so no axis is said to be reduced",
            "mark what the value owes, e.g. 'B/d L M{U_t} -> B/d L M'",
        )
    extra = set(call.dst.unreduced) - set(call.src.unreduced)
    if extra:
        raise call.fail(
            f"the output owes {sorted(extra)}, which the input did not", "fix the markers"
        )
    return [a for a in call.src.unreduced if a not in call.dst.unreduced]


def _all_reduce_axes(call: _Call, x: jax.Array, what: str) -> list[str]:
    """The axes an all-reduce (psum, pmax) of ``x`` runs over: those its spec reduces, but
    the ones of size 1, except those x still varies over (see _Call.stuck): only an
    all-reduce makes it invariant there, as the caller's replicated result must be."""
    reduced = _reduce_plan(call)
    call.require_varying(x, reduced, what)
    return [a for a in reduced if a in call.over(reduced) or a in call.stuck(x, reduced)]


def psum(spec: str, x: jax.Array) -> jax.Array:
    """All-reduce a partial sum: ``psum('B/d L{U_t} -> B/d L', s)`` is one all-reduce over t.

    The ``{U_..}`` marker names the axes reduced (an output marker keeps some unreduced).
    The result is replicated (invariant) over them, so it may be returned as replicated.
    Over axes of size 1 the sum is the value itself: no collective is emitted.
    """
    call = _Call("psum", spec, [x], 1)
    axes = _all_reduce_axes(call, x, "a partial sum")
    if not axes:
        return call.finish(x)
    wide = _cpu_reduce_dtype(x)
    y = lax.psum(x.astype(wide), _axis_arg(axes))
    call.log("all-reduce", axes, x.astype(wide), y)
    return call.finish(y.astype(x.dtype))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _pmax_no_tangent(x: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    return lax.pmax(x, axes)


def _pmax_jvp(axes, primals, tangents):
    (x,), (t,) = primals, tangents
    if not isinstance(t, SymbolicZero):
        raise ValueError(
            "pmax has no gradient (JAX defines none for lax.pmax), but its input carries one. "
            "Apply it to jax.lax.stop_gradient(x): e.g. the max subtracted for a stable "
            "logsumexp is pmax(stop_gradient(local_max)), which leaves the result exact."
        )
    y = _pmax_no_tangent(x, axes)
    return y, jnp.zeros_like(y)


_pmax_no_tangent.defjvp(_pmax_jvp, symbolic_zeros=True)


def pmax(spec: str, x: jax.Array) -> jax.Array:
    """All-reduce with max: ``pmax('B/d L{U_t} -> B/d L', m)``, one all-reduce over t.

    pmax has no gradient: its input must carry none (``pmax(spec, lax.stop_gradient(m))``);
    differentiating through it raises a ValueError that says so.
    """
    call = _Call("pmax", spec, [x], 1)
    axes = _all_reduce_axes(call, x, "a partial max")
    if not axes:
        return call.finish(x)
    y = _pmax_no_tangent(x, _axis_arg(axes))
    call.log("all-reduce", axes, x, y)
    return call.finish(y)


def all_to_all(spec: str, x: jax.Array) -> jax.Array:
    """Move a split from one dimension to another: ``all_to_all('B/d L -> B L/d', x)``.

    The moved axes are the minor-most split of the source dimension and become the minor-most
    split of the target. One all-to-all over those of size > 1 (none when all have size 1:
    ``'B/t L'`` and ``'B L/t'`` are the same layout when t = 1).
    """
    call = _Call("all_to_all", spec, [x], 1)
    call.require_same_labels()
    if call.src.unreduced or call.dst.unreduced:
        raise call.fail("all_to_all moves splits, it does not reduce", "drop the markers")
    sources, targets = [], []
    for i, (a, b) in enumerate(zip(call.src.dims, call.dst.dims, strict=True)):
        if a.axes == b.axes:
            continue
        if a.axes[: len(b.axes)] == b.axes:
            sources.append((i, a.axes[len(b.axes) :]))
        elif b.axes[: len(a.axes)] == a.axes:
            targets.append((i, b.axes[len(a.axes) :]))
        else:
            raise call.fail(
                f"dimension {a.label} goes from '{a}' to '{b}'",
                "all_to_all removes minor-most axes from one dimension and appends them to another",
            )
    if len(sources) != 1 or len(targets) != 1 or sources[0][1] != targets[0][1]:
        raise call.fail(
            "all_to_all moves the same axes from exactly one dimension to exactly one other",
            "e.g. 'B/d L -> B L/d'; split other changes into separate calls",
        )
    (src_dim, moved), (dst_dim, _) = sources[0], targets[0]
    call.require_varying(x, moved, "split")
    call.require_divisible(x, dst_dim, moved)
    if not call.over(moved):
        return call.finish(x)  # one shard: the block is already in place
    y = lax.all_to_all(
        x, _axis_arg(call.over(moved)), split_axis=dst_dim, concat_axis=src_dim, tiled=True
    )
    call.log("all-to-all", call.over(moved), x, y)
    return call.finish(y)


def ring_shift(spec: str, x: jax.Array, axis: str, offset: int = 1) -> jax.Array:
    """Pass blocks around the ring of mesh axis ``axis``: each device sends its block to the
    device ``offset`` further along it (modulo its size) and receives the block of the one
    ``offset`` before it. ``ring_shift('B/d L@zigzag/c K/t D', k, 'c')`` is one
    ``lax.ppermute`` over c (ring attention's step). The spec states the blocks' layout, which
    the shift keeps (each device now holds another shard's block of the same layout); ``axis``
    must split one of its dimensions. Over an axis of size 1 nothing moves: no collective.

    Its transpose (autodiff's backward) is the shift by ``-offset``."""
    if "->" in str(spec):
        raise ShapeError(
            f"ring_shift({spec!r}): the spec is the blocks' one layout, which the shift keeps "
            f"(e.g. 'B/d L@zigzag/c K/t D'), not an op spec with '->'."
        )
    call = _Call("ring_shift", f"{spec} -> {spec}", [x], 1)
    if axis not in call.src.split_axes:
        raise call.fail(
            f"mesh axis {axis!r} splits no dimension of '{call.src}'",
            "shift along an axis the blocks are split over",
        )
    if call.src.unreduced:
        raise call.fail("the blocks owe a reduction", "reduce them first (psum)")
    n = call.axes[axis]
    if n == 1 or offset % n == 0:
        return call.finish(x)
    call.require_varying(x, [axis], "split")
    y = lax.ppermute(x, axis, [(i, (i + offset) % n) for i in range(n)])
    call.log("collective-permute", [axis], x, y)
    return call.finish(y)


def zigzag_chunks(n: int) -> tuple[int, ...]:
    """The natural chunk at each position of the zigzag order over ``n`` shards (2n chunks):
    ``zigzag_chunks(2) == (0, 3, 1, 2)``; shard i holds chunks i and 2n-1-i."""
    return tuple(c for i in range(n) for c in (i, 2 * n - 1 - i))


def _permute_chunks(x: jax.Array, dim: int, order: Sequence[int]) -> jax.Array:
    chunks = jnp.split(x, len(order), axis=dim)
    return jnp.concatenate([chunks[c] for c in order], axis=dim)


def reorder(spec: str, x: jax.Array) -> jax.Array:
    """Permute a dimension into or out of an order: ``reorder('B/d L -> B/d L@zigzag', ids)``.

    Local, no communication: the dimension must be whole on this device (split over no axis
    of size > 1). Zigzag cuts it into 2c chunks (c: the context axis's size) and lays out chunk
    0, 2c-1, 1, 2c-2, ... (:func:`zigzag_chunks`); the reverse puts them back."""
    call = _Call("reorder", spec, [x], 1)
    call.require_same_labels()
    if call.src.unreduced != call.dst.unreduced:
        raise call.fail("a reorder does not reduce", "keep the markers the same")
    pairs = list(zip(call.src.dims, call.dst.dims, strict=True))
    changed = [i for i, (a, b) in enumerate(pairs) if a.order != b.order]
    if any(a.axes != b.axes for a, b in pairs) or len(changed) != 1:
        raise call.fail(
            "a reorder changes the order of exactly one dimension and no split",
            "e.g. 'B/d L -> B/d L@zigzag'; gather or split in separate calls",
        )
    dim = changed[0]
    split_over = call.over(call.src.dims[dim].axes)
    if split_over:
        raise call.fail(
            f"dimension {call.src.dims[dim]} is split over {split_over}, so no device holds "
            f"all of it",
            "gather it first (all_gather), reorder, then split",
        )
    n = call.axes.get("c", 1)
    order = zigzag_chunks(n)
    if call.src.dims[dim].order == "zigzag":  # back to the natural order
        order = tuple(sorted(range(2 * n), key=order.__getitem__))
    if x.shape[dim] % (2 * n):
        raise call.fail(
            f"dimension {call.src.dims[dim].label} has size {x.shape[dim]}, not divisible into "
            f"2c = {2 * n} chunks",
            "choose a size divisible by 2 x mesh.c",
        )
    return call.finish(_permute_chunks(x, dim, order) if n > 1 else x)


def split(spec: str, x: jax.Array) -> jax.Array:
    """Split whole dimensions over mesh axes, each device keeping its own block:
    ``split('B/d L@zigzag -> B/d L@zigzag/c', positions)``. Local, no communication (the
    transpose of a gather, for values every device of those axes holds whole). New axes are
    appended as the minor-most split of a dimension; over axes of size 1 nothing changes."""
    call = _Call("split", spec, [x], 1)
    call.require_same_labels()
    if call.src.unreduced or call.dst.unreduced:
        raise call.fail("a split does not reduce", "reduce first (psum, psum_scatter)")
    plan = _appended_axes(call, "a split", "L -> L/c")
    if not plan:
        raise call.fail("no axis is added: nothing is split", "drop the call")
    y = x
    for dim, new in plan:
        call.require_divisible(y, dim, new)
        if call.over(new):
            size = y.shape[dim] // call.size(new)
            y = lax.dynamic_slice_in_dim(y, call.index(new) * size, size, axis=dim)
    return call.finish(y)


# ---------------------------------------------------------------------------------------------
# Local ops that leave a reduction to the caller

_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _check_owed_not_split(call: _Call, owed: set[str], cause: str) -> None:
    """A block owing a sum over an axis cannot also be split over it: the sum would mix blocks."""
    clash = sorted(owed & set(call.dst.split_axes))
    if clash:
        raise call.fail(
            f"{cause} leaves the result owing a sum over {clash}, but the output '{call.dst}' is "
            f"also split over {clash}, so the devices' partial sums belong to different blocks",
            "split the reduced dimension over a different mesh axis, or gather the output's "
            "dimension first",
        )


def einsum_unreduced(spec: str, *operands: jax.Array, out_dtype=None) -> jax.Array:
    """A local einsum of two per-device blocks; no communication.

    ``einsum_unreduced('B/d L F/t, M F/t -> B/d L M', y, w)`` contracts F, which is split over
    t, so the result is a partial sum that still owes a sum over t: the caller reduces it
    (``psum_scatter`` or ``psum``). A dimension must have the same split in every operand
    and in the output, and no axis the result owes may also split the output. The output may
    state what it owes (``'... -> B/d L M{U_t}'``). Products are accumulated as
    :data:`seqshard.shardlib.matmul.ACCUMULATE` says (bf16 in f32, where CPUs run it 2.5-5x
    faster) and the result cast to ``out_dtype``, by default the operands' dtype.
    """
    call = _Call("einsum_unreduced", spec, list(operands), None)
    if len(operands) != 2:
        raise call.fail(
            f"{len(operands)} operands given", "a matmul takes two: contract them pairwise"
        )
    splits: dict[str, Dim] = {}
    letters: dict[str, str] = {}
    for i, shape in enumerate((*call.op.inputs, call.dst)):
        if shape.unreduced and i < len(call.op.inputs):
            raise call.fail(
                f"input {i} is marked unreduced",
                "reduce it first: a product of partial sums is not a partial sum",
            )
        if len(set(shape.labels)) != len(shape.labels):
            raise call.fail(
                f"operand '{shape}' repeats a dimension",
                "give each dimension its own name (e.g. Qlen and Klen)",
            )
        for d in shape.dims:
            if d.indexed:
                raise call.fail("brackets are only for index_unreduced's table", "remove them")
            if i == len(call.op.inputs) and d.label not in splits:
                raise call.fail(
                    f"output dimension {d.label} is in no input", "einsum cannot create dimensions"
                )
            first = splits.setdefault(d.label, d)
            if (first.axes, first.order) != (d.axes, d.order):
                raise call.fail(
                    f"dimension {d.label} is laid out as '{first}' in one operand and '{d}' in "
                    f"another",
                    "an einsum is local: gather, slice or reorder an operand so the layouts agree",
                )
            if d.label not in letters:
                if len(letters) == len(_LETTERS):
                    raise call.fail("too many distinct dimensions", "use at most 52")
                letters[d.label] = _LETTERS[len(letters)]
    contracted = set(splits) - set(call.dst.labels)
    owed = {a for label in contracted for a in splits[label].axes}
    _check_owed_not_split(call, owed, f"contracting {sorted(contracted)}")
    if call.dst.unreduced and set(call.dst.unreduced) != owed:
        raise call.fail(
            f"the output is marked as owing {sorted(call.dst.unreduced)}, but contracting "
            f"{sorted(contracted)} leaves it owing {sorted(owed)}",
            "fix the marker (or drop it)",
        )
    equation = ",".join("".join(letters[label] for label in s.labels) for s in call.op.inputs)
    equation += "->" + "".join(letters[label] for label in call.dst.labels)
    return call.finish(matmul.einsum(equation, *operands, out_dtype=out_dtype))


def index_unreduced(spec: str, table: jax.Array, ids: jax.Array) -> jax.Array:
    """Look up rows of a sharded table: ``index_unreduced('[V/t] M, B/d L -> B/d L M', t, ids)``.

    The bracketed dimension is indexed by ``ids`` (global indices). Each device holds a block
    of it and returns the rows it has, zeros elsewhere: a partial sum that owes a sum over the
    bracketed dimension's axes (here t), which must not also split the output (not
    ``'[V/d] M, B/d L -> ...'``). Output: the ids' dimensions, then the table's others.
    """
    call = _Call("index_unreduced", spec, [table, ids], 2)
    table_shape, ids_shape = call.op.inputs
    indexed = [i for i, d in enumerate(table_shape.dims) if d.indexed]
    if len(indexed) != 1 or any(d.indexed for d in ids_shape.dims):
        raise call.fail(
            "the table (first operand) must bracket exactly one dimension and the ids none",
            "write e.g. '[V/t] M, B/d L -> B/d L M'",
        )
    k = indexed[0]
    rest = table_shape.dims[:k] + table_shape.dims[k + 1 :]
    expected = ids_shape.dims + rest
    if call.dst.dims != expected:
        raise call.fail(
            f"the output must be the ids' dimensions then the table's others, "
            f"'{Shape(expected)}', but the spec says '{Shape(call.dst.dims)}'",
            "fix the output",
        )
    owed = table_shape.dims[k].axes
    _check_owed_not_split(call, set(owed), f"looking up {table_shape.dims[k]}")
    if call.dst.unreduced and set(call.dst.unreduced) != set(owed):
        raise call.fail(
            f"the output is marked as owing {list(call.dst.unreduced)}, but the lookup owes {list(owed)}",
            "fix the marker (or drop it)",
        )
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{call.where}: ids must be integers, got {ids.dtype}.")
    rows = table.shape[k]
    local = ids.astype(jnp.int32) - call.index(owed) * rows
    present = (local >= 0) & (local < rows)
    looked_up = jnp.take(table, jnp.where(present, local, 0), axis=k)
    looked_up = jnp.moveaxis(looked_up, tuple(range(k, k + ids.ndim)), tuple(range(ids.ndim)))
    present = present.reshape(present.shape + (1,) * len(rest))
    return call.finish(jnp.where(present, looked_up, jnp.zeros((), table.dtype)))


def index_add(spec: str, update: jax.Array, ids: jax.Array, *, vocab: int) -> jax.Array:
    """Scatter-add rows into a sharded table, the transpose of :func:`index_unreduced`:
    ``index_add('B/d L M, B/d L -> V/t M{U_d}', dx, ids, vocab=V)``.

    Inputs: the update (the ids' dimensions, then the table's others) and ``ids`` (global
    indices). Output: a block of the table, zeros but for the updates of the ids in it. Its
    indexed dimension is the one the update lacks (written without brackets, which mark only
    inputs); ``vocab`` is its global size. Ids in other devices' blocks, or outside
    ``[0, vocab)``, add nothing. Each device sums only its own ids' rows (here its B/d rows),
    so the result owes a sum over the axes that split the ids (here d), which must not also
    split the table (not ``'B/d L M, B/d L -> V/d M'``). The output may state what it owes.
    FSDP's embedding gradient follows with ``psum_scatter('V/t M{U_d} -> V/t M/d', g)``.
    """
    if isinstance(spec, str) and "[" in spec.partition("->")[2]:
        raise ShapeError(
            f"index_add({spec!r}): the output is the table, written without brackets (they mark "
            f"only inputs): its indexed dimension is the one output dimension the update lacks. "
            f"Write e.g. 'B/d L M, B/d L -> V/t M{{U_d}}'."
        )
    call = _Call("index_add", spec, [update, ids], 2)
    update_shape, ids_shape = call.op.inputs
    for i, shape in enumerate(call.op.inputs):
        if shape.unreduced:
            raise call.fail(
                f"input {i} ('{shape}') is marked unreduced",
                "reduce it first (psum): index_add's result owes only the sums its own "
                "scatter leaves",
            )
        if any(d.indexed for d in shape.dims):
            raise call.fail(
                "brackets are only for index_unreduced's table",
                "remove them: index_add's indexed dimension is the output's one the update lacks",
            )
    new = [i for i, d in enumerate(call.dst.dims) if d.label not in update_shape.labels]
    if len(new) != 1:
        raise call.fail(
            f"the output (the table) must have exactly one dimension the update lacks, the "
            f"indexed one, but it has {len(new)} ({' '.join(call.dst.labels[i] for i in new) or 'none'})",
            "write e.g. 'B/d L M, B/d L -> V/t M'",
        )
    k = new[0]
    rest = call.dst.dims[:k] + call.dst.dims[k + 1 :]
    expected = ids_shape.dims + rest
    if update_shape.dims != expected:
        raise call.fail(
            f"the update must be the ids' dimensions then the table's others, "
            f"'{Shape(expected)}', but the spec says '{Shape(update_shape.dims)}'",
            "fix the update's operand (every dimension split as in the ids and the table)",
        )
    owed = ids_shape.split_axes
    _check_owed_not_split(call, set(owed), f"summing over the ids' dimensions {ids_shape}")
    if call.dst.unreduced and set(call.dst.unreduced) != set(owed):
        raise call.fail(
            f"the output is marked as owing {list(call.dst.unreduced)}, but summing over the "
            f"ids' dimensions '{ids_shape}' owes {list(owed)}",
            "fix the marker (or drop it)",
        )
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{call.where}: ids must be integers, got {ids.dtype}.")
    if isinstance(vocab, bool) or not hasattr(type(vocab), "__index__"):
        raise TypeError(
            f"{call.where}: vocab must be an int, the global size of the table's dimension "
            f"{call.dst.dims[k].label}; got {vocab!r}."
        )
    vocab, axes = operator.index(vocab), call.dst.dims[k].axes
    if vocab < 1:
        raise call.fail(
            f"vocab = {vocab}",
            f"vocab is the global size of {call.dst.dims[k].label}: make it positive",
        )
    if vocab % call.size(axes):
        raise call.fail(
            f"vocab = {vocab}, the global size of {call.dst.dims[k]}, is not divisible by "
            f"{'x'.join(axes)} = {call.size(axes)} shards",
            "choose a size divisible by the mesh axes (pad the table)",
        )
    rows = vocab // call.size(axes)
    local = ids.astype(jnp.int32) - call.index(axes) * rows
    # Ids outside this block go one past its end, where mode='drop' discards them: a negative
    # index would wrap around to the block's last rows instead, even with mode='drop'.
    local = jnp.where((local >= 0) & (local < rows), local, rows)
    table = jnp.zeros((rows, *update.shape[ids.ndim :]), update.dtype)
    table = table.at[local].add(update, mode="drop")
    return call.finish(jnp.moveaxis(table, 0, k))


# ---------------------------------------------------------------------------------------------
# Mesh queries


def _axes_here(op: str, axes: str | Sequence[str]) -> tuple[tuple[str, ...], Mapping[str, int]]:
    """``axes`` as a tuple, and the block's axis sizes; every one of ``axes`` must be there."""
    sizes = _block_axes(f"{op}({axes!r})").sizes
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    for a in names:
        if a not in sizes:
            raise ShapeError(
                f"{op}({axes!r}): no manual mesh axis {a!r}; the axes here are {sizes}."
            )
    return names, sizes


def axis_size(axes: str | Sequence[str]) -> int:
    """The number of shards over ``axes`` (a name or a tuple, major to minor), as a Python int."""
    names, sizes = _axes_here("axis_size", axes)
    return math.prod(sizes[a] for a in names)


def axis_index(axes: str | Sequence[str]) -> jax.Array:
    """This device's block index over ``axes`` (a name or a tuple, major to minor); 0 over
    axes of size 1."""
    names, sizes = _axes_here("axis_index", axes)
    return _linear_index(names, sizes)
