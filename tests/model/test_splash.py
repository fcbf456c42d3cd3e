"""Tests of seqshard/model/splash.py: Pallas splash attention, run in interpret mode on CPU,
against einsum attention, and hosted inside the model's checked shard_map.

    values      splash equals einsum attention, output and gradients w.r.t. q, k, v, for the
                document and causal masks: on one device (no shard_map) and inside a
                check_vma=True shard_map on a 2x2 mesh (the hosted path)
    types       an input that varies over fewer mesh axes (k, v replicated over t) gets the
                sum of its per-device cotangents, as autodiff of einsum attention would give
    model       loss_fn and its gradient with attention_impl=splash equal einsum's on d=2 x t=2
    costs       the kernel runs once forward, three times backward (its forward again, dq,
                dkv); the hosting adds no collective (slow: two compiles)
    blocks      L = 640 runs a 5 x 5 grid of 128-blocks per head, documents crossing their edges
    fallback    given a dense mask (generation's prompts) splash is einsum attention
    errors      a sequence length the kernel cannot block names seq_len

Sizes are the smallest splash takes: L = 128 (one block), head dim 8 (interpret mode takes
any). Each compile of an interpreted kernel and its VJP costs a few seconds on CPU; the file
runs in about 40 s on 2 cores (``-m slow`` adds the causal model test and the collective count).
"""

from __future__ import annotations

import functools

import attention_helpers as helpers
import jax
import jax.extend
import numpy as np
import pytest
from attention_helpers import (
    F32,
    MODEL,
    MODEL_BATCH,
    assert_attention_close,
    attend_fn,
    loss_and_grad,
    mesh_of,
    model_args,
    pallas_calls,
    seq_len_error,
)
from model_weights import assert_trees_close, packed_batch, random_weights, tiny_model

from seqshard.model import loss_fn
from seqshard.model.splash import block_size, splash_attention
from seqshard.testing import count_collectives

BATCH, LENGTH, N_Q, N_KV, D_HEAD = 4, 128, 2, 2, 8
MASKS = ["document", "causal"]

# Within attention_helpers.F32 (1e-5): splash scales q instead of the scores. Measured, with
# q, k, v and the output's cotangent N(0, 1), both masks: outputs within 9.5e-7 (entries up to
# 3.3), gradients within 4.8e-6 (entries up to 6.8); the same on one device and on 2x2.


def inputs(seed: int = 0):
    """q, k, v, output cotangent (f32, N(0, 1)) and is_seq_start of packed documents."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BATCH, LENGTH, N_Q, N_KV, D_HEAD), np.float32)
    k, v = rng.standard_normal((2, BATCH, LENGTH, N_KV, D_HEAD), np.float32)
    cotangent = rng.standard_normal(q.shape, np.float32)
    _, starts = packed_batch(vocab=2, batch=BATCH, length=LENGTH, seed=seed)
    return q, k, v, cotangent, starts


Q, K, V, COTANGENT, STARTS = inputs()


@functools.cache
def attention_and_grads(impl: str, mode: str, shape: tuple[int, int]):
    """(output, (dq, dk, dv)) for the module's inputs."""
    return helpers.attention_and_grads(impl, mode, shape, (Q, K, V, COTANGENT, STARTS))


# ---------------------------------------------------------------------------------------------
# Values: splash == einsum


def test_inputs_pack_documents_across_the_block():
    starts_per_row = STARTS.sum(axis=1)
    assert starts_per_row.min() >= 10, "every row should pack many documents"


@pytest.mark.parametrize("mode", MASKS)
def test_splash_equals_einsum_on_one_device(mode):
    """No shard_map (1x1 mesh): the kernel runs directly, with its own VJP."""
    assert_attention_close(
        attention_and_grads("splash", mode, (1, 1)), attention_and_grads("einsum", mode, (1, 1))
    )


@pytest.mark.parametrize("mode", MASKS)
def test_splash_equals_einsum_inside_checked_shard_map(mode):
    """d=2 x t=2 with check_vma=True: the hosted kernel, on each device's blocks."""
    assert_attention_close(
        attention_and_grads("splash", mode, (2, 2)), attention_and_grads("einsum", mode, (1, 1))
    )


def test_masks_matter():
    """The document mask changes the output, so the tests above can tell the masks apart."""
    document = attention_and_grads("einsum", "document", (1, 1))[0]
    causal = attention_and_grads("einsum", "causal", (1, 1))[0]
    assert np.max(np.abs(document - causal)) > 0.1


def test_dense_mask_falls_back_to_einsum():
    """Generation's prefill passes a dense mask (padded prompts), which has no segment ids."""
    helpers.assert_a_dense_mask_falls_back_to_einsum("splash", Q, K, V, STARTS)


def test_inputs_that_vary_over_fewer_axes_get_summed_cotangents():
    """q split over t by query head (Q/t), k and v replicated over t: their per-device
    cotangents are partial, and only the sum over t (autodiff's transpose of the cast to
    varying that splash_attention makes) equals the single-device gradient."""
    _, ref_grads = attention_and_grads("einsum", "document", (1, 1))
    args = (Q, K, V, COTANGENT, STARTS)
    helpers.assert_fewer_axes_get_summed_cotangents(splash_attention, "splash", args, ref_grads)


# ---------------------------------------------------------------------------------------------
# In the model: loss and gradients, communication, kernel runs


@functools.cache
def model_loss_and_grads(impl: str, mode: str):
    cfg = tiny_model(attention_impl=impl, attention_mask=mode, **MODEL)
    mesh = mesh_of((2, 2))
    tokens, starts = packed_batch(cfg.vocab, MODEL_BATCH, LENGTH, seed=0)
    fn = jax.jit(jax.value_and_grad(lambda w, t, s: loss_fn(w, t, s, cfg, mesh)))
    loss, grads = fn(random_weights(cfg, mesh), tokens, starts)
    return np.asarray(loss), jax.tree.map(np.asarray, grads)


# f32, 2 layers, remat=saved, both masks: measured loss within 4.8e-7 (4.78), gradients within
# 2.7e-7 (entries up to 0.2).
MODEL_LOSS = dict(rtol=1e-6, atol=0)
MODEL_GRADS = dict(rtol=1e-5, atol=1e-6)


def assert_model_close(mode: str) -> None:
    loss, grads = model_loss_and_grads("splash", mode)
    ref_loss, ref_grads = model_loss_and_grads("einsum", mode)
    np.testing.assert_allclose(loss, ref_loss, **MODEL_LOSS)
    assert_trees_close(grads, ref_grads, **MODEL_GRADS)


def test_model_with_splash_equals_einsum():
    """loss_fn and its gradient on d=2 x t=2, check_vma on, packed documents."""
    assert_model_close("document")


@pytest.mark.slow
def test_model_with_splash_equals_einsum_causal():
    assert_model_close("causal")


@pytest.mark.slow
def test_hosting_adds_no_collective():
    """The unchecked region moves no data: the compiled loss-and-gradient holds exactly the
    collectives einsum attention's does (test_transformer.py audits those)."""
    mesh = mesh_of((2, 2))
    counts = {}
    for impl in ("einsum", "splash"):
        cfg = tiny_model(attention_impl=impl, **MODEL)
        counts[impl] = count_collectives(
            jax.jit(loss_and_grad(cfg, mesh)), *model_args(cfg, mesh, LENGTH)
        )
    assert counts["splash"] == counts["einsum"]


@pytest.mark.parametrize("remat, kernels", [("saved", 4), ("full", 5)])
def test_kernel_runs_per_layer(remat, kernels):
    """splash.py's cost note: forward 1; backward 3, the kernel's forward again (for its
    logsumexp), dq and dkv. 'saved' keeps the attention output, so its recomputation skips the
    kernel; 'full' runs the forward kernel once more. The scanned body appears once."""
    cfg = tiny_model(attention_impl="splash", remat=remat, **MODEL)
    mesh = mesh_of((2, 2))
    jaxpr = jax.make_jaxpr(loss_and_grad(cfg, mesh))(*model_args(cfg, mesh, LENGTH))
    assert pallas_calls(jaxpr.jaxpr) == kernels


# ---------------------------------------------------------------------------------------------
# Blocks and errors


def test_block_is_the_largest_of_512_256_128_dividing_the_length():
    got = {n: block_size(n) for n in (128, 256, 384, 512, 640, 1024, 1536, 8192)}
    assert got == {128: 128, 256: 256, 384: 128, 512: 512, 640: 128, 1024: 512, 1536: 512,
                   8192: 512}  # fmt: skip


def test_length_the_kernel_cannot_block_names_seq_len():
    message = seq_len_error("splash")
    assert "seq_len=100" in message and "multiple of 128" in message
    assert "attention_impl=einsum" in message  # the fix


def test_several_blocks_equal_einsum():
    """L = 640: blocks of 128, a 5 x 5 grid of them per head, documents crossing block edges."""
    rng = np.random.default_rng(3)
    length = 640
    q = rng.standard_normal((1, length, N_Q, N_KV, D_HEAD), np.float32)
    k, v = rng.standard_normal((2, 1, length, N_KV, D_HEAD), np.float32)
    _, starts = packed_batch(vocab=2, batch=1, length=length, seed=3)
    outs = {
        impl: np.asarray(jax.jit(attend_fn(impl, "document", (1, 1)))(q, k, v, starts))
        for impl in ("einsum", "splash")
    }
    np.testing.assert_allclose(outs["splash"], outs["einsum"], **F32)
