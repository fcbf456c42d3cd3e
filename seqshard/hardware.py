"""The machines seqshard knows: one table of chips, for MFU and for the planner.

:data:`CHIPS` holds, per accelerator, the vendor's figures: dense bf16 peak FLOP/s (no
sparsity), dense FP8 where it has FP8 matmul units, memory, and the links between chips.
:func:`peak_flops` (the denominator of MFU, bf16's also for FP8 runs) looks a device up in it by ``device_kind`` and multiplies by the device count; on CPU it
measures instead, since there is no datasheet number: fake CPU devices
(``--xla_force_host_platform_device_count``) share the host's cores, so the peak is the
host's, measured with a large matmul in the run's compute dtype, asked for as the model asks
(:func:`measure_matmul_flops`), whatever the device count; the best measurement so far is kept
per machine (:data:`CPU_PEAK_CACHE`).
:mod:`seqshard.plan.planner` reads the rest (``seqshard show CONFIG --devices N --chip NAME``).

Links, as the planner uses them: a collective over a mesh axis whose devices all sit in one
*fast domain* (a GPU node's NVLink/NVSwitch, a TPU slice's ICI) runs at ``fast_bytes_per_s``
per chip; one that crosses domains (GPU nodes over InfiniBand, TPU slices over the data
center network) runs at ``slow_bytes_per_s`` per chip. Both are bytes one chip sends per
second, so a ring collective that sends S bytes per chip takes S / bandwidth:

* NVLink: the datasheet's total (both directions, all links) / 2: one direction, which a
  ring through the NVSwitch uses in full.
* ICI: per-chip bidirectional bandwidth / ports / 2 is one link's one-way bandwidth; a mesh
  axis laid along one torus dimension runs a bidirectional ring over its two links there, so
  2 x that. (An axis spread over several torus dimensions could use more links; not counted.)
* InfiniBand / DCN: the NIC bandwidth per GPU / per chip, one direction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import platform
import time
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp

from seqshard.files import write_whole
from seqshard.shardlib import matmul

__all__ = [
    "CHIPS",
    "CPU_PEAK_CACHE",
    "KNOWN_PEAKS",
    "MATMUL_PATHS",
    "Chip",
    "chip",
    "matmul_paths",
    "measure_matmul_flops",
    "peak_flops",
]

GB = 1e9
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip: its peak, its memory, and its links (see the module docstring)."""

    name: str  # `--chip NAME`
    platform: str  # 'gpu', 'tpu' or 'cpu': what model.attention_impl=auto resolves for
    device_kinds: tuple[str, ...]  # substrings of jax's device_kind (lower case) naming it
    peak_flops: float  # dense bf16 FLOP/s per chip
    hbm_bytes: float  # memory per chip
    usable_fraction: float  # of hbm_bytes that one JAX process may use (see USABLE_*)
    fast_link: str  # 'NVLink', 'ICI', ...
    fast_bytes_per_s: float  # per chip, one direction (see the module docstring)
    fast_domain_chips: int  # chips one fast link joins: a GPU node; a TPU slice at most
    slow_link: str  # 'InfiniBand', 'DCN'
    slow_bytes_per_s: float | None  # per chip, one direction; None: no published figure
    cores_per_chip: int = 1  # TPU slice names count TensorCores: v5p-64 is 32 chips
    nominal: bool = False  # figures are placeholders, not a datasheet's (cpu)
    fp8_flops: float = 0.0  # dense FP8 (e4m3/e5m2) FLOP/s per chip; 0: no FP8 matmul units

    @property
    def fp8_peak(self) -> float:
        """The rate of the model's FP8 matmuls (model.fp8): the FP8 peak, or where the chip
        has no FP8 units the bf16 peak (the dequantized matmul runs there)."""
        return self.fp8_flops or self.peak_flops

    @property
    def usable_bytes(self) -> float:
        """The memory a training step may take on one chip."""
        return self.hbm_bytes * self.usable_fraction

    def describe_count(self, n: int) -> str:
        """``'32 chips (a v5p-64 slice)'``, ``'16 GPUs (2 nodes of 8)'``: what ``n`` devices are."""
        if self.platform == "tpu":
            return f"{n} chip{'s' * (n != 1)} (a {self.name}-{n * self.cores_per_chip} slice)"
        if self.platform == "gpu":
            gpus = f"{n} {self.name.upper()} GPU{'s' * (n != 1)}"
            nodes = -(-n // self.fast_domain_chips)
            if nodes > 1:
                return f"{gpus} ({nodes} nodes of {self.fast_domain_chips})"
            return gpus + (" (one node)" if n > 1 else "")
        return f"{n} fake CPU device{'s' * (n != 1)}"

    @property
    def usable_note(self) -> str:
        """Why :attr:`usable_bytes` is what it is."""
        return {
            "gpu": "JAX's default GPU memory fraction; XLA_PYTHON_CLIENT_MEM_FRACTION raises it",
            "tpu": "less a 5% margin for the TPU runtime",
        }.get(self.platform, "nominal")


# JAX preallocates 75% of a GPU's memory and allocates from that pool
# (https://docs.jax.dev/en/latest/gpu_memory_allocation.html); XLA_PYTHON_CLIENT_MEM_FRACTION
# raises it. On TPU the runtime and the program take some HBM: the 5% kept back is a planner
# margin, not a published figure.
USABLE_GPU = 0.75
USABLE_TPU = 0.95

# Sources. NVIDIA: the H100 / H200 / A100 / L4 datasheets (dense = the sparsity figure / 2;
# FP8: H100/H200 SXM 3,958 TFLOPS sparse, L4 485; A100 has no FP8 tensor cores)
# and the DGX H100 / DGX A100 user guides (8 GPUs per node, one ConnectX-7 400 Gb/s resp.
# ConnectX-6 200 Gb/s InfiniBand NIC per GPU). H800: NVIDIA's H800 SXM5 product brief (NVLink
# cut to 400 GB/s). Google: cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e} ("key specifications":
# peak bf16 per chip, HBM per chip, bidirectional ICI per chip and ICI ports, pod or largest
# slice, DCN); v4's ICI link figure is from the JAX scaling book ("How to Think About TPUs").
CHIPS: Mapping[str, Chip] = {
    c.name: c
    for c in (
        Chip(
            name="h100", platform="gpu", device_kinds=("h100",),
            peak_flops=989e12, hbm_bytes=80 * GB, usable_fraction=USABLE_GPU,
            fast_link="NVLink", fast_bytes_per_s=900 * GB / 2, fast_domain_chips=8,
            slow_link="InfiniBand", slow_bytes_per_s=400e9 / 8,  # 400 Gb/s per GPU
            fp8_flops=1979e12,
        ),
        Chip(
            name="h200", platform="gpu", device_kinds=("h200",),
            peak_flops=989e12, hbm_bytes=141 * GB, usable_fraction=USABLE_GPU,
            fast_link="NVLink", fast_bytes_per_s=900 * GB / 2, fast_domain_chips=8,
            slow_link="InfiniBand", slow_bytes_per_s=400e9 / 8,
            fp8_flops=1979e12,
        ),
        Chip(
            name="h800", platform="gpu", device_kinds=("h800",),
            peak_flops=989e12, hbm_bytes=80 * GB, usable_fraction=USABLE_GPU,
            fast_link="NVLink", fast_bytes_per_s=400 * GB / 2, fast_domain_chips=8,
            slow_link="InfiniBand", slow_bytes_per_s=400e9 / 8,
            fp8_flops=1979e12,
        ),
        Chip(
            name="a100", platform="gpu", device_kinds=("a100",),  # SXM4 80GB
            peak_flops=312e12, hbm_bytes=80 * GB, usable_fraction=USABLE_GPU,
            fast_link="NVLink", fast_bytes_per_s=600 * GB / 2, fast_domain_chips=8,
            slow_link="InfiniBand", slow_bytes_per_s=200e9 / 8,  # 200 Gb/s HDR per GPU
        ),
        Chip(
            name="l4", platform="gpu", device_kinds=("l4",),
            peak_flops=121e12, hbm_bytes=24 * GB, usable_fraction=USABLE_GPU,
            # No NVLink: GPUs of one machine (up to 8, e.g. GCP g2-standard-96) talk over
            # PCIe Gen4 x16, 64 GB/s both directions.
            fast_link="PCIe", fast_bytes_per_s=64 * GB / 2, fast_domain_chips=8,
            slow_link="network", slow_bytes_per_s=None,
            fp8_flops=242e12,
        ),
        Chip(
            name="v4", platform="tpu", device_kinds=("tpu v4",),
            peak_flops=275e12, hbm_bytes=32 * GiB, usable_fraction=USABLE_TPU,
            fast_link="ICI", fast_bytes_per_s=2 * 45 * GB, fast_domain_chips=4096,
            slow_link="DCN", slow_bytes_per_s=None, cores_per_chip=2,
        ),
        Chip(
            name="v5e", platform="tpu", device_kinds=("tpu v5 lite", "tpu v5e"),
            peak_flops=197e12, hbm_bytes=16 * GB, usable_fraction=USABLE_TPU,
            # 400 GB/s bidirectional ICI over 4 ports: 50 GB/s one way per link.
            fast_link="ICI", fast_bytes_per_s=2 * 400 * GB / 4 / 2, fast_domain_chips=256,
            # 6.4 Tb/s of DCN per 256-chip pod.
            slow_link="DCN", slow_bytes_per_s=6.4e12 / 8 / 256,
        ),
        Chip(
            name="v5p", platform="tpu", device_kinds=("tpu v5p", "tpu v5"),
            peak_flops=459e12, hbm_bytes=95 * GiB, usable_fraction=USABLE_TPU,
            # 1200 GB/s bidirectional ICI over 6 ports (3D torus): 100 GB/s one way per link.
            # One slice: up to 6144 chips (16x16x24).
            fast_link="ICI", fast_bytes_per_s=2 * 1200 * GB / 6 / 2, fast_domain_chips=6144,
            slow_link="DCN", slow_bytes_per_s=50e9 / 8,  # 50 Gb/s per chip
            cores_per_chip=2,
        ),
        Chip(
            name="v6e", platform="tpu", device_kinds=("tpu v6 lite", "tpu v6e"),
            peak_flops=918e12, hbm_bytes=32 * GB, usable_fraction=USABLE_TPU,
            # 800 GB/s bidirectional ICI over 4 ports: 100 GB/s one way per link.
            fast_link="ICI", fast_bytes_per_s=2 * 800 * GB / 4 / 2, fast_domain_chips=256,
            slow_link="DCN", slow_bytes_per_s=None,
        ),
        Chip(
            # Nominal placeholders for planning runs on fake CPU devices: a few cores' f32
            # matmul rate (peak_flops() measures the real one), a modest memory per device,
            # and memory-copy speed between devices. Fake devices share one host's cores and
            # RAM, so no figure here is a measurement.
            name="cpu", platform="cpu", device_kinds=(),
            peak_flops=100e9, hbm_bytes=4 * GiB, usable_fraction=1.0,
            fast_link="host memory", fast_bytes_per_s=10 * GB, fast_domain_chips=1 << 20,
            slow_link="network", slow_bytes_per_s=None, nominal=True,
        ),
    )
}  # fmt: skip
"""``--chip NAME`` -> its :class:`Chip`, one entry per accelerator (sources above)."""

KNOWN_PEAKS: Mapping[str, float] = {
    kind: c.peak_flops for c in CHIPS.values() for kind in c.device_kinds
}
"""Dense bf16 FLOP/s per chip by ``device_kind`` substring (lower case), read off :data:`CHIPS`
in its order (``'tpu v5 lite'`` before ``'tpu v5'``)."""


def chip(name: str) -> Chip:
    """The chip called ``name`` (``'h100'``, ``'v5p'``, ...); an unknown name is a ValueError
    naming the known ones."""
    if name not in CHIPS:
        raise ValueError(
            f"unknown chip {name!r}; known chips: {', '.join(CHIPS)}. Pass one of them "
            f"(--chip v5p), or add the chip to CHIPS in seqshard/hardware.py with its sources."
        )
    return CHIPS[name]


def measure_matmul_flops(n: int = 2048, dtype=jnp.float32, repeats: int = 3, device=None) -> float:
    """FLOP/s of an n x n x n matmul of ``dtype`` operands on one device (best of ``repeats``,
    after a warm-up), asked for as the model asks: :func:`seqshard.shardlib.matmul.einsum`
    (on CPU, bf16 products summed in f32 and the result cast to bf16). That is the peak MFU is
    against: a bare ``a @ b`` in bf16 takes another, slower path on CPU (:func:`matmul_paths`)."""
    return _time_matmul(lambda x: matmul.einsum("ij,jk->ik", x, x), n, dtype, repeats, device)


MATMUL_PATHS: Mapping[str, tuple] = {
    "bf16 x bf16 -> bf16 (a @ b)": (jnp.bfloat16, lambda x: x @ x),
    "bf16 x bf16 -> f32, cast to bf16": (
        jnp.bfloat16,
        lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
    ),
    "f32 x f32 -> f32": (jnp.float32, lambda x: x @ x),
    "bf16 upcast, f32 x f32 -> f32, cast to bf16": (
        jnp.bfloat16,
        lambda x: (x.astype(jnp.float32) @ x.astype(jnp.float32)).astype(jnp.bfloat16),
    ),
}
"""The ways to ask a backend for one matmul that :func:`matmul_paths` times: the bf16 product
with a bf16 output, summed in f32 and cast, f32, and bf16 upcast to an f32 dot. Which the
model's bf16 matmuls take is :data:`seqshard.shardlib.matmul.ACCUMULATE`'s choice (a CPU with
bf16 instructions: the second; one without: the last; GPU: the first)."""


def matmul_paths(n: int = 2048, repeats: int = 3, device=None) -> dict[str, float]:
    """FLOP/s of an n x n x n matmul asked for each way of :data:`MATMUL_PATHS`, by name."""
    return {
        name: _time_matmul(fn, n, dtype, repeats, device)
        for name, (dtype, fn) in MATMUL_PATHS.items()
    }


def _time_matmul(fn, n: int, dtype, repeats: int, device) -> float:
    device = device or jax.devices()[0]
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    run = jax.jit(fn)
    run(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


@functools.cache
def peak_flops(n_devices: int, dtype: str = "float32") -> float:
    """Peak FLOP/s of ``n_devices`` devices of this machine's default backend, all together;
    on CPU measured for ``dtype`` operands (the run's ``model.compute_dtype``) on the model's
    matmul path, once for all fake devices."""
    device = jax.devices()[0]
    kind = device.device_kind.lower()
    for name, peak in KNOWN_PEAKS.items():
        if name in kind:
            return peak * n_devices
    if device.platform == "cpu":
        return _cpu_peak(jnp.dtype(dtype))
    return measure_matmul_flops(n=8192, dtype=jnp.bfloat16) * n_devices


CPU_PEAK_CACHE = "cpu-peak.json"
"""The file, in ``$SEQSHARD_CACHE_DIR`` (default ``~/.cache/seqshard``), where the best peak
measured on this CPU is kept: {machine key: FLOP/s}. A measurement on a shared machine moves
from run to run (tiny-cpu: 87.7% MFU at 3,257 tokens/s in one run, 29.7% at 2,150 in another,
the peak taken afresh each time), and one taken while the machine was busy comes out low (MFU
above 100% against it). The best measurement so far is the peak: two runs' MFU compare their
speed, and a busy start can lower neither."""


def _cpu_peak(dtype: jnp.dtype) -> float:
    """The best peak measured on this CPU for ``dtype``: this start's measurement (best of 3)
    or the cache's for this machine (CPU model and count, JAX version, XLA's code-generation
    flags, the model's matmul path for the dtype), whichever is higher, kept there. A cache
    that cannot be read or written is passed over."""
    key = "|".join(
        [_cpu_model(), f"{os.cpu_count()} cpus", f"jax {jax.__version__}", str(dtype),
         " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "optimization" in f),
         str(matmul.matmul_path(jnp.ones(1, dtype), platform="cpu") or dtype)]
    )  # fmt: skip
    path = Path(os.environ.get("SEQSHARD_CACHE_DIR", Path.home() / ".cache" / "seqshard"))
    path = path / CPU_PEAK_CACHE
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    best = known.get(key) if isinstance(known.get(key), float) else 0.0
    peak = max(best, measure_matmul_flops(dtype=dtype))
    if peak > best:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_whole(path, json.dumps({**known, key: peak}).encode())
    return peak


def _cpu_model() -> str:
    """The CPU's model name (Linux), or the platform's processor string."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
