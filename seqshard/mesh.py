"""The mesh axes seqshard knows, as data, and meshes built from their sizes (Auto axes).

One ordered table, :data:`MESH_AXES` (:mod:`seqshard.shardlib.axes`), names every mesh axis a
spec may use, what it means and the link it crosses.
A run gives sizes for any subset (``{'d': 4, 't': 2}``); the others have size 1. Every mesh
seqshard builds has all the table's axes, in table order, so one model text (its specs name
``p``, ``d``, ``c`` and ``t``) runs on any of them: an axis of size 1 moves nothing
(seqshard's ops emit no collective over it).

Meshes have axes of type ``AxisType.Auto``: ``jax.make_mesh`` now defaults to Explicit axes,
under which ``jax.shard_map`` rejects any input whose sharding differs from its in_specs; with
Auto axes a jitted shard_map reshards its inputs itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh

from seqshard.shardlib.axes import AXES, MESH_AXES, MeshAxis, full_axis_sizes

__all__ = [
    "AXES",
    "MESH_AXES",
    "MeshAxis",
    "axis_size",
    "axis_sizes",
    "describe_sizes",
    "mesh_from_devices",
    "mesh_of_sizes",
    "training_mesh",
]


def axis_sizes(sizes: Mapping[str, int] | None = None, **named: int) -> dict[str, int]:
    """Every known axis's size, in table order; axes not given have size 1.

    ``axis_sizes({'t': 2})`` -> ``{'p': 1, 'd': 1, 'c': 1, 't': 2}``. An unknown name or a size < 1 is an error.
    """
    out = full_axis_sizes({**(sizes or {}), **named}, "the mesh sizes")
    for name, size in out.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"mesh axis {name} must have an integer size >= 1, got {size!r}.")
    return out


def axis_size(mesh: Mesh, name: str) -> int:
    """The size of axis ``name`` on ``mesh``: 1 if a mesh built by hand lacks it."""
    return full_axis_sizes(dict(mesh.shape))[name]


def describe_sizes(sizes: Mapping[str, int]) -> str:
    """``'d=4 x c=1 x t=2'``: the axes in table order; ``p`` and ``e`` only when they split
    (p != 1: a pipeline, e != 1: experts), so that the meshes of runs without them read as
    they always have."""
    return " x ".join(f"{a}={n}" for a, n in sizes.items() if a not in ("p", "e") or n != 1)


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


def training_mesh(sizes: Mapping[str, int], devices: Sequence | None = None) -> Mesh:
    """The training mesh over every process's devices, laid out along the machine's links.

    ``training_mesh(cfg.mesh.sizes())``. Within one slice (TPU) or node (GPU) the mesh follows
    the physical topology (``jax.make_mesh``). Across several slices or nodes (granules) the
    mesh is hybrid: ``d``, whose FSDP gathers and gradient reductions can wait behind compute,
    is split over the slower links (DCN, InfiniBand), and every other axis (``t``, whose
    transfers sit on the critical path of each layer) stays inside a granule.

    The mesh must use every device of a multi-process or accelerator run: a mismatch is an
    error naming both, before anything compiles. One CPU process may use the first
    ``prod(sizes)`` of its fake devices (tests run many meshes on 8)."""
    full = axis_sizes(sizes)
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(full.values())
    described = describe_sizes(full)
    platform = devices[0].platform if devices else "no"
    processes = len({dev.process_index for dev in devices})
    if need > len(devices) or (need != len(devices) and (processes > 1 or platform != "cpu")):
        raise RuntimeError(
            f"mesh {described} needs {need} devices, but the run has {len(devices)} "
            f"{platform.upper()} devices ({processes} process{'es' if processes > 1 else ''}, "
            f"{len(devices) // processes} each). Set the mesh sizes so that their product is "
            f"{len(devices)} (a size of -1 takes the remaining devices: mesh.d=-1)"
            + (
                f", or give this process {need} fake CPU devices "
                f"(XLA_FLAGS=--xla_force_host_platform_device_count={need})."
                if platform == "cpu" and processes == 1
                else "."
            )
        )
    by_slice, granules = _granules(devices)
    inner = need // full["d"]  # devices of one d index: must stay inside a granule
    if len(granules) == 1 or min(map(len, granules.values())) < inner:
        # One granule; or one process per GPU with no slice information: devices in process
        # order (SLURM numbers tasks node by node), so t's groups, taken innermost, stay
        # inside a node as long as t divides the GPUs per node.
        return mesh_from_devices(tuple(full.values()), tuple(full), devices)
    return _hybrid_mesh(full, devices, len(granules), by_slice)


def _granules(devices: Sequence) -> tuple[bool, dict[int, list]]:
    """(by slice, the devices grouped by the slower links between them): the slices
    (``slice_index``: a TPU pod slice is one ICI domain however many hosts it has; JAX also
    numbers GPU nodes so) when there are several, else the processes (one per GPU node; CPU
    processes stand in for them in tests)."""
    slices = {getattr(dev, "slice_index", None) for dev in devices}
    by_slice = None not in slices and (len(slices) > 1 or devices[0].platform == "tpu")
    out: dict[int, list] = {}
    for dev in devices:
        out.setdefault(dev.slice_index if by_slice else dev.process_index, []).append(dev)
    return by_slice, out


def _hybrid_mesh(full: dict[str, int], devices: Sequence, n: int, by_slice: bool) -> Mesh:
    from jax.experimental import mesh_utils

    if full["d"] % n:
        raise RuntimeError(
            f"the run's {len(devices)} devices sit in {n} slices or nodes joined by slower links, "
            f"and seqshard splits only mesh axis d across those links; d={full['d']} is not a "
            f"multiple of {n}. Choose mesh.d divisible by {n} (each slice or node then holds "
            f"d/{n} x the other axes)."
        )
    outer = {a: (n if a == "d" else 1) for a in full}  # across granules
    inner = {a: size // outer[a] for a, size in full.items()}  # inside one
    grid = mesh_utils.create_hybrid_device_mesh(
        tuple(inner.values()),
        tuple(outer.values()),
        devices,
        process_is_granule=not by_slice,
    )
    return Mesh(grid, tuple(full), axis_types=(AxisType.Auto,) * len(full))
