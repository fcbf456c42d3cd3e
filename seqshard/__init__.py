"""seqshard: train language models on device meshes, with every tensor layout and every
chip-to-chip transfer written in a small named-axis notation, and checked.

    from seqshard import f32, bf16, pytree_dataclass, typed_shard_map, shardops

    @pytree_dataclass
    class Ffn:
        w_up: f32['d_model/d d_ff/t']             # rows split over d (FSDP), columns over t

    w = shardops.all_gather('M/d F/t -> M F/t', w)   # one all-gather over d, checked

The notation core lives in :mod:`seqshard.shardlib`, the model (with its FLOP and memory
accounting, :mod:`seqshard.model.cost`) in :mod:`seqshard.model`, the data pipeline in
:mod:`seqshard.data`, training in :mod:`seqshard.train`, Hugging Face interop in
:mod:`seqshard.hf`, the planner and ``seqshard show`` in :mod:`seqshard.plan`, and helpers for
tests of sharded code (fake CPU meshes, HLO collective counts) in :mod:`seqshard.testing`.
"""

import importlib

# The public names and the modules that define them. They load on first use, so that
# `seqshard train` can install its signal handlers before JAX is imported (seconds).
_PUBLIC = {
    "shardops": None,
    "OpSpec": "shardlib.notation",
    "Shape": "shardlib.notation",
    "SpecSyntaxError": "shardlib.notation",
    "parse_op": "shardlib.notation",
    "parse_shape": "shardlib.notation",
    "explicit_activation_checkpointing": "model.remat",
    "save_for_backward": "model.remat",
    "ShapeError": "shardlib.shapecheck",
    "shape_scope": "shardlib.shapecheck",
    **dict.fromkeys(
        [
            "Array",
            "ArrayType",
            "bf16",
            "bool_",
            "f16",
            "f32",
            "i32",
            "u32",
            "partition_specs",
            "pytree_dataclass",
            "shape_dtype_structs",
            "shardings",
            "typed_shard_map",
        ],
        "shardlib.shardtypes",
    ),
}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'seqshard' has no attribute {name!r}")
    module = _PUBLIC[name]
    if module is None:
        return importlib.import_module(f"seqshard.shardlib.{name}")
    return getattr(importlib.import_module(f"seqshard.{module}"), name)


__version__ = "0.1.0"

__all__ = sorted(_PUBLIC)
