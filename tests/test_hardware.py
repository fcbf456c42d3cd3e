"""Tests of seqshard.hardware: the peak FLOP/s behind MFU."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from seqshard import hardware


def test_known_accelerators_use_the_datasheet_peak(monkeypatch):
    class FakeDevice:
        platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    monkeypatch.setattr(hardware.jax, "devices", lambda: [FakeDevice()])
    hardware.peak_flops.cache_clear()
    try:
        assert hardware.peak_flops(8) == 8 * 989e12
    finally:
        hardware.peak_flops.cache_clear()


def test_cpu_peak_is_measured_once_for_all_fake_devices():
    """Fake CPU devices share the host's cores: the peak does not grow with their count."""
    hardware.peak_flops.cache_clear()
    measured = hardware.measure_matmul_flops(n=256, dtype=jnp.float32, repeats=2)
    assert measured > 1e8  # any CPU does more than 0.1 GFLOP/s
    with pytest.MonkeyPatch.context() as m:
        m.setattr(hardware, "measure_matmul_flops", lambda **kw: 123.0)
        assert hardware.peak_flops(8) == hardware.peak_flops(1) == 123.0
    hardware.peak_flops.cache_clear()
