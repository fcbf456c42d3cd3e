"""Where text meets tokens: text prompts in, sampled text out.

    texts = generate_text(weights, tok, ["def f(x):"], cfg, None, Sampling(32, temperature=0.0))

The model (:func:`seqshard.model.generate`) works on token ids only; this module encodes the
prompts with the run's tokenizer (:mod:`seqshard.data.tokenizer`), left-pads them into one
batch, generates, and decodes each continuation up to its first ``<|endoftext|>``.
"""

import dataclasses

import numpy as np
from jax.sharding import Mesh

from seqshard.data.tokenizer import Tokenizer, decode, encode_batch, eot_id
from seqshard.model.config import ModelConfig
from seqshard.model.generate import Sampling, decode_mesh, generate
from seqshard.model.weights import Weights

__all__ = ["generate_text"]


def generate_text(
    weights: Weights,
    tokenizer: Tokenizer,
    prompts: list[str],
    cfg: ModelConfig,
    mesh: Mesh | None,
    sampling: Sampling,
) -> list[str]:
    """Each prompt's continuation (without the prompt), cut before its first ``<|endoftext|>``.

    Prompts are encoded and left-padded into one batch; an empty prompt is ``<|endoftext|>``
    alone (the token before every document in the training data). ``mesh=None`` picks
    :func:`~seqshard.model.decode_mesh`; with a mesh whose d does not divide the batch, the
    batch is padded with copies of the first prompt, which are dropped from the result.
    ``sampling`` chooses the tokens; the stop token is the tokenizer's ``<|endoftext|>``.
    """
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"generate_text: prompts must be a list of strings, got {prompts!r}.")
    if sampling.stop_token is not None or sampling.return_logits:
        raise ValueError(
            f"generate_text: rows stop at the tokenizer's <|endoftext|> and the result is text, "
            f"so sampling.stop_token and sampling.return_logits must be unset, got "
            f"stop_token={sampling.stop_token!r}, return_logits={sampling.return_logits!r}. "
            f"Call seqshard.model.generate for token ids and logits."
        )
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
    sampling = dataclasses.replace(sampling, stop_token=eot)
    out = generate(weights, prompt, cfg, mesh, sampling, prompt_lengths=[len(row) for row in ids])
    texts = []
    for row in np.asarray(out[:n, width:]).tolist():
        if eot is not None and eot in row:
            row = row[: row.index(eot)]
        texts.append(decode(tokenizer, row))
    return texts
