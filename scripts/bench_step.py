#!/usr/bin/env python
"""Time seqshard's train step against a plain-``jax.jit`` GSPMD baseline, and its hand-written
backward against autodiff, on 8 fake CPU devices.

    python scripts/bench_step.py                       # f32, meshes 8x1 4x2 2x4: ~7 min on 2 cores
    python scripts/bench_step.py --dtype bfloat16 --meshes 4x2 --steps 5
    python scripts/bench_step.py --dtype float32,bfloat16 --meshes 8x1,4x2   # bf16 vs f32
    python scripts/bench_step.py --remat full --hlo-dir /tmp/hlo   # also writes each variant's HLO
    python scripts/bench_step.py --impls seqshard,gspmd,gspmd-act --meshes 8x1,4x2
    python scripts/bench_step.py --impls seqshard,seqshard-M/t,gspmd-act   # the residual's layouts
    python scripts/bench_step.py --attention mla --meshes 8x1,4x2 --impls seqshard,gspmd,gspmd-act

The model (both variants): 2 layers, d_model 256, 2 kv heads x 2 query heads each, d_head 32,
d_ff 1024, vocab 1280, packed documents (``attention_mask='document'``), einsum attention;
batch 32 x 128 tokens; AdamW + clipping from :func:`seqshard.train.optimizer.make_optimizer`.

**MLA** (``--attention mla``; default ``gqa``, the model above): the same model with
multi-head latent attention (``model.attention=mla``, :mod:`seqshard.model.mla`) in place of
GQA, at about the same active size: 4 heads (``n_kv=4, n_q_per_kv=1``: MLA gives every head
its own keys and values), ``kv_lora_rank`` 64, ``qk_nope_head_dim`` 32 + ``qk_rope_head_dim``
16 = ``d_head`` 48, ``v_head_dim`` 32, ``q_lora_rank`` 128 (``--q-lora-rank``; 0 projects the
queries from the residual directly): 2.48 M weights and 13.4 MFLOP/token (q_lora_rank 0:
2.47 M, 13.3 M) against GQA's 2.43 M and 13.0 M. The default meshes (8x1, 4x2, 2x4) split
it as specified (the latents' rows rest split over t and d: kv_lora_rank and q_lora_rank
divide by t x d = 8; the 4 heads over t <= 4), so none changes the model and 2x4 is no '*'
mesh; t = 8 cannot split 4 heads, and MLA cannot regroup them (n_q_per_kv stays 1): the
script stops there with the reason. The baseline scans the same
reference layer, which computes MLA for this config. seqshard's explicit backward
differentiates the MLA block by ``jax.vjp`` of its forward (no hand-written MLA backward;
``seqshard/model/mla.py`` says why).

* **seqshard**: :func:`seqshard.train.step.make_train_step` (one ``shard_map``, every
  collective written) as configured by default, state from
  :func:`seqshard.train.state.init_train_state`; its gradient is
  ``seqshard/model/backward.py``'s hand-written backward pass (``model.backward=explicit``,
  the default).
* **seqshard-autodiff**: the same step with ``model.backward=autodiff``: JAX differentiates
  the forward pass. Same forward, same state, same first-step loss. (**seqshard-explicit**,
  only with ``--impls``, pins ``model.backward=explicit``.)
* **gspmd** (the baseline): the single-device oracle's math, ``seqshard/model/reference.py``
  (:func:`~seqshard.model.reference.reference_layer` and its loss terms; no copy of the model
  here), as one plain single-program forward: ``lax.scan`` over layers under seqshard's own
  remat (``explicit_activation_checkpointing(layer, cfg.remat)``, the layer marking the same
  values as seqshard's with ``save_for_backward``), jitted with in/out shardings only: weights
  and optimizer state in the shardings of their types (``seqshard.shardlib.shardtypes.shardings``), the
  batch ``TokenBatch``'s ``'B/d L'``; XLA's SPMD partitioner chooses every collective. It
  starts from the very same initial state, so the two first-step losses printed must agree.
* **seqshard-M/t**, **seqshard-L/t** (only with ``--impls``): seqshard's step with
  ``model.residual`` pinned: the residual between blocks ``'B/d L M/t'`` or ``'B/d L/t M'``
  (sequence parallelism, the default).
* **gspmd-act** (only with ``--impls``, not in the default run): the baseline plus one
  ``with_sharding_constraint`` of the residual stream to ``shardings(f32[b'B/d L M'], mesh)``
  (batch over d, replicated over t) after each residual add. Weights-only annotations leave
  XLA free to keep the FSDP-sharded weights in place and move full-batch activations
  instead; this variant shows what GSPMD does when steered.

**The 2x4 mesh.** The kv heads are split over t, so t=4 needs ``n_kv % 4 == 0``, and the
specified ``n_kv=2`` cannot split. The script does not skip it: it runs 2x4 (both variants)
with the smallest change that keeps the query-head count and sizes, ``n_kv=4, n_q_per_kv=1``
(4 query heads of 32, but 4 kv heads instead of 2: +8% model FLOPs, counted with that config's
own ``flops_per_token``), labelled ``2x4*`` in the table. Because it is another model, the
ratio on the last line is taken over the meshes that run the specified config only; an
earlier line gives the ratio with ``2x4*`` included.

Timing: every variant is compiled and warmed up first; then the timed steps run round-robin
(one step of each variant per round, the order rotated each round), each step timed alone
with ``block_until_ready``; the table shows medians. Peak FLOP/s (for MFU) is measured in the
same run by :func:`seqshard.hardware.measure_matmul_flops` (2048^3 f32 and bf16 matmuls on
one fake device, i.e. the host's cores, asked for as the model asks; best of 8), once before
and once after the timed rounds, best kept; each variant's MFU uses the peak of its compute
dtype. The table of :data:`seqshard.hardware.MATMUL_PATHS` beside it shows what the other ways
of asking would run at (a bare bf16 ``a @ b``, ...), and the line under it which the model's
bf16 matmuls take on this CPU (its class, :func:`seqshard.shardlib.matmul.cpu_matmul`;
``SEQSHARD_CPU_MATMUL=f32`` or ``bf16`` forces one). ``--dtype float32,bfloat16`` times both
compute dtypes interleaved in one run and adds a block comparing them, mesh by mesh, ending with
``ratio_bf16_vs_f32=X`` (seqshard's, the minimum over the meshes); the baseline ratios below
are then printed per dtype, each against the baseline of the same dtype (the reference's
matmuls go through the same :mod:`seqshard.shardlib.matmul`). After the table, a block
compares the two backward passes mesh by mesh (tokens/s, temp memory, compiled collectives)
and ends with the line ``ratio_explicit_vs_autodiff=X``: explicit over autodiff tokens/s, the
minimum over the meshes (each mesh compares the same model, ``2x4*`` included). The last line
is ``ratio_vs_gspmd=X``: seqshard (as configured by default) tokens/s at its best mesh over
the baseline's at its best mesh. With ``gspmd-act`` in ``--impls``, the line
``ratio_vs_gspmd_act=X`` gives the smallest, over the meshes run, of seqshard's tokens/s over
gspmd-act's on the same mesh.

Columns: step time (median and min over the timed steps), tokens/s (all B x L tokens),
GFLOP/s of model FLOPs (``seqshard.model.cost.flops_per_token``: no credit for recomputation), MFU,
the compiled collectives (``seqshard.testing.count_collectives``: a scan body counts once),
collective calls and ring-model bytes sent per device per step (``seqshard.shardlib.comms``: scan bodies
times their trip count), XLA's ``temp_size_in_bytes``, and the first step's loss.
"""

# ruff: noqa: E402  (XLA_FLAGS must be set before JAX is imported)
from __future__ import annotations

import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import collections
import dataclasses
import functools
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, Sharding

from seqshard.batch import TokenBatch
from seqshard.config import Config, MeshConfig, TrainConfig
from seqshard.hardware import MATMUL_PATHS, matmul_paths, measure_matmul_flops
from seqshard.mesh import mesh_of_sizes
from seqshard.model.config import MLAConfig, ModelConfig
from seqshard.model.cost import flops_per_token
from seqshard.model.reference import (
    reference_embed,
    reference_layer,
    reference_loss_terms,
    reference_mask,
    reference_positions,
    reference_unembed,
)
from seqshard.model.weights import Layer, Weights, check_mesh
from seqshard.shardlib.comms import collectives
from seqshard.shardlib.matmul import matmul_path, matmul_target
from seqshard.shardlib.remat import explicit_activation_checkpointing, save_for_backward
from seqshard.shardlib.shardtypes import f32, shardings
from seqshard.shardlib.tables import format_bytes, format_table
from seqshard.testing import COLLECTIVE_KINDS, count_collectives
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import TrainState, init_train_state
from seqshard.train.step import make_train_step

MODEL = dict(
    vocab=1280,
    d_model=256,
    n_layers=2,
    n_q_per_kv=2,
    n_kv=2,
    d_head=32,
    d_ff=1024,
    attention_impl="einsum",
    attention_mask="document",
)
BATCH, SEQ_LEN = 32, 128
MLA_MODEL = dict(n_q_per_kv=1, n_kv=4, d_head=48, attention="mla")
"""``--attention mla``: what changes in MODEL (4 heads of 32 + 16, each its own kv head)."""
MLA_SIZES = dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
"""``--attention mla``: ``model.mla`` but ``q_lora_rank`` (``--q-lora-rank``)."""


def model_fields(attention: str, q_lora_rank: int) -> dict:
    """ModelConfig's fields for ``--attention``: MODEL (gqa), or MODEL with MLA of about the
    same size in place of its GQA."""
    if attention == "gqa":
        return MODEL
    return {**MODEL, **MLA_MODEL, "mla": MLAConfig(q_lora_rank=q_lora_rank, **MLA_SIZES)}


# ---------------------------------------------------------------------------------------------
# The baseline: one plain jitted program, sharding annotations on its inputs and outputs only


def gspmd_loss_sum_and_count(
    w: Weights, batch: TokenBatch, cfg: ModelConfig, act: Sharding | None = None
) -> jax.Array:
    """f32[2] (summed next-token loss, positions counted): the reference model, single-program.

    The math is ``seqshard/model/reference.py``'s, its layers scanned under seqshard's own
    remat (the same values marked with ``save_for_backward``). ``act`` (the ``gspmd-act``
    variant only): a sharding constraint on the residual stream at every residual add; the
    plain baseline has none.
    """
    tokens, is_seq_start = batch.tokens, batch.is_seq_start
    constrain = (lambda x: x) if act is None else (lambda x: lax.with_sharding_constraint(x, act))
    positions = reference_positions(is_seq_start)
    mask = reference_mask(is_seq_start, cfg.attention_mask)

    def layer(x: jax.Array, lw: Layer) -> tuple[jax.Array, None]:
        out = reference_layer(
            cfg, lw, x, positions, mask, mark=save_for_backward, constrain=constrain
        )
        return out, None

    x = constrain(reference_embed(cfg, w, tokens))
    x, _ = lax.scan(explicit_activation_checkpointing(layer, cfg.remat), x, w.layers)
    return reference_loss_terms(reference_unembed(cfg, w, x), tokens, is_seq_start)


def make_gspmd_step(
    cfg: Config, mesh: Mesh, opt: optax.GradientTransformation, constrain_acts: bool = False
):
    """The baseline's jitted step: seqshard's own ``make_train_step`` (same update, same state
    shardings from the types, same donation) with the plain-jit loss in place of the model's.

    ``constrain_acts``: also pin the residual stream to ``'B/d L M'`` (batch over d,
    replicated over t), which steers XLA to FSDP + Megatron; the plain baseline does not.
    """
    act = shardings(f32[b"B/d L M"], mesh) if constrain_acts else None

    def loss_terms(w: Weights, batch: TokenBatch) -> jax.Array:
        return gspmd_loss_sum_and_count(w, batch, cfg.model, act)

    return make_train_step(cfg, mesh, opt, loss_terms=loss_terms)


# ---------------------------------------------------------------------------------------------
# Variants


def make_step_with_backward(
    backward: str, cfg: Config, mesh: Mesh, opt: optax.GradientTransformation
):
    """seqshard's step with ``model.backward`` set to ``backward``."""
    model = dataclasses.replace(cfg.model, backward=backward)
    return make_train_step(dataclasses.replace(cfg, model=model), mesh, opt)


def make_step_with_residual(
    residual: str, cfg: Config, mesh: Mesh, opt: optax.GradientTransformation
):
    """seqshard's step with ``model.residual`` set to ``residual``."""
    model = dataclasses.replace(cfg.model, residual=residual)
    return make_train_step(dataclasses.replace(cfg, model=model), mesh, opt)


IMPLS = {
    "seqshard": make_train_step,
    "seqshard-autodiff": functools.partial(make_step_with_backward, "autodiff"),
    "seqshard-explicit": functools.partial(make_step_with_backward, "explicit"),
    "seqshard-M/t": functools.partial(make_step_with_residual, "M/t"),
    "seqshard-L/t": functools.partial(make_step_with_residual, "L/t"),
    "gspmd": make_gspmd_step,
    "gspmd-act": functools.partial(make_gspmd_step, constrain_acts=True),
}


SHORT = {"float32": "f32", "bfloat16": "bf16"}

BACKWARD_OF = {
    "seqshard": ModelConfig.backward,  # the default
    "seqshard-autodiff": "autodiff",
    "seqshard-explicit": "explicit",
}
"""The ``model.backward`` each seqshard variant runs."""


@dataclasses.dataclass
class Variant:
    impl: str  # a key of IMPLS
    mesh_name: str  # '4x2', or '2x4*' when the model had to change to split
    dtype: str  # model.compute_dtype
    cfg: Config
    mesh: Mesh
    make: object = None  # (cfg, mesh, opt) -> jitted step; None: by impl
    step: object = None  # the compiled executable
    state: TrainState | None = None
    times: list = dataclasses.field(default_factory=list)
    loss0: float = float("nan")
    compile_s: float = 0.0
    counts: dict = dataclasses.field(default_factory=dict)
    per_step: dict = dataclasses.field(default_factory=dict)  # kind -> (calls, bytes sent)
    temp_bytes: int = 0
    hlo: str = ""
    batch: TokenBatch | None = None  # on the mesh, sharded as TokenBatch's types say

    @property
    def name(self) -> str:
        return f"{self.impl}@{self.mesh_name}/{SHORT[self.dtype]}"

    @property
    def spec_config(self) -> bool:
        return not self.mesh_name.endswith("*")


def make_batch(vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random tokens, packed documents: every row starts one, more start at random (p=1/48)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(BATCH, SEQ_LEN), dtype=np.int32)
    starts = rng.random((BATCH, SEQ_LEN)) < 1 / 48
    starts[:, 0] = True
    return tokens, starts


def model_for_mesh(base: ModelConfig, d: int, t: int) -> tuple[ModelConfig, str]:
    """The specified model, or (t does not divide n_kv) the smallest change that splits."""
    try:
        check_mesh(base, {"d": d, "t": t})
        return base, ""
    except ValueError as e:
        why = str(e).split(". Choose")[0]
    n_heads = base.n_heads
    if base.attention == "mla":  # one kv head per query head: no regrouping can help
        raise SystemExit(
            f"mesh t={t}: {why}; MLA keeps n_q_per_kv=1 (n_kv = the {n_heads} heads), so no "
            f"regrouping of its heads helps; drop the mesh."
        )
    for n_kv in range(t, n_heads + 1, t):
        if n_heads % n_kv == 0:
            changed = dataclasses.replace(base, n_kv=n_kv, n_q_per_kv=n_heads // n_kv)
            try:
                check_mesh(changed, {"d": d, "t": t})
            except ValueError:
                continue
            return changed, (
                f"{why}; running it with n_kv={n_kv}, n_q_per_kv={n_heads // n_kv} (same "
                f"{n_heads} query heads, {n_kv} kv heads): a different model, labelled '*'"
            )
    raise SystemExit(f"mesh t={t}: {why}, and no kv-head split of {n_heads} heads fits; drop it.")


def build(v: Variant, tokens: np.ndarray, starts: np.ndarray, warmup: int, hlo_dir: Path | None):
    """Compile, count collectives, read memory, warm up; the first step's loss is kept."""
    opt = make_optimizer(v.cfg.train, v.cfg.model, v.mesh)
    make = v.make or IMPLS[v.impl]
    jitted = make(v.cfg, v.mesh, opt)
    state = init_train_state(v.cfg.model, v.mesh, opt, jax.random.key(v.cfg.train.seed))
    batch = jax.device_put(
        TokenBatch(tokens, starts, np.ones_like(starts)), shardings(TokenBatch, v.mesh)
    )
    start = time.perf_counter()
    compiled = jitted.lower(state, batch).compile()
    v.compile_s = time.perf_counter() - start
    v.counts = count_collectives(jitted, state, batch)  # the compiled HLO, scan body once
    v.hlo = compiled.as_text()
    per_step = collections.defaultdict(lambda: [0, 0.0])
    for c in collectives(v.hlo, v.mesh):  # calls per step: scan bodies x trip count
        per_step[c.kind][0] += c.calls_per_step
        per_step[c.kind][1] += c.calls_per_step * c.bytes_sent
    v.per_step = dict(per_step)
    mem = compiled.memory_analysis()
    v.temp_bytes = int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1
    if hlo_dir is not None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        name = f"{v.impl}_{v.mesh_name.rstrip('*')}_{SHORT[v.dtype]}"
        (hlo_dir / f"{name}.hlo.txt").write_text(v.hlo)
    v.step, v.batch = compiled, batch
    for i in range(max(warmup, 1)):
        state, metrics = compiled(state, batch)
        if i == 0:
            v.loss0 = float(metrics["loss"])
    jax.block_until_ready(state)
    v.state = state


def run_round(variants: list[Variant], order: list[int]) -> None:
    for i in order:
        v = variants[i]
        start = time.perf_counter()
        state, metrics = v.step(v.state, v.batch)
        jax.block_until_ready((state, metrics))
        v.times.append(time.perf_counter() - start)
        v.state = state


def measure_peaks(n: int) -> dict[str, float]:
    """FLOP/s of each way of asking for an n^3 matmul (seqshard.hardware.MATMUL_PATHS), and
    the peak of each compute dtype: its matmul as the model asks for it."""
    return {
        **matmul_paths(n, repeats=8),
        "float32": measure_matmul_flops(n, jnp.float32, repeats=8),
        "bfloat16": measure_matmul_flops(n, jnp.bfloat16, repeats=8),
    }


# ---------------------------------------------------------------------------------------------
# Report


def table(rows: list[list[str]], header: list[str]) -> str:
    return format_table(rows, header, right=range(len(header)))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant (default 8)")
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed steps per variant after compiling"
    )
    p.add_argument(
        "--meshes", default="8x1,4x2,2x4", help="comma-separated DxT (default 8x1,4x2,2x4)"
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help="compute_dtype, or several comma-separated, timed interleaved in one run: "
        "float32, bfloat16 (default float32, the CPU configs' choice)",
    )
    p.add_argument("--remat", default="saved", choices=("saved", "full", "none"))
    p.add_argument(
        "--impls",
        default="seqshard,seqshard-autodiff,gspmd",
        help=f"which variants, of {','.join(IMPLS)} (default seqshard,seqshard-autodiff,gspmd)",
    )
    p.add_argument(
        "--attention",
        default="gqa",
        choices=("gqa", "mla"),
        help="the model's attention: gqa (default, the model above) or mla (multi-head latent "
        "attention of about the same size)",
    )
    p.add_argument(
        "--q-lora-rank",
        type=int,
        default=None,
        help="--attention mla: model.mla.q_lora_rank (default 128; 0: queries straight from "
        "the residual)",
    )
    p.add_argument(
        "--peak-n", type=int, default=2048, help="matmul size for the peak (default 2048)"
    )
    p.add_argument(
        "--hlo-dir", type=Path, default=None, help="write each variant's compiled HLO here"
    )
    args = p.parse_args(argv)
    dtypes = args.dtype.split(",")
    for dtype in dtypes:
        if dtype not in SHORT:
            p.error(f"--dtype {dtype!r}: choose from {', '.join(SHORT)}")

    if args.q_lora_rank is not None and args.attention != "mla":
        p.error(f"--q-lora-rank {args.q_lora_rank} sizes MLA's query latent: add --attention mla")
    fields = model_fields(args.attention, 128 if args.q_lora_rank is None else args.q_lora_rank)

    n_dev = len(jax.devices())
    model = ModelConfig(**fields, remat=args.remat)
    train = TrainConfig(batch_size=BATCH, seq_len=SEQ_LEN, warmup_steps=10, steps=1000)
    tokens, starts = make_batch(model.vocab)
    print(
        f"jax {jax.__version__} on {n_dev} {jax.devices()[0].platform} devices, "
        f"{os.cpu_count()} host cores; model {fields}, compute_dtype {'/'.join(dtypes)}, "
        f"remat={args.remat}; batch {BATCH} x {SEQ_LEN} = {BATCH * SEQ_LEN} tokens"
    )

    variants: list[Variant] = []
    for spec in args.meshes.split(","):
        d, t = (int(x) for x in spec.lower().split("x"))
        if d * t > n_dev:
            print(f"skipping {spec}: it needs {d * t} devices, this process has {n_dev}")
            continue
        if BATCH % d:
            print(f"skipping {spec}: the batch of {BATCH} does not split over d={d}")
            continue
        m, why = model_for_mesh(model, d, t)
        if why:
            print(f"mesh {spec}: {why}")
        mesh = mesh_of_sizes(MeshConfig(d=d, t=t).sizes())
        for dtype in dtypes:
            m_dtype = dataclasses.replace(m, compute_dtype=dtype)
            cfg = Config(model=m_dtype, mesh=MeshConfig(d=d, t=t), train=train)
            for impl in args.impls.split(","):
                variants.append(Variant(impl, spec + ("*" if why else ""), dtype, cfg, mesh))

    t_start = time.perf_counter()
    peaks = measure_peaks(args.peak_n)
    for v in variants:
        build(v, tokens, starts, args.warmup, args.hlo_dir)
        print(f"  compiled {v.name:<16} in {v.compile_s:5.1f} s; first-step loss {v.loss0:.6f}")
    for r in range(args.steps):  # round-robin, the starting variant rotating
        run_round(variants, [(r + i) % len(variants) for i in range(len(variants))])
    after = measure_peaks(args.peak_n)
    peaks = {k: max(peaks[k], after[k]) for k in peaks}
    print(f"\n{args.peak_n}^3 matmul on one device, GFLOP/s (best of before/after the rounds):")
    for path in MATMUL_PATHS:
        print(f"  {path:<44} {peaks[path] / 1e9:8.1f}")
    model_path = matmul_path(jnp.ones(1, jnp.bfloat16)) or "bf16 x bf16 -> bf16, JAX's default"
    print(
        f"  the model's bf16 matmuls here: {model_path} (shardlib.matmul.ACCUMULATE"
        f"[{matmul_target()!r}])"
    )
    print(
        f"MFU below is against each variant's compute dtype's peak, its matmul as the model "
        f"asks for it: f32 {peaks['float32'] / 1e9:.1f}, bf16 {peaks['bfloat16'] / 1e9:.1f} "
        f"GFLOP/s. Total {time.perf_counter() - t_start:.0f} s."
    )

    tokens_per_step = BATCH * SEQ_LEN
    rows, tps = [], {}
    for v in variants:
        med = statistics.median(v.times)
        tps[v.name] = tokens_per_step / med
        flops = flops_per_token(v.cfg.model, SEQ_LEN).total * tokens_per_step / med
        calls = sum(n for n, _ in v.per_step.values())
        sent = sum(b for _, b in v.per_step.values())
        rows.append(
            [v.impl, v.mesh_name, SHORT[v.dtype], f"{med * 1e3:.0f}", f"{min(v.times) * 1e3:.0f}"]
            + [f"{tps[v.name]:.0f}", f"{flops / 1e9:.1f}", f"{100 * flops / peaks[v.dtype]:.1f}%"]
            + [_counts(v.counts), str(calls), format_bytes(sent), format_bytes(v.temp_bytes)]
            + [f"{v.loss0:.5f}"]
        )
    header = ["impl", "mesh", "dtype", "step ms (med)", "min ms", "tokens/s", "GFLOP/s", "MFU"]
    header += ["collectives in HLO", "calls/step", "sent/dev/step", "temp", "loss0"]
    print()
    print(table(rows, header))
    print(
        f"(median of {args.steps} steps each, interleaved; model FLOPs "
        f"{flops_per_token(model, SEQ_LEN).total / 1e6:.2f} M/token; collectives in HLO: "
        f"count_collectives, a scan body once; calls/step: x trip count; '*': changed model)"
    )

    for dtype in dtypes:
        compare_backwards([v for v in variants if v.dtype == dtype], tps)
    if len(dtypes) > 1:
        compare_dtypes(variants, tps, dtypes)
    for dtype in dtypes:
        if len(dtypes) > 1:
            print(f"\ncompute_dtype {dtype}:")
        compare_baselines([v for v in variants if v.dtype == dtype], tps)


def compare_dtypes(variants: list[Variant], tps: dict[str, float], dtypes: list[str]) -> None:
    """Each variant's tokens/s in each compute dtype over the first's, mesh by mesh; ends with
    ``ratio_<dtype>_vs_<first>=X`` for seqshard, the minimum over the meshes."""
    first = dtypes[0]
    base = {(v.impl, v.mesh_name): tps[v.name] for v in variants if v.dtype == first}
    for dtype in dtypes[1:]:
        rows, seqshard = [], []
        for v in variants:
            if v.dtype != dtype or (v.impl, v.mesh_name) not in base:
                continue
            ratio = tps[v.name] / base[(v.impl, v.mesh_name)]
            rows.append([v.impl, v.mesh_name, f"{base[(v.impl, v.mesh_name)]:.0f}"])
            rows[-1] += [f"{tps[v.name]:.0f}", f"{ratio:.3f}"]
            if v.impl == "seqshard":
                seqshard.append(ratio)
        a, b = SHORT[first], SHORT[dtype]
        print(f"\ncompute dtype: {b} vs {a}, same model, mesh and initial state")
        print(table(rows, ["impl", "mesh", f"{a} tok/s", f"{b} tok/s", f"{b} / {a}"]))
        if seqshard:
            print(f"ratio_{b}_vs_{a}={min(seqshard):.3f}")


def compare_baselines(variants: list[Variant], tps: dict[str, float]) -> None:
    """seqshard against the GSPMD baselines of the same compute dtype: ``ratio_vs_gspmd=X``
    (and ``ratio_vs_gspmd_act=X``)."""
    by = {(v.impl, v.mesh_name): tps[v.name] for v in variants}

    def best(impl: str, spec_only: bool) -> tuple[str, float] | None:
        got = [
            (v.mesh_name, tps[v.name])
            for v in variants
            if v.impl == impl and (v.spec_config or not spec_only)
        ]
        return max(got, key=lambda x: x[1]) if got else None

    if any(v.impl == "gspmd-act" for v in variants):
        s, g = best("seqshard", True), best("gspmd-act", True)
        if s and g:
            print(
                f"(vs gspmd-act, the baseline with the residual constrained: seqshard@{s[0]} "
                f"vs gspmd-act@{g[0]}: {s[1] / g[1]:.3f})"
            )
        per_mesh = {
            v.mesh_name: by[("seqshard", v.mesh_name)] / tps[v.name]
            for v in variants
            if v.impl == "gspmd-act" and ("seqshard", v.mesh_name) in by
        }
        if per_mesh:
            print(
                "seqshard / gspmd-act on the same mesh: "
                + ", ".join(f"{m} {r:.3f}" for m, r in per_mesh.items())
            )
            print(f"ratio_vs_gspmd_act={min(per_mesh.values()):.3f}")
    for spec_only in (False, True):
        s, g = best("seqshard", spec_only), best("gspmd", spec_only)
        if s is None or g is None:
            print("ratio_vs_gspmd=nan" if spec_only else "(no ratio: a variant is missing)")
            continue
        line = f"ratio_vs_gspmd={s[1] / g[1]:.3f}"
        if spec_only:
            print(f"best: seqshard@{s[0]} {s[1]:.0f} tokens/s, gspmd@{g[0]} {g[1]:.0f} tokens/s")
            print(line)
        else:
            print(f"(with '*' meshes too: seqshard@{s[0]} vs gspmd@{g[0]}: {line})")


def compare_backwards(variants: list[Variant], tps: dict[str, float]) -> None:
    """Explicit vs autodiff backward, mesh by mesh; ends with ``ratio_explicit_vs_autodiff=X``
    (tokens/s, the minimum over the meshes that ran both)."""
    by_mesh: dict[tuple[str, str], Variant] = {}
    for v in variants:  # the first variant with each backward pass, per mesh
        if v.impl in BACKWARD_OF:
            by_mesh.setdefault((BACKWARD_OF[v.impl], v.mesh_name), v)
    rows, ratios = [], []
    for (backward, mesh_name), v in by_mesh.items():
        e = by_mesh.get(("explicit", mesh_name))
        if backward != "autodiff" or e is None:
            continue
        ratio = tps[e.name] / tps[v.name]
        ratios.append(ratio)
        more = [k for k in COLLECTIVE_KINDS if e.counts[k] > v.counts[k]]
        rows.append(
            [v.mesh_name, f"{tps[v.name]:.0f}", f"{tps[e.name]:.0f}", f"{ratio:.3f}"]
            + [format_bytes(v.temp_bytes), format_bytes(e.temp_bytes)]
            + [f"{e.temp_bytes / v.temp_bytes - 1:+.1%}" if v.temp_bytes > 0 else "?"]
            + [_counts(v.counts), _counts(e.counts), "more: " + ",".join(more) if more else "<="]
            + [f"{abs(e.loss0 - v.loss0):.1e}"]
        )
    if not rows:
        print("ratio_explicit_vs_autodiff=nan  (run --impls with seqshard and seqshard-autodiff)")
        return
    header = ["mesh", "autodiff tok/s", "explicit tok/s", "ratio", "temp autodiff"]
    header += ["temp explicit", "temp +/-", "collectives autodiff", "explicit", "vs autodiff"]
    header += ["|loss0 diff|"]
    print("\nbackward: explicit (model/backward.py) vs autodiff, same model, mesh and state")
    print(table(rows, header))
    print(f"ratio_explicit_vs_autodiff={min(ratios):.3f}")


def _counts(counts: dict[str, int]) -> str:
    short = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR"}
    short |= {"all-to-all": "A2A", "collective-permute": "CP"}
    return " ".join(f"{short[k]}{counts[k]}" for k in COLLECTIVE_KINDS if counts[k]) or "-"


if __name__ == "__main__":
    main(sys.argv[1:])
