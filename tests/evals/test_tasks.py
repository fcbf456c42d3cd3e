"""Tests of seqshard.evals.tasks (task files) and seqshard.evals.stdlib_task (the task made from
the held-out files)."""

from __future__ import annotations

import json

import pytest

from seqshard.data.tokenfile import open_split
from seqshard.data.tokenizer import decode, load_tokenizer
from seqshard.evals.configured import read_task
from seqshard.evals.stdlib_task import stdlib_next_line
from seqshard.evals.tasks import TaskError, load_task


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_a_task_file_of_each_kind(tmp_path):
    mc = load_task(
        _write(tmp_path / "mc.jsonl", [{"context": "a", "choices": ["b", "c"], "answer": 1}])
    )
    assert (
        mc.name == "mc"
        and mc.multiple_choice
        and mc.examples[0].requests() == [("a", "b"), ("a", "c")]
    )
    cont = load_task(_write(tmp_path / "lm.jsonl", [{"context": "a", "continuation": " b"}] * 3))
    assert not cont.multiple_choice and len(cont.first(2).examples) == 2


@pytest.mark.parametrize(
    "records,message",
    [
        ([{"context": "a", "choices": ["b"], "answer": 0}], "at least 2 non-empty strings"),
        ([{"context": "a", "choices": ["b", "c"], "answer": 2}], "'answer' must be the index"),
        ([{"context": "a"}], "needs 'choices' and 'answer'"),
        ([{"text": "a"}], "a string 'context'"),
        (
            [
                {"context": "a", "continuation": "b"},
                {"context": "a", "choices": ["b", "c"], "answer": 0},
            ],
            "mixes multiple-choice and continuation",
        ),
    ],
)
def test_a_malformed_task_file_is_refused_naming_the_line(tmp_path, records, message):
    with pytest.raises(TaskError, match=message):
        load_task(_write(tmp_path / "bad.jsonl", records))


def test_a_missing_or_non_json_file_is_named(tmp_path):
    with pytest.raises(TaskError, match="nothere.jsonl.*built-in tasks: stdlib_next_line"):
        load_task(tmp_path / "nothere.jsonl")
    (tmp_path / "x.jsonl").write_text('{"context": "a", "continuation": "b"}\nnot json\n')
    with pytest.raises(TaskError, match=r"x.jsonl:2: not JSON"):
        load_task(tmp_path / "x.jsonl")


def test_the_stdlib_task_is_made_deterministically_from_the_held_out_files(data_dir):
    """The same examples twice; each: 4 choices, the right one the real next line of its
    function in a validation document, the others other documents' lines re-indented."""
    task = stdlib_next_line(data_dir)
    assert task == stdlib_next_line(data_dir) == read_task("stdlib_next_line", data_dir)
    assert task.name == "stdlib_next_line" and len(task.examples) >= 5
    split = open_split(data_dir, "val")
    tok = load_tokenizer(data_dir / "tokenizer.json")
    texts = [decode(tok, split.doc(i), skip_special_tokens=True) for i in range(split.n_docs)]
    for ex in task.examples:
        assert len(ex.choices) == 4 and len(set(ex.choices)) == 4
        right = ex.choices[ex.answer]
        assert ex.context.lstrip().startswith("def ")
        home = [t for t in texts if _next_line(t, ex.context) == right]
        assert home, "the right choice is the next non-blank line after its context"
        indent = right[: len(right) - len(right.lstrip())]
        for wrong in (c for i, c in enumerate(ex.choices) if i != ex.answer):
            assert wrong.startswith(indent) and wrong.strip() != right.strip()


def _next_line(text: str, context: str) -> str | None:
    """The first non-blank line after ``context`` in ``text`` (with its newline), if there."""
    at = text.find(context)
    if at < 0:
        return None
    rest = text[at + len(context) :].splitlines(keepends=True)
    return next((line for line in rest if line.strip()), None)
