"""Tests of seqshard/model/mla.py: multi-head latent attention against the reference (Hugging
Face's DeepSeek-V3 math written densely), with and without the query latent, on meshes
splitting t, c (allgather and ring), e and d, under both backwards; YaRN's frequencies and
softmax scale; configs that cannot work.

Tolerances (f32): the loss to 1e-5 relative, each gradient to 1e-4 of its leaf's largest
entry (the issue's bounds).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
from model_weights import (
    assert_close_to_reference,
    packed_batch,
    random_weights,
    reference_value_and_grad,
    sharded_value_and_grad,
    tiny_model,
)

from seqshard.model.config import MLAConfig

MLA = MLAConfig(
    q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
)
CFG = tiny_model(attention="mla", n_q_per_kv=1, n_kv=4, d_head=12, mla=MLA)
BATCH, LENGTH = 8, 16
TOKENS, STARTS = packed_batch(CFG.vocab, BATCH, LENGTH, seed=0)


@functools.cache
def _weights(cfg):
    return random_weights(cfg, seed=0)


@functools.cache
def reference(cfg):
    return reference_value_and_grad(cfg, _weights(cfg), TOKENS, STARTS)


def sharded(cfg, sizes):
    return sharded_value_and_grad(cfg, sizes, _weights(cfg), TOKENS, STARTS)


assert_close = assert_close_to_reference


def _cfg(q_lora: bool, **changes):
    mla = MLA if q_lora else dataclasses.replace(MLA, q_lora_rank=0)
    return dataclasses.replace(CFG, mla=mla, **changes)


@pytest.mark.parametrize("backward", ["explicit", pytest.param("autodiff", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "q_lora,sizes,changes",
    [
        (True, {"d": 2, "t": 4}, {}),
        (False, {"d": 4, "t": 2}, {"residual": "M/t"}),
        (True, {"c": 2, "d": 2, "t": 2}, {}),
        (False, {"c": 4, "t": 2}, {"context_impl": "ring"}),
    ],
    ids=["d2t4", "d4t2-M/t-no-q-latent", "c2d2t2", "c4t2-ring-no-q-latent"],
)
def test_sharded_equals_the_reference(q_lora, sizes, changes, backward):
    cfg = _cfg(q_lora, backward=backward, **changes)
    assert_close(sharded(cfg, sizes), reference(_cfg(q_lora)))


MLA_KEYS = [
    "model.attention=mla",
    "model.n_q_per_kv=1",
    "model.n_kv=4",
    "model.d_head=48",
    "model.mla.qk_nope_head_dim=32",
    "model.mla.qk_rope_head_dim=16",
]


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["model.attention=mla", "model.n_q_per_kv=2"], ["model.n_q_per_kv=1", "got 2"]),
        (
            [*MLA_KEYS, "model.d_head=40"],
            ["model.d_head=40", "qk_nope_head_dim + qk_rope_head_dim", "model.d_head=48"],
        ),
        ([*MLA_KEYS, "model.mla.kv_lora_rank=0"], ["model.mla.kv_lora_rank", "positive"]),
        ([*MLA_KEYS, "model.mla.q_lora_rank=-1"], ["model.mla.q_lora_rank", ">= 0"]),
        (
            [*MLA_KEYS, "model.mla.qk_rope_head_dim=15", "model.mla.qk_nope_head_dim=33"],
            ["qk_rope_head_dim must be even", "15"],
        ),
        ([*MLA_KEYS, "model.qk_norm=true"], ["model.qk_norm=false", "model.attention=mla"]),
        (
            [*MLA_KEYS, "model.mla.kv_lora_rank=30", "mesh.d=4", "mesh.t=2"],
            ["model.mla.kv_lora_rank=30", "not divisible"],
        ),
        (["model.attention=mha"], ["model.attention", "'gqa', 'mla'"]),
        (
            ["model.rope_type=yarn", "model.rope_factor=0"],
            ["model.rope_type=yarn", "DeepSeek-V3: 40"],
        ),
        (["model.mtp.depth=-1"], ["model.mtp.depth", ">= 0", "-1"]),
        (["model.mtp.loss_weight=-0.5"], ["model.mtp.loss_weight", ">= 0"]),
    ],
)
def test_configs_that_cannot_work_are_errors_naming_the_key(overrides, needles):
    from seqshard.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_yarn_matches_transformers_frequencies_and_mscale():
    """YaRN's frequencies and attention factor as Hugging Face computes them (DeepSeek-V3's
    parameters, a small head), and MLA's softmax scale from mscale_all_dim."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from seqshard.model.attention import rope_attention_factor, rope_frequencies
    from seqshard.model.mla import softmax_mscale

    params = {
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 1.0,
        "rope_theta": 10000.0,
    }  # fmt: skip
    hf = DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, qk_rope_head_dim=16, qk_nope_head_dim=32,
        v_head_dim=32, rope_parameters=params, max_position_embeddings=163840,
    )  # fmt: skip
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, torch.device("cpu"))
    cfg = dataclasses.replace(
        CFG, rope_type="yarn", rope_factor=40.0, rope_original_max_position=4096,
        rope_mscale=0.707, rope_mscale_all_dim=1.0, d_head=48,
        mla=dataclasses.replace(MLA, qk_nope_head_dim=32, qk_rope_head_dim=16),
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(rope_frequencies(cfg)), inv_freq.numpy(), rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(factor, rel=1e-6)
    assert softmax_mscale(cfg) == pytest.approx((0.1 * math.log(40.0) + 1) ** 2, rel=1e-9)


@pytest.mark.parametrize("remat", ["full", "none"])
def test_every_remat_policy_gives_the_reference(remat):
    """remat=saved is the other tests'; full keeps only each layer's input (the explicit
    backward rebuilds q, k, v and the attention output), none keeps everything it reads."""
    cfg = _cfg(True, remat=remat)
    assert_close(sharded(cfg, {"d": 2, "t": 4}), reference(_cfg(True)))
