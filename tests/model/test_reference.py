"""Tests for seqshard/model/reference.py: its pieces, reassembled as the benchmark does, equal it.

    pieces     reference_layer scanned by lax.scan under explicit_activation_checkpointing
               (remat 'saved', save_for_backward as the mark) gives reference_logits_fn's
               logits and reference_loss_fn's loss and gradients; the layer marks the values
               the sharded model keeps (q, k, v, attention output, mid-layer residual, gate, up);
               positions within documents equal a plain loop's
    benchmark  scripts/bench_step.py's GSPMD baseline on a 4x2 mesh: its loss and gradients
               equal reference_loss_fn's; the jitted train step of its gspmd-act variant (the
               residual constrained) reports reference_loss_fn's loss for its first step

That remat changes no value is tested for every policy in tests/model/test_remat.py.

The sharded model itself is compared with the reference in tests/model/test_transformer.py.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_weights import assert_trees_close, random_weights, tiny_model
from model_weights import packed_batch as shared_packed_batch

from seqshard.batch import TokenBatch, token_batch
from seqshard.config import Config, MeshConfig, TrainConfig
from seqshard.mesh import mesh_of_sizes
from seqshard.model import ModelConfig, reference, reference_logits_fn, reference_loss_fn
from seqshard.shardlib.remat import explicit_activation_checkpointing, save_for_backward
from seqshard.shardlib.shardtypes import shardings
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import init_train_state

# Sizes a 4x2 mesh splits: d_model by d*t = 8, vocab, n_kv and d_ff by t = 2, the batch by d = 4.
CFG = tiny_model(n_kv=2)
BATCH, LENGTH = 8, 16
MESH = {"d": 4, "t": 2}

# f32 throughout; the tolerances of tests/model/test_transformer.py. The scan (one device) and GSPMD (4x2,
# d_model and vocab split) sum in other orders than the looped reference; measured: loss 1.0e-7
# relative (4.70) for both, logits 9.5e-7 (|logit| < 4.4), gradients 2.0e-7 (scan) and 3.1e-7
# (GSPMD) absolute (entries up to 0.29).
LOSS = dict(rtol=1e-6, atol=0)
LOGITS = dict(rtol=1e-5, atol=1e-5)
GRADS = dict(rtol=1e-5, atol=1e-6)


def packed_batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    return shared_packed_batch(CFG.vocab, BATCH, LENGTH, seed)


TOKENS, IS_SEQ_START = packed_batch()
WEIGHTS = random_weights(CFG, seed=0)  # numpy: the reference's single-device inputs


@functools.cache
def bench():
    """scripts/bench_step.py as a module (scripts/ is not a package)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_step.py"
    spec = importlib.util.spec_from_file_location("bench_step", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@functools.cache
def reference_outputs():
    """(loss, grads, logits) of the reference for the module's weights and batch, numpy."""

    def outputs(w, tokens, is_seq_start):
        loss, grads = jax.value_and_grad(reference_loss_fn)(w, tokens, is_seq_start, CFG)
        return loss, grads, reference_logits_fn(w, tokens, is_seq_start, CFG)

    return jax.tree.map(np.asarray, jax.jit(outputs)(WEIGHTS, TOKENS, IS_SEQ_START))


# ---------------------------------------------------------------------------------------------
# Pieces: the layer function, scanned, is the reference


def scanned_logits(w, tokens, is_seq_start, cfg: ModelConfig):
    """The reference's pieces as the benchmark assembles them: lax.scan of reference.reference_layer
    under explicit activation checkpointing, save_for_backward as the mark."""
    positions = reference.reference_positions(is_seq_start)
    mask = reference.reference_mask(is_seq_start, cfg.attention_mask)

    def layer(x, lw):
        return reference.reference_layer(cfg, lw, x, positions, mask, mark=save_for_backward), None

    x = reference.reference_embed(cfg, w, tokens)
    x, _ = jax.lax.scan(explicit_activation_checkpointing(layer, cfg.remat), x, w.layers)
    return reference.reference_unembed(cfg, w, x)


def test_scanned_layers_equal_reference():
    cfg = dataclasses.replace(CFG, remat="saved")
    ref_loss, ref_grads, ref_logits = reference_outputs()

    def loss(w, tokens, is_seq_start):
        logits = scanned_logits(w, tokens, is_seq_start, cfg)
        total, count = reference.reference_loss_terms(logits, tokens, is_seq_start)
        return total / count, logits

    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (got_loss, logits), got_grads = grad_fn(WEIGHTS, TOKENS, IS_SEQ_START)
    np.testing.assert_allclose(logits, ref_logits, **LOGITS)
    np.testing.assert_allclose(got_loss, ref_loss, **LOSS)
    assert_trees_close(got_grads, ref_grads, **GRADS)


def test_layer_marks_what_the_sharded_model_saves():
    """mark sees q and k after RoPE, v, the attention output, the mid-layer residual, gate and
    up: the seven values seqshard/model/transformer.py keeps with save_for_backward."""
    marked = []

    def mark(x):
        marked.append(x.shape)
        return x

    x = reference.reference_embed(CFG, WEIGHTS, TOKENS)
    layer = jax.tree.map(lambda a: a[0], WEIGHTS.layers)
    positions = reference.reference_positions(jnp.asarray(IS_SEQ_START))
    mask = reference.reference_mask(jnp.asarray(IS_SEQ_START), CFG.attention_mask)
    jax.eval_shape(lambda: reference.reference_layer(CFG, layer, x, positions, mask, mark=mark))
    b, n, q, k, d = BATCH, LENGTH, CFG.n_q_per_kv, CFG.n_kv, CFG.d_head
    residual, ffn = (b, n, CFG.d_model), (b, n, CFG.d_ff)
    assert sorted(marked) == sorted(
        [(b, n, q, k, d), (b, n, k, d), (b, n, k, d), (b, n, q, k, d), residual, ffn, ffn]
    )


def test_positions_count_from_each_document_start():
    """reference.reference_positions against a plain loop: +1 per token, 0 at a document start, and a row
    that begins mid-document (row 0) counts from 0."""
    want = np.zeros((BATCH, LENGTH), np.int32)
    for b in range(BATCH):
        for i in range(1, LENGTH):
            want[b, i] = 0 if IS_SEQ_START[b, i] else want[b, i - 1] + 1
    np.testing.assert_array_equal(reference.reference_positions(IS_SEQ_START), want)


def test_loss_terms_sum_and_count():
    """reference_loss_fn is reference.reference_loss_terms' sum over its count; a position counts when the
    next token is in its document."""
    loss, _, logits = reference_outputs()
    total, count = np.asarray(reference.reference_loss_terms(logits, TOKENS, IS_SEQ_START))
    assert count == np.sum(~IS_SEQ_START[:, 1:])
    np.testing.assert_allclose(total / count, loss, **LOSS)


# ---------------------------------------------------------------------------------------------
# Benchmark: the GSPMD baseline is the reference on a mesh


def test_bench_baseline_equals_reference():
    mesh = mesh_of_sizes(MESH)
    w = random_weights(CFG, mesh, seed=0)
    batch = jax.device_put(token_batch(TOKENS, IS_SEQ_START), shardings(TokenBatch, mesh))

    def loss(w, batch):
        total, count = bench().gspmd_loss_sum_and_count(w, batch, CFG)
        return total / count

    got_loss, got_grads = jax.jit(jax.value_and_grad(loss))(w, batch)
    ref_loss, ref_grads, _ = reference_outputs()
    np.testing.assert_allclose(got_loss, ref_loss, **LOSS)
    assert_trees_close(got_grads, ref_grads, **GRADS)


@pytest.mark.slow  # the plain-jit baseline's equality runs by default (test_bench_baseline_...)
def test_bench_gspmd_act_step_first_loss_equals_reference():
    """The gspmd-act variant's jitted train step (make_gspmd_step, as the benchmark builds it;
    the residual constrained to 'B/d/e L M') reports the reference's loss of its start weights."""
    cfg = Config(
        model=CFG,
        mesh=MeshConfig(**MESH),
        train=TrainConfig(batch_size=BATCH, seq_len=LENGTH, warmup_steps=1, steps=10),
    )
    mesh = mesh_of_sizes(cfg.mesh.sizes())
    opt = make_optimizer(cfg.train)
    state = init_train_state(CFG, mesh, opt, jax.random.key(0))
    # The module's weights in place of init's, whose norm gains are all ones.
    on_mesh = jax.device_put(WEIGHTS, jax.tree.map(lambda a: a.sharding, state.weights))
    state = dataclasses.replace(state, weights=on_mesh)
    batch = jax.device_put(token_batch(TOKENS, IS_SEQ_START), shardings(TokenBatch, mesh))
    _, metrics = bench().make_gspmd_step(cfg, mesh, opt, constrain_acts=True)(state, batch)
    ref_loss, _, _ = reference_outputs()
    np.testing.assert_allclose(metrics["loss"], ref_loss, **LOSS)
    assert metrics["tokens_counted"] == np.sum(~IS_SEQ_START[:, 1:])
