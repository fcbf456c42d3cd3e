#!/usr/bin/env python
"""Time seqshard's train step against a plain ``jax.jit`` Llama on one GPU (H100), per config.

    python scripts/bench_gpu.py                            # h100-125m, -350m, -1b x document, causal
    python scripts/bench_gpu.py --configs configs/h100-1b.yaml --masks causal --steps 20
    python scripts/bench_gpu.py --out runs/bench_gpu.json  # the results as JSON too
    python scripts/bench_gpu.py --configs configs/tiny-cpu.yaml --steps 2 --warmup 1 \\
        mesh.d=1 mesh.t=1                                 # CPU smoke test (positional overrides)

On a node with several GPUs, pick one: ``CUDA_VISIBLE_DEVICES=0 python scripts/bench_gpu.py``.
Every config runs on the first device; a config whose mesh (after ``resolve_mesh`` on one
device, so ``-1`` means 1) needs more than one device is an error line, not a run. Positional
``key=value`` arguments override every config (``load_config``'s overrides), e.g.
``train.batch_size=4 mesh.d=1 mesh.t=1``.

**Target**: seqshard at or above the plain-jit baseline (``ratio_vs_plain >= 1``) at every
size and mask, and the 1B at >= 55% MFU of the 989 TFLOP/s dense-bf16 peak (judged on the
``causal`` mask). Measured on one H200 (JAX 0.11.2, docs/benchmarks.md): the 1B (d_model
2048, 16 layers, 32 q / 8 kv heads, d_head 64, d_ff 8192, vocab 32768, seq 2048, batch 8)
at 493 TFLOP/s, 50% MFU, 1.06x the plain-jit baseline (47%); the 350M 1.05-1.06x, the 125M
1.16x. Issue 44: the ``document`` mask (Pallas' segment-id kernel under ``auto``) within 10%
of ``causal``'s speed on the largest config (``largest_document_vs_causal >= 0.9``, seqshard
tokens/s document over causal); not measured yet.

For each config (default ``configs/h100-{125m,350m,1b}.yaml``) and each ``model.attention_mask``
(``document``, ``causal``), in one process, on one device:

* **seqshard**: :func:`seqshard.train.step.make_train_step` on
  :func:`seqshard.mesh.training_mesh` of the config's mesh, state from
  :func:`seqshard.train.state.init_train_state`, AdamW + clipping from
  :func:`seqshard.train.optimizer.make_optimizer`, everything as the config says
  (``attention_impl: auto`` on GPU is Pallas' flash attention with segment ids for
  ``document`` and cuDNN's ``is_causal`` for ``causal``, einsum on CPU; the line's
  ``attention_impl=`` says which ran; ``model.attention_impl=cudnn`` as an override gives
  ``document`` cuDNN's dense mask instead).
* **plain** (the baseline; ``--no-plain`` skips it): the single-device oracle's math,
  ``seqshard/model/reference.py`` (no copy of the model here), as one plain jitted program, no
  shard_map, no sharding annotation: :func:`~seqshard.model.reference.reference_layer` scanned
  over the layer stack under ``jax.checkpoint(policy=dots_with_no_batch_dims_saveable)``, its
  attention swapped through reference.py's ``attend`` hook for the kernel written here
  (:func:`fused_attention`): ``jax.nn.dot_product_attention(implementation=<the config's
  resolved attention_impl>)``, i.e. cuDNN on GPU, with ``is_causal=True`` for ``causal`` and a
  dense ``[B, 1, L, L]`` mask for ``document`` (where seqshard runs Pallas' segment-id kernel,
  the baseline keeps cuDNN's dense mask: plain JAX's way to the same mask); on CPU (einsum)
  the reference's own einsum attention. Gradients by ``jax.value_and_grad`` (through
  :func:`seqshard.train.step.grads_and_loss`, which sums microbatches exactly as seqshard's
  step does), then the same optax optimizer, jitted with the state donated. It starts from
  the same initial weights, so the two first-step losses printed must agree (to bf16
  rounding on GPU).

Timing: both variants are compiled (``memory_analysis().temp_size_in_bytes`` read from the
executable) and warmed up (``--warmup`` steps); then the ``--steps`` timed steps run
round-robin, one of each variant per round, the order alternating, each step timed alone up to
``block_until_ready``; the step time is the median. The batch is one synthetic batch of the
config's ``train.batch_size x train.seq_len`` random tokens, packed documents (each row starts
one; more start at random, ``--mean-doc-len`` tokens apart on average).

FLOPs are model FLOPs from :func:`seqshard.model.cost.flops_per_token` (matmuls only, attention
counted unmasked, no credit for recomputation), never XLA's ``cost_analysis()``. MFU is given
against 989 TFLOP/s (H100 dense bf16) and against a large bf16 matmul measured in the same run
(:func:`seqshard.hardware.measure_matmul_flops`, ``--peak-n`` = 8192 on GPU, best of
``--peak-repeats``; bf16 summed in f32, the model's way; ``--matmul-paths`` times the other
ways too, bf16 output and f32), measured before the first config and again after the last (both printed;
the lines use the first). The planner's prediction, ``seqshard.plan.planner.plan(cfg, 1,
"h100").step_time_s``, is printed beside the measured step time (``n/a`` if the planner cannot
be imported or fails).

Output: one line per (config, mask)::

    config=h100-1b mask=causal attention_impl=cudnn tokens_per_step=16384
    seqshard_tokens_per_s=... seqshard_tflops=... mfu_989=... mfu_measured_matmul=...
    temp_gib=... plain_tokens_per_s=... plain_tflops=... plain_mfu_989=... plain_temp_gib=...
    ratio_vs_plain=... predicted_step_s=... measured_step_s=... plain_step_s=...
    seqshard_loss0=... plain_loss0=...

(one line each; ``ratio_vs_plain`` is seqshard tokens/s over plain tokens/s). A case that
fails (an OOM, a compile error) prints ``config=... mask=... error="..."`` (a failing plain
variant only blanks the plain fields and adds ``plain_error``) and the run goes on; arrays are
dropped and ``jax.clear_caches()`` runs between cases. The last line is ``summary
min_ratio_vs_plain=... largest_config=... largest_mfu_989_causal=...
largest_mfu_989_document=... largest_document_vs_causal=...`` (the largest config by
parameters: the 1B by default) and whether the targets are met. ``--out FILE`` writes the
same as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from seqshard.batch import TokenBatch
from seqshard.cli import with_hf_model
from seqshard.config import Config, load_config, resolve_mesh
from seqshard.hardware import KNOWN_PEAKS, matmul_paths, measure_matmul_flops
from seqshard.mesh import training_mesh
from seqshard.model import attention
from seqshard.model.attention import dense_mask_impl, resolve_impl
from seqshard.model.config import ModelConfig
from seqshard.model.cost import flops_per_token, param_count
from seqshard.model.reference import (
    Attend,
    reference_embed,
    reference_layer,
    reference_loss_terms,
    reference_mask,
    reference_positions,
    reference_unembed,
)
from seqshard.shardlib.shardtypes import shardings
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import init_train_state
from seqshard.train.step import grads_and_loss, make_train_step

DEFAULT_CONFIGS = "configs/h100-125m.yaml,configs/h100-350m.yaml,configs/h100-1b.yaml"
H100_PEAK = KNOWN_PEAKS["h100"]  # 989e12 dense bf16 FLOP/s
MFU_TARGET = 0.55
DOCUMENT_TARGET = 0.9  # issue 44: the document mask's tokens/s at least 0.9x causal's
GIB = 2**30


# ---------------------------------------------------------------------------------------------
# The baseline: the reference model as one plain jitted program


def fused_attention(impl: str, causal: bool) -> Attend:
    """reference.py's attention as ``jax.nn.dot_product_attention(implementation=impl)``.

    ``causal``: ``is_causal=True`` and the mask unread (the kernel skips the masked half);
    otherwise the dense ``[B, 1, Lq, Lk]`` document mask."""

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
        return attention.fused_attention(q, k, v, mask, impl, causal)

    return attend


def plain_loss_terms(cfg: ModelConfig) -> Callable[..., jax.Array]:
    """``(weights, batch) -> f32[2]`` (summed loss, positions counted): reference.py's layers
    scanned under ``dots_with_no_batch_dims_saveable``, attention as the config resolves it."""
    impl = resolve_impl(cfg.attention_impl, cfg.attention_mask)
    if impl == "pallas":  # jax.nn.dot_product_attention takes no segment ids: the dense mask
        impl = dense_mask_impl(impl)
    if impl not in ("einsum", "cudnn", "xla"):
        raise ValueError(
            f"the plain baseline has attention for einsum, cudnn and xla; the config resolves "
            f"model.attention_impl={cfg.attention_impl!r} to {impl!r}. Run on a GPU (cudnn) or "
            f"pass model.attention_impl=einsum."
        )
    attend = None if impl == "einsum" else fused_attention(impl, cfg.attention_mask == "causal")
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

    def loss_terms(w, batch: TokenBatch) -> jax.Array:
        tokens, starts = batch.tokens, batch.is_seq_start
        positions = reference_positions(starts)
        mask = reference_mask(starts, cfg.attention_mask)

        def layer(x, lw):
            return reference_layer(cfg, lw, x, positions, mask, attend=attend), None

        # prevent_cse=False: no CSE across scan iterations to prevent (JAX's advice for scans).
        body = jax.checkpoint(layer, policy=policy, prevent_cse=False)
        x, _ = lax.scan(body, reference_embed(cfg, w, tokens), w.layers)
        return reference_loss_terms(reference_unembed(cfg, w, x), tokens, starts)

    return loss_terms


def make_plain_step(cfg: Config, mesh, opt: optax.GradientTransformation):
    """``step((weights, opt_state), batch) -> ((weights, opt_state), loss)``, jitted, donated.

    No guard, no shardings: what one writes in plain JAX. ``mesh`` (one device) is only
    passed through to ``grads_and_loss`` for its microbatch split, a no-op on one device."""
    loss_terms = plain_loss_terms(cfg.model)

    def step(state, batch: TokenBatch):
        weights, opt_state = state
        grads, loss, _, _ = grads_and_loss(weights, batch, cfg, mesh, loss_terms)
        updates, opt_state = opt.update(grads, opt_state, weights)
        return (optax.apply_updates(weights, updates), opt_state), loss

    return jax.jit(step, donate_argnums=(0,))


# ---------------------------------------------------------------------------------------------
# Variants


@dataclasses.dataclass
class Variant:
    name: str  # 'seqshard' or 'plain'
    step: object = None  # the compiled executable: (state, batch) -> (state, loss or metrics)
    state: object = None
    batch: TokenBatch | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    temp_bytes: int = -1
    compile_s: float = math.nan
    loss0: float = math.nan

    def run(self) -> float:
        """One step, timed up to block_until_ready; returns its loss."""
        start = time.perf_counter()
        state, out = self.step(self.state, self.batch)
        jax.block_until_ready((state, out))
        self.times.append(time.perf_counter() - start)
        self.state = state
        return float(out["loss"] if isinstance(out, dict) else out)


def synthetic_batch(cfg: Config, mean_doc_len: int, seed: int = 0) -> TokenBatch:
    """Random tokens, packed documents: each row starts one, more start every
    ``mean_doc_len`` tokens on average (numpy, host)."""
    rng = np.random.default_rng(seed)
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    tokens = rng.integers(0, cfg.model.vocab, size=shape, dtype=np.int32)
    starts = rng.random(shape) < 1 / max(mean_doc_len, 1)
    starts[:, 0] = True
    return TokenBatch(tokens=tokens, is_seq_start=starts, loss_mask=np.ones_like(starts))


def compile_and_warm(v: Variant, jitted, warmup: int) -> None:
    """Compile, read the temp memory, run ``warmup`` (>= 1) steps; the first step's loss is kept."""
    start = time.perf_counter()
    compiled = jitted.lower(v.state, v.batch).compile()
    v.compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    v.temp_bytes = int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1
    v.step = compiled
    for i in range(max(warmup, 1)):
        loss = v.run()
        if i == 0:
            v.loss0 = loss
    v.times.clear()


def build(
    cfg: Config, mesh, batch: TokenBatch, args: argparse.Namespace
) -> tuple[list[Variant], str | None]:
    """(variants, why plain failed): both variants (plain unless ``--no-plain``), compiled and
    warmed up, from one initial state: seqshard's, and for plain a copy of its weights and
    optimizer state moved off the mesh onto the plain device (``may_alias=False``: seqshard
    donates the original).

    A plain variant that fails (e.g. out of memory) is dropped and its error returned; a
    seqshard failure raises."""
    opt = make_optimizer(cfg.train)
    state = init_train_state(cfg.model, mesh, opt, jax.random.key(cfg.train.seed))
    seqshard = Variant("seqshard", state=state, batch=batch)
    plain, plain_error = None, None
    if not args.no_plain:
        device = mesh.devices.flat[0]
        try:
            plain_state = jax.device_put((state.weights, state.opt_state), device, may_alias=False)
            plain = Variant("plain", state=plain_state, batch=jax.device_put(batch, device))
        except Exception as e:  # e.g. out of memory: report seqshard alone
            traceback.print_exc(file=sys.stderr)
            plain_error = _first_line(e)
    compile_and_warm(seqshard, make_train_step(cfg, mesh, opt), args.warmup)
    if plain is None:
        return [seqshard], plain_error
    try:
        compile_and_warm(plain, make_plain_step(cfg, mesh, opt), args.warmup)
    except Exception as e:  # e.g. out of memory: report seqshard alone
        traceback.print_exc(file=sys.stderr)
        return [seqshard], _first_line(e)
    return [seqshard, plain], None


# ---------------------------------------------------------------------------------------------
# One case: a config and a mask


def load_case(path: str, mask: str, overrides: list[str]) -> Config:
    """The config at ``path`` with ``overrides`` and the mask, its mesh resolved on one device."""
    cfg = load_config(path, [*overrides, f"model.attention_mask={mask}"], from_hf=with_hf_model)
    cfg = resolve_mesh(cfg, 1)
    if cfg.mesh.n_devices != 1:
        raise ValueError(
            f"{path}: mesh {cfg.mesh.describe()} uses {cfg.mesh.n_devices} devices, but "
            f"bench_gpu measures one device. Pass mesh.d=1 mesh.t=1 (or -1) as an override."
        )
    return cfg


def predicted_step_s(cfg: Config, hardware: str) -> tuple[float | None, str]:
    """The planner's step time for ``cfg`` on one ``hardware`` device, or (None, why not)."""
    try:
        from seqshard.plan.planner import plan
    except ImportError as e:
        return None, f"seqshard.plan.planner not importable ({e})"
    try:
        return float(plan(cfg, 1, hardware).step_time_s), ""
    except Exception as e:  # the planner is optional here: report and go on
        return None, f"plan() failed: {type(e).__name__}: {e}"


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return text[:300]


def run_case(
    name: str, cfg: Config, args: argparse.Namespace, peak_matmul: float
) -> dict[str, object]:
    """Build both variants, time them round-robin, return the case's fields."""
    mesh = training_mesh(cfg.mesh.sizes(), devices=jax.devices()[:1])
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
    flops_per_step = flops_per_token(cfg.model, cfg.train.seq_len).total * tokens_per_step
    row: dict[str, object] = {
        "config": name,
        "mask": cfg.model.attention_mask,
        "tokens_per_step": tokens_per_step,
        "params": param_count(cfg.model),
        "attention_impl": resolve_impl(cfg.model.attention_impl, cfg.model.attention_mask),
    }
    batch = jax.device_put(synthetic_batch(cfg, args.mean_doc_len), shardings(TokenBatch, mesh))
    variants, plain_error = build(cfg, mesh, batch, args)
    if plain_error:
        row["plain_error"] = plain_error
    for r in range(args.steps):  # round-robin, the first variant alternating
        for v in variants[r % 2 :] + variants[: r % 2]:
            v.run()

    for v in variants:
        step_s = statistics.median(v.times)
        prefix = "" if v.name == "seqshard" else "plain_"
        row[f"{v.name}_tokens_per_s"] = tokens_per_step / step_s
        row[f"{v.name}_tflops"] = flops_per_step / step_s / 1e12
        row[f"{prefix}mfu_989"] = flops_per_step / step_s / H100_PEAK
        row[f"{prefix}mfu_measured_matmul"] = flops_per_step / step_s / peak_matmul
        row[f"{prefix}temp_gib"] = v.temp_bytes / GIB if v.temp_bytes >= 0 else None
        row["measured_step_s" if v.name == "seqshard" else "plain_step_s"] = step_s
        row[f"{v.name}_min_step_s"] = min(v.times)
        row[f"{v.name}_compile_s"] = v.compile_s
        row[f"{v.name}_loss0"] = v.loss0
    if "plain_tokens_per_s" in row:
        row["ratio_vs_plain"] = row["seqshard_tokens_per_s"] / row["plain_tokens_per_s"]
    predicted, why = predicted_step_s(cfg, args.planner_hardware)
    row["predicted_step_s"] = predicted
    if why:
        row["predicted_note"] = why
    return row


# ---------------------------------------------------------------------------------------------
# Report

LINE_FIELDS = (
    ("tokens_per_step", "{:d}"),
    ("seqshard_tokens_per_s", "{:.0f}"),
    ("seqshard_tflops", "{:.4g}"),
    ("mfu_989", "{:.4g}"),
    ("mfu_measured_matmul", "{:.4g}"),
    ("temp_gib", "{:.3g}"),
    ("plain_tokens_per_s", "{:.0f}"),
    ("plain_tflops", "{:.4g}"),
    ("plain_mfu_989", "{:.4g}"),
    ("plain_temp_gib", "{:.3g}"),
    ("ratio_vs_plain", "{:.3f}"),
    ("predicted_step_s", "{:.4g}"),
    ("measured_step_s", "{:.4g}"),
    ("plain_step_s", "{:.4g}"),
    ("seqshard_loss0", "{:.6g}"),
    ("plain_loss0", "{:.6g}"),
)


def format_row(row: dict[str, object]) -> str:
    """``config=... mask=... key=value ...``; a missing value is ``n/a``."""
    parts = [f"config={row['config']}", f"mask={row['mask']}"]
    if "error" in row:
        return " ".join([*parts, f"error={json.dumps(row['error'])}"])
    parts.append(f"attention_impl={row['attention_impl']}")
    for key, fmt in LINE_FIELDS:
        value = row.get(key)
        parts.append(f"{key}={'n/a' if value is None else fmt.format(value)}")
    if "plain_error" in row:
        parts.append(f"plain_error={json.dumps(row['plain_error'])}")
    return " ".join(parts)


def summarize(rows: list[dict[str, object]]) -> dict[str, object]:
    """The minimum ratio_vs_plain, the largest config's MFU per mask and its document mask's
    speed against its causal one, and the targets."""
    done = [r for r in rows if "error" not in r]
    ratios = [r for r in done if r.get("ratio_vs_plain") is not None]
    out: dict[str, object] = {"min_ratio_vs_plain": None, "min_ratio_at": None}
    if ratios:
        worst = min(ratios, key=lambda r: r["ratio_vs_plain"])
        out["min_ratio_vs_plain"] = worst["ratio_vs_plain"]
        out["min_ratio_at"] = f"{worst['config']}/{worst['mask']}"
    largest = max(done, key=lambda r: r["params"], default=None)
    out["largest_config"] = largest["config"] if largest else None
    tokens_per_s = {}
    for mask in ("causal", "document"):
        got = [
            r for r in done if largest and r["config"] == largest["config"] and r["mask"] == mask
        ]
        out[f"largest_mfu_989_{mask}"] = got[0]["mfu_989"] if got else None
        tokens_per_s[mask] = got[0]["seqshard_tokens_per_s"] if got else None
    both = None not in tokens_per_s.values()
    out["largest_document_vs_causal"] = (
        tokens_per_s["document"] / tokens_per_s["causal"] if both else None
    )
    all_compared = bool(rows) and len(ratios) == len(rows)
    out["ratio_target_met"] = (
        None if not ratios else all_compared and out["min_ratio_vs_plain"] >= 1.0
    )
    mfu = out["largest_mfu_989_causal"]
    out["mfu_target_met"] = None if mfu is None else mfu >= MFU_TARGET
    ratio = out["largest_document_vs_causal"]
    out["document_target_met"] = None if ratio is None else ratio >= DOCUMENT_TARGET
    return out


def format_summary(s: dict[str, object]) -> str:
    def show(value) -> str:
        if value is None:
            return "n/a"
        if isinstance(value, bool):
            return "yes" if value else "no"
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    return "summary " + " ".join(f"{k}={show(v)}" for k, v in s.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("overrides", nargs="*", help="key=value config overrides for every config")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated config files")
    p.add_argument("--masks", default="document,causal", help="model.attention_mask values")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling (>= 1)")
    p.add_argument("--no-plain", action="store_true", help="skip the plain-jit baseline")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    p.add_argument(
        "--mean-doc-len", type=int, default=512, help="packed documents' mean length (tokens)"
    )
    p.add_argument(
        "--peak-n", type=int, default=None, help="matmul size for the peak (8192 GPU, 512 CPU)"
    )
    p.add_argument("--peak-repeats", type=int, default=20, help="best of this many matmuls")
    p.add_argument("--planner-hardware", default="h100", help="plan(cfg, 1, <this>)")
    p.add_argument(
        "--matmul-paths",
        action="store_true",
        help="also time the --peak-n matmul each way seqshard.hardware.MATMUL_PATHS asks for "
        "it (bf16 output, bf16 summed in f32 then cast: the model's, f32)",
    )
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}.")
    masks = [m for m in args.masks.split(",") if m]
    configs = [c for c in args.configs.split(",") if c]

    device = jax.devices()[0]
    peak_n = args.peak_n or (8192 if device.platform == "gpu" else 512)

    def peak() -> float:
        return measure_matmul_flops(peak_n, jnp.bfloat16, repeats=args.peak_repeats, device=device)

    peak_before = peak()
    print(
        f"jax {jax.__version__} on {device.platform} ({device.device_kind}), "
        f"{len(jax.devices())} devices, measuring on 1; bf16 {peak_n}^3 matmul: "
        f"{peak_before / 1e12:.4g} TFLOP/s measured ({peak_before / H100_PEAK:.3f} of 989)",
        flush=True,
    )
    if args.matmul_paths:
        for path, flops in matmul_paths(peak_n, args.peak_repeats, device).items():
            print(f"  {path:<44} {flops / 1e12:8.4g} TFLOP/s", flush=True)

    rows: list[dict[str, object]] = []
    notes: set[str] = set()
    for path in configs:
        name = Path(path).stem
        for mask in masks:
            try:
                cfg = load_case(path, mask, args.overrides)
            except ValueError as e:  # ConfigError too: the message says what to change
                row = {"config": name, "mask": mask, "error": _first_line(e)}
            else:
                try:
                    row = run_case(name, cfg, args, peak_before)
                except Exception as e:  # one case failing (OOM, compile error) skips only it
                    traceback.print_exc(file=sys.stderr)
                    row = {"config": name, "mask": mask, "error": _first_line(e)}
            rows.append(row)
            print(format_row(row), flush=True)
            note = row.get("predicted_note")
            if note and note not in notes:
                notes.add(note)
                print(f"  (predicted n/a: {note})", flush=True)
            # Free the case's arrays and executables before the next one.
            row = None
            gc.collect()
            jax.clear_caches()

    peak_after = peak()
    print(
        f"bf16 {peak_n}^3 matmul after the runs: {peak_after / 1e12:.4g} TFLOP/s "
        f"(before: {peak_before / 1e12:.4g}; the lines use before)",
        flush=True,
    )
    summary = summarize(rows)
    print(format_summary(summary), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "jax": jax.__version__,
            "platform": device.platform,
            "device_kind": device.device_kind,
            "peak_matmul_n": peak_n,
            "peak_matmul_flops_before": peak_before,
            "peak_matmul_flops_after": peak_after,
            "peak_989_flops": H100_PEAK,
            "steps": args.steps,
            "warmup": args.warmup,
            "overrides": args.overrides,
        }
        args.out.write_text(
            json.dumps({"meta": meta, "results": rows, "summary": summary}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
