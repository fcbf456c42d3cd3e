"""Tests of the loss mask (``TokenBatch.loss_mask``): the sharded model's loss and gradients
with a mask equal the single-device reference with the same mask, on every path that computes
them (autodiff, the hand-written backward, the sequence over c, a pipeline); masked-out tokens
contribute nothing; gradient accumulation stays exact; a batch that counts nothing leaves the
state alone.

Tolerances are those of the unmasked sharded-vs-reference tests (f32: loss rtol 1e-6, gradients
rtol 1e-5 / atol 1e-6)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from model_weights import packed_batch, random_weights, tiny_model

from seqshard.batch import TokenBatch, token_batch
from seqshard.config import Config, MeshConfig, TrainConfig
from seqshard.model.pipeline.schedule import Pipeline
from seqshard.model.reference import reference_loss_fn
from seqshard.model.sharded import batch_loss_terms
from seqshard.model.weights import weight_structs
from seqshard.testing import fake_cpu_mesh
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import init_train_state
from seqshard.train.step import grads_and_loss, make_train_step

CFG = tiny_model(n_layers=2)
BATCH, LENGTH = 8, 32
TOKENS, STARTS = packed_batch(CFG.vocab, BATCH, LENGTH, seed=3)
# About half the tokens masked out, in runs (prompt, completion, prompt, ...).
MASK = (np.cumsum(np.random.default_rng(5).random((BATCH, LENGTH)) < 0.15, axis=1) % 2) == 0
WEIGHTS = random_weights(CFG, seed=1)
LOSS = dict(rtol=1e-6, atol=0)
GRADS = dict(rtol=1e-5, atol=1e-6)


def _placed(cfg, mesh):
    return jax.tree.map(
        lambda x, s: jax.device_put(x, s.sharding), WEIGHTS, weight_structs(cfg, mesh)
    )


@functools.cache
def _sharded_fn(cfg, mesh, pipe):
    """jit of (weights, batch) -> (loss, gradients): one compile per model, mesh and pipeline."""

    def loss(w, batch):
        total, count = batch_loss_terms(w, batch, cfg, mesh, pipe)
        return total / count

    return jax.jit(jax.value_and_grad(loss))


def _sharded(cfg, mesh, batch, pipe=None):
    return jax.tree.map(np.asarray, _sharded_fn(cfg, mesh, pipe)(_placed(cfg, mesh), batch))


_reference_fn = jax.jit(jax.value_and_grad(reference_loss_fn), static_argnums=3)


def _reference(cfg, mask):
    mask = np.ones_like(STARTS) if mask is None else mask  # one compiled program for both
    return jax.tree.map(np.asarray, _reference_fn(WEIGHTS, TOKENS, STARTS, cfg, mask))


@pytest.mark.parametrize(
    "backward,axes,sizes,pipe",
    [
        ("autodiff", ("d", "t"), (4, 2), None),
        ("explicit", ("d", "c", "t"), (2, 2, 2), None),  # the mask gathered over c with the starts
        ("explicit", ("p", "d", "t"), (2, 2, 2), Pipeline("1f1b", 2)),
    ],
    ids=["autodiff-4x2", "explicit-d2c2t2", "1f1b-p2d2t2"],
)
def test_masked_loss_and_gradients_equal_the_reference(backward, axes, sizes, pipe):
    cfg = dataclasses.replace(CFG, backward=backward)
    mesh = fake_cpu_mesh(sizes, axes)
    loss, grads = _sharded(cfg, mesh, token_batch(TOKENS, STARTS, MASK), pipe)
    ref_loss, ref_grads = _reference(cfg, MASK)
    np.testing.assert_allclose(loss, ref_loss, **LOSS)
    for (path, r), g in zip(
        jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads), strict=True
    ):
        np.testing.assert_allclose(g, r, err_msg=jax.tree_util.keystr(path), **GRADS)
    # and the mask matters: unmasked, the loss is another number
    assert abs(float(_reference(cfg, None)[0]) - float(ref_loss)) > 1e-3


def test_masked_out_tokens_contribute_nothing():
    """Each row: document A (its second half counted) then document B, all masked out. With
    attention within documents, B's tokens reach no counted position: changing them leaves the
    loss and gradient bit for bit; changing a counted token of A changes them."""
    cfg = dataclasses.replace(CFG, backward="explicit")
    mesh = fake_cpu_mesh((4, 2), ("d", "t"))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab, (BATCH, LENGTH)).astype(np.int32)
    starts = np.zeros((BATCH, LENGTH), bool)
    starts[:, [0, 20]] = True
    mask = np.zeros((BATCH, LENGTH), bool)
    mask[:, 10:20] = True

    def outputs(tokens):
        return _sharded(cfg, mesh, token_batch(tokens, starts, mask))

    loss, grads = outputs(tokens)
    other_b = tokens.copy()
    other_b[:, 20:] = rng.integers(0, CFG.vocab, (BATCH, LENGTH - 20))
    loss_b, grads_b = outputs(other_b)
    assert loss_b == loss
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_b), strict=True):
        np.testing.assert_array_equal(a, b)
    other_a = tokens.copy()
    other_a[:, 15] = (other_a[:, 15] + 1) % CFG.vocab
    assert outputs(other_a)[0] != loss


def _run_config(microbatches: int) -> Config:
    return Config(
        model=CFG,
        mesh=MeshConfig(d=4, t=2),
        train=TrainConfig(batch_size=BATCH, microbatches=microbatches),
    )


def test_accumulation_stays_exact_when_microbatches_count_differently():
    """Rows 0, 2, 4, 6 (microbatch 0 of 2: row i goes to i % 2) count nearly nothing, the others
    nearly everything: the accumulated loss and gradient are still the full batch's (summed
    over every counted position, divided once)."""
    mask = np.ones((BATCH, LENGTH), bool)
    mask[0::2, 2:] = False
    mesh = fake_cpu_mesh((4, 2), ("d", "t"))
    batch = token_batch(TOKENS, STARTS, mask)
    w = _placed(CFG, mesh)
    out = {
        k: jax.tree.map(
            np.asarray,
            jax.jit(lambda w, b, k=k: grads_and_loss(w, b, _run_config(k), mesh)[:3])(w, batch),
        )
        for k in (1, 2)
    }
    (g1, l1, c1), (g2, l2, c2) = out[1], out[2]
    assert c1 == c2 == float(np.sum(~STARTS[:, 1:] & mask[:, 1:]))
    np.testing.assert_allclose(l2, l1, **LOSS)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, **GRADS)
    ref_loss, _ = _reference(CFG, mask)
    np.testing.assert_allclose(l1, ref_loss, **LOSS)


def test_a_batch_that_counts_nothing_leaves_the_state_alone():
    """Fine-tuning rows of prompts alone: loss 0, nothing counted, no update, and no fault in
    the guard (a zero gradient is right here); the next batch trains as usual."""
    run = _run_config(1)
    mesh = fake_cpu_mesh((4, 2), ("d", "t"))
    opt = make_optimizer(run.train)
    state = init_train_state(CFG, mesh, opt, jax.random.key(0))
    step = make_train_step(run, mesh, opt)
    nothing = TokenBatch(TOKENS, STARTS, np.zeros_like(STARTS))
    before = jax.tree.map(np.asarray, state.weights)
    state, metrics = step(state, nothing)
    assert float(metrics["loss"]) == 0.0 and float(metrics["tokens_counted"]) == 0.0
    assert int(state.guard.total) == 0 and int(state.step) == 1
    for a, b in zip(jax.tree.leaves(state.weights), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    state, metrics = step(state, TokenBatch(TOKENS, STARTS, MASK))
    assert float(metrics["loss"]) > 0 and int(state.guard.total) == 0
