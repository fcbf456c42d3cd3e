"""Tests of seqshard.train.run_files: a run's own files, written whole and readable by all."""

from __future__ import annotations

import os
import stat

from seqshard.train.run_files import atomic_write_text


def test_files_written_whole_are_readable_like_the_rest(tmp_path, trained_run):
    """Issue 41, item 14: config.yaml and run.json were 0600 (mkstemp's mode) while the run's
    other files are 0644: a teammate could read the metrics but not the config."""
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644
    _, run_dir = trained_run
    modes = {n: stat.S_IMODE((run_dir / n).stat().st_mode) for n in ("config.yaml", "run.json")}
    assert modes == dict.fromkeys(modes, stat.S_IMODE((run_dir / "metrics.jsonl").stat().st_mode))
