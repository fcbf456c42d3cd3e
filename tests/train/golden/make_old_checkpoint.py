"""Writes tests/train/golden/checkpoint_before_stacks/: a checkpoint as seqshard wrote it
before issue 42 (weights the config leaves off stored as zero-size arrays: q_norm and k_norm
without model.qk_norm, the shared experts without any, the empty dense stack of an MoE model
with no dense layers), and weights.npz, its weights as numpy. Run with that version's code:

    git worktree add /tmp/old 75ff3fc
    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=/tmp/old \\
        .venv/bin/python tests/train/golden/make_old_checkpoint.py

tests/train/test_checkpoint.py restores it with today's tree (those weights absent).
"""

from __future__ import annotations

import pathlib
import shutil
import sys

import jax
import numpy as np

from seqshard.config import load_config
from seqshard.mesh import mesh_of_sizes
from seqshard.train.checkpoint import Checkpointer
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import init_train_state

HERE = pathlib.Path(__file__).parent
OVERRIDES = [
    "model.vocab=64", "model.d_model=32", "model.n_layers=2", "model.n_q_per_kv=2",
    "model.n_kv=2", "model.d_head=8", "model.d_ff=64", "model.compute_dtype=float32",
    "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.d_ff=16",
    "model.moe.n_dense_layers=0", "model.moe.n_shared=0",
    "data.vocab_size=64", "mesh.e=2", "mesh.d=2", "mesh.t=2",
]  # fmt: skip


def main() -> None:
    cfg = load_config(None, OVERRIDES)
    mesh = mesh_of_sizes(cfg.mesh.sizes())
    opt = make_optimizer(cfg.train)
    state = init_train_state(cfg.model, mesh, opt, jax.random.key(7))
    out = HERE / "checkpoint_before_stacks"
    shutil.rmtree(out, ignore_errors=True)
    ckpt = Checkpointer(out / "checkpoints")
    ckpt.save(state, cfg, {})
    ckpt.wait()
    ckpt.close()
    flat = {
        jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(state.weights)
        if leaf.size
    }
    np.savez(out / "weights.npz", **flat)
    print(f"wrote {out}: {len(flat)} weights", file=sys.stderr)


if __name__ == "__main__":
    main()
