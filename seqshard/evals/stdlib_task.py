"""The task that ships with the repo: the next line of a function in held-out Python files.

Made deterministically from a prepared data directory's validation split (the documents
``seqshard prepare`` holds out of training; for the main job, 7 files of the Python standard
library): for each ``def`` in those files, the context is the ``def`` line and the lines after
it up to a point drawn by a seeded generator (0 to 2 more, stopping before a blank line), the
right choice is the next non-blank line, and the three others are lines drawn from *other*
files (4 to 100 characters, as the right one), re-indented as the right one, so indentation gives nothing away. The choices are
shuffled by the same generator. Chance is 1/4; a model that has learned Python's shapes
(``self.x = x`` after ``def __init__(self, x):``, a docstring after a ``def``) beats it.

    task = stdlib_next_line("data/stdlib")          # Task 'stdlib_next_line'
"""

from __future__ import annotations

import random
from pathlib import Path

from seqshard.data.tokenfile import open_split
from seqshard.data.tokenizer import decode, load_tokenizer
from seqshard.evals.tasks import Example, Task, TaskError

__all__ = ["SEED", "stdlib_next_line"]

SEED = 0
"""The generator's seed: the task is the same for the same data directory."""

_MIN_CHARS = 4  # a line shorter than this (stripped) is no choice: ')' or 'pass' say little
_MAX_CHARS = 100  # nor a longer one (prose, data): a choice fits a row of a small seq_len


def _files(data_dir: Path) -> list[list[str]]:
    split = open_split(data_dir, "val")
    tok = load_tokenizer(Path(data_dir) / split.meta.get("tokenizer", "tokenizer.json"))
    texts = [decode(tok, split.doc(i), skip_special_tokens=True) for i in range(split.n_docs)]
    return [t.splitlines() for t in texts]


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def stdlib_next_line(data_dir: str | Path) -> Task:
    """The task from ``data_dir``'s validation documents (the module docstring). Raises
    TaskError when they hold no function with a next line and three other files' lines."""
    files = _files(Path(data_dir))
    pool = [
        (f, line.strip())
        for f, lines in enumerate(files)
        for line in lines
        if _MIN_CHARS <= len(line.strip()) <= _MAX_CHARS
    ]
    rng = random.Random(SEED)
    examples = []
    for f, lines in enumerate(files):
        others = [text for g, text in pool if g != f]
        for i, line in enumerate(lines):
            if not line.lstrip().startswith("def "):
                continue
            end = i + 1 + rng.randrange(3)  # the def line and 0 to 2 more
            context = lines[i:end]
            if any(not x.strip() or len(x) > _MAX_CHARS for x in context[1:]):
                continue  # the function ended (or paused) inside the context
            nxt = next((j for j in range(end, len(lines)) if lines[j].strip()), None)
            if nxt is None or not _MIN_CHARS <= len(lines[nxt].strip()) <= _MAX_CHARS:
                continue
            right = lines[nxt]
            drawn = rng.sample(others, min(6, len(others)))  # 6: room for one equal to right
            wrong = [t for t in drawn if t != right.strip()][:3]
            if len(wrong) < 3:
                continue
            choices = [right] + [_indent(right) + t for t in wrong]
            order = list(range(4))
            rng.shuffle(order)
            examples.append(
                Example(
                    "\n".join(context) + "\n",
                    tuple(choices[k] + "\n" for k in order),
                    order.index(0),
                )
            )
    if not examples:
        raise TaskError(
            f"{data_dir}: its validation documents hold no function with a next line (the "
            f"stdlib_next_line task needs Python files among them; data.val_fraction holds "
            f"some out)."
        )
    rng.shuffle(examples)
    return Task("stdlib_next_line", tuple(examples))
