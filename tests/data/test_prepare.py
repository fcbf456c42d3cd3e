"""Tests of seqshard.data.prepare: text -> tokenizer + token files, deterministic and atomic."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from data_helpers import VOCAB, _documents
from process_helpers import SEQSHARD, ProcessGroup, cpu_env

from seqshard.cli import main
from seqshard.data import shards
from seqshard.data.corpus import path_corpus, stdlib_corpus
from seqshard.data.prepare import PrepareConfig, PrepareInterrupted, prepare
from seqshard.data.tokenfile import (
    SplitWriter,
    open_split,
    read_meta,
)
from seqshard.data.tokenizer import (
    decode,
    load_tokenizer,
    tokenizer_hash,
)


def test_prepare_writes_files_and_meta(data_dir, text_dir):
    names = sorted(p.name for p in data_dir.iterdir())
    assert names == [
        "meta.json",
        "tokenizer.json",
        "train-00000.bin",
        "train-00000.offsets.npy",
        "val-00000.bin",
        "val-00000.offsets.npy",
    ]
    assert not Path(f"{data_dir}.tmp").exists()
    meta = read_meta(data_dir)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] <= VOCAB
    assert meta["tokenizer"] == "tokenizer.json"
    assert meta["tokenizer_sha256"] == tokenizer_hash(data_dir / "tokenizer.json")
    assert str(text_dir) in meta["source"] and meta["format_version"] == 2
    n_docs = {s: meta["splits"][s]["n_docs"] for s in ("train", "val")}
    assert n_docs["train"] + n_docs["val"] == 80 and 5 <= n_docs["val"] <= 30

    # Every document comes back, in corpus order within its split, ending with EOT.
    tok = load_tokenizer(data_dir / "tokenizer.json")
    decoded = []
    for split in ("train", "val"):
        s = open_split(data_dir, split)
        assert (
            s.shards[0].tokens.dtype == np.uint16
            and s.n_tokens == meta["splits"][split]["n_tokens"]
        )
        assert (data_dir / f"{split}-00000.bin").stat().st_size == 2 * s.n_tokens
        for i in range(s.n_docs):
            ids = s.doc(i)
            assert ids[-1] == meta["eot_id"]
            decoded.append(decode(tok, ids[:-1]))
    assert sorted(decoded) == sorted(_documents())


def test_prepare_is_deterministic_and_reuses_a_tokenizer(tmp_path, data_dir, text_dir):
    given = PrepareConfig(tokenizer_path=data_dir / "tokenizer.json", val_fraction=0.2)
    again = prepare(tmp_path / "again", path_corpus([text_dir]), given, log=None)
    for name in ("train-00000.bin", "val-00000.bin", "train-00000.offsets.npy", "tokenizer.json"):
        assert (again / name).read_bytes() == (data_dir / name).read_bytes()
    assert read_meta(again)["tokenizer_sha256"] == read_meta(data_dir)["tokenizer_sha256"]
    with pytest.raises(FileExistsError, match="--force"):
        prepare(again, path_corpus([text_dir]), log=None)


def test_prepare_tiny_corpus_still_gets_a_val_doc(tmp_path):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"document number {i} " * 20)
    out = prepare(
        tmp_path / "out", path_corpus([tmp_path]), PrepareConfig(vocab_size=300), log=None
    )
    assert read_meta(out)["splits"]["val"]["n_docs"] == 1


def test_the_progress_line_says_how_far_of_the_total(tmp_path, monkeypatch, data_dir, text_dir):
    """Issue 41, item 14: the progress line said how many shards were done, not of how many
    documents; pass 1's count is the total."""
    monkeypatch.setattr(shards, "PROGRESS_EVERY_S", 0.0)  # a line after every shard
    lines: list[str] = []
    config = PrepareConfig(tokenizer_path=data_dir / "tokenizer.json", shard_tokens=4096)
    out = prepare(tmp_path / "p", path_corpus([text_dir]), config, log=lines.append)
    n_docs = sum(s["n_docs"] for s in read_meta(out)["splits"].values())
    progress = [line for line in lines if "shards done" in line]
    assert progress and all(f" of {n_docs:,} (" in line for line in progress), lines
    assert re.search(r"^prepare: 1 shards done, [0-9,]+ of [0-9,]+ \(\d+%\) documents", progress[0])


def test_the_default_out_is_where_the_configs_read(capsys):
    """--out's default is base.yaml's data.dir, where `seqshard train` looks for the stdlib."""
    from seqshard.config import load_config

    assert main(["prepare", "--help"]) == 0
    assert "(default: data/stdlib)" in " ".join(capsys.readouterr().out.split())
    assert load_config(Path(__file__).parents[2] / "configs" / "base.yaml").data.dir.endswith(
        "data/stdlib"
    )


def test_prepare_default_corpus_and_cli(tmp_path, capsys):
    out = str(tmp_path / "std")
    assert main(["prepare", "--out", out, "--vocab-size", "300", "--max-docs", "8"]) == 0
    meta = read_meta(tmp_path / "std")
    assert "stdlib" in meta["source"] and meta["splits"]["train"]["n_docs"] >= 6
    assert "prepare: wrote" in capsys.readouterr().out
    assert main(["prepare", "--out", str(tmp_path / "x"), str(tmp_path / "missing")]) == 2
    assert "missing does not exist" in capsys.readouterr().err
    assert main(["prepare", "--help"]) == 0 and "--vocab-size" in capsys.readouterr().out


def test_interrupted_prepare_leaves_nothing_that_looks_prepared(tmp_path, text_dir, monkeypatch):
    def crash(self, docs, masks=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(SplitWriter, "add", crash)
    with pytest.raises(PrepareInterrupted, match="rerun the same command to resume"):
        prepare(tmp_path / "out", path_corpus([text_dir]), PrepareConfig(vocab_size=300), log=None)
    # out.tmp stays, to resume; nothing at out looks prepared; the lock is let go.
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp" / "meta.json").exists()
    assert not (tmp_path / "out.lock").exists()


@pytest.mark.slow
def test_prepare_full_stdlib(tmp_path):
    t0 = time.perf_counter()
    out = prepare(tmp_path / "stdlib", stdlib_corpus(), PrepareConfig(vocab_size=4096), log=None)
    meta = read_meta(out)
    assert meta["vocab_size"] == 4096 and meta["splits"]["train"]["n_tokens"] > 1_000_000
    assert meta["splits"]["val"]["n_docs"] >= 1 and time.perf_counter() - t0 < 120
    assert json.loads((out / "meta.json").read_text()) == meta


def test_prepare_refuses_paths_in_place_of_a_corpus(tmp_path, text_dir):
    with pytest.raises(TypeError, match=r"corpus must be a seqshard.data.Corpus, got list"):
        prepare(tmp_path / "out", [text_dir], log=None)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def _files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _interrupted_after(n_units: int, out: Path, text_dir: Path, config: PrepareConfig) -> None:
    """A prepare of ``text_dir`` into ``out`` stopped by Ctrl-C as it starts unit ``n_units``:
    ``out.tmp`` holds the first ``n_units`` units' shards and records."""
    from seqshard.data import shards as shards_module

    real = shards_module._encode_unit
    calls = []

    def dies(job):
        if len(calls) == n_units:
            raise KeyboardInterrupt
        calls.append(job[1])
        return real(job)

    shards_module._encode_unit = dies
    try:
        with pytest.raises(PrepareInterrupted):
            prepare(out, path_corpus([text_dir]), config, log=None)
    finally:
        shards_module._encode_unit = real


def test_shards_are_the_same_for_any_number_of_workers_and_resume(tmp_path, data_dir, text_dir):
    """Small shards (a few documents each): 1 and 2 worker processes write the same files,
    byte for byte. A prepare killed after some shards resumes from them: the tokenizer and
    counts are reused, the finished shards kept (not rewritten), the output the same."""
    config = PrepareConfig(tokenizer_path=data_dir / "tokenizer.json", shard_tokens=3000)
    one = prepare(tmp_path / "one", path_corpus([text_dir]), config, log=None)
    two = prepare(
        tmp_path / "two",
        path_corpus([text_dir]),
        dataclasses.replace(config, workers=2),
        log=None,
    )
    files = _files(one)
    assert files == _files(two)
    meta = read_meta(one)
    shards = meta["splits"]["train"]["shards"]
    assert len(shards) > 3 and all(s["n_tokens"] <= 3000 for s in shards)
    total = sum(meta["splits"][s]["n_tokens"] for s in ("train", "val"))
    assert total == sum(open_split(data_dir, s).n_tokens for s in ("train", "val"))

    # A kill after the third unit: its tmp holds three units' shards and records.
    _interrupted_after(3, tmp_path / "again", text_dir, config)
    kept = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "again.tmp").glob("train-*.bin")}
    assert len(kept) == 3
    messages = []
    resumed = prepare(tmp_path / "again", path_corpus([text_dir]), config, log=messages.append)
    assert _files(resumed) == files
    assert any("resuming the unfinished" in m for m in messages)
    assert any(f"reused 3 of {len(shards)} units" in m for m in messages), messages
    for name, mtime in kept.items():
        assert (resumed / name).stat().st_mtime_ns == mtime  # not written again

    # Other settings start over.
    (tmp_path / "again.tmp").mkdir()
    (tmp_path / "again.tmp" / "prepare-plan.json").write_text("{}")
    messages.clear()
    prepare(
        tmp_path / "again", path_corpus([text_dir]), config, overwrite=True, log=messages.append
    )
    assert any("other inputs or settings; starting over" in m for m in messages)


# -- faults of `seqshard prepare` -------------------------------------------------------------

# `seqshard prepare ARGS` whose parent process reads each unit 0.1 s slower (the workers are
# untouched): a prepare with time to be interrupted, or to be waited for.
SLOW_PREPARE = [
    sys.executable,
    "-c",
    "import sys, time\n"
    "from seqshard.data import shards\n"
    "finished = shards._finished\n"
    "shards._finished = lambda *a: (time.sleep(0.1), finished(*a))[1]\n"
    "from seqshard.cli import main\n"
    "sys.exit(main(sys.argv[1:]))",
]


def _small_shards(data_dir: Path) -> PrepareConfig:
    """A unit a document or two: ~80 units of the test corpus, with the fixture's tokenizer."""
    return PrepareConfig(tokenizer_path=str(data_dir / "tokenizer.json"), shard_tokens=500)


def _cli_args(text_dir: Path, out: Path, config: PrepareConfig, workers: int = 1) -> list[str]:
    return [
        "prepare",
        str(text_dir),
        "--out",
        str(out),
        "--tokenizer",
        str(config.tokenizer_path),
        "--shard-tokens",
        str(config.shard_tokens),
        "--workers",
        str(workers),
    ]


def _wait_for_units(tmp: Path, group: ProcessGroup, timeout: float = 60) -> None:
    """Until ``tmp`` holds a finished unit (its process encoding)."""
    deadline = time.monotonic() + timeout
    while not any((tmp / "units").glob("*.json")):
        if time.monotonic() > deadline or group.procs[0].poll() is not None:
            raise AssertionError(f"no unit finished in {tmp}:\n{group.outputs()}")
        time.sleep(0.05)


def test_ctrl_c_stops_a_parallel_prepare_with_one_line_and_it_resumes(
    tmp_path, data_dir, text_dir, capsys
):
    """Fault 4: Ctrl-C (SIGINT to the whole process group, as a terminal sends it) during
    `prepare --workers 2` printed a KeyboardInterrupt traceback from each worker. Now: the
    workers ignore it, the parent ends them and says one line, status 130; the rerun resumes
    and gives the files of an uninterrupted prepare."""
    config = _small_shards(data_dir)
    out = tmp_path / "out"
    cmd = [*SLOW_PREPARE, *_cli_args(text_dir, out, config, workers=2)]
    with ProcessGroup([cmd], tmp_path / "logs", cpu_env()) as group:
        _wait_for_units(Path(f"{out}.tmp"), group)
        group.kill(0, signal.SIGINT)
        assert group.wait(timeout=30) == [130], group.outputs()
        output = group.output(0)
        deadline = time.monotonic() + 10  # the workers end with their parent
        while _group_alive(group.procs[0].pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_alive(group.procs[0].pid), "a worker outlived the interrupted prepare"
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert output.splitlines()[-1] == (
        f"seqshard prepare: error: interrupted (Ctrl-C); rerun the same command to resume: "
        f"{out}.tmp keeps the work done so far."
    ), output
    assert len(output.splitlines()) <= 6 and not Path(f"{out}.lock").exists(), output

    capsys.readouterr()
    assert main(_cli_args(text_dir, out, config, workers=2)) == 0
    assert re.search(r"prepare: reused \d+ of \d+ units", capsys.readouterr().out)
    reference = prepare(tmp_path / "reference", path_corpus([str(text_dir)]), config, log=None)
    assert _files(out) == _files(reference)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_full_disk_names_the_file_the_bytes_and_the_space_free(
    tmp_path, data_dir, text_dir, monkeypatch, capsys
):
    """Fault 9: a full disk said only `[Errno 28] No space left on device`. Now one line: the
    file, the OS error, the bytes the write needed, the space free there, what to do. The
    error crosses from a worker process intact (it is pickled there)."""
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=5 * 1024))

    def disk_full(self, docs, masks=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(SplitWriter, "add", disk_full)
    out = tmp_path / "out"
    assert main(_cli_args(text_dir, out, _small_shards(data_dir))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert re.fullmatch(
        rf"seqshard prepare: error: could not write {re.escape(str(out))}\.tmp/train-00000\.bin: "
        r"\[Errno 28\] No space left on device\. The write needed about [\d.]+ K?i?B; "
        rf"{re.escape(str(out))}\.tmp has 5\.00 KiB free\. Free space there and rerun the same "
        r"command \(it keeps the shards already finished\), or prepare into another --out\.\n",
        err,
    ), err
    assert not Path(f"{out}.tmp/train-00000.bin.tmp").exists()  # the partial shard is removed

    from seqshard.data.shards import PrepareWriteError, writing

    with pytest.raises(PrepareWriteError) as caught, writing(tmp_path / "x.bin", 4096):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert str(pickle.loads(pickle.dumps(caught.value))) == str(caught.value)


def test_torn_bookkeeping_files_are_made_again(tmp_path, data_dir, text_dir):
    """Fault 10: a torn prepare-count.json (or prepare-plan.json) in <out>.tmp failed every
    rerun with `Unterminated string starting at ...` and no file named. Now the rerun says
    which file and makes it again: the counts are counted again (the tokenizer and finished
    shards kept), a torn plan starts over; the output is the uninterrupted one's."""
    config = _small_shards(data_dir)
    reference = _files(prepare(tmp_path / "reference", path_corpus([text_dir]), config, log=None))

    out = tmp_path / "count"
    _interrupted_after(3, out, text_dir, config)
    count_file = Path(f"{out}.tmp") / "prepare-count.json"
    count_file.write_text(count_file.read_text()[:5])  # '{"n_d': torn inside a string
    messages = []
    assert _files(prepare(out, path_corpus([text_dir]), config, log=messages.append)) == reference
    assert any(
        f"{count_file} is damaged (Unterminated string starting at" in m
        and m.endswith("counting the documents again")
        for m in messages
    ), messages
    assert any("reused 3 of" in m for m in messages), messages

    out = tmp_path / "plan"
    _interrupted_after(3, out, text_dir, config)
    plan_file = Path(f"{out}.tmp") / "prepare-plan.json"
    plan_file.write_text(plan_file.read_text()[:20])
    messages.clear()
    assert _files(prepare(out, path_corpus([text_dir]), config, log=messages.append)) == reference
    assert any(
        m.startswith(f"prepare: {plan_file} is damaged (") and m.endswith("; starting over")
        for m in messages
    ), messages


def test_two_prepares_of_one_output_take_turns(tmp_path, data_dir, text_dir):
    """Fault 12: two prepares into one --out (two `seqshard train` runs on one fresh data.dir
    do that) both encoded into <out>.tmp, and one died with `[Errno 2] ... .bin.tmp`. Now the
    second waits for the first, naming it, and then uses the directory it made."""
    config = _small_shards(data_dir)
    out = tmp_path / "out"
    args = _cli_args(text_dir, out, config, workers=2)
    with ProcessGroup([[*SLOW_PREPARE, *args]], tmp_path / "first", cpu_env()) as first:
        _wait_for_units(Path(f"{out}.tmp"), first)
        with ProcessGroup([[*SEQSHARD, *args]], tmp_path / "second", cpu_env()) as second:
            assert second.wait(timeout=120) == [0], first.outputs() + second.outputs()
            assert first.wait(timeout=10) == [0], first.outputs()
    waited = second.output(0)
    assert f"prepare: waiting for process {first.procs[0].pid} on {socket.gethostname()}" in waited
    assert (
        f"prepare: {out} was prepared from the same inputs and settings by another process "
        f"while this one waited; using it" in waited
    ), waited
    reference = prepare(tmp_path / "reference", path_corpus([str(text_dir)]), config, log=None)
    assert _files(out) == _files(reference)
    assert not Path(f"{out}.tmp").exists() and not Path(f"{out}.lock").exists()


def test_a_prepare_waiting_for_another_refuses_what_that_one_made_of_other_inputs(
    tmp_path, data_dir, text_dir
):
    """Fault 12, the other way: what the holder made from other inputs or settings is not
    taken for this prepare's output (nor written over)."""
    out = tmp_path / "out"
    lock = os.open(f"{out}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.write(lock, json.dumps({"pid": 4242, "host": "node7", "started": "then"}).encode())
    messages: list[str] = []
    waiting = concurrent.futures.ThreadPoolExecutor(1).submit(
        prepare, out, path_corpus([text_dir]), _small_shards(data_dir), log=messages.append
    )
    deadline = time.monotonic() + 30
    while not any("waiting for" in m for m in messages) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (
        f"prepare: waiting for process 4242 on node7 (started then) to finish preparing {out} "
        f"({out}.lock)" in messages
    ), messages
    shutil.copytree(data_dir, out)  # what the holder made: other settings (one big shard)
    os.unlink(f"{out}.lock")
    os.close(lock)
    with pytest.raises(FileExistsError, match="was prepared by another process while this one "):
        waiting.result(timeout=30)
    assert _files(out) == _files(data_dir) and not Path(f"{out}.tmp").exists()


def test_a_damaged_finished_shard_is_encoded_again(tmp_path, data_dir, text_dir):
    """Fault 13: a resumed prepare reused a finished shard whose bytes had changed (only sizes
    were compared), and meta.json recorded the clean sha256 for them. Now each reused shard is
    hashed again; one that differs is encoded again, saying so."""
    config = _small_shards(data_dir)
    out = tmp_path / "out"
    _interrupted_after(3, out, text_dir, config)
    shard = Path(f"{out}.tmp") / "train-00001.bin"
    damaged = bytearray(shard.read_bytes())
    damaged[10] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    messages = []
    prepared = prepare(out, path_corpus([text_dir]), config, log=messages.append)
    assert (
        f"prepare: {shard} does not match its recorded sha256 (damaged since it was written); "
        f"encoding unit 1 again" in messages
    ), messages
    assert any("reused 2 of" in m for m in messages), messages
    reference = prepare(tmp_path / "reference", path_corpus([text_dir]), config, log=None)
    assert _files(prepared) == _files(reference)
    for entry in read_meta(prepared)["splits"]["train"]["shards"]:
        data = (prepared / f"{entry['name']}.bin").read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
