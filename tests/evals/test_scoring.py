"""Tests of seqshard.evals.scoring: continuations' log-likelihoods by the sharded model, packed
into rows, against the single-device reference's logits (log-softmax summed over the
continuation, in f64 on the host) on three meshes, dense and with experts; the metrics."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from model_weights import random_weights, tiny_model

from seqshard.data import load_tokenizer
from seqshard.evals.scoring import Scored, Scorer, TaskResult, _result, score_tasks, split_tokens
from seqshard.evals.tasks import Example, Task, TaskError
from seqshard.mesh import mesh_of_sizes
from seqshard.model import reference_logits_fn, weight_structs
from seqshard.model.config import MoEConfig

PAIRS = [
    ("def f0_1(x, y):\n", "    return x * 1 + y\n"),
    ("import", " os\n"),
    ("class A:\n    def g(self):\n        return 1\n" * 3, "    x = 2\n"),
    ("#", " a comment that runs on for a while, longer than its context\n"),
    ("x = [", "1, 2, 3]\n"),
] * 3


def _reference(cfg, weights, tok, pairs, seq_len: int) -> list[tuple[float, bool]]:
    """Each pair alone at the start of a row of ``seq_len`` (its context cut to its last
    seq_len - continuation tokens, as the scorer cuts it; causal attention: what follows it in
    the row changes nothing): the reference's logits, log-softmax in f64."""
    ids = np.zeros((len(pairs), seq_len), np.int32)
    spans = []
    for i, (context, continuation) in enumerate(pairs):
        ctx, cont = split_tokens(tok, context, continuation)
        ctx = ctx[-(seq_len - len(cont)) :]
        ids[i, : len(ctx) + len(cont)] = ctx + cont
        spans.append(range(len(ctx) - 1, len(ctx) + len(cont) - 1))
    starts = np.zeros_like(ids, bool)
    starts[:, 0] = True
    logits = np.asarray(jax.jit(reference_logits_fn, static_argnums=3)(weights, ids, starts, cfg))
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.sum(np.exp(logits - top), -1, keepdims=True))
    out = []
    for i, span in enumerate(spans):
        total = sum(logp[i, p, ids[i, p + 1]] for p in span)
        greedy = all(np.argmax(logits[i, p]) == ids[i, p + 1] for p in span)
        out.append((total, greedy))
    return out


@pytest.fixture(scope="module")
def tok(data_dir):
    return load_tokenizer(data_dir / "tokenizer.json")


CASES = {
    "d2t4": ({"d": 2, "t": 4}, {}),
    "c2d2t2": ({"c": 2, "d": 2, "t": 2}, {}),
    "e2d2t2 experts": (
        {"e": 2, "d": 2, "t": 2},
        {"moe": MoEConfig(n_experts=4, top_k=2, d_ff=32, n_shared=1, n_dense_layers=1)},
    ),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_scores_equal_the_single_device_reference(case, tok):
    """15 pairs packed 4 rows x 64 tokens at a time (several batches, pairs crossing into the
    next row): each log-likelihood within 1e-4 of the reference's (f32 model, sums of up to
    ~20 tokens), greedy flags equal."""
    sizes, changes = case
    cfg = tiny_model(vocab=320, **changes)
    weights = random_weights(cfg)
    mesh = mesh_of_sizes(sizes)
    placed = jax.device_put(weights, jax.tree.map(lambda s: s.sharding, weight_structs(cfg, mesh)))
    scored = Scorer(cfg, mesh, tok, rows=4, seq_len=64).score(placed, PAIRS)
    want = _reference(cfg, weights, tok, PAIRS, 64)
    for s, (total, greedy) in zip(scored, want, strict=True):
        np.testing.assert_allclose(s.loglikelihood, total, rtol=1e-5, atol=1e-4)
        assert s.greedy == greedy


def test_a_long_context_loses_its_start_and_a_long_continuation_is_refused(tok):
    cfg = tiny_model(vocab=320)
    weights = random_weights(cfg)
    mesh = mesh_of_sizes({})
    scorer = Scorer(cfg, mesh, tok, rows=2, seq_len=16)
    ctx, cont = split_tokens(tok, "x = 1\n" * 20, "y = 2\n")
    (long,) = scorer.score_ids(weights, [(ctx, cont)])
    (cut,) = scorer.score_ids(weights, [(ctx[-(16 - len(cont)) :], cont)])
    assert long == cut and long.tokens == len(cont)
    with pytest.raises(TaskError, match="does not fit a row of train.seq_len=16"):
        scorer.score_ids(weights, [([1], list(range(2, 20)))])
    with pytest.raises(TaskError, match="empty context"):
        scorer.score_ids(weights, [([], [3])])


def test_the_metrics_of_a_multiple_choice_task():
    """acc: the largest total; acc_norm: the largest per character; stderr: sample std / sqrt(n)."""
    task = Task(
        "t",
        (
            Example("c", ("a", "bbbb"), 1),  # totals prefer a (-1 > -2); per char bbbb (-0.5 > -1)
            Example("c", ("a", "bbbb"), 0),
        ),
    )
    scored = [Scored(-1.0, False, 1), Scored(-2.0, False, 2)] * 2
    result = _result(task, scored)
    assert result.metrics["acc"] == 0.5 and result.metrics["acc_norm"] == 0.5
    assert result.metrics["acc_stderr"] == pytest.approx(0.5)  # std(ddof=1) 0.707 / sqrt(2)
    assert result.logged() == {"task/t/acc": 0.5, "task/t/acc_norm": 0.5}


def test_a_continuation_task_reports_loss_per_token_and_greedy_share(tok):
    cfg = tiny_model(vocab=320)
    weights = random_weights(cfg)
    scorer = Scorer(cfg, mesh_of_sizes({}), tok, rows=2, seq_len=64)
    task = Task("c", tuple(Example(c, continuation=x) for c, x in PAIRS[:5]))
    (result,) = score_tasks(scorer, weights, [task])
    scored = scorer.score(weights, PAIRS[:5])
    want = -sum(s.loglikelihood for s in scored) / sum(s.tokens for s in scored)
    assert isinstance(result, TaskResult) and result.examples == 5
    assert result.metrics["nll"] == pytest.approx(want)
    assert 0 <= result.metrics["greedy"] <= 1
