"""Random weights for model tests (imported by test_model, test_remat, test_step)."""

from __future__ import annotations

import math

import jax
import numpy as np

from seqshard.model import ModelConfig, Weights, weight_structs

NORM_GAINS = ("layers.ln1", "layers.ln2", "final_norm")


def random_weights(cfg: ModelConfig, mesh=None, seed: int = 0) -> Weights:
    """Weights of ``cfg``'s shapes: matrices N(0, 1/d_model), norm gains 1 + N(0, 0.25); numpy,
    or placed in their declared layouts when ``mesh`` is given.

    Not init_weights: its gains are all ones, under which a gain gathered in the wrong order
    ('M/d/t' for 'M/t/d') would go unnoticed; and its partitioned RNG costs a compile.
    """
    rng = np.random.default_rng(seed)

    def draw(path, s):
        x = rng.standard_normal(s.shape)
        if jax.tree_util.keystr(path, simple=True, separator=".") in NORM_GAINS:
            x = 1 + 0.5 * x
        else:
            x = x / math.sqrt(cfg.d_model)
        x = x.astype(s.dtype)
        return x if mesh is None else jax.device_put(x, s.sharding)

    return jax.tree_util.tree_map_with_path(draw, weight_structs(cfg, mesh))
