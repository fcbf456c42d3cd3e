"""Tests for seqshard/model/pipeline/pipelined.py: the model pipelined over mesh axis p.

reference     loss and every weight's gradient equal reference_loss_fn and its jax.grad
              on meshes (p, d, c, t) = (2,2,1,2), (4,2,1,1), (2,4,1,1), (8,1,1,1), for
              gpipe, circular and 1f1b, m = p and 2p microbatches, packed documents, each remat
              policy (f32: loss 2e-6 relative, gradients 2e-5 of each weight's largest)
HLO           the compiled train step's collectives over p: the schedule's two
              collective-permutes (activations forward, cotangents back) and all-reduces
              of the loss and the replicated weights' gradients; nothing else crosses p
              (no all-gather of another stage's weights); no collective that may overtake
              a loop's on XLA's CPU runtime (seqshard.shardlib.collective_order); with
              experts on (p, e, d) = (2, 2, 2) the same, the exchanges over e in the tick
              loop (their values: tests/model/test_moe.py)
memory        1f1b's compiled temp bytes per device below gpipe's at m = 4p
training      20 steps of each schedule track the p = 1 run (gradient accumulation over
              the same microbatches) within 1e-5; checkpoints written with p = 2 restore
              with p = 1 and p = 4; eval runs pipelined
config        what p > 1 refuses, each naming the key and the fix
"""

from __future__ import annotations

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_weights import packed_batch, random_weights, tiny_model

from seqshard.batch import batch_structs, token_batch
from seqshard.cli import export_checkpoint, export_config
from seqshard.config import (
    Config,
    ConfigError,
    DataConfig,
    MeshConfig,
    TrainConfig,
    check_config,
    load_config,
)
from seqshard.hf.load import load_hf_weights
from seqshard.mesh import training_mesh
from seqshard.model.config import MoEConfig
from seqshard.model.pipeline.schedule import Pipeline
from seqshard.model.reference import reference_loss_fn
from seqshard.model.sharded import batch_loss_terms
from seqshard.model.weights import weight_structs
from seqshard.plan.show import pipeline_report, pipeline_shifts
from seqshard.shardlib.collective_order import unordered_after_loops
from seqshard.shardlib.comms import collectives
from seqshard.testing import compiled_hlo, fake_cpu_mesh
from seqshard.train.checkpoint import latest_state
from seqshard.train.loop import train
from seqshard.train.metrics import read_metrics
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import layer_order, relayered, train_state_structs
from seqshard.train.step import make_train_step

MESHES = [(2, 2, 1, 2), (4, 2, 1, 1), (2, 4, 1, 1), (8, 1, 1, 1)]
BATCH, LENGTH, LAYERS = 16, 16, 8
LOSS_RTOL, GRAD_TOL = 2e-6, 2e-5  # measured worst: 1.0e-7 and 4.9e-6


def _mesh(shape):
    return fake_cpu_mesh(shape, ("p", "d", "c", "t"))


def _cfg(remat="saved", layers=LAYERS, backward="autodiff"):
    return tiny_model(n_layers=layers, n_kv=2, backward=backward, remat=remat)


@functools.cache
def _reference(remat, layers=LAYERS):
    cfg = _cfg(remat, layers)
    w = random_weights(cfg, seed=1)
    tokens, starts = packed_batch(cfg.vocab, BATCH, LENGTH, seed=3)
    loss, grads = jax.jit(jax.value_and_grad(reference_loss_fn), static_argnums=3)(
        w, tokens, starts, cfg
    )
    return w, tokens, starts, float(loss), grads


def _pipelined_value_and_grad(shape, schedule, m, remat, backward):
    """The pipelined loss and gradients, the weights laid out in the schedule's layer order
    (circular: v = 2 blocks per stage) and the gradients brought back to the model's."""
    v = 2 if schedule == "circular" else 1
    layers = _layers(shape, schedule)
    cfg = _cfg(remat, layers, backward)
    mesh = _mesh(shape)
    w_np, tokens, starts, _, _ = _reference(remat, layers)
    w = jax.tree.map(lambda x, s: jax.device_put(x, s.sharding), w_np, weight_structs(cfg, mesh))
    pipe = Pipeline(schedule, m, repeats=v)
    order = pipe.layer_order(shape[0], layers)

    def loss(w):
        total, count = batch_loss_terms(w, token_batch(tokens, starts), cfg, mesh, pipe)
        return total / count

    loss, grads = jax.jit(jax.value_and_grad(loss))(relayered(w, range(layers), order))
    return loss, relayered(grads, order, range(layers))


def _layers(shape, schedule) -> int:
    """8 layers; 16 for the circular schedule's 2 blocks on each of 8 stages."""
    return max(LAYERS, 2 * shape[0]) if schedule == "circular" else LAYERS


CASES = [
    (shape, schedule, m_of_p, remat, backward)
    for shape in MESHES
    for schedule in ("gpipe", "circular", "1f1b")
    for m_of_p in (1, 2)
    for remat in ("saved", "full", "none")
    for backward in ("explicit", "autodiff")
]
# In the default run: each schedule, each mesh of p = 2, 4, 8, m, remat and the stage's backward
# varied; the other cases under -m slow.
DEFAULT = {
    ((2, 2, 1, 2), "1f1b", 2, "full", "autodiff"),
    ((4, 2, 1, 1), "circular", 1, "none", "explicit"),
    ((8, 1, 1, 1), "gpipe", 1, "full", "explicit"),
}  # 1f1b with the hand-written stage backward: tests/model/test_loss_mask.py (p2d2t2)
assert set(CASES) >= DEFAULT
# The sequence split over c inside each stage (context_impl allgather, the default).
CASES += [
    ((2, 1, 2, 2), "gpipe", 1, "saved", "explicit"),
    ((2, 1, 2, 2), "1f1b", 2, "full", "autodiff"),
]
DEFAULT.add(((2, 1, 2, 2), "1f1b", 2, "full", "autodiff"))


@pytest.mark.parametrize(
    "shape, schedule, m_of_p, remat, backward",
    [c if c in DEFAULT else pytest.param(*c, marks=pytest.mark.slow) for c in CASES],
    ids=lambda v: "p{}d{}c{}t{}".format(*v) if isinstance(v, tuple) else str(v),
)
def test_pipelined_loss_and_gradients_equal_the_reference(shape, schedule, m_of_p, remat, backward):
    m = m_of_p * shape[0]
    loss, grads = _pipelined_value_and_grad(shape, schedule, m, remat, backward)
    *_, want_loss, want_grads = _reference(remat, _layers(shape, schedule))
    np.testing.assert_allclose(float(loss), want_loss, rtol=LOSS_RTOL)
    for path, got, want in zip(
        jax.tree_util.tree_leaves_with_path(grads),
        jax.tree.leaves(grads),
        jax.tree.leaves(want_grads),
        strict=True,
    ):
        if not np.size(want):  # q_norm, k_norm without model.qk_norm
            continue
        scale = np.max(np.abs(want))
        err = np.max(np.abs(np.asarray(got) - np.asarray(want))) / scale
        assert err < GRAD_TOL, (jax.tree_util.keystr(path[0]), err)


def step_config(shape, schedule, m, batch=BATCH, backward="autodiff"):
    model = _cfg(backward=backward)
    p, d, c, t = shape
    config = Config(
        model=model,
        mesh=MeshConfig(p=p, d=d, c=c, t=t),
        data=DataConfig(vocab_size=model.vocab),
        train=TrainConfig(
            batch_size=batch,
            seq_len=LENGTH,
            microbatches=m,
            pipeline_schedule=schedule,
            pipeline_repeats=2 if schedule == "circular" else 1,
        ),
    )
    check_config(config)
    return config


def _train_step_and_args(shape, schedule, m, batch=BATCH, backward="autodiff"):
    config = step_config(shape, schedule, m, batch, backward)
    model = config.model
    mesh = _mesh(shape)
    opt = make_optimizer(config.train)
    step = make_train_step(config, mesh, opt)
    return step, train_state_structs(model, mesh, opt), batch_structs(batch, LENGTH, mesh), mesh


@pytest.mark.parametrize(
    "schedule, backward",
    [
        ("gpipe", "explicit"),
        ("1f1b", "autodiff"),
        pytest.param("circular", "explicit", marks=pytest.mark.slow),
    ],
)
def test_only_the_schedules_shifts_and_the_replicated_weights_sums_cross_p(schedule, backward):
    """On (p, d, c, t) = (2, 2, 1, 2), each schedule (circular: 2 blocks per stage): two
    collective-permutes over p (the activation and its cotangent, each inside the tick loop),
    all-reduces over p of the loss and of the gradients of the weights every stage holds
    (embedding, final norm, unembedding), and no
    other collective over p: no stage gathers another stage's weights. `seqshard show`
    predicts the shifts' bytes. No collective can overtake a loop's (collective_order)."""
    step, state, batch, mesh = _train_step_and_args((2, 2, 1, 2), schedule, 4, backward=backward)
    text = compiled_hlo(step, state, batch)
    calls = collectives(text, mesh)
    assert unordered_after_loops(text) == []  # one order on every device (collective_order)
    over_p = [c for c in calls if "p" in c.axes]
    permutes = [c for c in over_p if c.kind == "collective-permute"]
    assert len(permutes) == 2 and all(c.axes == ("p",) and c.in_loop for c in permutes)
    assert {c.kind for c in over_p} == {"collective-permute", "all-reduce"}
    assert not any(c.kind == "all-gather" and "p" in c.axes for c in calls)
    reduced = [c for c in over_p if c.kind == "all-reduce"]
    assert reduced and all(not c.in_loop for c in reduced)
    # What is summed over p is the replicated weights' gradients (and scalars): no layer's.
    structs = weight_structs(_cfg(), mesh)
    replicated = [structs.embed, structs.final_norm, structs.unembed]
    block = sum(4 * np.prod(s.sharding.shard_shape(s.shape)) for s in replicated)
    assert sum(c.result_bytes for c in reduced) <= block + 4 * 64
    # `seqshard show`'s pipeline report, from the config alone: its shifts per step and bytes
    # per shift are the compiled collective-permutes' (calls x result bytes).
    config = step_config((2, 2, 1, 2), schedule, 4)
    shifts, shifted = pipeline_shifts(config)
    assert {c.result_bytes for c in permutes} == {shifted}
    assert sum(c.calls_per_step for c in permutes) == shifts
    report = pipeline_report(config)
    bubble = config.train.pipeline().on(2).bubble_fraction
    assert f"train.pipeline_schedule={schedule}" in report
    assert f"bubble fraction: {bubble:.3f}" in report


@pytest.mark.parametrize(
    "schedule, backward",
    [
        ("1f1b", "explicit"),
        pytest.param("gpipe", "autodiff", marks=pytest.mark.slow),
        pytest.param("circular", "explicit", marks=pytest.mark.slow),
    ],
)
def test_the_pipelined_moe_step_crosses_p_only_by_shifts_and_sums(schedule, backward):
    """With experts, on (p, e, d) = (2, 2, 2) (4 MoE layers, 2 microbatches): over p, the
    schedule's collective-permutes in the tick loop and, outside it, all-reduces (the loss
    and balancing terms, the statistics placed by stage, the replicated weights' gradients);
    no stage gathers another's weights; the exchanges over e run inside the tick loop; no
    collective can overtake a loop's (collective_order). (step_comms' audit does not model
    the tick loop, for the dense pipelined step either: not compared here.)"""
    moe = MoEConfig(n_experts=4, top_k=2, d_ff=32, n_shared=1, z_loss_weight=1e-3)
    model = tiny_model(n_layers=4, n_kv=2, backward=backward, moe=moe)
    config = Config(
        model=model,
        mesh=MeshConfig(p=2, e=2, d=2),
        data=DataConfig(vocab_size=model.vocab),
        train=TrainConfig(
            batch_size=8,
            seq_len=LENGTH,
            microbatches=2,
            pipeline_schedule=schedule,
            pipeline_repeats=2 if schedule == "circular" else 1,
        ),
    )
    check_config(config)
    mesh = training_mesh(config.mesh.sizes())
    opt = make_optimizer(config.train)
    step = make_train_step(config, mesh, opt)
    text = compiled_hlo(step, train_state_structs(model, mesh, opt), batch_structs(8, LENGTH, mesh))
    assert unordered_after_loops(text) == []  # one order on every device (collective_order)
    calls = collectives(text, mesh)
    over_p = [c for c in calls if "p" in c.axes]
    assert {c.kind for c in over_p} == {"collective-permute", "all-reduce"}
    assert all(c.in_loop for c in over_p if c.kind == "collective-permute")
    assert all(not c.in_loop for c in over_p if c.kind == "all-reduce")
    assert not any(c.kind == "all-gather" and "p" in c.axes for c in calls)
    assert any(c.kind == "all-to-all" and c.axes == ("e",) and c.in_loop for c in calls)


def test_1f1b_needs_less_temporary_memory_than_gpipe():
    """At m = 4p on p = 4 (the model, remat=saved, (p, d, c, t) = (4, 2, 1, 1)): XLA's temp
    bytes per device of the 1F1B train step are below GPipe's (measured 0.26x): GPipe keeps
    every tick's stage activations for its backward, 1F1B at most 2p - 1 stage inputs."""
    temps = {}
    for schedule in ("gpipe", "1f1b"):
        step, state, batch, _ = _train_step_and_args((4, 2, 1, 1), schedule, 16, batch=32)
        compiled = step.lower(state, batch).compile()
        temps[schedule] = compiled.memory_analysis().temp_size_in_bytes
        assert unordered_after_loops(compiled.as_text()) == []
    print(f"1f1b / gpipe temp bytes: {temps['1f1b'] / temps['gpipe']:.3f} ({temps})")
    assert temps["1f1b"] < temps["gpipe"]


# ---------------------------------------------------------------------------------------------
# Training runs: the tiny model of conftest's tiny_overrides, 4 layers, 4 microbatches


def _quiet(_msg: str) -> None:
    pass


def _pipelined(p: int, d: int, schedule: str = "gpipe") -> list[str]:
    return [
        f"mesh.p={p}",
        f"mesh.d={d}",
        "model.n_layers=4",
        "train.microbatches=4",
        f"train.pipeline_schedule={schedule}",
    ]


def _train(overrides):
    return train(load_config(None, overrides), log=_quiet, tty=False)


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.mark.slow
def test_twenty_steps_of_each_schedule_track_the_unpipelined_run(tmp_path, tiny_overrides):
    """20 steps of 4 microbatches: gpipe and 1f1b on p=2 x d=2 x t=2 against p = 1
    (d=4 x t=2, gradient accumulation over the same microbatches): every step's loss within
    1e-5 relative."""
    losses = {}
    for name, p, d in (("p1", 1, 4), ("gpipe", 2, 2), ("1f1b", 2, 2)):
        runs = tmp_path / "runs"
        flags = dict(steps=20, eval_every=0, batch_size=16)
        _train(
            [*tiny_overrides(runs, name, **flags), *_pipelined(p, d, name.replace("p1", "gpipe"))]
        )
        losses[name] = _losses(runs / name)
    steps = sorted(losses["p1"])
    assert steps == list(range(1, 21))
    for name in ("gpipe", "1f1b"):
        np.testing.assert_allclose(
            [losses[name][s] for s in steps], [losses["p1"][s] for s in steps], rtol=1e-5
        )


# Both slow (a minute each on 2 cores): the layer orders across p are checked by default by
# test_the_circular_layer_order_and_its_inverse and the resumes on other meshes by test_loop.
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["circular", "1f1b"])
def test_a_pipelined_checkpoint_restores_with_other_p_and_trains_on(
    tmp_path, tiny_overrides, schedule
):
    """A run on p=2 x d=2 x t=2 (3 steps; circular: 2 blocks of 2 layers per stage, stored
    every p-th block) writes a checkpoint that restores on p = 1 (d=4 x t=2) and p = 4
    (p=4 x t=2) to the same model, layer for layer; resumed for a fourth step on each (eval
    pipelined on p = 4), their losses agree within 1e-5. Its export holds the model's layers
    in the model's order."""
    runs = tmp_path / "runs"
    two = [
        *tiny_overrides(runs, "two", steps=3, eval_every=0, batch_size=16),
        *_pipelined(2, 2, schedule),
        "model.n_layers=8",
        f"train.pipeline_repeats={2 if schedule == 'circular' else 1}",
    ]
    _train(two)
    cfg = load_config(None, two)
    mesh = training_mesh(cfg.mesh.sizes())
    stored = latest_state(runs / "two", cfg, mesh, log=_quiet).weights
    want = relayered(stored, layer_order(cfg, 2), range(8))  # the model's order
    resumed = {}
    for p, d in ((1, 4), (4, 1)):
        shutil.copytree(runs / "two", runs / f"p{p}")
        other = [*two, f"mesh.p={p}", f"mesh.d={d}", f"run.name=p{p}"]
        other_cfg = load_config(None, other)
        got = latest_state(
            runs / f"p{p}", other_cfg, training_mesh(other_cfg.mesh.sizes()), log=_quiet
        ).weights
        got = relayered(got, layer_order(other_cfg, p), range(8))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        resumed[p] = _train([*other, "train.steps=4", "train.eval_every=4"])
    assert resumed[1].step == resumed[4].step == 4
    np.testing.assert_allclose(resumed[4].val_loss, resumed[1].val_loss, rtol=1e-5)
    np.testing.assert_allclose(_losses(runs / "p4")[4], _losses(runs / "p1")[4], rtol=1e-5)
    # Exported from the stages' order, imported at p = 1: the model's layers in order.
    out = tmp_path / "hf"
    export_checkpoint(runs / "two", export_config(cfg, out), cfg, mesh, log=_quiet)
    flat = load_config(None, [*two, "mesh.p=1", "mesh.d=4"])
    imported = load_hf_weights(out, flat.model, training_mesh(flat.mesh.sizes()), log=_quiet)
    for a, b in zip(jax.tree.leaves(imported), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_circular_layer_order_and_its_inverse():
    """Stage s of p holds the model's blocks s, s + p, ...; relayered moves a stack between
    any two orders and back."""
    pipe = Pipeline("circular", 4, 2)
    assert pipe.layer_order(2, 8) == (0, 1, 4, 5, 2, 3, 6, 7)
    assert pipe.layer_order(4, 8) == (0, 4, 1, 5, 2, 6, 3, 7)
    assert pipe.layer_order(1, 8) == Pipeline("gpipe").layer_order(4, 8) == tuple(range(8))
    stack = {"layers": jnp.arange(8.0) * 10, "embed": jnp.arange(3.0)}
    moved = relayered(stack, range(8), pipe.layer_order(2, 8))
    np.testing.assert_array_equal(moved["layers"], [0, 10, 40, 50, 20, 30, 60, 70])
    np.testing.assert_array_equal(moved["embed"], stack["embed"])
    back = relayered(moved, pipe.layer_order(2, 8), pipe.layer_order(4, 8))
    np.testing.assert_array_equal(back["layers"], [0, 40, 10, 50, 20, 60, 30, 70])


# ---------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [
                "model.backward=autodiff",
                "train.pipeline_schedule=circular",
                "train.microbatches=2",
                "train.pipeline_repeats=4",
            ],
            "model.n_layers=4 does not split into mesh.p x train.pipeline_repeats = 2 x 4",
        ),
        (
            [
                "model.backward=autodiff",
                "train.pipeline_schedule=circular",
                "train.pipeline_repeats=2",
            ],
            "the circular schedule needs train.microbatches >= mesh.p",
        ),
        (
            ["model.backward=autodiff", "train.pipeline_repeats=2"],
            "train.pipeline_repeats=2 needs train.pipeline_schedule=circular",
        ),
        (["model.backward=autodiff", "model.n_layers=3"], "layers/p"),
    ],
)
def test_what_a_pipelined_config_refuses_names_the_key_and_the_fix(overrides, message):
    base = ["mesh.p=2", "mesh.d=2", "mesh.t=2", "model.n_layers=4", "model.vocab=4096"]
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*base, *overrides])


def test_logits_need_a_mesh_without_stages():
    """logits_fn runs every layer on each device: on a p > 1 mesh (a stage's block alone) it
    refuses, naming the fix, instead of returning another model's logits."""
    from seqshard.model.sharded import logits_fn

    cfg, mesh = _cfg(), _mesh((2, 2, 1, 2))
    w = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), weight_structs(cfg))
    tokens, starts = packed_batch(cfg.vocab, 4, LENGTH)
    with pytest.raises(ValueError, match=r"needs mesh axis p = 1, got p=2.*checkpoints restore"):
        logits_fn(w, tokens, starts, cfg, mesh)
