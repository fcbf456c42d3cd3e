"""Tests of seqshard.train.muon (train.optimizer=muon): which weights Muon takes, the update on
one device against optax.contrib.muon, the sharded update against the single-device one on
d, e, t and p splits, and the momentum's layout.

Tolerances: the single-device update equals optax's to 1e-5 of each leaf's largest entry
(the same iteration, other summation orders: measured <= 2e-6); sharded equals single-device
to 1e-5 (the
matrices' rows and columns arrive permuted, so each matmul sums in another order, and the
iteration multiplies a rounding difference by up to a^5 ~ 500 along small singular values;
measured <= 3e-6 on random gradients)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from model_weights import packed_batch, random_weights, tiny_model
from run_helpers import FLAT, by_step, latest_state, run

from seqshard.batch import token_batch
from seqshard.config import ConfigError, TrainConfig, load_config
from seqshard.mesh import mesh_of_sizes
from seqshard.model import ModelConfig
from seqshard.model.config import MLAConfig, MoEConfig, MTPConfig
from seqshard.model.matrices import matrix_stacks
from seqshard.model.sharded import batch_terms_and_aux
from seqshard.model.weights import weight_structs
from seqshard.train.muon import qk_clipped
from seqshard.train.optimizer import decay_mask, lr_schedule, make_optimizer
from seqshard.train.state import train_state_structs

TRAIN = TrainConfig(
    steps=20, lr=1e-2, warmup_steps=2, weight_decay=0.1, grad_clip=0.0, optimizer="muon"
)
MOE = MoEConfig(n_experts=4, top_k=2, d_ff=32, n_shared=1, n_dense_layers=1)


def _gradients(cfg: ModelConfig, mesh=None, steps: int = 2, seed: int = 1):
    """``steps`` gradient trees of normal entries (numpy, or placed as the weights on ``mesh``)."""
    return [random_weights(cfg, mesh, seed=seed + i) for i in range(steps)]


def _run(opt, weights, grads):
    """The updates of ``len(grads)`` steps of ``opt`` from ``weights`` (applied between)."""
    update = jax.jit(opt.update)
    state, out = opt.init(weights), []
    for g in grads:
        u, state = update(g, state, weights)
        weights = optax.apply_updates(weights, u)
        out.append(jax.tree.map(np.asarray, u))
    return out, state


def _worst(a, b) -> dict[str, float]:
    """Per leaf: the largest difference over the leaf's largest entry."""
    out = {}
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
    ):
        if x.size:
            out[jax.tree_util.keystr(path)] = float(
                np.max(np.abs(x - y)) / max(np.max(np.abs(x)), 1e-30)
            )
    return out


def test_muon_takes_the_declared_matrices_and_nothing_else():
    """Muon: every projection (attention, FFN, routed and shared experts, latent attention,
    multi-token prediction); AdamW: embeddings, head, norm gains, router and its bias."""
    cfg = tiny_model(
        n_layers=3,
        n_q_per_kv=1,
        moe=MOE,
        mla=MLAConfig(
            q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8
        ),
        attention="mla",
        mtp=MTPConfig(depth=1),
    )
    stacks = matrix_stacks(cfg)
    paths = {
        jax.tree_util.keystr(p).lstrip(".")
        for p, _ in jax.tree_util.tree_leaves_with_path(weight_structs(cfg))
    }
    adamw = paths - set(stacks)
    assert {p.split(".")[-1] for p in adamw} <= {
        "embed", "unembed", "final_norm", "ln1", "ln2", "router", "router_bias",
        "q_a_norm", "kv_a_norm", "enorm", "hnorm", "head_norm",
    }  # fmt: skip
    names = {p.split(".")[-1] for p in stacks}
    assert names >= {"w_q_a", "w_q_b", "w_kv_a", "w_kv_b", "w_o", "w_gate", "w_up", "w_down"}
    assert names >= {"s_gate", "s_up", "s_down", "w_eh"}
    sizes = cfg.dim_sizes()
    # The experts' matrices: one per layer and expert, d_model -> d_expert (down: back).
    gate = stacks["moe_layers.w_gate"]
    assert gate.spec == "S/p/e In/d/c Out/t"
    assert gate.sizes(sizes) == (2 * 4, cfg.d_model, 32)
    assert stacks["moe_layers.w_down"].sizes(sizes) == (2 * 4, 32, cfg.d_model)


def test_dense_matrices_layouts():
    cfg = tiny_model()
    stacks, sizes = matrix_stacks(cfg), cfg.dim_sizes()
    heads = cfg.n_q_per_kv * cfg.n_kv * cfg.d_head
    assert stacks["layers.w_q"].spec == "S/p In/d/e/c Out/t"
    assert stacks["layers.w_q"].sizes(sizes) == (2, cfg.d_model, heads)
    assert stacks["layers.w_kv"].sizes(sizes) == (2 * 2, cfg.d_model, cfg.n_kv * cfg.d_head)
    assert stacks["layers.w_o"].spec == "S/p In/t Out/d/e/c"
    assert stacks["layers.w_o"].sizes(sizes) == (2, heads, cfg.d_model)
    assert set(stacks) == {
        f"layers.{w}" for w in ("w_q", "w_kv", "w_o", "w_gate", "w_up", "w_down")
    }


def _optax_muon(cfg: ModelConfig, train: TrainConfig):
    """optax.contrib.muon with the same settings and dimension numbers (from the declarations)."""
    stacks = matrix_stacks(cfg)

    def dims(path, _):
        s = stacks.get(jax.tree_util.keystr(path).lstrip("."))
        if s is None:
            return None
        return optax.contrib.MuonDimensionNumbers(s.inputs, s.outputs)

    muon = train.muon
    return optax.contrib.muon(
        lr_schedule(train),
        ns_coeffs=tuple(muon.ns_coefficients),
        ns_steps=muon.ns_steps,
        beta=muon.momentum,
        weight_decay=train.weight_decay,
        weight_decay_mask=decay_mask,
        nesterov=muon.nesterov,
        consistent_rms=muon.rms if muon.scale == "rms" else None,
        muon_weight_dimension_numbers=lambda p: jax.tree_util.tree_map_with_path(dims, p),
    )


@pytest.mark.parametrize(
    "muon",
    [
        {},
        pytest.param(
            {"nesterov": False, "scale": "width", "momentum": 0.9, "ns_steps": 4},
            marks=pytest.mark.slow,
        ),
    ],
)
def test_one_device_update_equals_optax_contrib_muon(muon):
    """The matrices' updates are optax.contrib.muon's; the other weights' are the AdamW of
    train.optimizer=adamw (optax's muon gives them NAdam with nesterov, and decays them all)."""
    cfg = tiny_model(moe=MOE, n_layers=2)
    train = dataclasses.replace(TRAIN, muon=dataclasses.replace(TRAIN.muon, **muon))
    mesh = mesh_of_sizes({})
    weights, grads = random_weights(cfg), _gradients(cfg, steps=3)
    ours, _ = _run(make_optimizer(train, cfg, mesh), weights, grads)
    theirs, _ = _run(_optax_muon(cfg, train), weights, grads)
    adamw, _ = _run(make_optimizer(dataclasses.replace(train, optimizer="adamw")), weights, grads)
    matrices = {f".{p}" for p in matrix_stacks(cfg)}
    for step in range(3):
        for path, worst in _worst(theirs[step], ours[step]).items():
            if path in matrices:
                assert worst <= 1e-5, (step, path, worst)
        for path, worst in _worst(adamw[step], ours[step]).items():
            if path not in matrices:
                assert worst == 0, (step, path, worst)


MLA = MLAConfig(
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8
)
MESHES = {
    "d8": ({"d": 8}, {}),
    "d2t4": ({"d": 2, "t": 4}, {}),
    "e2d2t2 experts": ({"e": 2, "d": 2, "t": 2}, {"moe": MOE, "n_layers": 3}),
    "p2d2t2": ({"p": 2, "d": 2, "t": 2}, {"n_layers": 4}),
    "d4t2 latent attention": (
        {"d": 4, "t": 2},
        {"attention": "mla", "mla": MLA, "n_q_per_kv": 1, "mtp": MTPConfig(depth=1)},
    ),
}
DEFAULT_MESHES = ("d2t4",)


@pytest.mark.parametrize(
    "name",
    [n if n in DEFAULT_MESHES else pytest.param(n, marks=pytest.mark.slow) for n in MESHES],
)
def test_sharded_update_equals_the_single_device_one(name):
    """Two steps (the second with momentum) on a mesh against the same on one device."""
    sizes, changes = MESHES[name]
    cfg = tiny_model(**changes)
    weights, grads = random_weights(cfg), _gradients(cfg)
    single, _ = _run(make_optimizer(TRAIN, cfg, mesh_of_sizes({})), weights, grads)
    mesh = mesh_of_sizes(sizes)
    placed = random_weights(cfg, mesh)
    sharded, state = _run(make_optimizer(TRAIN, cfg, mesh), placed, _gradients(cfg, mesh))
    for step in range(2):
        for path, worst in _worst(single[step], sharded[step]).items():
            assert worst <= 1e-5, (name, step, path, worst)
    # The momentum rests as its weight does.
    structs = weight_structs(cfg, mesh)
    want = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_leaves_with_path(structs)}
    mu = state.inner_states["muon"].inner_state[0].mu
    for path, m in jax.tree_util.tree_leaves_with_path(mu):
        assert m.sharding.is_equivalent_to(want[jax.tree_util.keystr(path)].sharding, m.ndim)


def test_the_state_structs_carry_each_momentum_in_its_weight_layout():
    cfg = tiny_model()
    mesh = mesh_of_sizes({"d": 4, "t": 2})
    opt = make_optimizer(TRAIN, cfg, mesh)
    state = train_state_structs(cfg, mesh, opt).opt_state
    mu = state.inner_states["muon"].inner_state[0].mu
    assert isinstance(mu.embed, optax.MaskedNode)  # AdamW's
    assert mu.layers.w_q.sharding.spec == weight_structs(cfg, mesh).layers.w_q.sharding.spec
    adam = state.inner_states["adamw"].inner_state[0]
    assert isinstance(adam.mu.layers.w_q, optax.MaskedNode)  # Muon's
    assert adam.nu.embed.sharding.spec == weight_structs(cfg, mesh).embed.sharding.spec


def test_make_optimizer_needs_the_model_and_mesh_for_muon():
    with pytest.raises(TypeError, match="needs the model config and the mesh"):
        make_optimizer(TRAIN)


def test_a_zero_gradient_leaves_the_matrices_where_decay_puts_them():
    """A zero momentum stays zero through the iteration (0 / (0 + eps)): the update is the
    decay alone, and finite."""
    cfg = tiny_model()
    mesh = mesh_of_sizes({"d": 2, "t": 2})
    weights = random_weights(cfg, mesh)
    zeros = jax.tree.map(jnp.zeros_like, weights)
    train = dataclasses.replace(TRAIN, warmup_steps=0)
    (update,), _ = _run(make_optimizer(train, cfg, mesh), weights, [zeros])
    lr = float(lr_schedule(train)(0))
    for w in ("w_q", "w_kv", "w_o", "w_gate", "w_up", "w_down"):
        np.testing.assert_allclose(
            getattr(update.layers, w), -lr * 0.1 * np.asarray(getattr(weights.layers, w)), rtol=1e-6
        )


@pytest.mark.slow
def test_a_muon_run_resumes_bit_for_bit_and_restores_onto_another_mesh(tmp_path, tiny_overrides):
    """Momentum checkpointed with the weights: 3 steps then 3 more equal 6 straight, bit for
    bit (every loss, every array of the state); the checkpoint restored onto p2 x d4 holds the
    same momentum, in that mesh's layout."""
    muon = {"optimizer": "muon", **FLAT}
    run(tiny_overrides(tmp_path, "straight", **muon))
    run(tiny_overrides(tmp_path, "resumed", steps=3, **muon))
    run(tiny_overrides(tmp_path, "resumed", **muon))
    straight, resumed = by_step(tmp_path / "straight"), by_step(tmp_path / "resumed")
    assert sorted(resumed) == list(range(1, 7))
    for step in range(1, 7):
        for key in ("loss", "grad_norm", "val_loss"):
            assert resumed[step].get(key) == straight[step].get(key), (step, key)
    cfg = load_config(None, tiny_overrides(tmp_path, "straight", **muon))
    a, b = latest_state(tmp_path / "straight", cfg), latest_state(tmp_path / "resumed", cfg)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    other = load_config(
        None, [*tiny_overrides(tmp_path, "straight", **muon), "mesh.p=2", "mesh.d=4", "mesh.t=1"]
    )
    c = latest_state(tmp_path / "straight", other)
    mu_a = a.opt_state[1].inner_states["muon"].inner_state[0].mu
    mu_c = c.opt_state[1].inner_states["muon"].inner_state[0].mu
    assert np.abs(np.asarray(mu_a.layers.w_up)).max() > 0  # trained: not the initial zeros
    for x, y in zip(jax.tree.leaves(mu_a), jax.tree.leaves(mu_c), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert mu_c.layers.w_q.sharding.spec[0] == "p"


def _max_logits(cfg: ModelConfig, sizes: dict, weights, batch) -> np.ndarray:
    """The layers' heads' largest logits [layers, Q, K] of ``batch`` on a mesh of ``sizes``."""
    mesh = mesh_of_sizes(sizes)
    placed = jax.device_put(weights, jax.tree.map(lambda s: s.sharding, weight_structs(cfg, mesh)))
    _, aux = jax.jit(lambda w, b: batch_terms_and_aux(w, b, cfg, mesh))(placed, batch)
    return np.asarray(aux["layers"]["attention"]["max_logit"])


@pytest.fixture(scope="module")
def logits_case():
    """The tiny model with model.max_logit, its q weights scaled up 3x (logits ~9x), a batch."""
    cfg = tiny_model(max_logit=True)
    weights = random_weights(cfg)
    layers = dataclasses.replace(weights.layers, w_q=3 * weights.layers.w_q)
    weights = dataclasses.replace(weights, layers=layers)
    tokens, starts = packed_batch(cfg.vocab, 8, 32)
    return cfg, weights, token_batch(tokens, starts)


def test_max_logits_are_the_same_on_any_mesh(logits_case):
    """model.max_logit on d2t4 and c2d2t2 (keys gathered over c) equals one device's, 1e-5."""
    cfg, weights, batch = logits_case
    one = _max_logits(cfg, {}, weights, batch)
    assert one.shape == (cfg.n_layers, cfg.n_q_per_kv, cfg.n_kv) and (one > 0).all()
    for sizes in ({"d": 2, "t": 4}, {"c": 2, "d": 2, "t": 2}):
        np.testing.assert_allclose(_max_logits(cfg, sizes, weights, batch), one, rtol=1e-5)


def test_qk_clip_brings_each_head_over_the_threshold_back_to_it(logits_case):
    """MuonClip's guarantee: after the clip each head's largest logit (on the same inputs) is
    min(its old one, tau), to 1e-4; grouped heads sharing a key head included."""
    cfg, weights, batch = logits_case
    before = _max_logits(cfg, {"d": 2, "t": 2}, weights, batch)
    tau = float(np.median(before))
    full = load_config(
        None,
        [*(f"model.{k}={v}" for k, v in dataclasses.asdict(cfg).items() if not isinstance(v, dict)),
         "train.optimizer=muon", f"train.muon.qk_clip={tau}", "data.vocab_size=64"],
    )  # fmt: skip
    aux = {"layers": {"attention": {"max_logit": jnp.asarray(before)}}}
    clipped, n = qk_clipped(full, jax.tree.map(jnp.asarray, weights), aux)
    assert int(n) == int((before > tau).sum()) > 0 and (before[0] > tau).any()
    after = _max_logits(cfg, {"d": 2, "t": 2}, clipped, batch)
    # The first layer's inputs are the same; the later layers' are not (the first's output
    # changed), so their logits are only what the clip aimed at, not the same batch's.
    np.testing.assert_allclose(after[0], np.minimum(before[0], tau), rtol=1e-4)
    # v's half of w_kv, and every other weight, unchanged.
    np.testing.assert_array_equal(clipped.layers.w_kv[:, 1], weights.layers.w_kv[:, 1])
    np.testing.assert_array_equal(clipped.layers.w_o, weights.layers.w_o)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.muon.qk_clip=100"], "set train.optimizer=muon"),
        (["train.optimizer=muon", "train.muon.qk_clip=100"], r"model.max_logit=true, got False"),
        (
            [
                "train.optimizer=muon",
                "train.muon.qk_clip=100",
                "model.max_logit=true",
                "model.qk_norm=true",
            ],
            "model.qk_norm=false, got True",
        ),
        (["model.max_logit=true", "model.attention_impl=cudnn"], "only einsum attention forms"),
        (["train.optimizer=muon", "train.muon.momentum=1.0"], "momentum must be in"),
        (["train.optimizer=muon", "train.muon.ns_steps=0"], "ns_steps >= 1"),
    ],
)
def test_bad_muon_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        load_config("configs/tiny-cpu.yaml", overrides)
