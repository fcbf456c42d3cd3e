#!/usr/bin/env python
"""Correctness and matmul-path checks of seqshard on one GPU (the model on a 1-device mesh).

    python scripts/gpu_check.py [--out results.json]

Prints one line per check and what it measured, then ``gpu_check passed=N failed=M``. Each
check compares seqshard's sharded model (``loss_fn``, ``logits_fn`` and the gradients through
the hand-written backward or autodiff's, on a mesh of the first device) with the single-device
plain-JAX reference (``seqshard.model.reference``) on the tests' tiny model shapes scaled up
(vocab 512, d_model 256, 2 layers, GQA 4 x 2 heads of 64, d_ff 512; batch 4 x 256, packed
documents):

* ``f32-einsum-highest``: f32, einsum attention, matmuls at ``precision=highest`` (no TF32):
  loss to 1e-5 relative, logits to 1e-4, gradients to 1e-4 of each leaf's largest entry.
* ``f32-einsum-default``: the same at the backend's default precision (TF32 on Hopper):
  reported, held only to 2e-2 (TF32 keeps 10 mantissa bits).
* ``bf16-cudnn-<mask>``: bf16 compute, ``attention_impl=cudnn`` (cuDNN flash attention)
  against the reference in bf16 with einsum attention: loss within 1e-2, logits within 0.25,
  gradients within 10% of each leaf's largest entry (bf16 rounding; the CPU test holds the
  same model in bf16 to similar bounds).
* ``explicit-vs-autodiff``: ``model.backward`` explicit against autodiff on GPU, f32, highest.

Then the matmul paths a bf16 model can take, on an n^3 product and on the 1B config's
projection shapes: ``bf16 x bf16 -> bf16``, ``bf16 x bf16 -> f32`` (``preferred_element_type``),
the same cast back to bf16 (what a model that keeps bf16 activations runs), and f32 x f32.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

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


def random_inputs(cfg: ModelConfig, mesh, seed: int = 0):
    rng = np.random.default_rng(seed)

    def draw(path, s):
        name = jax.tree_util.keystr(path, simple=True, separator=".")
        x = rng.standard_normal(s.shape)
        x = 1 + 0.5 * x if name in ("layers.ln1", "layers.ln2", "final_norm") else x / 16
        return jax.device_put(x.astype(s.dtype), s.sharding)

    weights = jax.tree_util.tree_map_with_path(draw, weight_structs(cfg, mesh))
    tokens = rng.integers(0, cfg.vocab, (BATCH, LENGTH)).astype(np.int32)
    starts = rng.random((BATCH, LENGTH)) < 1 / 64
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


def model_checks(mesh, fused: str) -> list[dict]:
    """``fused``: the fused attention to check, cudnn on GPU (xla for a CPU smoke run)."""
    rows = []
    f32 = CFG
    w, tokens, starts = random_inputs(f32, mesh)
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
    for mask in ("document", "causal"):
        cudnn = dataclasses.replace(
            CFG, compute_dtype="bfloat16", attention_impl=fused, attention_mask=mask
        )
        ref = dataclasses.replace(cudnn, attention_impl="einsum")
        wb, tokens, starts = random_inputs(cudnn, mesh)
        with jax.default_matmul_precision("highest"):
            want = outputs(ref, mesh, wb, tokens, starts, reference=True)
        got = outputs(cudnn, mesh, wb, tokens, starts, reference=False)
        rows.append(check(f"bf16-{fused}-{mask}", compare(got, want), 1e-2, 0.25, 0.1))
    return rows


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


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--matmul-n", type=int, default=8192)
    args = p.parse_args(argv)
    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.platform} ({device.device_kind})", flush=True)
    mesh = training_mesh({}, devices=[device])
    rows = []
    if not args.skip_model:
        rows += model_checks(mesh, "cudnn" if device.platform == "gpu" else "xla")
    n = args.matmul_n
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
    matmuls = [matmul_paths(*s) for s in shapes]
    failed = sum(not r["ok"] for r in rows)
    print(f"gpu_check passed={len(rows) - failed} failed={failed}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"checks": rows, "matmuls": matmuls}, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
