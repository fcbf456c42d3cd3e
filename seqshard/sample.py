"""Where text meets tokens: text prompts in, sampled text out.

    texts = generate_text(weights, tok, ["def f(x):"], cfg, None, Sampling(32, temperature=0.0))
    texts = generate_text(weights, tok, prompts, cfg, None, sampling, stop=["<|end|>", "\n\n"])

The model (:func:`seqshard.model.generate`) works on token ids only; this module encodes the
prompts with the run's tokenizer (:mod:`seqshard.data.tokenizer`), left-pads them into one
batch, generates, and decodes each continuation up to its first ``<|endoftext|>`` or stop
string.

Stop strings are text, and a string's tokens in the generated text need not be its tokens
alone (the byte-level pre-tokenizer joins ``.<|`` in ``done.<|end|>``), so rows are not
stopped on token sequences. For a byte-level tokenizer, each string becomes an automaton over
token ids (:func:`stop_matcher`: the string's bytes matched as each token's bytes arrive), and
the decode loop stops a row at the token that completes a string and ends once every row has
stopped. With another tokenizer the rows run to ``max_new_tokens`` and the text is cut after.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh

from seqshard.data.tokenizer import Tokenizer, decode, encode_batch, eot_id, token_bytes
from seqshard.model.config import ModelConfig
from seqshard.model.generate import Sampling, StopMatcher, decode_mesh, generate
from seqshard.model.weights import Weights

__all__ = ["generate_text", "stop_matcher"]


def generate_text(
    weights: Weights,
    tokenizer: Tokenizer,
    prompts: list[str],
    cfg: ModelConfig,
    mesh: Mesh | None,
    sampling: Sampling,
    *,
    stop: Sequence[str] = (),
) -> list[str]:
    """Each prompt's continuation (without the prompt), cut before its first ``<|endoftext|>``
    and before the first place its text contains one of the ``stop`` strings.

    Prompts are encoded and left-padded into one batch; an empty prompt is ``<|endoftext|>``
    alone (the token before every document in the training data). ``mesh=None`` picks
    :func:`~seqshard.model.decode_mesh`; with a mesh whose d does not divide the batch, the
    batch is padded with copies of the first prompt, which are dropped from the result.
    ``sampling`` chooses the tokens; the stop token is the tokenizer's ``<|endoftext|>``. A
    row stops generating at its first stop string (module docstring: with a byte-level
    tokenizer; otherwise its text is cut after ``max_new_tokens``).
    """
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"generate_text: prompts must be a list of strings, got {prompts!r}.")
    if (
        sampling.stop_token is not None
        or sampling.return_logits
        or sampling.stop_matcher is not None
    ):
        raise ValueError(
            f"generate_text: rows stop at the tokenizer's <|endoftext|> and at the stop strings, "
            f"and the result is text, so sampling.stop_token, sampling.stop_matcher and "
            f"sampling.return_logits must be unset, got stop_token={sampling.stop_token!r}, "
            f"stop_matcher={sampling.stop_matcher!r}, return_logits={sampling.return_logits!r}. "
            f"Pass stop=[...] strings, or call seqshard.model.generate for token ids and logits."
        )
    stop = list(stop) if isinstance(stop, (list, tuple)) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"generate_text: stop must be a list of non-empty strings, got {stop!r}.")
    if not prompts:
        return []
    if tokenizer.get_vocab_size() > cfg.vocab:
        raise ValueError(
            f"generate_text: the tokenizer has {tokenizer.get_vocab_size()} tokens but the model "
            f"only {cfg.vocab} (model.vocab). Use the tokenizer the model was trained with."
        )
    eot = eot_id(tokenizer)
    ids = encode_batch(tokenizer, prompts)
    if any(not row for row in ids):
        if eot is None:
            raise ValueError(
                "generate_text: an empty prompt needs the tokenizer's <|endoftext|> token to "
                "start from, and this tokenizer has none; give every prompt some text."
            )
        ids = [row or [eot] for row in ids]
    n = len(ids)
    if mesh is None:
        mesh = decode_mesh(n, cfg)
    d = mesh.shape["d"] if isinstance(mesh, Mesh) and "d" in mesh.shape else 1
    ids += [ids[0]] * (-n % d)
    width = max(len(row) for row in ids)
    prompt = np.zeros((len(ids), width), np.int32)
    for b, row in enumerate(ids):
        prompt[b, width - len(row) :] = row
    matcher = stop_matcher(tokenizer, stop, cfg.vocab) if stop else None
    sampling = dataclasses.replace(sampling, stop_token=eot, stop_matcher=matcher)
    out = generate(weights, prompt, cfg, mesh, sampling, prompt_lengths=[len(row) for row in ids])
    texts = []
    for row in np.asarray(out[:n, width:]).tolist():
        if eot is not None and eot in row:
            row = row[: row.index(eot)]
        text = decode(tokenizer, row)
        # The stopping token may hold text before the string (and a row that stopped runs on
        # in `fill` tokens): cut at the string's first place.
        text = text[: min([text.find(s) for s in stop if s in text], default=len(text))]
        texts.append(text)
    return texts


def stop_matcher(tokenizer: Tokenizer, stop: Sequence[str], vocab: int) -> StopMatcher | None:
    """The :class:`~seqshard.model.generate.StopMatcher` that stops a row at the token whose
    text completes one of the ``stop`` strings, for the ids of a model of ``vocab`` tokens;
    None if the tokenizer is not byte-level (:func:`~seqshard.data.tokenizer.token_bytes`).

    Automaton s's state q is how many bytes of string s the text ends with (Knuth-Morris-Pratt
    over bytes); its transition on a token feeds that token's bytes one by one. Ids outside the
    tokenizer decode to nothing and leave the state as it is."""
    pieces = token_bytes(tokenizer)
    if pieces is None or not stop:
        return None
    pieces = pieces[:vocab] + [b""] * (vocab - len(pieces))
    longest = max(map(len, pieces))
    # Each token's bytes, then 256 ("no byte", which changes no state) up to the longest.
    padded = np.full((vocab, longest), 256, np.int32)
    for i, piece in enumerate(pieces):
        padded[i, : len(piece)] = list(piece)
    patterns = [s.encode() for s in stop]
    n_states = max(map(len, patterns)) + 1
    transitions = np.zeros((len(patterns), vocab, n_states), np.int32)
    for s, pattern in enumerate(patterns):
        step = _byte_automaton(pattern, n_states)
        state = np.broadcast_to(np.arange(n_states, dtype=np.int32), (vocab, n_states))
        for j in range(longest):
            state = step[state, padded[:, j : j + 1]]
        transitions[s] = state
    return StopMatcher(transitions, np.array([len(p) for p in patterns], np.int32))


def _byte_automaton(pattern: bytes, n_states: int) -> np.ndarray:
    """i32[n_states, 257]: the state after one byte (256: no byte) of the automaton that finds
    ``pattern``; state q < len(pattern): the text ends with its first q bytes (and with no
    longer prefix); len(pattern): found, kept (as are the unused states above it)."""
    m = len(pattern)
    step = np.zeros((n_states, 257), np.int32)
    step[:, 256] = np.arange(n_states)
    step[m:, :256] = np.arange(m, n_states)[:, None]
    step[0, pattern[0]] = 1
    fallback = 0  # the state the text would be in without its first byte
    for q in range(1, m):
        step[q, :256] = step[fallback, :256]
        step[q, pattern[q]] = q + 1
        fallback = step[fallback, pattern[q]]
    return step
