"""Peak FLOP/s of the machine, the denominator of MFU.

Accelerators: the vendor's dense bf16 peak per chip (no sparsity), looked up by
``device_kind``, times the number of devices. CPU: measured, since there is no datasheet
number; fake CPU devices (``--xla_force_host_platform_device_count``) share the host's cores,
so the peak is the host's, measured once with a large f32 matmul, whatever the device count.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

__all__ = ["KNOWN_PEAKS", "measure_matmul_flops", "peak_flops"]

KNOWN_PEAKS = {  # dense bf16 FLOP/s per chip
    "h100": 989e12,
    "h200": 989e12,
    "h800": 989e12,
    "a100": 312e12,
    "l4": 121e12,
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,
    "tpu v6 lite": 918e12,
    "tpu v6e": 918e12,
}


def measure_matmul_flops(n: int = 2048, dtype=jnp.float32, repeats: int = 3, device=None) -> float:
    """FLOP/s of an n x n x n matmul on one device (best of ``repeats``, after a warm-up)."""
    device = device or jax.devices()[0]
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


@functools.cache
def peak_flops(n_devices: int) -> float:
    """Peak FLOP/s of ``n_devices`` devices of this machine's default backend, all together."""
    device = jax.devices()[0]
    kind = device.device_kind.lower()
    for name, peak in KNOWN_PEAKS.items():
        if name in kind:
            return peak * n_devices
    if device.platform == "cpu":
        return measure_matmul_flops()
    return measure_matmul_flops(n=8192, dtype=jnp.bfloat16) * n_devices
