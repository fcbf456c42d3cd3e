"""Tests of seqshard.sample: text prompts in, text continuations out (via generate)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from model_weights import tiny_model

from seqshard.data.tokenizer import EOT, decode, encode_batch, eot_id, train_tokenizer
from seqshard.model import generate, init_weights
from seqshard.model.generate import Sampling, StopMatcher
from seqshard.sample import generate_text, stop_matcher
from seqshard.testing import fake_cpu_mesh

CFG = tiny_model(n_kv=2)
TEXT = ["the cat sat on the mat", "a dog ran in the park", "the sun is hot today"] * 8


def mesh(shape):
    return fake_cpu_mesh(shape, ("d", "t"))


@pytest.fixture(scope="module")
def text_setup():
    tok = train_tokenizer(TEXT, vocab_size=280)
    cfg = dataclasses.replace(CFG, vocab=288)
    # Weights made on one mesh (as a training run leaves them), generated on others.
    w = init_weights(cfg, mesh((4, 2)), jax.random.key(1))
    return tok, cfg, w


def test_generate_text_stops_each_row_at_endoftext(text_setup):
    tok, cfg, w = text_setup
    eot = eot_id(tok)
    texts = ["the cat", "a dog ran in", ""]
    greedy = Sampling(max_new_tokens=10, temperature=0.0)
    # Make <|endoftext|> win wherever a token the model likes already would: give it that
    # token's unembedding, slightly scaled up.
    ids = encode_batch(tok, [t or EOT for t in texts])
    width = max(map(len, ids))
    padded = np.array([[0] * (width - len(r)) + r for r in ids], np.int32)
    lengths = [len(r) for r in ids]
    free = generate(w, padded, cfg, mesh((1, 2)), greedy, prompt_lengths=lengths)
    liked = int(np.asarray(free)[1, width + 3])
    unembed = w.unembed.at[eot].set(1.5 * w.unembed[liked])
    w = dataclasses.replace(w, unembed=unembed)

    got = generate_text(w, tok, texts, cfg, None, greedy)
    out = generate(w, padded, cfg, mesh((1, 2)), greedy, prompt_lengths=lengths)
    out = np.asarray(out)[:, width:]
    stopped = [eot in row for row in out.tolist()]
    assert any(stopped), "the test should make some row emit <|endoftext|>"
    expected = [decode(tok, row[: row.index(eot)] if eot in row else row) for row in out.tolist()]
    assert got == expected
    assert all(EOT not in t for t in got)
    # A mesh whose d = 2 does not divide the 3 prompts: padded to 4 rows, the extra dropped.
    assert generate_text(w, tok, texts, cfg, mesh((2, 2)), greedy) == got


def test_generate_text_refuses_a_tokenizer_larger_than_the_model(text_setup):
    tok, _, w = text_setup
    with pytest.raises(ValueError, match=r"tokenizer has \d+ tokens but the model only 64"):
        generate_text(w, tok, ["x"], CFG, None, Sampling(max_new_tokens=2, temperature=0))


@pytest.mark.parametrize(
    "option",
    [
        dict(stop_token=3),
        dict(return_logits=True),
        dict(stop_matcher=StopMatcher(np.zeros((1, 288, 2), np.int32), np.ones(1, np.int32))),
    ],
)
def test_generate_text_refuses_a_stop_token_or_logits(text_setup, option):
    # Rows stop at <|endoftext|> and at the stop strings, and the result is text: another stop
    # token or matcher, or logits, would be dropped without a word.
    tok, cfg, w = text_setup
    sampling = Sampling(max_new_tokens=2, temperature=0, **option)
    match = r"sampling.stop_token, sampling.stop_matcher and sampling.return_logits must be unset"
    with pytest.raises(ValueError, match=match):
        generate_text(w, tok, ["x"], cfg, None, sampling)


def test_stop_strings_cut_each_row_where_its_text_first_holds_one(text_setup):
    tok, cfg, w = text_setup
    texts = ["the cat", "a dog ran in", "the sun"]
    greedy = Sampling(max_new_tokens=10, temperature=0.0)
    free = generate_text(w, tok, texts, cfg, None, greedy)
    # A string from the middle of row 0's text (it may also come earlier, or in other rows).
    middle = len(free[0]) // 2
    stop = free[0][middle : middle + 2]
    assert stop.strip() == stop and stop, free
    got = generate_text(w, tok, texts, cfg, None, greedy, stop=[stop, "never seen"])
    assert got == [t[: t.index(stop)] if stop in t else t for t in free]
    assert len(got[0]) <= middle < len(free[0])
    with pytest.raises(ValueError, match=r"stop must be a list of non-empty strings, got \['']"):
        generate_text(w, tok, texts, cfg, None, greedy, stop=[""])


def test_the_stop_matcher_accepts_where_the_decoded_text_first_holds_a_stop_string():
    """The automata run on token ids and the strings are text: a stop string's tokens in a text
    need not be its own (``.<|`` is one pre-token of ``done.<|end|>``), and a token may end or
    begin inside one. At every prefix of every text, an automaton is in its accepting state iff
    the decoded prefix holds its string."""
    import random

    stops = ["<|end|>", "aab", "\n\n", "ï ✓"]
    tok = train_tokenizer(["done.<|end|>\n abab aab ünï ✓\n\n def f(x):"] * 10, vocab_size=300)
    matcher = stop_matcher(tok, stops, vocab=320)  # ids past the tokenizer's: no text
    assert matcher.transitions.shape == (4, 320, 8)
    rng = random.Random(0)
    pieces = ["a", "b", "<|", "end", "|>", ".", "\n", "ï", " ", "✓", "x", "ab", "done"]
    accepted = 0
    for _ in range(300):
        ids = encode_batch(tok, ["".join(rng.choices(pieces, k=rng.randint(1, 12)))])[0]
        ids.insert(rng.randrange(len(ids) + 1), 310)
        state = np.zeros(len(stops), np.int32)
        for k, token in enumerate(ids):
            state = matcher.transitions[np.arange(len(stops)), token, state]
            text = decode(tok, [i for i in ids[: k + 1] if i < tok.get_vocab_size()])
            assert list(state == matcher.accept) == [s in text for s in stops], (text, state)
            accepted += any(state == matcher.accept)
    assert accepted > 50  # the texts hold the strings often enough to test both ways
