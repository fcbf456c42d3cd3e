"""The tasks a config names (``eval.tasks``), read or made, and one scorer for them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from jax.sharding import Mesh

from seqshard.data.tokenizer import load_tokenizer
from seqshard.evals.scoring import Scorer, TaskResult, score_tasks
from seqshard.evals.stdlib_task import stdlib_next_line
from seqshard.evals.tasks import BUILTIN, Task, load_task
from seqshard.model.config import ModelConfig
from seqshard.model.weights import Weights

__all__ = ["make_task_eval", "read_task", "timed"]


def read_task(path: str, data_dir: str | Path) -> Task:
    """The task ``path`` names: a built-in one (made from ``data_dir``) or a task file."""
    if path in BUILTIN and not Path(path).exists():
        return stdlib_next_line(data_dir)
    return load_task(path)


def make_task_eval(
    model: ModelConfig,
    mesh: Mesh,
    data_dir: str | Path,
    tasks: Sequence[tuple[str, int]],
    rows: int,
    seq_len: int,
) -> Callable[[Weights], list[TaskResult]] | None:
    """``evaluate(weights) -> [TaskResult]`` over ``tasks`` ((path, examples) each; 0: all),
    read once here; None without tasks. Rows of ``rows`` x ``seq_len`` tokens."""
    if not tasks:
        return None
    read = [read_task(path, data_dir).first(n) for path, n in tasks]
    tok = load_tokenizer(Path(data_dir) / "tokenizer.json")
    scorer = Scorer(model, mesh, tok, rows, seq_len)
    for (path, _), task in zip(tasks, read, strict=True):
        scorer.check([p for ex in task.examples for p in ex.requests()], f"task {path}")

    def evaluate(weights: Weights) -> list[TaskResult]:
        return score_tasks(scorer, weights, read)

    return evaluate


def timed(evaluate: Callable[[Weights], list[TaskResult]], weights: Weights) -> dict[str, float]:
    """The logged figures of ``evaluate(weights)`` and ``task_eval_s``, the seconds it took."""
    t0 = time.perf_counter()
    out: dict[str, float] = {}
    for result in evaluate(weights):
        out.update(result.logged())
    out["task_eval_s"] = time.perf_counter() - t0
    return out
