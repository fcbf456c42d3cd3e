"""Scoring tasks with the sharded model: log-likelihoods of continuations, packed into rows.

Every (context, continuation) pair a task needs becomes one document of a packed row
(``is_seq_start`` at its first token), so pairs of any lengths share fixed ``[rows, seq_len]``
batches and the scoring function compiles once per run::

    row 0:  [ctx a | cont a ][ctx b    | cont b  ][pad      ]
    row 1:  [ctx c          | cont c    ][ctx d | cont d    ]

The model's forward runs on the batch in its usual layouts on any mesh with p = 1
(:func:`seqshard.model.sharded.next_token_scores`: per position, the next token's negative
log-likelihood and whether it is the argmax, reduced over the vocabulary split across t
inside the shard_map); a continuation's log-likelihood is minus the sum over the positions
that predict its tokens, and it is greedy when each is the argmax. A context too long for a
row loses its start (the continuation always fits whole, or is an error).

Tokens: the pair's text is tokenized whole and the context's tokens are its longest prefix
the context alone tokenizes to (BPE may merge across the boundary), so the continuation's
tokens are exactly what the model would read after the context.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from tokenizers import Tokenizer

from seqshard.batch import TokenBatch
from seqshard.data.tokenizer import encode
from seqshard.evals.tasks import Task, TaskError, task_figure
from seqshard.model.config import ModelConfig
from seqshard.model.sharded import next_token_scores
from seqshard.model.weights import Weights
from seqshard.shardlib.shardtypes import f32, shardings

__all__ = ["Scored", "Scorer", "TaskResult", "score_tasks"]


@dataclasses.dataclass(frozen=True)
class Scored:
    """One continuation's score: its total log-likelihood, whether greedy decoding gives it,
    and its tokens."""

    loglikelihood: float
    greedy: bool
    tokens: int


def split_tokens(tok: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of ``context + continuation`` tokenized whole."""
    whole = encode(tok, context + continuation)
    alone = encode(tok, context)
    n = 0
    while n < min(len(alone), len(whole)) and alone[n] == whole[n]:
        n += 1
    n = min(n, len(whole) - 1)  # at least one continuation token
    return whole[:n], whole[n:]


@dataclasses.dataclass
class Scorer:
    """Scores pairs with ``weights`` (placed on ``mesh``, p = 1) in batches of ``rows`` x
    ``seq_len`` tokens (rows divisible by the mesh's batch axes, seq_len by c)."""

    cfg: ModelConfig
    mesh: Mesh
    tokenizer: Tokenizer
    rows: int
    seq_len: int

    def __post_init__(self) -> None:
        cfg, mesh = self.cfg, self.mesh
        # The scores come back whole on every process (a multi-process run reads them all).
        whole = shardings(f32["2 B L"], mesh)
        self._fn = jax.jit(lambda w, b: next_token_scores(w, b, cfg, mesh), out_shardings=whole)
        self._batch_shardings = shardings(TokenBatch, mesh)
        self._token_cache: dict[tuple[str, str], tuple[list[int], list[int]]] = {}

    def score(self, weights: Weights, pairs: Sequence[tuple[str, str]]) -> list[Scored]:
        """Each (context, continuation) pair's :class:`Scored`, in order."""
        return self.score_ids(weights, [self._tokens(c, x) for c, x in pairs])

    def check(self, pairs: Sequence[tuple[str, str]], where: str) -> None:
        """Raise TaskError (naming ``where`` and the example) for a pair that cannot be
        scored in a row: before a run spends anything on it."""
        for i, (c, x) in enumerate(pairs):
            try:
                self._document(i, *self._tokens(c, x))
            except TaskError as e:
                raise TaskError(f"{where}, request {i} ({c[-40:]!r} + {x[:40]!r}): {e}") from None

    def _tokens(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        key = (context, continuation)
        if key not in self._token_cache:  # the same pairs every evaluation of a run
            self._token_cache[key] = split_tokens(self.tokenizer, context, continuation)
        return self._token_cache[key]

    def score_ids(
        self, weights: Weights, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> list[Scored]:
        """Each (context ids, continuation ids) pair's :class:`Scored`, in order."""
        docs = [self._document(i, list(c), list(x)) for i, (c, x) in enumerate(pairs)]
        out: list[Scored | None] = [None] * len(pairs)
        for batch_docs, tokens, starts in self._batches(docs):
            # Every process packed the same rows: each places its devices' blocks of them
            # (from the host arrays; the loss mask is unread).
            batch = jax.tree.map(
                lambda x, sharding: jax.make_array_from_callback(x.shape, sharding, x.__getitem__),
                TokenBatch(tokens, starts, np.ones_like(starts)),
                self._batch_shardings,
            )
            nll, greedy = np.asarray(self._fn(weights, batch))
            for i, row, at, n_ctx, n_cont in batch_docs:
                # Position p predicts token p + 1: the continuation's tokens are predicted at
                # at + n_ctx - 1 ... at + n_ctx + n_cont - 2.
                span = slice(at + n_ctx - 1, at + n_ctx + n_cont - 1)
                out[i] = Scored(
                    -float(np.sum(nll[row, span], dtype=np.float64)),
                    bool(np.all(greedy[row, span] == 1)),
                    n_cont,
                )
        return out  # type: ignore[return-value]

    def _document(self, i: int, ctx: list[int], cont: list[int]) -> tuple[int, list[int], int]:
        if len(cont) >= self.seq_len:
            raise TaskError(
                f"a continuation of {len(cont)} tokens does not fit a row of train.seq_len="
                f"{self.seq_len} after at least one context token: score with a longer "
                f"seq_len, or shorten the example."
            )
        if not ctx or not cont:
            raise TaskError(
                "an example with an empty context or continuation: give each at least one token."
            )
        keep = self.seq_len - len(cont)
        ctx = ctx[-keep:]  # a context too long for a row loses its start
        return i, ctx + cont, len(ctx)

    def _batches(self, docs):
        """([(pair index, row, start, context tokens, continuation tokens)], tokens, starts)
        per batch: the documents packed first-fit in order into rows, ``rows`` rows a batch."""
        length = self.seq_len
        rows: list[list[tuple[int, list[int], int]]] = [[]]
        used = [0]
        for doc in docs:
            if used[-1] + len(doc[1]) > length:
                rows.append([])
                used.append(0)
            rows[-1].append(doc)
            used[-1] += len(doc[1])
        for first in range(0, len(rows), self.rows):
            tokens = np.zeros((self.rows, length), np.int32)
            starts = np.zeros((self.rows, length), bool)
            starts[:, 0] = True
            placed = []
            for r, row in enumerate(rows[first : first + self.rows]):
                at = 0
                for i, ids, n_ctx in row:
                    tokens[r, at : at + len(ids)] = ids
                    starts[r, at] = True
                    placed.append((i, r, at, n_ctx, len(ids) - n_ctx))
                    at += len(ids)
                if at < length:
                    starts[r, at] = True  # the padding: a document of its own, never read
            yield placed, tokens, starts


@dataclasses.dataclass(frozen=True)
class TaskResult:
    """A task's scores: ``examples`` scored; multiple choice: ``acc``, ``acc_norm`` and their
    standard errors; continuation: ``nll`` (per token) and ``greedy`` (the share of examples
    greedy decoding reproduces) with its standard error."""

    name: str
    examples: int
    metrics: dict[str, float]

    def logged(self) -> dict[str, float]:
        """``{'task/<name>/acc': ...}``: the figures the training log and TensorBoard show."""
        return {task_figure(self.name, k): v for k, v in self.metrics.items() if "stderr" not in k}


def _mean_and_stderr(values: np.ndarray) -> tuple[float, float]:
    n = len(values)
    mean = float(np.mean(values))
    return mean, float(np.std(values, ddof=1) / math.sqrt(n)) if n > 1 else 0.0


def _result(task: Task, scored: list[Scored]) -> TaskResult:
    if not task.multiple_choice:
        nll = -sum(s.loglikelihood for s in scored) / sum(s.tokens for s in scored)
        greedy, err = _mean_and_stderr(np.array([s.greedy for s in scored], float))
        metrics = {"nll": nll, "greedy": greedy, "greedy_stderr": err}
        return TaskResult(task.name, len(task.examples), metrics)
    right, right_norm, at = [], [], 0
    for ex in task.examples:
        lls = np.array([s.loglikelihood for s in scored[at : at + len(ex.choices)]])
        at += len(ex.choices)
        chars = np.array([len(c) for c in ex.choices], float)
        right.append(int(np.argmax(lls)) == ex.answer)
        right_norm.append(int(np.argmax(lls / chars)) == ex.answer)
    acc, acc_err = _mean_and_stderr(np.array(right, float))
    norm, norm_err = _mean_and_stderr(np.array(right_norm, float))
    metrics = {"acc": acc, "acc_stderr": acc_err, "acc_norm": norm, "acc_norm_stderr": norm_err}
    return TaskResult(task.name, len(task.examples), metrics)


def score_tasks(scorer: Scorer, weights: Weights, tasks: Sequence[Task]) -> list[TaskResult]:
    """Each task's :class:`TaskResult`, every task's pairs scored together (one pass of
    packed batches)."""
    pairs = [p for t in tasks for ex in t.examples for p in ex.requests()]
    scored = scorer.score(weights, pairs)
    out, at = [], 0
    for t in tasks:
        n = sum(len(ex.requests()) for ex in t.examples)
        out.append(_result(t, scored[at : at + n]))
        at += n
    return out
