"""The named-axis notation: parsing shape specs and op specs.

A *shape spec* is space-separated dimensions. A dimension is a name (``batch``, ``M``) or a
positive integer literal (``2``), followed by zero or more ``/axis`` suffixes naming the mesh
axes it is split over, major to minor::

    'B/d L M/t'                 batch split over d, model dim split over t
    '2 M/d K/t D'               a literal dimension of size 2
    'M/t/d'                     M split over t, then each t-block split over d
    'B/d L M{U_t}'              a partial sum: the value still owes a sum over t
    'B/d L@zigzag/c M/t'        L in zigzag order, split over c (see below)
    '()'                        a scalar

A dimension may name its *order* after ``@``: the global dimension is a permutation of the
natural one. The one order is ``zigzag``, the load-balanced layout of a causal sequence over
the context axis ``c``: the dimension is cut into 2c equal chunks and laid out as chunk 0,
2c-1, 1, 2c-2, ..., so that its split over c gives shard i chunks i and 2c-1-i (with c = 1 it
is the natural order). Labels bind one size whatever the order, but layouts differ: an op
that reads a zigzag array with a spec that omits the order is an error, and only
:func:`seqshard.shardlib.shardops.reorder` changes it.

``{U_t}`` (or ``{U_t,d}``) is the seed's *unreduced* marker: it belongs to the whole operand.
In ``index_unreduced`` the table operand marks its indexed dimension with brackets:
``'[V/t] M'``.

An *axis group* (:data:`seqshard.shardlib.axes.GROUPS`) may stand wherever an axis may, and
parses exactly as its axes spelled out in table order: ``'B/dp'`` is ``'B/d/e'``,
``'d_model/t/fsdp'`` is ``'d_model/t/d/e/c'``, ``'{U_t,fsdp}'`` is ``'{U_t,d,e,c}'``. A parsed
spec prints with its groups expanded; an error quoting a spec written with groups shows the
expansion too. A group's name is no dimension's name.

An *op spec* is comma-separated input operands, ``->``, and one output operand::

    'M/d F/t -> M F/t'
    'B/d L M, M F/t -> B/d L F/t'

Parsing is strict: malformed strings raise :class:`SpecSyntaxError` (a ``ValueError``) that
quotes the string with a caret under the offending position. Parsed specs print back in
canonical form, so ``str(parse_shape(s)) == s`` for canonical ``s``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

from seqshard.shardlib.axes import GROUPS

__all__ = [
    "Dim",
    "ORDERS",
    "OpSpec",
    "Shape",
    "SpecSyntaxError",
    "parse_op",
    "parse_shape",
    "spelled",
]

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INT = re.compile(r"[0-9]+")

ORDERS = ("zigzag",)
"""The orders a dimension may name after ``@`` (``'L@zigzag/c'``)."""


class SpecSyntaxError(ValueError):
    """A shape or op spec string is malformed. The message quotes it with a caret, and below
    it the spec with its axis groups expanded (``expansion``, when it has any)."""

    def __init__(self, spec: str, pos: int, problem: str, fix: str = "", expansion: str = ""):
        self.spec, self.pos, self.problem = spec, pos, problem
        caret = " " * (pos + 3) + "^"
        msg = f"malformed spec: {problem}\n  {spec!r}\n{caret}"
        if expansion:
            msg += f"\n  {expansion}"
        if fix:
            msg += f"\n  fix: {fix}"
        super().__init__(msg)


@dataclasses.dataclass(frozen=True)
class Dim:
    """One dimension: ``label`` is a name or an integer literal; ``axes`` split it, major first."""

    label: str
    axes: tuple[str, ...] = ()
    indexed: bool = False
    order: str = ""  # "" (natural) or one of ORDERS: the global dimension permuted

    @property
    def literal(self) -> int | None:
        """The fixed size of a literal dimension such as ``2``, else None."""
        return int(self.label) if self.label[0].isdigit() else None

    def __str__(self) -> str:
        core = "/".join((self.label + (f"@{self.order}" if self.order else ""), *self.axes))
        return f"[{core}]" if self.indexed else core


@dataclasses.dataclass(frozen=True)
class Shape:
    """An operand: its dimensions and the mesh axes it still owes a reduction over."""

    dims: tuple[Dim, ...]
    unreduced: tuple[str, ...] = ()

    @property
    def split_axes(self) -> tuple[str, ...]:
        """Every mesh axis some dimension is split over, in order of appearance."""
        return tuple(a for d in self.dims for a in d.axes)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(d.label for d in self.dims)

    def __str__(self) -> str:
        body = " ".join(map(str, self.dims)) if self.dims else "()"
        return body + (f"{{U_{','.join(self.unreduced)}}}" if self.unreduced else "")


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """``inputs -> output``, e.g. ``'B/d L M, M F/t -> B/d L F/t'``."""

    inputs: tuple[Shape, ...]
    output: Shape
    text: str = dataclasses.field(default="", compare=False)

    def __str__(self) -> str:
        return ", ".join(map(str, self.inputs)) + " -> " + str(self.output)


class _Parser:
    """A hand-written scanner: the grammar is small and every error needs a position."""

    def __init__(self, text: str):
        self.text, self.pos = text, 0
        # (axis, pos, in_marker, the group it was written as or "")
        self.axis_positions: list[tuple[str, int, bool, str]] = []
        self.groups_seen: list[tuple[int, int, str, str]] = []  # (start, end, group, spelled)

    def fail(self, problem: str, pos: int | None = None, fix: str = "") -> SpecSyntaxError:
        pos = self.pos if pos is None else pos
        return SpecSyntaxError(self.text, pos, problem, fix, self.expansion())

    def expansion(self) -> str:
        """``(= 'B/d/e L': dp = d/e)`` for the groups read so far, or "" when there are none."""
        if not self.groups_seen:
            return ""
        out, at = [], 0
        for start, end, _, spelled_out in self.groups_seen:
            out += [self.text[at:start], spelled_out]
            at = end
        defs = dict.fromkeys(f"{g} = {'/'.join(GROUPS[g])}" for _, _, g, _ in self.groups_seen)
        return f"(= {''.join([*out, self.text[at:]])!r}: {', '.join(defs)})"

    def axis_names(self, in_marker: bool) -> list[str]:
        """The mesh axis name at ``pos``, or a group's axes (major to minor); [] if none."""
        pos = self.pos
        name = self.match(_IDENT)
        if name is None:
            return []
        axes = list(GROUPS.get(name, (name,)))
        group = name if name in GROUPS else ""
        if group:
            sep = "," if in_marker else "/"
            self.groups_seen.append((pos, self.pos, group, sep.join(axes)))
        self.axis_positions += [(a, pos, in_marker, group) for a in axes]
        return axes

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def skip_spaces(self) -> None:
        while self.peek() == " ":
            self.pos += 1

    def match(self, pattern: re.Pattern[str]) -> str | None:
        m = pattern.match(self.text, self.pos)
        if not m:
            return None
        self.pos = m.end()
        return m.group()

    def operand(self, allow_brackets: bool) -> Shape:
        self.skip_spaces()
        self.axis_positions = []
        dims: list[Dim] = []
        scalar = self.text.startswith("()", self.pos)
        if scalar:
            self.pos += 2
        else:
            while self.peek() not in ("", ",", "-", "{"):
                dims.append(self.dim(allow_brackets))
                if self.peek() not in (" ", "", ",", "-", "{"):
                    raise self.fail(
                        f"unexpected character {self.peek()!r}",
                        fix="dimensions are names or integers with /axis suffixes, separated by spaces",
                    )
                self.skip_spaces()
        if not dims and not scalar:
            raise self.fail(
                "empty operand", fix="write dimensions such as 'B/d L M', or '()' for a scalar"
            )
        unreduced = self.marker() if self.peek() == "{" else ()
        self.skip_spaces()
        self.check_axes_unique()
        return Shape(tuple(dims), unreduced)

    def dim(self, allow_brackets: bool) -> Dim:
        start = self.pos
        indexed = self.peek() == "["
        if indexed:
            if not allow_brackets:
                raise self.fail(
                    "brackets mark the indexed table dimension, only allowed in an op's input"
                )
            self.pos += 1
        label = self.match(_IDENT) or self.match(_INT)
        if label is None:
            raise self.fail(
                f"expected a dimension name or size, found {self.peek() or 'end of string'!r}",
                fix="names start with a letter or '_'; sizes are positive integers",
            )
        if label in GROUPS:
            raise self.fail(
                f"{label!r} is a mesh axis group ({label} = {'/'.join(GROUPS[label])}), not a "
                "dimension name",
                start + int(indexed),
                fix=f"a group follows '/', as in 'B/{label}'; give the dimension another name",
            )
        if label[0].isdigit() and (label[0] == "0"):
            raise self.fail("a size must be a positive integer without leading zeros", start)
        if label[0].isdigit() and self.peek() and (self.peek().isalpha() or self.peek() == "_"):
            raise self.fail("a name cannot start with a digit", start)
        order = ""
        if self.peek() == "@":
            self.pos += 1
            order_pos = self.pos
            order = self.match(_IDENT) or ""
            if order not in ORDERS:
                raise self.fail(
                    f"unknown order {order!r} after '@'",
                    order_pos,
                    fix=f"the orders are {', '.join(ORDERS)}, e.g. 'L@zigzag/c'",
                )
        axes: list[str] = []
        while self.peek() == "/":
            self.pos += 1
            named = self.axis_names(in_marker=False)
            if not named:
                raise self.fail(
                    "expected a mesh axis name after '/'",
                    fix="write 'M/t' to split M over mesh axis t; '//' and a trailing '/' are not allowed",
                )
            axes += named
        if indexed:
            if self.peek() != "]":
                raise self.fail("expected ']' to close the indexed dimension")
            self.pos += 1
        return Dim(label, tuple(axes), indexed, order)

    def marker(self) -> tuple[str, ...]:
        if not self.text.startswith("{U_", self.pos):
            raise self.fail("expected '{U_' to open an unreduced marker such as '{U_t}'")
        self.pos += 3
        axes = []
        while True:
            named = self.axis_names(in_marker=True)
            if not named:
                raise self.fail("expected a mesh axis name in the unreduced marker")
            axes += named
            if self.peek() == ",":
                self.pos += 1
                continue
            if self.peek() == "}":
                self.pos += 1
                break
            raise self.fail(
                "expected ',' or '}' in the unreduced marker", fix="write '{U_t}' or '{U_t,d}'"
            )
        return tuple(axes)

    def check_axes_unique(self) -> None:
        first: dict[str, bool] = {}
        for axis, pos, in_marker, group in self.axis_positions:
            if axis in first:
                name = f"mesh axis {axis!r}" + (f" (of group {group})" if group else "")
                if first[axis] or in_marker:
                    problem = f"{name} both splits a dimension and is marked unreduced"
                    if first[axis] and in_marker:
                        problem = f"{name} is repeated in the unreduced marker"
                    fix = "a partial sum over an axis cannot also be split over it"
                else:
                    problem = f"{name} used twice in one operand"
                    fix = "each mesh axis splits at most one dimension of an operand"
                raise self.fail(problem, pos, fix=fix)
            first[axis] = in_marker


def _check_text(text: object) -> str:
    if isinstance(text, bytes):
        text = text.decode()
    if not isinstance(text, str):
        raise TypeError(f"a spec must be a str, got {type(text).__name__}: {text!r}")
    if not text.strip():
        raise SpecSyntaxError(text, 0, "empty spec", "write dimensions such as 'B/d L M'")
    return text


@functools.lru_cache(maxsize=4096)
def parse_shape(text: str) -> Shape:
    """Parse one shape spec such as ``'B/d L M/t'``; raise SpecSyntaxError if malformed."""
    return _shape(_Parser(_check_text(text)))


@functools.lru_cache(maxsize=4096)
def parse_op(text: str) -> OpSpec:
    """Parse an op spec such as ``'B/d L M, M F/t -> B/d L F/t'``."""
    return _op(_Parser(_check_text(text)))


def spelled(text: str) -> str:
    """A spec quoted for a message, with its axis groups expanded when it has any::

    spelled('B/dp L -> B L')  ==  "'B/dp L -> B L' (= 'B/d/e L -> B L': dp = d/e)"
    spelled('B/d L')          ==  "'B/d L'"
    """
    p = _Parser(text)
    with contextlib.suppress(SpecSyntaxError):  # a malformed spec: the groups read before the error
        (_op if "->" in text else _shape)(p)
    return " ".join(filter(None, (repr(text), p.expansion())))


def _shape(p: _Parser) -> Shape:
    text = p.text
    shape = p.operand(allow_brackets=False)
    if p.pos != len(text):
        if text.startswith("->", p.pos) or p.peek() == ",":
            raise p.fail("a shape spec has no ',' or '->'", fix="op specs belong to shardops calls")
        raise p.fail(f"unexpected character {p.peek()!r}")
    return shape


def _op(p: _Parser) -> OpSpec:
    text = p.text
    inputs = [p.operand(allow_brackets=True)]
    while p.peek() == ",":
        p.pos += 1
        inputs.append(p.operand(allow_brackets=True))
    if not text.startswith("->", p.pos):
        if p.pos >= len(text):
            raise p.fail(
                "missing '->'", fix="op specs read 'inputs -> output', e.g. 'M/d F -> M F'"
            )
        raise p.fail(f"unexpected character {p.peek()!r}")
    p.pos += 2
    output = p.operand(allow_brackets=False)
    if text.startswith("->", p.pos):
        raise p.fail("'->' appears twice", fix="an op spec has exactly one '->'")
    if p.pos != len(text):
        raise p.fail(f"unexpected character {p.peek()!r}")
    return OpSpec(tuple(inputs), output, text)
