"""Tests of seqshard/model/moe.py: the mixture-of-experts FFN against the reference's dense
routing (every expert applied to every token, weighted by the sparse gates), dropless and
with a capacity, on meshes splitting the experts over e beside d, c and t, under both
backwards; pipelined over p with every schedule; the router; balancing by bias; configs that
cannot work.

Tolerances (f32): the loss to 1e-6 relative; each gradient to 2e-5 of its leaf's largest
entry. Measured: loss within 2e-7, gradients within 1.1e-6 of their largest entries, on
(e, d, t) = (2, 2, 2), (4, 2, 1), (8, 1, 1) and (c, e, t) = (2, 2, 2), both backwards.
Pipelined on (p, e, d) = (2, 2, 2), 2 microbatches, against the reference's per-microbatch
loss: loss 1.0e-7, gradients within 1.1e-6 of their largest entries (gpipe, circular, 1f1b,
both backwards; also (p, c, e) = (2, 2, 2), (p, e, t) = (2, 2, 2), (p, e) = (4, 2)); the
statistics' counts exact, aux and z within 1.1e-7.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_weights import packed_batch, random_weights, tiny_model

from seqshard.batch import token_batch
from seqshard.config import ConfigError, load_config
from seqshard.mesh import mesh_of_sizes
from seqshard.model import logits_fn, loss_fn, reference_logits_fn, reference_loss_fn
from seqshard.model.config import MoEConfig
from seqshard.model.generate import Sampling, decode_mesh, generate
from seqshard.model.moe import capacity, route
from seqshard.model.pipeline.schedule import Pipeline
from seqshard.model.sharded import batch_terms_and_aux
from seqshard.model.weights import weight_structs
from seqshard.testing import compiled_hlo, count_dots
from seqshard.train.state import relayered


class Stats(NamedTuple):
    """The MoE stack's routing statistics (seqshard.model.moe.ROUTER_STATS), as attributes."""

    load: Any
    dropped: Any
    aux: Any
    z: Any
    tokens: Any


def batch_terms_and_stats(*args, **kwargs):
    """(the loss terms, the MoE stack's statistics) of batch_terms_and_aux."""
    terms, aux = batch_terms_and_aux(*args, **kwargs)
    return terms, Stats(**aux["moe_layers"]["moe"])


MOE = MoEConfig(
    n_experts=8, top_k=2, d_ff=32, n_shared=1, n_dense_layers=1,
    aux_loss_weight=1e-2, z_loss_weight=1e-3,
)  # fmt: skip
CFG = tiny_model(n_layers=3, n_kv=4, moe=MOE)
BATCH, LENGTH = 8, 16
TOKENS, STARTS = packed_batch(CFG.vocab, BATCH, LENGTH, seed=0)
WEIGHTS = random_weights(CFG, seed=0)


def on(mesh, weights):
    return jax.device_put(weights, jax.tree.map(lambda s: s.sharding, weight_structs(CFG, mesh)))


@functools.cache
def reference(cfg=CFG, weights_seed=0):
    fn = jax.jit(jax.value_and_grad(reference_loss_fn), static_argnums=3)
    return jax.tree.map(np.asarray, fn(WEIGHTS, TOKENS, STARTS, cfg))


def sharded(cfg, sizes, weights=WEIGHTS):
    mesh = mesh_of_sizes(sizes)
    fn = jax.jit(jax.value_and_grad(lambda w: loss_fn(w, TOKENS, STARTS, cfg, mesh)))
    return jax.tree.map(np.asarray, fn(on(mesh, weights)))


def assert_close(got, want) -> None:
    (loss, grads), (ref_loss, ref_grads) = got, want
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for (path, r), g in zip(
        jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads), strict=True
    ):
        if r.size:
            worst = np.max(np.abs(g - r)) / max(np.max(np.abs(r)), 1e-30)
            assert worst <= 2e-5, (jax.tree_util.keystr(path), worst)


MESHES = {
    "e2d2t2": {"e": 2, "d": 2, "t": 2},
    "e4d2": {"e": 4, "d": 2},
    "e8": {"e": 8},
    "c2e2t2": {"c": 2, "e": 2, "t": 2},
}


@pytest.mark.parametrize(
    "mesh,backward",
    [
        ("e2d2t2", "explicit"),
        ("c2e2t2", "explicit"),
        *(
            pytest.param(m, b, marks=pytest.mark.slow)
            for m, b in [
                ("e8", "autodiff"),
                ("e2d2t2", "autodiff"),
                ("e4d2", "explicit"),
                ("e4d2", "autodiff"),
                ("e8", "explicit"),
                ("c2e2t2", "autodiff"),
            ]
        ),
    ],
)
def test_sharded_equals_the_reference(mesh, backward):
    cfg = dataclasses.replace(CFG, backward=backward)
    assert_close(sharded(cfg, MESHES[mesh]), reference())


def test_a_zero_router_sends_every_token_to_the_same_experts_and_drops_none():
    """Every score ties: each token picks experts 0 and 1 (lowest indices), all on shard 0,
    the worst case the dropless buffers are sized for. Nothing is dropped; the loss and the
    gradients are the reference's."""
    zero = dataclasses.replace(
        WEIGHTS,
        moe_layers=dataclasses.replace(
            WEIGHTS.moe_layers,
            router=np.zeros_like(WEIGHTS.moe_layers.router),
            router_bias=np.zeros_like(WEIGHTS.moe_layers.router_bias),
        ),
    )
    mesh = mesh_of_sizes(MESHES["e2d2t2"])
    terms, stats = jax.jit(
        lambda w: batch_terms_and_stats(w, token_batch(TOKENS, STARTS), CFG, mesh)
    )(on(mesh, zero))
    assert float(jnp.sum(stats.dropped)) == 0
    np.testing.assert_array_equal(np.asarray(stats.load)[:, :2], BATCH * LENGTH)
    np.testing.assert_array_equal(np.asarray(stats.load)[:, 2:], 0)
    ref = jax.jit(jax.value_and_grad(reference_loss_fn), static_argnums=3)(
        zero, TOKENS, STARTS, CFG
    )
    assert_close(sharded(CFG, MESHES["e2d2t2"], zero), jax.tree.map(np.asarray, ref))


def test_a_capacity_that_drops_nothing_gives_the_dropless_loss_and_a_small_one_drops():
    mesh = mesh_of_sizes(MESHES["e2d2t2"])
    batch = token_batch(TOKENS, STARTS)

    def run(factor):
        cfg = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, capacity_factor=factor))
        return jax.jit(lambda w: batch_terms_and_stats(w, batch, cfg, mesh))(on(mesh, WEIGHTS))

    (dropless, _), (roomy, roomy_stats), (tight, tight_stats) = run(0.0), run(8.0), run(0.5)
    np.testing.assert_array_equal(np.asarray(roomy), np.asarray(dropless))
    assert float(jnp.sum(roomy_stats.dropped)) == 0
    copies = float(jnp.sum(tight_stats.tokens)) * MOE.top_k
    assert 0.3 < float(jnp.sum(tight_stats.dropped)) / copies < 0.9  # at least half dropped
    assert not np.allclose(np.asarray(tight), np.asarray(dropless))


def test_capacity_is_the_worst_case_when_dropless():
    assert capacity(CFG, tokens=64, e=2) == 64 * 2  # k = 2 <= E/e = 4
    assert capacity(CFG, tokens=64, e=8) == 64 * 1  # one expert per shard
    tight = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, capacity_factor=1.25))
    assert capacity(tight, tokens=64, e=2) == 80  # ceil(1.25 * 64 * 2 / 2)
    # Fault 2 of the second campaign: 1e6 planned 732 GiB of buffers per device. A factor past
    # the worst case sizes them as dropless does: more would only hold padding.
    huge = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, capacity_factor=1e6))
    assert capacity(huge, tokens=64, e=2) == capacity(CFG, tokens=64, e=2)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_the_router_gates_the_top_k_normalized(router):
    """Mixtral / Qwen3-MoE: softmax, the top k renormalized; DeepSeek-V3: sigmoid scores, the
    top k normalized. The bias moves the choice, not the gates."""
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(MOE, router=router))
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0, 0.5, 0.2, 0.1, -2.0]])
    ids, gates, _ = route(cfg, logits, jnp.zeros(8))
    assert ids.tolist() == [[0, 1]]
    scores = jax.nn.softmax(logits) if router == "softmax" else jax.nn.sigmoid(logits)
    np.testing.assert_allclose(gates, scores[:, :2] / scores[:, :2].sum(), rtol=1e-6)
    bias = jnp.zeros(8).at[7].set(10.0)
    ids, biased, _ = route(cfg, logits, bias)
    assert ids.tolist() == [[7, 0]]
    np.testing.assert_allclose(biased, scores[:, [7, 0]] / scores[:, [7, 0]].sum(), rtol=1e-6)


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["model.moe.n_experts=4", "model.moe.top_k=5"], ["model.moe.top_k=5", "n_experts=4"]),
        (["model.moe.n_experts=6", "mesh.e=4", "mesh.d=2"], ["model.moe.n_experts=6", "e = 4"]),
        (["mesh.e=2", "mesh.d=4"], ["mesh axis e=2", "model.moe.n_experts=0"]),
        (["model.moe.n_experts=4", "model.moe.n_dense_layers=2"], ["n_dense_layers=2", "0 .. "]),
        (["model.moe.n_experts=4", "model.moe.capacity_factor=-1"], ["capacity_factor", ">= 0"]),
        (
            ["model.moe.n_experts=4", "model.moe.n_dense_layers=1", "mesh.p=2", "mesh.d=4"],
            ["model.moe.n_dense_layers=1", "mesh.p=2", "Set model.moe.n_dense_layers=0"],
        ),
    ],
)
def test_configs_that_cannot_work_are_errors_naming_the_key(overrides, needles):
    base = [f"model.{k}={v}" for k, v in dataclasses.asdict(tiny_model()).items() if k != "moe"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, "model.n_layers=2", *overrides])
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_sharded_logits_equal_the_reference():
    mesh = mesh_of_sizes(MESHES["e2d2t2"])
    got = jax.jit(lambda w: logits_fn(w, TOKENS, STARTS, CFG, mesh))(on(mesh, WEIGHTS))
    want = jax.jit(reference_logits_fn, static_argnums=3)(WEIGHTS, TOKENS, STARTS, CFG)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_greedy_generation_with_experts_follows_the_reference():
    """The KV-cache decoder runs the dense and the MoE stacks (on a decode mesh, e = 1): each
    new token's cached logits equal the no-cache reference's on the sequence so far."""
    prompt = np.asarray(TOKENS[:2, :5])
    new = 4
    sampling = Sampling(max_new_tokens=new, temperature=0.0, return_logits=True)
    out, logits = generate(WEIGHTS, prompt, CFG, decode_mesh(2, CFG), sampling)
    out = np.asarray(out)
    starts = np.zeros(out.shape, bool)
    starts[:, 0] = True
    ref = np.asarray(jax.jit(reference_logits_fn, static_argnums=3)(WEIGHTS, out, starts, CFG))[
        :, 4 : 4 + new
    ]
    np.testing.assert_allclose(np.asarray(logits), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[:, 5:], np.argmax(ref, axis=-1))


@pytest.mark.parametrize("backward", ["explicit", pytest.param("autodiff", marks=pytest.mark.slow)])
def test_bf16_matmuls_accumulate_in_f32(backward):
    """compute_dtype=bfloat16 on e2d2t2: no dot of the compiled loss-and-gradient outputs
    bf16; 60 are bf16 x bf16 -> f32 (seqshard/shardlib/matmul.py's fast path). The 12
    f32 x f32 are the router's 4 (f32 by design: forward, its recomputation, dx, dw) and 8
    bf16 dots XLA:CPU upcasts itself whatever their output type: those whose lhs contracts a
    leading dimension alone (the shared experts' and the grouped matmuls' weight gradients
    over 'T M' rows, the gate-weighted combine and its transpose)."""
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16", backward=backward)
    mesh = mesh_of_sizes(MESHES["e2d2t2"])
    fn = jax.jit(jax.value_and_grad(lambda w: loss_fn(w, TOKENS, STARTS, cfg, mesh)))
    dots = count_dots(compiled_hlo(fn, on(mesh, WEIGHTS)))
    assert dots == {("bf16", "bf16", "f32"): 60, ("f32", "f32", "f32"): 12}


# -- pipelined over p -------------------------------------------------------------------------

PIPE_CFG = tiny_model(n_layers=4, n_kv=4, moe=dataclasses.replace(MOE, n_dense_layers=0))
PIPE_M = 2  # microbatches: rows i, i + 2, ... (4 rows each, split over d x e = 4)
PIPE_MESH = {"p": 2, "e": 2, "d": 2}


def _per_microbatch_reference(weights, tokens, starts):
    """The pipelined step's loss: each microbatch's mean loss (its balancing terms included)
    weighed by its counted positions."""
    total, count = 0.0, 0.0
    for i in range(PIPE_M):
        counted = jnp.sum(~starts[i::PIPE_M, 1:])
        loss = reference_loss_fn(weights, tokens[i::PIPE_M], starts[i::PIPE_M], PIPE_CFG)
        total, count = total + loss * counted, count + counted
    return total / count


@functools.cache
def _pipe_reference():
    """The per-microbatch reference's loss and gradients, and the statistics of the model at
    p = 1 run on each microbatch (loads, drops, tokens summed; aux, z their mean)."""
    weights = random_weights(PIPE_CFG, seed=2)
    want = jax.jit(jax.value_and_grad(_per_microbatch_reference))(weights, TOKENS, STARTS)
    mesh = mesh_of_sizes({"e": 2, "d": 2})
    placed = jax.device_put(
        weights, jax.tree.map(lambda s: s.sharding, weight_structs(PIPE_CFG, mesh))
    )
    fn = jax.jit(lambda w, b: batch_terms_and_stats(w, b, PIPE_CFG, mesh)[1])
    per = [fn(placed, token_batch(TOKENS[i::PIPE_M], STARTS[i::PIPE_M])) for i in range(PIPE_M)]
    stats = jax.tree.map(lambda *a: np.sum(a, axis=0), *per)
    stats = stats._replace(aux=stats.aux / PIPE_M, z=stats.z / PIPE_M)
    return weights, jax.tree.map(np.asarray, want), stats


def _pipelined(schedule, backward, sizes=PIPE_MESH):
    """The pipelined loss, gradients (in the model's layer order) and statistics (in it
    too) on a mesh of ``sizes`` (default p2 x e2 x d2)."""
    weights, _, _ = _pipe_reference()
    cfg = dataclasses.replace(PIPE_CFG, backward=backward)
    pipe = Pipeline(schedule, PIPE_M, repeats=2 if schedule == "circular" else 1)
    mesh = mesh_of_sizes(sizes)
    order = pipe.layer_order(sizes["p"], cfg.n_layers)
    placed = jax.device_put(weights, jax.tree.map(lambda s: s.sharding, weight_structs(cfg, mesh)))
    placed = relayered(placed, range(cfg.n_layers), order)

    def loss(w):
        (total, count), stats = batch_terms_and_stats(
            w, token_batch(TOKENS, STARTS), cfg, mesh, pipe
        )
        return total / count, stats

    (value, stats), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(placed)
    grads = relayered(grads, order, range(cfg.n_layers))
    stats = jax.tree.map(lambda a: np.asarray(a)[np.argsort(order)], stats)
    return jax.tree.map(np.asarray, (value, grads)), stats


@pytest.mark.parametrize(
    "schedule,backward,sizes",
    [
        # All slow: the pipelined MoE step's values are checked by default with accumulation
        # (tests/train/test_moe_training.py, p2e2d2) and its collectives by test_pipelined.py.
        *(
            pytest.param(s, b, m, marks=pytest.mark.slow)
            for s, b, m in [
                ("1f1b", "explicit", PIPE_MESH),
                ("1f1b", "autodiff", PIPE_MESH),
                ("gpipe", "explicit", PIPE_MESH),
                ("gpipe", "autodiff", PIPE_MESH),
                ("circular", "explicit", PIPE_MESH),
                ("circular", "autodiff", PIPE_MESH),
                ("1f1b", "explicit", {"p": 2, "c": 2, "e": 2}),  # the sequence over c
                ("gpipe", "autodiff", {"p": 2, "e": 2, "t": 2}),
                ("1f1b", "autodiff", {"p": 4, "e": 2}),  # one MoE layer per stage
            ]
        ),
    ],
    ids=lambda v: "".join(f"{k}{n}" for k, n in v.items()) if isinstance(v, dict) else v,
)
def test_pipelined_equals_the_per_microbatch_reference(schedule, backward, sizes):
    """2 microbatches: the loss (each microbatch's balancing terms from every stage's
    layers, weighed by its counted positions) and the gradients equal the reference's; the
    statistics equal the p = 1 model's on each microbatch, added up."""
    got, stats = _pipelined(schedule, backward, sizes)
    _, want, want_stats = _pipe_reference()
    assert_close(got, want)
    for name in ("load", "dropped", "tokens"):
        np.testing.assert_array_equal(getattr(stats, name), getattr(want_stats, name))
    for name in ("aux", "z"):
        np.testing.assert_allclose(getattr(stats, name), getattr(want_stats, name), rtol=1e-5)


def test_dense_first_layers_do_not_pipeline():
    cfg = dataclasses.replace(PIPE_CFG, moe=MOE)  # one dense layer
    mesh = mesh_of_sizes(PIPE_MESH)
    with pytest.raises(
        ValueError, match=r"model.moe.n_dense_layers=1 .* mesh.p=2.*n_dense_layers=0"
    ):
        batch_terms_and_stats(random_weights(cfg, mesh), token_batch(TOKENS, STARTS), cfg, mesh)


# -- group-limited routing (DeepSeek-V3) ------------------------------------------------------

GROUPED = dataclasses.replace(
    MOE, router="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5
)  # fmt: skip


def test_group_limited_routing_picks_within_the_best_groups():
    """Groups of 2 experts, scored by the sum of both; a token keeps the 2 best groups, then
    its top 2 experts among their 4. Expert 0 scores highest of all but its group (0, 1) is
    third: it is not chosen. Gates normalized, times routed_scaling_factor."""
    cfg = dataclasses.replace(CFG, moe=GROUPED)
    scores = jnp.array([[0.95, 0.0, 0.6, 0.55, 0.7, 0.7, 0.1, 0.1]])
    logits = jnp.log(scores / (1 - scores + 1e-9) + 1e-30)  # sigmoid(logits) = scores
    # group sums: 0.95, 1.15, 1.4, 0.2 -> groups 2 and 1: experts 4, 5, 2, 3
    ids, gates, _ = route(cfg, logits, jnp.zeros(8))
    assert sorted(ids.tolist()[0]) == [4, 5]
    np.testing.assert_allclose(gates, [[1.25, 1.25]], rtol=1e-5)  # 0.5 each x 2.5
    # The bias moves the groups' scores too: +0.5 on expert 1 makes group 0 the best (1.45).
    ids, _, _ = route(cfg, logits, jnp.zeros(8).at[1].set(0.5))
    assert ids.tolist()[0][0] == 0
    # norm_topk_prob false: the plain scores, scaled.
    plain = dataclasses.replace(cfg, moe=dataclasses.replace(GROUPED, norm_topk_prob=False))
    _, gates, _ = route(plain, logits, jnp.zeros(8))
    np.testing.assert_allclose(gates, [[0.7 * 2.5, 0.7 * 2.5]], rtol=1e-5)


@pytest.mark.parametrize(
    "moe,backward",
    [
        (GROUPED, "explicit"),
        pytest.param(GROUPED, "autodiff", marks=pytest.mark.slow),
        pytest.param(
            dataclasses.replace(GROUPED, norm_topk_prob=False, router="softmax"),
            "explicit",
            marks=pytest.mark.slow,
        ),
    ],
    ids=["grouped-explicit", "grouped-autodiff", "unnormalized-softmax"],
)
def test_group_limited_routing_sharded_equals_the_reference(moe, backward):
    cfg = dataclasses.replace(CFG, moe=moe, backward=backward)
    want = jax.jit(jax.value_and_grad(reference_loss_fn), static_argnums=3)(
        WEIGHTS, TOKENS, STARTS, cfg
    )
    assert_close(sharded(cfg, MESHES["e2d2t2"]), jax.tree.map(np.asarray, want))


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["model.moe.n_group=3"], ["model.moe.n_group=3", "n_experts=8"]),
        (["model.moe.n_group=8"], ["n_group=8", "two best experts"]),
        (["model.moe.n_group=2", "model.moe.topk_group=3"], ["topk_group=3", "n_group=2"]),
        (
            ["model.moe.n_group=4", "model.moe.topk_group=1", "model.moe.top_k=3"],
            ["model.moe.top_k=3", "topk_group=1"],
        ),
        (["model.moe.routed_scaling_factor=0"], ["routed_scaling_factor", "> 0"]),
    ],
)
def test_group_routing_configs_that_cannot_work_name_the_key(overrides, needles):
    base = [f"model.{k}={v}" for k, v in dataclasses.asdict(tiny_model()).items() if k != "moe"]
    moe = ["model.moe.n_experts=8", "model.moe.top_k=2"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, "model.n_layers=2", *moe, *overrides])
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))
