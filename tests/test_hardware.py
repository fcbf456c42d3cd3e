"""Tests of seqshard.hardware: the peak FLOP/s behind MFU."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from seqshard import hardware


def _on(monkeypatch, platform: str, device_kind: str) -> None:
    """This process's devices are of ``device_kind``; the peak is looked up afresh."""

    class FakeDevice:
        pass

    FakeDevice.platform, FakeDevice.device_kind = platform, device_kind
    monkeypatch.setattr(hardware.jax, "devices", lambda: [FakeDevice()])
    hardware.peak_flops.cache_clear()


@pytest.fixture(autouse=True)
def _fresh_peak(tmp_path, monkeypatch):
    """No peak known, in memory or on disk (a CPU's measured peak is cached per machine)."""
    monkeypatch.setenv("SEQSHARD_CACHE_DIR", str(tmp_path / "cache"))
    hardware.peak_flops.cache_clear()
    yield
    hardware.peak_flops.cache_clear()


@pytest.mark.parametrize(
    "platform, device_kind, datasheet_peak",
    [
        ("gpu", "NVIDIA H100 80GB HBM3", 989e12),
        ("gpu", "NVIDIA H200", 989e12),
        ("gpu", "NVIDIA A100-SXM4-80GB", 312e12),
        ("gpu", "NVIDIA L4", 121e12),
        ("tpu", "TPU v4", 275e12),
        # v5e's 'TPU v5 lite' holds v5p's 'tpu v5': matched in the table's order, v5e first.
        ("tpu", "TPU v5 lite", 197e12),
        ("tpu", "TPU v5p", 459e12),
        ("tpu", "TPU v6 lite", 918e12),
    ],
)
def test_a_known_device_kind_gets_its_datasheet_peak_times_the_devices(
    monkeypatch, platform, device_kind, datasheet_peak
):
    """jax's device_kind, as each accelerator reports it, finds its chip's dense bf16 peak
    (vendors' datasheets), never a measurement."""
    _on(monkeypatch, platform, device_kind)
    monkeypatch.setattr(hardware, "measure_matmul_flops", lambda **kw: pytest.fail("measured"))
    assert hardware.peak_flops(8) == 8 * datasheet_peak


def test_an_unknown_accelerator_is_measured_in_bf16_on_each_device(monkeypatch):
    _on(monkeypatch, "gpu", "Some Future GPU")
    calls = []
    monkeypatch.setattr(hardware, "measure_matmul_flops", lambda **kw: calls.append(kw) or 5.0e12)
    assert hardware.peak_flops(4) == 4 * 5.0e12
    assert [c["dtype"] for c in calls] == [jnp.bfloat16]


def test_cpu_peak_is_measured_once_for_all_fake_devices():
    """Fake CPU devices share the host's cores: the peak does not grow with their count."""
    measured = hardware.measure_matmul_flops(n=256, dtype=jnp.float32, repeats=2)
    assert measured > 1e8  # any CPU does more than 0.1 GFLOP/s
    with pytest.MonkeyPatch.context() as m:
        m.setattr(hardware, "measure_matmul_flops", lambda **kw: 123.0)
        assert hardware.peak_flops(8) == hardware.peak_flops(1) == 123.0


def test_cpu_peak_is_measured_in_the_runs_compute_dtype():
    calls = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(hardware, "measure_matmul_flops", lambda **kw: calls.append(kw) or 1.0)
        hardware.peak_flops(8, "bfloat16")
        hardware.peak_flops(8, "float32")
    assert [c["dtype"] for c in calls] == [jnp.bfloat16, jnp.float32]


def test_matmul_paths_time_each_way_of_asking_for_a_matmul():
    """Each path is timed (the figures themselves are the benchmarks'); the model's is the
    one measure_matmul_flops times."""
    paths = hardware.matmul_paths(n=128, repeats=1)
    assert list(paths) == list(hardware.MATMUL_PATHS)
    assert all(f > 1e6 for f in paths.values()), paths


def test_a_cpu_peak_is_the_best_measured_on_the_machine(tmp_path):
    """Issue 41, item 14: the CPU's peak was measured afresh at each start, so one machine
    reported 87.7% MFU in one run and 29.7% in the next. Now the best measurement so far is
    kept, keyed by the machine: a start on a busy machine (a low measurement) lowers nothing;
    another process (here: the in-memory cache cleared) reads it back."""
    measured = iter([4.5e11, 3.0e11, 5.0e11, 1.0e11])
    with pytest.MonkeyPatch.context() as m:
        m.setattr(hardware, "measure_matmul_flops", lambda **kw: next(measured))
        peaks = []
        for _ in range(3):
            peaks.append(hardware.peak_flops(8))
            hardware.peak_flops.cache_clear()
        assert peaks == [4.5e11, 4.5e11, 5.0e11]
        assert hardware.peak_flops(8, "bfloat16") == 1.0e11  # another dtype: its own
    kept = json.loads((tmp_path / "cache" / hardware.CPU_PEAK_CACHE).read_text())
    assert sorted(kept.values()) == [1.0e11, 5.0e11]
