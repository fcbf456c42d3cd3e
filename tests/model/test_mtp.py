"""Tests of seqshard/model/mtp.py: multi-token prediction (DeepSeek-V3's sequential modules)
against the reference, depth 1 and 2, with grouped-query and latent attention, dense and MoE,
on meshes splitting t, d, e and c (zigzag, c = 2 and 4: the token ahead of a position on
another device), under both backwards; targets never cross a packed document.

Tolerances (f32): the loss to 1e-5 relative, each gradient to 1e-4 of its leaf's largest
entry (the issue's bounds).
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

from seqshard.mesh import mesh_of_sizes
from seqshard.model import loss_fn, reference_loss_fn
from seqshard.model.config import MLAConfig, MoEConfig, MTPConfig
from seqshard.model.context import tokens_ahead
from seqshard.model.weights import weight_structs

BATCH, LENGTH = 8, 16
DENSE = tiny_model(n_layers=2, mtp=MTPConfig(depth=1, loss_weight=0.3))
MLA = tiny_model(
    attention="mla",
    n_q_per_kv=1,
    n_kv=4,
    d_head=12,
    mla=MLAConfig(
        q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
    ),
    moe=MoEConfig(
        n_experts=8, top_k=2, d_ff=32, n_shared=1, router="sigmoid", balance="bias",
        n_group=4, topk_group=2, routed_scaling_factor=2.5,
    ),
    mtp=MTPConfig(depth=2, loss_weight=0.5),
)  # fmt: skip
TOKENS, STARTS = packed_batch(DENSE.vocab, BATCH, LENGTH, seed=1)


@functools.cache
def _weights(cfg):
    return random_weights(cfg, seed=0)


@functools.cache
def reference(cfg):
    return reference_value_and_grad(cfg, _weights(cfg), TOKENS, STARTS)


def sharded(cfg, sizes):
    return sharded_value_and_grad(cfg, sizes, _weights(cfg), TOKENS, STARTS)


assert_close = assert_close_to_reference


CASES = {
    "dense-d2t4": (DENSE, {"d": 2, "t": 4}),
    "dense-depth2-c2d2t2": (dataclasses.replace(DENSE, mtp=MTPConfig(2, 0.3)), {"c": 2, "d": 2, "t": 2}),
    "dense-c4t2-ring": (dataclasses.replace(DENSE, context_impl="ring"), {"c": 4, "t": 2}),
    "mla-moe-depth2-e2d2t2": (MLA, {"e": 2, "d": 2, "t": 2}),
    "mla-moe-depth2-c2e2t2": (MLA, {"c": 2, "e": 2, "t": 2}),
    "mla-moe-depth2-c4e2": (MLA, {"c": 4, "e": 2}),
}  # fmt: skip


# By default two: t with autodiff, and zigzag c = 4 with e, MLA, MoE and groups under the
# explicit backward; every case and both backwards with -m slow.
DEFAULT = {("dense-d2t4", "autodiff"), ("mla-moe-depth2-c4e2", "explicit")}


@pytest.mark.parametrize(
    "case,backward",
    [
        (c, b) if (c, b) in DEFAULT else pytest.param(c, b, marks=pytest.mark.slow)
        for c in sorted(CASES)
        for b in ("explicit", "autodiff")
    ],
)
def test_sharded_equals_the_reference(case, backward):
    cfg, sizes = CASES[case]
    assert_close(sharded(dataclasses.replace(cfg, backward=backward), sizes), reference(cfg))


@pytest.mark.slow
def test_the_modules_add_their_weighted_mean_losses():
    """Without the modules the loss is the model's; with loss_weight 0 it is too (the modules
    run, their loss weighs nothing); a larger weight adds more."""
    base = dataclasses.replace(DENSE, mtp=MTPConfig(depth=0))
    sizes = {"d": 2, "t": 2}
    zero = dataclasses.replace(DENSE, mtp=MTPConfig(depth=1, loss_weight=0.0))
    w = random_weights(DENSE, seed=0)
    mesh = mesh_of_sizes(sizes)
    plain = {f.name: getattr(w, f.name) for f in dataclasses.fields(w) if f.name != "mtp"}

    def loss(cfg, weights):
        return float(loss_fn(weights, TOKENS, STARTS, cfg, mesh))

    no_mtp = loss(base, type(random_weights(base, seed=0))(**plain))  # the same other weights
    assert loss(zero, w) == pytest.approx(no_mtp, rel=1e-6)
    assert loss(DENSE, w) > no_mtp


def test_targets_never_cross_a_document_or_the_row():
    tokens = jnp.arange(8)[None]
    starts = jnp.array([[True, False, False, True, False, False, False, False]])
    ahead = tokens_ahead(tokens, starts, None, depth=2)
    # Module 1 embeds token i + 1 and predicts i + 2; module 2 embeds i + 2, predicts i + 3.
    np.testing.assert_array_equal(ahead.tokens[0, 0], [1, 2, 3, 4, 5, 6, 7, 0])
    np.testing.assert_array_equal(ahead.targets[1, 0], [3, 4, 5, 6, 7, 0, 0, 0])
    # Document 0 is positions 0-2, document 1 is 3-7.
    np.testing.assert_array_equal(ahead.counted[0, 0], [1, 0, 0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(ahead.counted[1, 0], [0, 0, 0, 1, 1, 0, 0, 0])
    mask = jnp.array([[True] * 5 + [False] * 3])
    masked = tokens_ahead(tokens, starts, mask, depth=1)
    np.testing.assert_array_equal(masked.counted[0, 0], [1, 0, 0, 0, 0, 0, 0, 0])  # 5 on: masked


PIPE_CFG = tiny_model(
    n_layers=2,
    moe=MoEConfig(n_experts=4, top_k=2, d_ff=32, router="sigmoid", balance="bias"),
    mtp=MTPConfig(depth=2, loss_weight=0.3),
)


def _pipelined(cfg, sizes, schedule):
    from seqshard.batch import token_batch
    from seqshard.model.pipeline.schedule import Pipeline
    from seqshard.model.sharded import batch_terms_and_aux

    mesh = mesh_of_sizes(sizes)
    structs = weight_structs(cfg, mesh)
    placed = jax.device_put(_weights(cfg), jax.tree.map(lambda s: s.sharding, structs))
    pipe = Pipeline(schedule=schedule, microbatches=2)

    def loss(w):
        (total, count), aux = batch_terms_and_aux(w, token_batch(TOKENS, STARTS), cfg, mesh, pipe)
        return total / count, aux

    (value, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(placed)
    return jax.tree.map(np.asarray, (value, grads)), jax.tree.map(np.asarray, aux)


@functools.cache
def _per_microbatch_reference(cfg):
    """The loss over 2 microbatches (rows i, i + 2, ...) as the pipeline sums it: each
    microbatch's mean (the modules' and balancing terms included) weighed by its counted
    positions."""

    def loss(w):
        totals, counts = [], []
        for i in range(2):
            tokens, starts = TOKENS[i::2], STARTS[i::2]
            n = jnp.sum(~jnp.asarray(starts)[:, 1:], dtype=jnp.float32)
            totals.append(reference_loss_fn(w, tokens, starts, cfg) * n)
            counts.append(n)
        return sum(totals) / sum(counts)

    return jax.tree.map(np.asarray, jax.jit(jax.value_and_grad(loss))(_weights(cfg)))


PIPE_MLA = dataclasses.replace(
    PIPE_CFG, attention="mla", n_q_per_kv=1, n_kv=4, d_head=12, mla=MLA.mla
)


@pytest.mark.parametrize(
    "schedule,backward,cfg",
    [
        pytest.param("gpipe", "explicit", PIPE_CFG, marks=pytest.mark.slow),
        pytest.param("gpipe", "autodiff", PIPE_CFG, marks=pytest.mark.slow),
        pytest.param("1f1b", "explicit", PIPE_CFG, marks=pytest.mark.slow),
        pytest.param("1f1b", "autodiff", PIPE_CFG, marks=pytest.mark.slow),
        ("1f1b", "explicit", PIPE_MLA),
        pytest.param("gpipe", "autodiff", PIPE_MLA, marks=pytest.mark.slow),
    ],
    ids=["gpipe-explicit", "gpipe-autodiff", "1f1b-explicit", "1f1b-autodiff",
         "mla-1f1b-explicit", "mla-gpipe-autodiff"],
)  # fmt: skip
def test_pipelined_runs_the_modules_on_the_last_stage(schedule, backward, cfg):
    got, aux = _pipelined(
        dataclasses.replace(cfg, backward=backward), {"p": 2, "e": 2, "d": 2}, schedule
    )
    assert_close(got, _per_microbatch_reference(cfg))
    # Each module's mean loss, averaged over the microbatches, on every stage.
    assert aux["mtp"]["mtp_entry"]["loss"].shape == (2,)
    assert np.all(aux["mtp"]["mtp_entry"]["loss"] > 0)
    assert aux["mtp"]["moe"]["load"].sum() > 0
