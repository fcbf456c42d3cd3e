"""Tests of seqshard.train.state: the train state's layout, derived from the weight types."""

from __future__ import annotations

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
from model_weights import tiny_model

from seqshard.config import TrainConfig
from seqshard.model.weights import weight_structs, weights_type
from seqshard.shardlib.shardtypes import partition_specs
from seqshard.testing import fake_cpu_mesh
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import init_train_state, shardings_of, train_state_structs

CFG = tiny_model(n_kv=4)


def test_optimizer_moments_take_their_weights_layouts_and_scalars_are_replicated():
    mesh = fake_cpu_mesh((4, 2), ("d", "t"))
    opt = make_optimizer(TrainConfig())
    structs = train_state_structs(CFG, mesh, opt)
    specs = partition_specs(weights_type(CFG))
    assert jax.tree.map(lambda s: s.sharding.spec, structs.weights) == specs
    for moment in ("mu", "nu"):
        got = optax.tree_utils.tree_get(structs.opt_state, moment)
        assert jax.tree.map(lambda s: s.sharding.spec, got) == specs, moment
    scalars = [s for s in jax.tree.leaves(structs) if s.shape == ()]
    assert structs.step in scalars and len(scalars) >= 2  # the step and Adam's count
    assert all(s.sharding.spec == P() for s in scalars)


def test_init_train_state_is_made_in_place_and_equals_its_structs():
    mesh = fake_cpu_mesh((2, 4), ("d", "t"))
    opt = make_optimizer(TrainConfig())
    state = init_train_state(CFG, mesh, opt, jax.random.key(0))
    structs = train_state_structs(CFG, mesh, opt)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == jax.tree.map(
        lambda s: (s.shape, s.dtype), structs
    )
    assert jax.tree.map(lambda a: a.sharding, state) == shardings_of(structs)
    assert int(state.step) == 0
    np.testing.assert_array_equal(optax.tree_utils.tree_get(state.opt_state, "mu").embed, 0.0)
    assert weight_structs(CFG, mesh).embed.sharding == state.weights.embed.sharding
