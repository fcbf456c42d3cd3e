"""Tests of seqshard.model.generate: the KV-cache decoder against the no-cache reference."""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from model_weights import tiny_model

from seqshard.mesh import mesh_of_sizes
from seqshard.model import init_weights, reference_logits_fn
from seqshard.model.generate import (
    DecodeSpec,
    Sampling,
    StopMatcher,
    _decoder,
    decode_mesh,
    generate,
)
from seqshard.testing import fake_cpu_mesh

# The module, not the function seqshard.model re-exports under the same name.
generate_module = importlib.import_module("seqshard.model.generate")

CFG = tiny_model(n_kv=2)
# Weights are made on one mesh (as a training run would leave them) and generated on others.
TRAIN_MESH = (4, 2)


def mesh(shape):
    return fake_cpu_mesh(shape, ("d", "t"))


@pytest.fixture(scope="module")
def weights():
    return init_weights(CFG, mesh(TRAIN_MESH), jax.random.key(0))


@pytest.fixture(scope="module")
def host_weights(weights):
    return jax.device_get(weights)


def prompts(batch, length, seed=0, vocab=CFG.vocab):
    return np.random.default_rng(seed).integers(0, vocab, (batch, length), dtype=np.int32)


_reference = jax.jit(reference_logits_fn, static_argnums=3)
WIDTH = 16  # every reference call is padded to this length at the end: one compilation


def reference_logits(host_weights, seq, cfg=CFG):
    """f32[len(seq), vocab]: the no-cache reference logits of one document.

    Padding after the document changes nothing before it (the model is causal).
    """
    tokens = np.zeros((1, WIDTH), np.int32)
    tokens[0, : len(seq)] = seq
    starts = np.zeros((1, WIDTH), bool)
    starts[:, 0] = True
    return np.asarray(_reference(host_weights, tokens, starts, cfg))[0, : len(seq)]


def test_decode_mesh_fills_t_then_divides_the_batch():
    # n_kv = 2 caps t at 2; d is the largest divisor of the batch that fits the rest.
    assert dict(decode_mesh(1, CFG).shape) == {"p": 1, "d": 1, "e": 1, "c": 1, "t": 2}
    assert dict(decode_mesh(4, CFG).shape) == {"p": 1, "d": 4, "e": 1, "c": 1, "t": 2}
    assert dict(decode_mesh(8, CFG).shape) == {"p": 1, "d": 4, "e": 1, "c": 1, "t": 2}
    # d = 3 does not divide d_model = 32 (norm gains are d_model/t/d): d falls back to 1.
    assert dict(decode_mesh(3, CFG).shape) == {"p": 1, "d": 1, "e": 1, "c": 1, "t": 2}
    assert dict(decode_mesh(4, CFG, max_d=1).shape) == {"p": 1, "d": 1, "e": 1, "c": 1, "t": 2}
    assert dict(decode_mesh(4, CFG, jax.devices()[:1]).shape) == {
        "p": 1,
        "d": 1,
        "e": 1,
        "c": 1,
        "t": 1,
    }


@pytest.mark.parametrize(
    "batch, shape",
    [
        (1, (1, 1)),
        pytest.param(1, (1, 2), marks=pytest.mark.slow),
        pytest.param(4, (1, 1), marks=pytest.mark.slow),
        (4, (2, 2)),
        pytest.param(4, (1, 2), marks=pytest.mark.slow),
    ],
    ids=lambda x: str(x),
)
def test_greedy_equals_step_by_step_reference_argmax(weights, host_weights, batch, shape):
    prompt, new = prompts(batch, 5, seed=batch), 5
    out = np.asarray(generate(weights, prompt, CFG, mesh(shape), Sampling(new, temperature=0.0)))
    assert out.shape == (batch, 5 + new) and out.dtype == np.int32
    np.testing.assert_array_equal(out[:, :5], prompt)
    for b in range(batch):
        seq = list(prompt[b])
        for _ in range(new):  # no cache: the whole growing sequence each step
            seq.append(int(np.argmax(reference_logits(host_weights, seq)[-1])))
        np.testing.assert_array_equal(out[b], seq, err_msg=f"row {b} on mesh {shape}")


def with_logits(weights, prompt, new: int, temperature: float, seed: int, top_k=None, **kw):
    """(tokens, each new token's logits) as numpy, generated on a 2x2 mesh."""
    key = jax.random.key(seed)
    sampling = Sampling(new, temperature, top_k, key=key, return_logits=True)
    out, logits = generate(weights, prompt, CFG, mesh((2, 2)), sampling, **kw)
    return np.asarray(out), np.asarray(logits)


def test_cached_logits_match_reference_with_left_padding(weights, host_weights):
    lengths = [5, 2, 4, 1]
    prompt = prompts(4, 5, seed=1)
    for b, n in enumerate(lengths):
        prompt[b, : 5 - n] = -1
    new = 6
    # sampled (temperature 1), so the cache sees tokens that are not the argmax
    out, logits = with_logits(weights, prompt, new, 1.0, 3, prompt_lengths=lengths)
    assert logits.shape == (4, new, CFG.vocab)
    assert ((out[:, 5:] >= 0) & (out[:, 5:] < CFG.vocab)).all()
    for b, n in enumerate(lengths):
        seq = out[b, 5 - n :]  # the row's document without its padding
        ref = reference_logits(host_weights, seq)[n - 1 : n - 1 + new]
        np.testing.assert_allclose(logits[b], ref, rtol=1e-5, atol=1e-5, err_msg=f"row {b}")


def test_left_padded_rows_generate_what_they_generate_alone(weights):
    lengths = [3, 6]
    prompt = prompts(2, 6, seed=2)
    greedy = Sampling(max_new_tokens=5, temperature=0.0)
    out = np.asarray(generate(weights, prompt, CFG, mesh((2, 2)), greedy, prompt_lengths=lengths))
    for b, n in enumerate(lengths):
        alone = generate(weights, prompt[b : b + 1, 6 - n :], CFG, mesh((1, 2)), greedy)
        np.testing.assert_array_equal(out[b, 6:], np.asarray(alone)[0, n:], err_msg=f"row {b}")


def test_top_k_1_equals_greedy(weights):
    prompt = prompts(4, 4, seed=4)
    greedy = generate(weights, prompt, CFG, mesh((2, 2)), Sampling(8, temperature=0.0))
    top1_sampling = Sampling(8, temperature=2.0, top_k=1, key=jax.random.key(9))
    top1 = generate(weights, prompt, CFG, mesh((2, 2)), top1_sampling)
    np.testing.assert_array_equal(np.asarray(top1), np.asarray(greedy))


def test_sampling_is_a_function_of_the_key_on_any_mesh(weights):
    prompt = prompts(4, 3, seed=5)

    def sample(shape, seed):
        sampling = Sampling(8, temperature=1.0, top_k=5, key=jax.random.key(seed))
        return np.asarray(generate(weights, prompt, CFG, mesh(shape), sampling))

    first = sample((2, 2), 0)
    np.testing.assert_array_equal(sample((2, 2), 0), first)
    assert not np.array_equal(sample((2, 2), 1), first)
    # The Gumbel noise is drawn for the global [B, V] array, and the top-k threshold is the
    # same however the vocab is split: the same tokens on every mesh.
    np.testing.assert_array_equal(sample((1, 1), 0), first)


@pytest.mark.parametrize("top_k", [3, 40])  # 40 > the 32 logits of a t shard
def test_sampled_ids_are_in_the_vocab_and_among_the_top_k(weights, top_k):
    prompt = prompts(8, 3, seed=6)
    new = 12
    # temperature 5: flat, so that a sample outside the top k would show
    out, logits = with_logits(weights, prompt, new, 5.0, 1, top_k=top_k)
    sampled = out[:, 3:]
    assert ((sampled >= 0) & (sampled < CFG.vocab)).all()
    kth = np.sort(logits, axis=-1)[..., -top_k]
    picked = np.take_along_axis(logits, sampled[..., None], axis=-1)[..., 0]
    assert (picked >= kth).all()
    # At temperature 5 the samples are not all the argmax.
    assert (sampled != logits.argmax(-1)).any()


def test_stop_token_ends_rows_and_fills_them(weights):
    prompt = prompts(4, 4, seed=7)
    greedy = Sampling(max_new_tokens=8, temperature=0.0)
    free = np.asarray(generate(weights, prompt, CFG, mesh((2, 2)), greedy))[:, 4:]
    stop = int(free[0, 2])
    stopping = dataclasses.replace(greedy, stop_token=stop)
    out = np.asarray(generate(weights, prompt, CFG, mesh((2, 2)), stopping))
    for b in range(4):
        hits = np.flatnonzero(free[b] == stop)
        end = hits[0] + 1 if hits.size else 8
        np.testing.assert_array_equal(out[b, 4 : 4 + end], free[b, :end])
        assert (out[b, 4 + end :] == stop).all()


def bigram_matcher(pairs, vocab=CFG.vocab):
    """A StopMatcher with one automaton per token pair (a, b): state 1 after a, 2 (accept)
    after a then b."""
    transitions = np.zeros((len(pairs), vocab, 3), np.int32)
    for s, (a, b) in enumerate(pairs):
        transitions[s, :, 2] = 2
        transitions[s, a, :2] = 1
        transitions[s, b, 1] = 2
    return StopMatcher(transitions, np.full(len(pairs), 2, np.int32))


def test_a_stop_matcher_ends_each_row_and_then_the_loop(weights):
    prompt = prompts(4, 4, seed=7)
    greedy = Sampling(max_new_tokens=8, temperature=0.0)
    free = np.asarray(generate(weights, prompt, CFG, mesh((2, 2)), greedy))[:, 4:]
    # Each row's new tokens 2 and 3 as a pair: every row stops by its token 3 (or earlier, at
    # another row's pair), so the loop can end there. A stopped row emits the stop token,
    # here one no row generates (so that only the matcher stops rows).
    pairs = [tuple(row) for row in free[:, 2:4].tolist()]
    fill = min(set(range(CFG.vocab)) - set(free.flat))
    matching = Sampling(
        8, temperature=0.0, stop_token=fill, stop_matcher=bigram_matcher(pairs), return_logits=True
    )
    out, logits = generate(weights, prompt, CFG, mesh((2, 2)), matching)
    out, logits = np.asarray(out)[:, 4:], np.asarray(logits)
    ends = [next(k for k in range(1, 8) if (row[k - 1], row[k]) in pairs) for row in free.tolist()]
    for b, end in enumerate(ends):
        np.testing.assert_array_equal(out[b, : end + 1], free[b, : end + 1])
        assert (out[b, end + 1 :] == fill).all()
    # The loop ended with the last row: no step ran after it (its logits stay unwritten).
    assert max(ends) == 3 and (logits[:, 4:] == 0).all() and (logits[:, :4] != 0).any(-1).all()


def test_a_stop_matcher_is_checked_against_the_model(weights):
    with pytest.raises(ValueError, match=r"states must lie in \[0, Q=3\)"):
        StopMatcher(np.full((1, CFG.vocab, 3), 3, np.int32), np.array([2]))
    other_vocab = Sampling(4, temperature=0.0, stop_matcher=bigram_matcher([(1, 2)], vocab=10))
    with pytest.raises(ValueError, match=r"a state for 10 token ids, but the model's vocabulary"):
        generate(weights, prompts(2, 3), CFG, mesh((2, 2)), other_vocab)


def test_bfloat16_cache(weights, host_weights):
    # The same f32 master weights; matmul inputs and the cache in bfloat16.
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16")
    prompt = prompts(2, 4, seed=8)
    sampling = Sampling(max_new_tokens=4, temperature=0.0, return_logits=True)
    out, logits = generate(weights, prompt, cfg, mesh((2, 2)), sampling)
    ref = reference_logits(host_weights, np.asarray(out)[0], cfg)[3:7]
    np.testing.assert_allclose(np.asarray(logits)[0], ref, atol=0.1, rtol=0.05)


def test_the_decoder_is_built_once_per_decode_spec(weights, monkeypatch):
    prompt = prompts(2, 4, seed=10)
    m = mesh((2, 2))
    _decoder.cache_clear()
    traced = []  # the spec of each trace of the prefill shard_map: one per compilation
    prefill = generate_module._prefill

    def spy(spec, *args):
        traced.append(spec)
        return prefill(spec, *args)

    monkeypatch.setattr(generate_module, "_prefill", spy)

    def sample(seed, temperature, top_k=4):
        key = jax.random.key(seed)
        generate(weights, prompt, CFG, m, Sampling(3, temperature, top_k, key=key))

    # Keys and temperatures are traced arguments: one spec, one decoder, one compilation.
    for seed, temperature in [(0, 0.7), (1, 1.3), (2, 0.9)]:
        sample(seed, temperature)
    spec = DecodeSpec(
        cfg=dataclasses.replace(CFG, residual="M/t"),  # one token per step: nothing to split in L
        mesh=m,
        max_new_tokens=3,
        cache_len=7,
        greedy=False,
        top_k=4,
        stop_token=None,
        stop_matcher=False,
        padded=False,
        return_logits=False,
    )
    assert traced == [spec]
    assert (_decoder.cache_info().misses, _decoder.cache_info().hits) == (1, 2)
    assert _decoder(spec) is _decoder(dataclasses.replace(spec))  # equal specs, one decoder
    # A different option is another spec: another decoder, another compilation.
    sample(0, 0.7, top_k=5)
    assert traced == [spec, dataclasses.replace(spec, top_k=5)]
    assert _decoder.cache_info().misses == 2


def test_importing_the_model_loads_no_data_pipeline_or_tokenizer():
    code = (
        "import sys, seqshard.model\n"
        "print([m for m in sys.modules if m.startswith(('seqshard.data', 'tokenizers'))])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_generation_writes_no_layout_by_hand():
    # Every sharding comes from a type (seqshard.shardlib.shardtypes.shardings), none from a hand-built
    # PartitionSpec or NamedSharding.
    root = pathlib.Path(__file__).resolve().parents[2] / "seqshard"
    for path in (root / "model" / "generate.py", root / "sample.py"):
        text = path.read_text()
        for name in ("PartitionSpec", "NamedSharding"):
            assert name not in text, f"{path.name} names {name}"


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(max_len=6), r"needs a cache of 8 positions, but max_len=6"),
        (dict(prompt=np.zeros((3, 5), np.int32)), r"batch 3 .* d=2.*decode_mesh\(3, cfg\)"),
        (dict(prompt=np.full((2, 5), 64, np.int32)), r"prompt_tokens\[0, 0\] = 64 .*\[0, 64\)"),
        (dict(prompt=np.full((2, 5), -1, np.int32)), r"prompt_tokens\[0, 0\] = -1"),
        (dict(prompt=np.zeros((5,), np.int32)), r"2-D \[batch, prompt_len\]"),
        (dict(prompt_lengths=[0, 5]), r"prompt_lengths\[0\] = 0 is outside \[1, 5\]"),
        (dict(top_k=65), r"top_k must be .* \[1, vocab=64\], got 65"),
        (dict(temperature=-1.0), r"temperature must be a finite number >= 0"),
        (dict(temperature=1.0, key=None), r"needs a key: pass key=jax.random.key"),
        (dict(max_new_tokens=0), r"max_new_tokens must be an int >= 1, got 0"),
    ],
    ids=lambda x: x if isinstance(x, str) else ",".join(x),
)
def test_bad_input_raises_a_clear_value_error(weights, change, match):
    args = dict(
        prompt=np.zeros((2, 5), np.int32),
        max_new_tokens=3,
        temperature=0.0,
        key=jax.random.key(0),
    )
    args.update(change)
    prompt, prompt_lengths = args.pop("prompt"), args.pop("prompt_lengths", None)
    # A bad sampling option fails when the Sampling is made, the rest in generate.
    with pytest.raises(ValueError, match=match):
        sampling = Sampling(**args)
        generate(weights, prompt, CFG, mesh((2, 2)), sampling, prompt_lengths=prompt_lengths)


def test_mesh_the_model_does_not_split_is_refused(weights):
    with pytest.raises(ValueError, match=r"model.n_kv=2 is not divisible by mesh axis t"):
        generate(weights, prompts(1, 3), CFG, mesh((1, 4)), Sampling(2, temperature=0))


def test_a_mesh_that_splits_the_sequence_is_refused(weights):
    """Generation keeps each row's cache whole: a mesh with c > 1 is an error naming c."""
    mesh = mesh_of_sizes({"c": 2})
    with pytest.raises(ValueError, match=r"mesh axis c \(context\) has size 2.*decode_mesh"):
        generate(weights, np.zeros((1, 4), np.int32), CFG, mesh, Sampling(2, temperature=0))
