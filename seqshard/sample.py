"""Where text meets tokens: text prompts in, sampled text out.

    texts = generate_text(weights, tok, ["def f(x):"], cfg, None, max_new_tokens=32,
                          temperature=0.0, top_k=None, seed=0)

The model (:func:`seqshard.model.generate`) works on token ids only; this module encodes the
prompts with the run's tokenizer (:mod:`seqshard.data.tokenizer`), left-pads them into one
batch, generates, and decodes each continuation up to its first ``<|endoftext|>``.
"""

import jax
import numpy as np
from jax.sharding import Mesh

from seqshard.data.tokenizer import Tokenizer, decode, encode_batch, eot_id
from seqshard.model.config import ModelConfig
from seqshard.model.generate import decode_mesh, generate
from seqshard.model.weights import Weights

__all__ = ["generate_text"]


def generate_text(
    weights: Weights,
    tokenizer: Tokenizer,
    prompts: list[str],
    cfg: ModelConfig,
    mesh: Mesh | None,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
) -> list[str]:
    """Each prompt's continuation (without the prompt), cut before its first ``<|endoftext|>``.

    Prompts are encoded and left-padded into one batch; an empty prompt is ``<|endoftext|>``
    alone (the token before every document in the training data). ``mesh=None`` picks
    :func:`~seqshard.model.decode_mesh`; with a mesh whose d does not divide the batch, the
    batch is padded with copies of the first prompt, which are dropped from the result.
    """
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"generate_text: prompts must be a list of strings, got {prompts!r}.")
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
    out = generate(
        weights,
        prompt,
        cfg,
        mesh,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        key=jax.random.key(seed),
        prompt_lengths=[len(row) for row in ids],
        stop_token=eot,
    )
    texts = []
    for row in np.asarray(out[:n, width:]).tolist():
        if eot is not None and eot in row:
            row = row[: row.index(eot)]
        texts.append(decode(tokenizer, row))
    return texts
