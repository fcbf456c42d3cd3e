"""model.fp8=current: the sharded model equals the FP8 reference (seqshard.model.reference, the
same quantization of whole tensors on one device) on several meshes under both backwards, and
FP8 really changes the numbers.

Tolerances (f32 compute): the loss to 1e-5 relative, each gradient to 1e-4 of its leaf's
largest entry, the bounds of the f32 tests. They hold because scales are powers of two: a
tensor's scale does not move with the last bits of its amax, so a value quantizes differently
only when it lies within f32 rounding of an e4m3/e5m2 rounding boundary. With exact scales
(amax / 448) the same comparison differs by up to 5% of a gradient leaf, and so does the
reference against itself with its weights moved by 1e-7 relative: FP8's grid turns the last
bits of the amax into different roundings everywhere.
"""

from __future__ import annotations

import dataclasses
import functools

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

from seqshard.model.config import ModelConfig

CFG = tiny_model(fp8="current")
MOE = dataclasses.replace(
    CFG,
    n_layers=3,
    moe=dataclasses.replace(CFG.moe, n_experts=4, top_k=2, d_ff=64, n_dense_layers=1, n_shared=1),
)
BATCH, LENGTH = 8, 16
TOKENS, STARTS = packed_batch(CFG.vocab, BATCH, LENGTH, seed=0)


@functools.cache
def _weights(cfg: ModelConfig):
    return random_weights(cfg, seed=0)


@functools.cache
def reference(cfg: ModelConfig):
    return reference_value_and_grad(cfg, _weights(cfg), TOKENS, STARTS)


@pytest.mark.parametrize("backward", ["explicit", pytest.param("autodiff", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "sizes,changes",
    [
        ({"d": 2, "t": 4}, {}),
        ({"c": 2, "d": 2, "t": 2}, {}),
        ({"d": 4, "t": 2}, {"residual": "M/t", "qk_norm": True}),
        pytest.param({"c": 4, "t": 2}, {"context_impl": "ring"}, marks=pytest.mark.slow),
        pytest.param({"d": 8}, {"remat": "full"}, marks=pytest.mark.slow),
    ],
    ids=["d2t4", "c2d2t2", "d4t2-M/t-qk_norm", "c4t2-ring", "d8-remat-full"],
)
def test_sharded_fp8_equals_the_fp8_reference(sizes, changes, backward):
    cfg = dataclasses.replace(CFG, backward=backward, **changes)
    ref_cfg = dataclasses.replace(CFG, qk_norm=changes.get("qk_norm", False))
    got = sharded_value_and_grad(cfg, sizes, _weights(ref_cfg), TOKENS, STARTS)
    assert_close_to_reference(got, reference(ref_cfg))


@pytest.mark.slow
@pytest.mark.parametrize("backward", ["explicit", "autodiff"])
def test_fp8_with_experts_equals_the_reference(backward):
    """Attention and the dense layer in FP8, the routed and shared experts in compute dtype."""
    cfg = dataclasses.replace(MOE, backward=backward)
    got = sharded_value_and_grad(cfg, {"e": 2, "d": 2, "t": 2}, _weights(MOE), TOKENS, STARTS)
    assert_close_to_reference(got, reference(MOE))


def test_fp8_changes_the_numbers_a_little():
    """FP8 is on: the loss moves, by less than 1% on this model (f32 elsewhere)."""
    plain = dataclasses.replace(CFG, fp8="none")
    loss, grads = reference(CFG)
    plain_loss, plain_grads = reference_value_and_grad(plain, _weights(CFG), TOKENS, STARTS)
    assert 1e-5 < abs(loss - plain_loss) / plain_loss < 1e-2
    assert not np.array_equal(grads.layers.w_up, plain_grads.layers.w_up)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"fp8": "e4m3"}, r"model.fp8 must be one of \('none', 'current'"),
        ({"attention": "mla", "n_q_per_kv": 1, "d_head": 48}, r"model.fp8=current .* MLA"),
    ],
)
def test_bad_fp8_configs_name_the_key(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CFG, **changes)


DELAYED = dataclasses.replace(CFG, fp8="delayed", fp8_history=4)


@functools.cache
def _delayed_weights():
    """Weights with amax histories around half the tensors' own amaxes' size: some sites
    saturate (a history below the current amax), some do not."""
    w = _weights(DELAYED)
    rng = np.random.default_rng(7)

    def history(h):
        return (np.abs(rng.standard_normal(h.shape)) * 0.5).astype(np.float32)

    layers = dataclasses.replace(
        w.layers,
        attention_fp8_history=history(w.layers.attention_fp8_history),
        swiglu_fp8_history=history(w.layers.swiglu_fp8_history),
    )
    return dataclasses.replace(w, layers=layers)


@pytest.mark.parametrize(
    "sizes,backward",
    [
        ({"d": 2, "t": 4}, "explicit"),
        pytest.param({"c": 2, "d": 2, "t": 2}, "autodiff", marks=pytest.mark.slow),
    ],
    ids=["d2t4-explicit", "c2d2t2-autodiff"],
)
def test_sharded_delayed_fp8_equals_the_reference(sizes, backward):
    """model.fp8=delayed: each site at its history's scale, saturating where the history is
    below the tensor's amax; the sharded model equals the reference's delayed scaling."""
    w = _delayed_weights()
    want = reference_value_and_grad(DELAYED, w, TOKENS, STARTS)
    cfg = dataclasses.replace(DELAYED, backward=backward)
    assert_close_to_reference(sharded_value_and_grad(cfg, sizes, w, TOKENS, STARTS), want)
    current = reference(CFG)
    assert abs(want[0] - current[0]) > 1e-3  # the histories' scales, not the current ones
