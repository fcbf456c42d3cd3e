"""What the Hugging Face interop tests (tests/hf/) share: the transformers skip mark, the logits
tolerance, logits from torch and from seqshard, random seqshard weights, tree and file
comparisons."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import numpy as np
import pytest

from seqshard.model import ModelConfig
from seqshard.model.sharded import logits_fn
from seqshard.model.weights import weight_structs

HAS_TRANSFORMERS = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
needs_transformers = pytest.mark.skipif(
    not HAS_TRANSFORMERS,
    reason="needs transformers and a CPU torch: pip install -e '.[test,hf]'",
)
LOGITS_TOL = 1e-5  # max abs, f32 (measured: see each test)


def tree_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True)
    )


def tokens_and_starts(vocab: int, batch: int = 4, length: int = 32):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, vocab, (batch, length)).astype(np.int32)
    starts = np.zeros((batch, length), bool)
    starts[:, 0] = True  # one document per row, as transformers sees it
    return tokens, starts


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


# Jitted: logits_fn called eagerly runs its shard_map op by op (about 5 s a call here).
_logits_jit = jax.jit(logits_fn, static_argnums=(3, 4))


def seqshard_logits(weights, tokens, starts, cfg, mesh) -> np.ndarray:
    return np.asarray(_logits_jit(weights, tokens, starts, cfg, mesh))


def random_seqshard_weights(
    cfg: ModelConfig, mesh, *, embed_std: float | None = None, router_bias_std: float = 0.0
):
    """Random weights of ``cfg`` placed on ``mesh``: gains (``ln*``, ``*norm``) 1 + N(0, 0.04),
    router_bias N(0, router_bias_std^2) (default zero), the embedding N(0, embed_std^2)
    (default as the other matrices), matrices N(0, 1/d_model)."""
    rng = np.random.default_rng(3)

    def draw(path, s):
        name = jax.tree_util.keystr(path, simple=True, separator=".").split(".")[-1]
        x = rng.standard_normal(s.shape)
        if name.startswith("ln") or name.endswith("norm"):
            x = 1 + 0.2 * x
        elif name == "router_bias":
            x = router_bias_std * x
        elif name == "embed" and embed_std is not None:
            x = embed_std * x
        else:
            x = x / np.sqrt(cfg.d_model)
        return jax.device_put(x.astype(np.float32), s.sharding)

    return jax.tree_util.tree_map_with_path(draw, weight_structs(cfg, mesh))


def safetensors_names(path: Path) -> list[str]:
    """The tensor names of ``path/model.safetensors``."""
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "np") as f:
        return list(f.keys())
