"""Tests of generation with multi-head latent attention (seqshard/model/mla_decode.py, run by
seqshard/model/generate.py): the latent cache, decoded in the absorbed form, against the
unabsorbed no-cache reference (seqshard/model/reference.py, DeepSeek-V3's math written
densely) on 1-device, t=2 and d=2 t=2 meshes, with and without the query latent, with MoE
layers and with YaRN's softmax scale; left-padded prompts; the cache's size and
communication; text sampling (``seqshard generate``'s path) over it.

Tolerances: f32, each new token's logits within 1e-5 (absolute and relative) of the
reference's on the sequence so far, and every greedy token the reference's argmax there;
bf16 as tests/model/test_generate.py's bf16 cache (0.1 absolute, 5% relative).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import numpy as np
import pytest
from model_weights import random_weights, tiny_model

from seqshard.data.tokenizer import decode, encode_batch, eot_id, train_tokenizer
from seqshard.model import reference_logits_fn
from seqshard.model.config import MLAConfig, MoEConfig
from seqshard.model.generate import (
    Sampling,
    _checked,
    _decoder,
    cache_bytes_per_token,
    decode_mesh,
    generate,
)
from seqshard.model.weights import weights_type
from seqshard.sample import generate_text
from seqshard.shardlib.shardtypes import shardings
from seqshard.testing import count_collectives, fake_cpu_mesh

# The module, not the function seqshard.model re-exports under the same name.
generate_module = importlib.import_module("seqshard.model.generate")

# Every size distinct where a mix-up could hide: R = 16, P = 4, Dn = 8, Dv = 6, Rq = 12.
MLA = MLAConfig(
    q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
)
CFG = tiny_model(attention="mla", n_q_per_kv=1, n_kv=4, d_head=12, mla=MLA)
CONFIGS = {
    "q-latent": CFG,
    "no-q-latent": dataclasses.replace(CFG, mla=dataclasses.replace(MLA, q_lora_rank=0)),
    # One dense layer, then two MoE layers (the stacks' layers share one cache).
    "moe": dataclasses.replace(
        CFG, n_layers=3, moe=MoEConfig(n_experts=4, top_k=2, d_ff=32, n_shared=1, n_dense_layers=1)
    ),
    # softmax_mscale(cfg) = (0.1 ln 4 + 1)^2 = 1.30: q carries it into the absorbed scores.
    "yarn": dataclasses.replace(
        CFG,
        rope_type="yarn",
        rope_factor=4.0,
        rope_original_max_position=8,
        rope_mscale=1.0,
        rope_mscale_all_dim=1.0,
    ),
}
GQA = tiny_model(n_kv=4)  # the same sizes with grouped-query attention


def mesh(shape):
    return fake_cpu_mesh(shape, ("d", "t"))


@functools.cache
def weights(cfg):
    """Random weights (norm gains not ones), numpy: generate places them on its mesh."""
    return random_weights(cfg, seed=0)


def prompts(batch, length, seed=0):
    return np.random.default_rng(seed).integers(0, CFG.vocab, (batch, length), dtype=np.int32)


_reference = jax.jit(reference_logits_fn, static_argnums=3)
WIDTH = 16  # every reference call is padded to this length at the end: one compilation per cfg


def reference_logits(cfg, seq):
    """f32[len(seq), vocab]: the unabsorbed no-cache logits of one document (padding after it
    changes nothing before it: the model is causal)."""
    tokens = np.zeros((1, WIDTH), np.int32)
    tokens[0, : len(seq)] = seq
    starts = np.zeros((1, WIDTH), bool)
    starts[:, 0] = True
    return np.asarray(_reference(weights(cfg), tokens, starts, cfg))[0, : len(seq)]


def assert_matches_reference(cfg, out, logits, lengths, width, *, greedy: bool) -> None:
    """Each row's new tokens' logits are the reference's on its document so far (1e-5), and
    with ``greedy`` each new token is the reference's argmax there."""
    new = logits.shape[1]
    for b, n in enumerate(lengths):
        seq = out[b, width - n :]  # the row's document without its padding
        ref = reference_logits(cfg, seq)[n - 1 : n - 1 + new]
        np.testing.assert_allclose(logits[b], ref, rtol=1e-5, atol=1e-5, err_msg=f"row {b}")
        if greedy:
            np.testing.assert_array_equal(out[b, width:], ref.argmax(-1), err_msg=f"row {b}")


@pytest.mark.parametrize(
    "name, shape",
    [
        pytest.param("q-latent", (1, 1), marks=pytest.mark.slow),
        ("no-q-latent", (1, 2)),
        ("q-latent", (2, 2)),
        pytest.param("no-q-latent", (2, 2), marks=pytest.mark.slow),
        pytest.param("q-latent", (1, 2), marks=pytest.mark.slow),
        pytest.param("moe", (1, 2), marks=pytest.mark.slow),
        pytest.param("moe", (2, 2), marks=pytest.mark.slow),
        pytest.param("yarn", (2, 2), marks=pytest.mark.slow),
    ],
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else x,
)
def test_greedy_equals_the_unabsorbed_reference_step_by_step(name, shape):
    cfg = CONFIGS[name]
    prompt, new = prompts(2, 5, seed=1), 6
    sampling = Sampling(new, temperature=0.0, return_logits=True)
    out, logits = generate(weights(cfg), prompt, cfg, mesh(shape), sampling)
    out, logits = np.asarray(out), np.asarray(logits)
    assert out.shape == (2, 5 + new) and logits.shape == (2, new, cfg.vocab)
    np.testing.assert_array_equal(out[:, :5], prompt)
    assert_matches_reference(cfg, out, logits, [5, 5], 5, greedy=True)


def test_left_padded_prompts_of_different_lengths_match_the_reference():
    lengths, width, new = [5, 2, 4, 1], 5, 6
    prompt = prompts(4, width, seed=2)
    for b, n in enumerate(lengths):
        prompt[b, : width - n] = -1  # padding values are ignored
    # Sampled (temperature 1): the cache sees tokens that are not the argmax.
    sampling = Sampling(new, temperature=1.0, key=jax.random.key(3), return_logits=True)
    out, logits = generate(
        weights(CFG), prompt, CFG, mesh((2, 2)), sampling, prompt_lengths=lengths
    )
    out, logits = np.asarray(out), np.asarray(logits)
    assert (out[:, width:] != logits.argmax(-1)).any()  # not all greedy
    assert_matches_reference(CFG, out, logits, lengths, width, greedy=False)


@pytest.mark.slow
def test_left_padded_greedy_rows_generate_what_they_generate_alone():
    lengths, width = [3, 6], 6
    prompt = prompts(2, width, seed=4)
    greedy = Sampling(max_new_tokens=5, temperature=0.0)
    out = generate(weights(CFG), prompt, CFG, mesh((1, 2)), greedy, prompt_lengths=lengths)
    for b, n in enumerate(lengths):
        alone = generate(weights(CFG), prompt[b : b + 1, width - n :], CFG, mesh((1, 2)), greedy)
        np.testing.assert_array_equal(
            np.asarray(out)[b, width:], np.asarray(alone)[0, n:], err_msg=f"row {b}"
        )


@pytest.mark.slow
def test_bfloat16_latent_cache():
    # The same f32 master weights (random_weights draws the same for either compute dtype);
    # matmul inputs, the latent cache and the absorbed query in bfloat16.
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16")
    prompt = prompts(2, 4, seed=5)
    sampling = Sampling(max_new_tokens=4, temperature=0.0, return_logits=True)
    out, logits = generate(weights(CFG), prompt, cfg, mesh((2, 2)), sampling)
    ref = reference_logits(cfg, np.asarray(out)[0])[3:7]
    np.testing.assert_allclose(np.asarray(logits)[0], ref, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("compute_dtype, nbytes", [("float32", 4), ("bfloat16", 2)])
def test_cache_bytes_per_token_are_the_latent_and_the_rope_key(compute_dtype, nbytes):
    # (kv_lora_rank + qk_rope_head_dim) x bytes per layer, against 2 n_kv d_head x bytes.
    mla = dataclasses.replace(CFG, compute_dtype=compute_dtype)
    gqa = dataclasses.replace(GQA, compute_dtype=compute_dtype)
    assert cache_bytes_per_token(mla) == (16 + 4) * nbytes
    assert cache_bytes_per_token(gqa) == 2 * 4 * 8 * nbytes


@pytest.mark.parametrize("cfg, split_over_t", [(CFG, False), (GQA, True)], ids=["mla", "gqa"])
def test_the_cache_generate_holds_has_that_size(cfg, split_over_t, monkeypatch):
    """The cache prefill returns, per device, on a d=2 t=2 mesh: every t shard holds MLA's
    latent cache whole; GQA's heads are split over t."""
    caches = []
    prefill = generate_module._prefill

    def spy(spec, *args):
        token, logits, kv = prefill(spec, *args)
        caches.append(kv)
        return token, logits, kv

    monkeypatch.setattr(generate_module, "_prefill", spy)
    _decoder.cache_clear()  # trace again, through the spy
    batch, length, new, d, t = 4, 5, 3, 2, 2
    generate(weights(cfg), prompts(batch, length), cfg, mesh((d, t)), Sampling(new, 0.0))
    (kv,) = caches
    per_token = kv.size * kv.dtype.itemsize // (cfg.n_layers * batch // d * (length + new))
    assert per_token == cache_bytes_per_token(cfg) // (t if split_over_t else 1)


def test_the_latent_cache_adds_no_communication():
    """On a t=2 mesh (no weight gathers over d), the compiled generator (prefill and the decode
    loop) holds the collectives GQA's does, but for the gathers over t of the latents' own
    weights (their projections and norm gains rest split over t, mla.py): the cache never
    moves, MLA's latents are replicated over t by those and the all-gathers every layer makes
    anyway."""
    prompt, sampling = prompts(2, 5), Sampling(4, temperature=0.0)
    counts = []
    for cfg in (CFG, GQA):
        spec, padded, start, key = _checked(weights(cfg), prompt, cfg, mesh((1, 2)), sampling, None)
        w = jax.device_put(weights(cfg), shardings(weights_type(cfg), spec.mesh))
        args = (w, padded, start, key, np.float32(0), None)
        counts.append(count_collectives(_decoder(spec), *args))
    # w_q_a, q_a_norm, w_kv_a, kv_a_norm: in the prefill and in the decode loop's body.
    latent_weights = 4 if CFG.mla.q_lora_rank else 2
    assert counts[0]["all-gather"] == counts[1]["all-gather"] + 2 * latent_weights
    assert {k: v for k, v in counts[0].items() if k != "all-gather"} == {
        k: v for k, v in counts[1].items() if k != "all-gather"
    }
    assert counts[0]["all-gather"] > 0 and counts[0]["reduce-scatter"] > 0


TEXT = ["the cat sat on the mat", "a dog ran in the park", "the sun is hot today"] * 8


def test_text_sampling_runs_an_mla_model():
    """seqshard.sample.generate_text (what ``seqshard generate`` and the end-of-run sample
    call, on the mesh decode_mesh picks) continues text with an MLA model: each text is the
    decoded tokens generate gives, cut at <|endoftext|>."""
    tok = train_tokenizer(TEXT, vocab_size=280)
    cfg = dataclasses.replace(CFG, vocab=288)
    w = random_weights(cfg, seed=1)
    texts = ["the cat", "a dog ran in"]
    greedy = Sampling(max_new_tokens=6, temperature=0.0)
    got = generate_text(w, tok, texts, cfg, None, greedy)
    ids = encode_batch(tok, texts)
    width = max(map(len, ids))
    padded = np.array([[0] * (width - len(r)) + r for r in ids], np.int32)
    out = generate(
        w, padded, cfg, decode_mesh(2, cfg), greedy, prompt_lengths=[len(r) for r in ids]
    )
    eot = eot_id(tok)
    rows = np.asarray(out)[:, width:].tolist()
    assert got == [decode(tok, row[: row.index(eot)] if eot in row else row) for row in rows]
