"""Tests for seqshard/shardlib/remat.py: what each policy keeps, and that it changes memory, not values.

    unit     on a small function: 'saved' recomputes exactly what save_for_backward does not
             mark, 'full' recomputes everything, 'none' nothing (counted in the grad's jaxpr)
    policy   the objects behind model.remat: the registry, the checkpoint policy each hands to
             jax.checkpoint (its saved residuals), and which layer parts each one recomputes
             and keeps in the FLOP and memory accounting (the bytes kept against the
             residuals jax.vjp of the model keeps)
    model    remat 'saved', 'full' and 'none' give the same loss and gradients, and the
             compiled value_and_grad's temporary memory orders full <= saved < none
             (>= 2 layers, so the scan stays rolled and keeps one layer's residuals per layer)

The collectives each policy adds (the re-gathers of 'saved' and 'full') are audited in
tests/model/test_transformer.py (COMM TABLE).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
import re
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from model_weights import packed_batch, random_weights, tiny_model

from seqshard.model import ModelConfig, loss_fn
from seqshard.model.cost import MatmulFlops, layer_bytes, recomputes, saved_bytes
from seqshard.shardlib.remat import (
    SAVED,
    NoRemat,
    RematName,
    RematPolicy,
    SavedRemat,
    explicit_activation_checkpointing,
    remat_policy,
    save_for_backward,
)
from seqshard.testing import fake_cpu_mesh

POLICIES = ["saved", "full", "none"]

# ---------------------------------------------------------------------------------------------
# Unit: which values the backward pass recomputes


def body(x):
    a = save_for_backward(jnp.log1p(x))  # kept under 'saved'
    b = jnp.expm1(a)  # not marked: recomputed under 'saved' (the backward of b * b needs b)
    return jnp.sum(b * b)


def count_in_grad_jaxpr(fn, primitive: str) -> int:
    """How many times ``primitive`` is evaluated in the jaxpr of ``grad(fn)`` (forward and
    recomputation; neither log1p's nor expm1's derivative evaluates log1p or expm1)."""
    return str(jax.make_jaxpr(jax.grad(fn))(jnp.ones(3))).count(f"= {primitive} ")


@pytest.mark.parametrize(
    "policy, log1p, expm1",
    [
        ("none", 1, 1),  # everything kept from the forward pass
        ("saved", 1, 2),  # the marked log1p kept, the unmarked expm1 recomputed
        ("full", 2, 2),  # only the input kept: both recomputed
    ],
)
def test_policy_recomputes_what_it_does_not_keep(policy, log1p, expm1):
    fn = explicit_activation_checkpointing(body, policy)
    assert count_in_grad_jaxpr(fn, "log1p") == log1p
    assert count_in_grad_jaxpr(fn, "expm1") == expm1
    np.testing.assert_allclose(jax.grad(fn)(jnp.ones(3)), jax.grad(body)(jnp.ones(3)), rtol=1e-6)


def test_save_for_backward_names_the_value():
    jaxpr = str(jax.make_jaxpr(lambda x: save_for_backward(x * 2))(jnp.ones(3)))
    assert f"name={SAVED}" in jaxpr


def test_none_applies_no_checkpointing():
    assert explicit_activation_checkpointing(body, "none") is body
    assert explicit_activation_checkpointing(body, NoRemat()) is body


def test_unknown_policy_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match=r"'saved', 'full' or 'none', got 'everything'"):
        explicit_activation_checkpointing(body, "everything")
    with pytest.raises(ValueError, match=r"'saved', 'full' or 'none', got 'Saved'"):
        remat_policy("Saved")
    with pytest.raises(TypeError, match=r"a name \('saved', 'full' or 'none'\).*got int 3"):
        remat_policy(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"policy object such as SavedRemat\(\), got type"):
        remat_policy(SavedRemat)  # type: ignore[arg-type]  (the class, not an instance)


# ---------------------------------------------------------------------------------------------
# Policy objects: one per model.remat value


def test_every_config_value_has_its_policy_and_objects_pass_through():
    """Every value the config key accepts names a policy of that name (a value added to
    RematName without a policy fails here), and a policy object passes through unchanged."""
    for name in typing.get_args(RematName):
        policy = remat_policy(name)
        assert policy.name == name and isinstance(policy, RematPolicy)
        assert remat_policy(policy) is policy


def saved_residuals(fn) -> list[str]:
    """What the backward pass of ``fn`` keeps (``jax.ad_checkpoint.print_saved_residuals``):
    one line per residual, without its source location."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, jnp.ones(3))
    lines = out.getvalue().splitlines()
    return [re.sub(r" from \S+:\d+:\d+ \(\w+\)$", "", line) for line in lines]


@pytest.mark.parametrize(
    "name, kept",
    [
        ("saved", ["f32[3] from the argument x", f"f32[3] named '{SAVED}'"]),
        ("full", ["f32[3] from the argument x"]),
    ],
)
def test_checkpoint_policy_is_what_the_wrapper_uses(name, kept):
    """The object's checkpoint_policy given to jax.checkpoint keeps what the wrapper keeps,
    whether the wrapper is given the name or the object."""
    policy = remat_policy(name)
    assert saved_residuals(jax.checkpoint(body, policy=policy.checkpoint_policy)) == kept
    assert saved_residuals(explicit_activation_checkpointing(body, name)) == kept
    assert saved_residuals(explicit_activation_checkpointing(body, policy)) == kept


def test_no_remat_keeps_every_residual_autodiff_needs():
    """No checkpoint: not the input, but log1p's 1 + x, expm1's output and b (measured)."""
    assert NoRemat().checkpoint_policy is None
    kept = saved_residuals(explicit_activation_checkpointing(body, "none"))
    assert len(kept) == 3 and "f32[3] from the argument x" not in kept, kept


# Forward FLOPs per token whose digits name the part: a sum shows which parts it took.
PARTS = MatmulFlops(
    qkv=1, attn_scores=10, attn_values=100, out_proj=1_000, ffn=3 * 10_000, lm_head=10**6,
    n_layers=7,
)  # fmt: skip


@pytest.mark.parametrize(
    "name, recomputed",
    [
        ("none", 0),
        ("saved", 10),  # q . k^T, for the probabilities
        ("full", 1 + 10 + 100 + 1_000 + 2 * 10_000),  # the layer but the down projection
    ],
)
def test_recompute_flops_per_layer(name, recomputed):
    """The matmuls each policy re-runs, as the blocks declare them (recomputed_by). What the
    model's gradient really re-runs, counted in its jaxpr, is checked against this in
    tests/model/test_cost.py (test_matmul_rows_are_the_dot_generals_jax_traces)."""
    assert PARTS.recomputed(lambda op: recomputes(name, op)) == recomputed


MARKED = {"q", "k", "v", "attn", "h", "gate", "up"}  # save_for_backward in the model
GATHERED_WEIGHTS = {"ln1", "w_q", "w_kv", "w_o", "ln2", "w_gate", "w_up", "w_down"}


@pytest.mark.parametrize(
    "name, kept",
    [
        ("full", {"x"}),
        ("saved", {"x"} | MARKED),
        # Everything the hand-written backward reads (c = 1, no ring, no model.qk_norm): the
        # marked values, the gathered weights, both blocks' gathered and normed inputs, the
        # probabilities and silu(gate) * up; not the down projection nor the layer output.
        ("none", {"x"} | MARKED | GATHERED_WEIGHTS | {"gx", "nx", "gh", "nh", "probs", "y"}),
    ],
)
def test_saved_bytes_take_the_arrays_the_policy_keeps(name, kept):
    """Each array's bytes a distinct power of two, so the sum names the arrays kept."""
    cfg = dataclasses.replace(CFG, remat=name, attention_impl="einsum")
    names = list(layer_bytes(cfg, d=1, t=1, batch=2, seq_len=8))
    layer = {n: 2**i for i, n in enumerate(names)}
    total = saved_bytes(cfg, layer)
    assert {n for i, n in enumerate(names) if total >> i & 1} == kept
    assert total == sum(layer[n] for n in kept)


def layer_residual_bytes(cfg: ModelConfig, batch: int, length: int) -> int:
    """Bytes per layer of what ``jax.vjp`` of the loss keeps for its backward pass, on one
    device: the residuals the layer scan stacks (leading dimension ``cfg.n_layers``), less
    those that are the weights themselves (inputs, which the backward reads in any case)."""
    mesh = fake_cpu_mesh((1, 1), ("d", "t"))
    tokens, starts = packed_batch(cfg.vocab, batch, length)

    def residuals(w):
        return jax.tree.leaves(jax.vjp(lambda w: loss_fn(w, tokens, starts, cfg, mesh), w)[1])

    jaxpr = jax.make_jaxpr(residuals)(random_weights(cfg, mesh)).jaxpr
    inputs = {id(v) for v in jaxpr.invars}
    kept = [v.aval for v in jaxpr.outvars if id(v) not in inputs]
    return sum(
        math.prod(a.shape[1:]) * a.dtype.itemsize
        for a in kept
        if a.ndim and a.shape[0] == cfg.n_layers
    )


# f32, B 2, L 16, M 40, Q 2 x K 2 heads of D 8, F 72 (no size 3, the scan's length): x, h and
# the norms' gathered and normed inputs 2*16*40 * 4 B = 5120 each; q and attn 2*16*2*2*8 * 4 =
# 4096; k and v 2*16*2*8 * 4 = 2048; gate, up, y 2*16*72 * 4 = 9216; probs 2*2*2*16*16 * 4 =
# 8192. The gathered weights, 50_240 B (w_q, w_kv, w_o 2*2*40*8 * 4 = 5120 each; w_gate, w_up,
# w_down 40*72 * 4 = 11_520 each; ln1, ln2 40 * 4 = 160 each), are the weights themselves on
# one device: in layer_bytes, not among the residuals measured.
RESIDUALS = {
    "full": 5120,  # x
    "saved": 2 * 5120 + 2 * 4096 + 2 * 2048 + 2 * 9216,  # x, h; q, attn; k, v; gate, up: 40_960
    "none": 40_960 + 4 * 5120 + 8192 + 9216,  # and gx, nx, gh, nh; probs; y: 78_848
}


@pytest.mark.parametrize(
    "backward, name",
    [
        ("autodiff", "saved"),  # jax.checkpoint with save_only_these_names
        ("autodiff", "full"),  # jax.checkpoint with nothing_saveable
        ("explicit", "saved"),  # the hand-written backward's custom VJP
        ("explicit", "full"),
        ("explicit", "none"),  # (autodiff's 'none' keeps more: not what cost estimates)
    ],
)
def test_saved_bytes_are_what_the_backward_keeps(backward, name):
    """The residuals jax.vjp of the loss keeps per layer, measured in its jaxpr: the bytes
    counted by hand above, and what cost.saved_bytes says the policy keeps."""
    cfg = tiny_model(n_layers=3, n_kv=2, d_model=40, d_ff=72, vocab=80, remat=name,
                     backward=backward)  # fmt: skip
    measured = layer_residual_bytes(cfg, 2, 16)
    assert measured == RESIDUALS[name]
    weights = 50_240 if name == "none" else 0
    assert saved_bytes(cfg, layer_bytes(cfg, d=1, t=1, batch=2, seq_len=16)) == measured + weights


def test_model_config_rejects_an_unknown_policy():
    with pytest.raises(ValueError, match=r"model\.remat must be one of .*got 'some'"):
        ModelConfig(remat="some")


# ---------------------------------------------------------------------------------------------
# The model under each policy: equal values, different memory

CFG = tiny_model(n_layers=3, n_kv=4)
MESH_SHAPE = (4, 2)
BATCH, LENGTH = 8, 32


@functools.cache
def mesh():
    return fake_cpu_mesh(MESH_SHAPE, ("d", "t"))


@functools.cache
def batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab, (BATCH, LENGTH)).astype(np.int32)
    is_seq_start = rng.random((BATCH, LENGTH)) < 0.1
    is_seq_start[:, 0] = True
    return tokens, is_seq_start


@functools.cache
def weights():
    return random_weights(CFG, mesh())


@functools.cache
def compiled(policy: str):
    """The compiled value_and_grad of loss_fn under ``policy``: run it, and read its memory."""
    cfg = dataclasses.replace(CFG, remat=policy)
    m = mesh()
    w = weights()
    fn = jax.jit(jax.value_and_grad(lambda w, tok, start: loss_fn(w, tok, start, cfg, m)))
    executable = fn.lower(w, *batch()).compile()
    return executable, w


@functools.cache
def outputs(policy: str):
    executable, weights = compiled(policy)
    return jax.tree.map(np.asarray, executable(weights, *batch()))


@pytest.mark.parametrize("policy", ["saved", "full"])
def test_remat_gives_the_values_of_no_remat(policy):
    """Recomputation runs the same f32 operations again; measured: equal losses, gradients within 7.5e-9."""
    loss, grads = outputs(policy)
    ref_loss, ref_grads = outputs("none")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for (path, r), g in zip(
        jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads), strict=True
    ):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def temp_bytes(policy: str) -> int:
    return compiled(policy)[0].memory_analysis().temp_size_in_bytes


def test_remat_orders_temporary_memory():
    """Measured on mesh 4x2, 3 layers, B=8, L=32 (XLA CPU): full 269 kB, saved 346 kB,
    none 853 kB. 'none' keeps every intermediate of every layer (gathered weights included);
    'saved' keeps the marked activations per layer; 'full' only each layer's input."""
    mem = {p: temp_bytes(p) for p in POLICIES}
    assert mem["saved"] < mem["none"], mem
    assert mem["full"] <= mem["saved"], mem
