"""Checkpoints with orbax: the train state plus JSON metadata (config, loader state, checksums).

Each checkpoint is a step directory ``RUN_DIR/checkpoints/<step>`` holding

    state   TrainState (weights, AdamW moments, step, ...), saved shard by shard
    meta    {"config": resolved YAML, "loader": loader state, "seed": init seed, "step": step,
             "checksums": {"state.weights.layers.w_up": "0x1234abcd", ...}, "finite": true}

Saves are asynchronous (training continues while the previous checkpoint is written) and
atomic: orbax writes into ``<step>.orbax-checkpoint-tmp*`` and renames it when complete. What
can go wrong, and what happens then:

- **Damaged data.** Each array's checksum is computed on device when it is saved (a hash of
  its bits, reduced over the *global* array, so it does not depend on the mesh) and checked
  after it is read back, on whatever mesh restores it. ``restore`` (policy ``latest_good``)
  skips a checkpoint that fails the check or cannot be read, with one warning line, for the
  newest one that passes, and renames the skipped ones ``<step>.damaged`` (kept for a look,
  out of the way of the steps the resumed run writes again); ``strict`` raises instead.
  A non-finite state is never written.
- **Kills.** A step directory counts as a checkpoint only when complete (every file orbax
  writes, ``commit_success.txt`` last, is there), so an empty or half-written one is never
  loaded. Old checkpoints are deleted by renaming them to ``.deleting-<step>`` first (atomic)
  and removing that, so a kill mid-deletion leaves no step directory behind; such leftovers,
  the temporary directories of interrupted saves and empty step directories are removed
  when a Checkpointer opens the directory for writing. Nothing else is ever removed: a step
  directory with files in it that is not a complete checkpoint (a file deleted by hand, a
  copy cut short) is treated as damaged by ``restore``. Exactly ``keep`` checkpoints are
  kept, the newest ones (a kill between a save and its retention leaves one more, removed
  when the run resumes).
- **Failed saves** (disk full, permissions): ``raise_if_save_failed()``, called by the loop
  after every step, raises :class:`CheckpointSaveError` as soon as the background save has
  failed, with the OS error, the space needed and free; the partial write is removed and every
  earlier checkpoint is intact. Orbax's own tracebacks of that failure are held back.

Restoring builds every target as a ``jax.ShapeDtypeStruct`` with the sharding its type
declares on the *current* mesh (optimizer state included), so a run saved on 4x2 resumes on
2x4 or 8x1: orbax reads each device's slices directly.

The loop's calls::

    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep_checkpoints, log=log)
    restored = ckpt.restore(cfg, mesh, opt)       # .state .meta .step .skipped
    ckpt.save(state, cfg, loader.state())         # on intervals; starts an async write
    ckpt.raise_if_save_failed()                   # after every step: cheap, never blocks
    ckpt.close()                                  # waits; raises CheckpointSaveError too
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import math
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from seqshard.config import Config, ConfigError, config_from_yaml, config_to_yaml
from seqshard.model.config import DIM_FIELDS
from seqshard.shardlib.shardtypes import shardings, u32, with_unsplit_dims
from seqshard.train.optimizer import make_optimizer
from seqshard.train.run_files import format_bytes
from seqshard.train.state import TrainState, layer_order, relayered, train_state_structs

__all__ = [
    "CheckpointError",
    "CheckpointSaveError",
    "Checkpointer",
    "Restored",
    "checkpoint_steps",
    "latest_state",
    "state_digest",
    "step_directories",
]

ResumePolicy = Literal["latest_good", "strict"]
RESUME_POLICIES = ("latest_good", "strict")

# What orbax (this version) writes into a step directory, relative to it; the top-level
# commit_success.txt is written last, just before the rename from the temporary name.
# tests/test_checkpoint.py checks that a fresh save has all of them, so an orbax that writes
# another layout fails there instead of having its checkpoints taken for leftovers.
_COMPLETE_MARKERS = (
    "commit_success.txt",
    "_CHECKPOINT_METADATA",
    "meta/metadata",
    "state/_METADATA",
)
_STEP_NAME = re.compile(r"^(0|[1-9][0-9]*)$")
_TMP_NAME = re.compile(r"^[0-9]+\.orbax-checkpoint-tmp")  # an interrupted save
_DELETING = ".deleting-"  # an interrupted deletion: `.deleting-<step>`
_DAMAGED = ".damaged"  # a checkpoint restore skipped, kept for inspection: `<step>.damaged`


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not fit the model being restored."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed (disk full, permissions); the earlier ones are intact."""


@dataclasses.dataclass
class Restored:
    state: TrainState
    meta: dict[str, Any]
    step: int  # the checkpoint restored
    skipped: dict[int, str] = dataclasses.field(default_factory=dict)  # newer ones: why not


class _Unusable(Exception):
    """A checkpoint that cannot be restored as it is: damaged, incomplete or unreadable."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


# -- checksums --------------------------------------------------------------------------------


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's finalizer: a bijection of u32 in which every input bit flips ~half the
    output bits."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _as_u32(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as u32 words (one per element; two for a 64-bit one, last axis)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}.get(x.dtype.itemsize)
    if uint is None:
        raise TypeError(f"checkpoint checksums: unsupported dtype {x.dtype}.")
    return jax.lax.bitcast_convert_type(x, uint).astype(jnp.uint32)


def _hash_sum(
    x: jax.Array, first: jax.Array, strides: Sequence[int]
) -> tuple[jax.Array, jax.Array]:
    """(u32[] checksum, bool[] all finite) of ``x``, a part of an array whose u32 word
    [i, j, ...] is word ``first + i * strides[0] + j * strides[1] + ...`` of the array."""
    bits = _as_u32(x)
    position = jnp.zeros(bits.shape, jnp.uint32) + first  # (mod 2^32)
    for axis, stride in enumerate(strides):
        iota = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
        position = position + iota * jnp.uint32(stride % 2**32)
    checksum = jnp.sum(_fmix32(bits ^ (position * jnp.uint32(0x9E3779B9))), dtype=jnp.uint32)
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.array(True)
    return checksum, finite


def _row_major(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[axis + 1 :]) for axis in range(len(shape))]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How to hash one array: whole, or in ``parts`` parts (see :func:`_checksum`)."""

    parts: int = 1
    shards: int = 1  # how many blocks the leading dim is split into
    sharding: NamedSharding | None = None  # of the (shards, parts, rows per part, ...) view


_PART_BYTES = 2 << 20  # per device: about what one part of an array's hashing holds at once


def _plan(x: Any) -> _Plan:
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or x.ndim == 0:
        return _Plan()
    block = sharding.shard_shape(x.shape)  # this device's
    block_bytes = math.prod(block) * x.dtype.itemsize
    rows = block[0]
    if block_bytes <= _PART_BYTES or rows == 1:
        return _Plan()
    parts = min(
        (p for p in range(2, rows + 1) if rows % p == 0 and block_bytes <= _PART_BYTES * p),
        default=rows,
    )
    per_part = 1 if rows > parts else 0  # see _checksum
    view = with_unsplit_dims(sharding, x.ndim, at=1, count=1 + per_part)
    return _Plan(parts, x.shape[0] // rows, view)


def _checksum(x: jax.Array, plan: _Plan) -> tuple[jax.Array, jax.Array]:
    """(u32[], bool[]): the wrapping sum over the array of fmix32(bits ^ position * golden
    ratio), and whether it is all finite.

    Each term is a bijection of the element's bits, so any change to one element (a flipped
    bit) always changes the sum; the position makes a swap of two elements change it too
    (but for a 2^-32 chance). The sum is over the *global* array: XLA reduces each device's
    block and adds the partial sums, and wrapping u32 addition is associative and commutative,
    so the result is the same, bit for bit, on every mesh and sharding.

    XLA on CPU writes the hashed words to a temporary before reducing them, as large as the
    array's block on each device and, for arrays hashed side by side, all of them at once.
    A large array is hashed in ``plan.parts`` parts instead, one after the other in a loop,
    so the temporary is one part's: its rows viewed as ``(shards, parts, rows per part)``,
    a free reshape that leaves each device its own rows, part ``j`` being the ``j``-th run of
    consecutive rows of every device's block."""
    bits_shape = jax.eval_shape(_as_u32, jax.ShapeDtypeStruct(x.shape, x.dtype)).shape
    if plan.parts == 1:
        return _hash_sum(x, jnp.uint32(0), _row_major(bits_shape))
    shards, parts = plan.shards, plan.parts
    per_part = x.shape[0] // shards // parts  # rows
    row = math.prod(bits_shape[1:])  # u32 words
    # The words of part j's [s, i, ...] are at ((s * parts + j) * per_part + i) * row + ...
    # (A dim of 1 row per part is left out: XLA on CPU copies the whole view for it.)
    rows = [per_part] if per_part > 1 else []
    view = x.reshape(shards, parts, *rows, *x.shape[1:])
    view = jax.lax.with_sharding_constraint(view, plan.sharding)
    strides = [parts * per_part * row, *[row] * len(rows), *_row_major(bits_shape[1:])]

    def add_part(j, total):
        part = jax.lax.dynamic_index_in_dim(view, j, axis=1, keepdims=False)
        first = j.astype(jnp.uint32) * jnp.uint32(per_part * row % 2**32)
        checksum, finite = _hash_sum(part, first, strides)
        return total[0] + checksum, total[1] & finite

    return jax.lax.fori_loop(0, parts, add_part, (jnp.uint32(0), jnp.array(True)))


def _digest(leaves: Sequence[jax.Array], plans: tuple[_Plan, ...]) -> tuple[jax.Array, jax.Array]:
    """(u32[n] checksums, bool[n] all finite) of ``leaves``."""
    sums, finite = zip(*(_checksum(x, p) for x, p in zip(leaves, plans, strict=True)), strict=True)
    return jnp.stack(sums), jnp.stack(finite)


@functools.cache
def _jitted_digest(mesh: Mesh | None):
    if mesh is None:
        return jax.jit(_digest, static_argnums=1)
    # A few scalars, replicated: every process can read them.
    return jax.jit(_digest, static_argnums=1, out_shardings=shardings(u32["n"], mesh))


def _leaf_names(state: Any) -> list[str]:
    """``state.weights.layers.w_up``, ``state.opt_state[1][0].mu.embed``, ...: every array."""
    return [
        "state" + jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_leaves_with_path(state)
    ]


def state_digest(state: Any) -> tuple[dict[str, int], dict[str, bool]]:
    """Each array's checksum and whether it is finite, by name, in one jitted call on device.

    Nothing but the 5 bytes per array comes to the host; the checksum does not depend on the
    arrays' sharding (see :func:`_checksum`)."""
    names, leaves = _leaf_names(state), jax.tree.leaves(state)
    shardings = [getattr(x, "sharding", None) for x in leaves]
    mesh = next((s.mesh for s in shardings if isinstance(s, NamedSharding)), None)
    plans = tuple(_plan(x) for x in leaves)
    sums, finite = jax.device_get(_jitted_digest(mesh)(leaves, plans))
    return (
        dict(zip(names, (int(c) for c in sums), strict=True)),
        dict(zip(names, (bool(f) for f in finite), strict=True)),
    )


# -- the step directories ---------------------------------------------------------------------


def _missing_marker(path: Path) -> str | None:
    """The first file a complete checkpoint has that ``path`` lacks, or None."""
    for marker in _COMPLETE_MARKERS:
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
        if _STEP_NAME.match(p.name) and p.is_dir() and not p.is_symlink() and any(p.iterdir())
    }
    return dict(sorted(steps.items()))


def checkpoint_steps(directory: str | Path) -> list[int]:
    """The steps of the complete checkpoints in ``directory``, ascending (none: [])."""
    return [step for step, missing in step_directories(directory).items() if missing is None]


def _sync(name: str) -> None:
    """All processes of a multi-process run wait here (for what process 0 changed on disk)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _remove_tree(path: Path) -> None:
    """Remove ``path``: renamed (atomically) to a name no reader takes for a checkpoint first,
    so a kill mid-removal leaves a ``.deleting-*`` directory, cleaned at the next start."""
    if not path.name.startswith(_DELETING):
        hidden = path.with_name(f"{_DELETING}{path.name}")
        if hidden.exists():
            shutil.rmtree(hidden, ignore_errors=True)
        path.rename(hidden)
        path = hidden
    shutil.rmtree(path, ignore_errors=True)


def _os_error(e: BaseException) -> str:
    """``[Errno 28] No space left on device``: the OS error in ``e``'s chain, else its text."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno:
            return f"[Errno {x.errno}] {os.strerror(x.errno)}"
        todo += [x.__cause__, x.__context__]
    code = re.search(r"os_error_code='?(\d+)", str(e))  # tensorstore's errors carry the code
    if code:
        return f"[Errno {code.group(1)}] {os.strerror(int(code.group(1)))}"
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def _first_line(e: BaseException) -> str:
    """The first line of the innermost error in ``e``'s chain (orbax wraps tensorstore's
    precise one, "Error reading ... ZSTD_decompressStream() failed", in a vaguer one)."""
    for _ in range(20):  # (a chain can loop)
        if (e.__cause__ or e.__context__) is None:
            break
        e = e.__cause__ or e.__context__
    lines = str(e).splitlines()
    return lines[0][:300] if lines else type(e).__name__


_LOGGERS = ("absl", "asyncio")  # where orbax's errors and those of its asyncio tasks go
_QUIET: set[_OrbaxQuiet] = set()  # Checkpointers whose reads or writes' leftovers are silenced
_outer_unraisablehook: Callable[[Any], None] | None = None


def _orbax_leftover(u: Any) -> bool:
    """An error orbax's workers raise where nobody catches it, after a failed read or write:
    a tensorstore callback into the event loop orbax closed at the first error ("Event loop
    is closed"), or an abandoned read coroutine."""
    code = getattr(u.object, "cr_code", None)
    return (
        isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value)
    ) or (code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename)


_silenced = 0  # leftovers silenced so far (see _settle)


def _unraisablehook(u: Any) -> None:
    global _silenced
    if _QUIET and _orbax_leftover(u):
        _silenced += 1
        return
    (_outer_unraisablehook or sys.__unraisablehook__)(u)


def _settle(timeout_s: float = 2.0) -> None:
    """After a failed read or write, wait (within the Checkpointer's call, which the caller
    sees as one error) until orbax's abandoned work stops reporting: ~10 ms on a local disk."""
    deadline, seen = time.monotonic() + timeout_s, -1
    while seen != _silenced and time.monotonic() < deadline:
        seen = _silenced
        gc.collect()  # abandoned coroutines and tasks report when collected
        time.sleep(0.05)


class _OrbaxQuiet(logging.Filter):
    """Keeps what orbax reports of a failure we report ourselves off stderr.

    A failed asynchronous save makes orbax log the same OSError from several threads, each
    with a traceback (hundreds of lines), and its abandoned tensorstore callbacks print more;
    the Checkpointer raises one CheckpointSaveError with what matters instead (a damaged
    checkpoint read: one CheckpointError or warning line). Held: orbax's ERROR records, only
    while a save or read of ours is in flight (let through afterwards if it succeeded), and
    the leftovers above, from then until close() if it failed."""

    def __init__(self):
        super().__init__()
        self.holding, self.failed, self.held = False, False, []

    def filter(self, record: logging.LogRecord) -> bool:
        """(On the absl and asyncio loggers.)"""
        global _silenced
        if record.levelno < logging.ERROR:
            return True
        if self.holding and f"{os.sep}orbax{os.sep}" in record.pathname:
            self.held.append(record)
            return False
        # asyncio's "Task exception was never retrieved" of an orbax task orbax abandoned.
        if (
            self in _QUIET
            and record.name == "asyncio"
            and f"{os.sep}orbax{os.sep}" in record.getMessage()
        ):
            _silenced += 1
            return False
        return True

    def hold(self) -> None:
        self.holding = True
        _quiet(self, True)

    def release(self, ok: bool) -> None:
        """End of a save or read: ``ok``, let what was held through; else drop it."""
        held, self.holding, self.held = self.held, False, []
        self.failed |= not ok
        if ok:
            _quiet(self, self.failed)
            for record in held:
                logging.getLogger(record.name).handle(record)

    def close(self) -> None:
        self.holding, self.held = False, []
        _quiet(self, False)


def _quiet(owner: _OrbaxQuiet, on: bool) -> None:
    """Add or remove ``owner`` from those silencing orbax's leftovers (sys.unraisablehook)."""
    global _outer_unraisablehook
    if on:
        if sys.unraisablehook is not _unraisablehook:
            _outer_unraisablehook, sys.unraisablehook = sys.unraisablehook, _unraisablehook
        _QUIET.add(owner)
    else:
        _QUIET.discard(owner)
        if not _QUIET and sys.unraisablehook is _unraisablehook:
            sys.unraisablehook, _outer_unraisablehook = _outer_unraisablehook, None


def _join_orbax_threads(timeout_s: float = 120.0) -> None:
    """Wait for the worker threads orbax started for a save: they outlive its first error and
    go on writing into (and re-creating) the temporary directory for a moment."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = [
            t
            for t in threading.enumerate()
            if t is not threading.current_thread() and type(t).__module__.startswith("orbax.")
        ]
        if not workers:
            return
        for t in workers:
            # orbax's threads re-raise their error from join(): the one we report already.
            with contextlib.suppress(Exception):
                t.join(max(0.0, deadline - time.monotonic()))


@dataclasses.dataclass(frozen=True)
class _Pending:
    step: int
    nbytes: int  # the state's arrays, uncompressed


class Checkpointer:
    """Save and restore training checkpoints under ``directory``, keeping the ``keep`` newest.

    ``read_only``: only restore (evaluation beside a running training): nothing in the
    directory is changed, leftovers included."""

    def __init__(
        self,
        directory: str | Path,
        keep: int = 3,
        *,
        read_only: bool = False,
        log: Callable[[str], None] = print,
    ):
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (checkpoints kept), got {keep}.")
        self.directory = Path(directory).absolute()
        self.keep, self.read_only, self.log = keep, read_only, log
        self._pending: _Pending | None = None
        self._held = _OrbaxQuiet()
        self._writer = not read_only and jax.process_index() == 0  # who changes the directory
        if self._writer and self.directory.is_dir():
            self._clean_leftovers()
        _sync("seqshard.checkpoint: leftovers cleaned")  # before any process lists steps
        self.manager = self._new_manager()
        for logger in _LOGGERS:
            logging.getLogger(logger).addFilter(self._held)

    def _new_manager(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None,  # retention is ours: see _apply_retention
                enable_async_checkpointing=True,
                # Not orbax's read_only (which warns on every use): we never save when read-only.
                create=not self.read_only,
            ),
        )

    # -- listing --

    def all_steps(self) -> list[int]:
        """The steps of the complete checkpoints, ascending."""
        return checkpoint_steps(self.directory)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -- saving --

    def save(self, state: TrainState, cfg: Config, loader_state: dict[str, Any]) -> int:
        """Start saving ``state`` (asynchronously); returns its step.

        Raises CheckpointError if the state holds a NaN or Inf (nothing is written), and
        CheckpointSaveError if the previous save failed."""
        if self.read_only:
            raise CheckpointError(f"{self.directory} was opened read-only; it cannot save.")
        step = int(jax.device_get(state.step))
        self._finish_pending(block=True)  # orbax would wait for it anyway
        if step in self.all_steps():
            return step
        checksums, finite = state_digest(state)
        bad = [name for name, ok in finite.items() if not ok]
        if bad:
            latest = self.latest_step()
            raise CheckpointError(
                f"the state at step {step} holds NaN or Inf in {len(bad)} arrays ("
                f"{', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''}): a non-finite state "
                f"is never written. "
                + (
                    f"The newest checkpoint, {self.directory / str(latest)}, is the last good state."
                    if latest is not None
                    else f"{self.directory} holds no checkpoint of this run yet."
                )
            )
        meta = {
            "config": config_to_yaml(cfg),
            "loader": loader_state,
            "seed": cfg.train.seed,
            "step": step,
            "checksums": {name: f"0x{c:08x}" for name, c in checksums.items()},
            "finite": True,
        }
        pending = _Pending(step, sum(int(x.nbytes) for x in jax.tree.leaves(state)))
        self._held.hold()
        failure = None
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
                ),
                force=True,  # when to save is the caller's decision, not orbax's interval
            )
        except Exception as e:  # the blocking part failed: creating the directory, say
            failure = _os_error(e)
        if failure is not None:  # (outside the except: orbax's abandoned tasks can go)
            self._failed(pending, failure)
        self._pending = pending
        return step

    def raise_if_save_failed(self) -> None:
        """Raise CheckpointSaveError if the save in flight has failed; never blocks.

        Cheap (a flag read) while a save is in flight or none is: call it after every step."""
        self._finish_pending(block=False)

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk; CheckpointSaveError if it failed."""
        self._finish_pending(block=True)

    def close(self) -> None:
        """Wait for the save in flight (CheckpointSaveError if it failed) and let go."""
        try:
            self._finish_pending(block=True)
        finally:
            with contextlib.suppress(Exception):  # a failure _finish_pending reported already
                self.manager.close()
            self._held.close()
            for logger in _LOGGERS:
                logging.getLogger(logger).removeFilter(self._held)

    def _finish_pending(self, *, block: bool) -> None:
        """If the save in flight is done (or ``block``): on success apply retention, on
        failure clean up and raise CheckpointSaveError."""
        pending = self._pending
        if pending is None or (not block and self.manager.is_saving_in_progress()):
            return
        self._pending = None
        failure = None
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            failure = _os_error(e)
        if failure is not None:  # (outside the except: orbax's abandoned tasks can go)
            self._failed(pending, failure)
        self._held.release(ok=True)  # orbax errors of a save that succeeded: not ours
        if self._writer:
            self._apply_retention()

    def _failed(self, pending: _Pending, error: str):
        """Clean up after a failed save and raise the one error that says what happened."""
        path = self.directory / str(pending.step)
        removed = "it left nothing behind"
        # orbax's other workers of this save go on (and go on failing) after the first error:
        # let them finish before removing what they wrote. Their reports stay held until
        # close(), the one below replaces them. A manager that saw a failure may raise it
        # again at its next save: a new one takes over.
        _join_orbax_threads()
        with contextlib.suppress(Exception):
            self.manager.close()
        self.manager = self._new_manager()
        _settle()
        self._held.held.clear()  # (still holding: stragglers' reports are dropped at close)
        self._held.failed = True
        if self._writer:
            try:
                self._clean_leftovers()
                removed = "the partial write was removed"
            except OSError as e:
                removed = f"removing the partial write failed too ({e})"
            self.manager.reload()
        try:
            free = f"{format_bytes(shutil.disk_usage(self.directory).free)} free"
        except OSError:
            free = "an unknown amount free"
        steps = self.all_steps()
        earlier = (
            f"Checkpoint{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} "
            f"{'are' if len(steps) > 1 else 'is'} intact (the run can resume from {steps[-1]})"
            if steps
            else "There is no earlier checkpoint"
        )
        raise CheckpointSaveError(
            f"checkpoint {path} could not be written: {error}. It needs about "
            f"{format_bytes(pending.nbytes)} (the train state, before compression); "
            f"{self.directory} has {free}. {earlier}; {removed}. Free space (or fix the "
            f"directory's permissions) and resume."
        ) from None

    def _apply_retention(self) -> None:
        steps = self.all_steps()
        for step in steps[: max(len(steps) - self.keep, 0)]:
            _remove_tree(self.directory / str(step))
        if len(steps) > self.keep:
            self.manager.reload()

    def _clean_leftovers(self) -> None:
        """Remove what this code's interrupted saves and deletions provably left: orbax's
        temporary directories (``<step>.orbax-checkpoint-tmp*``), ``.deleting-*`` ones, and
        empty step directories. A step directory with anything in it is never removed here,
        even if incomplete: :meth:`restore` sets it aside (``<step>.damaged``) or refuses it."""
        for path in sorted(self.directory.iterdir()):
            if _TMP_NAME.match(path.name) or path.name.startswith(_DELETING):
                _remove_tree(path)
            elif (
                _STEP_NAME.match(path.name)
                and path.is_dir()
                and not path.is_symlink()
                and not any(path.iterdir())
            ):
                path.rmdir()

    # -- restoring --

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The metadata of checkpoint ``step`` (default: latest), without touching the arrays."""
        step = self._existing(step)
        try:
            return self._read_meta(step)
        except _Unusable as e:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)}: {e.why}. Delete that step directory "
                f"to resume from an earlier checkpoint."
            ) from None

    def restore(
        self,
        cfg: Config,
        mesh: Mesh,
        opt: optax.GradientTransformation,
        step: int | None = None,
        *,
        policy: ResumePolicy | None = None,
        log: Callable[[str], None] | None = None,
    ) -> Restored:
        """Restore checkpoint ``step`` (default: the newest good one) resharded onto ``mesh``.

        Every array is checked against the checksum saved with it. ``policy`` (default
        ``cfg.train.resume``): ``latest_good`` skips a damaged, incomplete or unreadable
        checkpoint, with one line to ``log`` (default: the Checkpointer's) each, for the newest
        one that is good, and moves the skipped ones aside (``<step>.damaged``) unless
        read-only; ``strict`` raises CheckpointError for it. An explicit ``step`` is strict."""
        policy = cfg.train.resume if policy is None else policy
        if policy not in RESUME_POLICIES:
            raise ValueError(f"policy must be one of {RESUME_POLICIES}, got {policy!r}.")
        log = self.log if log is None else log
        self._finish_pending(block=True)
        if step is not None:
            candidates = {self._existing(step): None}
        else:  # newest first, incomplete ones included: they are skipped or refused by name
            candidates = dict(reversed(step_directories(self.directory).items()))
        if not candidates:
            raise CheckpointError(
                f"no complete checkpoint in {self.directory}. Train first (seqshard train CONFIG)."
            )
        target = train_state_structs(cfg.model, mesh, opt)
        skipped: dict[int, str] = {}
        for s, missing in candidates.items():
            why = f"not a complete checkpoint (no {missing})" if missing is not None else None
            self._held.hold()
            try:
                try:
                    if why is None:
                        state, meta = self._restore_verified(s, cfg, target, log)
                except _Unusable as e:
                    why = e.why
                if why is not None:
                    _settle()
            finally:
                self._held.release(ok=why is None)
            if why is None:
                self._set_aside(skipped, s, log)
                if self._writer:
                    self._apply_retention()  # a kill right after a save left one too many
                state = _in_layer_order(state, meta, cfg, mesh)
                return Restored(state=state, meta=meta, step=s, skipped=skipped)
            if policy == "strict" or step is not None:
                raise CheckpointError(self._unusable(s, why))
            skipped[s] = why
        listing = "; ".join(f"{self.directory / str(s)}: {why}" for s, why in skipped.items())
        raise CheckpointError(
            f"no good checkpoint in {self.directory}: {listing}. Start a new run (run.name=...) "
            f"or delete the run directory."
        )

    def _unusable(self, step: int, why: str) -> str:
        older = [s for s in self.all_steps() if s < step]
        then = (
            f"delete it to resume from checkpoint {older[-1]}, or set train.resume=latest_good "
            f"to skip it"
            if older
            else "delete it and start again; no earlier checkpoint exists"
        )
        return (
            f"checkpoint {self.directory / str(step)}: {why}. It is damaged or incomplete: {then}."
        )

    def _set_aside(self, skipped: dict[int, str], good: int, log: Callable[[str], None]) -> None:
        """One line per skipped checkpoint; out of the way of the steps the run will save."""
        for s, why in skipped.items():
            path = self.directory / str(s)
            where = ""
            if self._writer:
                aside, n = path.with_name(f"{s}{_DAMAGED}"), 1
                while aside.exists():
                    n += 1
                    aside = path.with_name(f"{s}{_DAMAGED}-{n}")
                path.rename(aside)
                where = f" (kept as {aside.name})"
            log(f"checkpoint {path}: {why}: skipping it, resuming from checkpoint {good}{where}")
        if skipped:
            _sync("seqshard.checkpoint: damaged set aside")
            self.manager.reload()  # (orbax would refuse to save those steps again)

    def _read_meta(self, step: int) -> dict[str, Any]:
        try:
            meta = self.manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            ).meta
        except Exception as e:  # orbax raises many kinds on a damaged directory
            raise _Unusable(f"unreadable metadata ({_first_line(e)})") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), str):
            raise _Unusable("no readable config in its metadata")
        return meta

    def _restore_verified(
        self, step: int, cfg: Config, target: TrainState, log: Callable[[str], None]
    ):
        """(state, meta) of checkpoint ``step``, every array's checksum checked; raises
        _Unusable if it is damaged, CheckpointError if it is of another model."""
        meta = self._read_meta(step)
        _check_same_model(meta, cfg, self.directory / str(step))
        if meta.get("step") != step:
            raise _Unusable(f"its metadata is of step {meta.get('step')!r}")
        try:
            state = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
            ).state
        except Exception as e:
            raise _Unusable(f"unreadable arrays ({_first_line(e)})") from None
        saved = meta.get("checksums")
        if saved is None:  # written before checksums were recorded
            log(f"checkpoint {self.directory / str(step)} has no checksums: not verified")
            return state, meta
        checksums, _ = state_digest(state)
        if set(saved) != set(checksums):
            raise _Unusable(
                f"its arrays ({len(saved)}) are not the state's ({len(checksums)}): "
                f"{sorted(set(saved) ^ set(checksums))[:4]}"
            )
        bad = [n for n in checksums if int(saved[n], 16) != checksums[n]]
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise _Unusable(
                f"array {bad[0]} checksum mismatch (saved {saved[bad[0]]}, read "
                f"0x{checksums[bad[0]]:08x}){more}"
            )
        return state, meta

    def _existing(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(
                    f"no complete checkpoint in {self.directory}. Train first (seqshard train CONFIG)."
                )
            return steps[-1]
        if step not in steps:
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; it has {steps}."
            )
        return step


def _in_layer_order(state: TrainState, meta: dict[str, Any], cfg: Config, mesh: Mesh):
    """The restored ``state``, its layer stacks moved from the order the checkpoint's run
    stored them in to the order ``cfg`` runs them in on ``mesh`` (they differ only for the
    circular pipeline schedule: :func:`~seqshard.train.state.layer_order`)."""
    saved = config_from_yaml(meta["config"], "checkpoint metadata")
    saved_p = saved.mesh.p if saved.mesh.is_resolved else 1
    return relayered(
        state, layer_order(saved, saved_p), layer_order(cfg, dict(mesh.shape).get("p", 1))
    )


def _check_same_model(meta: dict[str, Any], cfg: Config, where: Path) -> None:
    """Refuse, with the differing fields, a checkpoint saved for another model shape."""
    try:
        saved = config_from_yaml(meta["config"], f"checkpoint {where} metadata").model.dim_sizes()
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    current = cfg.model.dim_sizes()
    diff = [
        f"model.{DIM_FIELDS[dim]}: checkpoint {saved[dim]!r}, config {current[dim]!r}"
        for dim in current
        if saved[dim] != current[dim]
    ]
    if diff:
        raise CheckpointError(
            f"checkpoint {where} was saved for another model shape ({'; '.join(diff)}). Use the "
            f"run's own config (RUN_DIR/config.yaml) or start a new run (run.name=...)."
        )


def latest_state(
    run_dir: str | Path, cfg: Config, mesh: Mesh, *, log: Callable[[str], None] = print
) -> TrainState:
    """The train state of ``run_dir``'s newest good checkpoint, restored onto ``mesh``.

    Read-only: safe beside a training run writing into the same directory."""
    ckpt = Checkpointer(Path(run_dir) / "checkpoints", read_only=True, log=log)
    try:
        return ckpt.restore(cfg, mesh, make_optimizer(cfg.train)).state
    finally:
        ckpt.close()
