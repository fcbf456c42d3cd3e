#!/usr/bin/env python
"""Where a profiled run's step time went, by op kind: ``python scripts/profile_summary.py RUN_DIR``.

Reads the newest trace a run with ``train.profile`` wrote to ``RUN_DIR/profile/`` and prints
the traced steps' XLA op time per device and step, by program and by op kind (fusion,
dot/convolution, all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute, copy,
other), with each one's share (``seqshard.train.profile.summarize`` says how it counts).
"""

from __future__ import annotations

import argparse
import sys

from seqshard.train.profile import summarize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory holding profile/")
    args = parser.parse_args(argv)
    try:
        print(summarize(args.run_dir).table())
    except (FileNotFoundError, ValueError) as e:
        print(f"profile_summary: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
