"""Write the small chat set configs/sft-tiny-cpu.yaml fine-tunes on: questions about the Python
standard library's functions, answered by the first paragraph of their docstrings.

    python scripts/make_chat_set.py                  # -> configs/sft/chat-stdlib.jsonl

Each record is chat ``messages`` (a user question, the assistant's answer), every fourth a
two-turn chat (then the signature), every fifth a ``prompt``/``completion`` pair instead, so
the set exercises both kinds of fine-tuning record. The main job trained on the stdlib's
source, so these answers are text it has seen, in another form. Deterministic for a given
Python version (the committed file was made with Python 3.11).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
from pathlib import Path

MODULES = (
    "os",
    "os.path",
    "json",
    "string",
    "math",
    "itertools",
    "collections",
    "functools",
    "re",
    "textwrap",
    "shutil",
    "random",
    "statistics",
    "bisect",
    "heapq",
    "fnmatch",
    "glob",
    "base64",
    "hashlib",
    "copy",
    "operator",
    "difflib",
    "calendar",
    "datetime",
)


def _answer(doc: str) -> str | None:
    first = doc.strip().split("\n\n")[0]
    text = " ".join(line.strip() for line in first.splitlines())
    return text if 20 <= len(text) <= 400 else None


def records() -> list[dict]:
    out = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            fn = getattr(module, attr)
            if attr.startswith("_") or not callable(fn) or inspect.isclass(fn):
                continue
            answer = _answer(inspect.getdoc(fn) or "")
            if answer is None:
                continue
            k = len(out)
            question = f"What does `{name}.{attr}` do?"
            if k % 5 == 4:
                out.append({"prompt": f"Q: {question}\nA:", "completion": f" {answer}"})
                continue
            messages = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
            try:
                signature = f"{name}.{attr}{inspect.signature(fn)}"
            except (TypeError, ValueError):
                signature = None
            if k % 4 == 3 and signature:
                messages += [
                    {"role": "user", "content": "How is it called?"},
                    {"role": "assistant", "content": f"`{signature}`"},
                ]
            out.append({"messages": messages})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="configs/sft/chat-stdlib.jsonl")
    args = p.parse_args()
    rows = records()
    Path(args.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"wrote {len(rows)} records to {args.out}")


if __name__ == "__main__":
    main()
