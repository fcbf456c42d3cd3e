"""The planner: what one training step of a config costs on a machine, from the notation alone.

    p = plan(cfg, 32, "v5p")        # nothing compiles, nothing is allocated, no device needed
    p.fits, p.bytes_per_device, p.step_time_s, p.mfu, p.comm_bytes_by_axis
    print(show.format_plan(p))      # `seqshard show CONFIG --devices 32 --chip v5p`

A mesh size of -1 resolves against ``n_devices``; the chip's figures come from
:data:`seqshard.hardware.CHIPS`. Every number is per device and per training step (all
``train.microbatches`` passes and the optimizer update). Four parts:

**Memory** (the peak of the step, :class:`MemoryPlan`). Weights, gradients and AdamW's two
moments are f32 and fully sharded (:func:`seqshard.model.cost.memory_per_device`); with
microbatches the gradients have an accumulation buffer too. Activations are what the remat
policy keeps of every layer for the backward pass (:mod:`seqshard.shardlib.remat`), for one
microbatch of ``b = batch / (microbatches * d)`` rows. Logits: f32 ``'b L V/t'`` and their
gradient. Transient: the largest short-lived working set, either

* the LM head's backward: the gathered unembedding ``'V/t M'`` in compute dtype, its
  gradient before the reduce-scatter, and one transposed copy (the gather runs along M, not
  the major dimension); or
* one layer's backward: what the policy did not keep and the backward rebuilds (gathered
  weights, normalized inputs, attention probabilities: :func:`seqshard.model.cost.layer_bytes`),
  the gathered weights' gradients, and, on the einsum path, the f32 ``'b L L Q K/t'``
  gradients of the scores (fused kernels, cudnn, splash and pallas, never hold them).

With microbatches XLA hoists the embedding and unembedding gathers (they do not depend on
the microbatch) out of the accumulation loop, so both gathered tables (and a transposed copy)
stay alive throughout. Not counted: XLA's other temporaries, collective buffers,
fragmentation. Checked against XLA's ``memory_analysis`` (arguments + temporaries) of the
train step compiled for fake CPU devices (tests/plan/test_planner.py): within 15%, measured 0.90
to 1.10 of XLA's figure.

**Communication** (:class:`PlannedCollective`): every collective the step's shardops calls
emit, predicted from the notation by :mod:`seqshard.plan.step_comms` (the step traced on an
abstract mesh, nothing compiled): the forward's, their transposes (autodiff) or the
hand-written backward's (``model.backward=explicit``), and what the remat policy re-runs.
Bytes per call are the ring formulas of :func:`seqshard.shardlib.comms.ring_bytes_sent`. With
``train.optimizer=muon`` also the update's all_to_alls (exposed: they run after the backward
pass, nothing to hide behind). Not counted: the optimizer's global-norm all-reduces (a few f32
scalars).

**Roofline.** Compute: the hardware FLOPs of the step (model FLOPs plus what remat re-runs,
:mod:`seqshard.model.cost`, attention unmasked; with Muon its Newton-Schulz matmuls,
:func:`seqshard.model.matrices.newton_schulz_flops`) at the chip's dense bf16 peak, with ``model.fp8``
the FP8 projections' at its dense FP8 peak (MFU stays against bf16's). Each collective
runs at the bandwidth of the link its mesh axis crosses (:mod:`seqshard.hardware`: NVLink
or ICI inside a GPU node or TPU slice, InfiniBand or DCN across them; t stays inside one, as
:func:`seqshard.mesh.training_mesh` lays it out, and d crosses when the devices span more
than one). The step time is::

    step = max(compute + activation collectives, weight collectives)

Activation collectives (over t, and the loss's) sit between dependent matmuls: nothing can
run while they do. Weight collectives (FSDP gathers and gradient reduce-scatters over d, the
norm gains') depend only on the weights, so XLA's scheduler overlaps them with the matmuls
of other layers (``runtime.overlap_collectives``; without it they add:
``step = compute + all collectives``). MFU = model FLOPs / (step x devices x peak). A
roofline is an upper bound on speed: kernels below peak, latency of small collectives and
imperfect overlap all make a real step slower.

**Verdict.** Fits when the memory total is at most the chip's usable memory
(:attr:`seqshard.hardware.Chip.usable_bytes`). When it does not, the planner tries, with the
same planner, more ``d`` through a smaller ``t`` (same devices), ``model.remat=full``, and
more ``train.microbatches``, alone and combined, and names the fastest change that fits.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from seqshard import hardware
from seqshard.config import Config, ConfigError, check_config, resolve_mesh
from seqshard.mesh import MESH_AXES
from seqshard.model.block import weight_info
from seqshard.model.cost import (
    flops_per_token,
    hardware_flops_per_token,
    layer_bytes,
    matmul_flops_per_token,
    memory_per_device,
    optimizer_bytes_per_device,
    param_bytes_per_device,
    saved_bytes,
    step_flops,
)
from seqshard.model.layers import Stack, runs, stacks
from seqshard.model.matrices import newton_schulz_flops
from seqshard.model.moe import MOE, ROUTED_OPS, buffer_bytes
from seqshard.model.weights import weights_type
from seqshard.plan.step_comms import PlannedCollective, collectives_per_step
from seqshard.shardlib.axes import group_size
from seqshard.shardlib.shardtypes import block_shape, type_tree
from seqshard.shardlib.tables import format_bytes

__all__ = [
    "FUSED_ATTENTION",
    "MOE_IMBALANCE",
    "MemoryPlan",
    "Plan",
    "PlannedCollective",
    "Suggestion",
    "attention_impl_on",
    "collectives_per_step",
    "config_target",
    "describe_memory",
    "memory_plan",
    "moe_buffer_bytes",
    "moe_tokens_per_device",
    "plan",
    "target_config",
]

FUSED_ATTENTION = ("cudnn", "splash", "pallas")
"""Attention kernels that never hold the ``'b L L Q K/t'`` scores (flash attention)."""

MOE_EXCHANGE_BUFFERS = 4
"""How many ``[e, C, M]`` exchange buffers an MoE layer's backward holds at once (see
:func:`_exchange_working_set`)."""

MOE_IMBALANCE = 1.25
"""The planner's default load imbalance of the routed experts: the busiest e shard gets this
many times the mean token copies (a balanced router, aux loss or DeepSeek-V3's bias, keeps
it near 1.1-1.5 after the first steps). It scales the routed experts' compute time only:
dropless buffers are sized for the worst case, so memory and the exchange's bytes do not
depend on it; with ``capacity_factor`` f > 0 a shard takes at most f x the mean."""

CPU_TILE_BUFFERS = 8
"""How many exchange-buffer-sized arrays ``[e, C, M]`` XLA:CPU holds at once in an MoE
layer's backward beyond :data:`MOE_EXCHANGE_BUFFERS`, where the grouped matmuls walk row
tiles (:data:`seqshard.shardlib.matmul.ROW_TILES`: the rows sorted and padded by a tile, each
projection's output and cotangent); and :data:`CPU_EXPERT_COPIES`, how many f32 copies of
this shard's expert matrices (one projection's ``E/e M X/t``: the walk's weight-gradient
accumulators and their casts). Both fitted to ``memory_analysis`` of the step compiled for 8
fake CPU devices (tests/plan/test_planner.py; five configs, e = 1, 2, 4, top_k 1 and 2,
dropless and capacity_factor 1.25, remat saved and full, batch 8 and 16: planner / XLA 0.88
to 0.99), not derived: XLA fuses and frees some of them, and two of the five configs peak in
the head, not here."""

CPU_EXPERT_COPIES = 8
"""See :data:`CPU_TILE_BUFFERS`."""


def attention_impl_on(impl: str, platform: str, mask: str = "document") -> str:
    """What ``model.attention_impl`` runs as on ``platform`` ('gpu', 'tpu', 'cpu') for the
    ``mask`` mode: ``auto`` is splash on TPU, on GPU pallas for the document mask and cudnn for
    the causal one, einsum elsewhere, as :func:`seqshard.model.attention.resolve_impl`
    resolves it on the machine it runs on."""
    if impl == "auto":
        if platform == "gpu":
            return "pallas" if mask == "document" else "cudnn"
        return "splash" if platform == "tpu" else "einsum"
    return impl


TARGET_LINE = re.compile(r"^# target: --devices (\d+) --chip (\S+)\s*$", re.M)
"""A config file's header line naming the machine it is written for, e.g. ``# target:
--devices 8 --chip h100``: what ``seqshard show CONFIG`` plans for without flags."""


def config_target(path: str | Path) -> tuple[int, str] | None:
    """(devices, chip) of the ``# target:`` line of the config file ``path`` (see
    :data:`TARGET_LINE`), or of the nearest base that has one; None if none does."""
    path = Path(path)
    for _ in range(16):  # a base chain (a loop is the config loader's error, not ours)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None
        found = TARGET_LINE.search(text)
        if found:
            return int(found.group(1)), found.group(2)
        base = re.search(r"^base:\s*(\S+)\s*$", text, re.M)
        if base is None:
            return None
        path = path.parent / base.group(1)
    return None


def target_config(cfg: Config, n_devices: int) -> Config:
    """``cfg`` on ``n_devices`` devices: a mesh size of -1 takes the remaining devices, and the
    mesh must use exactly ``n_devices``. Raises ConfigError."""
    if not isinstance(n_devices, int) or isinstance(n_devices, bool) or n_devices < 1:
        raise ConfigError(f"the device count must be a positive integer, got {n_devices!r}.")
    cfg = resolve_mesh(cfg, n_devices)
    if cfg.mesh.n_devices != n_devices:
        raise ConfigError(
            f"mesh {cfg.mesh.describe()} uses {cfg.mesh.n_devices} devices, not the "
            f"{n_devices} planned for. Set mesh sizes whose product is {n_devices}, or let one "
            f"take the remaining devices (mesh.d=-1)."
        )
    return cfg


# ---------------------------------------------------------------------------------------------
# Memory


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes on one device at the peak of a training step (see the module docstring)."""

    weights: int  # f32 master weights, sharded over d*c*t
    grads: int  # f32 gradients, and with microbatches their accumulation buffer
    optimizer: int  # AdamW's two f32 moments (Muon: one for the weight matrices)
    activations: int  # what the remat policy keeps of every layer, one microbatch
    logits: int  # f32 'b L V/t' logits and their gradient
    transient: int  # the largest short-lived working set: the LM head's or one layer's backward

    CATEGORIES = ("weights", "grads", "optimizer", "activations", "logits", "transient")

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in self.CATEGORIES)

    def as_dict(self) -> dict[str, int]:
        return {c: getattr(self, c) for c in self.CATEGORIES}


_FSDP_AXES = frozenset({"d", "e", "c"})


@dataclasses.dataclass(frozen=True)
class _Gather:
    """One weight's gather to a whole ``d_model`` (what its use in transformer.py needs)."""

    name: str
    gathered_bytes: int  # per device, after the gather
    minor: bool  # gathered along a dimension that is not the major one: a transposed copy


def _gathers(cfg: Config, weights: type, names: Iterable[str]) -> list[_Gather]:
    """The gathers of weights ``names`` of the weights dataclass ``weights``, each in the
    dtype its declaration says it is gathered in (norm gains in f32, every other weight cast
    to ``compute_dtype`` first)."""
    sizes, mesh = cfg.model.dim_sizes(), cfg.mesh.sizes()
    types, info = type_tree(weights), weight_info(weights)
    out = []
    for name in names:
        t = getattr(types, name)
        where = [i for i, dim in enumerate(t.shape.dims) if dim.label == "d_model"]
        if not where:  # a latent's rows (MLA's w_q_b, w_kv_b): the one dimension FSDP splits
            where = [i for i, dim in enumerate(t.shape.dims) if set(dim.axes) & _FSDP_AXES]
        if len(where) != 1:
            raise TypeError(
                f"weight {name} is {t!r}: the planner assumes every weight has one d_model "
                f"dimension (or else one split over d, e, c), gathered whole before use. "
                f"Teach seqshard/plan/planner.py how the model uses this one."
            )
        (pos,) = where
        axes = t.shape.dims[pos].axes
        elements = math.prod(block_shape(t, sizes, mesh)) * math.prod(mesh[a] for a in axes)
        out.append(
            _Gather(
                name=name,
                gathered_bytes=elements
                * (4 if info[name].gathered_in == "f32" else cfg.model.compute_bytes),
                minor=pos > 0,
            )
        )
    return out


def _stack(cfg: Config, name: str) -> Stack:
    """The model's layer stack ``name`` ('layers', 'moe_layers')."""
    return {s.name: s for s in stacks(cfg.model)}[name]


def _layer_gathers(cfg: Config, stack: str = "layers") -> list[_Gather]:
    """The gathers of one layer of ``stack`` ('layers', 'moe_layers'): every weight a mesh
    axis splits (a weight whole on every device, the router's bias, is read in place)."""
    layer = _stack(cfg, stack).layer_type
    types = type_tree(layer)
    split = (f.name for f in dataclasses.fields(layer) if getattr(types, f.name).shape.split_axes)
    return _gathers(cfg, layer, split)


def _outer_gathers(cfg: Config) -> dict[str, _Gather]:
    outer = ("embed", "final_norm", "unembed")
    return {g.name: g for g in _gathers(cfg, weights_type(cfg.model), outer)}


def _microbatch_rows(cfg: Config) -> int:
    """Rows of one microbatch in the global batch (``batch / microbatches``)."""
    return cfg.train.batch_size // cfg.train.microbatches


def moe_tokens_per_device(cfg: Config) -> int:
    """T, the tokens one device routes per microbatch: its rows ``'B/dp'`` times its
    positions ``'L/c'`` (every t shard routes the same tokens: the MoE block gathers the
    residual over t before its norm)."""
    sizes = cfg.mesh.sizes()
    rows = _microbatch_rows(cfg) // group_size(sizes, "dp")  # 'B/dp'
    return rows * (cfg.train.seq_len // sizes["c"])


def moe_buffer_bytes(cfg: Config) -> int:
    """Bytes of one of an MoE layer's exchange buffers ``[e, C, M]`` on one device
    (:func:`seqshard.model.moe.buffer_bytes`); 0 without experts."""
    if not runs(cfg.model, MOE):
        return 0
    return buffer_bytes(cfg.model, moe_tokens_per_device(cfg), cfg.mesh.sizes()["e"])


def memory_plan(cfg: Config, attention_impl: str, platform: str = "gpu") -> MemoryPlan:
    """Peak bytes per device of a training step of ``cfg`` (mesh resolved), with attention run
    as ``attention_impl`` (``einsum``, ``cudnn``, ``splash``, ``xla``), on ``platform``
    (``gpu``, ``tpu``, ``cpu``: how it runs the experts' grouped matmuls)."""
    if cfg.mesh.sizes()["p"] > 1:
        return _pipelined_memory_plan(cfg, attention_impl)
    m, train = cfg.model, cfg.train
    d, e, c, t = (cfg.mesh.sizes()[a] for a in ("d", "e", "c", "t"))
    micro = _microbatch_rows(cfg)
    base = memory_per_device(
        m, d=d, t=t, batch=micro, seq_len=train.seq_len, c=c, e=e, optimizer=train.optimizer
    )
    accumulate = train.microbatches > 1

    table, copy = _head_table(cfg)
    # Hoisted out of the accumulation loop, the gathered embed and unembed tables (and a
    # transposed copy) live through every microbatch.
    hoisted = 2 * table + copy if accumulate else 0
    head = (0 if accumulate else table + copy) + table  # gathered, transposed, gradient
    activations, layer = 0, 0
    for s in stacks(m):
        lb = layer_bytes(m, d=d, t=t, batch=micro, seq_len=train.seq_len, c=c, e=e, blocks=s.blocks)
        kept, working = _layer_memory(cfg, attention_impl, s.name, lb, s.n_layers, platform)
        activations, layer = activations + kept, max(layer, working)
    return MemoryPlan(
        weights=base.weights,
        grads=base.grads * (2 if accumulate else 1),
        optimizer=base.optimizer,
        activations=activations,
        logits=2 * base.logits,
        transient=hoisted + max(head, layer),
    )


def _head_table(cfg: Config) -> tuple[int, int]:
    """(bytes of the gathered unembedding 'V/t M' in compute dtype, of its transposed copy)."""
    outer = _outer_gathers(cfg)
    table = outer["unembed"].gathered_bytes
    return table, table if outer["unembed"].minor else 0


def _layer_memory(
    cfg: Config, attention_impl: str, stack: str, lb, n_layers: int, platform: str = "gpu"
) -> tuple[int, int]:
    """(what ``n_layers`` layers of ``stack`` keep for the backward, less the probabilities
    fused attention never keeps; one such layer's backward working set), for layers of
    activations ``lb`` (:func:`~seqshard.model.cost.layer_bytes`)."""
    m, c = cfg.model, cfg.mesh.sizes()["c"]
    blocks = _stack(cfg, stack).blocks
    activations = n_layers * saved_bytes(m, lb, c, blocks)
    gathered = _layer_gathers(cfg, stack)
    weight_grads = sum(g.gathered_bytes for g in gathered)  # before their reduce-scatters
    copies = sum(g.gathered_bytes for g in gathered if g.minor)
    everything = saved_bytes(dataclasses.replace(m, remat="none"), lb, c, blocks)
    rebuilt = everything - saved_bytes(m, lb, c, blocks)  # re-run in the backward
    # Flash kernels and the ring (c > 1) never hold the probabilities, to keep or to rebuild.
    probs = lb.get("probs", 0)  # f32 'b K/t Q L L' (einsum attention only)
    fused = attention_impl in FUSED_ATTENTION or m.ring_over(c)
    if fused:  # flash attention never holds the probabilities, to keep or to rebuild
        rebuilt -= min(rebuilt, probs)
        if m.remat == "none":
            activations -= n_layers * probs
    probs_elements = probs // 4
    # One f32 gradient of the scores at a time: softmax's backward turns d probs into
    # d scores elementwise.
    score_grads = 0 if fused else 4 * probs_elements
    exchange = _exchange_working_set(cfg, platform) if MOE in blocks else 0
    return activations, rebuilt + weight_grads + copies + score_grads + exchange


def _exchange_working_set(cfg: Config, platform: str) -> int:
    """What an MoE layer's exchange holds in its backward, beyond its declared activations
    (the block is re-run whole, :mod:`seqshard.model.moe`): :data:`MOE_EXCHANGE_BUFFERS` of
    the fixed ``[e, C, M]`` buffers, sized for the worst case when dropless whatever the
    routing. On CPU the grouped matmuls walk row tiles (:mod:`seqshard.shardlib.matmul`),
    holding :data:`CPU_TILE_BUFFERS` more buffers and :data:`CPU_EXPERT_COPIES` f32 copies of
    one projection's local experts (GPU and TPU run grouped kernels: none)."""
    buffer = moe_buffer_bytes(cfg)
    walk = 0
    if platform == "cpu":
        moe, sizes = cfg.model.moe, cfg.mesh.sizes()
        experts = 4 * (moe.n_experts // sizes["e"]) * cfg.model.d_model * (moe.d_ff // sizes["t"])
        walk = CPU_TILE_BUFFERS * buffer + CPU_EXPERT_COPIES * experts
    return MOE_EXCHANGE_BUFFERS * buffer + walk


def _pipelined_memory_plan(cfg: Config, attention_impl: str) -> MemoryPlan:
    """The peak of a pipelined step (mesh.p > 1, :mod:`seqshard.model.pipeline.pipelined`): each stage
    holds L/p layers; a microbatch has b = batch / (d·m) rows.

    * gpipe, circular (v blocks): autodiff of the tick loop keeps, for every forward tick
      (v·m + p - 1), what ``remat`` keeps of the block's L/(p·v) layers; plus the embedded
      inputs and the last stage's outputs, m residual blocks each.
    * 1f1b: the stashed stage inputs (at most 2p - 1 residual blocks), one stage's kept
      activations (the vjp in flight), and the inputs and their gradients (m blocks each).

    Logits and the transient working set are one microbatch's (the head runs per microbatch,
    rematerialized); the gradients accumulate in place (no extra buffer)."""
    m, train, sizes = cfg.model, cfg.train, cfg.mesh.sizes()
    p, d, c, t = (sizes[a] for a in ("p", "d", "c", "t"))
    k = train.microbatches
    schedule = train.pipeline().on(p)
    micro = train.batch_size // k
    lb = layer_bytes(m, d=d, t=t, batch=micro, seq_len=train.seq_len, c=c)
    per_layer, layer = _layer_memory(cfg, attention_impl, "layers", lb, 1)
    rows = micro // d
    block = rows * (train.seq_len // c) * m.d_model // t * m.compute_bytes
    stage_layers = m.n_layers // p
    # The stage's weights do not change from tick to tick: differentiating GPipe's tick scan,
    # JAX computes what depends on them alone (their gathers) once, before the loop, so the
    # stage's gathered layers stay alive through it. 1F1B gathers them each tick; its vjp
    # holds them as residuals (counted the same: 1F1B's peak measured 0.97-1.00 of XLA's).
    hoisted = stage_layers * sum(g.gathered_bytes for g in _layer_gathers(cfg))
    if schedule.name == "1f1b":
        activations = min(k, 2 * p - 1) * block + stage_layers * per_layer + 2 * k * block
    else:
        v = schedule.v
        forward_ticks = v * k + p - 1
        activations = forward_ticks * (stage_layers // v) * per_layer + 2 * k * block
    activations += hoisted
    weights = param_bytes_per_device(m, sizes)
    table, copy = _head_table(cfg)
    logits = 4 * rows * (train.seq_len // c) * (m.vocab // t)
    return MemoryPlan(
        weights=weights,
        grads=weights,
        optimizer=optimizer_bytes_per_device(m, sizes, train.optimizer),
        activations=activations,
        logits=2 * logits,
        transient=max(2 * table + copy, layer),
    )


# ---------------------------------------------------------------------------------------------
# The plan


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """A change of config (dotted overrides) and its plan, which fits."""

    overrides: tuple[str, ...]
    plan: Plan


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a training step of ``config`` costs on ``n_devices`` ``chip`` devices."""

    config: Config  # mesh resolved
    chip: hardware.Chip
    n_devices: int
    attention_impl: str  # what model.attention_impl runs as on this chip
    memory: MemoryPlan
    collectives: tuple[PlannedCollective, ...]
    model_flops: float  # per step, all devices (the numerator of MFU)
    hardware_flops: float  # per step, all devices: model FLOPs plus remat's recompute
    link_by_axis: Mapping[str, str]  # axis key -> the link it crosses, e.g. 'InfiniBand'
    bandwidth_by_axis: Mapping[str, float]  # axis key -> bytes/s per device
    suggestion: Suggestion | None = None  # when it does not fit: the fastest change that does
    suggestion_note: str = ""  # why there is none, when there is none
    pipelined_compute_s: float | None = None  # mesh.p > 1: the stages' ticks, bubble included
    routed_flops: float = 0.0  # per step, all devices: the routed experts' share of hardware_flops
    imbalance: float = 1.0  # the busiest expert shard's copies over the mean (MOE_IMBALANCE)
    fp8_flops: float = 0.0  # per step, all devices: the FP8 projections' share (model.fp8)

    # -- memory --
    @property
    def bytes_per_device(self) -> int:
        return self.memory.total

    @property
    def usable_bytes(self) -> float:
        return self.chip.usable_bytes

    @property
    def fits(self) -> bool:
        return self.bytes_per_device <= self.usable_bytes

    @property
    def excess_bytes(self) -> float:
        """How far the plan is over the usable memory (0 when it fits)."""
        return max(0.0, self.bytes_per_device - self.usable_bytes)

    # -- communication --
    @property
    def comm_bytes_by_axis(self) -> dict[str, float]:
        """Bytes one device sends per step, by the mesh axes of the collectives ('d', 't', 't/d')."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.axis_key] = out.get(c.axis_key, 0.0) + c.bytes_per_step
        return out

    def _seconds(self, c: PlannedCollective) -> float:
        return c.bytes_per_step / self.bandwidth_by_axis[c.axis_key]

    @property
    def comm_time_by_axis(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.axis_key] = out.get(c.axis_key, 0.0) + self._seconds(c)
        return out

    @property
    def exposed_comm_s(self) -> float:
        """Activation collectives: on the critical path between dependent matmuls."""
        return sum(self._seconds(c) for c in self.collectives if not c.weights)

    @property
    def overlapped_comm_s(self) -> float:
        """Weight collectives: independent of the matmuls around them."""
        return sum(self._seconds(c) for c in self.collectives if c.weights)

    # -- time --
    @property
    def busiest_shard_load(self) -> float:
        """The busiest expert shard's routed work over the mean: :attr:`imbalance`, capped by
        ``moe.capacity_factor`` when it drops copies (1 without experts)."""
        moe = self.config.model.moe
        if not runs(self.config.model, MOE):
            return 1.0
        return min(self.imbalance, moe.capacity_factor) if moe.capacity_factor else self.imbalance

    @property
    def fp8_speedup(self) -> float:
        """The compute time without FP8 over the time with it: the FP8 projections' FLOPs at
        the chip's FP8 peak (:attr:`seqshard.hardware.Chip.fp8_peak`), the rest at bf16's."""
        if not self.fp8_flops:
            return 1.0
        other = self.hardware_flops - self.fp8_flops
        with_fp8 = other + self.fp8_flops * self.chip.peak_flops / self.chip.fp8_peak
        return self.hardware_flops / with_fp8

    @property
    def compute_s(self) -> float:
        """The hardware FLOPs at peak (the FP8 projections' at the FP8 peak); the routed
        experts' on the busiest shard (every device waits for it at the return exchange)."""
        if self.pipelined_compute_s is not None:
            return self.pipelined_compute_s / self.fp8_speedup
        flops = self.hardware_flops + (self.busiest_shard_load - 1) * self.routed_flops
        return flops / (self.n_devices * self.chip.peak_flops) / self.fp8_speedup

    @property
    def step_time_s(self) -> float:
        busy = self.compute_s + self.exposed_comm_s
        if self.config.runtime.overlap_collectives:
            return max(busy, self.overlapped_comm_s)
        return busy + self.overlapped_comm_s

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_time_s * self.n_devices * self.chip.peak_flops)

    @property
    def tokens_per_s(self) -> float:
        return self.config.train.batch_size * self.config.train.seq_len / self.step_time_s

    @property
    def bound(self) -> str:
        """What dominates the step: 'compute' or 'communication over <axes> (<link>)'."""
        terms = {"compute": self.compute_s}
        for axis, s in self.comm_time_by_axis.items():
            terms[f"communication over {axis} ({self.link_by_axis[axis]})"] = s
        return max(terms, key=terms.get)

    # -- report --
    def verdict(self) -> str:
        """``'fits: ...'`` or ``'does not fit: ...'``, with the numbers."""
        ch = self.chip
        need = format_bytes(self.bytes_per_device)
        usable = (
            f"{format_bytes(self.usable_bytes)} usable ({format_bytes(ch.hbm_bytes)} x "
            f"{ch.usable_fraction:g}: {ch.usable_note})"
        )
        if self.fits:
            return f"fits: {need} per device of {usable}"
        gib = self.excess_bytes / 2**30
        return f"does not fit: {need} per device, {gib:.2f} GiB more than the {usable}"


def _pipelined_compute_s(cfg: Config, n_devices: int, peak: float) -> float | None:
    """The compute time of a pipelined step (mesh.p > 1; None otherwise): the critical path
    through the ticks, every stage working (or masked) in every tick.

    Per device and microbatch: F and B, a stage's layers forward and backward (remat's
    recompute in B), 1/(p·m) of the step's layer FLOPs per device; H, the head forward and
    backward on the last stage only (1/m of its per-device FLOPs, split over d, c, t).
    gpipe and circular: (v·m + p - 1) forward ticks of F/v and as many backward ticks of B/v,
    then the m heads between them; 1f1b: m + 2(p - 1) ticks of F, the backward's own forward
    (the stage's vjp runs it again), B and H."""
    sizes, train, m = cfg.mesh.sizes(), cfg.train, cfg.model
    p = sizes["p"]
    if p == 1:
        return None
    tokens = train.batch_size * train.seq_len
    hw = hardware_flops_per_token(m, train.seq_len)
    head_forward = matmul_flops_per_token(m, train.seq_len).lm_head
    k = train.microbatches
    per_micro = tokens / (k * n_devices)  # tokens one device holds of a microbatch, times p
    layers_forward = (hw.forward - head_forward) * per_micro
    layers_backward = (hw.backward + hw.recompute - 2 * head_forward) * per_micro
    head = 3 * head_forward * per_micro * p  # forward and backward, split over d, c, t only
    schedule = train.pipeline().on(p)
    if schedule.name == "1f1b":
        ticks = k + 2 * (p - 1)
        flops = ticks * (2 * layers_forward + layers_backward + head)
    else:
        v = schedule.v
        ticks = v * k + p - 1
        flops = ticks * (layers_forward + layers_backward) / v + k * head
    return flops / peak


def _routed_flops(cfg: Config) -> int:
    """The routed experts' FLOPs of a step (:data:`seqshard.model.moe.ROUTED_OPS`: forward,
    backward and remat's recompute), all devices; 0 without experts."""
    if not runs(cfg.model, MOE):
        return 0
    train = cfg.train
    s = step_flops(cfg.model, batch=train.batch_size, seq_len=train.seq_len)
    return s.sum(names=ROUTED_OPS)


def _links(cfg: Config, ch: hardware.Chip, n_devices: int, keys: Iterable[str]):
    """The link each axis key crosses and its bandwidth per device."""
    mesh = cfg.mesh.sizes()
    link = {a.name: a.link for a in MESH_AXES}
    inner_axes = [
        a for a in mesh if link[a] == "inner"
    ]  # innermost last, as training_mesh lays them
    links, bandwidths = {}, {}
    for key in keys:
        axes = key.split("/")
        # An outer axis (p, d) spans every device's domain; inner ones (c, t) stay inside a
        # fast domain while the inner axes from this key's outermost one inward fit one.
        spans = any(link[a] == "outer" for a in axes)
        mine = [inner_axes.index(a) for a in axes if link[a] == "inner"]
        inner = math.prod(mesh[a] for a in inner_axes[min(mine) :]) if mine else 1
        crosses = (spans and n_devices > ch.fast_domain_chips) or inner > ch.fast_domain_chips
        if crosses:
            if ch.slow_bytes_per_s is None:
                raise ValueError(
                    f"mesh {cfg.mesh.describe()} on {n_devices} {ch.name} chips runs collectives "
                    f"over {key} across more than {ch.fast_domain_chips} chips ({ch.slow_link}), "
                    f"for which seqshard/hardware.py has no bandwidth figure. Plan for at most "
                    f"{ch.fast_domain_chips} chips, or add the figure with its source."
                )
            links[key], bandwidths[key] = ch.slow_link, ch.slow_bytes_per_s
        else:
            links[key], bandwidths[key] = ch.fast_link, ch.fast_bytes_per_s
    return links, bandwidths


def _fp8_flops(cfg: Config) -> int:
    """The FP8 projections' FLOPs of a step (forward, backward, recompute), all devices; 0
    with model.fp8=none."""
    train = cfg.train
    return step_flops(cfg.model, batch=train.batch_size, seq_len=train.seq_len).sum(fp8=True)


def plan(
    cfg: Config,
    n_devices: int,
    chip: str,
    *,
    suggest: bool = True,
    imbalance: float = MOE_IMBALANCE,
) -> Plan:
    """The plan of one training step of ``cfg`` on ``n_devices`` devices of ``chip``
    (a name in :data:`seqshard.hardware.CHIPS`); mesh sizes of -1 resolve against
    ``n_devices``. Needs no devices and compiles nothing. Raises ValueError (ConfigError)
    for an unknown chip or a config that cannot run on that many devices.

    ``suggest``: when it does not fit, also plan the candidate changes (see the module
    docstring) and attach the fastest one that fits. ``imbalance``: with experts, the busiest
    expert shard's token copies over the mean (:data:`MOE_IMBALANCE`)."""
    if not imbalance >= 1:
        raise ValueError(
            f"imbalance must be >= 1 (the busiest shard over the mean), got {imbalance!r}."
        )
    ch, cfg, impl, memory = _memory_on(cfg, n_devices, chip)
    m, train = cfg.model, cfg.train
    calls = tuple(collectives_per_step(cfg))
    tokens = train.batch_size * train.seq_len
    links, bandwidths = _links(cfg, ch, n_devices, {c.axis_key for c in calls})
    result = Plan(
        config=cfg,
        chip=ch,
        n_devices=n_devices,
        attention_impl=impl,
        memory=memory,
        collectives=calls,
        model_flops=float(flops_per_token(m, train.seq_len).total * tokens),
        hardware_flops=float(hardware_flops_per_token(m, train.seq_len).total * tokens)
        + newton_schulz_flops(m, train.newton_schulz_steps),
        link_by_axis=links,
        bandwidth_by_axis=bandwidths,
        pipelined_compute_s=_pipelined_compute_s(cfg, n_devices, ch.peak_flops),
        routed_flops=float(_routed_flops(cfg)),
        imbalance=imbalance if runs(m, MOE) else 1.0,
        fp8_flops=float(_fp8_flops(cfg)),
    )
    if result.fits or not suggest:
        return result
    found = _cheapest_fitting_change(cfg, n_devices, chip)
    if found is None:
        note = f"no change of mesh (same {n_devices} devices), remat or microbatches would fit; "
        more = _more_devices(cfg, n_devices, chip)
        if more is None:
            note += (
                "nor would more devices, as far as train.batch_size splits over their d "
                "(up to 64x)."
            )
        else:
            n, p = more
            change = p.suggestion.overrides if p.suggestion else ()
            note += f"{n} devices would: --devices {n} " + " ".join(
                (f"mesh.d={p.config.mesh.d}", *change)
            )
        return dataclasses.replace(result, suggestion_note=note)
    return dataclasses.replace(result, suggestion=found)


def _more_devices(cfg: Config, n_devices: int, chip: str) -> tuple[int, Plan] | None:
    """The fewest devices, up to 64x, on which ``cfg`` (more d, same t and batch) fits, with
    the cheapest change if one is needed: (devices, their plan)."""
    for factor in (2, 4, 8, 16, 32, 64):
        n = n_devices * factor
        bigger = _apply(cfg, {"mesh.d": cfg.mesh.d * factor})
        if bigger is None:  # the batch no longer splits over d
            return None
        try:
            p = plan(bigger, n, chip)
        except ValueError:  # e.g. no bandwidth figure for the links that many chips cross
            return None
        if p.fits or p.suggestion is not None:
            return n, p
    return None


# ---------------------------------------------------------------------------------------------
# What would fit


def _candidate_changes(cfg: Config, n_devices: int) -> dict[str, list[dict[str, object]]]:
    """Per kind of change, the alternatives to try (dotted key -> value)."""
    mesh = cfg.mesh.sizes()
    t, k = mesh["t"], cfg.train.microbatches
    c = mesh["c"]
    meshes = [
        {"mesh.d": n_devices // (mesh["p"] * c * t2), "mesh.t": t2}
        for t2 in range(t - 1, 0, -1)
        if t % t2 == 0  # more d through a smaller t, on the same devices
    ]
    # Long sequences: more c (the sequence split further) through a smaller d.
    meshes += [{"mesh.d": mesh["d"] // k, "mesh.c": c * k} for k in (2, 4, 8) if mesh["d"] % k == 0]
    remat = [{"model.remat": "full"}] if cfg.model.remat != "full" else []
    rows = cfg.train.batch_size
    micro = [
        {"train.microbatches": k2}
        for k2 in (k * 2**i for i in range(1, 12))
        if k2 <= rows and rows % k2 == 0
    ]
    return {"mesh": meshes, "remat": remat, "microbatches": micro}


def _apply(cfg: Config, change: Mapping[str, object]) -> Config | None:
    """``cfg`` with dotted ``change``s, or None if the result is not a valid config."""
    sections = {}
    for key, value in change.items():
        section, field = key.split(".")
        sections.setdefault(section, {})[field] = value
    new = cfg
    for section, fields in sections.items():
        new = dataclasses.replace(
            new, **{section: dataclasses.replace(getattr(new, section), **fields)}
        )
    try:
        check_config(new)
    except (ConfigError, ValueError):
        return None
    return new


def _memory_on(cfg: Config, n_devices: int, chip: str):
    """(the chip, ``cfg`` resolved on ``n_devices``, its attention implementation there, the
    memory plan): what :func:`plan` needs before it traces the step."""
    ch = hardware.chip(chip)
    cfg = target_config(cfg, n_devices)
    impl = attention_impl_on(cfg.model.attention_impl, ch.platform, cfg.model.attention_mask)
    return ch, cfg, impl, memory_plan(cfg, impl, ch.platform)


def _fits_in_memory(cfg: Config, n_devices: int, chip: str) -> bool:
    """:attr:`Plan.fits` from the memory plan alone: what a step of ``cfg`` needs per device
    against ``chip``'s usable memory, without tracing the step for its collectives."""
    ch, _, _, memory = _memory_on(cfg, n_devices, chip)
    return memory.total <= ch.usable_bytes


def _cheapest_fitting_change(cfg: Config, n_devices: int, chip: str) -> Suggestion | None:
    """Of the candidate changes, alone and then combined, the fastest one that fits."""
    kinds = _candidate_changes(cfg, n_devices)
    names = [k for k in kinds if kinds[k]]
    for size in range(1, len(names) + 1):
        fitting = []
        for combo in itertools.combinations(names, size):
            for parts in itertools.product(*(kinds[k] for k in combo)):
                change = {key: v for part in parts for key, v in part.items()}
                new = _apply(cfg, change)
                if new is None or not _fits_in_memory(new, n_devices, chip):
                    continue  # no trace of the step for a change that cannot fit
                p = plan(new, n_devices, chip, suggest=False)
                if p.fits:
                    overrides = tuple(f"{key}={v}" for key, v in change.items())
                    fitting.append(Suggestion(overrides, p))
        if fitting:  # fewer changes first; among those, the fastest step
            return min(fitting, key=lambda s: s.plan.step_time_s)
    return None


def describe_memory(memory: MemoryPlan) -> list[str]:
    """``'  weights   1.00 GiB'`` lines, for ``seqshard show``."""
    lines = [f"  {name:<12}{format_bytes(v):>12}" for name, v in memory.as_dict().items()]
    return [*lines, f"  {'total':<12}{format_bytes(memory.total):>12}"]
