"""Training with mixture-of-experts layers (seqshard.train with model.moe): exact gradient
accumulation against the reference, the routing figures each log step, the expert-load
heatmap, bias balancing, and checkpoints written on e=2 resumed on e=4 and on e=1.

    accumulation   grads_and_loss over 2 microbatches on (e, d, t) = (2, 2, 2) equals the
                   reference's per-microbatch loss (each microbatch's balancing terms weighed
                   by its counted positions, as moe.py states) and its gradient (f32: loss to
                   1e-6 relative, each gradient leaf to 2e-5 of its largest entry); so does
                   the step pipelined on (p, e, d) = (2, 2, 2), its 2 microbatches the
                   pipeline's (4 MoE layers, none dense)
    runs           the tiny model with a dense first layer and 8 experts (top-2, one shared),
                   bias balancing, 2 microbatches: 8 steps straight on e2 x d2 x t2; 4 steps,
                   then resumed to 8 on another mesh: the resumed losses equal the straight
                   run's (rtol 2e-5, as the dense model's resumptions across meshes)
"""

from __future__ import annotations

import dataclasses
import shutil

import jax
import numpy as np
import pytest
from model_weights import random_weights, tiny_model
from run_helpers import FLAT, by_step, latest_state, run

from seqshard.batch import token_batch
from seqshard.config import (
    Config,
    DataConfig,
    MeshConfig,
    TrainConfig,
    check_config,
    load_config,
)
from seqshard.mesh import mesh_of_sizes
from seqshard.model import reference_loss_fn
from seqshard.model.config import MoEConfig
from seqshard.model.weights import weight_structs
from seqshard.train.plot import EXPERT_LOAD_FILE, expert_loads, plot_expert_load
from seqshard.train.step import grads_and_loss

# -- exact gradient accumulation ------------------------------------------------------------

MOE = MoEConfig(
    n_experts=8, top_k=2, d_ff=32, n_shared=1, n_dense_layers=1,
    aux_loss_weight=1e-2, z_loss_weight=1e-3,
)  # fmt: skip
MODEL = tiny_model(n_layers=3, n_kv=4, moe=MOE)
BATCH, LENGTH, K = 8, 16, 2
# Documents of uneven lengths: the two microbatches (rows m, m + K, ...) count different
# numbers of positions, so their balancing terms weigh differently.
DOC_LENGTHS = [2, 16, 3, 8, 2, 5, 16, 4]


def _batch():
    tokens = np.random.default_rng(0).integers(0, MODEL.vocab, (BATCH, LENGTH)).astype(np.int32)
    starts = np.arange(LENGTH)[None, :] % np.array(DOC_LENGTHS)[:, None] == 0
    return tokens, starts


def _reference_accumulated(weights, tokens, starts, model=MODEL):
    """The loss of K microbatches as the step defines it: each microbatch's mean loss (its
    balancing terms included) weighed by its counted positions."""
    total, count = 0.0, 0.0
    for m in range(K):
        counted = jax.numpy.sum(~starts[m::K, 1:])
        total = total + reference_loss_fn(weights, tokens[m::K], starts[m::K], model) * counted
        count = count + counted
    return total / count


# Pipelined over p (no dense first layers: pipelining needs none), the K microbatches the
# pipeline's.
PIPELINED = tiny_model(n_layers=4, n_kv=4, moe=dataclasses.replace(MOE, n_dense_layers=0))


@pytest.mark.parametrize(
    "model,sizes",
    [
        pytest.param(MODEL, {"e": 2, "d": 2, "t": 2}, marks=pytest.mark.slow),
        (PIPELINED, {"p": 2, "e": 2, "d": 2}),  # accumulation and pipelining with experts
    ],
    ids=["e2d2t2", "p2e2d2"],
)
def test_accumulated_gradients_with_experts_equal_the_reference_per_microbatch(model, sizes):
    mesh = mesh_of_sizes(sizes)
    cfg = Config(
        model=model,
        mesh=MeshConfig(**sizes),
        data=DataConfig(vocab_size=model.vocab),
        train=TrainConfig(batch_size=BATCH, seq_len=LENGTH, microbatches=K, warmup_steps=0),
    )
    check_config(cfg)
    weights = random_weights(model, seed=0)
    tokens, starts = _batch()
    on_mesh = jax.device_put(
        weights, jax.tree.map(lambda s: s.sharding, weight_structs(model, mesh))
    )
    grads, loss, count, stats = jax.jit(grads_and_loss, static_argnums=(2, 3))(
        on_mesh, token_batch(tokens, starts), cfg, mesh
    )
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(_reference_accumulated), static_argnums=3)(
        weights, tokens, starts, model
    )
    assert count == np.sum(~starts[:, 1:])
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for (path, r), g in zip(
        jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads), strict=True
    ):
        r, g = np.asarray(r), np.asarray(g)
        if r.size:
            worst = np.max(np.abs(g - r)) / max(np.max(np.abs(r)), 1e-30)
            assert worst <= 2e-5, (jax.tree_util.keystr(path), worst)
    # The statistics add up over the microbatches: every token routed once, k copies each.
    layers = model.dim_sizes()["moe_layers"]
    routing = stats["moe_layers"]["moe"]  # the MoE stack's auxiliary outputs
    np.testing.assert_allclose(np.asarray(routing["tokens"]), [BATCH * LENGTH] * layers)
    np.testing.assert_allclose(
        np.asarray(routing["load"]).sum(axis=1), [BATCH * LENGTH * 2] * layers
    )


# -- runs -----------------------------------------------------------------------------------

RUN_MOE = [
    "model.moe.n_experts=8",
    "model.moe.top_k=2",
    "model.moe.d_ff=32",
    "model.moe.n_shared=1",
    "model.moe.n_dense_layers=1",
    "model.moe.balance=bias",
    "model.moe.bias_rate=1e-2",
    "model.moe.z_loss_weight=1e-3",
    "train.batch_size=16",  # 2 microbatches of 8 rows: split over d x e = 8 on every mesh
    "train.microbatches=2",
]
E2 = ["mesh.e=2", "mesh.d=2", "mesh.t=2"]


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory, tiny_overrides):
    """(runs directory, its overrides maker): "straight", 8 steps on e2 x d2 x t2, and "half",
    the same config's first 4 steps with a checkpoint at 4 (the lr constant after warmup, so
    the schedule does not depend on train.steps)."""
    root = tmp_path_factory.mktemp("moe_runs")

    def overrides(name: str, steps: int, mesh: list[str], **train) -> list[str]:
        return [*tiny_overrides(root, name, steps=steps, **FLAT, **train), *RUN_MOE, *mesh]

    run(overrides("straight", 8, E2))
    return root, overrides


@pytest.fixture(scope="module")
def moe_half(moe_runs):
    """``moe_runs`` with "half" added: the same config's first 4 steps, checkpoint at 4."""
    root, overrides = moe_runs
    run(overrides("half", 4, E2, checkpoint_every=4))
    return moe_runs


def test_a_run_with_experts_logs_its_routing_each_step(moe_runs):
    root, _ = moe_runs
    records = by_step(root / "straight")
    assert sorted(records) == list(range(1, 9))
    for r in records.values():
        assert np.isfinite(r["loss"])
        assert r["moe_load_max_over_mean"] >= 1.0
        assert r["moe_load_max_over_mean"] == r["moe_load_max_over_mean/1"]  # one MoE layer
        assert r["moe_dropped_fraction"] == 0.0  # dropless
        assert r["moe_aux_loss"] == 0.0  # balance=bias: no auxiliary loss
        assert r["moe_z_loss"] > 0.0
        shares = [r[f"moe_load/1/{j}"] for j in range(8)]
        assert sum(shares) == pytest.approx(1.0, rel=1e-6)
        assert max(shares) * 8 == pytest.approx(r["moe_load_max_over_mean"], rel=1e-6)
    # The bias moves by bias_rate per step and expert, towards balance.
    assert records[1]["moe_bias_range"] == pytest.approx(2e-2, rel=1e-5)
    assert 0 < records[8]["moe_bias_range"] <= 8 * 2e-2 + 1e-6
    assert records[8]["loss"] < records[1]["loss"]


def test_the_expert_load_heatmap(moe_runs, tmp_path):
    root, _ = moe_runs
    steps, layers = expert_loads(root / "straight")
    assert steps == list(range(1, 9)) and list(layers) == [1]
    load = np.asarray(layers[1])  # [expert, step]: each step's shares sum to 1
    assert load.shape == (8, 8)
    np.testing.assert_allclose(load.sum(axis=0), 1.0, rtol=1e-6)

    path = plot_expert_load(root / "straight")
    assert path == root / "straight" / EXPERT_LOAD_FILE
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    with pytest.raises(ValueError, match="holds no expert load"):
        (tmp_path / "dense").mkdir()
        (tmp_path / "dense" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
        plot_expert_load(tmp_path / "dense")


@pytest.mark.parametrize(
    "mesh",
    [
        # (slow: the default run keeps the straight run's checks; tests/train/test_loop.py
        # resumes the dense model across meshes)
        pytest.param(["mesh.e=4", "mesh.d=2", "mesh.t=1"], id="e4", marks=pytest.mark.slow),
        pytest.param(["mesh.e=1", "mesh.d=4", "mesh.t=2"], id="e1", marks=pytest.mark.slow),
    ],
)
def test_a_checkpoint_written_on_e2_resumes_on_another_e(moe_half, tmp_path, mesh):
    root, overrides = moe_half
    shutil.copytree(root / "half", tmp_path / "half")
    resumed_overrides = [
        *overrides("half", 8, mesh),
        f"run.dir={tmp_path}",  # the copy (the last run.dir wins)
    ]
    result = run(resumed_overrides)
    assert result.step == 8
    resumed, straight = by_step(tmp_path / "half"), by_step(root / "straight")
    assert sorted(resumed) == list(range(1, 9))
    for step in range(5, 9):
        for key in ("loss", "grad_norm", "moe_load_max_over_mean", "moe_bias_range"):
            np.testing.assert_allclose(
                resumed[step][key], straight[step][key], rtol=2e-5, err_msg=f"{step} {key}"
            )
    # The router bias (no trained weight, checkpointed with the weights) came along.
    cfg = load_config(None, resumed_overrides)
    state = latest_state(tmp_path / "half", cfg)
    assert np.ptp(np.asarray(state.weights.moe_layers.router_bias)) > 0


@pytest.mark.slow
def test_a_pipelined_run_with_experts_tracks_p1_and_resumes_on_it(tmp_path, tiny_overrides):
    """4 MoE layers (none dense: pipelining needs none), bias balancing, 2 microbatches: on
    p2 x e2 x d2 under the circular schedule (2 blocks per stage: the MoE stack stored
    reordered) its first 2 steps equal the p = 1 run's (gradient accumulation over the same
    microbatches; the per-layer loads named by their place in the model); its checkpoint at
    step 2 (the empty dense stack left out of the write) resumes on p = 1 with that run's
    steps 3 and 4 (rtol 2e-5)."""
    moe = [
        *(x for x in RUN_MOE if "n_dense_layers" not in x),
        "model.moe.n_dense_layers=0",
        "model.n_layers=4",
    ]

    def overrides(name, steps, mesh, **train):
        return [*tiny_overrides(tmp_path, name, steps=steps, **FLAT, **train), *moe, *mesh]

    p1 = ["mesh.p=1", *E2]
    pipelined = ["mesh.p=2", "mesh.e=2", "mesh.d=2", "mesh.t=1"]
    circular = {"pipeline_schedule": "circular", "pipeline_repeats": 2}
    run(overrides("straight", 4, p1))
    run(overrides("resumed", 2, pipelined, checkpoint_every=2, **circular))
    straight = by_step(tmp_path / "straight")
    keys = ["loss", "grad_norm", "moe_load_max_over_mean", "moe_bias_range"]
    keys += [f"moe_load/{layer}/{j}" for layer in range(4) for j in range(8)]
    for step in (1, 2):
        for key in keys:
            np.testing.assert_allclose(
                by_step(tmp_path / "resumed")[step][key], straight[step][key], rtol=2e-5,
                err_msg=f"{step} {key}",
            )  # fmt: skip
    run(overrides("resumed", 4, p1, **circular))  # the run's keys; unused at p = 1
    resumed = by_step(tmp_path / "resumed")
    for step in (3, 4):
        for key in keys:
            np.testing.assert_allclose(
                resumed[step][key], straight[step][key], rtol=2e-5, err_msg=f"{step} {key}"
            )
