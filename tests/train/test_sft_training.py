"""Fine-tuning a run: init.from_run starts from another run's newest weights, and a chat set
prepared on first use trains with its prompts masked out (configs/sft-tiny-cpu.yaml's recipe,
on the tests' tiny model and corpus)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from run_helpers import by_step, latest_state, run

from seqshard.config import ConfigError, load_config
from seqshard.train.loop import evaluate, train
from seqshard.train.metrics import format_line

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def sft_overrides(tmp_path_factory, data_dir, tiny_overrides, trained_run):
    root = tmp_path_factory.mktemp("sft")
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"the word after {w}?"},
                {"role": "assistant", "content": f"{w} and then {w} again, of course."},
            ]
        }
        for w in ("def", "class", "return", "import", "lambda", "yield") * 8
    ]
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    (root / "chat.jinja").write_text(TEMPLATE)
    _, source = trained_run

    def make(name, **train):
        return [
            *tiny_overrides(root / "runs", name, **train),
            f"init.from_run={source}",
            f"data.dir={root / 'chat-tokens'}",
            f"data.inputs=[{root / 'chats.jsonl'}]",
            f"data.tokenizer={data_dir / 'tokenizer.json'}",
            f"data.chat_template={root / 'chat.jinja'}",
            "data.val_fraction=0.25",
        ]

    return make, source


def test_a_run_fine_tunes_from_another_run_with_prompts_masked(sft_overrides, trained_run):
    make, source = sft_overrides
    overrides = make("still", steps=1, checkpoint_every=1, eval_every=0)
    cfg = load_config(None, overrides)
    result = run(overrides)
    # Step 1 of the warmup has lr 0: the weights are the source run's newest, as restored.
    got = latest_state(result.run_dir, cfg).weights
    want = latest_state(source, trained_run[0]).weights
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    first = by_step(result.run_dir)[1]
    # Only the assistant turns count: well under the batch's 8 x 32 positions.
    assert 0 < first["tokens_counted"] < 0.8 * 8 * 31


def test_a_missing_from_run_stops_before_the_run_directory_is_written(sft_overrides, tmp_path):
    make, _ = sft_overrides
    missing = tmp_path / "no-such-run"
    overrides = [*make("orphan"), f"init.from_run={missing}"]
    with pytest.raises(ConfigError, match=rf"init\.from_run={missing}: .* is not a run directory"):
        run(overrides)
    assert not (load_config(None, overrides).run.dir / Path("orphan")).exists()


def test_from_run_refuses_a_model_of_other_shapes(sft_overrides):
    make, _ = sft_overrides
    with pytest.raises(ConfigError, match=r"init\.from_run=.*do not fit this model \(model\.d_ff"):
        run([*make("other"), "model.d_ff=128"])


def test_prompts_longer_than_a_row_are_warned_of_and_a_loss_over_no_token_is_na(
    tmp_path, data_dir, tiny_overrides
):
    """Fault 15 of the second campaign: records whose prompt is longer than seq_len gave no
    warning, and the steps whose rows held only prompt tokens logged `loss 0` (and a val loss
    of 0.0000), which reads as a perfect model. Now the start warns how many records have
    such prompts, and a loss over no counted token is absent from metrics.jsonl and shown n/a."""
    import random

    rng = random.Random(0)
    words = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "data", "model", "train")
    records = [
        {"prompt": " ".join(rng.choice(words) for _ in range(400)), "completion": " ok."}
        for _ in range(30)
    ]
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    overrides = [
        *tiny_overrides(tmp_path / "runs", "long", steps=6, eval_batches=1),
        f"data.dir={tmp_path / 'long-tokens'}",
        f"data.inputs=[{tmp_path / 'long.jsonl'}]",
        f"data.tokenizer={data_dir / 'tokenizer.json'}",
        "data.val_fraction=0.2",
    ]
    lines: list[str] = []
    result = train(load_config(None, overrides), log=lines.append, tty=False)
    warning = [line for line in lines if "fine-tuning records" in line]
    assert len(warning) == 1, lines
    assert re.search(
        r"warning: 2[0-9] of 2[0-9] fine-tuning records in .*long-tokens have a "
        r"prompt of train\.seq_len=32 tokens or more",
        warning[0],
    ), warning
    records = by_step(result.run_dir)
    empty = [s for s, r in records.items() if r["tokens_counted"] == 0]
    assert empty and all("loss" not in records[s] for s in empty), records
    assert all("loss" in r for r in records.values() if r["tokens_counted"] > 0)
    assert format_line(1, 6, {"loss": math.nan, "tokens_counted": 0}, ["loss"]).startswith(
        "step 1/6  loss n/a"
    )
    # Validation over rows that count nothing: no loss (printed n/a), not 0.
    nothing = lambda weights, batch: np.zeros(2)  # noqa: E731 (summed loss, count)
    assert evaluate(nothing, None, [None, None]) is None
