"""Whether a compiled program's collectives run in one order on every device, read off its HLO.

XLA's CPU runtime runs a computation's instructions as soon as their operands are ready, on a
thread pool. Collectives are *started* in program order, and a plain collective finishes
before the next starts; but a loop (a ``while``) may still be running when what follows it
starts. A collective that follows a loop of collectives without reading the loop's result can
then run while the loop's own collectives are still to come, on one device before them and on
another after: the devices wait on each other for ever (a rendezvous timeout), or two
collectives of one group meet (every collective there shares one key). GPU and TPU runtimes
order a device's collectives by program; this is the CPU runtime's hazard, and the
fake-device tests run there.

    late = unordered_after_loops(compiled.as_text())    # [] when the order is safe

Each entry is a loop of collectives and a later collective (or loop of them) in the same
computation that does not depend on the loop's result: code that writes such a program must
make the later one read what the loop made (:func:`seqshard.shardlib.dataflow.after`).
"""

from __future__ import annotations

import dataclasses
import re

from seqshard.shardlib.comms import KINDS, called_computations, hlo_computations

__all__ = ["Unordered", "unordered_after_loops"]

_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"\s(?P<op>[a-z][\w\-]*)\(")
_OPERAND = re.compile(r"%([\w.\-]+)")
_METADATA = re.compile(r",\s*(?:metadata|backend_config|frontend_attributes)=.*$")
_COLLECTIVE_OPS = {*KINDS, *(f"{k}-start" for k in KINDS)}


@dataclasses.dataclass(frozen=True)
class Unordered:
    """A loop of collectives and a later collective that may overtake the loop's own."""

    computation: str
    loop: str  # the while instruction
    later: str  # the collective (or loop of collectives) that does not read the loop's result
    later_op: str


@dataclasses.dataclass(frozen=True)
class _Instruction:
    name: str
    op: str
    operands: tuple[str, ...]
    called: tuple[str, ...]


def _parse(line: str) -> _Instruction | None:
    m = _DEFINITION.match(line)
    if not m:
        return None
    rest = _METADATA.sub("", m["rest"])
    op = _OPCODE.search(rest)
    called = tuple(called_computations(rest))
    operands = tuple(n for n in _OPERAND.findall(rest) if n != m["name"] and n not in called)
    return _Instruction(m["name"], op["op"] if op else "", operands, called)


def unordered_after_loops(hlo_text: str) -> list[Unordered]:
    """Every (loop of collectives, later collective not depending on it) pair, per computation
    of an optimized HLO module, in program order."""
    bodies, _ = hlo_computations(hlo_text)
    parsed = {
        name: [i for i in map(_parse, lines) if i is not None] for name, lines in bodies.items()
    }
    has_collectives: dict[str, bool] = {}

    def collects(computation: str) -> bool:
        if computation not in has_collectives:
            has_collectives[computation] = False  # a cycle guard; HLO has none
            has_collectives[computation] = any(
                i.op in _COLLECTIVE_OPS or any(collects(c) for c in i.called if c in parsed)
                for i in parsed.get(computation, [])
            )
        return has_collectives[computation]

    found = []
    for computation, instructions in parsed.items():
        depends: dict[str, set[str]] = {}  # instruction -> every instruction it reads, transitively
        for i in instructions:
            depends[i.name] = set(i.operands).union(*(depends.get(o, set()) for o in i.operands))
        loops: list[str] = []
        for i in instructions:
            communicates = i.op in _COLLECTIVE_OPS or any(
                collects(c) for c in i.called if c in parsed
            )
            if not communicates:
                continue
            found += [
                Unordered(computation, loop, i.name, i.op)
                for loop in loops
                if loop not in depends[i.name]
            ]
            if i.op == "while":
                loops.append(i.name)
    return found
