"""What the fused-attention kernel tests share (tests/model/test_splash.py, test_pallas_gpu.py):
attention of one implementation under typed_shard_map on a d x t mesh, its output and
gradients for given inputs, and the comparison against einsum attention."""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from model_weights import tiny_model

from seqshard.model import loss_fn, weight_structs
from seqshard.model.attention import attention, attention_mask
from seqshard.shardlib.shardtypes import bool_, f32, typed_shard_map
from seqshard.testing import fake_cpu_mesh

# f32 attention: a kernel accumulates its softmax blockwise (online max and sum) where einsum
# takes one softmax over all keys; each test file states what it measured within this.
F32 = dict(rtol=1e-5, atol=1e-5)


@functools.cache
def mesh_of(shape: tuple[int, int]) -> jax.sharding.Mesh:
    return fake_cpu_mesh(shape, ("d", "t"))


def attend_fn(impl: str, mode: str, shape: tuple[int, int]):
    """attention(q, k, v, mask of is_seq_start) under typed_shard_map on a d x t mesh (1x1:
    without shard_map)."""

    @functools.partial(typed_shard_map, mesh=mesh_of(shape))
    def attend(
        q: f32[b"B/d/e L@zigzag/c Q K/t D"],
        k: f32[b"B/d/e L@zigzag K/t D"],
        v: f32[b"B/d/e L@zigzag K/t Dv"],
        starts: bool_[b"B/d/e L"],
    ) -> f32[b"B/d/e L@zigzag/c Q K/t Dv"]:
        mask = attention_mask(starts, mode, impl)
        return attention(q, k, v, mask, impl, causal_only=mode == "causal")

    return attend


def attention_and_grads(impl: str, mode: str, shape: tuple[int, int], args):
    """(output, (dq, dk, dv)) as numpy for ``args`` = (q, k, v, cotangent, is_seq_start), the
    gradients those of <output, cotangent>."""
    q, k, v, cotangent, starts = args
    attend = attend_fn(impl, mode, shape)

    def f(q, k, v):
        out = attend(q, k, v, starts)
        return jnp.vdot(out, cotangent), out

    grads, out = jax.jit(jax.grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return np.asarray(out), tuple(np.asarray(g) for g in grads)


def assert_attention_close(got, want) -> None:
    """Output and dq, dk, dv within :data:`F32`, naming the one that differs."""
    (out, grads), (ref_out, ref_grads) = got, want
    np.testing.assert_allclose(out, ref_out, **F32, err_msg="output")
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, **F32, err_msg=f"d{name}")


def assert_a_dense_mask_falls_back_to_einsum(impl: str, q, k, v, starts) -> None:
    """Generation's prefill passes a dense mask (padded prompts), which has no segment ids:
    ``impl`` then computes exactly einsum attention."""
    dense = attention_mask(jnp.asarray(starts), "document")

    @functools.partial(typed_shard_map, mesh=mesh_of((1, 1)))
    def both(
        q: f32[b"B/d/e L@zigzag/c Q K/t D"],
        k: f32[b"B/d/e L@zigzag K/t D"],
        v: f32[b"B/d/e L@zigzag K/t D"],
    ) -> f32[b"2 B/d/e L@zigzag/c Q K/t D"]:
        return jnp.stack([attention(q, k, v, dense, i, False) for i in (impl, "einsum")])

    kernel_out, einsum_out = np.asarray(both(q, k, v))
    np.testing.assert_array_equal(kernel_out, einsum_out)


def assert_fewer_axes_get_summed_cotangents(kernel, impl: str, args, ref_grads) -> None:
    """q split over t by query head (Q/t), k and v replicated over t: their per-device
    cotangents are partial, and only the sum over t (autodiff's transpose of the cast to
    varying that ``kernel`` makes) equals the single-device gradient ``ref_grads``."""
    q, k, v, cotangent, starts = args
    segment_ids = attention_mask(jnp.asarray(starts), "document", impl)
    sharded = jax.shard_map(
        kernel,
        mesh=mesh_of((2, 2)),
        in_specs=(P("d", None, "t"), P("d"), P("d"), P("d")),
        out_specs=P("d", None, "t"),
        check_vma=True,
    )

    def f(q, k, v):
        return jnp.vdot(sharded(q, k, v, segment_ids), cotangent)

    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, **F32, err_msg=f"d{name}")


def pallas_calls(jaxpr) -> int:
    """Pallas kernels in a jaxpr, sub-jaxprs (scan, shard_map, custom_vjp, checkpoint) included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "pallas_call"
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    n += pallas_calls(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    n += pallas_calls(sub)
    return n


# The kernels in the model: the tiny model with 2 kv heads x 2 q heads per kv head (one of each
# per t shard of 2), batches of MODEL_BATCH rows.
MODEL_BATCH = 4
MODEL = dict(n_kv=2)


def loss_and_grad(cfg, mesh):
    return jax.value_and_grad(lambda w, t, s: loss_fn(w, t, s, cfg, mesh))


def model_args(cfg, mesh, length: int):
    """The abstract (weights, tokens, is_seq_start) of a batch of ``length``-token rows."""
    tokens = jax.ShapeDtypeStruct((MODEL_BATCH, length), jnp.int32)
    return weight_structs(cfg, mesh), tokens, jax.ShapeDtypeStruct(tokens.shape, jnp.bool_)


def seq_len_error(impl: str, length: int = 100) -> str:
    """The message of the error tracing the model with ``impl`` on rows of ``length`` tokens
    raises (a length the kernel cannot block)."""
    cfg = tiny_model(attention_impl=impl, **MODEL)
    mesh = mesh_of((2, 2))
    with pytest.raises(ValueError) as info:
        jax.eval_shape(loss_and_grad(cfg, mesh), *model_args(cfg, mesh, length))
    return str(info.value)
