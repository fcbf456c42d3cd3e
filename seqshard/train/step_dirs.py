"""The step directories of a checkpoint directory: which are complete checkpoints, and the
names that mark the rest (an interrupted save or deletion, a checkpoint set aside as damaged).

    checkpoints/
        4/  6/                          complete: every file of COMPLETE_MARKERS is there
        8.orbax-checkpoint-tmp-1234/    an interrupted save (TMP_NAME)
        .deleting-2/                    an interrupted deletion (DELETING)
        3.damaged/                      skipped by a restore, kept for a look (DAMAGED)

Retention removes old checkpoints with :func:`remove_tree` (renamed to ``.deleting-<step>``
first, so a kill leaves no phantom step); :func:`remove_leftovers` removes only the leftover
names above and empty step directories. A step directory with files in it that is not
complete is never removed: a restore refuses it or renames it (:func:`set_aside`).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

__all__ = [
    "COMPLETE_MARKERS",
    "checkpoint_steps",
    "remove_leftovers",
    "remove_tree",
    "set_aside",
    "step_directories",
]

# What orbax (this version) writes into a step directory, relative to it; the top-level
# commit_success.txt is written last, just before the rename from the temporary name.
# tests/train/test_checkpoint.py checks that a fresh save has all of them, so an orbax that writes
# another layout fails there instead of having its checkpoints taken for leftovers.
COMPLETE_MARKERS = (
    "commit_success.txt",
    "_CHECKPOINT_METADATA",
    "meta/metadata",
    "state/_METADATA",
)
STEP_NAME = re.compile(r"^(0|[1-9][0-9]*)$")
TMP_NAME = re.compile(r"^[0-9]+\.orbax-checkpoint-tmp")  # an interrupted save
DELETING = ".deleting-"  # an interrupted deletion: `.deleting-<step>`
DAMAGED = ".damaged"  # a checkpoint restore skipped, kept for inspection: `<step>.damaged`


def _missing_marker(path: Path) -> str | None:
    """The first file a complete checkpoint has that ``path`` lacks, or None."""
    for marker in COMPLETE_MARKERS:
        if not (path / marker).is_file():
            return marker
    return None


def step_directories(directory: str | Path) -> dict[int, str | None]:
    """Every step directory in ``directory`` that holds anything: step -> the first file of a
    complete checkpoint it lacks (None: complete), ascending. Empty ones are left out."""
    directory = Path(directory)
    if not directory.is_dir():
        return {}
    steps = {
        int(p.name): _missing_marker(p)
        for p in directory.iterdir()
        if STEP_NAME.match(p.name) and p.is_dir() and not p.is_symlink() and any(p.iterdir())
    }
    return dict(sorted(steps.items()))


def checkpoint_steps(directory: str | Path) -> list[int]:
    """The steps of the complete checkpoints in ``directory``, ascending (none: [])."""
    return [step for step, missing in step_directories(directory).items() if missing is None]


def remove_tree(path: Path) -> None:
    """Remove ``path``: renamed (atomically) to a name no reader takes for a checkpoint first,
    so a kill mid-removal leaves a ``.deleting-*`` directory, cleaned at the next start."""
    if not path.name.startswith(DELETING):
        hidden = path.with_name(f"{DELETING}{path.name}")
        if hidden.exists():
            shutil.rmtree(hidden, ignore_errors=True)
        path.rename(hidden)
        path = hidden
    shutil.rmtree(path, ignore_errors=True)


def remove_leftovers(directory: Path) -> None:
    """Remove what interrupted saves and deletions provably left in ``directory``: orbax's
    temporary directories (``<step>.orbax-checkpoint-tmp*``), ``.deleting-*`` ones, and empty
    step directories. A step directory with anything in it is never removed here, even if
    incomplete: a restore sets it aside (``<step>.damaged``) or refuses it."""
    for path in sorted(directory.iterdir()):
        if TMP_NAME.match(path.name) or path.name.startswith(DELETING):
            remove_tree(path)
        elif (
            STEP_NAME.match(path.name)
            and path.is_dir()
            and not path.is_symlink()
            and not any(path.iterdir())
        ):
            path.rmdir()


def set_aside(path: Path) -> Path:
    """Rename the step directory ``path`` to ``<step>.damaged`` (``-2``, ``-3``, ... when that
    is taken), out of the way of the steps a resumed run saves again; the new path."""
    aside, n = path.with_name(f"{path.name}{DAMAGED}"), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}{DAMAGED}-{n}")
    path.rename(aside)
    return aside
