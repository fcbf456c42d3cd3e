"""The sharded Llama-style decoder and its single-device reference.

from seqshard.model import ModelConfig, init_weights, loss_fn, logits_fn
from seqshard.model import reference_loss_fn, reference_logits_fn
from seqshard.model import decode_mesh, generate    # token ids in and out; text: seqshard.sample
"""

from seqshard.model.config import ModelConfig, MoEConfig
from seqshard.model.generate import decode_mesh, generate
from seqshard.model.reference import reference_logits_fn, reference_loss_fn
from seqshard.model.sharded import logits_fn, loss_fn, loss_sum_and_count
from seqshard.model.weights import Layer, Weights, init_weights, param_count, weight_structs

__all__ = [
    "Layer",
    "ModelConfig",
    "MoEConfig",
    "Weights",
    "decode_mesh",
    "generate",
    "init_weights",
    "logits_fn",
    "loss_fn",
    "loss_sum_and_count",
    "param_count",
    "reference_logits_fn",
    "reference_loss_fn",
    "weight_structs",
]
