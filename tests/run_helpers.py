"""Helpers of the tests that train the tiny model in-process (tests/train/test_loop.py,
tests/model/test_context.py, ...): run a config, read its metrics by step, restore its state."""

from __future__ import annotations

from pathlib import Path

from seqshard.config import load_config
from seqshard.mesh import training_mesh
from seqshard.train.checkpoint import Checkpointer
from seqshard.train.loop import train
from seqshard.train.metrics import read_metrics
from seqshard.train.optimizer import make_optimizer

# train.steps changes the lr schedule (the cosine ends at train.steps), so "6 steps, then
# resume to 12" only equals "12 steps" when the schedule does not depend on train.steps:
# min_lr_ratio=1 makes it warmup, then constant.
FLAT = {"min_lr_ratio": 1.0}

TRAINED_RUN = {"steps": 6, "min_lr_ratio": 1.0, "checkpoint_every": 2, "keep_checkpoints": 2}
"""train.* of conftest.py's ``trained_run`` over ``tiny_overrides``."""


def quiet(_msg: str) -> None:
    pass


def run(overrides: list[str]):
    """Train the config of ``overrides`` in this process, silently: its TrainResult."""
    return train(load_config(None, overrides), log=quiet, tty=False)


def by_step(run_dir: Path) -> dict[int, dict]:
    """A run's metrics.jsonl records by step; a repeated or backward step fails."""
    records = read_metrics(run_dir)
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), f"steps repeat or go back: {steps}"
    return {r["step"]: r for r in records}


def latest_state(run_dir: Path, cfg):
    """The train state of the run's newest checkpoint, restored on ``cfg``'s mesh."""
    ckpt = Checkpointer(run_dir / "checkpoints")
    try:
        mesh = training_mesh(cfg.mesh.sizes())
        return ckpt.restore(cfg, mesh, make_optimizer(cfg.train, cfg.model, mesh)).state
    finally:
        ckpt.close()
