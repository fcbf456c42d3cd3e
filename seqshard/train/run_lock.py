"""One writer per run directory: ``RUN_DIR/.lock``.

    with RunLock.acquire(run_dir, log=print):   # RunLockedError if another run holds it
        ...                                     # train: config.yaml, metrics, checkpoints

Two ``seqshard train`` processes on one run directory would both append every step to
``metrics.jsonl`` and save checkpoints of two trajectories into one directory. The writer
(process 0 of a run; a multi-process run has one) takes the lock before it writes anything;
a second one stops at once with the holder's process id, host and start time.

How a dead holder is told from a live one:

- **The kernel's lock.** The holder keeps an exclusive ``flock`` on the file for as long as
  it runs. The operating system drops it when the process ends in any way (exit, crash,
  ``kill -9``), and an NFS server drops a lost client's locks when its lease runs out (90 s by
  default). A held ``flock`` means a live holder; a free one means the last holder is gone,
  whatever the file still says.
- **The heartbeat**, for filesystems whose ``flock`` is local to each host (some network and
  FUSE filesystems): the holder touches the file's modification time every
  ``HEARTBEAT_S`` seconds from a thread. A lock written by another host whose heartbeat is
  younger than ``STALE_S`` is taken as live even when ``flock`` succeeds; an older one (a lost
  node) is taken over, with a line saying so. On one host the holder's process id settles it.

A clean exit empties the file; a holder that died leaves its record, which the next run
replaces.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["HEARTBEAT_S", "LOCK_FILE", "STALE_S", "RunLock", "RunLockedError"]

LOCK_FILE = ".lock"
HEARTBEAT_S = 15.0  # how often the holder touches the lock file
STALE_S = 120.0  # another host's lock whose heartbeat is older than this is taken over


class RunLockedError(RuntimeError):
    """The run directory is being written by another process."""


def _holder(info: dict[str, Any], age_s: float | None) -> str:
    started = info.get("started", "an unknown time")
    beat = f", last heartbeat {age_s:.0f} s ago" if age_s is not None else ""
    return f"process {info.get('pid')} on {info.get('host')}, started {started}{beat}"


def _alive_here(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class RunLock:
    """The lock of one run directory, held by this process (see the module docstring)."""

    def __init__(self, path: Path, fd: int, created: list[Path]):
        self.path, self._fd, self._created = path, fd, created
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="seqshard-run-lock", daemon=True)
        self._beat.start()

    @classmethod
    def acquire(cls, run_dir: str | Path, log: Callable[[str], None] = print) -> RunLock:
        """Take ``run_dir``'s lock (creating the directory), or raise RunLockedError naming
        the live holder."""
        run_dir = Path(run_dir)
        created = [d for d in (run_dir, *run_dir.parents) if not d.exists()]  # innermost first
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            kernel = cls._flock(fd)
            info, age_s = cls._read(fd)
            live = kernel == "held" or cls._looks_live(info, age_s, kernel == "unsupported")
            if live:
                raise RunLockedError(cls._message(run_dir, path, info, age_s))
            if info.get("host") not in (None, socket.gethostname()):
                log(
                    f"{run_dir}: taking over the lock of {_holder(info, age_s)} (its heartbeat "
                    f"stopped over {STALE_S:.0f} s ago: a lost node)"
                )
            record = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, created)

    @staticmethod
    def _flock(fd: int) -> str:
        """``taken`` (this process holds the kernel's lock now), ``held`` (another does), or
        ``unsupported`` (a filesystem without locks: the record decides)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return "held"
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                return "unsupported"
            raise
        return "taken"

    @staticmethod
    def _read(fd: int) -> tuple[dict[str, Any], float | None]:
        """(the record in the file, seconds since its heartbeat); ({}, None) when empty."""
        size = os.fstat(fd).st_size
        if not size:
            return {}, None
        try:
            info = json.loads(os.pread(fd, min(size, 4096), 0).decode())
        except (ValueError, UnicodeDecodeError):
            return {}, None  # a torn record: its writer died while writing it
        if not isinstance(info, dict):
            return {}, None
        return info, max(0.0, time.time() - os.fstat(fd).st_mtime)

    @staticmethod
    def _looks_live(info: dict[str, Any], age_s: float | None, no_kernel_lock: bool) -> bool:
        """Whether the record left in a lock this process could take still names a live
        holder: another host's with a fresh heartbeat (its ``flock`` may not reach us), or,
        on a filesystem without locks, a live process of this host."""
        if not info or age_s is None or age_s >= STALE_S:
            return False
        if info.get("host") != socket.gethostname():
            return True
        pid = info.get("pid")
        return no_kernel_lock and isinstance(pid, int) and pid != os.getpid() and _alive_here(pid)

    @staticmethod
    def _message(run_dir: Path, path: Path, info: dict[str, Any], age_s: float | None) -> str:
        holder = (
            _holder(info, age_s) if info else "another process (it has not written its name yet)"
        )
        return (
            f"run directory {run_dir} is being written by {holder} (lock {path}). One run "
            f"directory has one writer: wait for that run to end or stop it, or train under "
            f"another run.name. A lock whose holder died (kill -9, a lost node) does not block: "
            f"the kernel releases it, or its heartbeat stops for {STALE_S:.0f} s."
        )

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Empty the record and let go (idempotent). A run directory this lock created that
        holds nothing else (the run stopped on bad input before writing) is removed again,
        with the parents it created."""
        if self._fd < 0:
            return
        self._stop.set()
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
            if self._created and [p.name for p in self.path.parent.iterdir()] == [LOCK_FILE]:
                self.path.unlink()  # (still holding the kernel lock)
                for directory in self._created:
                    directory.rmdir()
        os.close(self._fd)  # drops the kernel lock
        self._fd = -1

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
