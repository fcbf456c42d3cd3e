"""Start-up and resident memory of the loader against corpus size: flat, or growing?

    python scripts/bench_loader_scale.py                      # 1e6, 1e8, 1e9 tokens
    python scripts/bench_loader_scale.py --tokens 1e6 1e10    # any sizes

For each size: a synthetic token set (:mod:`seqshard.data.synthetic`, a sparse file, seconds
to make), then a fresh process that imports seqshard, builds a Loader on one CPU device and
fetches the first batch (32 x 2048 tokens). It prints the time from ``Loader(...)`` to the
first batch on the host and the process's RSS growth over the same span (current and peak,
and anonymous, from /proc/self/status), one line per size, and the ratio of the largest to the smallest.
``--checkout DIR`` measures another checkout's loader on the same sets (a version from before
the constant-memory loader, say).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, sys, time
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024  # MiB
import jax, numpy as np
from seqshard.data import Loader
from seqshard.mesh import mesh_of_sizes
mesh = mesh_of_sizes({}, jax.devices()[:1])
rss0, peak0, anon0 = status("VmRSS"), status("VmHWM"), status("RssAnon")
t0 = time.perf_counter()
loader = Loader(sys.argv[1], "train", batch_size=32, seq_len=2048, mesh=mesh, prefetch=0)
tokens = np.asarray(loader.batch_at(0).tokens)
elapsed = time.perf_counter() - t0
print(json.dumps({"first_batch_s": elapsed, "rss_mib": status("VmRSS") - rss0,
                  "anon_rss_mib": status("RssAnon") - anon0,
                  "peak_rss_mib": status("VmHWM") - peak0, "shape": list(tokens.shape)}))
"""


def measure(data_dir: Path, checkout: str | None) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if checkout:
        env["PYTHONPATH"] = checkout
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(data_dir)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        cwd=data_dir,  # not this checkout: `python -c` puts the working directory on sys.path
    )
    if out.returncode:
        raise SystemExit(f"the measuring process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, nargs="+", default=[1e6, 1e8, 1e9])
    p.add_argument("--tokenizer", default="data/stdlib/tokenizer.json")
    p.add_argument(
        "--checkout", help="measure the seqshard of this checkout (e.g. an older version)"
    )
    args = p.parse_args()
    from seqshard.data.synthetic import write_synthetic

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in map(int, args.tokens):
            data_dir = write_synthetic(Path(tmp) / f"tok{n}", n, tokenizer=args.tokenizer)
            r = results[n] = measure(data_dir, args.checkout)
            print(
                f"tokens {n:>14,}  first_batch_s {r['first_batch_s']:.3f}  "
                f"rss_growth_mib {r['rss_mib']:.1f} (anonymous {r['anon_rss_mib']:.1f}, the rest "
                f"mapped file pages)  peak_rss_growth_mib {r['peak_rss_mib']:.1f}",
                flush=True,
            )
    small, large = results[min(results)], results[max(results)]
    print(
        f"largest/smallest: first_batch_s {large['first_batch_s'] / small['first_batch_s']:.2f}x  "
        f"peak_rss_growth {large['peak_rss_mib'] - small['peak_rss_mib']:+.1f} MiB"
    )


if __name__ == "__main__":
    main()
