"""Meshes from config, with Auto axes, and multi-process start-up.

seqshard's meshes have axes ('d', 't') of type ``AxisType.Auto``: ``jax.make_mesh`` now
defaults to Explicit axes, under which ``jax.shard_map`` rejects any input whose sharding
differs from its in_specs; with Auto axes a jitted shard_map reshards its inputs itself.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
from jax.sharding import AxisType, Mesh

if TYPE_CHECKING:  # seqshard.config imports the model, which imports this module
    from seqshard.config import MeshConfig

__all__ = ["AXES", "initialize_distributed", "training_mesh", "mesh_from_devices"]

AXES = ("d", "t")


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


def training_mesh(cfg: MeshConfig) -> Mesh:
    """The (d, t) training mesh over all processes' devices."""
    return mesh_from_devices((cfg.d, cfg.t), AXES, jax.devices())


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
