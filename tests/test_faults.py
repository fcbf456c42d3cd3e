"""The fault campaign, run by `seqshard train` as a user would meet it: divergence under both
non-finite policies, SIGTERM at start-up and during the first compile (mid-run: test_loop.py),
kill -9 mid-run and at random moments (slow), paths that try to escape the run directory, and
inputs that used to be accepted.

Damaged checkpoints and full disks are in tests/train/test_checkpoint.py. Every subprocess here is
killed on the test's own timeout (:func:`launch`)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from process_helpers import SEQSHARD, xla_flags

from seqshard.cli import EXIT_ERROR, EXIT_NONFINITE, main
from seqshard.config import ConfigError, load_config
from seqshard.mesh import training_mesh
from seqshard.train.checkpoint import Checkpointer, latest_state
from seqshard.train.loop import NonfiniteError, train
from seqshard.train.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "XLA_FLAGS": xla_flags(8)}
FLAT = {"min_lr_ratio": 1.0}  # a schedule that does not depend on train.steps


def quiet(_msg: str) -> None:
    pass


def losses(run_dir: Path) -> dict[int, float]:
    """step -> train loss; a resumed run's later record of a step wins."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def checkpoint_steps(run_dir: Path) -> list[int]:
    ckpt = Checkpointer(run_dir / "checkpoints")
    try:
        return sorted(ckpt.manager.all_steps())
    finally:
        ckpt.close()


class launch:
    """``with launch(args, cwd) as proc``: `seqshard train ...` in a subprocess, killed (with
    its output collected) however the block ends."""

    def __init__(self, args: list[str], cwd: Path):
        self.proc = subprocess.Popen(
            [*SEQSHARD, *args],
            cwd=cwd,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def __enter__(self) -> subprocess.Popen:
        return self.proc

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the run ended first: {proc.communicate()}"
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def metric_lines(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


# -- divergence -------------------------------------------------------------------------------


def diverging(tiny_overrides, root: Path, name: str, **train) -> list[str]:
    """lr=1e6 without clipping: the loss is NaN within a few steps."""
    steps = {"steps": 15, "log_every": 4, "eval_every": 0, "checkpoint_every": 2}
    return tiny_overrides(root, name, lr=1e6, grad_clip=0, **{**steps, **train})


def test_divergence_stops_and_never_saves_a_non_finite_state(tmp_path, tiny_overrides):
    """train.nonfinite=stop (the default): the run stops with the step, the values and the
    last good checkpoint; every checkpoint on disk is finite and from before that step."""
    cfg = load_config(None, diverging(tiny_overrides, tmp_path, "stop"))
    with pytest.raises(NonfiniteError) as e:
        train(cfg, log=quiet, tty=False)
    msg = str(e.value)
    bad_step = int(msg.split("step ")[1].split(":")[0])
    # lr=1e6 saturates the model: its gradient is exactly zero a step or two before the NaN.
    assert "; stopping (train.nonfinite=stop)" in msg
    assert "loss nan" in msg or "grad norm nan" in msg or "grad norm zero" in msg
    saved = checkpoint_steps(tmp_path / "stop")
    assert saved and max(saved) < bad_step, (saved, bad_step)
    assert f"checkpoints/{max(saved)} (step {max(saved)})" in msg
    state = latest_state(tmp_path / "stop", cfg, training_mesh(cfg.mesh.sizes()))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.weights))


def test_divergence_with_skip_stops_after_max_skips_in_a_row(tmp_path, tiny_overrides):
    overrides = diverging(
        tiny_overrides, tmp_path, "skip", nonfinite="skip", max_nonfinite_skips=3, log_every=1
    )
    cfg = load_config(None, overrides)
    notes: list[str] = []
    with pytest.raises(NonfiniteError, match=r"3 non-finite or zero-gradient steps in a row"):
        train(cfg, log=notes.append, tty=False)
    skipped = [m for m in notes if "update skipped" in m]
    assert skipped and "train.nonfinite=skip stops after 3 in a row" in skipped[0]
    state = latest_state(tmp_path / "skip", cfg, training_mesh(cfg.mesh.sizes()))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


def test_the_command_exits_3_with_one_line_and_no_traceback(tmp_path, tiny_overrides, capsys):
    overrides = diverging(tiny_overrides, tmp_path, "cli", log_every=1)
    config = tmp_path / "c.yaml"
    config.write_text(f"base: {REPO / 'configs' / 'tiny-cpu.yaml'}\n")
    assert main(["train", str(config), *overrides, "--sample-tokens", "0"]) == EXIT_NONFINITE
    err = capsys.readouterr().err
    assert err.startswith("seqshard train: error: step ") and "Traceback" not in err
    assert err.count("\n") == 1


# -- signals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "moment", ["start-up", pytest.param("first compile", marks=pytest.mark.slow)]
)
def test_sigterm_before_the_first_step_exits_promptly_with_nothing_saved(
    tmp_path, tiny_overrides, moment
):
    config = tmp_path / "c.yaml"
    config.write_text(f"base: {REPO / 'configs' / 'tiny-cpu.yaml'}\n")
    run_dir = tmp_path / "runs" / "early"
    args = ["train", str(config), *tiny_overrides(tmp_path / "runs", "early"), "--sample-tokens=0"]
    with launch(args, tmp_path) as proc:
        if moment == "start-up":
            time.sleep(1.0)  # importing JAX (seqshard itself imports in ~0.1 s)
        else:
            wait_for(lambda: (run_dir / "config.yaml").exists(), proc)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - signalled
    assert proc.returncode == 0, err
    assert "nothing to save" in out and "Traceback" not in err
    assert took < 30, took  # (at most the compile in flight; seconds)
    assert not (run_dir / "checkpoints").exists() or not checkpoint_steps(run_dir)


@pytest.mark.parametrize(
    "delay", [0.6, *(pytest.param(d, marks=pytest.mark.slow) for d in (0.0, 0.3, 0.9, 1.2, 1.5))]
)
def test_sigterm_inside_the_first_compile_ends_without_teardown(tmp_path, tiny_overrides, delay):
    """Fault 1 of the campaign: SIGTERM while the train step's first compile runs raised out of
    JAX's wait for the compile, not out of the compile; Python's teardown then freed XLA's
    client under it (exit 134/139: 3 of 8 signals at 1.5-2.5 s into the compile of tiny-cpu's
    model). Now the process ends without the teardown, at once, with exit 0 and nothing saved.

    tiny-cpu's model (not the tests' tiny one: its step compiles in about 2 s here, long enough
    to land in) on the tiny data. The signal's moment is pinned by a watcher of the main
    thread's stack (tests/signal_in_compile.py). Without the fix the atexit line
    (``interpreter teardown``) is printed every time, the crash comes only sometimes."""
    run_dir = tmp_path / "runs" / "early"
    overrides = [o for o in tiny_overrides(tmp_path / "runs", "early") if "model." not in o]
    args = [sys.executable, str(REPO / "tests" / "signal_in_compile.py"), str(delay)]
    # Without the session's compilation cache (conftest.py): a hit would skip the compile.
    env = {k: v for k, v in ENV.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    proc = subprocess.run(
        [*args, "train", str(REPO / "configs" / "tiny-cpu.yaml"), *overrides, "--sample-tokens=0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert "sending SIGTERM in the compile" in proc.stdout, out
    assert proc.returncode == 0, out
    assert "nothing to save" in proc.stdout and "Traceback" not in proc.stderr, out
    assert "interpreter teardown" not in proc.stdout, out
    assert not (run_dir / "checkpoints").exists() or not checkpoint_steps(run_dir)


# -- kill -9 ----------------------------------------------------------------------------------


def kill_and_resume(tmp_path, tiny_overrides, moments: list[float], steps: int = 24):
    """Kill -9 `seqshard train` at each of ``moments`` (seconds after the first logged step),
    resuming after each; then finish. Returns (resumed losses, uninterrupted losses)."""
    config = tmp_path / "c.yaml"
    config.write_text(f"base: {REPO / 'configs' / 'tiny-cpu.yaml'}\n")
    overrides = tiny_overrides(
        tmp_path / "runs", "killed", steps=steps, checkpoint_every=2, keep_checkpoints=2, **FLAT
    )
    args = ["train", str(config), *overrides, "--sample-tokens=0"]
    run_dir = tmp_path / "runs" / "killed"
    for moment in moments:
        before = metric_lines(run_dir)
        with launch(args, tmp_path) as proc:
            wait_for(lambda: metric_lines(run_dir) > before, proc)  # noqa: B023
            time.sleep(moment)
            proc.kill()
    finished = subprocess.run(
        [*SEQSHARD, *args], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert finished.returncode == 0, finished.stderr
    straight = train(load_config(config, [*overrides, "run.name=straight"]), log=quiet, tty=False)
    return losses(run_dir), losses(straight.run_dir)


@pytest.mark.slow  # ~30 s; SIGTERM's resume (test_loop) and the checkpoint tests run by default
def test_kill_9_mid_run_resumes_to_the_same_curve(tmp_path, tiny_overrides):
    killed, straight = kill_and_resume(tmp_path, tiny_overrides, [0.5])
    assert killed == straight


@pytest.mark.slow
def test_kill_9_campaign_at_random_moments(tmp_path, tiny_overrides):
    """Kills during compile, mid-step, mid-save and mid-cleanup (keep_checkpoints=2 with a
    save every 2 steps deletes a checkpoint every save), then an identical curve."""
    rng = random.Random(0)
    killed, straight = kill_and_resume(
        tmp_path, tiny_overrides, [rng.uniform(0, 1.5) for _ in range(6)], steps=40
    )
    assert killed == straight
    leftovers = [p.name for p in (tmp_path / "runs" / "killed" / "checkpoints").iterdir()]
    assert all(name.isdigit() for name in leftovers), leftovers


# -- a full disk outside a save -----------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs at ``tmp_path / "disk"`` (skipped where this process cannot mount one)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill_leaving(disk: Path, pages: int) -> None:
    """Fill ``disk`` to the last byte, then free ``pages`` 4 KiB pages (tmpfs counts pages)."""
    reserve = disk / "reserve"
    reserve.write_bytes(b"\0" * 4096 * pages)
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        chunk = 65536
        while chunk:
            try:
                os.write(fd, b"\0" * chunk)
            except OSError:
                chunk //= 2
    finally:
        os.close(fd)
    reserve.unlink()


def test_a_disk_full_outside_a_save_stops_with_one_line(tmp_path, tiny_overrides, small_disk):
    """Fault 4 of the campaign: the disk filled after checkpoint 10 printed a bare "[Errno 28]
    No space left on device" with no path, ~25 lines of tensorboardX tracebacks at exit, and
    left metrics.jsonl ending in a torn line. Here a run checkpoints at 2, the disk is filled
    leaving two pages (the run files' rewrites fit, the metrics and events of the next steps do
    not), and the resumed run must stop with one line: the file, the OS error, the bytes needed
    and free, and the newest intact checkpoint; no traceback; metrics.jsonl whole lines."""
    config = tmp_path / "c.yaml"
    config.write_text(f"base: {REPO / 'configs' / 'tiny-cpu.yaml'}\n")
    overrides = tiny_overrides(small_disk / "runs", "full", steps=2, eval_every=0)
    run_dir = small_disk / "runs" / "full"
    assert train(load_config(config, overrides), log=quiet, tty=False).step == 2
    fill_leaving(small_disk, pages=2)
    more = ["train.steps=400", "train.checkpoint_every=0", "train.eval_every=0"]
    keys = {m.split("=")[0] for m in more}  # (a key given twice on the command line: an error)
    args = [*(o for o in overrides if o.split("=")[0] not in keys), *more, "--sample-tokens=0"]
    proc = subprocess.run(
        [*SEQSHARD, "train", str(config), *args],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == EXIT_ERROR, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err and "Exception ignored" not in err
    assert re.match(rf"seqshard train: error: could not write {re.escape(str(run_dir))}/", err)
    assert "[Errno 28] No space left on device" in err
    assert re.search(
        r"The write needed [0-9.]+ [KMGTP]?i?B; \S+ has [0-9.]+ [KMGTP]?i?B free", err
    ), err
    assert f"newest intact checkpoint is {run_dir / 'checkpoints' / '2'} (step 2)" in err, err
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    steps = [json.loads(line)["step"] for line in text.splitlines()]
    assert steps[:2] == [1, 2] and len(steps) > 2, steps
    assert checkpoint_steps(run_dir) == [2]


# -- paths and inputs -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../escape", "a/../../escape", "/tmp/abs", "..", "a b"])
def test_run_name_cannot_leave_run_dir(tmp_path, tiny_overrides, name):
    with pytest.raises(ConfigError, match="only letters, digits, '.', '_' and '-'"):
        load_config(None, [*tiny_overrides(tmp_path / "runs"), f"run.name={name}"])
    assert not (tmp_path / "escape").exists()


def test_an_empty_data_dir_is_prepared_and_a_foreign_one_refused(
    tmp_path, tiny_overrides, corpus_dir
):
    empty = tmp_path / "empty"
    empty.mkdir()
    overrides = [*tiny_overrides(tmp_path / "runs", steps=1, eval_every=0)]
    cfg = load_config(None, [*overrides, f"data.dir={empty}", f"data.inputs=[{corpus_dir}]"])
    assert train(cfg, log=quiet, tty=False).step == 1
    assert json.loads((empty / "meta.json").read_text())["vocab_size"] == 300

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    cfg = load_config(None, [*overrides, f"data.dir={foreign}", "run.name=other"])
    with pytest.raises(ConfigError, match=r"exists but is not a prepared data directory"):
        train(cfg, log=quiet, tty=False)
    assert (foreign / "notes.txt").read_text() == "mine"


# -- the second campaign (issue 40): run directories, bad data, run.json -----------------------


def copy_of_trained(trained_run, root: Path, name: str) -> Path:
    """A private copy of the conftest's trained run (6 steps, checkpoints 4 and 6)."""
    _, run_dir = trained_run
    return Path(shutil.copytree(run_dir, root / name))


def moved(cfg, run_dir: Path, name: str, **train_changes):
    """``cfg`` of the run ``run_dir / name``, with ``train_changes``."""
    return dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, dir=str(run_dir), name=name),
        train=dataclasses.replace(cfg.train, **train_changes),
    )


def test_a_run_dir_without_its_config_is_never_taken_for_a_fresh_run(tmp_path, trained_run):
    """Fault 1: `cp -r runs/a runs/b && rm runs/b/config.yaml`, then a train with another lr:
    exit 0, metrics.jsonl truncated to the new run's lines, its checkpoints pruned among the
    old ones, and the next command resumed the old trajectory under the new lr. Now the
    config saved with the checkpoint is compared, the mismatch refused by key, and nothing
    the run did not write is truncated or pruned; the same config resumes."""
    run_dir = copy_of_trained(trained_run, tmp_path, "b")
    (run_dir / "config.yaml").unlink()
    metrics = (run_dir / "metrics.jsonl").read_text()
    other = moved(trained_run[0], tmp_path, "b", lr=1e-3, steps=12)
    with pytest.raises(ConfigError) as e:
        train(other, log=quiet, tty=False)
    msg = str(e.value)
    assert f"{run_dir} holds a run of another config (train.lr: 0.003 -> 0.001" in msg
    assert f"saved in checkpoint {run_dir / 'checkpoints' / '6'})" in msg
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    assert checkpoint_steps(run_dir) == [4, 6]

    # Metrics alone (no checkpoint, no config): not this run's to truncate either.
    shutil.rmtree(run_dir / "checkpoints")
    with pytest.raises(ConfigError, match=r"holds metrics\.jsonl but no config\.yaml"):
        train(other, log=quiet, tty=False)
    assert (run_dir / "metrics.jsonl").read_text() == metrics

    # The run's own config resumes (and writes config.yaml again).
    again = copy_of_trained(trained_run, tmp_path, "c")
    (again / "config.yaml").unlink()
    result = train(moved(trained_run[0], tmp_path, "c", steps=8), log=quiet, tty=False)
    assert result.step == 8 and (again / "config.yaml").is_file()
    assert [s for s in losses(again)] == list(range(1, 9))


def corrupt_an_offset_read_at_a_later_step(data: Path, cfg) -> int:
    """Corrupt one inner offset of ``data``'s train split that the loader of ``cfg`` first
    reads at a step >= 2 (found with the loader itself); returns that step (0-based)."""
    from seqshard.data import Loader

    path = next(data.glob("train*.offsets.npy"))
    clean = np.load(path)
    mesh = training_mesh(cfg.mesh.sizes())
    for k in range(len(clean) // 2, len(clean) - 1):
        offsets = clean.copy()
        offsets[k] = 10**9
        np.save(path, offsets)
        args = {"batch_size": cfg.train.batch_size, "seq_len": cfg.train.seq_len, "mesh": mesh}
        with Loader(data, "train", prefetch=0, seed=cfg.data.seed, **args) as loader:
            for step in range(40):
                try:
                    loader.batch_at(step)
                except ValueError:
                    break
        if 2 <= step < 39:
            return step
    raise AssertionError("no offset entry is first read at a later step")


def test_bad_data_found_mid_run_saves_the_steps_trained_and_names_the_file(
    tmp_path, tiny_overrides, data_dir
):
    """Fault 3: a corrupted inner offset raised IndexError from data/tokenfile.py at step 3,
    after two steps trained and nothing saved. Now the run stops with the file and the entry,
    after saving the steps it trained."""
    data = Path(shutil.copytree(data_dir, tmp_path / "data"))
    overrides = [
        *tiny_overrides(tmp_path / "runs", "bad", steps=40, eval_every=0),
        f"data.dir={data}",
    ]
    cfg = load_config(None, overrides)
    bad = corrupt_an_offset_read_at_a_later_step(data, cfg)
    with pytest.raises(ValueError) as e:
        train(cfg, log=quiet, tty=False)
    msg = str(e.value)
    assert msg.startswith(f"step {bad + 1}: bad data: {data}/train")
    assert "offsets.npy is corrupt: entry" in msg
    assert f"Steps up to {bad} were saved first" in msg
    assert checkpoint_steps(tmp_path / "runs" / "bad") == [bad]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{}", r"holds \{\}; expected \{\"data_dir\": \"/abs/path\"\}"),
        ("garbage", "is not readable JSON"),
    ],
)
def test_a_damaged_run_json_names_the_file_and_the_fix(
    tmp_path, trained_run, content, needle, capsys
):
    """Faults 6 and 11: run.json holding {} gave `KeyError: 'data_dir'` (a traceback) from
    seqshard eval, holding garbage "Expecting value: line 1 column 1" with no file."""
    run_dir = copy_of_trained(trained_run, tmp_path, "r")
    (run_dir / "run.json").write_text(content)
    assert main(["eval", str(run_dir)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(rf"error: {re.escape(str(run_dir / 'run.json'))}.*{needle}", err), err
    assert "pass the data the run trained on as an override (data.dir=DIR" in err
