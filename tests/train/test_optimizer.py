"""Tests of seqshard.train.optimizer: the schedules, the decay mask, clipping."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from seqshard.config import TrainConfig
from seqshard.model import ModelConfig
from seqshard.model.weights import weight_structs
from seqshard.train.optimizer import decay_mask, lr_schedule, make_optimizer

T = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)


def test_cosine_warms_up_then_decays_to_the_floor():
    lr = lr_schedule(T)
    assert float(lr(0)) == 0.0
    assert float(lr(5)) == pytest.approx(5e-4)
    assert float(lr(10)) == pytest.approx(1e-3)
    assert float(lr(55)) == pytest.approx(1e-4 + 0.5 * 9e-4, rel=1e-5)  # half way down
    assert float(lr(100)) == pytest.approx(1e-4)
    values = [float(lr(s)) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_wsd_is_flat_until_the_decay_fraction():
    lr = lr_schedule(dataclasses.replace(T, schedule="wsd", decay_fraction=0.2))
    assert float(lr(10)) == float(lr(79)) == pytest.approx(1e-3)
    assert float(lr(90)) == pytest.approx(1e-3 - 0.5 * 9e-4, rel=1e-5)
    assert float(lr(100)) == pytest.approx(1e-4)


def test_decay_skips_exactly_the_norm_gains():
    w = weight_structs(ModelConfig(qk_norm=True))
    mask = decay_mask(w)
    assert mask.final_norm is False and mask.layers.ln1 is False and mask.layers.ln2 is False
    assert mask.layers.q_norm is False and mask.layers.k_norm is False  # model.qk_norm's
    decayed = [jax.tree_util.keystr(p) for p, m in jax.tree_util.tree_leaves_with_path(mask) if m]
    assert len(decayed) == len(jax.tree.leaves(w)) - 5


def test_weight_decay_moves_weights_but_not_gains():
    w = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), weight_structs(ModelConfig(n_layers=1)))
    opt = make_optimizer(dataclasses.replace(T, warmup_steps=0, weight_decay=0.5))
    zeros = jax.tree.map(jnp.zeros_like, w)
    updates, _ = opt.update(zeros, opt.init(w), w)
    new = optax.apply_updates(w, updates)
    np.testing.assert_array_equal(new.final_norm, 1.0)  # no gradient, no decay
    assert float(new.embed[0, 0]) == pytest.approx(1 - 1e-3 * 0.5)


def test_clipping_scales_the_gradient_to_the_norm_and_zero_disables_it():
    """Adam's first moment after one step is (1 - beta1) x the gradient it was given."""
    small = ModelConfig(vocab=8, d_model=4, n_layers=1, n_q_per_kv=1, n_kv=1, d_head=2, d_ff=4)
    w = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), weight_structs(small))
    big = jax.tree.map(lambda x: jnp.full_like(x, 100.0), w)
    norm = float(optax.tree.norm(big))
    for clip, seen in ((1.0, 100.0 / norm), (0.0, 100.0)):  # clipped to global norm 1
        opt = make_optimizer(dataclasses.replace(T, grad_clip=clip))
        _, state = opt.update(big, opt.init(w), w)
        mu = optax.tree_utils.tree_get(state, "mu")
        np.testing.assert_allclose(mu.embed, (1 - T.beta1) * seen, rtol=1e-5)
