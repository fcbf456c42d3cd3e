"""Running the processes of a multi-process test: several real processes on localhost, each
in its own session, all killed when the test's own timeout passes (a process left waiting for
a dead peer in a collective would otherwise hang the test run)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

SEQSHARD = [sys.executable, "-m", "seqshard.cli"]

# The XLA flags of every test process (conftest.py sets them for the session, `xla_flags` for
# the processes the tests start): LLVM's CPU code generation at -O0. The tests compile about
# a thousand small programs and run each a few steps, so compiling is most of their time;
# measured on 2 cores, the default run went from 10:36 to 7:18 of pytest (test_transformer
# 35 -> 23 s, test_backward 39 -> 28 s). The same HLO is compiled (the HLO audits and memory
# figures are unchanged); only the machine code's speed and its float rounding change, which
# is why a test comparing a subprocess's losses bit for bit with this process's needs both
# to use these flags.
TEST_COMPILE_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test's child process with ``devices`` fake CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {TEST_COMPILE_FLAGS}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """The environment of a child process of a multi-process test: ``devices`` fake CPU devices
    (None: the child chooses, e.g. seqshard from the config), no inherited count otherwise, and
    the tests' compile flags."""
    # Nor the test session's compilation cache (conftest.py): processes of one run compile the
    # same programs at the same moment, and the cache's writes are not atomic.
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
    }
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = TEST_COMPILE_FLAGS if devices is None else xla_flags(devices)
    return {**env, **extra}


class ProcessGroup:
    """``with ProcessGroup(cmds, logs_dir, env) as group: group.wait(timeout)``.

    Each command's stdout and stderr go to ``logs_dir/process<i>.log`` (a file, not a pipe:
    gloo and XLA can write more than a pipe holds). Leaving the block kills every process
    still running, whatever happened."""

    def __init__(self, cmds: Sequence[Sequence[str]], logs_dir: Path, env: dict[str, str]):
        logs_dir.mkdir(parents=True, exist_ok=True)
        self.logs = [logs_dir / f"process{i}.log" for i in range(len(cmds))]
        self.procs = []
        for cmd, log in zip(cmds, self.logs, strict=True):
            with open(log, "w") as out:
                self.procs.append(
                    subprocess.Popen(
                        list(cmd),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,  # its own group: killpg reaches its children
                    )
                )
        self.started = time.monotonic()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.kill_all()

    def output(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def outputs(self) -> str:
        return "\n".join(f"--- process {i} ---\n{self.output(i)}" for i in range(len(self.logs)))

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[i].pid, sig)

    def kill_all(self) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                self.kill(i)
        for p in self.procs:
            p.wait()

    def wait_for(self, i: int, text: str, timeout: float) -> None:
        """Until process ``i``'s output contains ``text``; fails (killing all) after ``timeout``."""
        deadline = time.monotonic() + timeout
        while text not in self.output(i):
            if time.monotonic() > deadline or self.procs[i].poll() is not None:
                self.kill_all()
                raise AssertionError(f"no {text!r} from process {i}:\n{self.outputs()}")
            time.sleep(0.2)

    def wait(self, timeout: float, which: Sequence[int] | None = None) -> list[int | None]:
        """Exit codes of processes ``which`` (default all), once they have exited; after
        ``timeout`` seconds every process is killed and the test fails with their output."""
        which = range(len(self.procs)) if which is None else which
        deadline = time.monotonic() + timeout
        while any(self.procs[i].poll() is None for i in which):
            if time.monotonic() > deadline:
                self.kill_all()
                raise AssertionError(
                    f"processes {list(which)} still running after {timeout:.0f} s; all killed:\n"
                    f"{self.outputs()}"
                )
            time.sleep(0.2)
        return [self.procs[i].returncode for i in which]


def two_seqshard_processes(tmp_path: Path, args: Sequence[str]) -> ProcessGroup:
    """``seqshard ARGS`` as process 0 and 1 of a run on 127.0.0.1, 4 CPU devices each (set by
    seqshard itself from the config's 8: no XLA_FLAGS in their environment)."""
    port = free_port()
    join = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id"]
    cmds = [[*SEQSHARD, *args, *join, str(i)] for i in (0, 1)]
    return ProcessGroup(cmds, tmp_path / f"logs-{port}", cpu_env(devices=None))
