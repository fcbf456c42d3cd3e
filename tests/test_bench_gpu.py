"""scripts/bench_gpu.py runs end to end on CPU: one line per (config, mask), finite fields.

The plain baseline's attention (the kernel the script swaps into reference.py's layer) equals
the reference's einsum attention, through jax.nn.dot_product_attention's XLA path on CPU (the
GPU run takes the same code with implementation='cudnn'); both masks, grouped query heads.

The script is meant for one H100; here it runs the shipped tiny-cpu config shrunk to one
device (mesh 1x1, batch 4 x 64) in a subprocess with one fake CPU device, 1 warm-up and 1 timed
step per variant, both masks, a tiny peak matmul. A missing config listed first must give an
error line and not stop the run. The two variants start from the same weights in f32 with
einsum attention on CPU, so their first-step losses agree: measured equal to the last bit;
checked to rtol 1e-6. About 30 s on 2 cores (four CPU compiles at -O0).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from seqshard.model.reference import reference_attention, reference_mask

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_gpu.py"

FIELDS = (
    "tokens_per_step",
    "seqshard_tokens_per_s",
    "seqshard_tflops",
    "mfu_989",
    "mfu_measured_matmul",
    "temp_gib",
    "plain_tokens_per_s",
    "plain_tflops",
    "plain_mfu_989",
    "plain_temp_gib",
    "ratio_vs_plain",
    "predicted_step_s",
    "measured_step_s",
    "plain_step_s",
    "seqshard_loss0",
    "plain_loss0",
)


@functools.cache
def bench():
    """scripts/bench_gpu.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mask", ["document", "causal"])
def test_fused_attention_equals_reference(mask):
    """[B, L, Q, K, D] = [2, 16, 2, 3, 8] in f32, three documents a row: the kv-major head
    regrouping and the mask (dense for document, is_causal for causal). Measured max difference
    0 (document) and 1.2e-7 (causal) for |out| < 2.9; a q-major grouping differs by 3.9."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 16, 2, 3, 8), dtype=np.float32)
    k, v = (rng.standard_normal((2, 16, 3, 8), dtype=np.float32) for _ in range(2))
    starts = np.zeros((2, 16), bool)
    starts[:, [0, 5, 11]] = True
    fused = bench().fused_attention("xla", causal=mask == "causal")

    @jax.jit  # one compile, not one per eager op
    def both(q, k, v, starts):
        m = reference_mask(starts, mask)
        return fused(q, k, v, m), reference_attention(q, k, v, m)

    got, expected = both(q, k, v, starts)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def _fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split())


@pytest.mark.slow
def test_bench_gpu_runs_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    # One fake device (the script measures one); CPU codegen at -O0 compiles the four steps in
    # about half the time (speed of the compiled code is not what this test checks).
    flags = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=1 {flags}",
        "JAX_PLATFORMS": "cpu",
    }
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--configs",
        "configs/no-such-config.yaml,configs/tiny-cpu.yaml",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--peak-n",
        "128",
        "--peak-repeats",
        "2",
        "--out",
        str(out),
        "mesh.d=1",
        "mesh.t=1",
        "train.batch_size=4",
        "train.seq_len=64",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()

    missing = [ln for ln in lines if ln.startswith("config=no-such-config ")]
    assert len(missing) == 2 and all(" error=" in ln for ln in missing), proc.stdout

    rows = {}
    for line in lines:
        if line.startswith("config=tiny-cpu "):
            fields = _fields(line)
            rows[fields["mask"]] = fields
    assert set(rows) == {"document", "causal"}, proc.stdout
    for mask, fields in rows.items():
        assert "error" not in fields and "plain_error" not in fields, (mask, fields)
        for key in FIELDS:
            assert key in fields, (mask, key, fields)
            if key == "predicted_step_s" and fields[key] == "n/a":  # the planner is optional
                continue
            assert math.isfinite(float(fields[key])), (mask, key, fields[key])
        assert float(fields["seqshard_tokens_per_s"]) > 0 and float(fields["ratio_vs_plain"]) > 0

    summary = [ln for ln in lines if ln.startswith("summary ")]
    assert len(summary) == 1, proc.stdout
    s = _fields(summary[0].removeprefix("summary "))
    assert math.isfinite(float(s["min_ratio_vs_plain"]))
    assert s["largest_config"] == "tiny-cpu"
    assert math.isfinite(float(s["largest_mfu_989_causal"]))

    data = json.loads(out.read_text())
    results = [r for r in data["results"] if "error" not in r]
    assert [r["mask"] for r in results] == ["document", "causal"]
    for r in results:
        # Same initial weights, same f32 math: the plain baseline is the same model.
        assert math.isclose(r["seqshard_loss0"], r["plain_loss0"], rel_tol=1e-6), r
        assert r["tokens_per_step"] == 4 * 64
