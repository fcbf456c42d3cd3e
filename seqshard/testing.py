"""Helpers for tests of sharded code, seqshard's and its users': fake CPU meshes and HLO audits.

    mesh = fake_cpu_mesh((2, 4), ('d', 't'))          # needs 8 devices
    count_collectives(jax.jit(step), *args)           # {'all-gather': 9, 'reduce-scatter': 8, ...}
    assert_collectives(step, *args, all_gather=9, reduce_scatter=8, all_reduce=0)
    count_dots(compiled_hlo(step, *args))             # {('bf16', 'bf16', 'f32'): 30, ...}

Counts are of collective instructions in the *compiled* HLO (after XLA's optimizations), async
``-start`` forms included and ``-done`` halves not. A ``lax.scan`` body appears once however many
times it runs, so counts do not grow with the number of layers.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Sequence

import jax
from jax.sharding import Mesh

from seqshard.mesh import AXES, mesh_from_devices
from seqshard.shardlib.comms import KINDS, Collective, collectives

__all__ = [
    "COLLECTIVE_KINDS",
    "Collective",
    "assert_collectives",
    "compiled_hlo",
    "count_collectives",
    "count_dots",
    "fake_cpu_mesh",
    "list_collectives",
]

COLLECTIVE_KINDS = KINDS


def fake_cpu_mesh(shape: Sequence[int], axis_names: Sequence[str]) -> Mesh:
    """A mesh of fake CPU devices with Auto axes (shard_map reshards its inputs itself).

    When every name is one of seqshard's mesh axes (:data:`seqshard.mesh.MESH_AXES`), the
    others are added after them with size 1 (``fake_cpu_mesh((2, 4), ('d', 't'))`` has axes
    d, t, p, e, c), so seqshard's model, whose specs name them all, runs on it; same devices,
    same layout.
    The process must have been started with enough host devices, e.g.
    ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` set before JAX is imported.
    """
    shape, axis_names = tuple(int(s) for s in shape), tuple(axis_names)
    if len(shape) != len(axis_names):
        raise ValueError(
            f"fake_cpu_mesh: shape {shape} has {len(shape)} axes but axis_names {axis_names} "
            f"has {len(axis_names)}; give one name per axis."
        )
    if set(axis_names) <= set(AXES):
        missing = tuple(a for a in AXES if a not in axis_names)
        shape, axis_names = shape + (1,) * len(missing), axis_names + missing
    return mesh_from_devices(shape, axis_names, jax.devices("cpu"))


def compiled_hlo(fn: Callable, *args, **kwargs) -> str:
    """The optimized HLO text of ``fn`` compiled for these arguments (jitted if it is not)."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return jitted.lower(*args, **kwargs).compile().as_text()


def list_collectives(fn: Callable, *args, mesh: Mesh | None = None, **kwargs) -> list[Collective]:
    """Every collective instruction in the compiled HLO of ``fn(*args)``, in text order.

    With ``mesh``, each also names the mesh axes it runs over (see :mod:`seqshard.shardlib.comms`).
    """
    return collectives(compiled_hlo(fn, *args, **kwargs), mesh)


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


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\w+)\[")
_DOT = re.compile(r"= (\w+)\[[^=]*?\bdot\(%?([\w.\-]+), %?([\w.\-]+)\)")


def count_dots(hlo: str) -> dict[tuple[str, str, str], int]:
    """Dot instructions of an HLO module's text by (lhs, rhs, result) element type, e.g.
    ``{('bf16', 'bf16', 'f32'): 30}``: which matmul path each takes (seqshard.shardlib.matmul).
    A loop body counts once, as in :func:`count_collectives`."""
    types = {}
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            types[m.group(1)] = m.group(2)
    counts: collections.Counter = collections.Counter()
    for line in hlo.splitlines():
        m = _DOT.search(line)
        if m and " dot(" in line:
            out, lhs, rhs = m.groups()
            counts[(types.get(lhs, "?"), types.get(rhs, "?"), out)] += 1
    return dict(counts)
