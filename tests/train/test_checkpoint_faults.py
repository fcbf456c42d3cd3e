"""Failed checkpoint saves (seqshard.train.checkpoint): a full disk, a real one (a small tmpfs,
where this process may mount one) and a simulated one (orbax's finalize raising ENOSPC).

Each failure must reach the loop at its next per-step check (not at the next save interval),
as one CheckpointSaveError that says where, why, how much space is needed and free, with
nothing of orbax's on stderr, no temporary directory left, and the earlier checkpoints intact.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import gc
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from seqshard.config import load_config
from seqshard.mesh import training_mesh
from seqshard.shardlib.tables import format_bytes
from seqshard.train.checkpoint import Checkpointer, CheckpointSaveError
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import init_train_state


@pytest.fixture(scope="module")
def fresh(tmp_path_factory, tiny_overrides):
    """(config, a freshly initialized train state on its 4x2 mesh)."""
    cfg = load_config(None, tiny_overrides(tmp_path_factory.mktemp("faults")))
    mesh = training_mesh(cfg.mesh.sizes())
    return cfg, init_train_state(cfg.model, mesh, make_optimizer(cfg.train), jax.random.key(0))


def at_step(state, step: int):
    return dataclasses.replace(state, step=jax.device_put(np.int32(step), state.step.sharding))


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MB tmpfs: room for one checkpoint of the tiny model (~0.6 MB) and a filler."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root; the simulated full disk test still runs")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path) -> None:
    """Write a filler file until the disk is full, to the last byte. Unbuffered: a buffered
    file whose flush failed retries that flush on close and raises ENOSPC a second time."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        chunk = 65536
        while chunk:
            try:
                os.write(fd, b"\0" * chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                chunk //= 2
    finally:
        os.close(fd)


def _next_check_raises(ckpt: Checkpointer) -> CheckpointSaveError:
    """Call raise_if_save_failed() as the loop does after each step until it raises."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        started = time.perf_counter()
        try:
            ckpt.raise_if_save_failed()
        except CheckpointSaveError as e:
            return e
        assert time.perf_counter() - started < 0.05  # a check never waits for the save
        time.sleep(0.01)
    pytest.fail("the failed save was not reported within 60 s")


def _check_the_report(
    error: CheckpointSaveError, directory: Path, step: int, earlier: int, state, capfd
) -> None:
    msg = str(error)
    assert msg.startswith(f"checkpoint {directory / str(step)} could not be written: ")
    assert "[Errno 28] No space left on device" in msg
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    assert f"needs about {format_bytes(nbytes)} (the train state" in msg
    assert re.search(rf"{re.escape(str(directory))} has [0-9.]+ [KMGTP]?i?B free", msg)
    assert f"Checkpoint {earlier} is intact" in msg and "the partial write was removed" in msg
    assert len(msg.splitlines()) == 1
    # No temporary directory of the failed save; the earlier checkpoint as it was.
    assert sorted(p.name for p in directory.iterdir()) == [str(earlier)]
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ERROR" not in err, err[:2000]


def _restores_to(cfg, directory: Path, state) -> None:
    ckpt = Checkpointer(directory, read_only=True)
    try:
        restored = ckpt.restore(cfg, training_mesh(cfg.mesh.sizes()), make_optimizer(cfg.train))
    finally:
        ckpt.close()
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _with_step_2(directory, cfg, state) -> Checkpointer:
    """A Checkpointer (keep 3) over ``directory`` holding one complete checkpoint, step 2."""
    ckpt = Checkpointer(directory, keep=3)
    ckpt.save(at_step(state, 2), cfg, {"step": 2})
    ckpt.wait()
    return ckpt


def test_a_full_disk_is_reported_at_the_next_check(fresh, small_disk, capfd):
    cfg, state = fresh
    directory = small_disk / "ck"
    ckpt = _with_step_2(directory, cfg, state)
    try:
        _fill(small_disk)
        capfd.readouterr()
        ckpt.save(at_step(state, 4), cfg, {"step": 4})  # returns: the write goes on behind
        error = _next_check_raises(ckpt)
        _check_the_report(error, directory, 4, 2, state, capfd)
        ckpt.raise_if_save_failed()  # reported once

        # With room again, the same Checkpointer saves.
        (small_disk / "filler").unlink()
        ckpt.save(at_step(state, 4), cfg, {"step": 4})
        ckpt.wait()
        assert ckpt.all_steps() == [2, 4]
    finally:
        ckpt.close()
    _restores_to(cfg, directory, at_step(state, 4))


@pytest.mark.parametrize("reported_by", ["raise_if_save_failed", "close"])
def test_a_failing_finalize_is_reported_quietly(fresh, tmp_path, monkeypatch, capfd, reported_by):
    """orbax's last step of a save (renaming the temporary directory) failing with ENOSPC, as
    on a disk that fills up at the end of a write; reported by the per-step check, or by
    close() when it was the run's last save."""
    cfg, state = fresh
    directory = tmp_path / "ck"
    ckpt = _with_step_2(directory, cfg, state)
    try:

        async def no_space(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.get()))

        monkeypatch.setattr(ocp.path.atomicity.AtomicRenameTemporaryPath, "finalize", no_space)
        capfd.readouterr()
        ckpt.save(at_step(state, 4), cfg, {"step": 4})
        if reported_by == "close":
            with pytest.raises(CheckpointSaveError) as e:
                ckpt.close()
            error = e.value
        else:
            error = _next_check_raises(ckpt)
        _check_the_report(error, directory, 4, 2, state, capfd)
    finally:
        ckpt.close()
    _restores_to(cfg, directory, at_step(state, 2))


def _abandon_a_task(package: str) -> None:
    """What orbax leaves behind after a failed save (``package`` "orbax"), collected late (at
    the interpreter's exit in a run): an asyncio task whose exception nobody retrieved. Its
    coroutine is compiled as if from ``package``'s source (asyncio names where it was
    defined)."""
    source = "async def commit():\n    raise OSError(28, 'RESOURCE_EXHAUSTED: No space left')\n"
    namespace: dict = {}
    where = os.sep.join(["", "site-packages", package, "commit.py"])
    exec(compile(source, where, "exec"), namespace)
    loop = asyncio.new_event_loop()
    task = loop.create_task(namespace["commit"]())
    loop.run_until_complete(asyncio.sleep(0.01))
    loop.close()
    del task
    gc.collect()  # Task.__del__: asyncio logs "Task exception was never retrieved"


def test_orbax_leftovers_collected_after_a_failed_save_stay_quiet(
    fresh, tmp_path, monkeypatch, caplog
):
    """Fault 5 of the second campaign: after the one-line error of a failed later save, 1 run
    in 2 also printed `ERROR:asyncio:Task exception was never retrieved` and orbax's
    RESOURCE_EXHAUSTED traceback: orbax's abandoned task was collected after close() had
    taken the filter off. After a failure it stays on for the process, for orbax's leftovers
    only: another library's unretrieved task still reports."""
    cfg, state = fresh
    ckpt = _with_step_2(tmp_path / "ck", cfg, state)

    async def no_space(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.get()))

    monkeypatch.setattr(ocp.path.atomicity.AtomicRenameTemporaryPath, "finalize", no_space)
    ckpt.save(at_step(state, 4), cfg, {"step": 4})
    with pytest.raises(CheckpointSaveError):
        ckpt.close()
    ckpt.close()
    for package, reported in [("orbax", 0), ("elsewhere", 1)]:
        caplog.clear()
        _abandon_a_task(package)
        leftovers = [r for r in caplog.records if "never retrieved" in r.getMessage()]
        assert len(leftovers) == reported, (package, caplog.text)
