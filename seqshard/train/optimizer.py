"""The optimizer: global-norm clipping, then AdamW on a warmup + cosine or WSD schedule.

Weight decay skips the norm gains (``ln1``, ``ln2``, ``final_norm``): decaying a gain towards
zero fights the normalization it scales.
"""

from __future__ import annotations

import jax
import optax

from seqshard.config import TrainConfig
from seqshard.model.weights import Layer, Weights

__all__ = ["decay_mask", "lr_schedule", "make_optimizer"]


def lr_schedule(t: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to ``lr``, then cosine to ``lr * min_lr_ratio`` at ``steps``, or
    (``wsd``) constant ``lr`` until the last ``decay_fraction`` of steps, decayed linearly."""
    end = t.lr * t.min_lr_ratio
    if t.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, t.lr, t.warmup_steps, max(t.steps, t.warmup_steps + 1), end
        )
    decay_steps = max(1, round(t.steps * t.decay_fraction))
    stable_steps = max(0, t.steps - t.warmup_steps - decay_steps)
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, t.lr, max(t.warmup_steps, 1)),
            optax.constant_schedule(t.lr),
            optax.linear_schedule(t.lr, end, decay_steps),
        ],
        boundaries=[t.warmup_steps, t.warmup_steps + stable_steps],
    )


def decay_mask(weights: Weights) -> Weights:
    """True where weight decay applies: every weight but the norm gains."""
    mask = jax.tree.map(lambda _: True, weights)
    layers = Layer(**{**vars(mask.layers), "ln1": False, "ln2": False})
    return Weights(embed=mask.embed, layers=layers, final_norm=False, unembed=mask.unembed)


def make_optimizer(t: TrainConfig) -> optax.GradientTransformation:
    """clip_by_global_norm (unless ``grad_clip`` is 0), then AdamW with :func:`decay_mask`."""
    adamw = optax.adamw(
        lr_schedule(t),
        b1=t.beta1,
        b2=t.beta2,
        eps=t.eps,
        weight_decay=t.weight_decay,
        mask=decay_mask,
    )
    if t.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw)
    return adamw
