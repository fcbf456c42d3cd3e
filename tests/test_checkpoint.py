"""Tests of seqshard.train.checkpoint: contents, resharding on restore, atomicity, bad checkpoints."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from seqshard.config import Config, check_config, config_to_yaml, load_config
from seqshard.mesh import training_mesh
from seqshard.train.checkpoint import Checkpointer, CheckpointError
from seqshard.train.loop import train
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import train_state_structs


def replace(cfg: Config, section: str, **values) -> Config:
    """``cfg`` with ``section``'s ``values`` changed, checked as load_config would."""
    cfg = dataclasses.replace(
        cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)}
    )
    check_config(cfg)
    return cfg


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_overrides):
    """A 6-step run on 4x2 checkpointing every 2 steps, keeping 2: (config, run dir)."""
    runs = tmp_path_factory.mktemp("ckpt_runs")
    cfg = load_config(None, tiny_overrides(runs, "trained", checkpoint_every=2, keep_checkpoints=2))
    result = train(cfg, log=lambda _: None, tty=False)
    assert result.step == 6 and not result.interrupted
    return cfg, result.run_dir


@pytest.fixture
def ckpt_copy(trained, tmp_path):
    """A copy of the trained run's checkpoints, free to damage: (config, checkpoint dir)."""
    cfg, run_dir = trained
    copy = tmp_path / "checkpoints"
    shutil.copytree(run_dir / "checkpoints", copy)
    return cfg, copy


def restore(cfg: Config, directory: Path):
    mesh = training_mesh(cfg.mesh.sizes())
    ckpt = Checkpointer(directory)
    try:
        return ckpt.restore(cfg, mesh, make_optimizer(cfg.train)), mesh
    finally:
        ckpt.close()


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_checkpoint_holds_state_loader_and_config(trained):
    cfg, run_dir = trained
    ckpt = Checkpointer(run_dir / "checkpoints")
    try:
        # checkpoint_every=2 and keep_checkpoints=2: steps 2, 4, 6 written, the last two kept.
        assert ckpt.latest_step() == 6
        assert sorted(ckpt.manager.all_steps()) == [4, 6]
        meta = ckpt.read_meta()
        assert meta["step"] == 6 and meta["seed"] == cfg.train.seed
        assert meta["config"] == config_to_yaml(cfg)
        loader = meta["loader"]
        assert loader["step"] == 6  # the next batch to train on
        assert (loader["batch_size"], loader["seq_len"], loader["split"]) == (8, 32, "train")
        assert loader["data_hash"]
        assert ckpt.read_meta(4)["loader"]["step"] == 4
        with pytest.raises(CheckpointError, match="no checkpoint for step 2"):
            ckpt.read_meta(2)

        restored = ckpt.restore(cfg, training_mesh(cfg.mesh.sizes()), make_optimizer(cfg.train))
    finally:
        ckpt.close()
    state = restored.state
    assert int(state.step) == 6
    assert restored.meta["loader"] == loader
    # Weights and both AdamW moments, trained (non-zero), of the weights' shapes.
    weights = leaves(state.weights)
    assert weights and all(np.isfinite(w).all() for w in weights)
    moments = [s for s in jax.tree.leaves(state.opt_state) if getattr(s, "ndim", 0) > 0]
    assert len(moments) == 2 * len(weights)
    assert sorted(m.shape for m in moments) == sorted([w.shape for w in weights] * 2)
    assert all(np.abs(np.asarray(m)).max() > 0 for m in moments)
    counts = [int(c) for c in jax.tree.leaves(state.opt_state) if getattr(c, "ndim", 1) == 0]
    assert 6 in counts  # AdamW's update count


@pytest.mark.parametrize(("d", "t"), [(2, 4), (8, 1)])
def test_restore_reshards_onto_the_current_mesh_exactly(trained, d, t):
    cfg, run_dir = trained
    on_saved, _ = restore(cfg, run_dir / "checkpoints")
    other = replace(cfg, "mesh", d=d, t=t)
    on_other, mesh = restore(other, run_dir / "checkpoints")

    # Every restored array carries the sharding its type declares on the *new* mesh,
    # optimizer state included.
    targets = train_state_structs(other.model, mesh, make_optimizer(other.train))
    for got, want in zip(jax.tree.leaves(on_other.state), jax.tree.leaves(targets), strict=True):
        assert isinstance(got.sharding, NamedSharding)
        assert got.sharding.mesh.shape == mesh.shape
        assert got.sharding.spec == want.sharding.spec
    # For instance AdamW's first moment of w_up: split like w_up, over the new mesh.
    w_up_moment = optax.tree_utils.tree_get(on_other.state.opt_state, "mu").layers.w_up
    spec = on_other.state.weights.layers.w_up.sharding.spec
    assert w_up_moment.sharding.spec == spec and {"d", "t"} <= set(jax.tree.leaves(tuple(spec)))
    assert dict(w_up_moment.sharding.mesh.shape) == {"d": d, "t": t}

    # Resharding moves bytes, it does not change them.
    for a, b in zip(leaves(on_saved.state), leaves(on_other.state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_save_then_restore_round_trips_exactly(trained, tmp_path):
    """A state saved from one mesh (8x1) and restored onto another (4x2) is the same state."""
    cfg, run_dir = trained
    original, _ = restore(cfg, run_dir / "checkpoints")
    on_8x1 = replace(cfg, "mesh", d=8, t=1)
    state = restore(on_8x1, run_dir / "checkpoints")[0].state
    mesh, opt = training_mesh(cfg.mesh.sizes()), make_optimizer(cfg.train)
    ckpt = Checkpointer(tmp_path / "ck")
    try:
        assert ckpt.latest_step() is None
        with pytest.raises(CheckpointError, match="no complete checkpoint"):
            ckpt.restore(cfg, mesh, opt)
        assert ckpt.save(state, on_8x1, {"step": 6}) == 6
        assert ckpt.save(state, on_8x1, {"step": 6}) == 6  # a second save of a step: no-op
        ckpt.wait()
        assert ckpt.latest_step() == 6
        again = ckpt.restore(cfg, mesh, opt)
    finally:
        ckpt.close()
    assert again.meta["loader"] == {"step": 6}
    for a, b in zip(leaves(original.state), leaves(again.state), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "name", ["12.orbax-checkpoint-tmp", "14.orbax-checkpoint-tmp-1718000000123456"]
)
def test_a_checkpoint_mid_save_is_never_loaded(ckpt_copy, name):
    """Orbax writes a step into ``<step>.orbax-checkpoint-tmp[-<timestamp>]`` and renames it
    when complete; a kill mid-save leaves that directory behind, which must be ignored."""
    cfg, directory = ckpt_copy
    # The worst case: a temporary directory holding a complete-looking later step.
    shutil.copytree(directory / "6", directory / name)
    (directory / name / "commit_success.txt").unlink(missing_ok=True)
    ckpt = Checkpointer(directory)
    try:
        assert ckpt.latest_step() == 6
        assert sorted(ckpt.manager.all_steps()) == [4, 6]
        assert ckpt.read_meta()["step"] == 6
    finally:
        ckpt.close()
    restored, _ = restore(cfg, directory)
    assert int(restored.state.step) == 6


def test_another_model_shape_is_refused_naming_the_fields(ckpt_copy):
    cfg, directory = ckpt_copy
    other = replace(cfg, "model", d_model=64, d_ff=128)
    with pytest.raises(CheckpointError) as e:
        restore(other, directory)
    msg = str(e.value)
    assert "model.d_model: checkpoint 32, config 64" in msg
    assert "model.d_ff: checkpoint 64, config 128" in msg
    assert "n_layers" not in msg  # only the fields that differ


def _garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(0, len(data), 7):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        "garble array data",
        "garble array metadata",
        "delete metadata",
        "garble metadata",
        "delete state",
    ],
)
def test_a_damaged_checkpoint_is_a_checkpoint_error(ckpt_copy, damage):
    cfg, directory = ckpt_copy
    step = directory / "6"
    if damage == "garble array data":
        files = [p for p in (step / "state" / "d").iterdir() if p.is_file()]
        assert files
        for p in files:
            _garble(p)
    elif damage == "garble array metadata":
        _garble(step / "state" / "_METADATA")
    elif damage == "delete metadata":
        (step / "meta" / "metadata").unlink()
    elif damage == "garble metadata":
        _garble(step / "meta" / "metadata")
    else:
        shutil.rmtree(step / "state")
    with pytest.raises(CheckpointError) as e:
        restore(cfg, directory)
    msg = str(e.value)
    assert str(step) in msg and "delete" in msg.lower()
    # The older checkpoint is still there to fall back on.
    ckpt = Checkpointer(directory)
    try:
        older = ckpt.restore(cfg, training_mesh(cfg.mesh.sizes()), make_optimizer(cfg.train), step=4)
    finally:
        ckpt.close()
    assert int(older.state.step) == 4


def test_optimizer_state_targets_carry_weight_shardings(tiny_overrides, tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path))
    mesh = training_mesh(cfg.mesh.sizes())
    structs = train_state_structs(cfg.model, mesh, make_optimizer(cfg.train))
    moments = optax.tree_utils.tree_get_all_with_path(structs.opt_state, "mu")
    assert moments
    mu = moments[0][1]
    for m, w in zip(jax.tree.leaves(mu), jax.tree.leaves(structs.weights), strict=True):
        assert m.sharding == w.sharding and m.shape == w.shape
