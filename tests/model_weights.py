"""The tests' tiny model, random weights for it and tree comparisons (imported by the model,
step, remat, generation and comms tests; ``conftest.py``'s ``tiny_model_config`` fixture hands
out the same model)."""

from __future__ import annotations

import math

import jax
import numpy as np

from seqshard.mesh import mesh_of_sizes
from seqshard.model import ModelConfig, Weights, loss_fn, reference_loss_fn, weight_structs

NORM_GAINS = (
    "layers.ln1",
    "layers.ln2",
    "layers.q_norm",
    "layers.k_norm",
    "final_norm",
    *(f"{s}.{g}" for s in ("layers", "moe_layers", "mtp") for g in ("q_a_norm", "kv_a_norm")),
    *(f"mtp.{g}" for g in ("ln1", "ln2", "enorm", "hnorm", "head_norm", "q_norm", "k_norm")),
)

TINY = {
    "vocab": 64,
    "d_model": 32,
    "n_layers": 2,
    "n_q_per_kv": 2,
    "n_kv": 8,
    "d_head": 8,
    "d_ff": 64,
    "compute_dtype": "float32",
    "attention_impl": "einsum",
}
"""Sizes every test mesh of 8 devices splits (n_kv, d_ff, vocab by t <= 8; d_model by d*t
<= 32), GQA (n_q_per_kv and n_kv > 1), f32 so the sharded model equals its reference tightly."""


def tiny_model(**changes) -> ModelConfig:
    """The tiny model, with ``changes`` (e.g. ``n_kv=2``, ``remat='full'``)."""
    return ModelConfig(**{**TINY, **changes})


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


def packed_batch(vocab: int, batch: int, length: int, seed: int = 0):
    """(tokens i32[B, L], is_seq_start bool[B, L]) as numpy: random tokens in packed rows,
    documents starting at random places (about 1 in 5 tokens). Row 0 begins mid-document (no
    start at position 0), as a packed loader's rows may."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, length)).astype(np.int32)
    is_seq_start = rng.random((batch, length)) < 0.2
    is_seq_start[1:, 0] = True
    is_seq_start[0, 0] = False
    return tokens, is_seq_start


def to_numpy(tree):
    """Every leaf of ``tree`` as a numpy array (fetched from its devices)."""
    return jax.tree.map(np.asarray, tree)


def assert_trees_close(actual, expected, **tol) -> None:
    """allclose leaf by leaf, naming the leaf that differs."""
    paths = jax.tree_util.tree_leaves_with_path(expected)
    for (path, e), a in zip(paths, jax.tree.leaves(actual), strict=True):
        np.testing.assert_allclose(a, e, err_msg=jax.tree_util.keystr(path), **tol)


def reference_value_and_grad(cfg: ModelConfig, weights: Weights, tokens, starts):
    """(loss, gradients) of the single-device reference, as numpy."""
    fn = jax.jit(jax.value_and_grad(reference_loss_fn), static_argnums=3)
    return to_numpy(fn(weights, tokens, starts, cfg))


def sharded_value_and_grad(cfg: ModelConfig, sizes: dict, weights: Weights, tokens, starts):
    """(loss, gradients) of the sharded model on a mesh of ``sizes`` (``{'d': 2, 't': 4}``),
    the weights placed in their layouts, as numpy."""
    mesh = mesh_of_sizes(sizes)
    placed = jax.device_put(weights, jax.tree.map(lambda s: s.sharding, weight_structs(cfg, mesh)))
    fn = jax.jit(jax.value_and_grad(lambda w: loss_fn(w, tokens, starts, cfg, mesh)))
    return to_numpy(fn(placed))


def assert_close_to_reference(got, want, loss_rtol: float = 1e-5, grad_tol: float = 1e-4):
    """The loss within ``loss_rtol`` relative, each gradient within ``grad_tol`` of its leaf's
    largest entry (naming the leaf)."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    np.testing.assert_allclose(loss, ref_loss, rtol=loss_rtol)
    for (path, r), g in zip(
        jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads), strict=True
    ):
        if r.size:
            worst = np.max(np.abs(g - r)) / max(np.max(np.abs(r)), 1e-30)
            assert worst <= grad_tol, (jax.tree_util.keystr(path), worst)
