"""seqshard: train language models on device meshes, with every tensor layout and every
chip-to-chip transfer written in a small named-axis notation, and checked.

    from seqshard import f32, bf16, pytree_dataclass, typed_shard_map, shardops

    @pytree_dataclass
    class Ffn:
        w_up: f32['d_model/d d_ff/t']             # rows split over d (FSDP), columns over t

    w = shardops.all_gather('M/d F/t -> M F/t', w)   # one all-gather over d, checked

The model lives in :mod:`seqshard.model`, training in :mod:`seqshard.train`, the data pipeline
in :mod:`seqshard.data`, FLOP and memory accounting in :mod:`seqshard.flops`, and helpers for
tests of sharded code (fake CPU meshes, HLO collective counts) in :mod:`seqshard.testing`.
"""

from seqshard import shardops
from seqshard.notation import OpSpec, Shape, SpecSyntaxError, parse_op, parse_shape
from seqshard.remat import explicit_activation_checkpointing, save_for_backward
from seqshard.shapecheck import ShapeError, shape_scope
from seqshard.shardtypes import (
    Array,
    ArrayType,
    bf16,
    bool_,
    f16,
    f32,
    i32,
    partition_specs,
    pytree_dataclass,
    shape_dtype_structs,
    shardings,
    typed_shard_map,
    u32,
)

__version__ = "0.1.0"

__all__ = [
    "Array",
    "ArrayType",
    "OpSpec",
    "Shape",
    "ShapeError",
    "SpecSyntaxError",
    "bf16",
    "bool_",
    "explicit_activation_checkpointing",
    "f16",
    "f32",
    "i32",
    "parse_op",
    "parse_shape",
    "partition_specs",
    "pytree_dataclass",
    "save_for_backward",
    "shape_dtype_structs",
    "shape_scope",
    "shardings",
    "shardops",
    "typed_shard_map",
    "u32",
]
