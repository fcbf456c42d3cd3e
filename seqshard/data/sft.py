"""Fine-tuning records: prompt and completion, or chat messages, as text pieces that count in
the loss or not.

    {"prompt": "Q: what does os.getcwd return?\\nA:", "completion": " the current directory"}
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}

A record becomes :class:`Pieces`: ``(text, counted)`` in order. Prompt and completion: the
prompt not counted, the completion counted, and (``prepare`` appends it) the end-of-text token
counted, so the model learns to stop. Chat messages are rendered by a chat template (Jinja, as
Hugging Face's ``tokenizer_config.json`` holds it): each assistant turn's span is what rendering
``messages[:i + 1]`` adds to rendering ``messages[:i]`` with the generation prompt, so it holds
the turn's content and the template's end-of-turn text, counted; everything else (system and
user turns, the role headers, the generation prompts) is not. ``prepare`` encodes each piece
separately, so a token never straddles a counted and an uncounted span.

    template = load_chat_template("path/to/hf_model")   # tokenizer_config.json's chat_template
    pieces = record_pieces(record, template, where="chat.jsonl:3")

Generating a reply (``seqshard generate --chat``) renders a user message with the generation
prompt (:meth:`ChatTemplate.user_turn`) and stops at the template's end of turn
(:meth:`ChatTemplate.end_of_turn`, found by rendering, as the assistant spans above are).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

__all__ = [
    "ChatTemplate",
    "Pieces",
    "find_chat_template",
    "load_chat_template",
    "record_kind",
    "record_pieces",
]

_TEMPLATE_KEY = "chat_template"
_CONFIG_FILE = "tokenizer_config.json"
# Where a user gives a template: the errors below name both (a config is read by train).
_GIVE_TEMPLATE = "data.chat_template in a config, --chat-template on the command line"


@dataclasses.dataclass(frozen=True)
class Pieces:
    """A fine-tuning document: its text in order, each piece counted in the loss or not, and
    whether the end-of-text token ``prepare`` appends counts (a completion's end: the model
    learns to stop; a chat's: the template's end-of-turn already taught it)."""

    parts: tuple[tuple[str, bool], ...]
    end_counted: bool = False

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.parts)

    def __len__(self) -> int:  # what the corpus's emptiness check reads
        return len(self.text)


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the file it came from (named in errors), with the
    ``bos_token`` and ``eos_token`` it renders (those of its tokenizer_config.json; a .jinja
    file's: empty)."""

    source: str
    text: str
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
        import jinja2  # noqa: PLC0415 -- only fine-tuning data needs it

        try:
            env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            return env.from_string(self.text).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
            raise ValueError(
                f"{where}: the chat template of {self.source} cannot render this record: "
                f"{type(e).__name__}: {e}. Fix the record, or give a template that renders it "
                f"({_GIVE_TEMPLATE})."
            ) from None

    def user_turn(self, content: str) -> str:
        """The prompt that asks for a reply to the user message ``content``: the chat
        ``[{role: user, content}]`` rendered with the generation prompt."""
        return self.render([{"role": "user", "content": content}], True, "a user message")

    def end_of_turn(self) -> str | None:
        """What the template writes after an assistant message's content, without the
        whitespace around it (``<|end|>``, ChatML's ``<|im_end|>``): where a reply ends. None
        if it writes nothing there. Found by rendering a chat whose reply is a marker: the text
        after the marker in what the reply's turn adds (as :func:`record_pieces` finds it)."""
        marker = "seqshard-probe-reply"
        chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": marker}]
        where = "a probe chat (finding the end of an assistant turn)"
        before = self.render(chat[:1], True, where)
        after = self.render(chat, False, where)
        turn = after[len(before) :] if after.startswith(before) else ""
        if marker not in turn:
            raise ValueError(
                f"the chat template of {self.source} does not render a reply as the text after "
                f"the generation prompt (rendering [user, assistant {marker!r}] gives {after!r}, "
                f"which does not continue [user] + generation prompt {before!r}), so the end "
                f"of a turn cannot be found; pass the end as --stop STRING."
            )
        return turn[turn.index(marker) + len(marker) :].strip() or None


def _raise_exception(message: str):
    import jinja2  # noqa: PLC0415

    raise jinja2.TemplateError(message)


def load_chat_template(path: str | os.PathLike) -> ChatTemplate:
    """The chat template at ``path``: a Jinja file, a ``tokenizer_config.json``, or a Hugging
    Face model directory holding one (with a ``chat_template`` key). ValueError naming the file
    and the fix when there is none."""
    path = Path(path)
    config = path / _CONFIG_FILE if path.is_dir() else path
    if not config.is_file():
        raise FileNotFoundError(
            f"chat template {path}: no such file{f' ({config} is missing)' if path.is_dir() else ''}; "
            f"give a .jinja file, a tokenizer_config.json, or a Hugging Face model directory "
            f"({_GIVE_TEMPLATE})."
        )
    if config.suffix != ".json":
        return ChatTemplate(str(config), config.read_text(encoding="utf-8"))
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config} is not valid JSON ({e.msg}); give a readable one.") from None
    template = data.get(_TEMPLATE_KEY) if isinstance(data, dict) else None
    if isinstance(template, list):  # the named-templates form: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        raise ValueError(
            f"{config} has no chat template (no string {_TEMPLATE_KEY!r} key), so chat "
            f"messages cannot be rendered; give a .jinja file ({_GIVE_TEMPLATE}), or a model "
            f"directory whose tokenizer_config.json has one."
        )

    def token(key: str) -> str:
        value = data.get(key, "")
        return value.get("content", "") if isinstance(value, dict) else str(value or "")

    return ChatTemplate(str(config), template, token("bos_token"), token("eos_token"))


def find_chat_template(
    chat_template: str | os.PathLike | None, tokenizer: str | os.PathLike | None
) -> ChatTemplate | None:
    """``chat_template`` (see :func:`load_chat_template`) if given, else the one in the
    ``tokenizer_config.json`` beside ``tokenizer`` (a model directory's tokenizer.json), else
    None: a chat record then fails, naming the fix."""
    if chat_template is not None:
        return load_chat_template(chat_template)
    if tokenizer is None:
        return None
    beside = Path(tokenizer).parent / _CONFIG_FILE
    if not beside.is_file():
        return None
    try:
        return load_chat_template(beside)
    except ValueError:  # a tokenizer_config.json without a template: as if none
        return None


def record_kind(record: dict) -> str | None:
    """``text``, ``prompt_completion`` or ``messages``: the fields a JSONL record holds (None:
    none of them)."""
    if "messages" in record:
        return "messages"
    if "prompt" in record or "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    return None


def record_pieces(record: dict, template: ChatTemplate | None, where: str) -> Pieces:
    """A prompt/completion or chat record as :class:`Pieces` (see the module docstring);
    ``where`` (``file:line``) names it in errors."""
    kind = record_kind(record)
    if kind == "prompt_completion":
        for field in ("prompt", "completion"):
            if not isinstance(record.get(field), str):
                raise ValueError(
                    f"{where}: a prompt/completion record needs string fields 'prompt' and "
                    f"'completion'; {field!r} is {type(record.get(field)).__name__}."
                )
        return Pieces(((record["prompt"], False), (record["completion"], True)), end_counted=True)
    if kind != "messages":
        raise ValueError(f"{where}: record_pieces takes prompt/completion or messages records.")
    return _chat_pieces(record["messages"], template, where)


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}}.")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise ValueError(f"{where}: messages[{i}] needs a string 'role', got {m!r:.80}.")
        if not isinstance(m.get("content"), str):
            raise ValueError(
                f"{where}: messages[{i}] ({m['role']}) needs a string 'content', got "
                f"{type(m.get('content')).__name__}."
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(
            f"{where}: the chat has no assistant turn, so nothing of it would count in the "
            f"loss; add the assistant's reply or drop the record."
        )


def _chat_pieces(messages, template: ChatTemplate | None, where: str) -> Pieces:
    _check_messages(messages, where)
    if template is None:
        raise ValueError(
            f"{where}: a chat record needs a chat template to render it, and none was given "
            f"(the tokenizer's directory has no tokenizer_config.json with one); give a .jinja "
            f"file, a tokenizer_config.json or a model directory ({_GIVE_TEMPLATE})."
        )
    parts: list[tuple[str, bool]] = []
    done = ""  # the text rendered so far
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template.render(messages[:i], True, where)
        after = template.render(messages[: i + 1], False, where)
        if not (before.startswith(done) and after.startswith(before)):
            raise ValueError(
                f"{where}: the chat template of {template.source} does not render turn by turn "
                f"(rendering the first {i} messages with the generation prompt is not a prefix "
                f"of rendering {i + 1}), so the assistant turns cannot be located; use a "
                f"template whose renderings of a chat's prefixes are prefixes."
            )
        parts += [(before[len(done) :], False), (after[len(before) :], True)]
        done = after
    full = template.render(messages, False, where)
    parts.append((full[len(done) :], False))
    return Pieces(tuple((text, counted) for text, counted in parts if text))
