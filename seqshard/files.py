"""Files written whole, and the room left for them: the pieces every writer of seqshard's own
files shares (a run's files, ``prepare``'s bookkeeping, the CPU peak's cache), each of which
raises its own error around them.

    write_whole(path, data)     # path holds data, or what it held before: never a part
    free_space(path)            # '1.21 GiB free', of the nearest directory that exists
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from seqshard.shardlib.tables import format_bytes

__all__ = ["free_space", "write_whole"]


def write_whole(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` by ``data`` (a temporary file beside it, synced, renamed over it): a
    kill or a full disk leaves the old file or the new one, never a torn one, and no temporary
    file. The file is readable by all (0644 under the usual umask), like a file ``open``
    creates: mkstemp's 0600 would hide a run's config.yaml from the rest of a team. OSError as
    the OS raised it."""
    path = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


def free_space(path: str | os.PathLike) -> str:
    """``'<bytes> free'`` on the filesystem of ``path`` (or of its nearest parent that exists),
    for an error that says a write did not fit; ``'an unknown amount free'`` if none answers."""
    path = Path(path)
    for where in (path, *path.parents):
        with contextlib.suppress(OSError):
            return f"{format_bytes(shutil.disk_usage(where).free)} free"
    return "an unknown amount free"


def _umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
