"""scripts/gpu_check.py's smoke mode on CPU: every stage of the GPU check (the model against
the reference, the matmul paths, a short run through the CLI with eval, bench_gpu) runs with
tiny shapes and the JSON summary says each passed, so the one GPU run of a session does not
fail on a typo. About 90 s on 2 cores (about 12 compiles of the model): slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_stage(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["ok"] and list(summary["stages"]) == ["model", "matmul", "train", "bench"]
    checks = summary["stages"]["model"]["checks"]
    assert [c["check"] for c in checks] == [
        "f32-einsum-highest",
        "explicit-vs-autodiff",
        "f32-einsum-default",
        "bf16-xla-document",
        "bf16-xla-causal",
        "bf16-pallas-document",
    ]
    assert all(c["ok"] and c["finite"] for c in checks)
    assert "val loss" in summary["stages"]["train"]["final"]
    assert summary["stages"]["bench"]["summary"].startswith("summary min_ratio_vs_plain=")
    assert not (tmp_path / "runs").exists()  # the run's checkpoints are not kept
