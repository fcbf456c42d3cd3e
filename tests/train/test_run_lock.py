"""seqshard.train.run_lock: one writer per run directory (fault 5 of the campaign: two
`seqshard train` processes on one run both exited 0, every step twice in metrics.jsonl).

The holder's kernel lock (flock) says it is alive; a dead holder's is gone (kill -9 here),
and another host's record is trusted only while its heartbeat is fresh (a lost node's is
not). Multi-process runs (one writer, process 0) are covered by tests/test_launch.py."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_helpers import xla_flags

from seqshard.train import run_lock
from seqshard.train.run_lock import LOCK_FILE, STALE_S, RunLock, RunLockedError

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "XLA_FLAGS": xla_flags(8)}


def test_a_second_training_stops_at_once_naming_the_holder(tmp_path, tiny_overrides):
    """The holder is this test process; `seqshard train` on its run directory stops before
    writing anything, with one line naming the holder's process id, host and start time."""
    run_dir = tmp_path / "runs" / "busy"
    with RunLock.acquire(run_dir) as lock:
        record = json.loads(lock.path.read_text())
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "seqshard.cli", "train", str(REPO / "configs" / "tiny-cpu.yaml")]
            + [*tiny_overrides(tmp_path / "runs", "busy"), "--sample-tokens=0"],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        took = time.monotonic() - started
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    holder = f"process {os.getpid()} on {socket.gethostname()}, started {record['started']}"
    assert err.startswith(f"seqshard train: error: run directory {run_dir} is being written by")
    assert holder in err, err
    assert took < 30, took  # before any compile
    assert not run_dir.exists()  # created by the lock, nothing else written: removed again


@pytest.mark.slow  # ~15 s: two real trainings
def test_two_trainings_on_one_run_directory(tmp_path, tiny_overrides):
    config = REPO / "configs" / "tiny-cpu.yaml"
    args = [*tiny_overrides(tmp_path / "runs", "twice", steps=2000), "--sample-tokens=0"]
    command = [sys.executable, "-m", "seqshard.cli", "train", str(config), *args]
    run_dir = tmp_path / "runs" / "twice"
    first = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while (
            not (run_dir / "metrics.jsonl").exists()
            or not (run_dir / "metrics.jsonl").stat().st_size
        ):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        second = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and f"process {first.pid} on" in second.stderr
        assert first.poll() is None  # the first goes on
    finally:
        first.kill()
        first.communicate()
    steps = [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(steps) == len(set(steps))


def test_a_lock_left_by_kill_9_does_not_block(tmp_path):
    """kill -9 ends the holder without releasing: the kernel drops its flock, and the record
    it left (its pid, now dead) does not count."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from seqshard.train.run_lock import RunLock; "
            f"RunLock.acquire({str(run_dir)!r}); print('held', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError, match=f"process {holder.pid} on"):
            RunLock.acquire(run_dir)
    finally:
        holder.kill()
        holder.communicate()
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == holder.pid  # left behind
    lines = []
    RunLock.acquire(run_dir, log=lines.append).release()
    assert lines == []


def _left_by(run_dir: Path, host: str, pid: int, age_s: float) -> None:
    """A record as a holder that died (its kernel lock gone) left it, heartbeat ``age_s`` old."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    path.write_text(json.dumps({"pid": pid, "host": host, "started": "2026-11-26T10:00:00+00:00"}))
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_another_hosts_lock_counts_while_its_heartbeat_is_fresh(tmp_path):
    """Some network filesystems' flock does not reach other hosts: a record of another host
    with a fresh heartbeat is a live holder; one silent for STALE_S (a lost node) is taken
    over with a line saying so."""
    _left_by(tmp_path, "node-7", 4242, age_s=5)
    with pytest.raises(RunLockedError, match=r"process 4242 on node-7, started 2026-11-26"):
        RunLock.acquire(tmp_path)
    _left_by(tmp_path, "node-7", 4242, age_s=STALE_S + 60)
    lines = []
    lock = RunLock.acquire(tmp_path, log=lines.append)
    assert len(lines) == 1 and "taking over the lock of process 4242 on node-7" in lines[0]
    assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    lock.release()


def test_without_kernel_locks_a_live_process_of_this_host_holds(tmp_path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        _left_by(tmp_path, socket.gethostname(), sleeper.pid, age_s=1)
        with pytest.raises(RunLockedError, match=f"process {sleeper.pid} on"):
            RunLock.acquire(tmp_path)
    finally:
        sleeper.kill()
        sleeper.wait()
    RunLock.acquire(tmp_path).release()  # its pid is dead now


def test_the_holder_keeps_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    with RunLock.acquire(tmp_path) as lock:
        old = time.time() - 1000
        os.utime(lock.path, (old, old))
        time.sleep(0.3)
        assert time.time() - lock.path.stat().st_mtime < 5
