"""The lm-evaluation-harness model ``seqshard``: a run's latest checkpoint behind the
harness's ``LM`` API, so any task the harness knows scores a seqshard model.

    seqshard lm-eval --model seqshard --model_args run_dir=runs/tiny-cpu --tasks hellaswag
    python -m seqshard.harness --model seqshard --model_args run_dir=runs/NAME --tasks ...

lm-eval 0.4.13 finds no model outside its own package by itself (no plugin entry points; its
CLI imports nothing of ours), so ``seqshard lm-eval`` (or ``python -m seqshard.harness``)
imports this module, which registers the model, and runs the harness's own command line with
every flag of it. From Python: ``import seqshard.harness`` and then
``lm_eval.simple_evaluate(model="seqshard", model_args="run_dir=runs/NAME", ...)``, or pass
``SeqshardLM(run_dir=...)`` itself. Needs ``pip install -e '.[eval]'``.

* ``loglikelihood``: each (context, continuation) scored by the sharded model, packed into
  rows of the run's ``train.seq_len`` (:class:`seqshard.evals.scoring.Scorer`): the same
  numbers ``seqshard eval --tasks`` reads.
* ``loglikelihood_rolling``: a text's log-likelihood from its first token (after
  ``<|endoftext|>``, the token before every training document), in windows of
  ``train.seq_len`` tokens, each conditioned on the last token of the one before.
* ``generate_until``: the KV-cache generation of ``seqshard generate`` (greedy unless the
  request's ``temperature`` says otherwise), cut at the request's ``until`` strings.

``model_args``: ``run_dir`` (required), ``rows`` (packed rows per batch; default the run's
``train.batch_size``). The mesh is the run's when this machine has its devices, else one
device.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        "seqshard.harness needs the lm-evaluation-harness: pip install -e '.[eval]' "
        f"(lm-eval>=0.4.13). ({e})"
    ) from None

from seqshard.config import Config, read_run_config
from seqshard.data.tokenizer import encode, eot_id, load_tokenizer
from seqshard.evals.scoring import Scorer
from seqshard.mesh import mesh_of_sizes
from seqshard.model.generate import Sampling
from seqshard.sample import generate_text
from seqshard.train.checkpoint import latest_state

__all__ = ["SeqshardLM", "main"]


def _mesh(cfg: Config):
    sizes = cfg.mesh.sizes()
    if math.prod(sizes.values()) == jax.device_count() and sizes["p"] == 1:
        return mesh_of_sizes(sizes)
    return mesh_of_sizes({})


@register_model("seqshard")
class SeqshardLM(LM):
    """A seqshard run's latest checkpoint as an lm-eval model (the module docstring)."""

    def __init__(self, run_dir: str, rows: int = 0, **harness_kwargs) -> None:
        # The harness also passes batch_size, max_batch_size and device: seqshard packs its
        # own batches and runs on the run's mesh.
        super().__init__()
        self.run_dir = Path(run_dir)
        cfg = read_run_config(self.run_dir)
        self.cfg, self.mesh = cfg, _mesh(cfg)
        self.weights = latest_state(self.run_dir, cfg, self.mesh, log=lambda _: None).weights
        self.tokenizer = load_tokenizer(Path(cfg.data.dir) / "tokenizer.json")
        rows = rows or cfg.train.batch_size
        self.scorer = Scorer(cfg.model, self.mesh, self.tokenizer, rows, cfg.train.seq_len)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        scored = self.scorer.score(self.weights, [tuple(r.args) for r in requests])
        return [(s.loglikelihood, s.greedy) for s in scored]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        start = eot_id(self.tokenizer) or 0
        window = self.cfg.train.seq_len
        pairs, owner = [], []  # every request's windows, scored in one pass of packed rows
        for i, r in enumerate(requests):
            ids = [start, *encode(self.tokenizer, r.args[0])]
            for k in range(0, len(ids) - 1, window - 1):
                pairs.append((ids[k : k + 1], ids[k + 1 : k + window]))
                owner.append(i)
        out = [0.0] * len(requests)
        for i, scored in zip(owner, self.scorer.score_ids(self.weights, pairs), strict=True):
            out[i] += scored.loglikelihood
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for r in requests:
            context, kwargs = r.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            sampling = Sampling(
                int(kwargs.get("max_gen_toks", 64)), temperature, key=jax.random.key(0)
            )
            (text,) = generate_text(
                self.weights, self.tokenizer, [context], self.cfg.model, None, sampling, stop=until
            )
            out.append(text)
        return out


def main(argv: list[str] | None = None) -> None:
    """The harness's command line, with the ``seqshard`` model registered."""
    import sys

    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = ["lm_eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
