"""Tests of fine-tuning data (seqshard.data.sft and prepare's loss masks): prompt/completion and
chat records tokenized with a mask that counts exactly the completions and assistant turns, the
mask carried into the loader's batches, and every bad record named by file and line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from data_helpers import SEQ_LEN, _loader

from seqshard.data.corpus import path_corpus
from seqshard.data.prepare import PrepareConfig, prepare
from seqshard.data.sft import find_chat_template, load_chat_template
from seqshard.data.tokenfile import open_split
from seqshard.data.tokenizer import load_tokenizer

TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHATS = [
    {
        "messages": [
            {"role": "user", "content": f"what is {i} plus {i}?"},
            {"role": "assistant", "content": f"it is {2 * i}."},
            {"role": "user", "content": "and doubled?"},
            {"role": "assistant", "content": f"then {4 * i}."},
        ]
    }
    for i in range(30)
]
PAIRS = [{"prompt": f"Q: name {i}\nA:", "completion": f" the number {i}"} for i in range(30)]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("sft")
    (root / "chat.jinja").write_text(TEMPLATE)
    inputs = [_write_jsonl(root / "chats.jsonl", CHATS), _write_jsonl(root / "pairs.jsonl", PAIRS)]
    template = load_chat_template(root / "chat.jinja")
    corpus = path_corpus(inputs, chat_template=template)
    config = PrepareConfig(tokenizer_path=data_dir / "tokenizer.json", val_fraction=0.2)
    return prepare(root / "tokens", corpus, config, log=None)


def _counted_text(data_dir, split="train") -> list[str]:
    """Each document's counted tokens, decoded, and its whole text."""
    data = open_split(data_dir, split)
    tok = load_tokenizer(data_dir / "tokenizer.json")
    tokens, _, mask = data.read(0, data.n_tokens)
    out = []
    for i in range(data.n_docs):
        lo, hi = data.shards[0].offsets[i], data.shards[0].offsets[i + 1]
        ids, m = tokens[lo:hi], mask[lo:hi]
        out.append(
            (
                tok.decode(ids[m].tolist(), skip_special_tokens=False),
                tok.decode(ids.tolist(), skip_special_tokens=False),
            )
        )
    return out


def test_masks_count_the_completions_and_assistant_turns(sft_dir):
    data = open_split(sft_dir, "train")
    assert data.has_mask and data.shards[0].mask is not None
    docs = _counted_text(sft_dir) + _counted_text(sft_dir, "val")
    assert len(docs) == len(CHATS) + len(PAIRS)
    for counted, whole in docs:
        if whole.startswith("<|user|>"):  # a chat: both assistant turns and their end markers
            i = int(whole.split("what is ")[1].split(" ")[0])
            assert counted == f"it is {2 * i}.<|end|>\nthen {4 * i}.<|end|>\n", (counted, whole)
        else:  # prompt/completion: the completion and the end of text
            i = int(whole.split("name ")[1].split("\n")[0])
            assert counted == f" the number {i}<|endoftext|>", (counted, whole)


def test_the_loader_carries_the_mask(sft_dir, mesh):
    with _loader(sft_dir, mesh, batch_size=4, seq_len=SEQ_LEN, prefetch=0) as loader:
        batch = loader.batch_at(0)
        want = loader.stream.rows(np.arange(4))[2]
    mask = np.asarray(batch.loss_mask)
    assert np.array_equal(mask, want) and 0 < mask.mean() < 1


def test_plain_text_has_no_mask(data_dir):
    assert not open_split(data_dir, "train").has_mask


@pytest.mark.parametrize(
    "record, template, message",
    [
        (
            {"messages": [{"role": "user", "content": "hi"}]},
            TEMPLATE,
            r"bad\.jsonl:1: the chat has no assistant turn",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "yo"},
                ]
            },
            None,
            r"bad\.jsonl:1: a chat record needs a chat template.*--chat-template",
        ),
        (
            {"messages": [{"role": "assistant", "content": "yo"}]},
            "{{ raise_exception('no system turn') }}",
            r"bad\.jsonl:1: the chat template of .*cannot render this record: TemplateError: no system turn",
        ),
        (
            {"prompt": "a", "completion": 3},
            None,
            r"bad\.jsonl:1: a prompt/completion record needs string fields.*'completion' is int",
        ),
        (
            {"title": "x"},
            None,
            r'bad\.jsonl:1: expected a JSON object with a string "text" field, "prompt" and "completion", or chat "messages"',
        ),
        (
            {"messages": [{"role": "assistant", "content": None}]},
            TEMPLATE,
            r"messages\[0\] \(assistant\) needs a string 'content'",
        ),
    ],
    ids=[
        "no-assistant",
        "no-template",
        "template-fails",
        "non-string",
        "no-known-field",
        "bad-content",
    ],
)
def test_bad_records_are_named_by_file_and_line(tmp_path, record, template, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", [record])
    chat = None
    if template is not None:
        (tmp_path / "t.jinja").write_text(template)
        chat = load_chat_template(tmp_path / "t.jinja")
    with pytest.raises(ValueError, match=message):
        list(path_corpus([path], chat_template=chat))


def test_finding_a_chat_template(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    assert find_chat_template(None, tmp_path / "tokenizer.json") is None
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": TEMPLATE, "eos_token": "</s>"})
    )
    found = find_chat_template(None, tmp_path / "tokenizer.json")
    assert found.text == TEMPLATE and found.eos_token == "</s>"
    assert load_chat_template(tmp_path).text == TEMPLATE  # a model directory
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has no chat template.*--chat-template"):
        load_chat_template(tmp_path / "empty")


@pytest.mark.parametrize(
    ("template", "end"),
    [
        (TEMPLATE, "<|end|>"),
        (  # ChatML, as Qwen's tokenizer_config.json holds it
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "<|im_end|>",
        ),
        (  # nothing after a reply: no end to stop at
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}",
            None,
        ),
    ],
)
def test_a_templates_user_turn_and_end_of_turn(tmp_path, template, end):
    (tmp_path / "t.jinja").write_text(template)
    chat = load_chat_template(tmp_path / "t.jinja")
    assert chat.end_of_turn() == end
    messages = [{"role": "user", "content": "hi?"}]
    assert chat.user_turn("hi?") == chat.render(messages, True, "test")
    # The turn the template adds for a reply is the reply, then the end (and whitespace).
    reply = chat.render([*messages, {"role": "assistant", "content": "yes."}], False, "test")
    assert reply.removeprefix(chat.user_turn("hi?")).strip() == "yes." + (end or "")


def test_a_template_that_does_not_render_turn_by_turn_has_no_end_of_turn(tmp_path):
    # The generation prompt is not where the reply's turn starts: the end cannot be located.
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages %}[{{ m.content }}]{% endfor %}"
        "{% if add_generation_prompt %}<reply>{% endif %}"
    )
    with pytest.raises(ValueError, match=r"does not render a reply.*pass the end as --stop"):
        load_chat_template(tmp_path / "t.jinja").end_of_turn()
