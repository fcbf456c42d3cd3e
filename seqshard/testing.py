"""Helpers for tests of sharded code, seqshard's and its users': fake CPU meshes and HLO audits.

    mesh = fake_cpu_mesh((2, 4), ('d', 't'))          # needs 8 devices
    count_collectives(jax.jit(step), *args)           # {'all-gather': 9, 'reduce-scatter': 8, ...}
    assert_collectives(step, *args, all_gather=9, reduce_scatter=8, all_reduce=0)

Counts are of collective instructions in the *compiled* HLO (after XLA's optimizations), async
``-start`` forms included and ``-done`` halves not. A ``lax.scan`` body appears once however many
times it runs, so counts do not grow with the number of layers.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Sequence

import jax
from jax.sharding import Mesh

from seqshard.mesh import mesh_from_devices

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "assert_collectives",
    "compiled_hlo",
    "count_collectives",
    "fake_cpu_mesh",
    "list_collectives",
]

COLLECTIVE_KINDS = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "collective-permute",
)

# An HLO instruction line: '%name = TYPE OPCODE(operands), attributes'. The opcode follows the
# result type; names never precede a '(' directly, so matching 'opcode(' finds instructions.
_INSTRUCTION = re.compile(
    r"=\s*(?P<type>.*?)\s(?P<op>all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
    r"(?P<start>-start)?\("
)
_GROUPS = re.compile(r"replica_groups=(\{[^=]*?\}\}|\[[^\]]*\][^,\s]*)")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of compiled HLO: its kind, result type and replica groups."""

    kind: str
    result_type: str
    replica_groups: str

    @property
    def result_shapes(self) -> list[tuple[int, ...]]:
        """The shapes in the result type (several for a tuple-shaped, combined collective)."""
        shapes = []
        for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", self.result_type):
            shapes.append(tuple(int(d) for d in dims.split(",") if d))
        return shapes


def fake_cpu_mesh(shape: Sequence[int], axis_names: Sequence[str]) -> Mesh:
    """A mesh of fake CPU devices with Auto axes (shard_map reshards its inputs itself).

    The process must have been started with enough host devices, e.g.
    ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before JAX is imported.
    """
    shape, axis_names = tuple(int(s) for s in shape), tuple(axis_names)
    if len(shape) != len(axis_names):
        raise ValueError(
            f"fake_cpu_mesh: shape {shape} has {len(shape)} axes but axis_names {axis_names} "
            f"has {len(axis_names)}; give one name per axis."
        )
    return mesh_from_devices(shape, axis_names, jax.devices("cpu"))


def compiled_hlo(fn: Callable, *args, **kwargs) -> str:
    """The optimized HLO text of ``fn`` compiled for these arguments (jitted if it is not)."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return jitted.lower(*args, **kwargs).compile().as_text()


def list_collectives(fn: Callable, *args, **kwargs) -> list[Collective]:
    """Every collective instruction in the compiled HLO of ``fn(*args)``, in text order."""
    found = []
    for line in compiled_hlo(fn, *args, **kwargs).splitlines():
        m = _INSTRUCTION.search(line)
        if m:
            groups = _GROUPS.search(line)
            found.append(Collective(m["op"], m["type"], groups.group(1) if groups else ""))
    return found


def count_collectives(fn: Callable, *args, **kwargs) -> dict[str, int]:
    """Counts of each collective kind in the compiled HLO (every kind present, zeros included)."""
    counts = collections.Counter(c.kind for c in list_collectives(fn, *args, **kwargs))
    return {kind: counts.get(kind, 0) for kind in COLLECTIVE_KINDS}


def assert_collectives(fn: Callable, *args, **expected: int) -> dict[str, int]:
    """Assert exact counts, by keyword (``all_gather=2``; kinds not named are not checked)."""
    unknown = set(expected) - {k.replace("-", "_") for k in COLLECTIVE_KINDS}
    if unknown:
        raise TypeError(
            f"assert_collectives: unknown kinds {sorted(unknown)}; use "
            f"{[k.replace('-', '_') for k in COLLECTIVE_KINDS]}."
        )
    counts = count_collectives(fn, *args)
    got = {k: counts[k.replace("_", "-")] for k in expected}
    if got != expected:
        raise AssertionError(
            f"compiled collectives differ: expected {expected}, got {got} (all counts: {counts})."
        )
    return counts
