"""Start-up and memory flat in the corpus size: a fresh process opens a token set of 10^6,
10^8 (and, under -m slow, 10^9) tokens and fetches its first batch; its resident memory grows
by the same small amount for each (scripts/bench_loader_scale.py prints the figures, and the
times, against an older checkout too)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from seqshard.data.synthetic import write_synthetic

_CHILD = r"""
import json, sys
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
import jax, numpy as np
from seqshard.data import Loader
from seqshard.mesh import mesh_of_sizes
mesh = mesh_of_sizes({}, jax.devices()[:1])
anon0, peak0 = status("RssAnon"), status("VmHWM")
loader = Loader(sys.argv[1], "train", batch_size=32, seq_len=2048, mesh=mesh, prefetch=0)
tokens = np.asarray(loader.batch_at(0).tokens)
assert tokens.shape == (32, 2048)
print(json.dumps({"anon": status("RssAnon") - anon0, "peak": status("VmHWM") - peak0}))
"""


def _growth(tmp_path, tokenizer, n_tokens: int) -> dict:
    data_dir = write_synthetic(tmp_path / f"t{n_tokens}", n_tokens, tokenizer=tokenizer)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(data_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "n_tokens", [10**8, pytest.param(10**9, marks=pytest.mark.slow)], ids=["1e8", "1e9"]
)
def test_first_batch_memory_is_flat_in_corpus_size(tmp_path, data_dir, n_tokens):
    """Anonymous memory (what the loader holds) within 8 MiB of a 10^6-token set's; peak
    resident memory (mapped file pages included: a batch's pages and its binary searches)
    within 32 MiB. Before the index shuffle, 10^9 tokens took 1.9 GB of peak RSS here."""
    tokenizer = data_dir / "tokenizer.json"
    small = _growth(tmp_path, tokenizer, 10**6)
    large = _growth(tmp_path, tokenizer, n_tokens)
    assert large["anon"] < small["anon"] + 8, (small, large)
    assert large["peak"] < small["peak"] + 32, (small, large)
