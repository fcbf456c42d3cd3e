"""Tests of seqshard/model/mla.py: multi-head latent attention against the reference (Hugging
Face's DeepSeek-V3 math written densely), with and without the query latent, on meshes
splitting t, c (allgather and ring), e and d, under both backwards; YaRN's frequencies and
softmax scale; configs that cannot work.

Tolerances (f32): the loss to 1e-5 relative, each gradient to 1e-4 of its leaf's largest
entry (the issue's bounds).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from model_weights import packed_batch, random_weights, tiny_model

from seqshard.mesh import mesh_of_sizes
from seqshard.model import loss_fn, reference_loss_fn
from seqshard.model.config import MLAConfig, MoEConfig
from seqshard.model.weights import weight_structs

MLA = MLAConfig(
    q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
)
CFG = tiny_model(attention="mla", n_q_per_kv=1, n_kv=4, d_head=12, mla=MLA)
BATCH, LENGTH = 8, 16
TOKENS, STARTS = packed_batch(CFG.vocab, BATCH, LENGTH, seed=0)


@functools.cache
def _weights(cfg):
    return random_weights(cfg, seed=0)


@functools.cache
def reference(cfg):
    fn = jax.jit(jax.value_and_grad(reference_loss_fn), static_argnums=3)
    return jax.tree.map(np.asarray, fn(_weights(cfg), TOKENS, STARTS, cfg))


def sharded(cfg, sizes):
    mesh = mesh_of_sizes(sizes)
    placed = jax.device_put(
        _weights(cfg), jax.tree.map(lambda s: s.sharding, weight_structs(cfg, mesh))
    )
    fn = jax.jit(jax.value_and_grad(lambda w: loss_fn(w, TOKENS, STARTS, cfg, mesh)))
    return jax.tree.map(np.asarray, fn(placed))


def assert_close(got, want) -> None:
    (loss, grads), (ref_loss, ref_grads) = got, want
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for (path, r), g in zip(
        jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads), strict=True
    ):
        if r.size:
            worst = np.max(np.abs(g - r)) / max(np.max(np.abs(r)), 1e-30)
            assert worst <= 1e-4, (jax.tree_util.keystr(path), worst)


def _cfg(q_lora: bool, **changes):
    mla = MLA if q_lora else dataclasses.replace(MLA, q_lora_rank=0)
    return dataclasses.replace(CFG, mla=mla, **changes)


@pytest.mark.parametrize("backward", ["explicit", "autodiff"])
@pytest.mark.parametrize(
    "q_lora,sizes,changes",
    [
        (True, {"d": 2, "t": 4}, {}),
        (False, {"d": 4, "t": 2}, {"residual": "M/t"}),
        (True, {"c": 2, "d": 2, "t": 2}, {}),
        (False, {"c": 4, "t": 2}, {"context_impl": "ring"}),
    ],
    ids=["d2t4", "d4t2-M/t-no-q-latent", "c2d2t2", "c4t2-ring-no-q-latent"],
)
def test_sharded_equals_the_reference(q_lora, sizes, changes, backward):
    cfg = _cfg(q_lora, backward=backward, **changes)
    assert_close(sharded(cfg, sizes), reference(_cfg(q_lora)))
