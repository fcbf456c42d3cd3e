"""Tests of seqshard.launch: where a process's place in a run comes from, the CPU device count,
the collective-overlap flags; and real two-process runs of `seqshard train` and `seqshard eval`
on localhost (4 fake CPU devices each, gloo collectives), against one process on 8 devices,
including a process killed or failing (the survivor must not hang).

Every multi-process test kills all its processes on its own timeout (tests/process_helpers.py).
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from process_helpers import SEQSHARD, ProcessGroup, cpu_env, free_port, two_seqshard_processes

from seqshard import launch
from seqshard.config import load_config
from seqshard.launch import Processes, cpu_device_count_in_flags, find_processes
from seqshard.mesh import training_mesh
from seqshard.train.checkpoint import latest_state
from seqshard.train.loop import train
from seqshard.train.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
TINY_CPU = REPO / "configs" / "tiny-cpu.yaml"


# -- where a process's place comes from ----------------------------------------------------------


def test_flags_win_over_the_environment():
    env = {"SEQSHARD_COORDINATOR": "h:1", "SEQSHARD_NUM_PROCESSES": "4", "SEQSHARD_PROCESS_ID": "3"}
    assert find_processes("10.0.0.1:1234", 2, 1, env) == Processes("flags", "10.0.0.1:1234", 2, 1)
    assert find_processes(environ=env) == Processes("environment", "h:1", 4, 3)


def test_one_process_is_not_distributed():
    assert find_processes(environ={}) == Processes("single")
    assert find_processes("127.0.0.1:5", 1, 0, {}) == Processes("single")
    assert find_processes(environ={"SEQSHARD_DISTRIBUTED": "auto"}).source == "auto"
    off = {"SEQSHARD_DISTRIBUTED": "off", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0"}
    assert find_processes(environ=off) == Processes("single")


def test_slurm_with_several_tasks_is_left_to_jax():
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16", "SLURM_STEP_ID": "0"}
    assert find_processes(environ=slurm) == Processes("slurm", num_processes=16)
    assert find_processes(environ={**slurm, "SLURM_NTASKS": "1"}) == Processes("single")
    # sbatch's batch script (no step yet) is one process: srun starts the run's processes
    assert find_processes(environ={"SLURM_NTASKS": "16"}) == Processes("single")


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (("127.0.0.1:5", None, 0), "missing --num-processes"),
        ((None, 2, None), "missing --coordinator, --process-id"),
        (("127.0.0.1:5", 2, 2), "--process-id=2 must be in 0 .. --num-processes-1 = 1"),
        (("127.0.0.1", 2, 0), "--coordinator must be HOST:PORT"),
    ],
)
def test_incomplete_or_inconsistent_flags_say_what_to_give(given, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        find_processes(*given, environ={})


def test_environment_values_must_be_integers():
    env = {"SEQSHARD_COORDINATOR": "h:1", "SEQSHARD_NUM_PROCESSES": "two"}
    with pytest.raises(ValueError, match="SEQSHARD_NUM_PROCESSES must be an integer, got 'two'"):
        find_processes(environ=env)


def test_the_device_count_in_xla_flags_is_read_last_one_wins():
    assert cpu_device_count_in_flags("") is None
    assert cpu_device_count_in_flags("--xla_force_host_platform_device_count=4") == 4
    flags = (
        "--a=1 --xla_force_host_platform_device_count=4 --xla_force_host_platform_device_count=16"
    )
    assert cpu_device_count_in_flags(flags) == 16


def test_a_device_count_in_xla_flags_wins_over_the_configs(monkeypatch):
    jax.devices()  # the backend starts (8 devices, from conftest): its count stands after
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=16")
    assert launch.use_cpu_devices(8) == 16
    monkeypatch.delenv("XLA_FLAGS")
    assert launch.use_cpu_devices(2) == jax.local_device_count() == 8


@pytest.mark.parametrize(
    ("accelerator", "variable"), [("gpu", "XLA_FLAGS"), ("tpu", "LIBTPU_INIT_ARGS")]
)
def test_overlap_flags_go_to_the_accelerators_variable_and_keep_the_users(
    monkeypatch, accelerator, variable
):
    _, _, flags = launch.overlap_flags(accelerator)
    first = flags[0].split("=")[0]
    monkeypatch.setenv(variable, f"--mine=1 {first}=false")
    added = launch.set_overlap_flags(True, accelerator)
    assert added == list(flags[1:])
    value = launch.os.environ[variable]
    assert value.startswith(f"--mine=1 {first}=false") and f"{first}=true" not in value
    assert launch.set_overlap_flags(False, accelerator) == []


def test_no_overlap_flags_on_cpu(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert launch.set_overlap_flags(True, None) == []
    assert launch.os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


# -- two real processes ----------------------------------------------------------------------------

STEPS = 4


def _overrides(data_dir: Path, run_dir: Path, **train_values) -> list[str]:
    """configs/tiny-cpu.yaml cut down to a few quick steps on the tests' data."""
    t = {
        "steps": STEPS,
        "batch_size": 8,
        "seq_len": 32,
        "warmup_steps": 1,
        "log_every": 1,
        "eval_every": 0,
        "eval_batches": 2,
        "checkpoint_every": 0,
        "peak_flops": 1e10,
        **train_values,
    }
    return [
        *(f"train.{k}={v}" for k, v in t.items()),
        f"data.dir={data_dir}",
        "data.vocab_size=300",
        f"run.dir={run_dir.parent}",
        f"run.name={run_dir.name}",
    ]


def _two_processes(tmp_path: Path, command: list[str], **runtime) -> ProcessGroup:
    """``seqshard COMMAND`` as process 0 and 1 of a run (4 CPU devices each)."""
    return two_seqshard_processes(
        tmp_path, [*command, *(f"runtime.{k}={v}" for k, v in runtime.items())]
    )


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def _quiet(_msg: str) -> None:
    pass


def test_two_processes_train_like_one_and_their_checkpoints_restore_either_way(tmp_path, data_dir):
    """Two processes of 4 devices train configs/tiny-cpu.yaml (d=4 x t=2 over both) to the same
    losses as one process of 8, within 1e-4 relative (the reduction order differs); the
    checkpoint the two wrote restores in one process, and one written by one process
    restores in two (`seqshard eval` in two processes)."""
    two, one = tmp_path / "runs" / "two", tmp_path / "runs" / "one"
    with _two_processes(
        tmp_path, ["train", str(TINY_CPU), *_overrides(data_dir, two), "--sample-tokens", "0"]
    ) as group:
        assert group.wait(timeout=240) == [0, 0], group.outputs()
        out0, out1 = group.output(0), group.output(1)
    assert f"step {STEPS}: train loss" in out0
    assert "train loss" not in out1 and "run directory" not in out1  # process 0 reports
    cfg = load_config(TINY_CPU, _overrides(data_dir, one))
    result = train(cfg, log=_quiet, tty=False)
    assert result.step == STEPS
    two_losses, one_losses = _losses(two), _losses(one)
    assert sorted(two_losses) == list(range(1, STEPS + 1))
    np.testing.assert_allclose(
        [two_losses[s] for s in sorted(one_losses)], list(one_losses.values()), rtol=1e-4
    )
    # The two processes' checkpoint, restored by this one process on its 8 devices.
    mesh = training_mesh(cfg.mesh.sizes())
    from_two = latest_state(two, load_config(TINY_CPU, _overrides(data_dir, two)), mesh)
    from_one = latest_state(one, cfg, mesh)
    assert int(from_two.step) == int(from_one.step) == STEPS
    for a, b in zip(
        jax.tree.leaves(from_two.weights), jax.tree.leaves(from_one.weights), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)
    # One process's checkpoint, restored and evaluated by two.
    with _two_processes(tmp_path, ["eval", str(one)]) as group:
        assert group.wait(timeout=180) == [0, 0], group.outputs()
        evaluated = group.output(0)
    val = float(re.search(rf"step {STEPS}: val loss ([\d.]+)", evaluated).group(1))
    assert val == pytest.approx(result.val_loss, rel=1e-4)
    assert "val loss" not in group.output(1)


@pytest.mark.slow
def test_a_killed_process_stops_the_other_within_the_heartbeat_timeout(tmp_path, data_dir):
    """SIGKILL one process mid-run: the other, waiting in a collective, is ended by JAX once the
    dead process's heartbeat is missed (runtime.heartbeat_timeout_s=10): about 15 s here, well
    inside the 60 s this test allows."""
    run = tmp_path / "runs" / "killed"
    cmd = [
        "train",
        str(TINY_CPU),
        *_overrides(data_dir, run, steps=100_000, log_every=50),
        "--sample-tokens",
        "0",
    ]
    with _two_processes(tmp_path, cmd, heartbeat_timeout_s=10, shutdown_timeout_s=10) as group:
        group.wait_for(0, "compiled and ran the first step", timeout=180)
        group.kill(1, signal.SIGKILL)
        killed = time.monotonic()
        [code] = group.wait(timeout=60, which=[0])
        took = time.monotonic() - killed
    assert code != 0, group.output(0)
    print(f"survivor exited with {code} {took:.1f} s after its peer was killed")


@pytest.mark.slow
def test_a_failing_process_exits_at_once_and_the_other_follows(tmp_path, data_dir):
    """Process 1 fails (its host lacks the data directory): it prints its error and exits
    with status 2 at once, without waiting at JAX's shutdown barrier; process 0, waiting for
    it, is ended within the heartbeat timeout instead of hanging."""
    run = tmp_path / "runs" / "failing"
    port = free_port()
    flags = [
        "runtime.heartbeat_timeout_s=10",
        "runtime.shutdown_timeout_s=10",
        "--sample-tokens",
        "0",
    ]
    join = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    cmds = [
        [
            *SEQSHARD,
            "train",
            str(TINY_CPU),
            *_overrides(data_dir, run),
            *flags,
            *join,
            "--process-id",
            "0",
        ],
        [
            *SEQSHARD,
            "train",
            str(TINY_CPU),
            *_overrides(tmp_path / "not-here", run),
            *flags,
            *join,
            "--process-id",
            "1",
        ],
    ]
    with ProcessGroup(cmds, tmp_path / "logs", cpu_env(devices=None)) as group:
        started = time.monotonic()
        [failed] = group.wait(timeout=120, which=[1])
        failed_after = time.monotonic() - started
        [survivor] = group.wait(timeout=60, which=[0])
        took = time.monotonic() - started - failed_after
    assert failed == 2, group.output(1)
    assert "seqshard train (process 1 of 2): error: data.dir=" in group.output(1)
    assert "holds no prepared data on this host" in group.output(1)
    assert survivor != 0, group.output(0)
    print(f"failing process exited after {failed_after:.1f} s; survivor {took:.1f} s later")


@pytest.mark.slow
def test_slurm_tasks_join_by_themselves(tmp_path, data_dir):
    """Under srun (faked here: SLURM's variables for two tasks on localhost) `seqshard eval`
    needs no flags: JAX's SLURM detection joins the two processes, and seqshard splits the
    config's 8 devices between the SLURM_NTASKS=2 tasks."""
    run = tmp_path / "runs" / "slurm"
    train(load_config(TINY_CPU, _overrides(data_dir, run, steps=1)), log=_quiet, tty=False)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}
    slurm.update({k: "localhost" for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")})
    envs = [cpu_env(None, **slurm, SLURM_PROCID=str(i), SLURM_LOCALID=str(i)) for i in (0, 1)]
    groups = [
        ProcessGroup([[*SEQSHARD, "eval", str(run)]], tmp_path / f"logs{i}", envs[i])
        for i in (0, 1)
    ]
    try:
        codes = [g.wait(timeout=120)[0] for g in groups]
        assert codes == [0, 0], [g.outputs() for g in groups]
        assert re.search(r"step 1: val loss [\d.]+", groups[0].output(0)), groups[0].output(0)
    finally:
        for g in groups:
            g.kill_all()


@pytest.mark.slow
def test_a_stop_signal_to_one_process_stops_both_at_the_same_step(tmp_path, data_dir):
    """Preemption reaches each host at its own moment: SIGTERM to process 1 alone makes both
    processes agree on the step, write one checkpoint together and exit 0; the run resumes."""
    run = tmp_path / "runs" / "preempted"
    cmd = ["train", str(TINY_CPU), *_overrides(data_dir, run, steps=100_000, log_every=1000)]
    with _two_processes(tmp_path, [*cmd, "--sample-tokens", "0"]) as group:
        group.wait_for(0, "compiled and ran the first step", timeout=180)
        time.sleep(1.0)
        group.kill(1, signal.SIGTERM)
        assert group.wait(timeout=60) == [0, 0], group.outputs()
        out0 = group.output(0)
    saved = re.search(r"step (\d+): train loss", out0)
    assert saved and "stopped early" in out0, out0
    cfg = load_config(TINY_CPU, _overrides(data_dir, run, steps=int(saved.group(1)) + 1))
    result = train(cfg, log=_quiet, tty=False)
    assert result.step == int(saved.group(1)) + 1
