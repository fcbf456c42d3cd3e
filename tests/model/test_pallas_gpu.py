"""Tests of seqshard/model/pallas_gpu.py: Pallas' GPU flash attention with segment ids, run in
interpret mode on CPU, against einsum attention, and hosted inside the model's checked
shard_map.

    values      pallas equals einsum attention, output and gradients w.r.t. q, k, v, for the
                document and causal masks: on one device (no shard_map) and inside a
                check_vma=True shard_map on a 2x2 mesh (the hosted path); grouped queries
                (Q = 2 q heads per kv head: dk, dv summed over them)
    blocks      the default blocks (64 forward, 32 backward at L = 64) and blocks of 32 and 16
                (a 2 x 2 forward grid per head, 4 x 4 backward), packed documents crossing
                their edges; MLA's head sizes (v's head smaller than q's)
    types       an input that varies over fewer mesh axes (k, v replicated over t) gets the
                sum of its per-device cotangents, as autodiff of einsum attention would give
    model       loss_fn and its gradient with attention_impl=pallas equal einsum's on d=2 x t=2
                (the hand-written backward: the kernel's VJP called directly), packed documents
    causality   perturbing token j changes no logit before j nor in another document (exactly:
                a masked key's weight is exactly 0 in the kernel too)
    costs       the kernel runs once forward, three times backward (its forward again, the
                backward's preprocessing, dq / dk / dv)
    context     with the row split over c = 2 (documents crossing the shards' zigzag chunks)
                the kernel is not used (it has no query offset): the dense mask goes to einsum
                (cudnn on GPU), and the model equals einsum's
    fallback    given a dense mask (generation's prompts) pallas is einsum attention
    errors      a sequence length the kernel cannot block names seq_len

Sizes are small: L = 64, head dim 8 (interpret mode takes any; on GPU heads are >= 16). The
file runs in about 20 s on 2 cores.
"""

from __future__ import annotations

import functools

import attention_helpers as helpers
import jax
import jax.extend
import numpy as np
import pytest
from attention_helpers import (
    MODEL,
    MODEL_BATCH,
    assert_attention_close,
    loss_and_grad,
    model_args,
    pallas_calls,
    seq_len_error,
)
from model_weights import assert_trees_close, packed_batch, random_weights, tiny_model

from seqshard.mesh import mesh_of_sizes
from seqshard.model import logits_fn, pallas_gpu
from seqshard.model.pallas_gpu import block_sizes, pallas_attention

BATCH, LENGTH, N_Q, N_KV, D_HEAD = 4, 64, 2, 2, 8
MASKS = ["document", "causal"]

# Within attention_helpers.F32 (1e-5): the kernel's online softmax is base 2. Measured, with
# q, k, v and the output's cotangent N(0, 1), both masks, one device and 2x2, small blocks,
# MLA's heads: outputs within 6.0e-7 (entries up to 4.1), gradients within 1.9e-6 (entries up
# to 6.2).


def inputs(seed: int = 0, length: int = LENGTH, d_v: int = D_HEAD):
    """q, k, v, output cotangent (f32, N(0, 1)) and is_seq_start of packed documents."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BATCH, length, N_Q, N_KV, D_HEAD), np.float32)
    k = rng.standard_normal((BATCH, length, N_KV, D_HEAD), np.float32)
    v = rng.standard_normal((BATCH, length, N_KV, d_v), np.float32)
    cotangent = rng.standard_normal(q.shape[:-1] + (d_v,), np.float32)
    _, starts = packed_batch(vocab=2, batch=BATCH, length=length, seed=seed)
    return q, k, v, cotangent, starts


Q, K, V, COTANGENT, STARTS = inputs()


def attention_and_grads(impl: str, mode: str, shape: tuple[int, int], args=None):
    """(output, (dq, dk, dv)) for ``args`` (the module's inputs by default)."""
    args = (Q, K, V, COTANGENT, STARTS) if args is None else args
    return helpers.attention_and_grads(impl, mode, shape, args)


@functools.cache
def einsum_attention_and_grads(mode: str):
    return attention_and_grads("einsum", mode, (1, 1))


# ---------------------------------------------------------------------------------------------
# Values: pallas == einsum


def test_inputs_pack_documents_across_the_blocks():
    """Many documents a row, and some cross the edges of 16-long blocks."""
    assert STARTS.sum(axis=1).min() >= 8, "every row should pack many documents"
    segments = np.cumsum(STARTS, axis=1)
    edges = np.arange(16, LENGTH, 16)
    assert (segments[:, edges - 1] == segments[:, edges]).any(), "a document crosses an edge"


@pytest.mark.parametrize("mode", MASKS)
def test_pallas_equals_einsum_on_one_device(mode):
    """No shard_map (1x1 mesh): the kernel runs directly, with its own VJP."""
    got = attention_and_grads("pallas", mode, (1, 1))
    assert_attention_close(got, einsum_attention_and_grads(mode))


@pytest.mark.parametrize("mode", MASKS)
def test_pallas_equals_einsum_inside_checked_shard_map(mode):
    """d=2 x t=2 with check_vma=True: the hosted kernel, on each device's blocks."""
    got = attention_and_grads("pallas", mode, (2, 2))
    assert_attention_close(got, einsum_attention_and_grads(mode))


def test_masks_matter():
    """The document mask changes the output, so the tests above can tell the masks apart."""
    document = einsum_attention_and_grads("document")[0]
    causal = einsum_attention_and_grads("causal")[0]
    assert np.max(np.abs(document - causal)) > 0.1


def test_small_blocks_equal_einsum(monkeypatch):
    """Blocks of 32 (forward) and 16 (backward): documents cross the edges of a 2 x 2 grid of
    forward blocks and a 4 x 4 one of backward blocks, per head."""
    small = pallas_gpu.flash.BlockSizes(
        block_q=32, block_k=32, block_q_dkv=16, block_kv_dkv=16, block_q_dq=16, block_kv_dq=16
    )
    monkeypatch.setattr(pallas_gpu, "BLOCKS", small)
    assert block_sizes(LENGTH) == small
    got = attention_and_grads("pallas", "document", (1, 1))
    assert_attention_close(got, einsum_attention_and_grads("document"))


def test_mla_head_sizes_equal_einsum():
    """v's head (MLA's v_head_dim, 4) smaller than q's and k's (8): v is padded, the output cut."""
    args = inputs(seed=1, d_v=4)
    got = attention_and_grads("pallas", "document", (1, 1), args)
    assert got[0].shape[-1] == 4 and got[1][2].shape[-1] == 4
    assert_attention_close(got, attention_and_grads("einsum", "document", (1, 1), args))


def test_inputs_that_vary_over_fewer_axes_get_summed_cotangents():
    """q split over t by query head (Q/t), k and v replicated over t: their per-device
    cotangents are partial, and only the sum over t (autodiff's transpose of the cast to
    varying that the hosting makes) equals the single-device gradient."""
    _, ref_grads = einsum_attention_and_grads("document")
    args = (Q, K, V, COTANGENT, STARTS)
    helpers.assert_fewer_axes_get_summed_cotangents(pallas_attention, "pallas", args, ref_grads)


def test_dense_mask_falls_back_to_einsum():
    """Generation's prefill passes a dense mask (padded prompts), which has no segment ids."""
    helpers.assert_a_dense_mask_falls_back_to_einsum("pallas", Q, K, V, STARTS)


# ---------------------------------------------------------------------------------------------
# In the model: loss and gradients, kernel runs, the split over c


# f32, 2 layers, remat=saved: test_splash.py's bounds; measured here, c = 1 and 2: the loss
# equal (4.77), gradients within 1.2e-7 (entries up to 0.24).
MODEL_LOSS = dict(rtol=1e-6, atol=0)
MODEL_GRADS = dict(rtol=1e-5, atol=1e-6)


def model_mesh(c: int):
    return mesh_of_sizes({"d": 2 // c, "c": c, "t": 2})


@functools.cache
def model_loss_and_grads(impl: str, c: int):
    """loss_fn and its gradient, document mask, on d x c x t = (2 / c) x c x 2."""
    cfg = tiny_model(attention_impl=impl, **MODEL)
    mesh = model_mesh(c)
    tokens, starts = packed_batch(cfg.vocab, MODEL_BATCH, LENGTH, seed=0)
    loss, grads = jax.jit(loss_and_grad(cfg, mesh))(random_weights(cfg, mesh), tokens, starts)
    return np.asarray(loss), jax.tree.map(np.asarray, grads)


def assert_model_close(c: int) -> None:
    loss, grads = model_loss_and_grads("pallas", c)
    ref_loss, ref_grads = model_loss_and_grads("einsum", c)
    np.testing.assert_allclose(loss, ref_loss, **MODEL_LOSS)
    assert_trees_close(grads, ref_grads, **MODEL_GRADS)


def test_model_with_pallas_equals_einsum():
    """loss_fn and its gradient on d=2 x t=2, check_vma on, packed documents."""
    assert_model_close(c=1)


def test_no_logit_sees_a_later_token_or_another_document():
    """One row of three documents, [0, 13), [13, 40), [40, 64) (the middle one across the
    edges of 16-long blocks at 16 and 32); each other row changes one token of the middle one."""
    cfg = tiny_model(attention_impl="pallas", **MODEL)
    mesh = model_mesh(c=1)
    start, end, changed = 13, 40, (13, 20, 39)
    base = np.random.default_rng(2).integers(0, cfg.vocab, LENGTH).astype(np.int32)
    tokens = np.tile(base, (MODEL_BATCH, 1))
    for row, j in enumerate(changed, start=1):
        tokens[row, j] = (base[j] + 1) % cfg.vocab
    starts = np.zeros(tokens.shape, bool)
    starts[:, [0, start, end]] = True
    fn = jax.jit(lambda w, t, s: logits_fn(w, t, s, cfg, mesh))
    logits = np.asarray(fn(random_weights(cfg, mesh), tokens, starts))
    for row, j in enumerate(changed, start=1):
        np.testing.assert_array_equal(logits[row, :j], logits[0, :j], err_msg=f"before {j}")
        np.testing.assert_array_equal(logits[row, end:], logits[0, end:], err_msg="next document")
        assert np.abs(logits[row, j:end] - logits[0, j:end]).max() > 1e-3  # the test can fail


def kernels_per_step(c: int, **changes) -> int:
    cfg = tiny_model(attention_impl="pallas", **MODEL, **changes)
    mesh = model_mesh(c)
    return pallas_calls(
        jax.make_jaxpr(loss_and_grad(cfg, mesh))(*model_args(cfg, mesh, LENGTH)).jaxpr
    )


@pytest.mark.parametrize("remat, kernels", [("saved", 4), ("full", 5)])
def test_kernel_runs_per_layer(remat, kernels):
    """pallas_gpu.py's cost note: forward 1; backward 3, the kernel's forward again (for its
    logsumexp), the preprocessing of its backward and the backward kernel. 'saved' keeps the
    attention output, so its recomputation skips the kernel; 'full' runs the forward kernel
    once more. The scanned body appears once."""
    assert kernels_per_step(c=1, remat=remat) == kernels


def test_rows_split_over_c_use_the_dense_mask_and_equal_einsum():
    """c = 2 (allgather): each device's queries are two zigzag chunks of 16 against all 64
    keys, which the kernel cannot take (no query offset). No kernel runs; the dense mask goes
    to einsum (cudnn on GPU), and the model equals einsum's, packed documents crossing the
    chunks' edges (1 in 5 tokens starts one)."""
    assert kernels_per_step(c=2) == 0
    assert_model_close(c=2)


# ---------------------------------------------------------------------------------------------
# Blocks and errors


def test_blocks_are_the_kernel_defaults_cut_to_divide_the_length():
    forward = {n: (block_sizes(n).block_q, block_sizes(n).block_k) for n in (16, 48, 96, 2048)}
    assert forward == {16: (16, 16), 48: (16, 16), 96: (32, 32), 2048: (128, 128)}
    backward = {n: block_sizes(n).block_kv_dkv for n in (16, 48, 96, 2048)}
    assert backward == {16: 16, 48: 16, 96: 32, 2048: 32}
    for n in (16, 48, 96, 2048):  # the backward kernel needs as many dq blocks as dkv blocks
        assert block_sizes(n).block_q_dq == block_sizes(n).block_kv_dkv


def test_length_the_kernel_cannot_block_names_seq_len():
    message = seq_len_error("pallas")
    assert "seq_len=100" in message and "multiple of 16" in message
    assert "attention_impl=cudnn" in message  # the fix
