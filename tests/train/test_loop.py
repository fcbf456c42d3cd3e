"""Tests of seqshard.train.loop: metrics, exact resumption (same mesh, other meshes, after SIGTERM),
and refusing bad input before it costs anything."""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from process_helpers import SEQSHARD, xla_flags
from run_helpers import FLAT, by_step, latest_state, quiet, run

from seqshard.config import ConfigError, load_config
from seqshard.train import loop
from seqshard.train.checkpoint import Checkpointer, CheckpointError
from seqshard.train.loop import train
from seqshard.train.metrics import MetricsLogger

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_overrides):
    """A 12-step run straight through: (runs directory, its TrainResult)."""
    root = tmp_path_factory.mktemp("loop_runs")
    straight = run(tiny_overrides(root, "straight", steps=12, **FLAT))
    return root, straight


@pytest.fixture
def half_copy(trained_run, tmp_path):
    """A copy of the session's 6-step run of the same config (conftest.py's trained_run:
    checkpoints at 4 and 6), under ``tmp_path/runs/half``, to resume."""
    _, run_dir = trained_run
    shutil.copytree(run_dir, tmp_path / "runs" / "half")
    return tmp_path / "runs"


# -- metrics ------------------------------------------------------------------------------


def test_metrics_jsonl_tensorboard_and_result(runs, tiny_overrides):
    root, result = runs
    records = by_step(root / "straight")
    assert sorted(records) == list(range(1, 13))  # log_every=1
    for step, r in records.items():
        assert {"step", "loss", "lr", "grad_norm", "time"} <= set(r)
        assert np.isfinite(r["loss"]) and r["grad_norm"] > 0
        # The first step compiles; it is kept out of the throughput figures.
        if step > 1:
            assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["mfu"] > 0
    assert {s for s, r in records.items() if "val_loss" in r} == {3, 6, 9, 12}
    assert records[1]["lr"] == 0.0 and records[3]["lr"] == pytest.approx(3e-3)  # warmup of 2
    assert records[12]["loss"] < records[1]["loss"]  # it learns something

    events = list((root / "straight" / "tb").glob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)

    assert result.run_dir == root / "straight"
    assert result.step == 12 and not result.interrupted and not result.already_finished
    assert result.train_loss == records[12]["loss"]
    assert result.val_loss == records[12]["val_loss"]
    assert result.tokens_per_s == records[12]["tokens_per_s"] and result.mfu == records[12]["mfu"]
    # config.yaml is the resolved config: loading it gives the run's config back.
    saved = load_config(root / "straight" / "config.yaml")
    assert saved == load_config(None, tiny_overrides(root, "straight", steps=12, **FLAT))


# -- resumption -------------------------------------------------------------------------------


def test_resume_on_the_same_mesh_is_bit_for_bit(runs, half_copy, tiny_overrides):
    root, _ = runs
    result = run(tiny_overrides(half_copy, "half", steps=12, **FLAT))
    assert result.step == 12 and not result.interrupted
    resumed, straight = by_step(half_copy / "half"), by_step(root / "straight")
    assert sorted(resumed) == list(range(1, 13))
    for step in range(1, 13):
        for key in ("loss", "grad_norm", "lr", "val_loss"):
            assert resumed[step].get(key) == straight[step].get(key), (step, key)

    cfg = load_config(None, tiny_overrides(root, "straight", steps=12, **FLAT))
    a, b = latest_state(root / "straight", cfg), latest_state(half_copy / "half", cfg)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


RESUME_CHANGES = [
    pytest.param(["mesh.d=2", "mesh.t=4"], id="2x4", marks=pytest.mark.slow),
    pytest.param(["mesh.d=8", "mesh.t=1"], id="8x1"),
    # Same model, other layouts and autodiff's backward: the residual over M, not L.
    pytest.param(
        ["model.residual=M/t", "model.backward=autodiff"], id="M/t-explicit", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize("changes", RESUME_CHANGES)
def test_resume_on_another_mesh_matches_within_tolerance(runs, half_copy, tiny_overrides, changes):
    root, _ = runs
    overrides = tiny_overrides(half_copy, "half", steps=12, **FLAT)
    run([*overrides, *changes])
    resumed, straight = by_step(half_copy / "half"), by_step(root / "straight")
    assert sorted(resumed) == list(range(1, 13))
    for step in range(7, 13):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in straight[step]:
                np.testing.assert_allclose(
                    resumed[step][key], straight[step][key], rtol=2e-5, err_msg=f"{step} {key}"
                )
    assert resumed[12]["lr"] == straight[12]["lr"]
    # The saved config records the mesh and layouts it last ran on.
    assert load_config(half_copy / "half" / "config.yaml") == load_config(
        None, [*overrides, *changes]
    )


def test_a_changed_train_steps_is_noted_with_the_lr_it_changes():
    """Resuming with another train.steps recomputes the schedule; the log says what it does."""
    base = load_config(None, ["train.steps=300", "train.warmup_steps=30", "train.lr=1e-3"]).train
    assert loop._schedule_change(base, base, 300) is None  # unchanged
    cosine = loop._schedule_change(
        base, dataclasses.replace(base, schedule="cosine", steps=600), 300
    )
    # The finished cosine ended at lr * min_lr_ratio; at half of 600 steps it is back near the middle.
    assert cosine.startswith("train.steps changed 300 -> 600: the cosine lr schedule"), cosine
    assert cosine.endswith(f"lr at step 300: {1e-3 * base.min_lr_ratio:.3g} -> 0.000587"), cosine
    wsd = dataclasses.replace(base, schedule="wsd", decay_fraction=0.2)
    # Extended from the stable phase (step 200 of 300), WSD keeps lr.
    assert loop._schedule_change(wsd, dataclasses.replace(wsd, steps=600), 200).endswith(
        "lr at step 200: 0.001 -> 0.001"
    )


def test_finished_run_resumed_again_does_nothing(runs, half_copy, tiny_overrides):
    before = (half_copy / "half" / "metrics.jsonl").read_text()
    result = run(tiny_overrides(half_copy, "half", steps=6, **FLAT))
    assert result.step == 6 and not result.interrupted
    assert result.already_finished and result.train_loss is None
    assert result.val_loss == pytest.approx(by_step(half_copy / "half")[6]["val_loss"])
    assert (half_copy / "half" / "metrics.jsonl").read_text() == before


def test_a_run_that_failed_before_its_first_checkpoint_does_not_lock_its_dir(
    tmp_path, tiny_overrides
):
    """A failure before anything was saved loses nothing, so the next config may use the dir."""
    run_dir = tmp_path / "runs" / "tiny"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("model: {d_model: 999}\n")  # left by a failed start
    result = run(tiny_overrides(tmp_path / "runs", steps=2, eval_every=0))
    assert result.step == 2
    assert load_config(run_dir / "config.yaml").model.d_model == 32


def test_a_signal_while_logging_still_stops_with_a_checkpoint(
    runs, tmp_path, tiny_overrides, monkeypatch
):
    """SIGTERM landing while step 3 is logged, after the loop decided step 3 is not the last,
    stops after step 4 with a checkpoint (not after step 3 without one); resuming then gives
    the uninterrupted run's losses."""

    class SignalWhileLogging(MetricsLogger):
        def log(self, step, metrics):
            super().log(step, metrics)
            if step == 3:
                handler = signal.getsignal(signal.SIGTERM)
                assert type(getattr(handler, "__self__", None)).__name__ == "_StopOnSignal"
                os.kill(os.getpid(), signal.SIGTERM)

    overrides = tiny_overrides(tmp_path, "signalled", steps=12, **FLAT)
    with monkeypatch.context() as m:
        m.setattr(loop, "MetricsLogger", SignalWhileLogging)
        result = run(overrides)
    assert result.interrupted and result.step == 4
    run_dir = tmp_path / "signalled"
    ckpt = Checkpointer(run_dir / "checkpoints")
    try:
        assert ckpt.latest_step() == 4
    finally:
        ckpt.close()
    # No evaluation on the way out (train.eval_on_stop is off): stopping takes seconds.
    assert "val_loss" not in by_step(run_dir)[4] and "loss" in by_step(run_dir)[4]

    result = run(overrides)
    assert result.step == 12 and not result.interrupted
    resumed, straight = by_step(run_dir), by_step(runs[0] / "straight")
    assert sorted(resumed) == list(range(1, 13))
    for step in range(1, 13):
        assert resumed[step]["loss"] == straight[step]["loss"], step


def test_sigterm_checkpoints_and_resuming_loses_nothing(tmp_path, tiny_overrides):
    """`seqshard train` stopped by SIGTERM mid-run exits 0 with a checkpoint; resuming it gives
    the uninterrupted run's losses, step for step."""
    steps = 120
    config = tmp_path / "tiny.yaml"
    config.write_text(f"base: {REPO / 'configs' / 'tiny-cpu.yaml'}\n")
    overrides = tiny_overrides(
        tmp_path / "runs", "killed", steps=steps, eval_every=40, checkpoint_every=0
    )
    env = {**os.environ, "XLA_FLAGS": xla_flags(8)}
    cmd = [*SEQSHARD, "train", str(config), *overrides, "--sample-tokens", "0"]
    metrics = tmp_path / "runs" / "killed" / "metrics.jsonl"

    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and metrics.read_text().count("\n") >= 3:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "SIGTERM" in out and "stopped early" in out
    # The hint resumes this run, not the config's default one: every override repeated.
    hint = out.split("stopped early; `")[1].split("` resumes")[0]
    assert shlex.split(hint) == ["seqshard", "train", str(config), *overrides], hint
    assert took < 10, took  # no evaluation on the way out; one small checkpoint
    assert "Traceback" not in err
    stopped_at = max(by_step(metrics.parent))
    assert 3 <= stopped_at < steps
    ckpt = Checkpointer(metrics.parent / "checkpoints")
    try:
        assert ckpt.latest_step() == stopped_at
    finally:
        ckpt.close()

    resumed = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming {metrics.parent} at step {stopped_at}" in resumed.stdout

    # The uninterrupted run: same config, a fresh run directory, in this process.
    straight = train(load_config(config, [*overrides, "run.name=straight"]), log=quiet, tty=False)
    killed, reference = by_step(metrics.parent), by_step(straight.run_dir)
    assert sorted(killed) == sorted(reference) == list(range(1, steps + 1))
    for step in reference:
        assert killed[step]["loss"] == reference[step]["loss"], step
    assert killed[steps]["val_loss"] == reference[steps]["val_loss"]


# -- bad input: refused with the values, before anything is written or compiled -----------------


def test_run_dir_of_another_config_is_refused(runs, half_copy, tiny_overrides):
    run_dir = half_copy / "half"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    overrides = tiny_overrides(half_copy, "half", steps=12, **FLAT)
    with pytest.raises(ConfigError) as e:
        run([*overrides, "model.d_model=64"])
    msg = str(e.value)
    assert str(run_dir) in msg and "model.d_model: 32 -> 64" in msg
    with pytest.raises(ConfigError, match=r"train\.lr: 0\.003 -> 0\.001"):
        run([*overrides, "train.lr=1e-3"])
    with pytest.raises(ConfigError, match=r"data\.seed: 0 -> 1"):
        run([*overrides, "data.seed=1"])
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_a_run_saved_with_relative_paths_resumes_where_it_ran(
    half_copy, tiny_overrides, monkeypatch
):
    """Issue 41: a config's relative paths are now relative to its file, and a run saves them
    absolute. A run whose config.yaml was saved before, ``data.dir: tokens`` relative to the
    directory `seqshard train` ran in, resumes from that directory (the paths compared
    resolved), and is refused from another, where the same words mean other data."""
    run_dir = half_copy / "half"
    cfg = load_config(None, tiny_overrides(half_copy, "half", steps=12, **FLAT))
    data = Path(cfg.data.dir)
    saved = (run_dir / "config.yaml").read_text()
    assert f"  dir: {data}\n" in saved
    (run_dir / "config.yaml").write_text(saved.replace(f"  dir: {data}\n", f"  dir: {data.name}\n"))
    monkeypatch.chdir(data.parent)
    assert loop._check_run_dir(run_dir, cfg) is True  # resumes
    monkeypatch.chdir(half_copy)
    with pytest.raises(ConfigError) as e:
        loop._check_run_dir(run_dir, cfg)
    assert f"data.dir: '{half_copy / data.name}' -> '{data}'" in str(e.value)


def test_a_corrupt_checkpoint_stops_the_resume_with_a_checkpoint_error(half_copy, tiny_overrides):
    """Every kept checkpoint zeroed (a damaged newest one alone is skipped for the one before:
    test_checkpoint.py)."""
    run_dir = half_copy / "half"
    for step in ("4", "6"):
        for path in (run_dir / "checkpoints" / step / "state" / "d").iterdir():
            path.write_bytes(b"\0" * path.stat().st_size)
    metrics = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError) as e:
        run(tiny_overrides(half_copy, "half", steps=12, **FLAT))
    assert str(run_dir / "checkpoints" / "6") in str(e.value)
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # nothing was truncated


def test_an_unpreparable_data_dir(tmp_path, tiny_overrides):
    overrides = tiny_overrides(tmp_path / "runs")
    missing = tmp_path / "no-such-text"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        run([*overrides, f"data.dir={tmp_path / 'new-data'}", f"data.inputs=[{missing}]"])
    assert not (tmp_path / "new-data").exists()
    assert not (tmp_path / "runs").exists()


def test_a_truncated_token_file_is_named(tmp_path, data_dir, tiny_overrides):
    broken = tmp_path / "data"
    shutil.copytree(data_dir, broken)
    train_bin = broken / "train-00000.bin"
    with open(train_bin, "r+b") as f:
        f.truncate(train_bin.stat().st_size - 1)
    with pytest.raises(ValueError, match="not a multiple of 2") as e:
        run([*tiny_overrides(tmp_path / "runs"), f"data.dir={broken}"])
    assert str(train_bin) in str(e.value)


def test_a_model_vocab_below_the_tokenizers_is_refused_before_training(
    tmp_path, data_dir, tiny_overrides
):
    overrides = [*tiny_overrides(tmp_path / "runs"), "model.vocab=256", "data.vocab_size=256"]
    with pytest.raises(ConfigError) as e:
        run(overrides)
    msg = str(e.value)
    assert "300" in msg and "model.vocab=256" in msg and str(data_dir) in msg
    assert not (tmp_path / "runs").exists()
