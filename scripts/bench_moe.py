#!/usr/bin/env python
"""Time seqshard's mixture-of-experts train step against a plain-``jax.jit`` GSPMD baseline of
the same model on 8 fake CPU devices, per mesh e x d x t, dropless and with a capacity; beside
it the dense model of equal active parameters. ``--gpu``: one device (an H100), a larger model.

    python scripts/bench_moe.py                          # meshes 2x2x2 4x2x1 8x1x1 2x4x1: ~5 min on 2 cores
    python scripts/bench_moe.py --meshes 2x2x2 --capacities 0 --steps 3 --no-dense
    python scripts/bench_moe.py --hlo-dir /tmp/hlo       # also writes each variant's compiled HLO
    python scripts/bench_moe.py --gpu                    # one GPU, the larger model (below)
    python scripts/bench_moe.py --gpu --tiny --steps 2   # the same on one CPU device, tiny shapes

The model (CPU): 2 layers, both mixture-of-experts (``moe.n_dense_layers=0``), d_model 128,
2 kv heads x 2 query heads of 32, vocab 1024, packed documents, einsum attention, f32, remat
saved, seqshard's default hand-written backward; each MoE FFN 8 routed SwiGLU experts of
``moe.d_ff`` 128, top-3 softmax router (renormalized), 1 shared expert, DeepSeek-V3's bias
balancing (rate 1e-3), z-loss 1e-3 (``configs/tiny-cpu-moe.yaml``'s routing); batch 16 x 128
tokens; AdamW + clipping from :func:`seqshard.train.optimizer.make_optimizer`. The dense model
of equal active parameters: the same with a SwiGLU FFN of ``d_ff = (top_k + n_shared) x
moe.d_ff`` = 512 (tiny-cpu's). The size flags (``--d-model``, ``--expert-d-ff``, ...) change
both models.

Variants, per mesh (``--meshes``, e x d x t) and per ``moe.capacity_factor`` (``--capacities``:
0 is dropless, the exchange buffers sized for the worst case; 1.25 drops the copies past each
expert shard's share x 1.25):

* **seqshard**: :func:`seqshard.train.step.make_train_step`, the model's one ``shard_map``
  (``seqshard/model/moe.py``: the token copies sorted by expert into fixed buffers, one
  ``all_to_all`` over e there and one back, one grouped matmul per expert projection, in row
  tiles on CPU).
* **gspmd** (the baseline): one plain single-program forward jitted with in/out shardings only
  (the same ``make_train_step`` with its ``loss_terms`` swapped, as in ``bench_step.py``):
  weights and optimizer state in the shardings of their types (routed experts
  ``'experts/e d_model/d/c d_expert/t'``, other rows ``d_model/d/e/c``), the batch
  ``TokenBatch``'s ``'B/d/e L'``; XLA's SPMD partitioner chooses every collective. The math is
  ``seqshard/model/reference.py``'s (its embedding, attention half, norms, head and loss;
  layers scanned under seqshard's own remat, the same values marked saved) and, for the MoE
  FFN, the reference's **dense routing**: every expert applied to every token, weighted by the
  sparse gates, with the router written as the model's (:func:`seqshard.model.moe.route`) and
  the gates folded into the down projection's contraction (no [B, L, E, M] tensor). With a
  capacity, each copy is kept or dropped by seqshard's rule, computed densely per device's
  tokens (:func:`capacity_kept`: a shard takes ``capacity(T)`` copies, ranked by expert and
  then by token), so both programs are the same model at every capacity; the baseline returns
  the same routing statistics, so the step also moves the router bias the same way. Both
  start from the very same state: the first-step losses must agree (the table prints the
  difference, and the dropped fraction of each).

  Why dense routing: it costs E/k = 8/3 times the active expert FLOPs, but it is the fastest
  plain-jit formulation here. ``lax.ragged_dot`` has no grouped kernel on XLA:CPU: it lowers to
  a dense dot of every group against every row (``jax/_src/lax/lax.py``'s default
  lowering), so a sorted ragged_dot under jit costs E x T x k rows, k times dense routing; a
  GShard/MaxText capacity einsum (dispatch [G, T, E, C] one-hot) computes E x C rows per
  group, which dropless needs at C = T (dense routing's work plus the dispatch and combine
  einsums), and with a per-expert capacity it is another model (its drops differ from
  seqshard's per-shard buffers). seqshard avoids that lowering on CPU (row tiles, below).
* **seqshard-dense**, **gspmd-dense** (``--no-dense`` skips them): the dense model of equal
  active parameters on the same devices, mesh d = e x d (the dense model has no experts to
  split over e; e is data parallelism anyway), t as given; gspmd-dense is
  ``bench_step.py``'s baseline. Meshes that give the same d x t run once.

Timing: every variant is compiled (XLA's ``memory_analysis().temp_size_in_bytes`` read from the
executable, the collectives from its HLO text) and warmed up, then the timed steps run
round-robin, one step of each variant per round, the order rotated each round, each timed
alone up to ``block_until_ready``; the table shows medians. Columns: tokens/s (all B x L
tokens), GFLOP/s of active model FLOPs (:func:`seqshard.model.cost.flops_per_token`: the k
chosen experts, no credit for recomputation or for dense routing's extra work), the compiled
collectives by kind (:func:`seqshard.shardlib.comms.collectives`; a scan body counts once),
collective calls and ring-model bytes sent per device per step (scan bodies times their trip
count), temp memory, the first-step loss and the fraction of copies dropped. Then, per mesh,
seqshard over gspmd; the last line is ``ratio_vs_gspmd_moe=X``: the smallest over the meshes
of seqshard's tokens/s over the baseline's, dropless.

**Measured** (JAX 0.10.2, 2 cores, docs/benchmarks.md): ``ratio_vs_gspmd_moe=1.524``.
seqshard wins dropless on every mesh (e2 d2 t2 1.52, e4 d2 t1 1.94, e8 d1 t1 1.62, e2 d4 t1
4.17), with capacity 1.25 1.93 to 3.97, the dense model 2.1x and 6.3x. seqshard's grouped
matmuls on CPU walk the rows each expert holds in tiles (:data:`seqshard.shardlib.matmul.
ROW_TILES`); before that, XLA:CPU's own ``ragged_dot`` (a dense dot of every local expert
against every row of the worst-case-sized buffer, 8x the active work at e = 2) made it 0.551.

**--gpu**: on the first device only (``CUDA_VISIBLE_DEVICES=0`` on a node with several), mesh
1 x 1 x 1, bf16, attention as ``auto`` resolves it (cuDNN on GPU, einsum on CPU): 8 layers
(the first dense), d_model 1024, 16 query heads over 8 kv heads of 64, vocab 32768, 16 routed
experts of 1024 top-2 plus 1 shared, batch 8 x 2048 tokens (476M parameters, 168M
active; well inside an H100's 80 GB). On one device no sharding is involved, so the baseline
is the plain single-device MoE one writes in JAX, **plain**: the reference's layers with the
FFN as sorted ``lax.ragged_dot`` (copies argsorted by expert, one grouped matmul per
projection, scattered back and combined; on GPU ``ragged_dot`` has a grouped lowering, unlike
CPU), under ``jax.checkpoint(dots_with_no_batch_dims_saveable)`` as ``bench_gpu.py``'s plain
Llama; and **plain-dense-routing** (``--gpu-dense-routing``), the reference's formulation.
The last line is ``ratio_vs_plain_moe=X`` (seqshard over plain, dropless). ``--tiny`` shrinks
either mode's model and batch for a smoke run (``--gpu --tiny`` runs on one CPU device).
"""

# ruff: noqa: E402  (XLA_FLAGS must be set before JAX is imported)
from __future__ import annotations

import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
if "--gpu" not in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import collections
import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh

from seqshard.batch import TokenBatch
from seqshard.config import Config, MeshConfig, TrainConfig
from seqshard.hardware import KNOWN_PEAKS
from seqshard.mesh import mesh_of_sizes, training_mesh
from seqshard.model import attention
from seqshard.model.attention import dense_mask_impl, resolve_impl
from seqshard.model.config import ModelConfig, MoEConfig
from seqshard.model.cost import flops_per_token, param_count
from seqshard.model.layers import with_aux_losses
from seqshard.model.moe import capacity, route
from seqshard.model.reference import (
    reference_attention_half,
    reference_embed,
    reference_layer,
    reference_loss_terms,
    reference_mask,
    reference_norm,
    reference_positions,
    reference_unembed,
)
from seqshard.model.weights import Layer
from seqshard.shardlib.comms import collectives
from seqshard.shardlib.remat import explicit_activation_checkpointing, save_for_backward
from seqshard.shardlib.shardtypes import shardings
from seqshard.shardlib.tables import format_bytes, format_table
from seqshard.testing import COLLECTIVE_KINDS
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import TrainState, init_train_state
from seqshard.train.step import make_train_step

CPU_MODEL = dict(
    vocab=1024,
    d_model=128,
    n_layers=2,
    n_q_per_kv=2,
    n_kv=2,
    d_head=32,
    attention_impl="einsum",
    attention_mask="document",
    compute_dtype="float32",
)
CPU_MOE = dict(n_experts=8, top_k=3, d_ff=128, n_shared=1, n_dense_layers=0)
GPU_MODEL = dict(
    vocab=32768,
    d_model=1024,
    n_layers=8,
    n_q_per_kv=2,
    n_kv=8,
    d_head=64,
    attention_impl="auto",
    attention_mask="document",
    compute_dtype="bfloat16",
)
GPU_MOE = dict(n_experts=16, top_k=2, d_ff=1024, n_shared=1, n_dense_layers=1)
TINY_MODEL = dict(vocab=512, d_model=64, n_layers=2, n_q_per_kv=2, n_kv=2, d_head=16)
TINY_MOE = dict(n_experts=8, top_k=2, d_ff=32, n_shared=1, n_dense_layers=1)
ROUTING = dict(router="softmax", balance="bias", bias_rate=1e-3, z_loss_weight=1e-3)
BATCH = {"cpu": (16, 128), "gpu": (8, 2048), "tiny": (8, 64)}  # rows x tokens per row


# ---------------------------------------------------------------------------------------------
# The baselines: one plain program each, the reference's math


def capacity_kept(cfg: ModelConfig, ids: jax.Array, groups: int, e: int) -> jax.Array:
    """bool[B, L, k]: which token copies seqshard's dispatch keeps under ``moe.capacity_factor``,
    computed densely. ``ids`` i32[B, L, k] (each token's k distinct experts); ``groups`` the
    devices the batch's rows are split over (d x e, each holding ``B/groups`` consecutive rows),
    ``e`` the expert shards. As ``seqshard.model.moe._dispatch_plan``: a device's copies to
    shard r fill r's ``capacity(T)`` slots ranked by expert, then by token; past them, dropped.
    A copy's rank is the copies to its shard's lower experts plus the earlier tokens' copies
    to its own expert (a token picks an expert at most once)."""
    n_experts = cfg.moe.n_experts
    b, length, k = ids.shape
    g = ids.reshape(groups, b // groups * length, k)
    per_token = jnp.sum(jax.nn.one_hot(g, n_experts, dtype=jnp.int32), axis=2)  # [G, T, E]
    earlier_tokens = jnp.cumsum(per_token, axis=1) - per_token
    per_expert = jnp.sum(per_token, axis=1).reshape(groups, e, n_experts // e)
    lower_experts = (jnp.cumsum(per_expert, axis=-1) - per_expert).reshape(groups, 1, n_experts)
    rank = jnp.take_along_axis(earlier_tokens + lower_experts, g, axis=-1)  # [G, T, k]
    return (rank < capacity(cfg, g.shape[1], e)).reshape(b, length, k)


def routing_stats(cfg: ModelConfig, ids, kept, probs, logits) -> dict[str, jax.Array]:
    """One layer's routing statistics (``seqshard.model.moe.ROUTER_STATS``) over the whole batch, as ``seqshard.model.moe`` defines
    them (load before drops, drops, the weighted aux and z terms, tokens)."""
    moe = cfg.moe
    tokens = jnp.asarray(ids.shape[0] * ids.shape[1], jnp.float32)
    load = jnp.sum(jax.nn.one_hot(ids, moe.n_experts, dtype=jnp.float32), axis=(0, 1, 2))
    weight = moe.aux_loss_weight if moe.balance == "aux_loss" else 0.0
    f = load / (tokens * moe.top_k)
    aux = weight * moe.n_experts * jnp.sum(f * jnp.sum(probs, axis=(0, 1)) / tokens)
    z = moe.z_loss_weight * jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    dropped = jnp.sum(jnp.where(kept, 0.0, 1.0))
    return {"load": load, "dropped": dropped, "aux": aux, "z": z, "tokens": tokens}


def dense_routing(cfg: ModelConfig, w: Layer, nx: jax.Array, combine: jax.Array) -> jax.Array:
    """The reference's routed experts: every expert on every token, [B, L, M] -> [B, L, M],
    ``combine`` f32[B, L, E] the gates (0 for experts not chosen or copies dropped), folded
    into the down projection's contraction over (E, X)."""
    dt = nx.dtype
    gate = jnp.einsum("blm,emx->blex", nx, w.w_gate.astype(dt))
    up = jnp.einsum("blm,emx->blex", nx, w.w_up.astype(dt))
    hidden = jax.nn.silu(gate) * up * combine[..., None].astype(dt)
    return jnp.einsum("blex,emx->blm", hidden, w.w_down.astype(dt))


def sorted_ragged(cfg: ModelConfig, w: Layer, nx, ids, weights) -> jax.Array:
    """The routed experts as one writes them in plain JAX on one device: the B x L x k copies
    argsorted by expert, one ``lax.ragged_dot`` per projection, scattered back and summed with
    ``weights`` f32[B, L, k] (the gates, 0 for a dropped copy)."""
    b, length, m = nx.shape
    dt = nx.dtype
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=cfg.moe.n_experts).astype(jnp.int32)
    rows = nx.reshape(b * length, m)[order // cfg.moe.top_k]
    gate = lax.ragged_dot(rows, w.w_gate.astype(dt), sizes)
    up = lax.ragged_dot(rows, w.w_up.astype(dt), sizes)
    out = lax.ragged_dot(jax.nn.silu(gate) * up, jnp.swapaxes(w.w_down.astype(dt), 1, 2), sizes)
    copies = jnp.zeros_like(out).at[order].set(out).reshape(b, length, -1, m)
    return jnp.einsum("blkm,blk->blm", copies, weights.astype(dt))


@dataclasses.dataclass(frozen=True)
class Plain:
    """How a baseline runs the reference's layers: ``groups`` and ``e``, the devices the batch
    is split over and the expert shards (for :func:`capacity_kept`); ``experts``, the routed
    experts' formulation (``dense``: :func:`dense_routing`; ``ragged``: :func:`sorted_ragged`);
    ``remat`` wraps the scanned layer; ``mark`` tags what it keeps; ``attend``: reference.py's
    attention hook (None: its einsum attention)."""

    groups: int
    e: int
    experts: str
    remat: Callable
    mark: Callable = lambda v: v
    attend: Callable | None = None


def plain_moe_layer(
    cfg: ModelConfig, plain: Plain, w: Layer, x, positions, mask
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One MoE layer of the baselines: reference.py's attention half, then the MoE FFN with
    the routed experts as ``plain.experts`` says and the shared experts as the reference's:
    (the residual, the layer's statistics)."""
    moe = cfg.moe
    dt = jnp.dtype(cfg.compute_dtype)
    hooks = dict(mark=plain.mark, attend=plain.attend)
    x = reference_attention_half(cfg, w, x, positions, mask, **hooks)
    nx = reference_norm(x, w.ln2, cfg.norm_eps).astype(dt)
    logits = jnp.einsum("blm,me->ble", nx.astype(jnp.float32), w.router)
    ids, gates, probs = route(cfg, logits, w.router_bias)
    if moe.capacity_factor:
        kept = capacity_kept(cfg, ids, plain.groups, plain.e)
        gates = jnp.where(kept, gates, 0.0)
    else:
        kept = jnp.ones(ids.shape, bool)
    if plain.experts == "dense":
        combine = jnp.einsum("blke,blk->ble", jax.nn.one_hot(ids, moe.n_experts), gates)
        y = dense_routing(cfg, w, nx, combine)
    else:
        y = sorted_ragged(cfg, w, nx, ids, gates)
    if moe.n_shared:
        shared = jax.nn.silu(nx @ w.s_gate.astype(dt)) * (nx @ w.s_up.astype(dt))
        y = y + shared @ w.s_down.astype(dt).T
    return (x + y).astype(dt), routing_stats(cfg, ids, kept, probs, logits)


def plain_terms_and_stats(cfg: ModelConfig, plain: Plain) -> Callable:
    """``(weights, batch) -> (f32[2], the auxiliary outputs) or f32[2]``: the summed loss (balancing
    terms included, as seqshard's) and positions counted, and with experts the MoE layers'
    statistics; the layers scanned, each body wrapped by ``plain.remat``."""
    sizes = cfg.dim_sizes()
    remat = plain.remat

    def loss_terms(w, batch: TokenBatch):
        tokens, starts = batch.tokens, batch.is_seq_start
        positions = reference_positions(starts)
        mask = reference_mask(starts, cfg.attention_mask)

        def layer(x, lw):
            hooks = dict(mark=plain.mark, attend=plain.attend)
            return reference_layer(cfg, lw, x, positions, mask, **hooks), None

        def moe_layer(x, lw):
            return plain_moe_layer(cfg, plain, lw, x, positions, mask)

        x = reference_embed(cfg, w, tokens)
        if sizes["layers"]:
            x, _ = lax.scan(remat(layer), x, w.layers)
        if not sizes["moe_layers"]:
            return reference_loss_terms(reference_unembed(cfg, w, x), tokens, starts)
        x, stats = lax.scan(remat(moe_layer), x, w.moe_layers)
        terms = reference_loss_terms(reference_unembed(cfg, w, x), tokens, starts)
        aux = {"moe_layers": {"moe": stats}}  # as seqshard.model.layers.run_stacks gives them
        return with_aux_losses(cfg, terms, aux), aux

    return loss_terms


def fused_attention(impl: str, causal: bool) -> Callable:
    """reference.py's attention as ``jax.nn.dot_product_attention(implementation=impl)``
    (``bench_gpu.py``'s hook)."""

    def attend(q, k, v, mask):
        return attention.fused_attention(q, k, v, mask, impl, causal)

    return attend


def _plain_checkpoint(body: Callable) -> Callable:
    """``bench_gpu.py``'s plain remat: matmul outputs without batch dims saved."""
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return jax.checkpoint(body, policy=policy, prevent_cse=False)


def make_gspmd_step(cfg: Config, mesh: Mesh, opt: optax.GradientTransformation):
    """The CPU baseline: seqshard's ``make_train_step`` (same update, state shardings from the
    types, donation) with the plain program's loss, dense routing, seqshard's remat."""
    sizes = dict(mesh.shape)
    plain = Plain(
        groups=sizes.get("d", 1) * sizes.get("e", 1),
        e=sizes.get("e", 1),
        experts="dense",
        remat=lambda body: explicit_activation_checkpointing(body, cfg.model.remat),
        mark=save_for_backward,
    )
    return make_train_step(cfg, mesh, opt, loss_terms=plain_terms_and_stats(cfg.model, plain))


def make_plain_step(experts: str) -> Callable:
    """The one-device baseline (``--gpu``): the same step, no sharding involved, the routed
    experts as ``experts`` says, under ``bench_gpu.py``'s plain remat, attention as the config
    resolves it (``bench_gpu.py``'s :func:`fused_attention` hook: cuDNN on GPU)."""

    def make(cfg: Config, mesh: Mesh, opt: optax.GradientTransformation):
        # Plain JAX has no segment-id attention: where seqshard runs pallas, the dense mask.
        impl = dense_mask_impl(resolve_impl(cfg.model.attention_impl, cfg.model.attention_mask))
        causal = cfg.model.attention_mask == "causal"
        attend = None if impl == "einsum" else fused_attention(impl, causal)
        plain = Plain(1, 1, experts, remat=_plain_checkpoint, attend=attend)
        return make_train_step(cfg, mesh, opt, loss_terms=plain_terms_and_stats(cfg.model, plain))

    return make


IMPLS = {
    "seqshard": make_train_step,
    "gspmd": make_gspmd_step,
    "plain": make_plain_step("ragged"),
    "plain-dense-routing": make_plain_step("dense"),
}


# ---------------------------------------------------------------------------------------------
# Variants


@dataclasses.dataclass
class Variant:
    impl: str  # a key of IMPLS
    model: str  # 'moe' or 'dense'
    mesh_name: str  # 'e2 d2 t2'; a dense model's 'd4 t2'
    cfg: Config
    mesh: Mesh
    step: object = None  # the compiled executable
    state: TrainState | None = None
    batch: TokenBatch | None = None
    times: list = dataclasses.field(default_factory=list)
    loss0: float = float("nan")
    dropped0: float = float("nan")
    compile_s: float = 0.0
    counts: dict = dataclasses.field(default_factory=dict)
    calls: int = 0
    sent: float = 0.0
    temp_bytes: int = -1

    @property
    def capacity_name(self) -> str:
        cf = self.cfg.model.moe.capacity_factor
        return "-" if self.model == "dense" else ("dropless" if cf == 0 else f"cf {cf:g}")

    @property
    def name(self) -> str:
        return f"{self.impl}@{self.mesh_name}/{self.capacity_name}"


def make_batch(vocab: int, rows: int, length: int, seed: int = 0) -> TokenBatch:
    """Random tokens, packed documents: every row starts one, more start at random (p=1/48)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(rows, length), dtype=np.int32)
    starts = rng.random((rows, length)) < 1 / 48
    starts[:, 0] = True
    return TokenBatch(tokens, starts, np.ones_like(starts))


def build(v: Variant, batch: TokenBatch, warmup: int, hlo_dir: Path | None) -> None:
    """Compile, read collectives and memory, warm up; the first step's loss is kept."""
    opt = make_optimizer(v.cfg.train, v.cfg.model, v.mesh)
    jitted = IMPLS[v.impl](v.cfg, v.mesh, opt)
    state = init_train_state(v.cfg.model, v.mesh, opt, jax.random.key(v.cfg.train.seed))
    v.batch = jax.device_put(batch, shardings(TokenBatch, v.mesh))
    start = time.perf_counter()
    compiled = jitted.lower(state, v.batch).compile()
    v.compile_s = time.perf_counter() - start
    hlo = compiled.as_text()
    found = collectives(hlo, v.mesh)
    kinds = collections.Counter(c.kind for c in found)  # a scan body once
    v.counts = {k: kinds.get(k, 0) for k in COLLECTIVE_KINDS}
    v.calls = sum(c.calls_per_step for c in found)  # scan bodies x trip count
    v.sent = sum(c.calls_per_step * c.bytes_sent for c in found)
    mem = compiled.memory_analysis()
    v.temp_bytes = int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1
    if hlo_dir is not None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        name = v.name.replace("@", "_").replace("/", "_").replace(" ", "")
        (hlo_dir / f"{name}.hlo.txt").write_text(hlo)
    v.step = compiled
    for i in range(max(warmup, 1)):
        state, metrics = compiled(state, v.batch)
        if i == 0:
            v.loss0 = float(metrics["loss"])
            v.dropped0 = float(metrics.get("moe_dropped_fraction", float("nan")))
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


# ---------------------------------------------------------------------------------------------
# Configs


def model_configs(args: argparse.Namespace) -> tuple[ModelConfig, ModelConfig]:
    """(the MoE model, the dense model of equal active parameters) from the mode and flags."""
    preset = "tiny" if args.tiny else ("gpu" if args.gpu else "cpu")
    fields = {"cpu": CPU_MODEL, "gpu": GPU_MODEL, "tiny": {**CPU_MODEL, **TINY_MODEL}}[preset]
    moe_fields = {"cpu": CPU_MOE, "gpu": GPU_MOE, "tiny": TINY_MOE}[preset]
    if args.gpu:
        fields = {**fields, "compute_dtype": "float32" if args.tiny else "bfloat16"}
        fields["attention_impl"] = "auto"
    for flag, key in (("d_model", "d_model"), ("layers", "n_layers"), ("vocab", "vocab")):
        if getattr(args, flag) is not None:
            fields = {**fields, key: getattr(args, flag)}
    for flag, key in (("experts", "n_experts"), ("top_k", "top_k"), ("expert_d_ff", "d_ff")):
        if getattr(args, flag) is not None:
            moe_fields = {**moe_fields, key: getattr(args, flag)}
    moe = MoEConfig(**moe_fields, **ROUTING)
    d_ff = (moe.top_k + moe.n_shared) * moe.d_ff
    return (
        ModelConfig(**fields, d_ff=d_ff, moe=moe, remat=args.remat),
        ModelConfig(**fields, d_ff=d_ff, remat=args.remat),
    )


def with_capacity(model: ModelConfig, factor: float) -> ModelConfig:
    return dataclasses.replace(model, moe=dataclasses.replace(model.moe, capacity_factor=factor))


def cpu_variants(args, moe_model, dense_model, train) -> list[Variant]:
    variants, dense_meshes = [], []
    n_dev = len(jax.devices())
    rows = train.batch_size
    for spec in args.meshes.split(","):
        e, d, t = (int(x) for x in spec.lower().split("x"))
        name = f"e{e} d{d} t{t}"
        why = None
        if e * d * t > n_dev:
            why = f"it needs {e * d * t} devices, this process has {n_dev}"
        elif rows % (e * d):
            why = f"the batch of {rows} rows does not split over e x d = {e * d}"
        elif moe_model.moe.n_experts % e:
            why = f"{moe_model.moe.n_experts} experts do not split over e={e}"
        elif moe_model.n_kv % t:
            why = f"{moe_model.n_kv} kv heads do not split over t={t}"
        if why:
            print(f"skipping {spec}: {why}")
            continue
        mesh = mesh_of_sizes({"e": e, "d": d, "t": t})
        for factor in args.capacities:
            cfg = Config(model=with_capacity(moe_model, factor), mesh=MeshConfig(e=e, d=d, t=t))
            cfg = dataclasses.replace(cfg, train=train)
            for impl in ("seqshard", "gspmd"):
                variants.append(Variant(impl, "moe", name, cfg, mesh))
        if not args.no_dense and (e * d, t) not in dense_meshes:
            dense_meshes.append((e * d, t))
    for d, t in dense_meshes:
        cfg = Config(model=dense_model, mesh=MeshConfig(d=d, t=t), train=train)
        mesh = mesh_of_sizes({"d": d, "t": t})
        for impl in ("seqshard", "gspmd"):
            variants.append(Variant(impl, "dense", f"d{d} t{t}", cfg, mesh))
    return variants


def gpu_variants(args, moe_model, dense_model, train) -> list[Variant]:
    mesh = training_mesh({}, devices=jax.devices()[:1])
    variants = []
    for factor in args.capacities:
        cfg = Config(model=with_capacity(moe_model, factor), mesh=MeshConfig(), train=train)
        impls = ["seqshard", "plain"] + (["plain-dense-routing"] if args.gpu_dense_routing else [])
        variants += [Variant(impl, "moe", "1 device", cfg, mesh) for impl in impls]
    if not args.no_dense:
        cfg = Config(model=dense_model, mesh=MeshConfig(), train=train)
        variants.append(Variant("seqshard", "dense", "1 device", cfg, mesh))
    return variants


# ---------------------------------------------------------------------------------------------
# Report


def report(variants: list[Variant], tokens_per_step: int, seq_len: int, gpu: bool) -> None:
    rows, tps = [], {}
    for v in variants:
        med = statistics.median(v.times)
        tps[v.name] = tokens_per_step / med
        flops = flops_per_token(v.cfg.model, seq_len).total * tokens_per_step / med
        rows.append(
            [v.impl, v.model, v.mesh_name, v.capacity_name, f"{med * 1e3:.0f}"]
            + [f"{min(v.times) * 1e3:.0f}", f"{tps[v.name]:.0f}", f"{flops / 1e9:.1f}"]
            + ([f"{100 * flops / KNOWN_PEAKS['h100']:.1f}%"] if gpu else [])
            + [_counts(v.counts), str(v.calls), format_bytes(v.sent)]
            + [format_bytes(v.temp_bytes), f"{v.loss0:.6f}"]
            + ["-" if np.isnan(v.dropped0) else f"{v.dropped0:.4f}"]
        )
    header = ["impl", "model", "mesh", "capacity", "step ms (med)", "min ms", "tokens/s"]
    header += ["GFLOP/s"] + (["MFU 989"] if gpu else [])
    header += ["collectives in HLO", "calls/step", "sent/dev/step", "temp", "loss0", "dropped0"]
    print()
    print(format_table(rows, header, right=range(4, len(header))))
    print(
        "(medians, interleaved; GFLOP/s of active model FLOPs; collectives in HLO: a scan body "
        "once; calls/step: x trip count; dropped0: the first step's fraction of copies dropped)"
    )

    base = "plain" if gpu else "gspmd"
    by_name = {v.name: v for v in variants}
    rows, dropless = [], []
    for v in variants:
        if v.impl != "seqshard":
            continue
        b = by_name.get(v.name.replace("seqshard@", f"{base}@", 1))
        if b is None:
            continue
        ratio = tps[v.name] / tps[b.name]
        if v.model == "moe" and v.cfg.model.moe.capacity_factor == 0:
            dropless.append(ratio)
        temp = f"{v.temp_bytes / b.temp_bytes:.2f}" if b.temp_bytes > 0 else "?"
        rows.append(
            [v.model, v.mesh_name, v.capacity_name, f"{tps[v.name]:.0f}", f"{tps[b.name]:.0f}"]
            + [f"{ratio:.3f}", temp, f"{abs(v.loss0 - b.loss0):.1e}"]
        )
    print(f"\nseqshard vs {base}, same model, mesh and initial state")
    header = ["model", "mesh", "capacity", "seqshard tok/s", f"{base} tok/s", "ratio"]
    header += ["temp ratio", "|loss0 diff|"]
    print(format_table(rows, header, right=range(3, len(header))))
    name = "ratio_vs_plain_moe" if gpu else "ratio_vs_gspmd_moe"
    print(f"{name}={min(dropless):.3f}" if dropless else f"{name}=nan")


def _counts(counts: dict[str, int]) -> str:
    short = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR"}
    short |= {"all-to-all": "A2A", "collective-permute": "CP"}
    return " ".join(f"{short[k]}{counts[k]}" for k in COLLECTIVE_KINDS if counts[k]) or "-"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant (default 4)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after compiling (>= 1)")
    p.add_argument(
        "--meshes",
        default="2x2x2,4x2x1,8x1x1,2x4x1",
        help="comma-separated ExDxT (default 2x2x2,4x2x1,8x1x1,2x4x1; CPU mode)",
    )
    p.add_argument(
        "--capacities",
        default=None,
        type=lambda s: [float(x) for x in s.split(",")],
        help="model.moe.capacity_factor values, 0 dropless (default 0,1.25; --gpu 0: on one "
        "device a capacity >= 1 drops nothing)",
    )
    p.add_argument("--no-dense", action="store_true", help="skip the dense model")
    p.add_argument("--remat", default="saved", choices=("saved", "full", "none"))
    p.add_argument("--gpu", action="store_true", help="one device, the larger model")
    p.add_argument(
        "--gpu-dense-routing",
        action="store_true",
        help="with --gpu, also the reference's dense-routing baseline",
    )
    p.add_argument("--tiny", action="store_true", help="tiny model and batch (smoke run)")
    p.add_argument("--batch", type=int, default=None, help="rows per step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row")
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--experts", type=int, default=None, help="model.moe.n_experts")
    p.add_argument("--top-k", type=int, default=None, help="model.moe.top_k")
    p.add_argument("--expert-d-ff", type=int, default=None, help="model.moe.d_ff")
    p.add_argument("--hlo-dir", type=Path, default=None, help="write each compiled HLO here")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}.")
    if args.capacities is None:
        args.capacities = [0.0] if args.gpu else [0.0, 1.25]

    moe_model, dense_model = model_configs(args)
    rows, length = BATCH["tiny" if args.tiny else ("gpu" if args.gpu else "cpu")]
    rows, length = args.batch or rows, args.seq_len or length
    train = TrainConfig(batch_size=rows, seq_len=length, warmup_steps=10, steps=1000)
    make = gpu_variants if args.gpu else cpu_variants
    variants = make(args, moe_model, dense_model, train)
    device = jax.devices()[0]
    print(
        f"jax {jax.__version__} on {len(jax.devices())} {device.platform} devices "
        f"({device.device_kind}), {os.cpu_count()} host cores; batch {rows} x {length}; "
        f"MoE {param_count(moe_model) / 1e6:.1f}M parameters, {moe_model.moe}; dense "
        f"d_ff={dense_model.d_ff}, {param_count(dense_model) / 1e6:.1f}M parameters; "
        f"{moe_model.compute_dtype}, remat={args.remat}"
    )

    batch = make_batch(moe_model.vocab, rows, length)
    t_start = time.perf_counter()
    for v in variants:
        build(v, batch, args.warmup, args.hlo_dir)
        print(
            f"  compiled {v.name:<34} in {v.compile_s:5.1f} s; loss0 {v.loss0:.6f}",
            flush=True,
        )
    for r in range(args.steps):  # round-robin, the starting variant rotating
        run_round(variants, [(r + i) % len(variants) for i in range(len(variants))])
    print(f"total {time.perf_counter() - t_start:.0f} s")
    report(variants, rows * length, length, args.gpu)


if __name__ == "__main__":
    main(sys.argv[1:])
