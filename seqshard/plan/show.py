"""``seqshard show``: what a config means on its mesh, read off the types and the compiled step.

Resolved config; parameter count; each weight's global and per-device shape and layout;
the FLOPs of a training step by operation (:func:`flops_table`) and per token (MFU's); every
collective of the step predicted from the notation, per phase and per layer, without
compiling (:func:`predicted_comm_report`); the
planner's bytes per device (:mod:`seqshard.plan.planner`: weights, grads,
optimizer state, activations, logits, the largest transient); with a chip, the planner's
whole plan for it (FLOPs and communication per step, roofline step time and MFU, and whether
it fits); and, from the train step compiled for the config's mesh (nothing runs, nothing is
allocated), every collective per step with its axes, calls and bytes, and XLA's own memory
figures.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from seqshard.batch import batch_structs
from seqshard.config import Config, config_to_yaml
from seqshard.model.cost import (
    PHASES,
    flops_per_token,
    hardware_flops_per_token,
    param_counts,
    step_flops,
)
from seqshard.model.layers import runs, stacks
from seqshard.model.moe import MOE, capacity
from seqshard.model.weights import weight_structs, weights_type
from seqshard.plan.planner import (
    FUSED_ATTENTION,
    Plan,
    describe_memory,
    memory_plan,
    moe_buffer_bytes,
    moe_tokens_per_device,
    plan,
)
from seqshard.plan.step_comms import PHASES as COMM_PHASES
from seqshard.plan.step_comms import (
    PlannedCollective,
    collectives_per_step,
    format_planned_table,
)
from seqshard.shardlib.axes import group_size
from seqshard.shardlib.comms import Collective, collectives, format_comm_table
from seqshard.shardlib.shardtypes import block_shape, type_tree
from seqshard.shardlib.tables import format_bytes, format_table

__all__ = [
    "context_report",
    "describe",
    "flops_table",
    "format_plan",
    "moe_report",
    "parameters_line",
    "pipeline_report",
    "pipeline_shifts",
    "weight_table",
]


def _shape(s) -> str:
    return "[" + ", ".join(map(str, s)) + "]"


def weight_table(cfg: Config) -> list[tuple[str, str, str, str, str]]:
    """(name, type, global shape, per-device shape, PartitionSpec) per weight the config has
    (a zero-size one, such as q_norm without model.qk_norm, is left out)."""
    sizes, axes = cfg.model.dim_sizes(), cfg.mesh.sizes()
    rows = []
    for path, t in jax.tree_util.tree_flatten_with_path(
        type_tree(weights_type(cfg.model)),
        is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype_name"),
    )[0]:
        name = jax.tree_util.keystr(path).lstrip(".")
        if math.prod(t.global_shape(sizes)) == 0:
            continue
        rows.append(
            (
                name,
                repr(t),
                _shape(t.global_shape(sizes)),
                _shape(block_shape(t, sizes, axes)),
                str(t.partition_spec),
            )
        )
    return rows


def _scaled(n: float, units: tuple[tuple[str, float], ...]) -> str:
    """``n`` in three digits and the largest of ``units`` it reaches, exact below them all."""
    for unit, scale in units:
        if n >= scale:
            x = n / scale
            return f"{x:.{2 if x < 10 else 1 if x < 100 else 0}f} {unit}"
    return f"{int(n):,}"


def _count(n: float) -> str:
    """FLOPs in a table cell: ``-`` for none, exact below a million, else three digits and a
    unit: ``'2.10 M'``, ``'15.7 G'``, ``'563 T'``."""
    if n == 0:
        return "-"
    return _scaled(n, (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)))


def _params(n: int) -> str:
    """A parameter count as people write it: ``'675 B'``, ``'41.4 B'``, ``'1.79 M'``."""
    return _scaled(n, (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)))


def flops_table(cfg: Config) -> str:
    """The FLOPs of one training step of ``cfg`` by operation (:func:`seqshard.model.cost.step_flops`):
    forward, backward, remat's recompute and the optimizer update, each over the whole step
    (all devices), with the row's total on one device of the mesh; matmul and elementwise
    sums; attention's causal half; and the model FLOPs per token (the numerator of MFU)."""
    m, train = cfg.model, cfg.train
    muon_steps = train.newton_schulz_steps
    step = step_flops(
        m,
        batch=train.batch_size,
        seq_len=train.seq_len,
        microbatches=train.microbatches,
        newton_schulz_steps=muon_steps,
    )
    device = step.per_device(cfg.mesh.sizes())
    rows = [
        (op.name, op.kind + " fp8" * op.fp8, str(op.runs), *(_count(getattr(op, p)) for p in PHASES),
         _count(op.total), _count(dev.total))
        for op, dev in zip(step.ops, device.ops, strict=True)
    ]  # fmt: skip
    for name, kind in (("all", "matmul"), ("all", "elementwise"), ("total", None)):
        rows.append(
            (name, kind or "", "", *(_count(step.sum(p, kind)) for p in PHASES),
             _count(step.sum("total", kind)), _count(device.sum("total", kind)))
        )  # fmt: skip
    header = ("operation", "kind", "runs", *PHASES, "sum", "per device")
    length = train.seq_len
    causal = step_flops(
        m,
        batch=train.batch_size,
        seq_len=length,
        causal=True,
        microbatches=train.microbatches,
        newton_schulz_steps=muon_steps,
    )
    attention = [op.name for op in step.ops if op.per == "pair"]  # over (query, key) pairs
    model, hw = flops_per_token(m, length), hardware_flops_per_token(m, length)
    tokens = train.batch_size * length
    return "\n".join(
        [
            f"FLOPs per training step of {train.batch_size} x {length} tokens, all devices "
            f"(remat={m.remat}; matmuls 2 per multiply-add, elementwise 1 per add, multiply, "
            f"exp, ...; attention over all {length} x {length} (query, key) pairs; per device "
            f"on mesh {cfg.mesh.describe()}):",
            format_table(rows, header, right=frozenset(range(2, len(header)))),
            "  runs: per pass over the batch (a layer's operations once per layer); update: the "
            "optimizer step"
            + ("; matmul fp8: in FP8 (model.fp8)" if m.fp8 != "none" else "")
            + (
                f"; newton_schulz: Muon's {muon_steps} iterations on every weight matrix"
                if muon_steps
                else ""
            ),
            f"  attention's causal half only (the useful work: {length * (length + 1) // 2:,} of "
            f"{length * length:,} pairs per row): {', '.join(attention)} "
            f"{_count(causal.sum(names=attention))} of {_count(step.sum(names=attention))}; "
            f"step total {_count(causal.total)}",
            f"model FLOPs per token at seq_len {length} (the matmul rows, forward + backward, "
            f"for MFU): {model.total:,}; with remat={m.remat}'s recompute {hw.total:,}; per "
            f"step {_count(model.total * tokens)} (model), {_count(hw.total * tokens)} (with "
            f"recompute)",
        ]
    )


def predicted_comm_report(cfg: Config) -> str:
    """Every collective of a training step, predicted from the notation without compiling
    (:mod:`seqshard.plan.step_comms`), per phase and per layer."""
    m = cfg.model
    calls = collectives_per_step(cfg)
    head = (
        f"communication per train step, predicted from the notation (nothing compiled; mesh "
        f"{cfg.mesh.describe()}, per device, model.backward={m.backward}, remat={m.remat}, "
        f"{cfg.train.microbatches} microbatch(es); calls per step, per layer rows x "
        f"{m.n_layers} layers; bytes for ring algorithms):"
    )
    if not calls:
        return head + "\n  none: no mesh axis has more than one device"
    return head + "\n" + format_planned_table(calls, m.n_layers)


def parameters_line(cfg: Config) -> str:
    """The parameter count, without the embedding, and with experts the active parameters
    (what one token's forward reads: :func:`seqshard.model.cost.param_counts`)."""
    m = cfg.model
    n = param_counts(m)
    line = f"parameters: {n.total:,} ({n.total - n.embedding:,} without the embedding)"
    if runs(m, MOE):
        line += (
            f"; active per token {n.active:,} ({n.active - n.embedding:,} without the "
            f"embedding): the dense parts, {m.moe.top_k} of the {m.moe.n_experts} routed "
            f"experts ({n.routed:,} parameters in all) and {m.moe.n_shared} shared"
        )
    return line


def moe_report(cfg: Config) -> str:
    """The routed experts on the mesh: experts per device, the exchange buffers each MoE
    layer holds per device (fixed shapes: :func:`seqshard.model.moe.capacity`), and the
    all-to-all traffic of a step per mesh axis, predicted from the notation."""
    m, sizes = cfg.model, cfg.mesh.sizes()
    moe = m.moe
    if not runs(m, MOE):
        return "experts: none (model.moe.n_experts=0)"
    e, n_moe = sizes["e"], m.dim_sizes()["moe_layers"]
    tokens = moe_tokens_per_device(cfg)
    cap = capacity(m, tokens, e)
    buffer = moe_buffer_bytes(cfg)
    worst = f"T x min(top_k, E/e) = {tokens:,} x {min(moe.top_k, moe.n_experts // e)}"
    sizing = (
        f"dropless: C = {worst}, the worst case"
        if moe.capacity_factor == 0
        else f"C = ceil(capacity_factor x T x top_k / e) = ceil({moe.capacity_factor:g} x "
        f"{tokens:,} x {moe.top_k} / {e})"
    )
    if moe.capacity_factor and cap == tokens * min(moe.top_k, moe.n_experts // e):
        sizing = (
            f"capacity_factor {moe.capacity_factor:g} reaches the worst case: C = {worst}, dropless"
        )
    calls = [c for c in collectives_per_step(cfg) if c.kind == "all-to-all"]
    lines = [
        f"experts: {moe.n_experts} routed (top-{moe.top_k}, {moe.router} router, d_ff "
        f"{moe.d_ff}) + {moe.n_shared} shared, in {n_moe} of {m.n_layers} layers; "
        f"E/e = {moe.n_experts // e} experts per device (mesh.e={e})",
        f"  exchange buffers per device per MoE layer: send + receive 2 x e x C x M x "
        f"{m.compute_bytes} B = 2 x {e} x {cap:,} x {m.d_model} x {m.compute_bytes} B = "
        f"{format_bytes(2 * buffer)} (T = {tokens:,} tokens per device and microbatch; "
        f"{sizing}); the return exchange as much again",
    ]
    if not calls:
        lines.append("  all-to-all per step: none (mesh.e=1: every expert is local)")
        return "\n".join(lines)
    by_axis: dict[str, tuple[int, float]] = {}
    for c in calls:
        n, sent = by_axis.get(c.axis_key, (0, 0.0))
        by_axis[c.axis_key] = (n + c.calls, sent + c.bytes_per_step)
    for axis, (n, sent) in sorted(by_axis.items()):
        per_phase = {p: sum(c.calls for c in calls if c.phase == p and c.axis_key == axis)
                     for p in COMM_PHASES}  # fmt: skip
        lines.append(
            f"  all-to-all over {axis}: {n} per step ("
            + ", ".join(f"{p} {k}" for p, k in per_phase.items())
            + f"; the token rows and their expert ids, x {n_moe} MoE layers x "
            f"{cfg.train.microbatches} microbatch(es)), {format_bytes(sent)} sent per device"
        )
    return "\n".join(lines)


def context_report(cfg: Config) -> str:
    """The sequence split over c: for each ``model.context_impl``, what it moves per layer
    (predicted from the notation, :mod:`seqshard.plan.step_comms`) and the planner's per-device
    activation and peak memory (:mod:`seqshard.plan.planner`), side by side."""
    import dataclasses

    m, c = cfg.model, cfg.mesh.sizes()["c"]
    if c == 1:
        return (
            "context: mesh.c = 1, the sequence is not split (mesh.c=k splits each row k ways, "
            "'B/dp L@zigzag/c M/t', for sequences whose activations do not fit)"
        )
    impl = "einsum" if m.attention_impl == "auto" else m.attention_impl
    rows = []
    for strategy in ("allgather", "ring"):
        variant = dataclasses.replace(cfg, model=dataclasses.replace(m, context_impl=strategy))
        calls = [x for x in collectives_per_step(variant) if x.what.startswith("context:")]
        layer = [x for x in calls if x.in_layers]
        per_layer = {
            p: sum(x.bytes_per_step for x in layer if x.phase == p) / m.n_layers for p in PHASES
        }
        memory = memory_plan(variant, impl)
        rows.append(
            (
                strategy + (" *" if strategy == m.context_impl else ""),
                str(sum(x.calls for x in layer) // m.n_layers),
                format_bytes(per_layer["forward"]),
                format_bytes(per_layer["recompute"] + per_layer["backward"]),
                format_bytes(memory.activations),
                format_bytes(memory.total),
            )
        )
    head = (
        f"context: the sequence split over c = {c} ('B/dp L@zigzag/c', zigzag chunks i and "
        f"{2 * c - 1}-i per shard), per device; collectives and bytes sent per layer, from "
        f"the notation; memory from the planner (* model.context_impl):"
    )
    columns = ("context_impl", "collectives", "sent forward", "sent backward",
               "activations kept", "peak memory")  # fmt: skip
    return head + "\n" + format_table(rows, columns)


def predicted_vs_compiled(predicted: list[PlannedCollective], compiled: list[Collective]) -> str:
    """One line: the prediction from the notation (:mod:`seqshard.plan.step_comms`) against the
    compiled step's collectives (:mod:`seqshard.shardlib.comms`), calls and bytes per step, and what
    XLA adds in the optimizer update (its global gradient norm, no shardops call)."""
    model = [c for c in compiled if c.phase != "update"]
    update = [c for c in compiled if c.phase == "update"]
    calls = (sum(c.calls for c in predicted), sum(c.calls_per_step for c in model))
    sent = (
        sum(c.bytes_per_step for c in predicted),
        sum(c.calls_per_step * c.bytes_sent for c in model),
    )
    ratio = f"{sent[1] / sent[0]:.3f}" if sent[0] else "-"
    return (
        f"predicted from the notation vs compiled, forward + recompute + backward: {calls[0]} vs "
        f"{calls[1]} calls, {format_bytes(sent[0])} vs {format_bytes(sent[1])} sent per device "
        f"(compiled / predicted {ratio}; XLA's CPU backend runs bf16 collectives in f32, "
        f"doubling their compiled bytes); the update adds {sum(c.calls_per_step for c in update)} "
        f"all-reduce(s), {format_bytes(sum(c.calls_per_step * c.bytes_sent for c in update))}: "
        f"the optimizer's global gradient norm"
    )


def compiled_step_report(cfg: Config) -> str:
    """Collectives and XLA memory of the train step compiled for ``cfg``'s mesh."""
    from seqshard.mesh import training_mesh
    from seqshard.model.attention import resolve_impl
    from seqshard.train.optimizer import make_optimizer
    from seqshard.train.state import train_state_structs
    from seqshard.train.step import make_train_step

    mesh = training_mesh(cfg.mesh.sizes())
    opt = make_optimizer(cfg.train, cfg.model, mesh)
    compiled = (
        make_train_step(cfg, mesh, opt)
        .lower(
            train_state_structs(cfg.model, mesh, opt),
            batch_structs(cfg.train.batch_size, cfg.train.seq_len, mesh),
        )
        .compile()
    )
    found = collectives(compiled.as_text(), mesh)
    lines = [
        f"communication per train step, from the step compiled for mesh {cfg.mesh.describe()} "
        f"(per device; scanned layer bodies counted x{cfg.model.n_layers}; bytes for ring algorithms):",
        format_comm_table(found),
        predicted_vs_compiled(collectives_per_step(cfg), found),
    ]
    mem = compiled.memory_analysis()
    if mem is not None:
        impl = resolve_impl(cfg.model.attention_impl, cfg.model.attention_mask)
        planned = memory_plan(cfg, impl, jax.default_backend()).total
        peak = mem.argument_size_in_bytes + mem.temp_size_in_bytes
        lines += [
            "",
            "compiled memory per device (XLA memory_analysis): "
            f"arguments {format_bytes(mem.argument_size_in_bytes)}, outputs {format_bytes(mem.output_size_in_bytes)} "
            f"(aliased with donated arguments {format_bytes(mem.alias_size_in_bytes)}), "
            f"temporaries {format_bytes(mem.temp_size_in_bytes)}",
            f"  arguments + temporaries {format_bytes(peak)}; the planner's peak for attention as "
            f"{impl}: {format_bytes(planned)} ({planned / peak:.2f}x)",
        ]
    return "\n".join(lines)


def pipeline_shifts(cfg: Config) -> tuple[int, int]:
    """(ring_shifts over p per train step, bytes each sends per device) of a config with
    mesh.p > 1: each moves one microbatch's residual block (B/d/k rows, L/c/t or M/t split);
    each tick shifts once per kind it runs (1f1b: activations and cotangents every tick)."""
    import numpy as np

    m, train_cfg, sizes = cfg.model, cfg.train, cfg.mesh.sizes()
    schedule = train_cfg.pipeline().on(sizes["p"])
    rows = train_cfg.batch_size // (group_size(sizes, "dp") * train_cfg.microbatches)
    block = rows * train_cfg.seq_len * m.d_model // (sizes["c"] * sizes["t"])
    shifts = 2 * schedule.n_ticks if schedule.name == "1f1b" else schedule.n_ticks
    return shifts, block * np.dtype(m.compute_dtype).itemsize


def pipeline_report(cfg: Config) -> str:
    """The layers pipelined over p: the schedule as a tick x stage table, its bubble fraction,
    the microbatch inputs each stage holds at its peak, and what ``ring_shift`` over p moves
    per step (:mod:`seqshard.model.pipeline.schedule`; from the config alone)."""
    m, train_cfg, sizes = cfg.model, cfg.train, cfg.mesh.sizes()
    p = sizes["p"]
    if p == 1:
        return (
            "pipeline: mesh.p = 1, the layers are not pipelined (mesh.p=k splits them into k "
            "stages, 'layers/p', and runs train.microbatches microbatches through them)"
        )
    schedule = train_cfg.pipeline().on(p)
    k = train_cfg.microbatches
    rows = train_cfg.batch_size // (group_size(sizes, "dp") * k)
    shifts, block_bytes = pipeline_shifts(cfg)
    held = [schedule.max_in_flight(s) for s in range(p)]
    lines = [
        f"pipeline: {m.n_layers // p} layers on each of p = {p} stages ('layers/p'), "
        f"train.pipeline_schedule={schedule.name}, {k} microbatch(es) of {rows} rows per "
        f"device, {schedule.n_ticks} ticks; F3 = forward of microbatch 3, B3 its backward, "
        f". idle:",
        schedule.format_table(),
        f"bubble fraction: {schedule.bubble_fraction:.3f} (idle stage-slots / all)",
        "microbatch inputs held per stage at the peak: "
        + ", ".join(
            f"stage {s}: {n} ({format_bytes(n * block_bytes)})" for s, n in enumerate(held)
        ),
        f"ring_shift over p per step: {shifts} shifts of {format_bytes(block_bytes)} "
        f"(one microbatch's residual block per device) = {format_bytes(shifts * block_bytes)} "
        f"sent per device",
    ]
    return "\n".join(lines)


def describe(cfg: Config, compile_step: bool = True, chip: str | None = None) -> str:
    """The report of ``seqshard show`` for ``cfg`` (its mesh resolved). ``chip``: add the
    planner's plan for ``cfg.mesh.n_devices`` devices of that chip (seqshard.hardware.CHIPS).
    ``compile_step``: add the communication and memory of the compiled train step (needs the
    mesh's devices)."""
    m, train_cfg = cfg.model, cfg.train
    mesh = cfg.mesh.describe()
    parts = ["# resolved config", config_to_yaml(cfg).rstrip(), ""]
    parts.append(parameters_line(cfg))
    parts.append("")
    parts.append(f"weights on mesh {mesh} (f32 master copies):")
    parts.append(
        format_table(weight_table(cfg), ("weight", "type", "global", "per device", "PartitionSpec"))
    )
    parts.append("")
    parts.append(flops_table(cfg))
    parts.append("")
    parts.append(predicted_comm_report(cfg))
    parts.append("")
    parts.append(context_report(cfg))
    parts.append("")
    parts.append(pipeline_report(cfg))
    parts.append("")
    if runs(m, MOE):
        parts += [moe_report(cfg), ""]
    if chip is not None:
        parts.append(format_plan(plan(cfg, cfg.mesh.n_devices, chip)))
    else:
        # No target chip: attention 'auto' is counted as einsum, whose 'b L L Q K/t' scores
        # the fused kernels never hold (the larger figure; --chip names the target's kernel).
        impl = "einsum" if m.attention_impl == "auto" else m.attention_impl
        micro = train_cfg.batch_size // train_cfg.microbatches
        parts.append(
            f"estimated memory per device at the peak of a step (seqshard.plan.planner; microbatch of "
            f"{micro}, remat={m.remat}, attention as {impl}"
            + ("" if impl in FUSED_ATTENTION else ", scores materialized")
            + "; --chip NAME plans for a chip):"
        )
        parts += describe_memory(memory_plan(cfg, impl))
    if compile_step:
        parts += ["", compiled_step_report(cfg)]
    return "\n".join(parts)


# -- a plan on a chip -------------------------------------------------------------------------


def format_plan(p: Plan) -> str:
    """The plan as text: the target, memory, FLOPs, communication, roofline and verdict, a
    blank line between them (``seqshard show CONFIG --chip NAME``)."""
    sections = (
        _plan_target(p),
        _plan_memory(p),
        [_plan_flops(p)],
        _plan_communication(p),
        _plan_roofline(p),
        _plan_verdict(p),
    )
    return "\n\n".join("\n".join(lines) for lines in sections)


def _plan_target(p: Plan) -> list[str]:
    """The devices and mesh, the chip's figures, and how the step runs on them."""
    cfg, ch = p.config, p.chip
    train = cfg.train
    micro = train.batch_size // train.microbatches
    lines = [
        f"plan for {ch.describe_count(p.n_devices)}, mesh {cfg.mesh.describe()}"
        + (" -- nominal CPU figures, not a measurement" if ch.nominal else ""),
        f"  chip {ch.name}: {ch.peak_flops / 1e12:g} TFLOP/s dense bf16, "
        + (f"{ch.fp8_flops / 1e12:g} dense FP8, " if ch.fp8_flops else "")
        + f"{ch.hbm_bytes / 1e9:.4g} GB ({format_bytes(ch.hbm_bytes)}) memory; {ch.fast_link} "
        f"{ch.fast_bytes_per_s / 1e9:g} GB/s per chip within "
        f"{ch.fast_domain_chips if ch.fast_domain_chips < 1 << 20 else 'any number of'} "
        f"chips"
        + (
            f", {ch.slow_link} {ch.slow_bytes_per_s / 1e9:g} GB/s across"
            if ch.slow_bytes_per_s
            else ""
        ),
        f"  attention_impl={cfg.model.attention_impl} runs as {p.attention_impl}; "
        f"remat={cfg.model.remat}; {train.microbatches} microbatch"
        f"{'es' * (train.microbatches != 1)} of {micro} x {train.seq_len} tokens "
        f"({micro // group_size(cfg.mesh.sizes(), 'dp')} rows per device)",
    ]
    if cfg.model.fp8 != "none":
        lines.append(_fp8_line(p))
    moe = cfg.model.moe
    if runs(cfg.model, MOE):
        counts = param_counts(cfg.model)
        e = cfg.mesh.sizes()["e"]
        lines.append(
            f"  experts: {moe.n_experts // e} of {moe.n_experts} per device (e={e}), top-"
            f"{moe.top_k}; parameters {_params(counts.total)} total, "
            f"{_params(counts.active)} active per token (FLOPs and MFU on the active); "
            f"routed compute at the busiest shard's {p.busiest_shard_load:g} x the mean "
            f"(imbalance {p.imbalance:g}"
            + (f", capacity_factor {moe.capacity_factor:g}" if moe.capacity_factor else "")
            + ")"
        )
    stages = cfg.mesh.sizes()["p"]
    if stages > 1:
        schedule = train.pipeline().on(stages)
        lines.append(
            f"  pipeline: train.pipeline_schedule={schedule.name} over p={stages} stages of "
            f"{cfg.model.n_layers // stages} layers, bubble {schedule.bubble_fraction:.3f}"
        )
    return lines


def _fp8_line(p: Plan) -> str:
    """What model.fp8 runs in FP8, at what peak, and the FSDP gathers' bytes in e4m3."""
    cfg, ch = p.config, p.chip
    m = cfg.model
    names = [o.name for o in step_flops(m, batch=1, seq_len=1).ops if o.fp8]
    peak = (
        f"at {ch.fp8_flops / 1e12:g} TFLOP/s dense FP8"
        if ch.fp8_flops
        else f"no FP8 units on {ch.name}: at its bf16 peak"
    )
    gathers = [c for c in p.collectives if c.dtype.startswith("float8")]
    sent = sum(c.bytes_per_step for c in gathers)
    if gathers:
        gathered = (
            f"{sum(c.calls for c in gathers)} weight gathers a step in e4m3, "
            f"{format_bytes(sent)} sent per device (bf16: {format_bytes(2 * sent)})"
        )
    else:
        whole = _fp8_weight_elements(m)
        gathered = (
            f"no weight gathers on this mesh; FSDP gathers those weights in e4m3, "
            f"{format_bytes(whole)} all layers (bf16: {format_bytes(2 * whole)})"
        )
    return (
        f"  model.fp8={m.fp8}: {', '.join(names)} multiply e4m3 operands (gradients e5m2), "
        f"{_flops(p.fp8_flops)} of {_flops(p.hardware_flops)} {peak} (compute "
        f"{p.fp8_speedup:.2f}x faster than bf16's); {gathered}"
    )


def _fp8_weight_elements(m) -> int:
    """The elements of the layer weights the blocks put on e4m3's grid (their FP8 sites that
    are weights), all layers: one byte each in an FP8 gather."""
    structs = weight_structs(m)
    total = 0
    for stack in stacks(m):
        fields = {f.name for f in dataclasses.fields(stack.layer_type)}
        layers = getattr(structs, stack.name)
        for block in stack.blocks:
            for site in block.fp8_sites:
                if site in fields:
                    total += math.prod(getattr(layers, site).shape)
    return total


def _plan_memory(p: Plan) -> list[str]:
    """Each part of the peak bytes per device, with what it holds, and their total."""
    cfg = p.config
    stages = cfg.mesh.sizes()["p"]
    accumulated = cfg.train.microbatches > 1 and stages == 1
    notes = {
        "weights": "f32 master weights" + (", this stage's layers" if stages > 1 else ""),
        "grads": "f32" + (", and their accumulation buffer" if accumulated else ""),
        "optimizer": (
            "Muon momentum of the matrices, AdamW moments of the rest, f32"
            if cfg.train.optimizer == "muon"
            else "AdamW moments, f32"
        ),
        "activations": f"kept for the backward pass by remat={cfg.model.remat}, "
        + ("the stage's layers in flight, gathered stage weights" if stages > 1 else "all layers"),
        "logits": "f32 logits and their gradient",
        "transient": "the LM head's or one layer's backward working set",
    }
    lines = ["memory per device (peak of a step):"]
    for name, value in p.memory.as_dict().items():
        lines.append(f"  {name:<12}{format_bytes(value):>12}  {notes[name]}")
    lines.append(f"  {'total':<12}{format_bytes(p.bytes_per_device):>12}")
    return lines


def _plan_flops(p: Plan) -> str:
    muon = " and Muon's Newton-Schulz" if p.config.train.optimizer == "muon" else ""
    return (
        f"FLOPs per step: {_flops(p.model_flops)} model, {_flops(p.hardware_flops)} "
        f"with remat's recompute{muon} ({_flops(p.hardware_flops / p.n_devices)} per device)"
    )


def _flops(n: float) -> str:
    """``3.2e15 -> '3.20 PFLOP'``."""
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n / 1e6:,.2f} MFLOP"


def _plan_communication(p: Plan) -> list[str]:
    """The bytes each device sends per step over each mesh axis, and how long they take."""
    lines = ["communication per step, bytes each device sends (ring algorithms):"]
    times = p.comm_time_by_axis
    for axis, sent in sorted(p.comm_bytes_by_axis.items()):
        lines.append(
            f"  over {axis:<4}{format_bytes(sent):>12}  {p.link_by_axis[axis]} "
            f"{p.bandwidth_by_axis[axis] / 1e9:g} GB/s: {times[axis] * 1e3:,.2f} ms"
        )
    if not p.collectives:
        lines.append("  none (one device, or every axis of size 1)")
    return lines


def _plan_roofline(p: Plan) -> list[str]:
    """The step time from compute and the collectives, tokens/s, MFU, and what bounds it."""
    overlap = p.config.runtime.overlap_collectives
    return [
        "roofline: step = "
        + (
            "max(compute + activation collectives, weight collectives)"
            if overlap
            else "compute + all collectives (runtime.overlap_collectives is off)"
        ),
        f"  compute {p.compute_s * 1e3:,.2f} ms, activation collectives "
        f"{p.exposed_comm_s * 1e3:,.2f} ms, weight collectives "
        f"{p.overlapped_comm_s * 1e3:,.2f} ms",
        f"  estimated step time {p.step_time_s * 1e3:,.2f} ms, "
        f"{p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}"
        + (" of the bf16 peak (the FP8 projections run at up to the FP8 peak)" * bool(p.fp8_flops))
        + f"; bound: {p.bound}",
        "  (a roofline: every matmul at peak, no kernel or launch overhead, so a floor on the "
        "step time; on one H200 seqshard's 1B ran at 50% MFU, its 125M at 39% "
        "(docs/benchmarks.md): scripts/bench_gpu.py prints this estimate beside its measurement)",
    ]


def _plan_verdict(p: Plan) -> list[str]:
    """Whether it fits, and if not the cheapest change that would (or why there is none)."""
    lines = [f"verdict: {p.verdict()}"]
    if p.suggestion is not None:
        s = p.suggestion.plan
        lines.append(
            f"cheapest change that would fit: {' '.join(p.suggestion.overrides)} "
            f"({format_bytes(s.bytes_per_device)} per device, step {s.step_time_s * 1e3:,.2f} "
            f"ms, MFU {s.mfu:.1%})"
        )
    elif p.suggestion_note:
        lines.append(p.suggestion_note)
    return lines
