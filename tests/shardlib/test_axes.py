"""Tests for seqshard/shardlib/axes.py's axis groups and how the notation expands them: a group
parses as its axes spelled out, follows the table, and errors show the expansion."""

# Spec strings such as 'B/dp L' in annotations parse as Python expressions, so ruff reads them
# as forward references to undefined names.
# ruff: noqa: F821

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from seqshard import f32, typed_shard_map
from seqshard.shardlib import axes, shardops
from seqshard.shardlib.notation import SpecSyntaxError, parse_op, parse_shape, spelled
from seqshard.shardlib.shapecheck import ShapeError, check_block
from seqshard.shardlib.shardtypes import shardings
from seqshard.testing import fake_cpu_mesh

# ---------------------------------------------------------------------------------------------
# The groups follow the table


def test_groups_are_the_tables_axes_in_order():
    assert dict(axes.GROUPS) == {"dp": ("d", "e"), "fsdp": ("d", "e", "c")}
    assert axes.group("dp") == ("d", "e")
    assert axes.group("fsdp") == ("d", "e", "c")
    assert [(a.name, a.groups) for a in axes.MESH_AXES] == [
        ("p", ()),
        ("d", ("dp", "fsdp")),
        ("e", ("dp", "fsdp")),
        ("c", ("fsdp",)),
        ("t", ()),
    ]
    assert list(axes.AXIS_GROUPS) == ["dp", "fsdp"]
    assert axes.describe_groups() == "dp = d/e, fsdp = d/e/c"


def test_group_names_are_not_axis_names():
    assert not set(axes.GROUPS) & set(axes.AXES)


def test_unknown_group_lists_the_groups():
    with pytest.raises(ValueError, match=r"unknown axis group 'tp': the groups are dp = d/e, fsdp"):
        axes.group("tp")


# ---------------------------------------------------------------------------------------------
# A group parses exactly as its axes spelled out

GROUPED_SHAPES = [
    ("B/dp", "B/d/e"),
    ("B/dp L M/t", "B/d/e L M/t"),
    ("B/dp L@zigzag/c M", "B/d/e L@zigzag/c M"),
    ("d_model/fsdp d_ff/t", "d_model/d/e/c d_ff/t"),
    ("d_model/t/fsdp", "d_model/t/d/e/c"),
    ("layers/p d_model/fsdp n_kv/t d_head", "layers/p d_model/d/e/c n_kv/t d_head"),
    ("M F/t{U_fsdp}", "M F/t{U_d,e,c}"),
    ("M F{U_t,fsdp}", "M F{U_t,d,e,c}"),
    ("B L M{U_dp}", "B L M{U_d,e}"),
    ("B/dp L M{U_c,t}", "B/d/e L M{U_c,t}"),
    ("(){U_fsdp}", "(){U_d,e,c}"),
]


@pytest.mark.parametrize(("grouped", "expanded"), GROUPED_SHAPES)
def test_grouped_shape_equals_spelled_shape(grouped, expanded):
    shape = parse_shape(grouped)
    assert shape == parse_shape(expanded)
    assert str(shape) == expanded  # a parsed spec prints with its groups expanded


def test_group_axes_in_parsed_structure():
    shape = parse_shape("d_model/t/fsdp d_ff{U_p}")
    assert shape.dims[0].axes == ("t", "d", "e", "c")
    assert shape.split_axes == ("t", "d", "e", "c")
    assert parse_shape("B L M/t{U_p,dp}").unreduced == ("p", "d", "e")


@pytest.mark.parametrize(
    ("grouped", "expanded"),
    [
        ("B/dp L M, M/fsdp F/t -> B/dp L F/t", "B/d/e L M, M/d/e/c F/t -> B/d/e L F/t"),
        ("M/fsdp F/t -> M F/t", "M/d/e/c F/t -> M F/t"),
        ("B/dp L F/t, M F/t -> B/dp L M{U_t}", "B/d/e L F/t, M F/t -> B/d/e L M{U_t}"),
        ("M F/t{U_fsdp} -> M/fsdp F/t", "M F/t{U_d,e,c} -> M/d/e/c F/t"),
        ("[V/t] M, B/dp L -> B/dp L M", "[V/t] M, B/d/e L -> B/d/e L M"),
    ],
)
def test_grouped_op_equals_spelled_op(grouped, expanded):
    op = parse_op(grouped)
    assert op == parse_op(expanded)
    assert str(op) == expanded
    assert op.text == grouped  # the text as written, for messages


def test_typed_annotation_with_groups_has_the_spelled_partition_spec():
    assert f32["d_model/fsdp d_ff/t"] == f32["d_model/d/e/c d_ff/t"]
    assert f32["d_model/fsdp d_ff/t"].partition_spec == P(("d", "e", "c"), "t")
    assert f32["B/dp L M/t"].partition_spec == P(("d", "e"), None, "t")


# ---------------------------------------------------------------------------------------------
# Errors show the expansion


def _syntax_error(parse, spec) -> SpecSyntaxError:
    with pytest.raises(SpecSyntaxError) as info:
        parse(spec)
    return info.value


@pytest.mark.parametrize(
    ("parse", "spec", "pos", "words", "expansion"),
    [
        (
            parse_shape,
            "B/dp M/d",
            7,
            "mesh axis 'd' used twice in one operand",
            "(= 'B/d/e M/d': dp = d/e)",
        ),
        (
            parse_shape,
            "B/d M/dp",
            6,
            "mesh axis 'd' (of group dp) used twice in one operand",
            "(= 'B/d M/d/e': dp = d/e)",
        ),
        (
            parse_shape,
            "B/fsdp L@zigzag/c",
            16,
            "mesh axis 'c' used twice",
            "(= 'B/d/e/c L@zigzag/c': fsdp = d/e/c)",
        ),
        (
            parse_shape,
            "B/dp M{U_e}",
            9,
            "'e' both splits a dimension and is marked unreduced",
            "(= 'B/d/e M{U_e}': dp = d/e)",
        ),
        (
            parse_shape,
            "M{U_t,fsdp,c}",
            11,
            "mesh axis 'c' is repeated in the unreduced marker",
            "(= 'M{U_t,d,e,c,c}': fsdp = d/e/c)",
        ),
        (
            parse_op,
            "B/dp L, M/fsdp -> B/dp/t L $",
            27,
            "expected a dimension name or size, found '$'",
            "(= 'B/d/e L, M/d/e/c -> B/d/e/t L $': dp = d/e, fsdp = d/e/c)",
        ),
    ],
)
def test_syntax_error_quotes_the_spec_and_its_expansion(parse, spec, pos, words, expansion):
    err = _syntax_error(parse, spec)
    message = str(err)
    lines = message.splitlines()
    assert words in lines[0]
    assert lines[1] == f"  {spec!r}"
    assert lines[2].index("^") - 3 == pos == err.pos
    assert lines[3] == f"  {expansion}"


def test_syntax_error_without_groups_has_no_expansion_line():
    message = str(_syntax_error(parse_shape, "B/d M/d"))
    assert "(=" not in message
    assert message.splitlines()[3].startswith("  fix:")


def test_a_group_is_not_a_dimension_name():
    err = _syntax_error(parse_shape, "dp L")
    assert "'dp' is a mesh axis group (dp = d/e), not a dimension name" in str(err)
    assert "fix: a group follows '/', as in 'B/dp'" in str(err)
    assert err.pos == 0
    assert _syntax_error(parse_op, "[fsdp] M, B -> B M").pos == 1
    assert _syntax_error(parse_shape, "B fsdp/t").pos == 2


def test_spelled_quotes_a_spec_with_its_expansion():
    assert spelled("B/dp L -> B L") == "'B/dp L -> B L' (= 'B/d/e L -> B L': dp = d/e)"
    assert spelled("d_model/fsdp d_ff/t") == (
        "'d_model/fsdp d_ff/t' (= 'd_model/d/e/c d_ff/t': fsdp = d/e/c)"
    )
    assert spelled("M{U_t,fsdp}") == "'M{U_t,fsdp}' (= 'M{U_t,d,e,c}': fsdp = d/e/c)"
    assert spelled("B/d/e L") == "'B/d/e L'"
    assert spelled("B/dp L/") == "'B/dp L/' (= 'B/d/e L/': dp = d/e)"  # malformed: best effort


def test_unknown_name_after_slash_lists_axes_and_groups():
    """'B/dq' is neither an axis nor a group: it parses as an axis name, and the mesh check
    names it, the mesh's axes and the groups."""
    shape = parse_shape("B/dq L")
    assert shape.dims[0].axes == ("dq",)
    sizes = {"p": 1, "d": 2, "e": 1, "c": 1, "t": 1}
    with pytest.raises(ShapeError) as info:
        check_block(shape, (2, 3), sizes, "here")
    message = str(info.value)
    assert "here: spec 'B/dq L' names mesh axis 'dq'" in message
    assert "('p', 'd', 'e', 'c', 't')" in message
    assert "dp = d/e, fsdp = d/e/c" in message


def test_unknown_name_in_a_type_lists_axes_and_groups():
    mesh = fake_cpu_mesh((2, 1, 1, 1, 1), ("d", "p", "e", "c", "t"))
    with pytest.raises(ShapeError) as info:
        shardings(f32["B/dq L"], mesh)
    message = str(info.value)
    assert "names mesh axis 'dq', which seqshard does not know" in message
    assert "its axes: p, d, e, c, t; its axis groups: dp = d/e, fsdp = d/e/c" in message


# ---------------------------------------------------------------------------------------------
# Through typed_shard_map and the ops: the same program, and messages name both spellings


@pytest.fixture(scope="module")
def mesh():
    return fake_cpu_mesh((2, 2, 2), ("d", "e", "t"))


def _gather_program(mesh, x_spec: str, w_spec: str, op: str):
    @functools.partial(typed_shard_map, mesh=mesh)
    def f(x: f32[x_spec], w: f32[w_spec]) -> f32[x_spec]:
        w = shardops.all_gather(op, w)
        return x * w.sum()

    return f


def test_grouped_and_spelled_programs_are_identical(mesh):
    x = jnp.arange(4 * 8, dtype=jnp.float32).reshape(4, 8)
    w = jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4)
    grouped = _gather_program(mesh, "B/dp L", "M/fsdp F", "M/fsdp F -> M F")
    spelled_out = _gather_program(mesh, "B/d/e L", "M/d/e/c F", "M/d/e/c F -> M F")
    text = jax.jit(grouped).lower(x, w).as_text()
    assert text == jax.jit(spelled_out).lower(x, w).as_text()
    np.testing.assert_array_equal(grouped(x, w), spelled_out(x, w))
    np.testing.assert_array_equal(grouped(x, w), x * w.sum())


def test_op_error_names_the_spec_as_written_and_expanded(mesh):
    @functools.partial(typed_shard_map, mesh=mesh)
    def f(x: f32["B/dp L"]) -> f32["B/dp L"]:
        return shardops.all_gather("B/dp L M -> B L M", x)

    with pytest.raises(ShapeError) as info:
        f(jnp.zeros((4, 8), jnp.float32))
    message = str(info.value)
    assert "all_gather('B/dp L M -> B L M')" in message
    assert "spec 'B/d/e L M' has 3 dimensions" in message
