"""The optimizer: global-norm clipping, then AdamW (or, with ``train.optimizer=muon``, Muon for
the weight matrices: :mod:`seqshard.train.muon`) on a warmup + cosine or WSD schedule.

Weight decay applies where each weight's declaration says (``decay``; the blocks declare their
weights beside their math): not to the norm gains (``ln1``, ``ln2``, ``final_norm``), since
decaying a gain towards zero fights the normalization it scales.
"""

from __future__ import annotations

import optax
from jax.sharding import Mesh

from seqshard.config import TrainConfig
from seqshard.model.block import weight_info
from seqshard.model.config import ModelConfig
from seqshard.model.weights import Weights, stack_layer_types
from seqshard.train.muon import sharded_muon

__all__ = ["decay_mask", "lr_schedule", "make_optimizer"]


def lr_schedule(train_cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to ``lr``, then cosine to ``lr * min_lr_ratio`` at ``steps``, or
    (``wsd``) constant ``lr`` until the last ``decay_fraction`` of steps, decayed linearly."""
    end = train_cfg.lr * train_cfg.min_lr_ratio
    if train_cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0,
            train_cfg.lr,
            train_cfg.warmup_steps,
            max(train_cfg.steps, train_cfg.warmup_steps + 1),
            end,
        )
    decay_steps = max(1, round(train_cfg.steps * train_cfg.decay_fraction))
    stable_steps = max(0, train_cfg.steps - train_cfg.warmup_steps - decay_steps)
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, train_cfg.lr, max(train_cfg.warmup_steps, 1)),
            optax.constant_schedule(train_cfg.lr),
            optax.linear_schedule(train_cfg.lr, end, decay_steps),
        ],
        boundaries=[train_cfg.warmup_steps, train_cfg.warmup_steps + stable_steps],
    )


def decay_mask(weights: Weights) -> Weights:
    """True where weight decay applies: each weight's declared ``decay`` (the tree of the
    weights given, whichever layer stacks and block kinds its config has)."""
    cls = type(weights)
    stacks = {
        name: layer(**{field: w.decay for field, w in weight_info(layer).items()})
        for name, layer in stack_layer_types(cls).items()
    }
    return cls(**stacks, **{name: w.decay for name, w in weight_info(cls).items()})


def make_optimizer(
    train_cfg: TrainConfig, model_cfg: ModelConfig | None = None, mesh: Mesh | None = None
) -> optax.GradientTransformation:
    """clip_by_global_norm (unless ``grad_clip`` is 0), then AdamW with :func:`decay_mask`;
    with ``train.optimizer=muon``, Muon for the weight matrices of ``model_cfg``, sharded on
    ``mesh`` (:mod:`seqshard.train.muon`), and that AdamW for the rest."""
    schedule = lr_schedule(train_cfg)
    tx = optax.adamw(
        schedule,
        b1=train_cfg.beta1,
        b2=train_cfg.beta2,
        eps=train_cfg.eps,
        weight_decay=train_cfg.weight_decay,
        mask=decay_mask,
    )
    if train_cfg.optimizer == "muon":
        if model_cfg is None or mesh is None:
            raise TypeError(
                "train.optimizer=muon orthogonalizes the sharded weight matrices: "
                "make_optimizer(cfg.train, cfg.model, mesh) needs the model config and the mesh."
            )
        tx = sharded_muon(
            model_cfg, mesh, train_cfg.muon, schedule, train_cfg.weight_decay, decay_mask, tx
        )
    if train_cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(train_cfg.grad_clip), tx)
    return tx
