"""scripts/bench_moe.py's baseline is the same model as seqshard's MoE: its dense capacity rule
keeps exactly the token copies seqshard's dispatch keeps.

The end-to-end agreement (first-step losses, dropped fractions) is printed by the script; here
only the rule, on random routings where capacity drops a good share: for each device group
(d x e of them, consecutive rows), ``capacity_kept`` against ``seqshard.model.moe``'s own
dispatch plan on that group's tokens (slot < capacity). Milliseconds, no mesh.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from seqshard.model.config import ModelConfig, MoEConfig
from seqshard.model.moe import _dispatch_plan, capacity

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_moe.py"


@functools.cache
def bench():
    """scripts/bench_moe.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_moe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("groups", "e", "factor"), [(4, 2, 1.0), (8, 8, 0.8), (2, 1, 0.5)])
def test_capacity_kept_is_seqshards_dispatch(groups, e, factor):
    """8 experts top-3, 8 rows x 16 tokens, skewed routing (experts 0-2 three times as
    likely), so shards overflow; the kept sets equal and some copies drop."""
    moe = MoEConfig(n_experts=8, top_k=3, d_ff=8, capacity_factor=factor)
    cfg = ModelConfig(vocab=64, d_model=16, n_layers=2, d_ff=32, moe=moe)
    rng = np.random.default_rng(0)
    weights = np.array([3, 3, 3, 1, 1, 1, 1, 1], float)
    ids = np.stack(
        [rng.choice(8, 3, replace=False, p=weights / weights.sum()) for _ in range(8 * 16)]
    ).reshape(8, 16, 3)
    kept = np.asarray(bench().capacity_kept(cfg, jnp.asarray(ids, jnp.int32), groups, e))
    tokens = ids.reshape(groups, -1, 3)
    cap = capacity(cfg, tokens.shape[1], e)
    want = np.stack(
        [
            np.asarray(_dispatch_plan(cfg, jnp.asarray(g, jnp.int32), e, cap)[1]) < cap
            for g in tokens
        ]
    ).reshape(kept.shape)
    assert (~want).sum() > 0 and (kept == want).all(), ((~want).sum(), (kept != want).sum())
