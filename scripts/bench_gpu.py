#!/usr/bin/env python
"""Time seqshard's train step against a plain ``jax.jit`` Llama on one GPU (H100), per config.

    python scripts/bench_gpu.py                            # h100-125m, -350m, -1b x document, causal
    python scripts/bench_gpu.py --configs configs/h100-1b.yaml --masks causal --steps 20
    python scripts/bench_gpu.py --out runs/bench_gpu.json  # the results as JSON too
    python scripts/bench_gpu.py --configs configs/h100-1b.yaml --fp8 none,current,delayed
                                                           # FP8 beside bf16 (issue 44, below)
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
tokens/s document over causal), and FP8 (``model.fp8`` current and delayed) at >= 1.25x bf16's
seqshard tokens/s on the 1B (``largest_fp8_speedup_{current,delayed} >= 1.25``, causal mask);
neither measured yet.

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

**FP8** (``--fp8 MODES``, a comma list of ``none``, ``current``, ``delayed``; default ``none``,
today's run): seqshard runs once per mode, ``model.fp8=<mode>`` (overriding a positional
``model.fp8=``; :mod:`seqshard.shardlib.fp8`: each projection, q kv o gate up down, multiplies
operands quantize-dequantized through float8_e4m3fn, gradients float8_e5m2, the pattern XLA's
GPU compiler rewrites into cuBLASLt FP8 GEMMs; on CPU nothing is rewritten and FP8 is slower),
all from the same initial weights, in the same round-robin as the baseline; the plain baseline
runs once, in bf16. One line per mode (``fp8=<mode>``; the baseline's fields repeated on each,
``ratio_vs_plain`` against each mode). When any mode other than ``none`` runs, each line gains
the GEMMs of its compiled step (``compiled.as_text()``, :func:`count_gemms`; a loop body
counts once, so the scanned layers' GEMMs count as one layer's)::

    fp8_gemms   custom-calls with an f8 operand (cuBLASLt's __cublas$lt$matmul$f8), and Triton
                GEMM fusions with one: the matmuls that run in FP8
    gemms       cuBLAS custom-calls (and Triton GEMM fusions) without an f8 operand: in bf16/f32
    dots_total  dot instructions left (in fusions too): on CPU every matmul; on GPU few

How to read them: on GPU with the rewrite working, ``fp8_gemms`` > 0 for current and delayed
and ``gemms`` falls by about as many against the ``fp8=none`` line (the projections' GEMMs of
one layer, forward and backward, plus any outside the scan); ``fp8_gemms=0`` there means the
FP8 operands reached the GEMMs dequantized, in bf16 (no speedup to expect; ``XLA_FLAGS=
--xla_dump_to=DIR`` dumps the HLO around each pass, to see which one left them). On CPU:
``fp8_gemms=0 gemms=0``. The lines of modes other than none also gain ``speedup_vs_bf16``
(this mode's seqshard tokens/s over mode none's, where none ran) and ``loss0_rel_diff_vs_bf16``
(|loss0 - none's loss0| / none's: the first step's loss on the same weights and batch, the FP8
rounding's effect; 1.7e-4 on tiny-cpu). MFU and TFLOP/s stay model FLOPs over the bf16 peak
(989; H100's dense FP8 peak is 1979). The summary gains ``largest_fp8_speedup_current``,
``largest_fp8_speedup_delayed`` (the largest config's ``causal`` line) and ``fp8_target_met``
(every mode run there >= 1.25); its other fields are of the ``fp8=none`` lines.

The run for a GPU session (issue 44: the FP8 and the document-mask targets, both on the 1B)::

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python scripts/bench_gpu.py \\
        --configs configs/h100-1b.yaml --fp8 none,current,delayed \\
        --out $OUT/bench_fp8.json | tee $OUT/bench_fp8.log

Memory: every variant's state stays on the GPU for the round-robin, 12.4 GiB each at the 1B
(f32 weights and AdamW's two moments), four with the baseline, plus one step's temporaries
(18.8 GiB for bf16 on the H200): more than the 75% of an 80 GB H100 that JAX preallocates by
default, hence the memory fraction. The baseline's state is made last, so if memory runs out,
the baseline is what is dropped (``plain_error``); ``--no-plain`` leaves it out. Time: not
measured on a GPU yet; it goes mostly to compiling, one step per mode and one for the baseline
per (config, mask): 8 for the command above (the JSON's ``seqshard_compile_s`` and
``plain_compile_s`` say how long each took). If that risks a 10-minute limit, split it in two
commands of 4 compiles each: ``--masks causal --fp8 none,current,delayed`` (the FP8 target)
and ``--masks document,causal`` (the document target, bf16). The 350M
(``--configs configs/h100-350m.yaml``) is best run as a command of its own.

Timing: all variants are compiled (``memory_analysis().temp_size_in_bytes`` read from the
executable) and warmed up (``--warmup`` steps); then the ``--steps`` timed steps run
round-robin, one of each variant per round, the order rotating (round r starts at variant
r), each step timed alone up to ``block_until_ready``; the step time is the median. The batch
is one synthetic batch of the config's ``train.batch_size x train.seq_len`` random tokens,
packed documents (each row starts one; more start at random, ``--mean-doc-len`` tokens apart
on average).

FLOPs are model FLOPs from :func:`seqshard.model.cost.flops_per_token` (matmuls only, attention
counted unmasked, no credit for recomputation), never XLA's ``cost_analysis()``. MFU is given
against 989 TFLOP/s (H100 dense bf16) and against a large bf16 matmul measured in the same run
(:func:`seqshard.hardware.measure_matmul_flops`, ``--peak-n`` = 8192 on GPU, best of
``--peak-repeats``; bf16 summed in f32, the model's way; ``--matmul-paths`` times the other
ways too, bf16 output and f32), measured before the first config and again after the last (both printed;
the lines use the first). The planner's prediction, ``seqshard.plan.planner.plan(cfg, 1,
"h100").step_time_s``, is printed beside the measured step time (``n/a`` if the planner cannot
be imported or fails).

Output: one line per (config, mask, FP8 mode)::

    config=h100-1b mask=causal fp8=none attention_impl=cudnn tokens_per_step=16384
    seqshard_tokens_per_s=... seqshard_tflops=... mfu_989=... mfu_measured_matmul=...
    temp_gib=... plain_tokens_per_s=... plain_tflops=... plain_mfu_989=... plain_temp_gib=...
    ratio_vs_plain=... predicted_step_s=... measured_step_s=... plain_step_s=...
    seqshard_loss0=... plain_loss0=...
    [speedup_vs_bf16=... loss0_rel_diff_vs_bf16=...] [fp8_gemms=... gemms=... dots_total=...]

(one line each; ``ratio_vs_plain`` is seqshard tokens/s over plain tokens/s; the bracketed FP8
fields as above). A case that fails (an OOM, a compile error) prints ``config=... mask=...
fp8=... error="..."`` for each mode (a mode that fails alone: its line only; a failing plain
variant only blanks the plain fields and adds ``plain_error``) and the run goes on; arrays are
dropped and ``jax.clear_caches()`` runs between cases. The last line is ``summary
min_ratio_vs_plain=... largest_config=... largest_mfu_989_causal=...
largest_mfu_989_document=... largest_document_vs_causal=...`` (the largest config by
parameters: the 1B by default), whether the targets are met, and with FP8 modes
``largest_fp8_speedup_current=... largest_fp8_speedup_delayed=... fp8_target_met=...``.
``--out FILE`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import re
import statistics
import sys
import time
import traceback
import typing
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
from seqshard.shardlib.fp8 import Fp8Mode
from seqshard.shardlib.shardtypes import shardings
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import init_train_state
from seqshard.train.step import grads_and_loss, make_train_step

DEFAULT_CONFIGS = "configs/h100-125m.yaml,configs/h100-350m.yaml,configs/h100-1b.yaml"
H100_PEAK = KNOWN_PEAKS["h100"]  # 989e12 dense bf16 FLOP/s
MFU_TARGET = 0.55
DOCUMENT_TARGET = 0.9  # issue 44: the document mask's tokens/s at least 0.9x causal's
FP8_TARGET = 1.25  # issue 44: FP8 current and delayed at least 1.25x bf16's tokens/s (the 1B)
FP8_MODES = typing.get_args(Fp8Mode)  # none, current, delayed
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
# GEMMs in the compiled step: did XLA turn the FP8 projections into FP8 GEMMs?

# One instruction: `[ROOT] %name = <type> <opcode>(<operands>), <attributes>`; the type is an
# array type (`bf16[8,64]{1,0}`) or a tuple of them (`(f32[128,64]{1,0}, s8[1024]{0})`).
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"\s*(?P<op>[\w\-]+)\(")
# FP8 element types: f8e4m3fn, f8e5m2 (and the fnuz / other f8 variants XLA prints).
_F8 = re.compile(r"\bf8e\d+m\d+\w*\[")
_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]*)"')
_GEMM_TARGET = re.compile(r"cublas|gemm|matmul", re.IGNORECASE)  # __cublas$lt$matmul$f8, ...
_GEMM_FUSION = re.compile(r'"kind":"__triton_gemm"')  # a dot XLA gave to Triton instead


def _closing(text: str, start: int) -> int:
    """The index of the bracket closing the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return len(text)


def _operands(args: str) -> list[tuple[str, str]]:
    """``(inline type or '', name)`` of each operand in an operand list, either printed way:
    ``%a, %b`` (``compiled.as_text()``) or ``f8e4m3fn[128,256]{1,0} %a, ...``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(args):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(args[start:i])
            start = i + 1
    parts.append(args[start:])
    out = []
    for part in (p.strip() for p in parts):
        if part:
            inline, _, name = part.rpartition(" ")
            out.append((inline, name.lstrip("%")))
    return out


def count_gemms(hlo: str) -> dict[str, int]:
    """The matmuls of an HLO module's text (``compiled.as_text()``) by how they run::

        fp8_gemms   custom-calls (cuBLASLt's ``__cublas$lt$matmul$f8``) and Triton GEMM fusions
                    with at least one f8 operand (f8e4m3fn, f8e5m2): FP8 GEMMs
        gemms       cuBLAS custom-calls (a target naming cublas, gemm or matmul) and Triton GEMM
                    fusions with no f8 operand: GEMMs in bf16 / f32
        dots_total  ``dot`` instructions anywhere, inside fusions too (a Triton GEMM fusion
                    holds one; on CPU every matmul stays a dot)

    An operand's type is read where it is printed inline, else from the instruction that made
    it (names are unique in a module). A loop body counts once, however many times it runs
    (the layers' scan: one layer's GEMMs), as :func:`seqshard.testing.count_dots` counts."""
    types: dict[str, str] = {}  # instruction name -> its result type as printed
    calls: list[tuple[str, list[tuple[str, str]], str]] = []  # (opcode, operands, attributes)
    for line in hlo.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        rest = m["rest"]
        end = _closing(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
        if end <= 0:
            continue
        types[m["name"]] = rest[:end]
        op = _OPCODE.match(rest, end)
        if not op:
            continue
        close = _closing(rest, op.end() - 1)
        calls.append((op["op"], _operands(rest[op.end() : close]), rest[close + 1 :]))
    counts = {"fp8_gemms": 0, "gemms": 0, "dots_total": 0}
    for op, operands, attrs in calls:
        if op == "dot":
            counts["dots_total"] += 1
            continue
        target = _TARGET.search(attrs)
        if op == "custom-call" and target:
            gemm = bool(_GEMM_TARGET.search(target["target"]))
        elif op == "fusion":
            gemm = bool(_GEMM_FUSION.search(attrs))
        else:
            continue
        f8 = any(_F8.search(inline or types.get(name, "")) for inline, name in operands)
        if f8 and (gemm or op == "custom-call"):
            counts["fp8_gemms"] += 1
        elif gemm:
            counts["gemms"] += 1
    return counts


# ---------------------------------------------------------------------------------------------
# Variants


@dataclasses.dataclass
class Variant:
    name: str  # 'seqshard' or 'plain'
    fp8: str = "none"  # seqshard's model.fp8 (the plain baseline: always none, bf16)
    step: object = None  # the compiled executable: (state, batch) -> (state, loss or metrics)
    state: object = None
    batch: TokenBatch | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    temp_bytes: int = -1
    compile_s: float = math.nan
    loss0: float = math.nan
    gemms: dict[str, int] | None = None  # count_gemms of the compiled step, when asked for

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


def compile_and_warm(v: Variant, jitted, warmup: int, count: bool = False) -> None:
    """Compile, read the temp memory (and with ``count`` the GEMMs of the compiled HLO), run
    ``warmup`` (>= 1) steps; the first step's loss is kept."""
    start = time.perf_counter()
    compiled = jitted.lower(v.state, v.batch).compile()
    v.compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    v.temp_bytes = int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1
    if count:
        v.gemms = count_gemms(compiled.as_text())
    v.step = compiled
    for i in range(max(warmup, 1)):
        loss = v.run()
        if i == 0:
            v.loss0 = loss
    v.times.clear()


@dataclasses.dataclass
class Built:
    """A case's variants, compiled and warmed up: seqshard's per FP8 mode (``errors``: the
    modes that failed, and why) and the plain baseline (None, and why in ``plain_error`` if
    it failed)."""

    seqshard: dict[str, Variant]
    errors: dict[str, str]
    plain: Variant | None
    plain_error: str | None


def _plain_variant(state, batch: TokenBatch, device) -> tuple[Variant | None, str | None]:
    """The plain variant on a copy of ``state``'s weights and optimizer state moved off the mesh
    onto ``device`` (``may_alias=False``: seqshard donates the original)."""
    try:
        plain_state = jax.device_put((state.weights, state.opt_state), device, may_alias=False)
        return Variant("plain", state=plain_state, batch=jax.device_put(batch, device)), None
    except Exception as e:  # e.g. out of memory: report seqshard alone
        traceback.print_exc(file=sys.stderr)
        return None, _first_line(e)


def build(
    cfgs: dict[str, Config], bf16: Config, mesh, batch: TokenBatch, args: argparse.Namespace
) -> Built:
    """Every variant of a case, compiled and warmed up, each from the same initial weights
    (``train.seed``'s; the FP8 amax history draws no key): seqshard once per FP8 mode of
    ``cfgs`` (mode -> the config with that ``model.fp8``), in order, then the plain baseline
    (unless ``--no-plain``) in bf16 (``bf16``: the config with ``model.fp8=none``) on a copy of
    mode none's initial state (a fresh one from the same seed when mode none is not asked for).
    Its state is the last made, so an out-of-memory drops the baseline first.

    A mode that fails (out of memory, a compile error) is dropped and its error kept; so is a
    failing plain variant. When ``--fp8`` names a mode other than none, the GEMMs of each
    seqshard step's compiled HLO are counted (:func:`count_gemms`)."""
    count = any(m not in ("", "none") for m in args.fp8.split(","))
    device = mesh.devices.flat[0]
    built = Built({}, {}, None, None)
    for mode, cfg in cfgs.items():
        try:
            opt = make_optimizer(cfg.train, cfg.model, mesh)
            state = init_train_state(cfg.model, mesh, opt, jax.random.key(cfg.train.seed))
            if mode == "none" and not args.no_plain:
                built.plain, built.plain_error = _plain_variant(state, batch, device)
            v = Variant("seqshard", fp8=mode, state=state, batch=batch)
            compile_and_warm(v, make_train_step(cfg, mesh, opt), args.warmup, count)
            built.seqshard[mode] = v
        except Exception as e:  # e.g. out of memory: this mode's line is an error line
            traceback.print_exc(file=sys.stderr)
            built.errors[mode] = _first_line(e)
    if not built.seqshard or args.no_plain:
        built.plain = None
        return built
    opt = make_optimizer(bf16.train, bf16.model, mesh)
    if built.plain is None and built.plain_error is None:  # no mode none: the same weights
        try:
            state = init_train_state(bf16.model, mesh, opt, jax.random.key(bf16.train.seed))
        except Exception as e:  # e.g. out of memory: report seqshard alone
            traceback.print_exc(file=sys.stderr)
            built.plain_error = _first_line(e)
        else:
            built.plain, built.plain_error = _plain_variant(state, batch, device)
            del state
    if built.plain is not None:
        try:
            compile_and_warm(built.plain, make_plain_step(bf16, mesh, opt), args.warmup)
        except Exception as e:  # e.g. out of memory: report seqshard alone
            traceback.print_exc(file=sys.stderr)
            built.plain, built.plain_error = None, _first_line(e)
    return built


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


def load_modes(
    path: str, mask: str, overrides: list[str], modes: list[str]
) -> tuple[dict[str, Config], Config, dict[str, str]] | str:
    """``(configs, bf16, errors)``: :func:`load_case` with ``model.fp8=<mode>`` for each mode
    that loads (``errors``: why the others do not, e.g. model.attention=mla), and with
    ``model.fp8=none`` for the plain baseline; or the error (a str) if that one fails."""
    try:
        bf16 = load_case(path, mask, [*overrides, "model.fp8=none"])
    except ValueError as e:
        return _first_line(e)
    cfgs, errors = {}, {}
    for mode in modes:
        try:
            cfgs[mode] = load_case(path, mask, [*overrides, f"model.fp8={mode}"])
        except ValueError as e:
            errors[mode] = _first_line(e)
    return cfgs, bf16, errors


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
    name: str, cfgs: dict[str, Config], bf16: Config, args: argparse.Namespace, peak_matmul: float
) -> list[dict[str, object]]:
    """Build every variant (seqshard per FP8 mode of ``cfgs``, the plain baseline from
    ``bf16``), time them round-robin, return one row per mode, in ``cfgs``' order."""
    mesh = training_mesh(bf16.mesh.sizes(), devices=jax.devices()[:1])
    tokens_per_step = bf16.train.batch_size * bf16.train.seq_len
    # Model FLOPs: the same matmuls in every mode (FP8 changes their operands' format only).
    flops_per_step = flops_per_token(bf16.model, bf16.train.seq_len).total * tokens_per_step
    common: dict[str, object] = {
        "config": name,
        "mask": bf16.model.attention_mask,
        "tokens_per_step": tokens_per_step,
        "params": param_count(bf16.model),
        "attention_impl": resolve_impl(bf16.model.attention_impl, bf16.model.attention_mask),
    }
    batch = jax.device_put(synthetic_batch(bf16, args.mean_doc_len), shardings(TokenBatch, mesh))
    built = build(cfgs, bf16, mesh, batch, args)
    variants = [*built.seqshard.values(), *([built.plain] if built.plain else [])]
    for r in range(args.steps if variants else 0):  # round-robin, the first variant rotating
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            v.run()

    def timed(v: Variant, prefix: str) -> dict[str, object]:
        step_s = statistics.median(v.times)
        return {
            f"{v.name}_tokens_per_s": tokens_per_step / step_s,
            f"{v.name}_tflops": flops_per_step / step_s / 1e12,
            f"{prefix}mfu_989": flops_per_step / step_s / H100_PEAK,
            f"{prefix}mfu_measured_matmul": flops_per_step / step_s / peak_matmul,
            f"{prefix}temp_gib": v.temp_bytes / GIB if v.temp_bytes >= 0 else None,
            "measured_step_s" if v.name == "seqshard" else "plain_step_s": step_s,
            f"{v.name}_min_step_s": min(v.times),
            f"{v.name}_compile_s": v.compile_s,
            f"{v.name}_loss0": v.loss0,
        }

    plain = timed(built.plain, "plain_") if built.plain else {}
    if built.plain_error:
        plain["plain_error"] = built.plain_error
    rows = []
    for mode, cfg in cfgs.items():
        row: dict[str, object] = {**common, "fp8": mode}
        v = built.seqshard.get(mode)
        if v is None:
            rows.append({"config": name, "mask": common["mask"], "fp8": mode})
            rows[-1]["error"] = built.errors[mode]  # this mode failed to build; the rest ran
            continue
        row.update(timed(v, ""))
        row.update(plain)
        if "plain_tokens_per_s" in row:
            row["ratio_vs_plain"] = row["seqshard_tokens_per_s"] / row["plain_tokens_per_s"]
        bf16_run = built.seqshard.get("none")
        if mode != "none" and bf16_run is not None:
            row["speedup_vs_bf16"] = statistics.median(bf16_run.times) / row["measured_step_s"]
            row["loss0_rel_diff_vs_bf16"] = abs(v.loss0 - bf16_run.loss0) / abs(bf16_run.loss0)
        if v.gemms is not None:
            row.update(v.gemms)
        predicted, why = predicted_step_s(cfg, args.planner_hardware)
        row["predicted_step_s"] = predicted
        if why:
            row["predicted_note"] = why
        rows.append(row)
    return rows


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
FP8_FIELDS = (  # on the lines of a run with --fp8 other than none; each where it is known
    ("speedup_vs_bf16", "{:.3f}"),
    ("loss0_rel_diff_vs_bf16", "{:.3g}"),
    ("fp8_gemms", "{:d}"),
    ("gemms", "{:d}"),
    ("dots_total", "{:d}"),
)


def format_row(row: dict[str, object]) -> str:
    """``config=... mask=... fp8=... key=value ...``; a missing value is ``n/a``; the FP8
    fields only where the row has them."""
    parts = [f"config={row['config']}", f"mask={row['mask']}", f"fp8={row.get('fp8', 'none')}"]
    if "error" in row:
        return " ".join([*parts, f"error={json.dumps(row['error'])}"])
    parts.append(f"attention_impl={row['attention_impl']}")
    for key, fmt in LINE_FIELDS:
        value = row.get(key)
        parts.append(f"{key}={'n/a' if value is None else fmt.format(value)}")
    parts += [f"{key}={fmt.format(row[key])}" for key, fmt in FP8_FIELDS if key in row]
    if "plain_error" in row:
        parts.append(f"plain_error={json.dumps(row['plain_error'])}")
    return " ".join(parts)


def summarize(rows: list[dict[str, object]]) -> dict[str, object]:
    """The minimum ratio_vs_plain, the largest config's MFU per mask and its document mask's
    speed against its causal one, and the targets: of the bf16 rows (``fp8=none``). Where other
    FP8 modes ran, also the largest config's FP8 speedups (causal mask) and their target."""
    fp8_rows = [r for r in rows if r.get("fp8", "none") != "none"]
    fp8_ran = bool(fp8_rows)
    rows = [r for r in rows if r.get("fp8", "none") == "none"]
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
    if fp8_ran:
        out.update(fp8_summary(fp8_rows, out["largest_config"]))
    return out


def fp8_summary(rows: list[dict[str, object]], largest: str | None) -> dict[str, object]:
    """``largest_fp8_speedup_<mode>``: the ``largest`` config's causal-mask speedup_vs_bf16 for
    current and delayed (None where not run or not measured); ``fp8_target_met``: yes when
    every mode run there is at or above FP8_TARGET, no when one is below, None otherwise."""
    out: dict[str, object] = {}
    ran = []
    for mode in [m for m in FP8_MODES if m != "none"]:
        got = [
            r.get("speedup_vs_bf16")
            for r in rows
            if r["config"] == largest and r["mask"] == "causal" and r["fp8"] == mode
        ]
        out[f"largest_fp8_speedup_{mode}"] = got[0] if got else None
        ran += got
    if any(v is not None and v < FP8_TARGET for v in ran):
        out["fp8_target_met"] = False
    else:
        out["fp8_target_met"] = True if ran and None not in ran else None
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
    p.add_argument(
        "--fp8",
        default="none",
        help="comma-separated model.fp8 modes to time seqshard in, side by side (none, current, "
        "delayed; default none); the plain baseline runs once, in bf16",
    )
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}.")
    fp8_modes = list(dict.fromkeys(m for m in args.fp8.split(",") if m))
    unknown = [m for m in fp8_modes if m not in FP8_MODES]
    if unknown or not fp8_modes:
        p.error(
            f"--fp8 takes a comma-separated list of {', '.join(FP8_MODES)}; got {args.fp8!r}. "
            f"E.g. --fp8 none,current,delayed."
        )
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
            case = load_modes(path, mask, args.overrides, fp8_modes)
            if isinstance(case, str):  # ConfigError too: the message says what to change
                got = [{"config": name, "mask": mask, "fp8": m, "error": case} for m in fp8_modes]
            else:
                cfgs, bf16, errors = case
                try:
                    got = run_case(name, cfgs, bf16, args, peak_before) if cfgs else []
                except Exception as e:  # one case failing (OOM, compile error) skips only it
                    traceback.print_exc(file=sys.stderr)
                    errors.update({m: _first_line(e) for m in cfgs})
                    got = []
                got += [
                    {"config": name, "mask": mask, "fp8": m, "error": errors[m]} for m in errors
                ]
                got.sort(key=lambda r: fp8_modes.index(r["fp8"]))
            for row in got:
                rows.append(row)
                print(format_row(row), flush=True)
                note = row.get("predicted_note")
                if note and note not in notes:
                    notes.add(note)
                    print(f"  (predicted n/a: {note})", flush=True)
            # Free the case's arrays and executables before the next one.
            row = got = case = None
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
            "fp8": fp8_modes,
        }
        args.out.write_text(
            json.dumps({"meta": meta, "results": rows, "summary": summary}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
