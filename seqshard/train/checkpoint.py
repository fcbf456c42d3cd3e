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

The checksums are :mod:`seqshard.train.checksums`'s, the names in a checkpoint directory
:mod:`seqshard.train.step_dirs`'s, and the quieting of orbax's own reports of a failure
:mod:`seqshard.train.orbax_quiet`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from seqshard.config import Config, ConfigError, config_from_yaml, config_to_yaml
from seqshard.files import free_space
from seqshard.model.config import DIM_KEYS
from seqshard.shardlib.tables import format_bytes
from seqshard.train.checksums import state_digest
from seqshard.train.optimizer import make_optimizer
from seqshard.train.orbax_quiet import ORBAX_LOGGERS, OrbaxQuiet, join_orbax_threads, settle
from seqshard.train.state import TrainState, layer_order, relayered, train_state_structs
from seqshard.train.step_dirs import (
    checkpoint_steps,
    remove_leftovers,
    remove_tree,
    set_aside,
    step_directories,
)

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


def _sync(name: str) -> None:
    """All processes of a multi-process run wait here (for what process 0 changed on disk)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


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
        self._held = OrbaxQuiet()
        self._writer = not read_only and jax.process_index() == 0  # who changes the directory
        if self._writer and self.directory.is_dir():
            remove_leftovers(self.directory)
        _sync("seqshard.checkpoint: leftovers cleaned")  # before any process lists steps
        self.manager = self._new_manager()
        for logger in ORBAX_LOGGERS:
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
                    state=ocp.args.StandardSave(_empty_as_none(state)),
                    meta=ocp.args.JsonSave(meta),
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
            if not self._held.failed:  # else it keeps orbax's late leftovers quiet (close)
                for logger in ORBAX_LOGGERS:
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
        join_orbax_threads()
        with contextlib.suppress(Exception):
            self.manager.close()
        self.manager = self._new_manager()
        settle()
        self._held.held.clear()  # (still holding: stragglers' reports are dropped at close)
        self._held.failed = True
        if self._writer:
            try:
                remove_leftovers(self.directory)
                removed = "the partial write was removed"
            except OSError as e:
                removed = f"removing the partial write failed too ({e})"
            self.manager.reload()
        free = free_space(self.directory)
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
            remove_tree(self.directory / str(step))
        if len(steps) > self.keep:
            self.manager.reload()

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
                    settle()
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
                where = f" (kept as {set_aside(path).name})"
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
            state = _with_empty(self._restore_arrays(step, _empty_as_none(target)), target)
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

    def _restore_arrays(self, step: int, target: Any) -> Any:
        """The arrays of checkpoint ``step`` as ``target`` (zero-size arrays as None). The
        tree on disk may differ from the target by empty entries only, either way: a
        checkpoint written before a weight existed lacks its None entries (read with them
        left out of the target, then put back); one written when a weight the config leaves
        off was a zero-size array (``q_norm`` without ``model.qk_norm``, shared experts
        without any, an empty layer stack, and their optimizer moments: written as None) has
        entries the target, in which such weights are absent, lacks (read with them, then
        dropped). Nothing is in either."""
        try:
            return self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
            ).state
        except ValueError as e:
            if "tree structures do not match" not in str(e):
                raise
        on_disk = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state")
        on_disk = on_disk.tree
        serialized = ocp.tree.serialize_tree(target, keep_empty_nodes=True)
        read = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_without_absent_nones(serialized, on_disk))
            ),
        ).state
        return ocp.tree.deserialize_tree(
            _with_nones(read, serialized), target, keep_empty_nodes=True
        )

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


def _empty_as_none(tree: Any) -> Any:
    """``tree`` with each zero-size array (a weight the model has not: ``q_norm`` without
    ``model.qk_norm``, shared experts without ``moe.n_shared``, and their optimizer moments)
    as None: orbax writes no zero-size array, and there is nothing in one to keep."""
    return jax.tree.map(lambda x: None if x.size == 0 else x, tree)


def _without_absent_nones(serialized: Any, on_disk: Any) -> Any:
    """``serialized`` (orbax's nested dicts and lists) less the None entries ``on_disk`` has
    not, plus the entries ``on_disk`` has that hold nothing (None, or dicts of them: a
    zero-size weight, a stack of them) and ``serialized`` has not."""
    if isinstance(serialized, list) and isinstance(on_disk, list):
        return [_without_absent_nones(v, d) for v, d in zip(serialized, on_disk, strict=True)]
    if not isinstance(serialized, dict) or not isinstance(on_disk, dict):
        return serialized
    out = {
        k: _without_absent_nones(v, on_disk.get(k))
        for k, v in serialized.items()
        if not (v is None and k not in on_disk)
    }
    out.update({k: d for k, d in on_disk.items() if k not in serialized and _holds_nothing(d)})
    return out


def _holds_nothing(on_disk: Any) -> bool:
    """Whether an entry of a checkpoint's tree holds no array (None, or containers of None)."""
    if isinstance(on_disk, dict):
        return all(_holds_nothing(v) for v in on_disk.values())
    if isinstance(on_disk, (list, tuple)):
        return all(_holds_nothing(v) for v in on_disk)
    return on_disk is None


def _with_nones(read: Any, serialized: Any) -> Any:
    """``read`` with the None entries of ``serialized`` it lacks put back."""
    if isinstance(serialized, list):
        return [_with_nones(r, v) for r, v in zip(read, serialized, strict=True)]
    if not isinstance(serialized, dict):
        return read
    return {k: None if k not in read else _with_nones(read[k], v) for k, v in serialized.items()}


def _with_empty(restored: Any, target: Any) -> Any:
    """``restored`` (read with :func:`_empty_as_none` of ``target``) with each zero-size array
    of ``target`` made again, in its sharding."""

    def fill(t, r):
        # device_put, not a jitted zeros: XLA does not split a zero-size output, and its
        # unsplit blocks fail jax's own reads (np.asarray) of the array.
        return jax.device_put(np.zeros(t.shape, t.dtype), t.sharding) if t.size == 0 else r

    return jax.tree.map(fill, target, restored, is_leaf=lambda x: x is None)


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
    # Each differing size by the key that sets it, once (a size two keys make, 'kv_a' or
    # 'mtp_in', differs only with one of theirs, which is named).
    keys: dict[str, str] = {}
    for dim in current:
        keys.setdefault(DIM_KEYS.get(dim, dim), dim)
    diff = [
        f"model.{key}: checkpoint {saved[dim]!r}, config {current[dim]!r}"
        for key, dim in keys.items()
        if saved.get(dim) != current[dim] and " " not in key
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
        return ckpt.restore(cfg, mesh, make_optimizer(cfg.train, cfg.model, mesh)).state
    finally:
        ckpt.close()
