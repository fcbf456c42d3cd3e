"""Tests for seqshard/shardlib/shardops.py: every op against a numpy reference on several meshes.

Each op runs inside ``jax.shard_map`` on global integer-valued float inputs (so sums are exact
whatever the reduction order). In/out specs come from the op's spec strings. An input that is
a partial sum (``{U_t}``, or what ``psum_scatter`` reduces) gets a leading dimension split over
those axes: its global value is the sum over that dimension. Every output gets a leading
dimension split over the mesh axes its spec does not split, so each device's copy comes back:
copies along the axes the output still owes a sum over are summed, and every other copy must
equal the reference exactly.
"""

import dataclasses
import functools
import inspect
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import typeguard
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Float, Int, jaxtyped

from seqshard.shardlib import shardops as so
from seqshard.shardlib.notation import Dim, Shape, parse_op
from seqshard.shardlib.shapecheck import ShapeError
from seqshard.shardlib.shardtypes import ArrayType, f32, i32, typed_shard_map
from seqshard.testing import COLLECTIVE_KINDS, count_collectives, fake_cpu_mesh, list_collectives

# ---------------------------------------------------------------------------------------------
# Harness

MESH_AXES = {
    (1, 8): ("d", "t"),
    (8, 1): ("d", "t"),
    (2, 4): ("d", "t"),
    (4, 2): ("d", "t"),
    (2, 2, 2): ("a", "b", "c"),
}
MESHES_2D = [(1, 8), (8, 1), (2, 4), (4, 2)]
# Every mesh a test here builds, the 1x1 mesh (both axes of size 1) included.
AXIS_NAMES = {**MESH_AXES, (1, 1): ("d", "t")}


@functools.cache
def mesh_of(shape: tuple[int, ...]) -> jax.sharding.Mesh:
    return fake_cpu_mesh(shape, AXIS_NAMES[shape])


def pspec(shape: Shape) -> P:
    """The PartitionSpec of an operand (brackets and markers do not change the layout)."""
    return ArrayType(jnp.float32, Shape(shape.dims), "f32").partition_spec


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


@dataclasses.dataclass(frozen=True)
class Case:
    """One op call (``op(spec, ...)``), optionally followed by a reduction ``then=(op, spec)``."""

    op: str
    spec: str
    then: tuple[str, str] | None = None
    to: str = "varying"

    def __str__(self) -> str:
        text = f"{self.op}({self.spec!r})"
        if self.to != "varying":
            text += f"[to={self.to}]"
        if self.then:
            text += f"+{self.then[0]}({self.then[1]!r})"
        return text

    @property
    def parsed(self):
        return parse_op(self.spec)

    @property
    def final(self) -> Shape:
        return parse_op(self.then[1]).output if self.then else self.parsed.output

    def partial_axes(self, i: int) -> tuple[str, ...]:
        """The axes input ``i`` is a partial sum (or partial max) over."""
        src = self.parsed.inputs[i]
        axes = list(src.unreduced)
        if self.op == "psum_scatter":
            for a, b in zip(src.dims, self.parsed.output.dims, strict=True):
                axes += [x for x in b.axes if x not in a.axes and x not in axes]
        return tuple(axes)

    def owed_axes(self) -> set[str]:
        """The axes the final output still owes a sum over (independently of shardops)."""
        owed = set(self.final.unreduced)
        if self.then is None and self.op == "einsum_unreduced":
            out = set(self.parsed.output.labels)
            owed |= {
                a for s in self.parsed.inputs for d in s.dims if d.label not in out for a in d.axes
            }
        if self.then is None and self.op == "index_unreduced":
            owed |= {a for d in self.parsed.inputs[0].dims if d.indexed for a in d.axes}
        if self.then is None and self.op == "index_add":
            owed |= set(self.parsed.inputs[1].split_axes)  # the ids' splits
        return owed

    @property
    def table_dim(self) -> tuple[int, str]:
        """The indexed dimension (position in the table, label) of a lookup or scatter-add."""
        if self.op == "index_unreduced":
            dims = self.parsed.inputs[0].dims
            return next((i, d.label) for i, d in enumerate(dims) if d.indexed)
        update = self.parsed.inputs[0].labels
        dims = self.parsed.output.dims
        return next((i, d.label) for i, d in enumerate(dims) if d.label not in update)

    def kwargs(self, sizes: dict[str, int]) -> dict[str, int]:
        """The op's keyword arguments: index_add's global vocab size."""
        return {"vocab": sizes[self.table_dim[1]]} if self.op == "index_add" else {}

    def all_dims(self):
        shapes = [*self.parsed.inputs, self.parsed.output]
        if self.then:
            shapes.append(parse_op(self.then[1]).output)
        return [d for s in shapes for d in s.dims]


OPS = {
    "all_gather": so.all_gather,
    "psum_scatter": so.psum_scatter,
    "psum": so.psum,
    "pmax": so.pmax,
    "all_to_all": so.all_to_all,
    "einsum_unreduced": so.einsum_unreduced,
    "index_unreduced": so.index_unreduced,
    "index_add": so.index_add,
}


def apply(case: Case, blocks, **kwargs):
    if case.op == "all_gather":
        y = so.all_gather(case.spec, blocks[0], to=case.to)
    elif case.op == "pmax":
        y = so.pmax(case.spec, lax.stop_gradient(blocks[0]))
    else:
        y = OPS[case.op](case.spec, *blocks, **kwargs)
    if case.then:
        y = OPS[case.then[0]](case.then[1], y)
    return y


def replica_axes(case: Case, mesh_shape) -> tuple[str, ...]:
    return tuple(a for a in AXIS_NAMES[mesh_shape] if a not in case.final.split_axes)


@functools.cache
def sharded(case: Case, mesh_shape: tuple[int, ...], check_vma: bool, **kwargs):
    """A jitted shard_map of the case (``kwargs``: :meth:`Case.kwargs`); jit caches one compile
    per input shape."""
    mesh = mesh_of(mesh_shape)
    in_specs = tuple(
        P(_entry(case.partial_axes(i)), *pspec(s)) for i, s in enumerate(case.parsed.inputs)
    )
    out_spec = P(_entry(replica_axes(case, mesh_shape)), *pspec(case.final))

    def body(*blocks):
        return apply(case, [b[0] for b in blocks], **kwargs)[None]

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=check_vma)
    )


@functools.cache
def typed_sharded(case: Case, mesh_shape: tuple[int, ...], check_vma: bool):
    """The case (one input) as a jitted ``typed_shard_map``: its types are ``sharded``'s specs."""
    (src,) = case.parsed.inputs
    in_type = Shape((Dim("parts", case.partial_axes(0)), *src.dims))
    out_type = Shape((Dim("copies", replica_axes(case, mesh_shape)), *case.final.dims))

    def body(x):
        return apply(case, [x[0]])[None]

    body.__annotations__ = {
        "x": ArrayType(jnp.float32, in_type, "f32"),
        "return": ArrayType(jnp.float32, out_type, "f32"),
    }
    return jax.jit(typed_shard_map(body, mesh=mesh_of(mesh_shape), check_vma=check_vma))


def global_sizes(case: Case, mesh_shape, ks: dict[str, int]) -> dict[str, int]:
    mesh = dict(zip(AXIS_NAMES[mesh_shape], mesh_shape, strict=True))
    axes: dict[str, set[str]] = {}
    for d in case.all_dims():
        axes.setdefault(d.label, set()).update(d.axes)
    return {
        label: int(label) if label[0].isdigit() else math.prod(mesh[a] for a in ax) * ks[label]
        for label, ax in axes.items()
    }


def make_inputs(case: Case, mesh_shape, sizes, rng) -> list[np.ndarray]:
    mesh = dict(zip(AXIS_NAMES[mesh_shape], mesh_shape, strict=True))
    out = []
    for i, s in enumerate(case.parsed.inputs):
        lead = math.prod(mesh[a] for a in case.partial_axes(i))
        shape = (lead, *(sizes[label] for label in s.labels))
        if case.op in ("index_unreduced", "index_add") and i == 1:
            vocab = sizes[case.table_dim[1]]
            ids = rng.integers(0, vocab, shape).astype(np.int32)
            # the first and the last vocab id, and a repeated id, whatever the draw
            ids.flat[0], ids.flat[-1] = 0, vocab - 1
            ids.flat[ids.size // 2] = vocab - 1
            out.append(ids)
        else:
            out.append(rng.integers(-3, 4, shape).astype(np.float32))
    return out


def _letters(labels, table):
    return "".join(
        table.setdefault(lab, "abcdefghijklmnopqrstuvwxyz"[len(table)]) for lab in labels
    )


def reference(case: Case, inputs, xp=np, *, vocab=None):
    """The global result of the case, computed on global arrays with ``xp`` (numpy or jnp)."""
    combined = [x.max(0) if case.op == "pmax" else x.sum(0) for x in inputs]
    op = case.parsed
    if case.op == "einsum_unreduced":
        table: dict[str, str] = {}
        lhs = ",".join(_letters(s.labels, table) for s in op.inputs)
        return xp.einsum(f"{lhs}->{_letters(op.output.labels, table)}", *combined)
    if case.op == "index_unreduced":
        values, ids = combined[0], inputs[1][0]
        k = next(i for i, d in enumerate(op.inputs[0].dims) if d.indexed)
        looked_up = xp.take(values, ids, axis=k)
        return xp.moveaxis(looked_up, tuple(range(k, k + ids.ndim)), tuple(range(ids.ndim)))
    if case.op == "index_add":
        update, ids = combined[0], inputs[1][0]
        shape = (vocab, *update.shape[ids.ndim :])
        if xp is np:
            table = np.zeros(shape, update.dtype)
            np.add.at(table, ids, update)
        else:
            table = jnp.zeros(shape, update.dtype).at[ids].add(update)
        return xp.moveaxis(table, 0, case.table_dim[0])
    return combined[0]


def check_case(
    case: Case, mesh_shape, check_vma: bool, ks: dict[str, int], seed: int, wrap=None
) -> None:
    """Run the case (``sharded``, or ``wrap`` such as ``typed_sharded``) against numpy."""
    rng = np.random.default_rng(seed)
    sizes = global_sizes(case, mesh_shape, ks)
    inputs = make_inputs(case, mesh_shape, sizes, rng)
    want = reference(case, inputs, **case.kwargs(sizes))
    fn = (wrap or sharded)(case, mesh_shape, check_vma, **case.kwargs(sizes))
    got = np.asarray(fn(*inputs))
    rest = replica_axes(case, mesh_shape)
    mesh = dict(zip(AXIS_NAMES[mesh_shape], mesh_shape, strict=True))
    got = got.reshape(*(mesh[a] for a in rest), *want.shape)
    owed = case.owed_axes()
    assert owed <= set(rest), (owed, rest)
    got = got.sum(axis=tuple(rest.index(a) for a in owed), keepdims=True)
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape), err_msg=str(case))


def label_ks(case: Case):
    labels = sorted({d.label for d in case.all_dims() if not d.label[0].isdigit()})
    return st.fixed_dictionaries({label: st.integers(1, 2) for label in labels})


# ---------------------------------------------------------------------------------------------
# Cases: every op, axis orders major/minor, gathers of minor and non-minor axes, markers

AG, RS, PS, PM, A2A, EIN, IDX, ADD = (
    "all_gather",
    "psum_scatter",
    "psum",
    "pmax",
    "all_to_all",
    "einsum_unreduced",
    "index_unreduced",
    "index_add",
)

CASES_2D = [
    # all_gather: one axis, both orders, minor and non-minor axes removed, several dims
    Case(AG, "M/d -> M"),
    Case(AG, "M/t -> M"),
    Case(AG, "M/d/t -> M"),
    Case(AG, "M/t/d -> M"),
    Case(AG, "M/d/t -> M/d"),
    Case(AG, "M/t/d -> M/t"),
    Case(AG, "M/t/d -> M/d"),
    Case(AG, "M/d/t -> M/t"),
    Case(AG, "M/d F/t -> M F/t"),
    Case(AG, "M/d F/t -> M F"),
    Case(AG, "M/d F/t -> M/d F"),
    Case(AG, "B/d L M/t -> B/d L M"),
    Case(AG, "V/t M/d -> V/t M"),
    Case(AG, "2 M/d K/t D -> 2 M K/t D"),
    Case(AG, "N M/t/d -> N M"),
    Case(AG, "M/d F/t -> M F/t", to="invarying"),
    Case(AG, "M/t/d -> M/d", to="invarying"),
    # psum_scatter: one or two axes, either order, onto split or unsplit dims, markers
    Case(RS, "B/d L M -> B/d L M/t"),
    Case(RS, "M -> M/d"),
    Case(RS, "M -> M/t"),
    Case(RS, "M -> M/t/d"),
    Case(RS, "M -> M/d/t"),
    Case(RS, "M/d -> M/d/t"),
    Case(RS, "M/t -> M/t/d"),
    Case(RS, "M F -> M/d F/t"),
    Case(RS, "M F -> M/t F/d"),
    Case(RS, "M F/t -> M/d F/t"),
    Case(RS, "L M{U_t} -> L M/t"),
    Case(RS, "L M{U_t,d} -> L M/t{U_d}"),
    # psum / pmax with markers, partial reductions, scalars
    Case(PS, "B/d L{U_t} -> B/d L"),
    Case(PS, "M{U_d} -> M"),
    Case(PS, "M{U_t,d} -> M"),
    Case(PS, "M{U_d,t} -> M{U_d}"),
    Case(PS, "M/t{U_d} -> M/t"),
    Case(PS, "(){U_d,t} -> ()"),
    Case(PM, "B/d L{U_t} -> B/d L"),
    Case(PM, "M{U_t,d} -> M"),
    Case(PM, "M/d{U_t} -> M/d"),
    Case(PM, "(){U_t} -> ()"),
    # all_to_all: move one or two axes between dims, onto split dims
    Case(A2A, "B/d L -> B L/d"),
    Case(A2A, "B L/t -> B/t L"),
    Case(A2A, "B/t/d L -> B/t L/d"),
    Case(A2A, "B/d/t L -> B L/d/t"),
    Case(A2A, "B/d L/t -> B L/t/d"),
    Case(A2A, "B/d L/t -> B/d/t L"),
    Case(A2A, "B/d L M/t -> B/d L/t M"),
    # einsum_unreduced: local; contracting a split dim owes a sum, then psum(_scatter)
    Case(EIN, "B/d L M, M F/t -> B/d L F/t"),
    Case(EIN, "B/d L F/t, M F/t -> B/d L M"),
    Case(EIN, "B/d L F/t, M F/t -> B/d L M{U_t}"),
    Case(EIN, "B/d L M/t, M/t F -> B/d L F"),
    Case(EIN, "B L M/t/d, M/t/d F -> B L F"),
    Case(EIN, "B/d Q K/t D, B/d S K/t D -> B/d Q S K/t"),
    Case(EIN, "M/d, M/d -> ()"),
    Case(EIN, "B/d L F/t, M F/t -> B/d L M", then=(RS, "B/d L M -> B/d L M/t")),
    Case(EIN, "B/d L F/t, M F/t -> B/d L M", then=(PS, "B/d L M{U_t} -> B/d L M")),
    Case(EIN, "B L M/t/d, M/t/d F -> B L F", then=(RS, "B L F -> B/t L F/d")),
    Case(EIN, "B L M/d/t, M/d/t F -> B L F", then=(PS, "B L F{U_t,d} -> B L F")),
    # index_unreduced: vocab over one or two axes, table dim not first, then the reduction
    Case(IDX, "[V/t] M, B/d L -> B/d L M"),
    Case(IDX, "[V/d] M, B/t L -> B/t L M"),
    Case(IDX, "[V/t/d] M, B L -> B L M"),
    Case(IDX, "[V/d/t] M, B L -> B L M{U_d,t}"),
    Case(IDX, "[V/t] M/d, B L -> B L M/d"),
    Case(IDX, "M [V/t], B/d L -> B/d L M"),
    Case(IDX, "[V/t] M, B/d L -> B/d L M", then=(RS, "B/d L M -> B/d L M/t")),
    Case(IDX, "[V/t/d] M, B L -> B L M", then=(PS, "B L M{U_t,d} -> B L M")),
    # index_add: the scatter-add owes a sum over the ids' axes; vocab over one or two axes,
    # either order, table dim not first, M split, then the reduction (FSDP's embedding grad)
    Case(ADD, "B/d L M, B/d L -> V/t M{U_d}"),
    Case(ADD, "B/t L M, B/t L -> V/d M"),
    Case(ADD, "B L M, B L -> V/t/d M"),
    Case(ADD, "B L M, B L -> V/d/t M"),
    Case(ADD, "B L M/d, B L -> V/t M/d"),
    Case(ADD, "B/d L/t M, B/d L/t -> V M{U_d,t}"),
    Case(ADD, "B/d L M, B/d L -> V/t M{U_d}", then=(RS, "V/t M{U_d} -> V/t M/d")),
    Case(ADD, "B L/d M, B L/d -> M V/t", then=(PS, "M V/t{U_d} -> M V/t")),
]

CASES_3D = [
    Case(AG, "M/a/b/c -> M"),
    Case(AG, "M/a/b/c -> M/a"),
    Case(AG, "M/a/b/c -> M/a/c"),
    Case(AG, "M/a/b/c -> M/b"),
    Case(AG, "M/c/a/b -> M/a/b"),
    Case(AG, "M/b F/c/a -> M F/c"),
    Case(AG, "M/c/b F/a -> M/b F"),
    Case(RS, "M -> M/a/b/c"),
    Case(RS, "M/b -> M/b/c/a"),
    Case(RS, "M F -> M/c F/a/b"),
    Case(RS, "M/a F{U_b,c} -> M/a/c F/b"),
    Case(PS, "M{U_a,c} -> M"),
    Case(PS, "M/b{U_c,a} -> M/b{U_a}"),
    Case(PM, "M/a{U_b,c} -> M/a"),
    Case(A2A, "B/a/b L/c -> B/a L/c/b"),
    Case(A2A, "B/c L -> B L/c"),
    Case(A2A, "B/a/b/c L -> B/a L/b/c"),
    Case(EIN, "B/a L M/b/c, M/b/c F -> B/a L F"),
    Case(EIN, "B/a L M/b/c, M/b/c F -> B/a L F", then=(RS, "B/a L F -> B/a L F/c/b")),
    Case(IDX, "[V/b/c] M, B/a L -> B/a L M"),
    Case(IDX, "[V/c/a] M, B/b L -> B/b L M"),
    Case(ADD, "B/a L M, B/a L -> V/b/c M"),
    Case(ADD, "B/a/b L M, B/a/b L -> V/c M", then=(RS, "V/c M -> V/c M/b/a")),
]

# Every case on every mesh with replication checks on; with them off (which changes the
# ops' typing, not their arithmetic) on one 2-D mesh and the 3-D one. The meshes with an axis
# of size 1 (1x8, 8x1), where an op over that axis emits nothing (tested on its own below),
# run with -m slow.
VALUE_PARAMS = [
    pytest.param(
        case,
        mesh,
        vma,
        id=f"{case}-{'x'.join(map(str, mesh))}-{'vma' if vma else 'novma'}",
        marks=[pytest.mark.slow] if 1 in mesh else [],
    )
    for case in CASES_2D
    for mesh in MESHES_2D
    for vma in ((True, False) if mesh == (2, 4) else (True,))
] + [
    pytest.param(case, (2, 2, 2), vma, id=f"{case}-2x2x2-{'vma' if vma else 'novma'}")
    for case in CASES_3D
    for vma in (True, False)
]


@pytest.mark.parametrize(("case", "mesh_shape", "check_vma"), VALUE_PARAMS)
@settings(deadline=None, max_examples=2)
@given(data=st.data())
def test_op_matches_numpy_reference(case, mesh_shape, check_vma, data):
    ks = data.draw(label_ks(case), label="sizes / mesh-axis product")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    check_case(case, mesh_shape, check_vma, ks, seed)


# ---------------------------------------------------------------------------------------------
# Random layouts: hypothesis draws the spec, the mesh and the sizes


@st.composite
def layouts(draw, axes, rank):
    """Each mesh axis splits one dimension (or none), in a random major-to-minor order."""
    dims = [[] for _ in range(rank)]
    for axis in draw(st.permutations(axes)):
        where = draw(st.integers(-1, rank - 1))
        if where >= 0:
            dims[where].append(axis)
    return dims


def _spec(dims, labels="ABC") -> str:
    return " ".join("/".join((labels[i], *axes)) for i, axes in enumerate(dims))


@st.composite
def random_cases(draw, op):
    mesh_shape = draw(st.sampled_from(list(MESH_AXES)))
    axes = MESH_AXES[mesh_shape]
    rank = draw(st.integers(1, 3))
    src = draw(layouts(axes, rank))
    if op == AG:
        if not any(src):
            src[draw(st.integers(0, rank - 1))].append(draw(st.sampled_from(axes)))
        dst = [[a for a in d if draw(st.booleans())] for d in src]
        if dst == src:
            i = next(i for i, d in enumerate(src) if d)
            dst[i] = dst[i][:-1]
    elif op == RS:
        free = [a for a in axes if not any(a in d for d in src)]
        if not free:
            src[next(i for i, d in enumerate(src) if d)].pop()
            free = [a for a in axes if not any(a in d for d in src)]
        new = draw(st.permutations(free))[: draw(st.integers(1, len(free)))]
        dst = [list(d) for d in src]
        for a in new:
            dst[draw(st.integers(0, rank - 1))].append(a)
    else:
        if rank == 1:
            src.append([])
            rank = 2
        if not any(src):
            src[0].append(draw(st.sampled_from(axes)))
        i = draw(st.sampled_from([i for i, d in enumerate(src) if d]))
        j = draw(st.sampled_from([j for j in range(rank) if j != i]))
        n = draw(st.integers(1, len(src[i])))
        dst = [list(d) for d in src]
        dst[i], dst[j] = src[i][: len(src[i]) - n], src[j] + src[i][len(src[i]) - n :]
    return Case(op, f"{_spec(src)} -> {_spec(dst)}"), mesh_shape


@pytest.mark.parametrize("op", [AG, RS, A2A])
@settings(deadline=None, max_examples=30)
@given(data=st.data())
def test_random_layout_change_matches_reference(op, data):
    case, mesh_shape = data.draw(random_cases(op), label="case")
    check_vma = data.draw(st.booleans(), label="check_vma")
    ks = data.draw(label_ks(case), label="sizes")
    check_case(case, mesh_shape, check_vma, ks, seed=0)


# ---------------------------------------------------------------------------------------------
# Gradients: equal the reference gradient; a gather's gradient is a reduce-scatter

GRAD_CASES = [
    Case(AG, "M/d F/t -> M F/t"),
    Case(AG, "M/t/d -> M/d"),
    Case(AG, "M/d/t -> M"),
    Case(AG, "M/d F/t -> M F/t", to="invarying"),
    Case(RS, "B/d L M -> B/d L M/t"),
    Case(RS, "M -> M/t/d"),
    Case(PS, "M{U_t,d} -> M"),
    Case(A2A, "B/d L -> B L/d"),
    Case(EIN, "B/d L F/t, M F/t -> B/d L M", then=(RS, "B/d L M -> B/d L M/t")),
    Case(IDX, "[V/t] M, B/d L -> B/d L M", then=(RS, "B/d L M -> B/d L M/t")),
    Case(ADD, "B/d L M, B/d L -> V/t M", then=(RS, "V/t M -> V/t M/d")),
]
GRAD_PARAMS = [
    pytest.param(case, mesh, id=f"{case}-{'x'.join(map(str, mesh))}")
    for case in GRAD_CASES
    for mesh in [(2, 4), (4, 2)]
] + [
    pytest.param(Case(AG, "M/a/b/c -> M/b"), (2, 2, 2), id="all_gather('M/a/b/c -> M/b')-2x2x2"),
    pytest.param(
        Case(RS, "M F -> M/c F/a/b"), (2, 2, 2), id="psum_scatter('M F -> M/c F/a/b')-2x2x2"
    ),
]


def _grad_fns(case, mesh_shape, check_vma, inputs, kwargs):
    fn = sharded(case, mesh_shape, check_vma, **kwargs)
    want = reference(case, inputs, **kwargs)
    n_rep = math.prod(mesh_of(mesh_shape).shape[a] for a in replica_axes(case, mesh_shape))
    cot = np.random.default_rng(1).integers(-3, 4, (n_rep, *want.shape)).astype(np.float32)
    argnums = tuple(i for i, x in enumerate(inputs) if x.dtype == np.float32)

    def loss(*xs):
        return jnp.sum(fn(*xs) * cot)

    def ref_loss(*xs):
        out = reference(case, xs, xp=jnp, **kwargs)
        return jnp.sum(jnp.broadcast_to(out, cot.shape) * cot)

    return jax.jit(jax.grad(loss, argnums)), jax.jit(jax.grad(ref_loss, argnums))


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize(("case", "mesh_shape"), GRAD_PARAMS)
def test_gradient_matches_reference(case, mesh_shape, check_vma):
    ks = {label: 1 for label in {d.label for d in case.all_dims()}}
    sizes = global_sizes(case, mesh_shape, ks)
    inputs = make_inputs(case, mesh_shape, sizes, np.random.default_rng(0))
    grad, ref_grad = _grad_fns(case, mesh_shape, check_vma, inputs, case.kwargs(sizes))
    for got, want in zip(grad(*inputs), ref_grad(*inputs), strict=True):
        np.testing.assert_array_equal(got, want, err_msg=str(case))
    if not check_vma:
        return
    counts = count_collectives(grad, *inputs)
    if case.op == AG and case.to == "varying":
        # FSDP's backward: the transpose of a (varying) gather is a reduce-scatter, and nothing
        # needs gathering in the backward pass of a linear op.
        assert counts["reduce-scatter"] >= 1 and counts["all-gather"] == 0, counts
    if case.op == RS:
        assert counts["all-gather"] >= 1 and counts["reduce-scatter"] == 0, counts


def test_fsdp_gather_gradient_is_one_reduce_scatter():
    """The forward gathers w over d; the backward reduce-scatters its gradient over d."""
    mesh = mesh_of((2, 4))

    def body(x, w):
        w = so.all_gather("M/d F/t -> M F/t", w)
        y = so.einsum_unreduced("B/d M, M F/t -> B/d F/t", x, w)
        return so.psum("(){U_d,t} -> ()", jnp.sum(y * y))

    loss = jax.shard_map(
        body, mesh=mesh, in_specs=(P("d", None), P("d", "t")), out_specs=P(), check_vma=True
    )
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, (4, 8)).astype(np.float32)
    w = rng.integers(-3, 4, (8, 8)).astype(np.float32)
    grad = jax.jit(jax.grad(loss, argnums=1))
    want = jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)
    np.testing.assert_array_equal(grad(x, w), want)
    counts = count_collectives(grad, x, w)
    assert counts["reduce-scatter"] == 1, counts
    assert counts["all-gather"] == 1, counts  # the forward gather, recomputed for the backward


# ---------------------------------------------------------------------------------------------
# index_add is the transpose of index_unreduced: autodiff of each lookup (and the reduction
# after it) equals the backward written by hand with index_add (and the reduction after it)

VOCAB = 16


def fsdp_lookup(embed, ids):  # 'V/t M/d', 'B/d L' -> 'B/d L M/t': the model's embedding
    table = so.all_gather("V/t M/d -> V/t M", embed)
    x = so.index_unreduced("[V/t] M, B/d L -> B/d L M", table, ids)
    return so.psum_scatter("B/d L M -> B/d L M/t", x)


def fsdp_lookup_grad(dx, ids):  # 'B/d L M/t', 'B/d L' -> 'V/t M/d'
    dx = so.all_gather("B/d L M/t -> B/d L M", dx)  # the transpose of the reduce-scatter
    g = so.index_add("B/d L M, B/d L -> V/t M{U_d}", dx, ids, vocab=VOCAB)
    # each d shard added only its own B/d rows: sum them, keeping this device's M/d block
    return so.psum_scatter("V/t M{U_d} -> V/t M/d", g)


def two_axis_lookup(table, ids):  # '[V/t/d] M', 'B L' -> 'B L M'
    x = so.index_unreduced("[V/t/d] M, B L -> B L M", table, ids)
    return so.psum("B L M{U_t,d} -> B L M", x)


def two_axis_lookup_grad(dx, ids):  # every device has every id: nothing is owed
    return so.index_add("B L M, B L -> V/t/d M", dx, ids, vocab=VOCAB)


def last_dim_lookup(table, ids):  # 'M [V/t]', 'B/d L' -> 'B/d L M'
    x = so.index_unreduced("M [V/t], B/d L -> B/d L M", table, ids)
    return so.psum("B/d L M{U_t} -> B/d L M", x)


def last_dim_lookup_grad(dx, ids):  # 'B/d L M', 'B/d L' -> 'M V/t', replicated over d
    g = so.index_add("B/d L M, B/d L -> M V/t{U_d}", dx, ids, vocab=VOCAB)
    return so.psum("M V/t{U_d} -> M V/t", g)


def split_m_lookup(table, ids):  # '[V/d] M/t', 'B L' -> 'B L M/t'
    x = so.index_unreduced("[V/d] M/t, B L -> B L M/t", table, ids)
    return so.psum("B L M/t{U_d} -> B L M/t", x)


def split_m_lookup_grad(dx, ids):
    return so.index_add("B L M/t, B L -> V/d M/t", dx, ids, vocab=VOCAB)


def swapped_lookup(embed, ids):  # 'V/d M/t', 'B/t L' -> 'B/t L M/d': fsdp_lookup, d and t swapped
    table = so.all_gather("V/d M/t -> V/d M", embed)
    x = so.index_unreduced("[V/d] M, B/t L -> B/t L M", table, ids)
    return so.psum_scatter("B/t L M -> B/t L M/d", x)


def swapped_lookup_grad(dx, ids):
    dx = so.all_gather("B/t L M/d -> B/t L M", dx)
    g = so.index_add("B/t L M, B/t L -> V/d M{U_t}", dx, ids, vocab=VOCAB)
    return so.psum_scatter("V/d M{U_t} -> V/d M/t", g)


# (lookup, its hand-written gradient, the table's spec and global shape, ids' spec, output's)
TRANSPOSES = [
    (fsdp_lookup, fsdp_lookup_grad, P("t", "d"), (VOCAB, 8), P("d", None), P("d", None, "t")),
    (two_axis_lookup, two_axis_lookup_grad, P(("t", "d")), (VOCAB, 8), P(), P()),
    (last_dim_lookup, last_dim_lookup_grad, P(None, "t"), (8, VOCAB), P("d"), P("d")),
    (split_m_lookup, split_m_lookup_grad, P("d", "t"), (VOCAB, 8), P(), P(None, None, "t")),
    (swapped_lookup, swapped_lookup_grad, P("d", "t"), (VOCAB, 8), P("t"), P("t", None, "d")),
]


# One mesh: on 2x4, swapped_lookup is fsdp_lookup on 4x2.
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize(
    ("lookup", "lookup_grad", "table_spec", "table_shape", "ids_spec", "out_spec"),
    [pytest.param(*t, id=t[0].__name__) for t in TRANSPOSES],
)
def test_index_add_is_the_transpose_of_index_unreduced(
    lookup, lookup_grad, table_spec, table_shape, ids_spec, out_spec, check_vma
):
    """jax.grad of the lookup equals index_add and its reduction, and both equal np.add.at
    (exact: integer values). Checked, the hand-written backward compiles to the collectives
    autodiff's does."""
    mesh = mesh_of((2, 4))
    forward = jax.shard_map(
        lookup, mesh=mesh, in_specs=(table_spec, ids_spec), out_specs=out_spec, check_vma=check_vma
    )
    backward = jax.jit(
        jax.shard_map(
            lookup_grad,
            mesh=mesh,
            in_specs=(out_spec, ids_spec),
            out_specs=table_spec,
            check_vma=check_vma,
        )
    )
    rng = np.random.default_rng(0)
    table = rng.integers(-3, 4, table_shape).astype(np.float32)
    ids = rng.integers(0, VOCAB, (4, 3)).astype(np.int32)
    ids[0, 0], ids[1, 1], ids[-1, -1] = 0, VOCAB - 1, VOCAB - 1  # first, last, repeated
    dx = rng.integers(-3, 4, (4, 3, 8)).astype(np.float32)
    autodiff = jax.jit(jax.grad(lambda t, i, dx: jnp.sum(forward(t, i) * dx)))
    want = np.zeros((VOCAB, 8), np.float32)
    np.add.at(want, ids, dx)
    want = want if table_shape[0] == VOCAB else want.T
    np.testing.assert_array_equal(autodiff(table, ids, dx), want)
    np.testing.assert_array_equal(backward(dx, ids), want)
    if check_vma:
        assert count_collectives(backward, dx, ids) == count_collectives(autodiff, table, ids, dx)


def test_index_add_drops_ids_outside_the_table():
    """Ids below 0 or at/after vocab add nothing (as index_unreduced looks up zeros for them):
    a negative id must not wrap around to the last rows of a device's block."""
    mesh = mesh_of((2, 4))
    f = jax.jit(
        jax.shard_map(
            lambda dx, ids: so.index_add("B L M, B L -> V/t/d M", dx, ids, vocab=VOCAB),
            mesh=mesh,
            in_specs=(P(), P()),
            out_specs=P(("t", "d")),
        )
    )
    ids = np.array([[-1, -VOCAB, VOCAB, 2**31 - 1, 3, -2]], np.int32)
    dx = np.arange(1, 13, dtype=np.float32).reshape(1, 6, 2)
    want = np.zeros((VOCAB, 2), np.float32)
    want[3] = dx[0, 4]
    np.testing.assert_array_equal(f(dx, ids), want)


def fsdp_embed_grad(dx: f32[b"B/d L M"], ids: i32[b"B/d L"]) -> f32["V/t M/d"]:
    g = so.index_add("B/d L M, B/d L -> V/t M{U_d}", dx, ids, vocab=VOCAB)
    return so.psum_scatter("V/t M{U_d} -> V/t M/d", g)


@pytest.mark.parametrize("mesh_shape", [(8, 1), (1, 8), (1, 1)], ids=["8x1", "1x8", "1x1"])
def test_index_add_over_size_one_axes_emits_nothing(mesh_shape):
    """index_add is local: inside typed_shard_map, where axes of size 1 are not manual, its
    block index over them is 0 and it emits no collective; only the reduce-scatter over d
    (when d > 1) follows."""
    f = jax.jit(typed_shard_map(fsdp_embed_grad, mesh=mesh_of(mesh_shape)))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (8, 3)).astype(np.int32)
    ids[0, 0], ids[1, 1], ids[-1, -1] = 0, VOCAB - 1, VOCAB - 1
    dx = rng.integers(-3, 4, (8, 3, 8)).astype(np.float32)
    want = np.zeros((VOCAB, 8), np.float32)
    np.add.at(want, ids, dx)
    np.testing.assert_array_equal(f(dx, ids), want)
    want_counts = {**NO_COLLECTIVES, "reduce-scatter": int(mesh_shape[0] > 1)}
    assert count_collectives(f, dx, ids) == want_counts


# ---------------------------------------------------------------------------------------------
# HLO: each op lowers to exactly the collectives it names


def expected_collectives(case: Case) -> dict[str, int]:
    want = dict.fromkeys(("all-gather", "reduce-scatter", "all-reduce", "all-to-all"), 0)
    for op, spec in [(case.op, case.spec), *([case.then] if case.then else [])]:
        parsed = parse_op(spec)
        changed = sum(
            a.axes != b.axes
            for a, b in zip(parsed.inputs[0].dims, parsed.output.dims, strict=False)
        )
        if op == AG:
            want["all-gather"] += changed
        elif op == RS:
            want["reduce-scatter"] += changed
        elif op in (PS, PM):
            want["all-reduce"] += 1
        elif op == A2A:
            want["all-to-all"] += 1
    return want


HLO_PARAMS = [
    pytest.param(case, mesh, id=f"{case}-{'x'.join(map(str, mesh))}")
    for case in CASES_2D
    for mesh in [(2, 4), (4, 2)]
] + [pytest.param(case, (2, 2, 2), id=f"{case}-2x2x2") for case in CASES_3D]


@pytest.mark.parametrize(("case", "mesh_shape"), HLO_PARAMS)
def test_op_lowers_to_the_collective_it_names(case, mesh_shape):
    ks = {label: 1 for label in {d.label for d in case.all_dims()}}
    sizes = global_sizes(case, mesh_shape, ks)
    inputs = make_inputs(case, mesh_shape, sizes, np.random.default_rng(0))
    counts = count_collectives(sharded(case, mesh_shape, True, **case.kwargs(sizes)), *inputs)
    assert counts == {**expected_collectives(case), "collective-permute": 0}, str(case)


# ---------------------------------------------------------------------------------------------
# The seed's call forms, as written, on an Auto mesh, with and without replication checks


def typeguard_checked(fn):
    """A typechecker for ``jaxtyped``: ``typeguard.check_type`` on each argument and the result.

    typeguard's own ``@typechecked`` re-parses the function's source: it cannot find the
    signature-only function ``jaxtyped`` hands it, and it parses ``'b l f'`` as Python.
    """
    signature, hints = inspect.signature(fn), typing.get_type_hints(fn)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        for name, value in signature.bind(*args, **kwargs).arguments.items():
            if name in hints:
                typeguard.check_type(value, hints[name])
        out = fn(*args, **kwargs)
        if "return" in hints:
            typeguard.check_type(out, hints["return"])
        return out

    return checked


@jaxtyped(typechecker=typeguard_checked)
def reference_embed_ffn(
    embed: Float[jax.Array, "v m"], ids: Int[jax.Array, "b l"], w: Float[jax.Array, "m f"]
) -> Float[jax.Array, "b l f"]:
    """Single-device reference: look up the tokens, then one matmul."""
    return jnp.einsum("blm,mf->blf", embed[ids], w)


def test_seed_001_rejects_mismatched_shapes_before_running():
    """seqshard's own checks, not the reference's type checker: a weight whose d_model disagrees
    with the embedding's, and float ids, are errors naming the argument, before any op runs."""
    typed = typed_shard_map(seed_typed, mesh=mesh_of((2, 4)))
    embed, ids, w = _seed_inputs()
    with pytest.raises(
        ShapeError,
        match=r"argument 'w': dimension 'd_model' has global size 6, but .* 'embed' gave it size 8",
    ):
        typed(embed, ids, np.zeros((6, 16), np.float32))  # d_model is 8 in embed, 6 in w
    with pytest.raises(TypeError, match=r"argument 'ids'.*expected dtype int32.*float32"):
        typed(embed, ids.astype(np.float32), w)
    assert typed(embed, ids, w).shape == (4, 3, 16)


def seed_embed_ffn(embed, ids, w):
    """seed 001: gather the embedding over d, look up, reduce-scatter, gather, project."""
    embed = so.all_gather("V/t M/d -> V/t M", embed)
    x = so.index_unreduced("[V/t] M, B/d L -> B/d L M", embed, ids)
    # the lookup is a partial sum over t (each t shard holds some vocab rows)
    x = so.psum_scatter("B/d L M -> B/d L M/t", x)
    x = so.all_gather("B/d L M/t -> B/d L M", x)
    w = so.all_gather("M/d F/t -> M F/t", w)
    return so.einsum_unreduced("B/d L M, M F/t -> B/d L F/t", x, w)


def _seed_inputs():
    rng = np.random.default_rng(0)
    embed = rng.integers(-3, 4, (16, 8)).astype(np.float32)
    ids = rng.integers(0, 16, (4, 3)).astype(np.int32)
    w = rng.integers(-3, 4, (8, 16)).astype(np.float32)
    return embed, ids, w


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
def test_seed_001_call_forms(mesh_shape, check_vma):
    mesh = mesh_of(mesh_shape)
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    f = jax.jit(
        jax.shard_map(
            seed_embed_ffn,
            mesh=mesh,
            in_specs=(P("t", "d"), P("d", None), P("d", "t")),
            out_specs=P("d", None, "t"),
            check_vma=check_vma,
        )
    )
    embed, ids, w = _seed_inputs()
    want = reference_embed_ffn(jnp.asarray(embed), jnp.asarray(ids), jnp.asarray(w))
    np.testing.assert_array_equal(f(embed, ids, w), want)
    assert count_collectives(f, embed, ids, w) == {
        "all-gather": 3,
        "reduce-scatter": 1,
        "all-reduce": 0,
        "all-to-all": 0,
        "collective-permute": 0,
    }

    def loss(embed, w):
        return jnp.sum(f(embed, ids, w) ** 2)

    def ref_loss(embed, w):
        return jnp.sum(reference_embed_ffn(embed, jnp.asarray(ids), w) ** 2)

    got = jax.grad(loss, (0, 1))(embed, w)
    want = jax.grad(ref_loss, (0, 1))(jnp.asarray(embed), jnp.asarray(w))
    for g, r in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, r)


def seed_typed(
    embed: f32["vocab/t d_model/d"], ids: i32[b"B/d L"], w: f32["d_model/d d_ff/t"]
) -> f32[b"B/d L F/t"]:
    return seed_embed_ffn(embed, ids, w)


def test_typed_shard_map_adds_no_collective():
    mesh = mesh_of((2, 4))
    typed = jax.jit(typed_shard_map(seed_typed, mesh=mesh))
    raw = jax.jit(
        jax.shard_map(
            seed_embed_ffn,
            mesh=mesh,
            in_specs=(P("t", "d"), P("d", None), P("d", "t")),
            out_specs=P("d", None, "t"),
        )
    )
    args = _seed_inputs()
    np.testing.assert_array_equal(typed(*args), raw(*args))
    assert count_collectives(typed, *args) == count_collectives(raw, *args)

    def grads(f):
        return jax.jit(jax.grad(lambda e, w: jnp.sum(f(e, args[1], w) ** 2), (0, 1)))

    assert count_collectives(grads(typed), args[0], args[2]) == count_collectives(
        grads(raw), args[0], args[2]
    )


# ---------------------------------------------------------------------------------------------
# Mesh queries


def test_axis_size_and_index():
    mesh = mesh_of((2, 4))

    def body():
        assert so.axis_size("t") == 4 and so.axis_size(("d", "t")) == 8
        assert isinstance(so.axis_size("d"), int)
        return jnp.stack(
            [so.axis_index("d"), so.axis_index(("d", "t")), so.axis_index(("t", "d"))]
        )[None]

    out = jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=P(("d", "t")))()
    d, t = np.divmod(np.arange(8), 4)
    np.testing.assert_array_equal(out, np.stack([d, d * 4 + t, t * 2 + d], axis=1))


@pytest.mark.parametrize("query", [so.axis_size, so.axis_index])
def test_axis_query_errors(query):
    mesh = mesh_of((2, 4))
    f = jax.shard_map(lambda: query("x") * jnp.ones(()), mesh=mesh, in_specs=(), out_specs=P())
    with pytest.raises(ShapeError, match=r"no manual mesh axis 'x'.*'d': 2, 't': 4"):
        jax.eval_shape(f)
    with pytest.raises(ShapeError, match="outside"):
        query("d")


# ---------------------------------------------------------------------------------------------
# Error messages: the op, the spec, the dimension, both sizes


def trace(body, mesh_shape, in_specs, shapes, check_vma=True, dtypes=None):
    """Trace ``body`` under shard_map with global arrays of ``shapes`` (no compile)."""
    dtypes = dtypes or [jnp.float32] * len(shapes)
    args = [jax.ShapeDtypeStruct(s, dt) for s, dt in zip(shapes, dtypes, strict=True)]
    f = jax.shard_map(
        body, mesh=mesh_of(mesh_shape), in_specs=in_specs, out_specs=P(), check_vma=check_vma
    )
    return jax.eval_shape(f, *args)


ERRORS = [
    # (id, body, in_specs, global shapes, exception, substrings of the message)
    (
        "wrong rank",
        lambda x: so.all_gather("M/d F/t -> M F/t", x),
        (P("d", "t", None),),
        [(8, 8, 4)],
        ShapeError,
        ["all_gather('M/d F/t -> M F/t')", "spec 'M/d F/t' has 2 dimensions", "(4, 2, 4)"],
    ),
    (
        "per-device size not divisible (psum_scatter)",
        lambda x: so.psum_scatter("M -> M/t", x),
        (P("t"),),
        [(24,)],
        ShapeError,
        ["psum_scatter('M -> M/t')", "dimension M", "per-device size 6", "t = 4"],
    ),
    (
        "per-device size not divisible (all_to_all)",
        lambda x: so.all_to_all("B/d L -> B L/d", x),
        (P("d", None),),
        [(4, 3)],
        ShapeError,
        ["all_to_all('B/d L -> B L/d')", "dimension L", "per-device size 3", "d = 2"],
    ),
    (
        "unknown mesh axis in an input",
        lambda x: so.all_gather("M/x -> M", x),
        (P("d"),),
        [(8,)],
        ShapeError,
        ["all_gather('M/x -> M')", "spec 'M/x'", "mesh axis 'x'", "'d': 2, 't': 4"],
    ),
    (
        "unknown mesh axis in the output",
        lambda x: so.psum_scatter("M -> M/x", x),
        (P(),),
        [(8,)],
        ShapeError,
        ["psum_scatter('M -> M/x')", "output names mesh axis 'x'"],
    ),
    (
        "one name, two sizes in one op",
        lambda x, w: so.einsum_unreduced("B/d L M, M F/t -> B/d L F/t", x, w),
        (P("d", None, None), P(None, "t")),
        [(4, 3, 8), (16, 8)],
        ShapeError,
        ["einsum_unreduced('B/d L M, M F/t -> B/d L F/t') input 1", "'M'", "16", "8"],
    ),
    (
        "psum over an axis the value does not vary over",
        lambda x: so.psum("M/d{U_t} -> M/d", x),
        (P("d"),),
        [(8,)],
        ShapeError,
        ["psum('M/d{U_t} -> M/d')", "does not vary over ['t']", "check_vma=True"],
    ),
    (
        "psum_scatter over an axis the value does not vary over",
        lambda x: so.psum_scatter("B/d M -> B/d M/t", x),
        (P("d", None),),
        [(2, 8)],
        ShapeError,
        ["psum_scatter('B/d M -> B/d M/t')", "does not vary over ['t']"],
    ),
    (
        "gather that adds an axis",
        lambda x: so.all_gather("M/d -> M/d/t", x),
        (P("d"),),
        [(8,)],
        ShapeError,
        ["all_gather('M/d -> M/d/t')", "dimension M goes from 'M/d' to 'M/d/t'", "only remove"],
    ),
    (
        "gather that swaps an axis",
        lambda x: so.all_gather("M/d -> M/t", x),
        (P("d"),),
        [(8,)],
        ShapeError,
        ["all_gather('M/d -> M/t')", "only remove axes"],
    ),
    (
        "gather of nothing",
        lambda x: so.all_gather("M/d -> M/d", x),
        (P("d"),),
        [(8,)],
        ShapeError,
        ["nothing is gathered"],
    ),
    (
        "gather changing dimensions",
        lambda x: so.all_gather("M/d F -> F M", x),
        (P("d", None),),
        [(8, 4)],
        ShapeError,
        ["the dimensions differ: M F -> F M"],
    ),
    (
        "reduce-scatter inserting a major axis",
        lambda x: so.psum_scatter("M/d -> M/t/d", x),
        (P("d"),),
        [(8,)],
        ShapeError,
        ["psum_scatter('M/d -> M/t/d')", "append minor axes"],
    ),
    (
        "reduce-scatter with a marker naming other axes",
        lambda x: so.psum_scatter("M{U_d} -> M/t", x),
        (P(),),
        [(8,)],
        ShapeError,
        ["owes sums over ['d'] but the output scatters over ['t']"],
    ),
    (
        "psum without a marker",
        lambda x: so.psum("B/d L -> B/d L", x),
        (P("d", None),),
        [(4, 2)],
        ShapeError,
        ["psum('B/d L -> B/d L')", "no '{U_axis}' marker"],
    ),
    (
        "psum changing the layout",
        lambda x: so.psum("M{U_t} -> M/t", x),
        (P(),),
        [(8,)],
        ShapeError,
        ["'M' and 'M/t' differ"],
    ),
    (
        "all_to_all moving to two dims",
        lambda x: so.all_to_all("B/d/t L M -> B L/d M/t", x),
        (P(("d", "t")),),
        [(8, 4, 4)],
        ShapeError,
        ["exactly one dimension to exactly one other"],
    ),
    (
        "einsum with disagreeing splits",
        lambda x, w: so.einsum_unreduced("B/d M/t, M F -> B/d F", x, w),
        (P("d", "t"), P()),
        [(4, 8), (8, 4)],
        ShapeError,
        ["dimension M is laid out as 'M/t' in one operand and 'M' in another"],
    ),
    (
        "einsum with a wrong marker",
        lambda x, w: so.einsum_unreduced("L F/t, M F/t -> L M{U_d}", x, w),
        (P(None, "t"), P(None, "t")),
        [(4, 8), (4, 8)],
        ShapeError,
        ["marked as owing ['d']", "leaves it owing ['t']"],
    ),
    (
        "einsum owing a sum over an axis that splits the output",
        lambda x, k: so.einsum_unreduced("X/d, K/d -> X/d", x, k),
        (P("d"), P("d")),
        [(4,), (4,)],
        ShapeError,
        ["einsum_unreduced('X/d, K/d -> X/d')", "owing a sum over ['d']", "also split over ['d']"],
    ),
    (
        "lookup owing a sum over an axis that splits the output",
        lambda table, ids: so.index_unreduced("[V/d] M, B/d L -> B/d L M", table, ids),
        (P("d"), P("d")),
        [(8, 4), (4, 2)],
        ShapeError,
        ["index_unreduced('[V/d] M, B/d L -> B/d L M')", "also split over ['d']"],
    ),
    (
        "lookup without brackets",
        lambda table, ids: so.index_unreduced("V/t M, B/d L -> B/d L M", table, ids),
        (P("t"), P("d")),
        [(8, 4), (4, 2)],
        ShapeError,
        ["must bracket exactly one dimension"],
    ),
    (
        "lookup with the wrong output",
        lambda table, ids: so.index_unreduced("[V/t] M, B/d L -> B/d M L", table, ids),
        (P("t"), P("d")),
        [(8, 4), (4, 2)],
        ShapeError,
        ["'B/d L M'", "'B/d M L'"],
    ),
    (
        "scatter-add owing a sum over an axis that splits the table",
        lambda u, ids: so.index_add("B/d L M, B/d L -> V/d M", u, ids, vocab=8),
        (P("d"), P("d")),
        [(4, 2, 4), (4, 2)],
        ShapeError,
        ["index_add('B/d L M, B/d L -> V/d M')", "owing a sum over ['d']", "also split over ['d']"],
    ),
    (
        "scatter-add with a wrong marker",
        lambda u, ids: so.index_add("B/d L M, B/d L -> V M{U_t}", u, ids, vocab=8),
        (P("d"), P("d")),
        [(4, 2, 4), (4, 2)],
        ShapeError,
        ["marked as owing ['t']", "'B/d L' owes ['d']"],
    ),
    (
        "scatter-add with the update's dimensions out of order",
        lambda u, ids: so.index_add("B/d M L, B/d L -> V/t M", u, ids, vocab=8),
        (P("d"), P("d")),
        [(4, 4, 2), (4, 2)],
        ShapeError,
        ["ids' dimensions then the table's others, 'B/d L M'", "the spec says 'B/d M L'"],
    ),
    (
        "scatter-add with the update split unlike the ids",
        lambda u, ids: so.index_add("B L M, B/d L -> V/t M", u, ids, vocab=8),
        (P(), P("d")),
        [(4, 2, 4), (4, 2)],
        ShapeError,
        ["'B/d L M'", "the spec says 'B L M'"],
    ),
    (
        "scatter-add without a table dimension",
        lambda u, ids: so.index_add("B/d L M, B/d L -> M", u, ids, vocab=8),
        (P("d"), P("d")),
        [(4, 2, 4), (4, 2)],
        ShapeError,
        ["exactly one dimension the update lacks", "it has 0 (none)"],
    ),
    (
        "scatter-add into brackets",
        lambda u, ids: so.index_add("B/d L M, B/d L -> [V/t] M", u, ids, vocab=8),
        (P("d"), P("d")),
        [(4, 2, 4), (4, 2)],
        ShapeError,
        ["index_add('B/d L M, B/d L -> [V/t] M')", "without brackets", "'B/d L M, B/d L -> V/t"],
    ),
    (
        "scatter-add of a marked update",
        lambda u, ids: so.index_add("B/d L M{U_t}, B/d L -> V M", u, ids, vocab=8),
        (P("d"), P("d")),
        [(4, 2, 4), (4, 2)],
        ShapeError,
        ["input 0 ('B/d L M{U_t}') is marked unreduced", "reduce it first"],
    ),
    (
        "wrong number of arrays",
        lambda x: so.einsum_unreduced("B M, M F -> B F", x),
        (P(),),
        [(4, 8)],
        ShapeError,
        ["2 input operand(s) but 1 array(s)"],
    ),
    (
        "two operands for a one-operand op",
        lambda x: so.all_gather("M/d, M -> M", x),
        (P("d"),),
        [(8,)],
        ShapeError,
        ["all_gather takes 1 input operand(s)"],
    ),
    (
        "malformed spec",
        lambda x: so.all_gather("M//d -> M", x),
        (P("d"),),
        [(8,)],
        ValueError,
        ["'M//d -> M'", "^"],
    ),
]


@pytest.mark.parametrize(
    ("body", "in_specs", "shapes", "exc", "words"),
    [pytest.param(*e[1:], id=e[0]) for e in ERRORS],
)
def test_error_message(body, in_specs, shapes, exc, words):
    with pytest.raises(exc) as info:
        trace(body, (2, 4), in_specs, shapes)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_lookup_ids_must_be_integers():
    with pytest.raises(TypeError, match="ids must be integers, got float32"):
        trace(
            lambda t, i: so.index_unreduced("[V/t] M, B/d L -> B/d L M", t, i),
            (2, 4),
            (P("t"), P("d")),
            [(8, 4), (4, 2)],
        )


def _trace_index_add(spec, vocab, ids_dtype=jnp.int32):
    return trace(
        lambda u, ids: so.index_add(spec, u, ids, vocab=vocab),
        (2, 4),
        (P("d"), P("d")),
        [(4, 2, 4), (4, 2)],
        check_vma=False,  # so that a block may come back as the result (out_specs=P())
        dtypes=[jnp.float32, ids_dtype],
    )


def test_index_add_argument_errors():
    with pytest.raises(TypeError, match=r"index_add\('B/d L M.*ids must be integers, got float32"):
        _trace_index_add("B/d L M, B/d L -> V/t M", 8, jnp.float32)
    with pytest.raises(TypeError, match=r"vocab must be an int, the global size .* V; got 8.0"):
        _trace_index_add("B/d L M, B/d L -> V/t M", 8.0)
    with pytest.raises(ShapeError, match=r"vocab = 0.*make it positive"):
        _trace_index_add("B/d L M, B/d L -> V/t M", 0)
    with pytest.raises(ShapeError, match=r"vocab = 6, the global size of V/t, .* t = 4 shards"):
        _trace_index_add("B/d L M, B/d L -> V/t M", 6)
    with pytest.raises(ShapeError, match=r"V/t/d, .* txd = 8 shards"):
        _trace_index_add("B L M, B L -> V/t/d M", 12)
    assert _trace_index_add("B/d L M, B/d L -> V/t M", np.int64(8)).shape == (2, 4)


def embed_and_grad(embed: f32["V/t M"], ids: i32[b"B/d L"], dx: f32[b"B/d L M"]) -> f32["V/t M"]:
    g = so.index_add("B/d L M, B/d L -> V/t M{U_d}", dx, ids, vocab=8)  # embed has 16 rows
    return embed + so.psum("V/t M{U_d} -> V/t M", g)


def test_index_add_vocab_checked_against_the_scope():
    """Inside typed_shard_map a vocab that disagrees with a declared table is an error."""
    f = typed_shard_map(embed_and_grad, mesh=mesh_of((2, 4)))
    shapes = [((16, 4), np.float32), ((4, 2), np.int32), ((4, 2, 4), np.float32)]
    with pytest.raises(ShapeError, match=r"index_add.* output: dimension 'V' has global size 8, "):
        jax.eval_shape(f, *(jax.ShapeDtypeStruct(*s) for s in shapes))


def test_all_gather_rejects_unknown_to():
    with pytest.raises(ValueError, match="to must be 'varying' or 'invarying'"):
        trace(lambda x: so.all_gather("M/d -> M", x, to="replicated"), (2, 4), (P("d"),), [(8,)])


def test_psum_without_vma_check_multiplies():
    """What seqshard's check prevents: lax.psum over an invariant axis multiplies silently."""
    mesh = mesh_of((2, 4))
    f = jax.shard_map(
        lambda x: so.psum("M/d{U_t} -> M/d", x),
        mesh=mesh,
        in_specs=P("d"),
        out_specs=P("d"),
        check_vma=False,
    )
    x = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(f(x), 4 * x)


def test_pmax_gradient_needs_stop_gradient():
    mesh = mesh_of((2, 4))
    f = jax.shard_map(
        lambda x: so.pmax("M{U_t} -> M", x[0]),
        mesh=mesh,
        in_specs=P("t"),
        out_specs=P(),
    )
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    np.testing.assert_array_equal(f(x), x.max(0))
    with pytest.raises(ValueError, match=r"pmax has no gradient.*stop_gradient"):
        jax.grad(lambda x: jnp.sum(f(x)))(x)
    g = jax.shard_map(
        lambda x: so.pmax("M{U_t} -> M", lax.stop_gradient(x[0])),
        mesh=mesh,
        in_specs=P("t"),
        out_specs=P(),
    )
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(g(x)))(x), np.zeros_like(x))


def test_op_outside_shard_map():
    with pytest.raises(ShapeError, match=r"all_gather\('M/d -> M'\).*outside one \(no mesh"):
        so.all_gather("M/d -> M", jnp.ones(4))
    with (
        jax.set_mesh(mesh_of((2, 4))),
        pytest.raises(
            ShapeError,
            match=r"outside one \(the mesh \{'d': 2, 't': 4, 'p': 1, 'e': 1, 'c': 1\} has no manual",
        ),
    ):
        so.psum_scatter("M -> M/t", jnp.ones(4))


# Inside typed_shard_map a scope holds every argument's declared sizes and layout.


def scope_size(w: f32["M/d F/t"]) -> f32["M F/t"]:
    return so.all_gather("F/d M/t -> F M/t", w, to="invarying")  # reads M as F


def scope_order(w: f32["M/t/d"]) -> f32["M"]:  # noqa: F821 (a spec, not a forward reference)
    return so.all_gather("M/d/t -> M", w, to="invarying")  # declared t-major


def test_scope_size_conflict():
    f = typed_shard_map(scope_size, mesh=mesh_of((2, 4)))
    with pytest.raises(ShapeError) as info:
        f(np.zeros((8, 16), np.float32))
    message = str(info.value)
    for word in ["all_gather('F/d M/t -> F M/t')", "'F'", "global size 8", "size 16", "'w'"]:
        assert word in message, (word, message)


def test_scope_axis_order_conflict():
    f = typed_shard_map(scope_order, mesh=mesh_of((2, 4)))
    with pytest.raises(ShapeError) as info:
        f(np.zeros((16,), np.float32))
    message = str(info.value)
    for word in ["all_gather('M/d/t -> M')", "declared 'M/t/d'", "'M/d/t'", "dimension M"]:
        assert word in message, (word, message)


def test_collectives_over_size_one_axes_are_skipped():
    """On an 8x1 mesh t has one shard: gathers and reduce-scatters over t move nothing, so
    none is emitted; over d they still are. In a plain jax.shard_map, t is manual: an invarying
    gather of a value that varies over t keeps its collective (nothing else makes it invariant)."""
    mesh = fake_cpu_mesh((8, 1), ("d", "t"))
    x = jnp.arange(8 * 4 * 8, dtype=jnp.float32).reshape(8, 4, 8)

    def run(body, out_spec, check_vma=True):
        f = jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=P("d", None, "t"), out_specs=out_spec, check_vma=check_vma
            )
        )
        return f(x), count_collectives(f, x)

    y, counts = run(lambda b: so.all_gather("B/d L M/t -> B/d L M", b), P("d", None, None), False)
    np.testing.assert_array_equal(y, x)
    assert sum(counts.values()) == 0
    y, counts = run(lambda b: so.psum_scatter("B/d L M -> B/d L M/t", b), P("d", None, "t"))
    np.testing.assert_array_equal(y, x)
    assert sum(counts.values()) == 0
    y, counts = run(lambda b: so.all_gather("B/d L M/t -> B L M/t", b), P(None, None, "t"), False)
    np.testing.assert_array_equal(y, x)
    assert counts["all-gather"] == 1
    y, counts = run(
        lambda b: so.all_gather("B/d L M/t -> B/d L M", b, to="invarying"), P("d", None, None)
    )
    np.testing.assert_array_equal(y, x)
    assert counts["all-gather"] == 1


# ---------------------------------------------------------------------------------------------
# An axis of size 1 costs nothing: no op emits a collective over it

NO_COLLECTIVES = dict.fromkeys(COLLECTIVE_KINDS, 0)

# Each op over t alone (run where t = 1) and over d alone (run where d = 1).
OVER_T = [
    Case(PS, "B/d L{U_t} -> B/d L"),
    Case(PM, "B/d L{U_t} -> B/d L"),
    Case(A2A, "B L/t -> B/t L"),
    Case(AG, "B/d L M/t -> B/d L M"),
    Case(AG, "B/d L M/t -> B/d L M", to="invarying"),
    Case(AG, "M/t/d -> M/d"),  # the same layout when t = 1
    Case(RS, "B/d L M -> B/d L M/t"),
]
OVER_D = [
    Case(PS, "M/t{U_d} -> M/t"),
    Case(PM, "L/t{U_d} -> L/t"),
    Case(A2A, "B/d L -> B L/d"),
    Case(AG, "M/d F/t -> M F/t"),
    Case(AG, "M/d F/t -> M F/t", to="invarying"),
    Case(AG, "M/d/t -> M/t"),  # the same layout when d = 1
    Case(RS, "M F/t -> M/d F/t"),
]
SIZE_ONE_PARAMS = [
    pytest.param(case, mesh, id=f"{case}-{'x'.join(map(str, mesh))}")
    for cases, meshes in [(OVER_T, [(8, 1), (1, 1)]), (OVER_D, [(1, 8), (1, 1)])]
    for case in cases
    for mesh in meshes
]


def _inputs(case: Case, mesh_shape, k: int = 2) -> list[np.ndarray]:
    ks = {d.label: k for d in case.all_dims()}
    return make_inputs(
        case, mesh_shape, global_sizes(case, mesh_shape, ks), np.random.default_rng(0)
    )


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize(("case", "mesh_shape"), SIZE_ONE_PARAMS)
def test_typed_op_over_size_one_axes_emits_nothing(case, mesh_shape, check_vma):
    """Inside typed_shard_map each op over axes of size 1 equals numpy and compiles to no
    collective, with replication checked or not (axes of size 1 are not manual there)."""
    ks = {d.label: 2 for d in case.all_dims()}
    check_case(case, mesh_shape, check_vma, ks, seed=0, wrap=typed_sharded)
    counts = count_collectives(
        typed_sharded(case, mesh_shape, check_vma), *_inputs(case, mesh_shape)
    )
    assert counts == NO_COLLECTIVES, str(case)


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize(("case", "mesh_shape"), SIZE_ONE_PARAMS)
def test_plain_shard_map_op_over_size_one_axes(case, mesh_shape, check_vma):
    """In a plain jax.shard_map the size-1 axes are manual. Unchecked, no op emits anything
    over them. Checked, a value that varies over a manual axis becomes invariant over it only
    through a collective, so psum, pmax and the invarying gather keep exactly one."""
    ks = {d.label: 2 for d in case.all_dims()}
    check_case(case, mesh_shape, check_vma, ks, seed=0)
    counts = count_collectives(sharded(case, mesh_shape, check_vma), *_inputs(case, mesh_shape))
    keeps = check_vma and (case.op in (PS, PM) or case.to == "invarying")
    assert sum(counts.values()) == (1 if keeps else 0), (str(case), counts)


MULTI_AXIS = [
    (Case(PS, "M{U_t,d} -> M"), "all-reduce"),
    (Case(PM, "M{U_t,d} -> M"), "all-reduce"),
    (Case(AG, "M/t/d -> M"), "all-gather"),
    (Case(AG, "M/t/d -> M", to="invarying"), "all-gather"),
    (Case(RS, "M -> M/t/d"), "reduce-scatter"),
    (Case(RS, "M F -> M/d F/t"), "reduce-scatter"),
    (Case(A2A, "B/t/d L -> B L/t/d"), "all-to-all"),
]


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "novma"])
@pytest.mark.parametrize("mesh_shape", [(8, 1), (1, 8)], ids=["8x1", "1x8"])
@pytest.mark.parametrize(("case", "kind"), [pytest.param(*c, id=str(c[0])) for c in MULTI_AXIS])
def test_multi_axis_op_runs_over_its_axis_above_size_one(case, kind, mesh_shape, check_vma):
    """An op over t and d runs one collective over the axis of size > 1 and none over the other."""
    ks = {d.label: 2 for d in case.all_dims()}
    check_case(case, mesh_shape, check_vma, ks, seed=0, wrap=typed_sharded)
    fn, inputs = typed_sharded(case, mesh_shape, check_vma), _inputs(case, mesh_shape)
    calls = list_collectives(fn, *inputs, mesh=mesh_of(mesh_shape))
    axis = "d" if mesh_shape == (8, 1) else "t"
    assert [(c.kind, c.axes) for c in calls] == [(kind, (axis,))], str(case)


def test_ops_in_a_shard_map_over_some_axes():
    """A plain jax.shard_map that leaves t (size 1) out of its manual axes: specs may still
    name t, ops treat it as one shard, axis_index('t') is 0 without lax.axis_index."""
    mesh = mesh_of((8, 1))

    def body(x):
        assert so.axis_size("t") == 1 and so.axis_size(("t", "d")) == 8
        y = so.all_gather("B/d M/t -> B M", x, to="invarying")  # one all-gather, over d
        s = so.psum("(){U_d,t} -> ()", jnp.sum(x))  # one all-reduce, over d
        z = so.psum_scatter("B/d M{U_t} -> B/d M/t", x)  # nothing: t has one shard
        return y, s, z, so.axis_index(("t", "d"))[None], so.axis_index("t")

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=P("d", None),
            out_specs=(P(), P(), P("d", None), P("d"), P()),
            axis_names=frozenset({"d"}),
            check_vma=True,
        )
    )
    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    y, s, z, index, t_index = f(x)
    np.testing.assert_array_equal(y, x)
    np.testing.assert_array_equal(z, x)
    assert s == x.sum() and t_index == 0
    np.testing.assert_array_equal(index, np.arange(8))
    counts = count_collectives(f, x)
    assert counts["all-gather"] == 1 and counts["all-reduce"] == 1, counts
    assert counts["reduce-scatter"] == 0 and counts["all-to-all"] == 0, counts


# ---------------------------------------------------------------------------------------------
# The sequence in zigzag order over c: reorder, split, ring_shift


def test_zigzag_chunks_give_shard_i_chunks_i_and_2c_minus_1_minus_i():
    assert so.zigzag_chunks(1) == (0, 1)
    assert so.zigzag_chunks(2) == (0, 3, 1, 2)
    assert so.zigzag_chunks(4) == (0, 7, 1, 6, 2, 5, 3, 4)


def _on_c(c: int):
    return fake_cpu_mesh((8 // c, c), ("d", "c"))


def test_reorder_then_split_keeps_each_shards_zigzag_chunks():
    c, length = 4, 16
    x = np.arange(2 * length, dtype=np.int32).reshape(2, length)

    @functools.partial(typed_shard_map, mesh=_on_c(c))
    def local(x: i32[b"B/d L"]) -> i32[b"B/d L@zigzag/c"]:
        zigzag = so.reorder("B/d L -> B/d L@zigzag", x)
        back = so.reorder("B/d L@zigzag -> B/d L", zigzag)
        assert back.shape == x.shape
        return so.split("B/d L@zigzag -> B/d L@zigzag/c", zigzag)

    got = np.asarray(local(x))  # global: the rows in zigzag order
    order = np.concatenate([np.arange(2 * c).reshape(-1, 1)[i] for i in so.zigzag_chunks(c)])
    chunks = x.reshape(2, 2 * c, length // (2 * c))[:, order].reshape(2, length)
    np.testing.assert_array_equal(got, chunks)
    np.testing.assert_array_equal(got[0, :4], [0, 1, 14, 15])  # shard 0: chunks 0 and 7


def test_a_spec_that_ignores_the_order_is_an_error():
    @functools.partial(typed_shard_map, mesh=_on_c(2))
    def ignores(x: f32[b"B/d L@zigzag/c M"]) -> f32[b"B/d L M"]:
        return so.all_gather("B/d L/c M -> B/d L M", x)

    with pytest.raises(ShapeError, match=r"declared 'B/d L@zigzag/c M'.*order zigzag vs natural"):
        ignores(np.zeros((4, 8, 2), np.float32))

    @functools.partial(typed_shard_map, mesh=_on_c(2))
    def drops(x: f32[b"B/d L@zigzag/c M"]) -> f32[b"B/d L M"]:
        return so.all_gather("B/d L@zigzag/c M -> B/d L M", x)

    with pytest.raises(ShapeError, match="keeps the order of every dimension.*shardops.reorder"):
        drops(np.zeros((4, 8, 2), np.float32))


def test_reorder_needs_the_whole_dimension_and_chunks_that_divide_it():
    @functools.partial(typed_shard_map, mesh=_on_c(2))
    def split_first(x: f32[b"B/d L/c"]) -> f32[b"B/d L@zigzag/c"]:
        return so.reorder("B/d L/c -> B/d L@zigzag/c", x)

    with pytest.raises(ShapeError, match=r"split over \['c'\].*gather it first"):
        split_first(np.zeros((4, 8), np.float32))

    @functools.partial(typed_shard_map, mesh=_on_c(4))
    def odd(x: f32[b"B/d L@zigzag/c"]) -> f32[b"B/d L@zigzag/c"]:
        return x

    with pytest.raises(ShapeError, match="zigzag order, cut into 2c = 8 chunks"):
        odd(np.zeros((2, 12), np.float32))


def test_ring_shift_passes_each_block_to_the_next_shard():
    c = 4

    @functools.partial(typed_shard_map, mesh=_on_c(c))
    def shifted(x: f32[b"B/d L@zigzag/c"]) -> f32[b"B/d L@zigzag/c"]:
        return so.ring_shift("B/d L@zigzag/c", x, "c")

    x = np.arange(2 * 8, dtype=np.float32).reshape(2, 8)  # 2 positions per shard
    got = np.asarray(shifted(x))
    np.testing.assert_array_equal(got, np.roll(x, 2, axis=1))  # shard i now holds i-1's
    counts = count_collectives(jax.jit(shifted), x)
    assert counts["collective-permute"] == 1
    with pytest.raises(ShapeError, match="mesh axis 'd' splits no dimension"):
        typed_shard_map(_shift_over_d, mesh=_on_c(c))(np.zeros(8, np.float32))


def _shift_over_d(x: f32[b"L/c"]) -> f32[b"L/c"]:
    return so.ring_shift("L/c", x, "d")


def test_ring_shift_over_one_shard_moves_nothing():
    @functools.partial(typed_shard_map, mesh=fake_cpu_mesh((8, 1), ("d", "c")))
    def shifted(x: f32[b"B/d L/c"]) -> f32[b"B/d L/c"]:
        return so.ring_shift("B/d L/c", x, "c")

    x = np.ones((8, 4), np.float32)
    assert count_collectives(jax.jit(shifted), x)["collective-permute"] == 0
