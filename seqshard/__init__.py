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

# The public names, by the module that defines them. They load on first use, so that
# `seqshard train` can install its signal handlers before JAX is imported (seconds); each
# module is imported by name in __getattr__, where the source's import graph sees it.
_NOTATION = ("OpSpec", "Shape", "SpecSyntaxError", "parse_op", "parse_shape")
_REMAT = ("explicit_activation_checkpointing", "save_for_backward")
_SHAPECHECK = ("ShapeError", "shape_scope")
_SHARDTYPES = (
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
)


def __getattr__(name: str):
    if name == "shardops":
        from seqshard.shardlib import shardops

        return shardops
    if name in _NOTATION:
        from seqshard.shardlib import notation as module
    elif name in _REMAT:
        from seqshard.shardlib import remat as module
    elif name in _SHAPECHECK:
        from seqshard.shardlib import shapecheck as module
    elif name in _SHARDTYPES:
        from seqshard.shardlib import shardtypes as module
    else:
        raise AttributeError(f"module 'seqshard' has no attribute {name!r}")
    return getattr(module, name)


__version__ = "0.1.0"

__all__ = sorted(["shardops", *_NOTATION, *_REMAT, *_SHAPECHECK, *_SHARDTYPES])
