"""Tests of seqshard.train.checkpoint: contents, resharding on restore, atomicity, checksums,
damaged, incomplete and leftover checkpoints, retention. (Failed saves: test_checkpoint_faults.py.)"""

from __future__ import annotations

import dataclasses
import itertools
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from seqshard.config import Config, check_config, config_to_yaml, load_config
from seqshard.mesh import training_mesh
from seqshard.train import checkpoint, checksums, step_dirs
from seqshard.train.checkpoint import Checkpointer, CheckpointError, state_digest
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import train_state_structs


def replace(cfg: Config, section: str, **values) -> Config:
    """``cfg`` with ``section``'s ``values`` changed, checked as load_config would."""
    cfg = dataclasses.replace(
        cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)}
    )
    check_config(cfg)
    return cfg


@pytest.fixture
def trained(trained_run):
    """The session's trained run (conftest.py): 6 steps on 4x2 checkpointing every 2 steps,
    keeping 2: (config, run dir). Read only; ``ckpt_copy`` to damage it."""
    return trained_run


@pytest.fixture
def ckpt_copy(trained, tmp_path):
    """A copy of the trained run's checkpoints, free to damage: (config, checkpoint dir)."""
    cfg, run_dir = trained
    copy = tmp_path / "checkpoints"
    shutil.copytree(run_dir / "checkpoints", copy)
    return cfg, copy


def restore(cfg: Config, directory: Path, **kwargs):
    """(Restored, mesh): ``directory``'s checkpoint restored onto ``cfg``'s mesh."""
    mesh = training_mesh(cfg.mesh.sizes())
    ckpt = Checkpointer(directory, log=kwargs.pop("log", print))
    try:
        return ckpt.restore(cfg, mesh, make_optimizer(cfg.train), **kwargs), mesh
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
        assert ckpt.all_steps() == sorted(ckpt.manager.all_steps()) == [4, 6]
        meta = ckpt.read_meta()
        assert meta["step"] == 6 and meta["seed"] == cfg.train.seed
        # One checksum per array, by name, and the state was finite.
        assert meta["finite"] is True
        assert "state.weights.layers.w_up" in meta["checksums"]
        assert all(re.fullmatch(r"0x[0-9a-f]{8}", c) for c in meta["checksums"].values())
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
    assert int(state.step) == 6 and restored.step == 6 and restored.skipped == {}
    # every array but the zero-size ones (q_norm without qk_norm: nothing to check)
    assert len(meta["checksums"]) == sum(x.size > 0 for x in jax.tree.leaves(state))
    assert restored.meta["loader"] == loader
    # Weights and both AdamW moments, trained (non-zero), of the weights' shapes.
    weights = leaves(state.weights)
    assert weights and all(np.isfinite(w).all() for w in weights)
    moments = [s for s in jax.tree.leaves(state.opt_state) if getattr(s, "ndim", 0) > 0]
    assert len(moments) == 2 * len(weights)
    assert sorted(m.shape for m in moments) == sorted([w.shape for w in weights] * 2)
    assert all(np.abs(np.asarray(m)).max() > 0 for m in moments if m.size)  # q_norm, k_norm: 0
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
    assert dict(w_up_moment.sharding.mesh.shape) == {"p": 1, "d": d, "e": 1, "c": 1, "t": t}

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
    reader = Checkpointer(directory, read_only=True)  # beside a live run: touches nothing
    try:
        assert reader.latest_step() == 6 and reader.all_steps() == [4, 6]
        assert reader.read_meta()["step"] == 6
    finally:
        reader.close()
    assert (directory / name).exists()
    ckpt = Checkpointer(directory)  # a run resuming: the leftover goes
    try:
        assert ckpt.latest_step() == 6
        assert sorted(ckpt.manager.all_steps()) == [4, 6]
    finally:
        ckpt.close()
    assert sorted(p.name for p in directory.iterdir()) == ["4", "6"]
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
    "damage", ["garble array data", "garble array metadata", "garble metadata"]
)
def test_a_damaged_checkpoint_is_skipped_or_with_strict_refused(ckpt_copy, damage):
    cfg, directory = ckpt_copy
    step = directory / "6"
    if damage == "garble array data":
        files = [p for p in (step / "state" / "d").iterdir() if p.is_file()]
        assert files
        for p in files:
            _garble(p)
    elif damage == "garble array metadata":
        _garble(step / "state" / "_METADATA")
    else:
        _garble(step / "meta" / "metadata")
    with pytest.raises(CheckpointError) as e:
        restore(cfg, directory, policy="strict")
    msg = str(e.value)
    assert str(step) in msg and "delete it to resume from checkpoint 4" in msg
    assert step.is_dir()  # strict moves nothing

    lines = []
    restored, _ = restore(cfg, directory, log=lines.append)  # train.resume: latest_good
    assert int(restored.state.step) == 4 and restored.step == 4 and list(restored.skipped) == [6]
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint {step}: ")
    assert lines[0].endswith("skipping it, resuming from checkpoint 4 (kept as 6.damaged)")
    assert sorted(p.name for p in directory.iterdir()) == ["4", "6.damaged"]


def _incomplete_step_8(directory: Path, damage: str) -> None:
    """A step directory 8, newer than the good 4 and 6, that is not a complete checkpoint."""
    if damage == "empty":
        (directory / "8").mkdir()
        return
    shutil.copytree(directory / "6", directory / "8")
    if damage == "delete metadata":
        (directory / "8" / "meta" / "metadata").unlink()
    elif damage == "delete state metadata":
        (directory / "8" / "state" / "_METADATA").unlink()
    elif damage == "delete state":
        shutil.rmtree(directory / "8" / "state")
    else:  # "half-deleted": rmtree stopped part-way, some top-level entries gone, one half-gone
        (directory / "8" / "commit_success.txt").unlink()
        files = sorted(p for p in (directory / "8" / "state").rglob("*") if p.is_file())
        for p in files[: len(files) // 2]:
            p.unlink()


INCOMPLETE = ["delete metadata", "delete state metadata", "delete state", "half-deleted"]


@pytest.mark.parametrize("damage", [*INCOMPLETE, "empty"])
def test_an_incomplete_step_directory_is_never_deleted(ckpt_copy, damage):
    """Fault 2 of the campaign: a step directory with files in it that is not a complete
    checkpoint (meta/metadata or state/_METADATA deleted, a deletion cut short) was removed,
    arrays and all, when a writer opened the directory, even under train.resume=strict. It is
    never listed nor loaded; latest_good skips it with one line and keeps it as 8.damaged;
    strict refuses it by name and changes nothing. Only what this code's interrupted saves
    and deletions provably left is removed: `.deleting-*`, orbax's temporary directories, and
    an empty step directory (nothing in it to lose)."""
    cfg, directory = ckpt_copy
    _incomplete_step_8(directory, damage)
    shutil.copytree(directory / "4", directory / ".deleting-2")  # a kill mid-removal
    shutil.copytree(directory / "4", directory / "9.orbax-checkpoint-tmp-1700000000")

    reader = Checkpointer(directory, read_only=True)
    try:
        assert reader.all_steps() == [4, 6] and reader.latest_step() == 6
    finally:
        reader.close()
    assert (directory / "8").exists() and (directory / ".deleting-2").exists()

    if damage == "empty":
        restored, _ = restore(cfg, directory, log=print, policy="strict")
        assert restored.step == 6
        assert sorted(p.name for p in directory.iterdir()) == ["4", "6"]
        return
    with pytest.raises(CheckpointError) as e:
        restore(cfg, directory, policy="strict")
    assert f"checkpoint {directory / '8'}: not a complete checkpoint (no " in str(e.value)
    assert "train.resume=latest_good" in str(e.value)
    assert sorted(p.name for p in directory.iterdir()) == ["4", "6", "8"]

    lines = []
    restored, _ = restore(cfg, directory, log=lines.append)  # latest_good
    assert restored.step == 6 and list(restored.skipped) == [8]
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint {directory / '8'}: not a complete")
    assert lines[0].endswith("skipping it, resuming from checkpoint 6 (kept as 8.damaged)")
    assert sorted(p.name for p in directory.iterdir()) == ["4", "6", "8.damaged"]


def test_a_kill_between_save_and_retention_leaves_keep_checkpoints_after_resume(ckpt_copy):
    """A kill after a save finished but before retention ran leaves keep + 1 checkpoints; the
    resumed run's restore applies retention, so exactly keep remain."""
    cfg, directory = ckpt_copy  # keep_checkpoints=2: 4 and 6
    shutil.copytree(directory / "4", directory / "2")
    ckpt = Checkpointer(directory, keep=2)
    try:
        assert ckpt.all_steps() == [2, 4, 6]
        restored = ckpt.restore(cfg, training_mesh(cfg.mesh.sizes()), make_optimizer(cfg.train))
    finally:
        ckpt.close()
    assert restored.step == 6
    assert sorted(p.name for p in directory.iterdir()) == ["4", "6"]


def _largest_data_file(step_dir: Path) -> Path:
    return max(
        (p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )


def _restored_at(cfg: Config, directory: Path, step: int) -> list[np.ndarray]:
    ckpt = Checkpointer(directory, read_only=True)
    try:
        return leaves(
            ckpt.restore(
                cfg, training_mesh(cfg.mesh.sizes()), make_optimizer(cfg.train), step=step
            ).state
        )
    finally:
        ckpt.close()


def at_step(state, step: int):
    """``state`` with its step counter set to ``step`` (to save it as another checkpoint)."""
    return dataclasses.replace(state, step=jax.device_put(np.int32(step), state.step.sharding))


def _skips_to_4_then_strict_refuses(cfg, directory, reason: str, capfd) -> None:
    """latest_good resumes from 4 with one line naming 6 and ``reason``; strict raises; a run
    resumed from 4 saves its own checkpoint 6 beside the damaged one."""
    want = _restored_at(cfg, directory, 4)
    step6 = directory / "6"
    with pytest.raises(CheckpointError) as e:
        restore(cfg, directory, policy="strict")
    assert re.search(f"checkpoint {re.escape(str(step6))}: {reason}", str(e.value)), str(e.value)

    lines = []
    restored, mesh = restore(cfg, directory, log=lines.append)
    assert restored.step == 4 and int(restored.state.step) == 4
    for a, b in zip(want, leaves(restored.state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(lines) == 1, lines
    assert re.fullmatch(
        f"checkpoint {re.escape(str(step6))}: {reason}: skipping it, resuming from checkpoint 4 "
        r"\(kept as 6\.damaged\)",
        lines[0],
    ), lines[0]
    assert "Traceback" not in capfd.readouterr().err  # orbax's abandoned reads stay quiet

    # Training on from 4 writes step 6 again: the damaged one is out of its way.
    ckpt = Checkpointer(directory, keep=3)
    try:
        ckpt.save(at_step(restored.state, 6), cfg, {"step": 6})
        ckpt.wait()
        assert ckpt.all_steps() == [4, 6]
    finally:
        ckpt.close()
    assert (directory / "6.damaged").is_dir()
    assert restore(cfg, directory)[0].step == 6


@pytest.mark.parametrize("seed", [0, 1])
def test_random_bytes_in_the_newest_checkpoint_are_skipped_for_the_previous(ckpt_copy, seed, capfd):
    """The fault campaign's damage: 4096 random bytes into the largest array data file."""
    cfg, directory = ckpt_copy
    path = _largest_data_file(directory / "6")
    rng = np.random.default_rng(seed)
    data = bytearray(path.read_bytes())
    at = int(rng.integers(0, len(data) - 4096))
    data[at : at + 4096] = rng.bytes(4096)
    path.write_bytes(bytes(data))
    # Most such damage breaks a zstd frame (an unreadable array); some decodes to other
    # numbers, which only the checksums catch (the next test makes that case certain).
    reason = r"(unreadable arrays \(.+\)|array state\S+ checksum mismatch \(.+\))"
    _skips_to_4_then_strict_refuses(cfg, directory, reason, capfd)


def test_damage_that_decodes_is_caught_by_the_checksums(ckpt_copy, capfd):
    """Bytes that still decode (here: one compressed chunk copied over another of the same
    length in the largest data file) load without any error from orbax; before checksums the
    run resumed from them."""
    cfg, directory = ckpt_copy
    path = _largest_data_file(directory / "6")
    data = bytearray(path.read_bytes())
    starts = [m.start() for m in re.finditer(re.escape(bytes.fromhex("28b52ffd")), data)]
    frames = {}  # (length, zstd frame + block header) -> start: frames that decode alike
    for a, b in itertools.pairwise(starts):
        key = (b - a, bytes(data[a : a + 10]))
        if key in frames and data[frames[key] : b - a + frames[key]] != data[a:b]:
            data[frames[key] : frames[key] + b - a] = data[a:b]
            break
        frames.setdefault(key, a)
    else:
        pytest.fail(f"no two zstd frames alike in {path}")
    path.write_bytes(bytes(data))
    reason = r"array state\S+ checksum mismatch \(saved 0x[0-9a-f]{8}, read 0x[0-9a-f]{8}\)"
    _skips_to_4_then_strict_refuses(cfg, directory, reason, capfd)


def test_no_good_checkpoint_lists_each_and_why(ckpt_copy):
    cfg, directory = ckpt_copy
    for step in ("4", "6"):
        _garble(directory / step / "meta" / "metadata")
    with pytest.raises(CheckpointError) as e:
        restore(cfg, directory)
    msg = str(e.value)
    assert msg.startswith(f"no good checkpoint in {directory}: ")
    assert f"{directory / '6'}: unreadable metadata" in msg
    assert f"{directory / '4'}: unreadable metadata" in msg
    assert sorted(p.name for p in directory.iterdir()) == ["4", "6"]  # nothing moved


def test_checksums_do_not_depend_on_the_mesh(trained):
    """Saved on 4x2; the same values on 2x4 and 8x1 (each restore verified them too)."""
    cfg, run_dir = trained
    reader = Checkpointer(run_dir / "checkpoints", read_only=True)
    try:
        saved = reader.read_meta()["checksums"]
    finally:
        reader.close()
    for d, t in [(4, 2), (2, 4), (8, 1)]:
        restored, _ = restore(replace(cfg, "mesh", d=d, t=t), run_dir / "checkpoints")
        sums, finite = state_digest(restored.state)
        assert {n: f"0x{c:08x}" for n, c in sums.items()} == saved, (d, t)
        assert all(finite.values())


def test_a_checksum_sees_a_flipped_bit_and_a_swap(trained):
    cfg, run_dir = trained
    state = restore(cfg, run_dir / "checkpoints")[0].state
    w = state.weights.layers.w_up
    base = state_digest(state)[0]["state.weights.layers.w_up"]
    host = np.asarray(w)
    flipped = host.copy()
    flipped.view(np.uint32)[1, 3, 5] ^= 1 << 7
    swapped = host.copy()
    swapped[0, 0, 0], swapped[1, 2, 3] = host[1, 2, 3], host[0, 0, 0]
    for changed in (flipped, swapped):
        other = dataclasses.replace(
            state,
            weights=dataclasses.replace(
                state.weights,
                layers=dataclasses.replace(
                    state.weights.layers, w_up=jax.device_put(changed, w.sharding)
                ),
            ),
        )
        assert state_digest(other)[0]["state.weights.layers.w_up"] != base


@pytest.mark.parametrize(("d", "t"), [(4, 2), (8, 1)])
def test_hashing_large_arrays_in_parts_gives_the_same_checksums(trained, monkeypatch, d, t):
    """Arrays over _PART_BYTES per device are hashed in parts (the tiny model's are not): with
    a limit of 256 bytes, most are, in 2 .. 64 parts; the checksums stay the same."""
    cfg, run_dir = trained
    other = replace(cfg, "mesh", d=d, t=t)
    state = restore(other, run_dir / "checkpoints")[0].state
    whole = state_digest(state)
    monkeypatch.setattr(checksums, "_PART_BYTES", 256)
    parts = [checksums._plan(x).parts for x in jax.tree.leaves(state)]
    assert max(parts) > 8 and sum(p > 1 for p in parts) > len(parts) // 2
    assert state_digest(state) == whole


def test_a_non_finite_state_is_never_written(trained, tmp_path):
    cfg, run_dir = trained
    state = restore(cfg, run_dir / "checkpoints")[0].state
    w = np.asarray(state.weights.layers.w_up).copy()
    w[0, 1, 2] = np.nan
    layers = dataclasses.replace(
        state.weights.layers, w_up=jax.device_put(w, state.weights.layers.w_up.sharding)
    )
    bad = dataclasses.replace(state, weights=dataclasses.replace(state.weights, layers=layers))
    ckpt = Checkpointer(tmp_path / "ck")
    try:
        ckpt.save(state, cfg, {"step": 6})
        ckpt.wait()
        with pytest.raises(CheckpointError) as e:
            ckpt.save(at_step(bad, 8), cfg, {"step": 8})
        ckpt.wait()
        assert ckpt.all_steps() == [6]
    finally:
        ckpt.close()
    msg = str(e.value)
    assert "a non-finite state is never written" in msg
    assert "state.weights.layers.w_up" in msg and str(tmp_path / "ck" / "6") in msg
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["6"]


def test_exactly_keep_checkpoints_are_kept_and_deletion_leaves_no_phantom(
    trained, tmp_path, monkeypatch
):
    cfg, run_dir = trained
    state = restore(cfg, run_dir / "checkpoints")[0].state
    directory = tmp_path / "ck"
    ckpt = Checkpointer(directory, keep=2)
    try:
        for step in range(1, 8):
            ckpt.save(at_step(state, step), cfg, {"step": step})
            ckpt.raise_if_save_failed()
            assert len(ckpt.all_steps()) <= 3  # the newest may wait for the next save's check
    finally:
        ckpt.close()
    assert sorted(p.name for p in directory.iterdir()) == ["6", "7"]

    # A kill in the middle of deleting step 6 (when 8 is saved with keep=2): the step
    # directory is renamed away before anything in it is removed, so no phantom is left.
    def killed(path, *args, **kwargs):
        raise KeyboardInterrupt

    ckpt = Checkpointer(directory, keep=2)
    monkeypatch.setattr(step_dirs.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(at_step(state, 8), cfg, {"step": 8})
        ckpt.wait()
    monkeypatch.undo()
    ckpt.close()
    assert sorted(p.name for p in directory.iterdir()) == [".deleting-6", "7", "8"]
    assert checkpoint.checkpoint_steps(directory) == [7, 8]
    Checkpointer(directory, keep=2).close()  # the next start removes the leftover
    assert sorted(p.name for p in directory.iterdir()) == ["7", "8"]


def test_a_fresh_checkpoint_is_complete(trained):
    """A complete checkpoint has every file listed in step_dirs.COMPLETE_MARKERS. If this
    fails, orbax changed its layout: update the list, or complete checkpoints would be taken
    for leftovers."""
    _, run_dir = trained
    for step in ("4", "6"):
        for marker in step_dirs.COMPLETE_MARKERS:
            assert (run_dir / "checkpoints" / step / marker).is_file(), marker


def test_optimizer_state_targets_carry_weight_shardings(tiny_overrides, tmp_path):
    cfg = load_config(None, tiny_overrides(tmp_path))
    mesh = training_mesh(cfg.mesh.sizes())
    structs = train_state_structs(cfg.model, mesh, make_optimizer(cfg.train))
    moments = optax.tree_utils.tree_get_all_with_path(structs.opt_state, "mu")
    assert moments
    mu = moments[0][1]
    for m, w in zip(jax.tree.leaves(mu), jax.tree.leaves(structs.weights), strict=True):
        assert m.sharding == w.sharding and m.shape == w.shape


def _without(tree, names: set[str]):
    """Orbax's serialized tree (nested dicts and lists) less the entries named ``names``."""
    if isinstance(tree, list):
        return [_without(x, names) for x in tree]
    if isinstance(tree, dict):
        return {k: _without(v, names) for k, v in tree.items() if k not in names}
    return tree


def test_a_checkpoint_written_before_qk_norm_existed_restores(ckpt_copy):
    """model.qk_norm added the gains q_norm and k_norm, of size 0 without it. A checkpoint
    written before has no entry for them (nor for their AdamW moments): it restores, the same
    arrays, the zero-size ones made again."""
    import orbax.checkpoint as ocp

    cfg, directory = ckpt_copy
    original, _ = restore(cfg, directory)
    step = original.step
    ckpt = Checkpointer(directory, log=lambda _: None)
    try:
        meta = ckpt.read_meta(step)
        state = ocp.tree.serialize_tree(
            checkpoint._empty_as_none(original.state), keep_empty_nodes=True
        )
        old = _without(state, {"q_norm", "k_norm"})
        shutil.rmtree(directory / str(step))
        ckpt.manager.reload()
        ckpt.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(old), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        ckpt.manager.wait_until_finished()
    finally:
        ckpt.close()
    assert "q_norm" not in str(
        ocp.StandardCheckpointHandler().metadata(directory / str(step) / "state").tree
    )
    again, _ = restore(cfg, directory, log=lambda _: None)
    assert again.step == step
    for a, b in zip(leaves(original.state), leaves(again.state), strict=True):
        np.testing.assert_array_equal(a, b)


# -- checkpoints written before the layer stacks (issue 42) -----------------------------------

OLD = Path(__file__).parent / "golden" / "checkpoint_before_stacks"


def _old_overrides() -> list[str]:
    """The config the old checkpoint was written with (its generator's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_old", OLD.parent / "make_old_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.OVERRIDES


def test_a_checkpoint_written_before_the_layer_stacks_restores_exactly(tmp_path):
    """Written by seqshard before issue 42 (75ff3fc): the weights a config leaves off were
    zero-size arrays (q_norm, k_norm, the shared experts, the MoE model's empty dense stack).
    Today they are absent from the tree; the checkpoint restores onto it, every array equal."""
    shutil.copytree(OLD / "checkpoints", tmp_path / "checkpoints")
    cfg = load_config(None, _old_overrides())
    mesh = training_mesh(cfg.mesh.sizes())
    restored = Checkpointer(tmp_path / "checkpoints", read_only=True).restore(
        cfg, mesh, make_optimizer(cfg.train)
    )
    weights = restored.state.weights
    assert [f.name for f in dataclasses.fields(weights)] == [
        "embed", "moe_layers", "final_norm", "unembed"
    ]  # fmt: skip
    names = {f.name for f in dataclasses.fields(weights.moe_layers)}
    assert not names & {"q_norm", "k_norm", "s_gate", "s_up", "s_down"}
    got = {
        jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(weights)
    }
    want = np.load(OLD / "weights.npz")
    assert set(got) == set(want.files)
    for name in want.files:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_an_fp8_amax_history_is_checkpointed_and_resharded(trained, tmp_path):
    """model.fp8=delayed: each block's amax history rides with the weights (replicated but for
    the layers' p split): saved from 4x2, restored onto p=2 x d=4 unchanged."""
    cfg, _ = trained
    cfg = replace(cfg, "model", fp8="delayed", fp8_history=3)
    mesh, opt = training_mesh(cfg.mesh.sizes()), make_optimizer(cfg.train)
    structs = train_state_structs(cfg.model, mesh, opt)
    rng = np.random.default_rng(0)
    state = jax.tree.map(
        lambda s: (
            jax.device_put(rng.random(s.shape).astype(s.dtype), s.sharding)
            if jnp.issubdtype(s.dtype, jnp.floating)
            else jax.device_put(np.zeros(s.shape, s.dtype), s.sharding)
        ),
        structs,
    )
    ckpt = Checkpointer(tmp_path / "ck")
    try:
        ckpt.save(state, cfg, {"step": 1})
        ckpt.wait()
        piped = replace(cfg, "mesh", p=2, d=4, t=1)
        again = ckpt.restore(piped, training_mesh(piped.mesh.sizes()), opt)
    finally:
        ckpt.close()
    for block in ("attention", "swiglu"):
        want = getattr(state.weights.layers, f"{block}_fp8_history")
        got = getattr(again.state.weights.layers, f"{block}_fp8_history")
        assert got.shape == (cfg.model.n_layers, 5, 3) and got.sharding.spec[0] == "p"
        np.testing.assert_array_equal(got, want)
