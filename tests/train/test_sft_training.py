"""Fine-tuning a run: init.from_run starts from another run's newest weights, and a chat set
prepared on first use trains with its prompts masked out (configs/sft-tiny-cpu.yaml's recipe,
on the tests' tiny model and corpus)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from run_helpers import by_step, latest_state, run

from seqshard.config import ConfigError, load_config

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


def test_from_run_refuses_a_model_of_other_shapes(sft_overrides):
    make, _ = sft_overrides
    with pytest.raises(ConfigError, match=r"init\.from_run=.*do not fit this model \(model\.d_ff"):
        run([*make("other"), "model.d_ff=128"])
