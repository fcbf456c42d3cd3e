"""eval.tasks during training (seqshard.train.loop with seqshard.evals): scored beside the
validation loss, logged, the same after a resume, and changing nothing of the training: the
losses are bit for bit those of the same run without tasks."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from process_helpers import SEQSHARD, xla_flags
from run_helpers import TRAINED_RUN, by_step, run

TASKS = "eval.tasks=[{path: stdlib_next_line, examples: 12}]"


@pytest.fixture(scope="module")
def with_tasks(tmp_path_factory, tiny_overrides):
    root = tmp_path_factory.mktemp("task_runs")
    run([*tiny_overrides(root, "straight", **TRAINED_RUN), TASKS])
    return root


def test_tasks_are_logged_and_change_no_loss(with_tasks, trained_run):
    _, plain_dir = trained_run
    plain, tasks = by_step(plain_dir), by_step(with_tasks / "straight")
    assert sorted(plain) == sorted(tasks) == list(range(1, 7))
    for step in range(1, 7):
        for key in ("loss", "grad_norm", "val_loss"):
            assert tasks[step].get(key) == plain[step].get(key), (step, key)
    for step in (3, 6):  # eval_every=3
        acc = tasks[step]["task/stdlib_next_line/acc"]
        assert 0 <= acc <= 1 and "task/stdlib_next_line/acc_norm" in tasks[step]
        assert tasks[step]["task_eval_s"] > 0
    assert not any(k.startswith("task/") for k in tasks[4])


@pytest.mark.slow
def test_a_resumed_run_scores_the_same_tasks(with_tasks, tiny_overrides):
    root = with_tasks
    run([*tiny_overrides(root, "resumed", **{**TRAINED_RUN, "steps": 3}), TASKS])
    run([*tiny_overrides(root, "resumed", **TRAINED_RUN), TASKS])
    straight, resumed = by_step(root / "straight"), by_step(root / "resumed")
    for key in ("task/stdlib_next_line/acc", "task/stdlib_next_line/acc_norm", "loss"):
        assert resumed[6][key] == straight[6][key], key


@pytest.mark.slow
def test_seqshard_eval_tasks_prints_a_table_and_json(with_tasks, tmp_path):
    task = tmp_path / "two.jsonl"
    task.write_text(
        json.dumps(
            {"context": "def f(x, y):\n", "choices": ["    return x\n", "import os\n"], "answer": 0}
        )
        + "\n"
    )
    run_dir = with_tasks / "straight"
    cmd = [
        *SEQSHARD,
        "eval",
        str(run_dir),
        "--tasks",
        "stdlib_next_line",
        str(task),
        "--examples",
        "5",
    ]
    env = {**os.environ, "XLA_FLAGS": xla_flags(8)}
    table = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert table.returncode == 0, table.stderr
    assert "task" in table.stdout and "stdlib_next_line" in table.stdout and "two" in table.stdout
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    assert results["step"] == 6
    names = {t["task"]: t for t in results["tasks"]}
    assert names["stdlib_next_line"]["examples"] == 5 and names["two"]["examples"] == 1
    assert {"acc", "acc_norm", "acc_stderr", "acc_norm_stderr"} <= set(names["two"])
    bad = subprocess.run(
        [*SEQSHARD, "eval", str(run_dir), "--tasks", str(tmp_path / "none.jsonl")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2 and "none.jsonl" in bad.stderr and "Traceback" not in bad.stderr
