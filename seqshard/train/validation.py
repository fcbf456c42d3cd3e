"""The validation loss: over one data directory's val batches, or per source of a mixture.

    validate = make_validate(loader, make_eval_step(cfg, mesh), n_batches=4)
    validate(weights, step)   # {'val_loss': 4.61}
                              # a mixture: {'val_loss': 4.3, 'val_loss/web': 4.9, 'val_loss/code': 3.1}

A mixture's ``val_loss`` is its sources' val losses weighted by their shares in the batches
after ``step`` steps (the stage the next step draws from), so it tracks the loss of what the
run is being trained to model;
each ``val_loss/<source>`` is that source's own ``val`` split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from seqshard.batch import TokenBatch
from seqshard.data import Loader
from seqshard.model.weights import Weights

__all__ = ["evaluate", "make_validate"]


def evaluate(eval_step, weights: Weights, batches: Iterable[TokenBatch]) -> float | None:
    """Mean next-token loss over ``batches`` (summed losses over summed counts); None when
    their loss masks count no token (fine-tuning rows of prompts alone): no loss, not 0."""
    totals = sum(np.asarray(eval_step(weights, b), np.float64) for b in batches)
    if totals[1] == 0:
        return None
    return float(totals[0] / totals[1])


def make_validate(
    loader: Loader, eval_step, n_batches: int
) -> Callable[[Weights, int], dict[str, float | None]]:
    """``validate(weights, step) -> metrics`` over ``n_batches`` val batches of each source (the
    batches are built once, here: every source's val split must exist). A loss over no
    counted token is None, and so is a mixture's if any source's is."""
    sets = loader.eval_sets(n_batches)

    def validate(weights: Weights, step: int) -> dict[str, float | None]:
        losses = {name: evaluate(eval_step, weights, batches) for name, batches in sets.items()}
        if loader.mixture is None:
            return {"val_loss": next(iter(losses.values()))}
        shares = loader.mixture.weights_at(step)
        mixed = (
            None
            if None in losses.values()
            else sum(shares[name] * loss for name, loss in losses.items())
        )
        return {"val_loss": mixed, **{f"val_loss/{k}": v for k, v in losses.items()}}

    return validate
