"""Tests for seqshard/shardlib/notation.py: canonical round trips, generated specs, fuzzing, error carets."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqshard.shardlib.notation import Dim, OpSpec, Shape, SpecSyntaxError, parse_op, parse_shape

# ---------------------------------------------------------------------------------------------
# Canonical strings print back unchanged

CANONICAL_SHAPES = [
    "B/d L M/t",
    "M",
    "2 M/d K/t D",
    "d_model/t/d",
    "d_model/d n_q_per_kv n_kv/t d_head",
    "vocab/t d_model/d",
    "layers d_model/d d_ff/t",
    "B/d L M{U_t}",
    "B/d L{U_t,c}",
    "M{U_t,d}",
    "()",
    "(){U_t}",
    "(){U_d,t}",
    "1",
    "2",
    "128/t",
    "_x x1/a/b/c",
]

CANONICAL_OPS = [
    "M/d F/t -> M F/t",
    "B/d L M -> B/d L M/t",
    "B/d L M, M F/t -> B/d L F/t",
    "B/d L F/t, M F/t -> B/d L M",
    "B/d L F/t, M F/t -> B/d L M{U_t}",
    "[V/t] M, B/d L -> B/d L M",
    "[V/t/d] M, B L -> B L M{U_t,d}",
    "M [V/t], B/d L -> B/d L M",
    "B/d L{U_t} -> B/d L",
    "M{U_t,d} -> M{U_d}",
    "(){U_t} -> ()",
    "() -> ()",
    "2 M/d K/t D -> 2 M K/t D",
    "M/t/d -> M/d",
    "B/d L -> B L/d",
    "a, b, c -> a",
]


@pytest.mark.parametrize("spec", CANONICAL_SHAPES)
def test_shape_round_trip(spec):
    assert str(parse_shape(spec)) == spec


@pytest.mark.parametrize("spec", CANONICAL_OPS)
def test_op_round_trip(spec):
    op = parse_op(spec)
    assert str(op) == spec
    assert op.text == spec


def test_parsed_structure():
    op = parse_op("[V/t/d] M, B/d L -> B/d L M{U_t}")
    table, ids = op.inputs
    assert table.dims == (Dim("V", ("t", "d"), indexed=True), Dim("M"))
    assert ids.dims == (Dim("B", ("d",)), Dim("L"))
    assert op.output.unreduced == ("t",)
    assert op.output.split_axes == ("d",)
    assert table.split_axes == ("t", "d")
    assert ids.labels == ("B", "L")
    assert parse_shape("2 M/d").dims[0].literal == 2
    assert parse_shape("2 M/d").dims[1].literal is None
    assert parse_shape("()") == Shape(())
    assert parse_shape("(){U_t}") == Shape((), ("t",))


@pytest.mark.parametrize(
    ("loose", "canonical"),
    [
        ("  M   F/t ", "M F/t"),
        ("M {U_t}", "M{U_t}"),
        ("a,b->c", "a, b -> c"),
        ("M/d F/t->M F/t", "M/d F/t -> M F/t"),
    ],
)
def test_non_canonical_spacing_normalizes(loose, canonical):
    parse = parse_op if "->" in loose else parse_shape
    assert str(parse(loose)) == canonical


def test_bytes_are_accepted_and_non_strings_rejected():
    assert parse_shape(b"B/d L".decode()) == parse_shape("B/d L")
    with pytest.raises(TypeError, match="must be a str"):
        parse_shape(3)


# ---------------------------------------------------------------------------------------------
# Generated valid specs round-trip

NAMES = st.sampled_from(["B", "L", "M", "F", "V", "d_model", "n_kv", "_h", "x9"])
LITERALS = st.integers(1, 4096).map(str)
AXES = ["d", "t", "a", "b", "c", "data", "x_1"]


@st.composite
def shapes(draw, allow_brackets=False, allow_marker=True):
    """A valid operand: dims with unique axes across the operand, maybe a {U_..} marker."""
    free = list(AXES)
    dims = []
    n = draw(st.integers(0, 4))
    bracket_at = (
        draw(st.integers(0, n - 1)) if (allow_brackets and n and draw(st.booleans())) else -1
    )
    for i in range(n):
        label = draw(st.one_of(NAMES, LITERALS))
        k = draw(st.integers(0, min(3, len(free))))
        axes = tuple(draw(st.permutations(free))[:k]) if k else ()
        free = [a for a in free if a not in axes]
        dims.append(Dim(label, axes, indexed=(i == bracket_at)))
    unreduced = ()
    if allow_marker and free and draw(st.booleans()):
        k = draw(st.integers(1, min(2, len(free))))
        unreduced = tuple(draw(st.permutations(free))[:k])
    return Shape(tuple(dims), unreduced)


@st.composite
def op_specs(draw):
    inputs = tuple(draw(shapes(allow_brackets=True)) for _ in range(draw(st.integers(1, 3))))
    return OpSpec(inputs, draw(shapes()))


@settings(deadline=None, max_examples=200)
@given(st.sampled_from([(shapes, parse_shape), (op_specs, parse_op)]), st.data())
def test_generated_shapes_and_ops_round_trip(kind, data):
    strategy, parse = kind
    spec = data.draw(strategy())
    text = str(spec)
    assert parse(text) == spec
    assert str(parse(text)) == text


# ---------------------------------------------------------------------------------------------
# Fuzzing: a parsed spec or SpecSyntaxError, nothing else

SPEC_CHARS = "BLMFVdt_x09 /,->{}[]()U"
JUNK = "#$%.:;=!?é\t\n'\"\\*+<|~"


def _parse_or_syntax_error(parse, text):
    try:
        result = parse(text)
    except SpecSyntaxError as e:
        assert isinstance(e, ValueError)
        assert 0 <= e.pos <= len(text)
        assert repr(text) in str(e)
        return None
    # Whatever parses prints to a canonical string that parses back to the same thing.
    assert parse(str(result)) == result
    return result


@settings(deadline=None, max_examples=400)
@given(st.text(alphabet=SPEC_CHARS + JUNK, max_size=40))
def test_fuzz_random_text(text):
    _parse_or_syntax_error(parse_shape, text)
    _parse_or_syntax_error(parse_op, text)


@settings(deadline=None, max_examples=400)
@given(
    st.text(alphabet=SPEC_CHARS, max_size=40).filter(lambda s: "->" in s or "/" in s),
)
def test_fuzz_spec_alphabet(text):
    _parse_or_syntax_error(parse_shape, text)
    _parse_or_syntax_error(parse_op, text)


@settings(deadline=None, max_examples=300)
@given(op_specs(), st.data())
def test_fuzz_mutated_valid_specs(op, data):
    text = str(op)
    pos = data.draw(st.integers(0, len(text)))
    kind = data.draw(st.sampled_from(["insert", "delete", "replace"]))
    char = data.draw(st.sampled_from(SPEC_CHARS + JUNK))
    if kind == "insert":
        text = text[:pos] + char + text[pos:]
    elif kind == "delete":
        text = text[:pos] + text[pos + 1 :]
    else:
        text = text[:pos] + char + text[pos + 1 :]
    _parse_or_syntax_error(parse_shape, text)
    _parse_or_syntax_error(parse_op, text)


# ---------------------------------------------------------------------------------------------
# Documented malformed cases: the message quotes the spec and puts a caret under the error


def _caret_column(message: str, spec: str) -> int:
    """The index into ``spec`` of the character the caret points at."""
    lines = message.splitlines()
    quoted = next(i for i, line in enumerate(lines) if line.strip() == repr(spec))
    caret_line = lines[quoted + 1]
    assert caret_line.strip() == "^", message
    return caret_line.index("^") - (lines[quoted].index(repr(spec)) + 1)


MALFORMED = [
    # (parser, spec, caret position, words in the problem)
    (parse_shape, "", 0, "empty spec"),
    (parse_op, "   ", 0, "empty spec"),
    (parse_shape, "M//t", 2, "mesh axis name after '/'"),
    (parse_shape, "M/", 2, "mesh axis name after '/'"),
    (parse_op, "B/d M/ -> B M", 6, "mesh axis name after '/'"),
    (parse_shape, "M/t/t", 4, "mesh axis 't' used twice"),
    (parse_shape, "B/d L M/d", 8, "mesh axis 'd' used twice"),
    (parse_op, "M/t F, B/d L/d -> B L", 13, "mesh axis 'd' used twice"),
    (parse_shape, "M/t{U_t}", 6, "both splits a dimension and is marked unreduced"),
    (parse_shape, "M{U_t,t}", 6, "repeated in the unreduced marker"),
    (parse_op, "M/d F/t", 7, "missing '->'"),
    (parse_op, "M/d -> M -> M", 9, "'->' appears twice"),
    (parse_shape, "M/d -> M", 4, "no ',' or '->'"),
    (parse_shape, "B/d L$ M", 5, "unexpected character '$'"),
    (parse_op, "M.F -> M", 1, "unexpected character '.'"),
    (parse_shape, "B 012", 2, "without leading zeros"),
    (parse_shape, "0", 0, "without leading zeros"),
    (parse_shape, "2x", 0, "cannot start with a digit"),
    (parse_op, "-> M", 0, "empty operand"),
    (parse_op, "M ->", 4, "empty operand"),
    (parse_shape, "[V/t] M", 0, "brackets"),
    (parse_op, "[V/t] M, B L -> [B] L M", 16, "brackets"),
    (parse_op, "[V/t M, B L -> B L M", 4, "expected ']'"),
    (parse_shape, "M{U_}", 4, "mesh axis name in the unreduced marker"),
    (parse_shape, "M{U_t", 5, "expected ',' or '}'"),
    (parse_shape, "M{t}", 1, "'{U_'"),
]


@pytest.mark.parametrize(
    ("parse", "spec", "pos", "words"), MALFORMED, ids=[repr(c[1]) for c in MALFORMED]
)
def test_malformed_spec_caret(parse, spec, pos, words):
    with pytest.raises(SpecSyntaxError) as info:
        parse(spec)
    err = info.value
    assert isinstance(err, ValueError)
    message = str(err)
    assert words in message
    assert repr(spec) in message
    assert err.pos == pos
    assert _caret_column(message, spec) == pos


def test_error_carries_a_fix():
    with pytest.raises(SpecSyntaxError, match="fix: write 'M/t' to split M over mesh axis t"):
        parse_shape("M//t")


def test_an_order_is_part_of_a_dimension():
    """'L@zigzag/c': L in zigzag order, split over c; printed back as written, and not equal
    to the natural 'L/c'."""
    shape = parse_shape("B/d L@zigzag/c/t M")
    assert shape.dims[1] == Dim("L", ("c", "t"), order="zigzag")
    assert str(shape) == "B/d L@zigzag/c/t M" and shape.dims[1] != Dim("L", ("c", "t"))
    assert str(parse_op("B/d L -> B/d L@zigzag")) == "B/d L -> B/d L@zigzag"
    with pytest.raises(SpecSyntaxError, match="unknown order 'spiral' after '@'") as info:
        parse_shape("L@spiral/c")
    assert "the orders are zigzag" in str(info.value)
