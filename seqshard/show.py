"""``seqshard show``: what a config means on its mesh, read off the types and the counts.

Resolved config; parameter count; each weight's global and per-device shape and layout;
FLOPs per token; estimated bytes per device (weights, grads, optimizer state, activations).
"""

from __future__ import annotations

import jax

from seqshard.config import Config, config_to_yaml
from seqshard.flops import (
    flops_per_token,
    format_bytes,
    hardware_flops_per_token,
    matmul_flops_per_token,
    memory_per_device,
)
from seqshard.model.weights import Weights, param_count
from seqshard.shardtypes import block_shape, type_tree

__all__ = ["describe", "weight_table"]


def _shape(s) -> str:
    return "[" + ", ".join(map(str, s)) + "]"


def weight_table(cfg: Config) -> list[tuple[str, str, str, str, str]]:
    """(name, type, global shape, per-device shape, PartitionSpec) per weight."""
    sizes, axes = cfg.model.dim_sizes(), {"d": cfg.mesh.d, "t": cfg.mesh.t}
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


def describe(cfg: Config) -> str:
    m, t = cfg.model, cfg.train
    mesh = f"d={cfg.mesh.d} x t={cfg.mesh.t}"
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
    per_part = matmul_flops_per_token(m, t.seq_len)
    model = flops_per_token(m, t.seq_len)
    hw = hardware_flops_per_token(m, t.seq_len)
    tokens = t.batch_size * t.seq_len
    parts.append(
        f"FLOPs per token at seq_len {t.seq_len} (matmuls, 2 per multiply-add, attention unmasked):"
    )
    parts.append(
        f"  forward {model.forward:,}  (per layer: qkv {per_part.qkv:,}, scores {per_part.attn_scores:,}, "
        f"values {per_part.attn_values:,}, out {per_part.out_proj:,}, ffn {per_part.ffn:,}; lm_head {per_part.lm_head:,})"
    )
    parts.append(
        f"  forward + backward {model.total:,} (model FLOPs, for MFU); with remat={m.remat} recompute {hw.total:,}"
    )
    parts.append(
        f"  per step ({t.batch_size} x {t.seq_len} tokens): {model.total * tokens / 1e12:.3f} TFLOP"
    )
    parts.append("")
    mem = memory_per_device(
        m, d=cfg.mesh.d, t=cfg.mesh.t, batch=t.batch_size // t.microbatches, seq_len=t.seq_len
    )
    parts.append(
        f"estimated memory per device (microbatch of {t.batch_size // t.microbatches}, remat={m.remat}):"
    )
    for name in ("weights", "grads", "optimizer", "activations", "logits"):
        parts.append(f"  {name:<12}{format_bytes(getattr(mem, name)):>12}")
    parts.append(f"  {'total':<12}{format_bytes(mem.total):>12}")
    return "\n".join(parts)
