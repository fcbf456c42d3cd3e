"""The mesh axes seqshard knows, as data, and meshes built from their sizes (Auto axes).

One ordered table, :data:`MESH_AXES`, names every mesh axis a spec may use and what it means.
A run gives sizes for any subset (``{'d': 4, 't': 2}``); the others have size 1. Every mesh
seqshard builds has all the table's axes, in table order, so one model text (its specs name
``d`` and ``t``, later ``c`` and ``p``) runs on any of them: an axis of size 1 moves nothing
(seqshard's ops emit no collective over it).

Meshes have axes of type ``AxisType.Auto``: ``jax.make_mesh`` now defaults to Explicit axes,
under which ``jax.shard_map`` rejects any input whose sharding differs from its in_specs; with
Auto axes a jitted shard_map reshards its inputs itself.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh

__all__ = [
    "AXES",
    "MESH_AXES",
    "MeshAxis",
    "axis_sizes",
    "initialize_distributed",
    "mesh_from_devices",
    "mesh_of_sizes",
    "training_mesh",
]


@dataclasses.dataclass(frozen=True)
class MeshAxis:
    """One mesh axis: its name in specs (``'B/d'``) and what splitting over it means."""

    name: str
    meaning: str


MESH_AXES: tuple[MeshAxis, ...] = (
    MeshAxis("d", "data / FSDP: batch rows, and weight rows (d_model) at rest"),
    MeshAxis("t", "tensor (Megatron): heads, d_ff, vocab, and the residual's d_model"),
)
"""Every mesh axis seqshard knows, outermost first (the order of a mesh's devices)."""

AXES: tuple[str, ...] = tuple(a.name for a in MESH_AXES)


def axis_sizes(sizes: Mapping[str, int] | None = None, **named: int) -> dict[str, int]:
    """Every known axis's size, in table order; axes not given have size 1.

    ``axis_sizes({'t': 2})`` -> ``{'d': 1, 't': 2}``. An unknown name or a size < 1 is an error.
    """
    given = {**(sizes or {}), **named}
    unknown = sorted(set(given) - set(AXES))
    if unknown:
        raise ValueError(
            f"unknown mesh axes {unknown}: seqshard's mesh axes are "
            + ", ".join(f"{a.name} ({a.meaning})" for a in MESH_AXES)
            + "."
        )
    out = {}
    for name in AXES:
        size = given.get(name, 1)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"mesh axis {name} must have an integer size >= 1, got {size!r}.")
        out[name] = size
    return out


def mesh_from_devices(shape: Sequence[int], axis_names: Sequence[str], devices: Sequence) -> Mesh:
    """A mesh of ``shape`` over the first ``prod(shape)`` of ``devices``, with Auto axes."""
    need = math.prod(shape)
    if len(devices) < need:
        platform = devices[0].platform if devices else "no"
        hint = (
            f" Set XLA_FLAGS=--xla_force_host_platform_device_count={need} in the environment "
            f"before JAX is imported (tests: in conftest.py)."
            if platform == "cpu"
            else ""
        )
        raise RuntimeError(
            f"a {' x '.join(map(str, shape))} mesh over {tuple(axis_names)} needs {need} "
            f"{platform.upper()} devices but this process has {len(devices)}. Choose a smaller "
            f"mesh.{hint}"
        )
    shape, names, auto = tuple(shape), tuple(axis_names), (AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, names, axis_types=auto, devices=list(devices)[:need])


def mesh_of_sizes(sizes: Mapping[str, int], devices: Sequence | None = None) -> Mesh:
    """A mesh with every known axis (:data:`MESH_AXES`), sized by ``sizes`` (missing: 1).

    Devices default to ``jax.devices()``; the first ``prod(sizes)`` are used.
    """
    full = axis_sizes(sizes)
    devices = jax.devices() if devices is None else devices
    return mesh_from_devices(tuple(full.values()), tuple(full), devices)


def training_mesh(sizes: Mapping[str, int]) -> Mesh:
    """The training mesh over all processes' devices: ``training_mesh(cfg.mesh.sizes())``."""
    return mesh_of_sizes(sizes)


def initialize_distributed() -> None:
    """Start multi-process JAX when launched as one of several processes.

    Reads ``SEQSHARD_COORDINATOR`` (host:port), ``SEQSHARD_NUM_PROCESSES`` and
    ``SEQSHARD_PROCESS_ID``; on TPU pods and SLURM, JAX finds these itself
    (``SEQSHARD_DISTRIBUTED=auto``). Does nothing for a single process.
    """
    if os.environ.get("SEQSHARD_DISTRIBUTED") == "auto":
        jax.distributed.initialize()
        return
    coordinator = os.environ.get("SEQSHARD_COORDINATOR")
    if not coordinator:
        return
    try:
        n, rank = int(os.environ["SEQSHARD_NUM_PROCESSES"]), int(os.environ["SEQSHARD_PROCESS_ID"])
    except (KeyError, ValueError):
        raise RuntimeError(
            "SEQSHARD_COORDINATOR is set, so SEQSHARD_NUM_PROCESSES and SEQSHARD_PROCESS_ID must be "
            "integers too (e.g. 2 and 0)."
        ) from None
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=n, process_id=rank)
