"""Where a path in a config points, and when a tokenizer's name is not a path.

The rule, for every path a config holds (``base``, ``data.dir``, ``data.inputs``,
``data.tokenizer``, ``data.chat_template``, each mixture source, ``init.from_run``,
``init.from_hf``, ``run.dir``): a relative path is relative to the file that names it; one
given in a dotted override on the command line is relative to the working directory, as a
shell user expects. :func:`rebase` applies it (seqshard.config, to each file's keys).

The one exception: ``data.tokenizer: meta-llama/Llama-3.2-1B``, a name of the form ORG/NAME at
which no file or directory exists, names a tokenizer on the Hugging Face Hub
(:func:`is_hub_name`; a path that exists wins, and a name ending in ``.json`` is always a
path). It is read by ``tokenizers.Tokenizer.from_pretrained`` (seqshard.data.tokenizer).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["is_hub_name", "rebase"]

# A Hub repository id: ORG/NAME, each of letters, digits, '-', '_', '.' (huggingface_hub's rule).
_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def rebase(path: str, base: str | os.PathLike) -> str:
    """``path`` relative to the directory ``base`` (an absolute path stays), with ``..`` taken
    out: ``rebase('../data/stdlib', '/repo/configs') == '/repo/data/stdlib'``."""
    return os.path.normpath(Path(base) / path)


def is_hub_name(name: str, base: str | os.PathLike = ".") -> bool:
    """Whether ``name`` names a Hugging Face Hub repository (``ORG/NAME``) rather than a path
    relative to ``base``: it has that form, does not end in ``.json``, and nothing exists at
    ``base/name``."""
    return (
        _HUB_NAME.fullmatch(name) is not None
        and not name.endswith(".json")
        and not (Path(base) / name).exists()
    )
