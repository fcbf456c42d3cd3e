"""Starting a run on its machines: the processes, the CPU device count, XLA's flags, and how a
failing process stops the others.

JAX's multi-controller runtime (``jax.distributed``) runs one process per host; together
their devices form one mesh, and every process runs the same program. seqshard starts it from
whichever source is given, first match wins:

    flags        seqshard train CONFIG --coordinator HOST:PORT --num-processes N --process-id I
    environment  SEQSHARD_COORDINATOR=HOST:PORT SEQSHARD_NUM_PROCESSES=N SEQSHARD_PROCESS_ID=I
    SLURM        inside ``srun`` with more than one task (SLURM_NTASKS > 1): JAX reads SLURM's
                 variables itself (``jax.distributed.initialize()`` with no arguments)
    Cloud TPU    a TPU VM (libtpu installed, TPU_WORKER_HOSTNAMES or TPU_ACCELERATOR_TYPE set):
                 JAX asks the TPU metadata itself; one worker alone runs as one process
    otherwise    one process

``SEQSHARD_DISTRIBUTED=auto`` forces JAX's own detection, ``off`` forces one process.

A Python exception in one process would leave every other process waiting in its next
collective, and then at JAX's shutdown barrier (``runtime.shutdown_timeout_s``). So a process
of a multi-process run that fails prints its error and exits at once (:func:`exit_now`); the
others lose its heartbeat within ``runtime.heartbeat_timeout_s`` and JAX ends them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
from collections.abc import Mapping

__all__ = [
    "CPU_DEVICE_COUNT_FLAG",
    "Processes",
    "agree_any",
    "barrier",
    "cpu_device_count_in_flags",
    "exit_now",
    "find_processes",
    "is_main_process",
    "joined",
    "overlap_flags",
    "process_label",
    "set_overlap_flags",
    "start_processes",
    "use_cpu_devices",
]

CPU_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


# -- devices --------------------------------------------------------------------------------


def cpu_device_count_in_flags(flags: str | None = None) -> int | None:
    """The fake CPU device count set in ``XLA_FLAGS`` (or ``flags``), or None."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    found = re.findall(rf"{CPU_DEVICE_COUNT_FLAG}=(\d+)", flags)
    return int(found[-1]) if found else None  # XLA, like argparse, takes the last one


def use_cpu_devices(n: int) -> int:
    """Give this process's CPU backend ``n`` devices, unless ``XLA_FLAGS`` already sets a count
    (the user's count wins). Returns the count the backend will have.

    ``jax_num_cpu_devices`` would override ``XLA_FLAGS``, so seqshard reads the flag itself
    and sets the option only when the flag is absent. Both are read when the backend starts;
    once it has started (a test calling the CLI in-process) the count is what it is."""
    import jax

    set_in_flags = cpu_device_count_in_flags()
    if set_in_flags is not None:
        return set_in_flags
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backend has started; its device count stands
        return jax.local_device_count() if jax.default_backend() == "cpu" else n
    return n


# -- XLA flags --------------------------------------------------------------------------------

_GPU_OVERLAP_FLAGS = (
    # The latency-hiding scheduler orders async collectives (FSDP all-gathers,
    # reduce-scatters) to run under independent matmuls instead of before them.
    # https://docs.jax.dev/en/latest/gpu_performance_tips.html
    "--xla_gpu_enable_latency_hiding_scheduler=true",
)
_TPU_OVERLAP_FLAGS = (
    # Async collective fusion: all-gathers and reduce-scatters run on the TPU's DMA engines
    # while the TensorCore computes (the flags MaxText sets for FSDP on v4/v5).
    # https://cloud.google.com/tpu/docs/performance-guide and MaxText's LIBTPU_INIT_ARGS
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _accelerator() -> str | None:
    """The accelerator JAX will use, guessed before its backend starts from what is installed
    (and ``JAX_PLATFORMS``): ``'gpu'``, ``'tpu'`` or None."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu", "tpu")):
        return None
    if "tpu" in platforms or (not platforms and _installed("libtpu")):
        return "tpu"
    if any(_installed(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return "gpu"
    return None


def overlap_flags(accelerator: str | None) -> tuple[str, str, tuple[str, ...]]:
    """(environment variable, its current value, flags to add) for ``accelerator``."""
    if accelerator == "gpu":
        return "XLA_FLAGS", os.environ.get("XLA_FLAGS", ""), _GPU_OVERLAP_FLAGS
    if accelerator == "tpu":  # libtpu reads its own variable
        return "LIBTPU_INIT_ARGS", os.environ.get("LIBTPU_INIT_ARGS", ""), _TPU_OVERLAP_FLAGS
    return "XLA_FLAGS", os.environ.get("XLA_FLAGS", ""), ()


def set_overlap_flags(enabled: bool, accelerator: str | None = None) -> list[str]:
    """Add the collective-overlap flags for this machine's accelerator to its environment
    variable (``runtime.overlap_collectives``); a flag already there, with any value, is left
    as the user set it. Must run before JAX's backend starts. Returns the flags added."""
    if not enabled:
        return []
    variable, current, flags = overlap_flags(accelerator or _accelerator())
    added = [f for f in flags if f.split("=")[0] not in current]
    if added:
        os.environ[variable] = " ".join([current, *added]).strip()
    return added


# -- processes --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Processes:
    """How this process joins a run. ``source`` says where that came from; ``auto`` leaves the
    coordinator, count and id to JAX's cluster detection (SLURM, Cloud TPU)."""

    source: str  # 'flags' | 'environment' | 'slurm' | 'tpu' | 'auto' | 'single'
    coordinator: str | None = None
    num_processes: int | None = None  # known in advance for flags, environment and SLURM
    process_id: int | None = None

    @property
    def distributed(self) -> bool:
        return self.source != "single"


def _parse_int(value, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be an integer, got {value!r}.") from None


def find_processes(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> Processes:
    """Where this process's place in the run comes from (see the module docstring)."""
    env = os.environ if environ is None else environ
    given = (coordinator, num_processes, process_id)
    if any(v is not None for v in given):
        return _explicit("flags", *given, ("--coordinator", "--num-processes", "--process-id"))
    if env.get("SEQSHARD_COORDINATOR"):
        n, i = env.get("SEQSHARD_NUM_PROCESSES"), env.get("SEQSHARD_PROCESS_ID")
        return _explicit(
            "environment",
            env["SEQSHARD_COORDINATOR"],
            _parse_int(n, "SEQSHARD_NUM_PROCESSES") if n is not None else None,
            _parse_int(i, "SEQSHARD_PROCESS_ID") if i is not None else None,
            ("SEQSHARD_COORDINATOR", "SEQSHARD_NUM_PROCESSES", "SEQSHARD_PROCESS_ID"),
        )
    mode = env.get("SEQSHARD_DISTRIBUTED", "").lower()
    if mode not in ("", "auto", "off"):
        raise ValueError(f"SEQSHARD_DISTRIBUTED must be auto or off, got {mode!r}.")
    if mode == "off":
        return Processes("single")
    if mode == "auto":
        return Processes("auto")
    if _parse_int(env.get("SLURM_NTASKS", "1"), "SLURM_NTASKS") > 1 and "SLURM_STEP_ID" in env:
        return Processes("slurm", num_processes=int(env["SLURM_NTASKS"]))
    if ("TPU_WORKER_HOSTNAMES" in env or "TPU_ACCELERATOR_TYPE" in env) and _installed("libtpu"):
        hosts = env.get("TPU_WORKER_HOSTNAMES", "")
        if "," in hosts or not hosts:  # several workers (or the metadata will say)
            return Processes("tpu")
    return Processes("single")


def _explicit(source, coordinator, num_processes, process_id, names) -> Processes:
    missing = [
        name
        for name, value in zip(names, (coordinator, num_processes, process_id), strict=True)
        if value is None
    ]
    if missing:
        raise ValueError(
            f"a multi-process run needs all of {', '.join(names)}; missing {', '.join(missing)}. "
            f"Give the same coordinator (process 0's host and a free port) and process count to "
            f"every process, and each its own id 0 .. N-1."
        )
    if not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", coordinator):
        raise ValueError(f"{names[0]} must be HOST:PORT (e.g. 10.0.0.1:1234), got {coordinator!r}.")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"{names[2]}={process_id} must be in 0 .. {names[1]}-1 = {num_processes - 1} "
            f"({names[1]} must be >= 1)."
        )
    if num_processes == 1:
        return Processes("single")
    return Processes(source, coordinator, num_processes, process_id)


def start_processes(processes: Processes, runtime) -> None:
    """Join the run's processes (``jax.distributed.initialize``), with the timeouts of
    ``runtime`` (a :class:`seqshard.config.RuntimeConfig`). Nothing for a single process.

    On CPU the processes' collectives go through gloo (XLA's CPU default has none across
    processes)."""
    if not processes.distributed:
        return
    import jax

    global _joined

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts = dict(
        initialization_timeout=runtime.initialization_timeout_s,
        heartbeat_timeout_seconds=runtime.heartbeat_timeout_s,
        shutdown_timeout_seconds=runtime.shutdown_timeout_s,
    )
    where = (
        f"coordinator {processes.coordinator}, process {processes.process_id} of "
        f"{processes.num_processes}"
        if processes.coordinator
        else f"{processes.source} cluster detection"
    )
    try:
        if processes.coordinator:
            jax.distributed.initialize(
                coordinator_address=processes.coordinator,
                num_processes=processes.num_processes,
                process_id=processes.process_id,
                **timeouts,
            )
        else:  # JAX's cluster detection (SLURM, Cloud TPU) finds all three
            jax.distributed.initialize(**timeouts)
        _joined = True
    except (RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(
            f"could not join the run's processes ({where}): {first}. Check that every process "
            f"got the same --coordinator and --num-processes, that process 0 is running and "
            f"its port is reachable, and that all joined within runtime.initialization_timeout_s="
            f"{runtime.initialization_timeout_s}."
        ) from None


_joined = False


def joined() -> bool:
    """Whether this process joined a multi-process run (:func:`start_processes`)."""
    return _joined


def is_main_process() -> bool:
    """Whether this process writes the run's files, metrics and messages (process 0)."""
    import jax

    return jax.process_index() == 0


def process_label() -> str:
    """``''`` for one process, ``' (process 1 of 2)'`` in a multi-process run."""
    import jax

    if jax.process_count() == 1:
        return ""
    return f" (process {jax.process_index()} of {jax.process_count()})"


def barrier(name: str) -> None:
    """Every process of the run waits here until all arrive (nothing for one process)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def agree_any(flag: bool) -> bool:
    """Whether ``flag`` is set in any process: every process gets the same answer.

    A stop request (SIGTERM on preemption, Ctrl-C) reaches each host's process at its own
    moment; the checkpoint they then write is a collective, so they must agree on the step.
    One small all-gather per call in a multi-process run (it waits for the step in flight);
    nothing for one process."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.int32))))


def exit_now(code: int) -> None:
    """End this process at once, skipping JAX's shutdown barrier: the others, waiting for it
    in a collective, lose its heartbeat and stop within ``runtime.heartbeat_timeout_s``."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
