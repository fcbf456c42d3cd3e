"""``seqshard show``: what a config means on its mesh, read off the types and the compiled step.

Resolved config; parameter count; each weight's global and per-device shape and layout;
FLOPs per token; the planner's bytes per device (:mod:`seqshard.planner`: weights, grads,
optimizer state, activations, logits, the largest transient); with a chip, the planner's
whole plan for it (FLOPs and communication per step, roofline step time and MFU, and whether
it fits); and, from the train step compiled for the config's mesh (nothing runs, nothing is
allocated), every collective per step with its axes, calls and bytes, and XLA's own memory
figures.
"""

from __future__ import annotations

import jax

from seqshard.batch import batch_structs
from seqshard.comms import collectives, format_comm_table
from seqshard.config import Config, config_to_yaml
from seqshard.flops import (
    flops_per_token,
    format_bytes,
    hardware_flops_per_token,
    matmul_flops_per_token,
)
from seqshard.model.weights import Weights, param_count
from seqshard.planner import FUSED_ATTENTION, describe_memory, memory_plan, plan
from seqshard.shardtypes import block_shape, type_tree

__all__ = ["describe", "weight_table"]


def _shape(s) -> str:
    return "[" + ", ".join(map(str, s)) + "]"


def weight_table(cfg: Config) -> list[tuple[str, str, str, str, str]]:
    """(name, type, global shape, per-device shape, PartitionSpec) per weight."""
    sizes, axes = cfg.model.dim_sizes(), cfg.mesh.sizes()
    rows = []
    for path, t in jax.tree_util.tree_flatten_with_path(
        type_tree(Weights), is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype_name")
    )[0]:
        name = jax.tree_util.keystr(path).lstrip(".")
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


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in (header, *rows)
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def compiled_step_report(cfg: Config) -> str:
    """Collectives and XLA memory of the train step compiled for ``cfg``'s mesh."""
    from seqshard.mesh import training_mesh
    from seqshard.model.attention import resolve_impl
    from seqshard.train.optimizer import make_optimizer
    from seqshard.train.state import train_state_structs
    from seqshard.train.step import make_train_step

    mesh = training_mesh(cfg.mesh.sizes())
    opt = make_optimizer(cfg.train)
    compiled = (
        make_train_step(cfg, mesh, opt)
        .lower(
            train_state_structs(cfg.model, mesh, opt),
            batch_structs(cfg.train.batch_size, cfg.train.seq_len, mesh),
        )
        .compile()
    )
    lines = [
        f"communication per train step, from the step compiled for mesh {cfg.mesh.describe()} "
        f"(per device; scanned layer bodies counted x{cfg.model.n_layers}; bytes for ring algorithms):",
        format_comm_table(collectives(compiled.as_text(), mesh)),
    ]
    mem = compiled.memory_analysis()
    if mem is not None:
        impl = resolve_impl(cfg.model.attention_impl)
        planned = memory_plan(cfg, impl).total
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


def describe(cfg: Config, compile_step: bool = True, chip: str | None = None) -> str:
    """The report of ``seqshard show`` for ``cfg`` (its mesh resolved). ``chip``: add the
    planner's plan for ``cfg.mesh.n_devices`` devices of that chip (seqshard.hardware.CHIPS).
    ``compile_step``: add the communication and memory of the compiled train step (needs the
    mesh's devices)."""
    m, train_cfg = cfg.model, cfg.train
    mesh = cfg.mesh.describe()
    parts = ["# resolved config", config_to_yaml(cfg).rstrip(), ""]
    n = param_count(m)
    non_embed = n - m.vocab * m.d_model
    parts.append(f"parameters: {n:,} ({non_embed:,} without the embedding)")
    parts.append("")
    parts.append(f"weights on mesh {mesh} (f32 master copies):")
    parts.append(
        _table(weight_table(cfg), ("weight", "type", "global", "per device", "PartitionSpec"))
    )
    parts.append("")
    per_part = matmul_flops_per_token(m, train_cfg.seq_len)
    model = flops_per_token(m, train_cfg.seq_len)
    hw = hardware_flops_per_token(m, train_cfg.seq_len)
    tokens = train_cfg.batch_size * train_cfg.seq_len
    parts.append(
        f"FLOPs per token at seq_len {train_cfg.seq_len} (matmuls, 2 per multiply-add, attention unmasked):"
    )
    parts.append(
        f"  forward {model.forward:,}  (per layer: qkv {per_part.qkv:,}, scores {per_part.attn_scores:,}, "
        f"values {per_part.attn_values:,}, out {per_part.out_proj:,}, ffn {per_part.ffn:,}; lm_head {per_part.lm_head:,})"
    )
    parts.append(
        f"  forward + backward {model.total:,} (model FLOPs, for MFU); with remat={m.remat} recompute {hw.total:,}"
    )
    parts.append(
        f"  per step ({train_cfg.batch_size} x {train_cfg.seq_len} tokens): {model.total * tokens / 1e12:.3f} TFLOP"
    )
    parts.append("")
    if chip is not None:
        parts.append(plan(cfg, cfg.mesh.n_devices, chip).format())
    else:
        # No target chip: attention 'auto' is counted as einsum, whose 'b L L Q K/t' scores
        # the fused kernels never hold (the larger figure; --chip names the target's kernel).
        impl = "einsum" if m.attention_impl == "auto" else m.attention_impl
        micro = train_cfg.batch_size // train_cfg.microbatches
        parts.append(
            f"estimated memory per device at the peak of a step (seqshard.planner; microbatch of "
            f"{micro}, remat={m.remat}, attention as {impl}"
            + ("" if impl in FUSED_ATTENTION else ", scores materialized")
            + "; --chip NAME plans for a chip):"
        )
        parts += describe_memory(memory_plan(cfg, impl))
    if compile_step:
        parts += ["", compiled_step_report(cfg)]
    return "\n".join(parts)
