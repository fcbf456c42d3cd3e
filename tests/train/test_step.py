"""Tests for seqshard/train/step.py: exact gradient accumulation and the step's communication.

    accumulation   grads_and_loss with train.microbatches = 2, 4 equals 1 on the same batch,
                   with packed documents of uneven lengths so microbatches count different
                   numbers of positions (where a mean of microbatch means would be wrong)
    train step     the compiled make_train_step holds the loss-and-gradient's collectives plus
                   only the optimizer update's all-reduces of scalars (global norms: clipping
                   and the grad_norm metric); its metrics are the loss, norm and count

Everything runs on mesh d=2 x t=4 in f32 and is jitted once per microbatch count.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from model_weights import random_weights, tiny_model

from seqshard.batch import batch_structs, token_batch
from seqshard.config import Config, DataConfig, MeshConfig, TrainConfig, check_config
from seqshard.model import loss_sum_and_count
from seqshard.testing import (
    compiled_hlo,
    count_collectives,
    count_dots,
    fake_cpu_mesh,
    list_collectives,
)
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import (
    NONFINITE_KINDS,
    TrainState,
    init_train_state,
    no_nonfinite,
    shardings_of,
    train_state_structs,
)
from seqshard.train.step import grads_and_loss, make_train_step

MODEL = tiny_model()

BATCH, LENGTH = 8, 16
# Row r packs documents of DOC_LENGTHS[r] tokens: rows count 8 to 15 positions each.
DOC_LENGTHS = [2, 16, 3, 8, 2, 5, 16, 4]


@functools.cache
def mesh():
    return fake_cpu_mesh((2, 4), ("d", "t"))


@functools.cache
def config(microbatches: int) -> Config:
    cfg = Config(
        model=MODEL,
        mesh=MeshConfig(d=2, t=4),
        data=DataConfig(vocab_size=MODEL.vocab),
        train=TrainConfig(
            batch_size=BATCH, seq_len=LENGTH, microbatches=microbatches, warmup_steps=0
        ),
    )
    check_config(cfg)
    return cfg


def uneven_batch() -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(0).integers(0, MODEL.vocab, (BATCH, LENGTH)).astype(np.int32)
    positions = np.arange(LENGTH)[None, :]
    is_seq_start = positions % np.array(DOC_LENGTHS)[:, None] == 0
    return tokens, is_seq_start


TOKENS, IS_SEQ_START = uneven_batch()


def counted_per_microbatch(k: int) -> list[int]:
    """Positions with a next token in their document, per microbatch (rows m, m+k, ...)."""
    counted = ~IS_SEQ_START[:, 1:]
    return [int(counted[m::k].sum()) for m in range(k)]


@functools.cache
def weights():
    return random_weights(MODEL, mesh())


# grads_and_loss(weights, batch, cfg, mesh), the config and mesh static
grads_and_loss_jit = jax.jit(grads_and_loss, static_argnums=(2, 3))


@functools.cache
def accumulated(k: int):
    """(mean gradient, mean loss, count) as numpy, over k microbatches."""
    out = grads_and_loss_jit(weights(), token_batch(TOKENS, IS_SEQ_START), config(k), mesh())
    return jax.tree.map(np.asarray, out[:3])  # (no routing statistics: a dense model)


# ---------------------------------------------------------------------------------------------
# Gradient accumulation


@pytest.mark.parametrize("k", [2, 4])
def test_microbatches_count_different_numbers_of_positions(k):
    counts = counted_per_microbatch(k)
    assert len(set(counts)) > 1, counts


@pytest.mark.parametrize("k", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_accumulated_gradients_equal_the_full_batch(k):
    """Sums over microbatches, divided once: the full-batch mean up to f32 summation order
    (measured: equal losses, gradients within 1.8e-7 of entries up to 0.19)."""
    grads, loss, count = accumulated(k)
    full_grads, full_loss, full_count = accumulated(1)
    assert count == full_count == sum(counted_per_microbatch(k))
    np.testing.assert_allclose(loss, full_loss, rtol=1e-6)
    for (path, f), g in zip(
        jax.tree_util.tree_leaves_with_path(full_grads), jax.tree.leaves(grads), strict=True
    ):
        np.testing.assert_allclose(g, f, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


# the summed loss and count of a microbatch's rows, jitted once per microbatch size
loss_sum_and_count_jit = jax.jit(loss_sum_and_count, static_argnums=(3, 4))


@pytest.mark.parametrize("k", [2, 4])
def test_a_mean_of_microbatch_means_would_differ(k):
    """What the test above rules out: weighting microbatches equally, whatever their counts."""
    per_micro = [
        np.asarray(
            loss_sum_and_count_jit(weights(), TOKENS[m::k], IS_SEQ_START[m::k], MODEL, mesh())
        )
        for m in range(k)
    ]
    totals, counts = np.array(per_micro).T
    assert counts.tolist() == counted_per_microbatch(k)
    _, loss, _ = accumulated(1)
    np.testing.assert_allclose(totals.sum() / counts.sum(), loss, rtol=1e-6)
    mean_of_means = np.mean(totals / counts)
    # measured: 2.3e-2 (k=2) and 8.3e-3 (k=4) away; the test above allows 4e-6
    assert abs(mean_of_means - loss) > 1e-3


# ---------------------------------------------------------------------------------------------
# The train step: loss-and-gradient collectives, plus the optimizer's scalar all-reduces


@functools.cache
def train_step():
    cfg = config(1)
    opt = make_optimizer(cfg.train)
    return make_train_step(cfg, mesh(), opt), opt


def abstract_batch():
    return batch_structs(BATCH, LENGTH)


def test_train_step_adds_only_scalar_all_reduces():
    """The optimizer update is elementwise on identically sharded arrays, so it moves nothing;
    only global norms cross devices: each device's sum of squares over its blocks, all-reduced
    as scalars (XLA combines them into tuples, by layout). Clipping and the grad_norm metric
    each take one norm."""
    step, opt = train_step()
    state = train_state_structs(MODEL, mesh(), opt)
    grads_args = (state.weights, abstract_batch(), config(1), mesh())
    step_counts = count_collectives(step, state, abstract_batch())
    grad_counts = count_collectives(grads_and_loss_jit, *grads_args)
    extra = {kind: step_counts[kind] - grad_counts[kind] for kind in step_counts}
    assert extra["all-gather"] == extra["reduce-scatter"] == 0, extra
    assert extra["all-to-all"] == extra["collective-permute"] == 0, extra
    assert extra["all-reduce"] > 0, "the global norms need an all-reduce"

    step_calls = list_collectives(step, state, abstract_batch(), mesh=mesh())
    update = [c for c in step_calls if c.phase == "update"]
    assert len(update) == extra["all-reduce"]
    n_weights = len(jax.tree.leaves(state.weights))
    for c in update:
        assert c.kind == "all-reduce" and not c.in_loop, c
        assert all(a == ("f32", ()) for a in c.result_arrays), c.result_type
        assert len(c.result_arrays) <= 2 * n_weights, c.result_type  # two norms' partial sums
    # ...and the rest of the step is the loss and gradient, collective for collective
    grad_calls = list_collectives(grads_and_loss_jit, *grads_args, mesh=mesh())

    def key(c):
        return c.kind, c.phase, c.in_loop, c.axes

    rest = [c for c in step_calls if c.phase != "update"]
    assert collections.Counter(map(key, rest)) == collections.Counter(map(key, grad_calls))


def test_train_step_metrics_and_update():
    """The step's metrics, and its update: the optimizer applied to the accumulated gradients."""
    step, opt = train_step()
    before = jax.tree.map(np.asarray, weights())
    fresh = TrainState(
        step=np.int32(0), weights=before, opt_state=opt.init(before), guard=no_nonfinite()
    )
    state = jax.device_put(fresh, shardings_of(train_state_structs(MODEL, mesh(), opt)))
    grads, loss, count = accumulated(1)
    new_state, metrics = step(state, token_batch(TOKENS, IS_SEQ_START))  # donates state
    metrics = jax.tree.map(np.asarray, metrics)
    assert int(new_state.step) == 1
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
    np.testing.assert_allclose(metrics["tokens_counted"], count)
    np.testing.assert_allclose(
        metrics["grad_norm"], np.sqrt(sum((g**2).sum() for g in jax.tree.leaves(grads))), rtol=1e-5
    )
    np.testing.assert_allclose(metrics["lr"], config(1).train.lr)  # no warmup: peak lr at step 0

    @jax.jit
    def by_hand(w, g):
        updates, _ = opt.update(g, opt.init(w), w)
        return optax.apply_updates(w, updates)

    expected = jax.tree.map(np.asarray, by_hand(before, grads))
    after = jax.tree.map(np.asarray, new_state.weights)
    assert_trees_close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7)
    for (path, e), a, b in zip(
        jax.tree_util.tree_leaves_with_path(expected),
        jax.tree.leaves(after),
        jax.tree.leaves(before),
        strict=True,
    ):
        assert_trees_close(a, e, err_msg=jax.tree_util.keystr(path))
        # every weight moved (a zero-size one, q_norm without qk_norm, has nothing to move)
        assert a.size == 0 or not np.array_equal(a, b), jax.tree_util.keystr(path)
    # and the weights keep the layouts their types declare
    shardings = jax.tree.map(lambda w: w.sharding, weights())
    assert jax.tree.map(lambda w: w.sharding, new_state.weights) == shardings


# ---------------------------------------------------------------------------------------------
# Non-finite steps: no update, recorded on device (train.nonfinite)


def poisoned_loss_terms(cfg: Config):
    """The model's loss terms, made NaN for a batch whose first token is 0 (a poisoned batch)."""
    from seqshard.model.sharded import batch_loss_terms

    def terms(w, batch):
        poison = jnp.where(batch.tokens[0, 0] == 0, jnp.nan, 1.0)
        return batch_loss_terms(w, batch, cfg.model, mesh()) * poison

    return terms


def run_steps(nonfinite: str, poisoned: list[bool], max_skips: int = 10):
    """Weights after each step (numpy) and the final guard, for a sequence of batches."""
    cfg = dataclasses.replace(
        config(1),
        train=dataclasses.replace(
            config(1).train, nonfinite=nonfinite, max_nonfinite_skips=max_skips
        ),
    )
    opt = make_optimizer(cfg.train)
    step = make_train_step(cfg, mesh(), opt, loss_terms=poisoned_loss_terms(cfg))
    state = init_train_state(MODEL, mesh(), opt, jax.random.key(0))
    seen = [jax.tree.map(np.asarray, state.weights)]
    for bad in poisoned:
        tokens = TOKENS.copy()
        tokens[0, 0] = 0 if bad else 1
        state, metrics = step(state, token_batch(tokens, IS_SEQ_START))
        assert np.isnan(metrics["loss"]) == bad
        seen.append(jax.tree.map(np.asarray, state.weights))
    return seen, jax.device_get(state.guard), int(state.step)


def same(a, b) -> bool:
    return all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_stop_applies_no_update_from_the_first_non_finite_step():
    seen, guard, steps = run_steps("stop", [False, True, False])
    assert not same(seen[1], seen[0])  # a finite step updates
    assert same(seen[2], seen[1]) and same(seen[3], seen[1])  # none after the NaN step
    assert steps == 3 and all(np.isfinite(x).all() for x in jax.tree.leaves(seen[3]))
    assert (int(guard.total), int(guard.in_a_row), int(guard.last_step)) == (1, 0, 2)
    assert NONFINITE_KINDS[int(guard.last_loss)] == "nan"


def test_skip_goes_on_and_stops_updating_after_max_in_a_row():
    seen, guard, _ = run_steps("skip", [True, False, True, True, False], max_skips=2)
    assert same(seen[1], seen[0])  # skipped
    assert not same(seen[2], seen[1])  # the next finite batch updates
    assert same(seen[4], seen[2])  # two skipped in a row...
    assert same(seen[5], seen[4])  # ...is the limit: the loop stops when it reads the guard
    assert (int(guard.total), int(guard.in_a_row), int(guard.last_step)) == (3, 0, 4)


# ---------------------------------------------------------------------------------------------
# bf16: every matmul of the step on the fast path


@pytest.mark.parametrize("backward", ["explicit", pytest.param("autodiff", marks=pytest.mark.slow)])
def test_bf16_step_runs_every_matmul_bf16_in_f32_out(backward):
    """With compute_dtype=bfloat16, each dot of the compiled loss-and-gradient (forward,
    backward, attention, head) is bf16 x bf16 -> f32 (seqshard/shardlib/matmul.py: the fast
    path on CPU): none bf16 -> bf16, and none f32 x f32, which is how XLA:CPU runs a bf16 dot
    it upcasts (measured before seqshard.shardlib.matmul: 24 of the 28 explicit, 25 of 28
    autodiff; a loop body counts once)."""
    model = dataclasses.replace(MODEL, compute_dtype="bfloat16", backward=backward)
    cfg = dataclasses.replace(config(1), model=model)
    hlo = compiled_hlo(
        grads_and_loss_jit, weights(), token_batch(TOKENS, IS_SEQ_START), cfg, mesh()
    )
    assert count_dots(hlo) == {("bf16", "bf16", "f32"): 28}


# ---------------------------------------------------------------------------------------------
# model.fp8=delayed: the amax history moves after the step


def _delayed_run(microbatches: int, steps: int):
    model = dataclasses.replace(MODEL, fp8="delayed", fp8_history=3)
    cfg = dataclasses.replace(config(microbatches), model=model)
    opt = make_optimizer(cfg.train)
    state = init_train_state(model, mesh(), opt, jax.random.key(0))
    first = jax.device_get(state.weights)
    step = make_train_step(cfg, mesh(), opt)
    histories, saturated = [], []
    for _ in range(steps):
        state, metrics = step(state, token_batch(TOKENS, IS_SEQ_START))  # donates state
        histories.append(jax.device_get(state.weights.layers))
        saturated.append(float(metrics["fp8_saturated/swiglu"]))
    return first, histories, saturated


@pytest.mark.slow
def test_fp8_delayed_history_takes_the_steps_amaxes():
    """After a step each site's history holds the step's amax first, older ones shifted on;
    a weight's amax is its largest |entry| before the update, the same in both microbatches:
    their max, not their sum."""
    first, (one, two), saturated = _delayed_run(microbatches=2, steps=2)
    w_gate = first.layers.w_gate  # [layers, M, F]; site 1 of the SwiGLU block
    np.testing.assert_array_equal(
        one.swiglu_fp8_history[:, 1, 0], np.max(np.abs(w_gate), axis=(1, 2))
    )
    assert np.all(one.swiglu_fp8_history[..., 0] > 0)
    assert np.all(one.attention_fp8_history[..., 0] > 0)
    assert np.all(one.attention_fp8_history[..., 1:] == 0)  # nothing before the first step
    np.testing.assert_array_equal(two.swiglu_fp8_history[..., 1], one.swiglu_fp8_history[..., 0])
    np.testing.assert_array_equal(two.swiglu_fp8_history[..., 2], 0)
    assert saturated[0] == 0  # the first step scales by its current amaxes
