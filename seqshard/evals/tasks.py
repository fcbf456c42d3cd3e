"""Evaluation tasks: what a task file holds and how it is read.

A task file is JSON Lines, one example per line, of one of two kinds (by its keys):

    {"context": "def f(x):\\n", "choices": ["    return x\\n", "import os\\n"], "answer": 0}
    {"context": "The capital of France is", "continuation": " Paris"}

* **multiple choice** (``choices`` and ``answer``, the index of the right one): each choice's
  log-likelihood after the context is scored; the example is right when the answer's total
  log-likelihood is the highest (``acc``), and, length-normalized, when its log-likelihood
  per character of the choice is (``acc_norm``, as HellaSwag, ARC and PIQA score and as the
  lm-evaluation-harness does).
* **continuation**: the continuation's negative log-likelihood per token (``nll``), and
  whether greedy decoding would produce it (``greedy``: every token the argmax).

The task's name is the file's stem. A name that is no file may be a built-in task
(:data:`BUILTIN`): ``stdlib_next_line`` (:mod:`seqshard.evals.stdlib_task`), made from a data
directory's held-out documents.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

__all__ = [
    "BUILTIN",
    "Example",
    "Task",
    "TaskError",
    "load_task",
    "task_figure",
    "task_of_figure",
]

BUILTIN = ("stdlib_next_line",)
"""The tasks made from a prepared data directory rather than read from a file."""


def task_figure(name: str, metric: str) -> str:
    """The logged figure of a task's metric: ``'task/<name>/<metric>'``."""
    return f"task/{name}/{metric}"


def task_of_figure(key: str) -> tuple[str, str] | None:
    """(task, metric) of a :func:`task_figure` key; None for any other key."""
    if not key.startswith("task/"):
        return None
    _, name, metric = key.split("/", 2)
    return name, metric


class TaskError(ValueError):
    """A task file that cannot be read or holds a malformed example (the message says which)."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One example: a context and either its ``choices`` and ``answer`` (multiple choice) or
    one ``continuation``."""

    context: str
    choices: tuple[str, ...] = ()
    answer: int = -1
    continuation: str = ""

    @property
    def multiple_choice(self) -> bool:
        return bool(self.choices)

    def requests(self) -> list[tuple[str, str]]:
        """The (context, continuation) pairs it needs scored, in order."""
        if self.multiple_choice:
            return [(self.context, c) for c in self.choices]
        return [(self.context, self.continuation)]


@dataclasses.dataclass(frozen=True)
class Task:
    """A named list of examples, all of one kind."""

    name: str
    examples: tuple[Example, ...]

    @property
    def multiple_choice(self) -> bool:
        return bool(self.examples) and self.examples[0].multiple_choice

    def first(self, n: int) -> Task:
        """The task cut to its first ``n`` examples (0: all)."""
        return self if n <= 0 else dataclasses.replace(self, examples=self.examples[:n])


def _example(record: object, where: str) -> Example:
    if not isinstance(record, dict) or not isinstance(record.get("context"), str):
        raise TaskError(f"{where}: expected an object with a string 'context', got {record!r:.200}")
    if "choices" in record:
        choices, answer = record["choices"], record.get("answer")
        if (
            not isinstance(choices, list)
            or len(choices) < 2
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise TaskError(
                f"{where}: 'choices' must be a list of at least 2 non-empty strings, got "
                f"{choices!r:.200}"
            )
        if (
            not isinstance(answer, int)
            or isinstance(answer, bool)
            or not 0 <= answer < len(choices)
        ):
            raise TaskError(
                f"{where}: 'answer' must be the index of the right choice, 0 to "
                f"{len(choices) - 1}, got {answer!r}"
            )
        return Example(record["context"], tuple(choices), answer)
    continuation = record.get("continuation")
    if not isinstance(continuation, str) or not continuation:
        raise TaskError(
            f"{where}: an example needs 'choices' and 'answer' (multiple choice) or a non-empty "
            f"string 'continuation'; got keys {sorted(record)}"
        )
    return Example(record["context"], continuation=continuation)


def load_task(path: str | Path) -> Task:
    """The task in the JSON Lines file ``path`` (the module docstring), named by its stem.
    Raises TaskError naming the file and line of a malformed example."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise TaskError(
            f"task file {path}: {e.strerror or e}. Give a JSON Lines file of examples, or one "
            f"of the built-in tasks: {', '.join(BUILTIN)}."
        ) from None
    examples = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{path}:{i}: not JSON ({e.msg})") from None
        examples.append(_example(record, f"{path}:{i}"))
    if not examples:
        raise TaskError(f"task file {path} holds no examples.")
    kinds = {e.multiple_choice for e in examples}
    if len(kinds) > 1:
        raise TaskError(
            f"task file {path} mixes multiple-choice and continuation examples: one kind a file."
        )
    return Task(path.stem, tuple(examples))
