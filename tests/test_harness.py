"""The lm-evaluation-harness bridge (seqshard.harness): the harness's own evaluation of a
local task (a YAML-style config over a local JSON Lines file, no network) through the model
``seqshard`` gives the accuracies ``seqshard eval --tasks`` gives on the same items."""

from __future__ import annotations

import json

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="the eval extra: pip install -e '.[eval]'")

from lm_eval.tasks import TaskManager  # noqa: E402

from seqshard.data.tokenizer import encode  # noqa: E402
from seqshard.evals.scoring import score_tasks  # noqa: E402
from seqshard.evals.stdlib_task import stdlib_next_line  # noqa: E402
from seqshard.harness import SeqshardLM  # noqa: E402


@pytest.fixture(scope="module")
def model(trained_run):
    _, run_dir = trained_run
    return SeqshardLM(run_dir=str(run_dir))


def test_the_harness_scores_a_local_task_as_seqshard_eval_does(model, data_dir, tmp_path):
    task = stdlib_next_line(data_dir)
    rows = [
        {"context": e.context, "choices": list(e.choices), "answer": e.answer}
        for e in task.examples
    ]
    path = tmp_path / "next_line.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "task": "seqshard_next_line",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(path)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "context",  # the fields themselves (a template would re-render them)
        "doc_to_choice": "choices",
        "doc_to_target": "answer",
        "target_delimiter": "",  # the choices are the whole next line, as seqshard scores them
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0},
    }
    out = lm_eval.simple_evaluate(
        model=model,
        tasks=[config],
        task_manager=TaskManager(include_defaults=False),
        log_samples=False,
        torch_random_seed=None,
    )
    harness = out["results"]["seqshard_next_line"]
    (ours,) = score_tasks(model.scorer, model.weights, [task])
    assert harness["acc,none"] == pytest.approx(ours.metrics["acc"], abs=1e-12)
    assert harness["acc_norm,none"] == pytest.approx(ours.metrics["acc_norm"], abs=1e-12)
    assert harness["acc_stderr,none"] == pytest.approx(ours.metrics["acc_stderr"])


class _Request:
    def __init__(self, *args):
        self.args = args


@pytest.mark.slow
def test_rolling_loglikelihood_and_generation(model):
    """A text's rolling log-likelihood is the sum over its tokens after <|endoftext|>, in
    windows of train.seq_len (here 32: the text spans 3); generation stops at ``until``."""
    text = "def f(x, y):\n    return x * 2 + y  # a comment\n" * 3
    (rolled,) = model.loglikelihood_rolling([_Request(text)])
    ids = encode(model.tokenizer, text)
    assert len(ids) > 2 * model.cfg.train.seq_len
    one = sum(s.loglikelihood for s in model.scorer.score_ids(model.weights, [([0], ids[:31])]))
    assert np.isfinite(rolled) and rolled < one < 0  # more tokens, more negative
    (text_out,) = model.generate_until([_Request("def f", {"until": ["\n"], "max_gen_toks": 8})])
    assert isinstance(text_out, str) and "\n" not in text_out
