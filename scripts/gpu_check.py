#!/usr/bin/env python
"""Every GPU check of seqshard in one command: ``python scripts/gpu_check.py --out DIR``.

Stages, most valuable first, within ``--budget`` seconds (default 480: each stage's limit is
cut to what is left; a stage that fails or runs out of time is recorded and the next runs):

    model   the model on a 1-device mesh against the single-device reference: f32 at precision
            highest (loss 1e-5 relative, logits 1e-4, gradients 1e-4 of each leaf's largest)
            and at the default precision (TF32 on Hopper; reported, bounds 2e-2 / 0.5 / 0.1),
            bf16 with cuDNN attention (``attention_impl=cudnn``) against the bf16 einsum
            reference for the document and causal masks, and with Pallas' segment-id flash
            attention (``pallas``, what ``auto`` runs for the document mask) for the document
            mask (loss 1e-2, logits 0.25, gradients 10%), and the hand-written backward
            against autodiff's (f32, 1e-4)
    matmul  the bf16 matmul paths (bf16 out, f32 out, f32 accumulation cast to bf16, f32) on an
            n^3 product and the 1B's projection shapes, TFLOP/s and max error
    train   ``seqshard train configs/h100-125m.yaml`` for 30 steps on the bundled data, a
            checkpoint, then ``seqshard eval`` of it (its final lines and exit codes)
    bench   ``scripts/bench_gpu.py`` (h100-1b, -125m, -350m, causal mask, 6 timed steps)
    fp8     only when asked for (``--stages model,fp8``): ``model.fp8=current`` in bf16, its
            loss against bf16's without FP8 (1e-2 relative; logits and gradients reported),
            and the FP8 GEMMs XLA made of its loss and gradient (``scripts/bench_gpu.py``'s
            count_gemms; reported: > 0 on GPU where the quantize-dequantize pairs became
            cuBLASLt FP8 GEMMs, 0 on CPU)

It writes ``DIR/gpu_check.json`` (per stage: ok, seconds, what it measured, its output's last
lines) and each stage's log; exits 1 if a check failed. ``--smoke`` runs the same stages on
CPU with tiny shapes (tiny-cpu's model, 3 steps, a 256^3 matmul): what tests/test_gpu_check.py
runs, so the GPU run cannot fail on a typo. The GPU machine lacks omegaconf and tensorboardX:
install their wheels first (pure Python).

This process allocates GPU memory as it goes (``XLA_PYTHON_CLIENT_PREALLOCATE=false``), so the
train and bench stages, each a process of its own, get the rest of the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Before JAX starts: this process's stages are small; its children need the GPU's memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
from bench_gpu import count_gemms  # scripts/, this script's directory: on sys.path

from seqshard.mesh import training_mesh
from seqshard.model import (
    ModelConfig,
    logits_fn,
    loss_fn,
    reference_logits_fn,
    reference_loss_fn,
    weight_structs,
)

CFG = ModelConfig(
    vocab=512,
    d_model=256,
    n_layers=2,
    n_q_per_kv=4,
    n_kv=2,
    d_head=64,
    d_ff=512,
    compute_dtype="float32",
    attention_impl="einsum",
)
BATCH, LENGTH = 4, 256
ROOT = Path(__file__).resolve().parent.parent


SMOKE_CFG = dataclasses.replace(CFG, vocab=128, d_model=64, n_q_per_kv=2, d_head=16, d_ff=128)
SMOKE_BATCH, SMOKE_LENGTH = 2, 32


def random_inputs(cfg: ModelConfig, mesh, seed: int = 0, shape=(BATCH, LENGTH)):
    rng = np.random.default_rng(seed)

    def draw(path, s):
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        x = rng.standard_normal(s.shape)
        x = 1 + 0.5 * x if name in ("layers.ln1", "layers.ln2", "final_norm") else x / 16
        return jax.device_put(x.astype(s.dtype), s.sharding)

    weights = jax.tree_util.tree_map_with_path(draw, weight_structs(cfg, mesh))
    tokens = rng.integers(0, cfg.vocab, shape).astype(np.int32)
    starts = rng.random(shape) < 1 / 16
    starts[:, 0] = True
    return weights, tokens, starts


def outputs(cfg: ModelConfig, mesh, weights, tokens, starts, reference: bool):
    if reference:

        def f(w, t, s):
            lg = jax.value_and_grad(reference_loss_fn)(w, t, s, cfg)
            return lg, reference_logits_fn(w, t, s, cfg)

    else:

        def f(w, t, s):
            lg = jax.value_and_grad(loss_fn)(w, t, s, cfg, mesh)
            return lg, logits_fn(w, t, s, cfg, mesh)

    out = jax.jit(f)(weights, tokens, starts)
    return jax.tree.map(lambda x: np.asarray(x, np.float32), out)


def compare(got, want) -> dict[str, float]:
    (loss, grads), logits = got
    (ref_loss, ref_grads), ref_logits = want
    worst_grad, worst_leaf = 0.0, ""
    for (path, r), g in zip(
        jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads), strict=True
    ):
        if r.size == 0:  # a switched-off weight (model.qk_norm's gains are [0])
            continue
        rel = float(np.max(np.abs(g - r)) / max(np.max(np.abs(r)), 1e-30))
        if rel >= worst_grad:
            worst_grad, worst_leaf = rel, jax.tree_util.keystr(path)
    return {
        "loss": float(loss),
        "ref_loss": float(ref_loss),
        "loss_rel": float(abs(loss - ref_loss) / abs(ref_loss)),
        "logits_abs": float(np.max(np.abs(logits - ref_logits))),
        "logits_max": float(np.max(np.abs(ref_logits))),
        "grad_rel_of_max": worst_grad,
        "grad_worst_leaf": worst_leaf,
        "finite": bool(np.isfinite(loss) and np.all(np.isfinite(logits))),
    }


def check(name: str, measured: dict, loss_rel: float, logits_abs: float, grad_rel: float):
    ok = (
        measured["finite"]
        and measured["loss_rel"] <= loss_rel
        and measured["logits_abs"] <= logits_abs
        and measured["grad_rel_of_max"] <= grad_rel
    )
    shown = " ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in measured.items()
    )
    print(f"check={name} ok={ok} {shown} (bounds {loss_rel:g}/{logits_abs:g}/{grad_rel:g})")
    return {"check": name, "ok": ok, **measured}


def model_checks(mesh, fused: str, smoke: bool = False) -> list[dict]:
    """``fused``: the fused attention to check, cudnn on GPU (xla for a CPU smoke run), with
    both masks; pallas with the document mask (interpreted on CPU); ``smoke``: tiny shapes."""
    rows = []
    base = SMOKE_CFG if smoke else CFG
    shape = (SMOKE_BATCH, SMOKE_LENGTH) if smoke else (BATCH, LENGTH)
    f32 = base
    w, tokens, starts = random_inputs(f32, mesh, shape=shape)
    with jax.default_matmul_precision("highest"):
        want = outputs(f32, mesh, w, tokens, starts, reference=True)
        got = outputs(f32, mesh, w, tokens, starts, reference=False)
        rows.append(check("f32-einsum-highest", compare(got, want), 1e-5, 1e-4, 1e-4))
        auto = outputs(
            dataclasses.replace(f32, backward="autodiff"), mesh, w, tokens, starts, False
        )
        rows.append(check("explicit-vs-autodiff", compare(got, auto), 1e-5, 1e-4, 1e-4))
    got = outputs(f32, mesh, w, tokens, starts, reference=False)
    want = outputs(f32, mesh, w, tokens, starts, reference=True)
    rows.append(check("f32-einsum-default", compare(got, want), 2e-2, 0.5, 0.1))
    for impl, mask in ((fused, "document"), (fused, "causal"), ("pallas", "document")):
        kernel = dataclasses.replace(
            base, compute_dtype="bfloat16", attention_impl=impl, attention_mask=mask
        )
        ref = dataclasses.replace(kernel, attention_impl="einsum")
        wb, tokens, starts = random_inputs(kernel, mesh, shape=shape)
        with jax.default_matmul_precision("highest"):
            want = outputs(ref, mesh, wb, tokens, starts, reference=True)
        got = outputs(kernel, mesh, wb, tokens, starts, reference=False)
        rows.append(check(f"bf16-{impl}-{mask}", compare(got, want), 1e-2, 0.25, 0.1))
    return rows


def fp8_checks(mesh, smoke: bool = False) -> dict:
    """``model.fp8=current`` (bf16, einsum attention) on the model stage's shapes against the
    same weights without FP8: the loss within 1e-2 relative; the logits and gradients reported,
    no bound (e4m3's 3 and e5m2's 2 mantissa bits move them by more than bf16's; ``--smoke``
    on CPU: loss 0.1%, logits 12%, gradients 24% of the largest). Then the GEMMs of its
    compiled loss and gradient by kind (``fp8_gemms``, ``gemms``, ``dots_total``; reported).
    The sharded FP8 model against the FP8 reference is the CPU tests' (to f32 rounding); in
    bf16, e4m3's rounding boundaries make that comparison noisy (gradients 22% apart on CPU)."""
    base = SMOKE_CFG if smoke else CFG
    shape = (SMOKE_BATCH, SMOKE_LENGTH) if smoke else (BATCH, LENGTH)
    cfg = dataclasses.replace(base, compute_dtype="bfloat16", fp8="current")
    w, tokens, starts = random_inputs(cfg, mesh, shape=shape)
    got = outputs(cfg, mesh, w, tokens, starts, reference=False)
    bf16 = outputs(dataclasses.replace(cfg, fp8="none"), mesh, w, tokens, starts, False)
    checks = [check("fp8-current-vs-bf16", compare(got, bf16), 1e-2, math.inf, math.inf)]
    step = jax.jit(lambda w, t, s: jax.value_and_grad(loss_fn)(w, t, s, cfg, mesh))
    gemms = count_gemms(step.lower(w, tokens, starts).compile().as_text())
    print("fp8 " + " ".join(f"{k}={v}" for k, v in gemms.items()), flush=True)
    return {"ok": all(c["ok"] for c in checks), "checks": checks, "gemms": gemms}


def time_fn(fn, *args, repeats: int = 20) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def matmul_paths(m: int, k: int, n: int, label: str) -> dict:
    """TFLOP/s of an [m, k] x [k, n] product by each path (best of 20)."""
    rng = np.random.default_rng(0)
    a32 = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
    b32 = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32))
    a, b = a32.astype(jnp.bfloat16), b32.astype(jnp.bfloat16)
    paths = {
        "bf16_out": (jax.jit(lambda x, y: x @ y), a, b),
        "f32_out": (
            jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32)),
            a,
            b,
        ),
        "f32_acc_bf16_out": (
            jax.jit(
                lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32).astype(
                    jnp.bfloat16
                )
            ),
            a,
            b,
        ),
        "f32": (jax.jit(lambda x, y: x @ y), a32, b32),
    }
    row = {"shape": label, "m": m, "k": k, "n": n}
    for name, (fn, x, y) in paths.items():
        row[f"{name}_tflops"] = 2 * m * k * n / time_fn(fn, x, y) / 1e12
    ref = np.asarray(a.astype(jnp.float32) @ b.astype(jnp.float32))
    for name in ("bf16_out", "f32_acc_bf16_out"):
        fn, x, y = paths[name]
        row[f"{name}_max_err"] = float(np.max(np.abs(np.asarray(fn(x, y), np.float32) - ref)))
    print(
        "matmul "
        + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
    )
    return row


def matmul_stage(n: int) -> list[dict]:
    # The 1B's projections at 8 x 2048 tokens: q (M -> Q*K*D), gate/up (M -> F), down (F -> M).
    tokens = 16384 if n >= 4096 else 256
    scale = 1 if n >= 4096 else 16
    shapes = [
        (n, n, n, f"square{n}"),
        (tokens, 2048 // scale, 2048 // scale, "w_q"),
        (tokens, 2048 // scale, 8192 // scale, "w_up"),
        (tokens, 8192 // scale, 2048 // scale, "w_down"),
        (2048 // scale, tokens, 8192 // scale, "w_up_grad"),
    ]
    return [matmul_paths(*shape) for shape in shapes]


def _run(command: list[str], log: Path, limit: float, env: dict | None = None) -> dict:
    """``command`` in a subprocess (the project root as cwd), its output to ``log``; its exit
    code, seconds and last lines (``timeout`` when killed at ``limit`` seconds)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        try:
            proc = subprocess.run(
                command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=limit, env=env
            )
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    tail = log.read_text().splitlines()[-12:]
    print("\n".join(tail), flush=True)
    return {"exit": code, "seconds": time.perf_counter() - start, "tail": tail}


def train_stage(out: Path, smoke: bool, limit: float) -> dict:
    """A short real run through the CLI, then its evaluation."""
    runs = out / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    cli = [sys.executable, "-m", "seqshard.cli"]
    if smoke:
        config, extra = (
            "configs/tiny-cpu.yaml",
            ["train.steps=3", "train.batch_size=8", "train.seq_len=64", "train.eval_batches=1"],
        )
    else:
        config, extra = "configs/h100-125m.yaml", ["train.steps=30"]
    args = [
        *extra,
        f"run.dir={runs}",
        "run.name=check",
        "train.log_every=5",
        "train.eval_every=1000",
        "train.checkpoint_every=1000",
        "--sample-tokens",
        "16",
    ]
    start = time.perf_counter()
    trained = _run([*cli, "train", config, *args], out / "train.log", limit)
    left = max(limit - (time.perf_counter() - start), 30)
    evaluated = _run([*cli, "eval", str(runs / "check")], out / "eval.log", left)
    shutil.rmtree(runs, ignore_errors=True)  # checkpoints: not worth carrying back
    final = next((line for line in trained["tail"] if "train loss" in line), "")
    return {
        "ok": trained["exit"] == 0 and evaluated["exit"] == 0 and "val loss" in final,
        "train": trained,
        "eval": evaluated,
        "final": final,
    }


def bench_stage(out: Path, smoke: bool, limit: float) -> dict:
    command = [
        sys.executable,
        "scripts/bench_gpu.py",
        "--masks",
        "causal",
        "--out",
        str(out / "bench.json"),
    ]
    if smoke:
        command += [
            "--configs",
            "configs/tiny-cpu.yaml",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--peak-repeats",
            "1",
            "mesh.d=1",
            "mesh.t=1",
            "train.batch_size=4",
            "train.seq_len=64",
        ]
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    else:
        command += [
            "--configs",
            "configs/h100-1b.yaml,configs/h100-125m.yaml,configs/h100-350m.yaml",
            "--steps",
            "6",
            "--warmup",
            "1",
            "--peak-repeats",
            "10",
        ]
        env = None
    ran = _run(command, out / "bench.log", limit, env)
    summary = next((line for line in ran["tail"] if line.startswith("summary ")), "")
    # Every case ran: none printed an error line, and the ratio against plain jit is known.
    errors = [line for line in (out / "bench.log").read_text().splitlines() if " error=" in line]
    ok = (
        ran["exit"] == 0
        and bool(summary)
        and not errors
        and "min_ratio_vs_plain=n/a" not in summary
    )
    return {"ok": ok, "bench": ran, "summary": summary, "errors": errors}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the summary and logs")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, on CPU (the test)")
    p.add_argument("--stages", default="model,matmul,train,bench", help="comma-separated")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all stages")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind})", flush=True)
    started = time.perf_counter()
    summary: dict = {"jax": jax.__version__, "device": device.device_kind, "stages": {}}
    for stage in [s for s in args.stages.split(",") if s]:
        left = args.budget - (time.perf_counter() - started)
        if left < 20:
            summary["stages"][stage] = {"ok": False, "skipped": f"{left:.0f} s of the budget left"}
            continue
        print(f"=== {stage} ({left:.0f} s of the budget left)", flush=True)
        t0 = time.perf_counter()
        try:
            if stage == "model":
                mesh = training_mesh({}, devices=[device])
                fused = "cudnn" if device.platform == "gpu" else "xla"
                checks = model_checks(mesh, fused, args.smoke)
                result = {"ok": all(c["ok"] for c in checks), "checks": checks}
            elif stage == "matmul":
                result = {"ok": True, "matmuls": matmul_stage(256 if args.smoke else 8192)}
            elif stage == "train":
                result = train_stage(args.out, args.smoke, left)
            elif stage == "bench":
                result = bench_stage(args.out, args.smoke, left)
            elif stage == "fp8":
                result = fp8_checks(training_mesh({}, devices=[device]), args.smoke)
            else:
                raise ValueError(f"unknown stage {stage!r} (model, matmul, train, bench, fp8)")
        except Exception as e:  # one stage failing does not stop the others
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        result["seconds"] = time.perf_counter() - t0
        summary["stages"][stage] = result
        error = f" error={result['error']}" if "error" in result else ""
        print(f"=== {stage} ok={result['ok']} in {result['seconds']:.0f} s{error}", flush=True)
    summary["ok"] = all(s["ok"] for s in summary["stages"].values())
    (args.out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"gpu_check ok={summary['ok']} "
        + " ".join(f"{k}={v['ok']}" for k, v in summary["stages"].items()),
        flush=True,
    )
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
