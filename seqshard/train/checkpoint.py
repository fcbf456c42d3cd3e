"""Checkpoints with orbax: the train state plus JSON metadata (config, loader state, seed).

Each checkpoint is a step directory ``RUN_DIR/checkpoints/<step>`` holding

    state   TrainState (weights, AdamW moments, step), saved shard by shard
    meta    {"config": resolved YAML, "loader": loader state, "seed": init seed, "step": step}

Saves are asynchronous (training continues while the previous checkpoint is written) and
atomic: orbax writes into a temporary directory and renames it when complete, so a crash or
kill mid-save leaves no checkpoint that a resume would load. The last ``keep`` are kept.

Restoring builds every target as a ``jax.ShapeDtypeStruct`` with the sharding its type
declares on the *current* mesh (optimizer state included), so a run saved on 4x2 resumes on
2x4 or 8x1: orbax reads each device's slices directly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from seqshard.config import Config, ConfigError, config_from_yaml, config_to_yaml
from seqshard.model.config import DIM_FIELDS
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import TrainState, train_state_structs

__all__ = ["CheckpointError", "Checkpointer", "latest_state"]


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not fit the model being restored."""


@dataclasses.dataclass
class Restored:
    state: TrainState
    meta: dict[str, Any]


class Checkpointer:
    """Save and restore training checkpoints under ``directory``."""

    def __init__(self, directory: str | Path, keep: int = 3):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=True, create=True
            ),
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self.manager.latest_step()

    def save(
        self, state: TrainState, cfg: Config, loader_state: dict[str, Any], *, force: bool = False
    ) -> int:
        """Start saving ``state`` (asynchronously); returns its step."""
        step = int(jax.device_get(state.step))
        if step in self.manager.all_steps():
            return step
        meta = {
            "config": config_to_yaml(cfg),
            "loader": loader_state,
            "seed": cfg.train.seed,
            "step": step,
        }
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )
        return step

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The metadata of checkpoint ``step`` (default: latest), without touching the arrays."""
        step = self._step(step)
        try:
            return self.manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            ).meta
        except Exception as e:  # orbax raises many kinds on a damaged directory
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} has unreadable metadata ({type(e).__name__}: "
                f"{e}). Delete that step directory to resume from an earlier checkpoint."
            ) from None

    def restore(
        self, cfg: Config, mesh: Mesh, opt: optax.GradientTransformation, step: int | None = None
    ) -> Restored:
        """Restore checkpoint ``step`` (default: latest) resharded onto ``mesh``."""
        step = self._step(step)
        meta = self.read_meta(step)
        _check_same_model(meta, cfg, self.directory / str(step))
        target = train_state_structs(cfg.model, mesh, opt)
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} could not be restored ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}). It may be damaged or from another "
                f"model: delete it to resume from an earlier one, or start a new run."
            ) from None
        return Restored(state=restored.state, meta=restored.meta)

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def _step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(
                    f"no complete checkpoint in {self.directory}. Train first (seqshard train CONFIG)."
                )
        elif step not in self.manager.all_steps():
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; it has {self.manager.all_steps()}."
            )
        return step


def _check_same_model(meta: dict[str, Any], cfg: Config, where: Path) -> None:
    """Refuse, with the differing fields, a checkpoint saved for another model shape."""
    if not isinstance(meta.get("config"), str):
        raise CheckpointError(f"checkpoint {where} has no readable config in its metadata.")
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


def latest_state(run_dir: str | Path, cfg: Config, mesh: Mesh) -> TrainState:
    """The train state of ``run_dir``'s latest checkpoint, restored onto ``mesh``."""
    ckpt = Checkpointer(Path(run_dir) / "checkpoints")
    try:
        return ckpt.restore(cfg, mesh, make_optimizer(cfg.train)).state
    finally:
        ckpt.close()
