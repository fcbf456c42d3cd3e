"""model.fp8 (seqshard/model/fp8_scaling.py and the blocks' FP8 sites): the sharded model
equals the FP8 reference (seqshard.model.reference, the same quantization of whole tensors on
one device) on several meshes under both backwards, current and delayed, pipelined too; FP8
really changes the numbers; training follows the plain curve.

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

import jax
import jax.numpy as jnp
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

from seqshard.batch import token_batch
from seqshard.config import Config, DataConfig, MeshConfig, TrainConfig, check_config
from seqshard.mesh import mesh_of_sizes
from seqshard.model.config import ModelConfig
from seqshard.model.pipeline.schedule import Pipeline
from seqshard.model.reference import reference_loss_fn
from seqshard.model.sharded import batch_terms_and_aux
from seqshard.model.weights import weight_structs
from seqshard.testing import fake_cpu_mesh
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import init_train_state
from seqshard.train.step import make_train_step

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


@pytest.mark.slow
def test_fp8_training_follows_the_compute_dtype():
    """30 steps (d=2 x t=4, f32 compute), a fresh batch each step of tokens drawn Zipf-like
    (something to learn, nothing to memorize): each FP8 mode's loss curve within 5e-3
    relative of the plain one's at every step (measured: 2.1e-3). Looser than tiny-cpu's
    1e-3 (docs/fp8.md: its 50 steps in bf16 within 7.5e-4 of bf16's, whose own distance from
    f32 is 6.1e-5): its projections sum 32 to 64 products, not 128 to 512, so FP8's rounding
    averages out less."""
    mesh = fake_cpu_mesh((2, 4), ("d", "t"))

    def curve(mode: str) -> np.ndarray:
        model = dataclasses.replace(CFG, fp8=mode)
        cfg = Config(
            model=model,
            mesh=MeshConfig(d=2, t=4),
            data=DataConfig(vocab_size=model.vocab),
            train=TrainConfig(batch_size=BATCH, seq_len=LENGTH, lr=3e-3, warmup_steps=2),
        )
        check_config(cfg)
        opt = make_optimizer(cfg.train)
        state = init_train_state(model, mesh, opt, jax.random.key(0))
        step = make_train_step(cfg, mesh, opt)
        rng = np.random.default_rng(0)
        odds = 1 / np.arange(1, model.vocab + 1)
        losses = []
        for _ in range(30):
            tokens = rng.choice(model.vocab, (BATCH, LENGTH), p=odds / odds.sum())
            state, metrics = step(state, token_batch(tokens.astype(np.int32), STARTS))
            losses.append(float(metrics["loss"]))
        return np.array(losses)

    plain = curve("none")
    assert plain[-1] < plain[0] - 1  # it learns
    for mode in ("current", "delayed"):
        np.testing.assert_allclose(curve(mode), plain, rtol=5e-3, err_msg=mode)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelined_delayed_fp8_equals_the_reference_and_maxes_the_amaxes(schedule):
    """p=2 (a layer per stage), 2 microbatches, every site with a history: each microbatch at
    the history's scales, as the reference's per-microbatch loss; the step's amaxes are the
    max over microbatches, each layer's from its stage (a weight's: its largest |entry|).
    Both differentiate the summed loss, as training does (1F1B seeds each microbatch's head
    with the cotangent 1 and divides by the count after: FP8 rounds the gradients of what is
    differentiated, so a mean's 1/count, not a power of two, would round them otherwise)."""
    cfg = dataclasses.replace(DELAYED, backward="explicit")
    w = _delayed_weights()
    mesh = mesh_of_sizes({"p": 2, "d": 2, "t": 2})
    placed = jax.device_put(w, jax.tree.map(lambda s: s.sharding, weight_structs(cfg, mesh)))
    pipe = Pipeline(schedule=schedule, microbatches=2)

    def loss(w):
        batch = token_batch(TOKENS, STARTS)
        (total, _), aux = batch_terms_and_aux(w, batch, cfg, mesh, pipe)
        return total, aux

    (value, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(placed)

    def reference(w):  # the summed loss of the two microbatches (rows i, i + 2, ...)
        totals = []
        for i in range(2):
            tokens, starts = TOKENS[i::2], STARTS[i::2]
            n = jnp.sum(~jnp.asarray(starts)[:, 1:], dtype=jnp.float32)
            totals.append(reference_loss_fn(w, tokens, starts, cfg) * n)
        return sum(totals)

    want = jax.jit(jax.value_and_grad(reference))(w)
    assert_close_to_reference(jax.tree.map(np.asarray, (value, grads)), want)
    amax = np.asarray(aux["layers"]["swiglu"]["fp8_amax"])  # [layers, sites]
    np.testing.assert_array_equal(amax[:, 1], np.max(np.abs(w.layers.w_gate), axis=(1, 2)))
    # A site saturates where its amax passed its history's scale's range, in each microbatch.
    history = np.max(w.layers.swiglu_fp8_history, axis=-1)
    fits = 2.0 ** np.ceil(np.log2(history / 448)) * 448  # the power-of-two scale's range
    saturated = np.asarray(aux["layers"]["swiglu"]["fp8_saturated"])
    np.testing.assert_array_equal(saturated[:, 1:3], 2.0 * (amax[:, 1:3] > fits[:, 1:3]))
    assert saturated.max() == 2  # the half-size histories make some site saturate
