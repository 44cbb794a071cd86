"""The commit protocol (docs/format.md §7) against concurrent and crashed saves.

- Two jobs (each its own gloo process group) saving into one location at the same time: at most
  one commits, the other gets ``CheckpointExistsError``, and the location always holds exactly
  the winner's checkpoint, every file it names present.
- Saves killed with SIGKILL before their commit leave files behind; the committed checkpoint
  still loads, and the next save removes them.
- A commit that the store reports as failed although it happened keeps its data files.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from shardsafe import Checkpointer, CheckpointExistsError, ShardedTensor
from shardsafe.storage import open_storage

from . import servers
from .helpers import CTX, run_ranks

ROOT = Path(__file__).resolve().parent.parent
META = "metadata.json"
LOST = r"another save committed a checkpoint there while this one ran, so this one did not commit"


def _full(job: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + job)
    return torch.randn(64, 1024, generator=g)  # 256 KiB, a different value for every job


class _Rendezvous:
    """A storage that passes every call to the one it wraps, except that ``write_file`` first
    waits until the other job's coordinator reaches ``write_file`` too. Both coordinators have
    then planned, that is read the committed ``metadata.json``, before either can commit: the
    two saves overlap for certain rather than by the luck of the scheduler."""

    def __init__(self, inner: Any, barrier: Any) -> None:
        self._inner = inner
        self._barrier = barrier

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def write_file(self, name: str) -> Iterator[Any]:
        self._barrier.wait(timeout=60)
        with self._inner.write_file(name) as w:
            yield w


def _save_racing(rank: int, ws: int, location: str, options: dict, barrier: Any, job: int, overwrite: bool) -> str:
    storage = open_storage(location, **options)
    if rank == 0:
        storage = _Rendezvous(storage, barrier)
    part = _full(job).chunk(ws)[rank].clone()
    state = {"w": ShardedTensor.from_rank_offsets("w", part, (0, rank, ws)), "job": job}
    try:
        Checkpointer().save(storage, state, save_overwrite=overwrite)
    except CheckpointExistsError as e:
        return f"lost: {e}"
    return "won"


def _race(location: str, options: dict, overwrite: bool) -> dict[int, list[str]]:
    """Jobs 1 and 2, two ranks each, saving into ``location`` at the same time."""
    barrier = CTX.Barrier(2)
    results: dict[int, Any] = {}

    def job(j: int) -> None:
        try:
            results[j] = run_ranks(2, _save_racing, location, options, barrier, j, overwrite, timeout=180)
        except BaseException as e:  # noqa: BLE001 - reported below
            results[j] = e

    threads = [threading.Thread(target=job, args=(j,)) for j in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results.values():
        if isinstance(r, BaseException):
            raise r
    return results


def _assert_holds_exactly(location: str, options: dict, job: int) -> None:
    """The location loads bit-exact as ``job``'s save, every file its metadata names is there, and
    no other data file is left."""
    storage = open_storage(location, **options)
    meta = json.loads(storage.read(META))
    named = {f["name"] for f in meta["file_table"]}
    assert len(named) == 2
    assert sorted(storage.list()) == sorted([META, *named])
    out = Checkpointer().unshard(storage)
    assert out["job"] == job
    assert torch.equal(out["w"].view(torch.int32), _full(job).view(torch.int32))


def _check_race(results: dict[int, list[str]], overwrite: bool) -> int:
    winners = [j for j, r in results.items() if r == ["won", "won"]]
    assert len(winners) == 1, results
    (loser,) = {1, 2} - set(winners)
    for message in results[loser]:  # every rank of the loser gets the same clear error
        assert re.search(LOST, message), message
        assert ("pass save_overwrite=True" in message) is (not overwrite)
    return winners[0]


@pytest.mark.parametrize("overwrite", [False, True], ids=["create", "overwrite"])
def test_two_racing_jobs_one_commits_and_the_checkpoint_stays_whole(tmp_path: Path, overwrite: bool) -> None:
    for trial in range(3):
        d = str(tmp_path / f"ckpt-{trial}")
        if overwrite:  # a committed checkpoint that both jobs set out to replace
            Checkpointer().save(d, {"w": _full(0), "job": 0})
        winner = _check_race(_race(d, {}, overwrite), overwrite)
        _assert_holds_exactly(d, {}, winner)


def test_two_racing_jobs_on_s3_one_commits() -> None:
    c = servers.cloud("s3")
    url = c.url()
    Checkpointer().save(open_storage(url, **c.options), {"w": _full(0), "job": 0})
    winner = _check_race(_race(url, c.options, True), True)
    _assert_holds_exactly(url, c.options, winner)


# --- crashes --------------------------------------------------------------------------------

_CHILD = r"""
import os, sys, time
import torch
import shardsafe

path, job, stop_at = sys.argv[1], int(sys.argv[2]), sys.argv[3]
real_open = os.open

def wait_to_be_killed(*args, **kwargs):
    print("ready", flush=True)
    time.sleep(600)

def open_(p, *args, **kwargs):
    if stop_at == "data-written" and ".tmp-" in os.fspath(p):  # every data file written and fsynced
        wait_to_be_killed()
    return real_open(p, *args, **kwargs)

os.open = open_
if stop_at == "before-rename":  # metadata.json.tmp-<hex> written and fsynced, not yet in place
    os.link = os.replace = wait_to_be_killed
g = torch.Generator().manual_seed(1000 + job)
state = {"w": torch.randn(64, 1024, generator=g), "job": job}
shardsafe.Checkpointer().save(path, state, save_overwrite=True)
print("committed", flush=True)
"""


def _save_and_kill(path: str, job: int, stop_at: str) -> None:
    """Run a save of ``job`` in a child process and SIGKILL it at ``stop_at``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, path, str(job), stop_at], stdout=subprocess.PIPE, env=env)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line == b"ready\n", line
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _leftovers(d: Path, keep: set[str]) -> list[str]:
    return sorted(n for n in os.listdir(d) if n not in keep)


def test_the_next_save_removes_what_killed_saves_left(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    _save_and_kill(str(d), 1, "data-written")
    _save_and_kill(str(d), 2, "before-rename")
    left = _leftovers(d, set())
    assert [n for n in left if n.startswith("metadata.json.tmp-")] and META not in left
    assert sum(n.startswith("shard-") for n in left) == 2  # one data file from each killed save

    meta, _ = Checkpointer().save(d, {"w": _full(3), "job": 3})  # into a folder that holds no checkpoint
    assert sorted(os.listdir(d)) == sorted([META, *meta.data_files()])
    _assert_holds_exactly_local(d, 3)

    (d / "notes.txt").write_text("mine")
    _save_and_kill(str(d), 4, "data-written")
    _save_and_kill(str(d), 5, "before-rename")
    _assert_holds_exactly_local(d, 3)  # the killed overwrites never touched the committed checkpoint
    assert len(_leftovers(d, {META, "notes.txt", *meta.data_files()})) == 3

    meta, _ = Checkpointer().save(d, {"w": _full(6), "job": 6}, save_overwrite=True)
    assert sorted(os.listdir(d)) == sorted([META, "notes.txt", *meta.data_files()])
    _assert_holds_exactly_local(d, 6)


def _assert_holds_exactly_local(d: Path, job: int) -> None:
    out = Checkpointer().unshard(d)
    assert out["job"] == job
    assert torch.equal(out["w"].view(torch.int32), _full(job).view(torch.int32))


# --- a commit whose outcome the store misreports ----------------------------------------------


def test_a_commit_reported_failed_after_it_happened_keeps_its_data_files(tmp_path: Path, monkeypatch) -> None:
    """The rename of metadata.json succeeds, then the directory fsync fails: the save finds its
    own metadata.json in place and succeeds; its data files, which that metadata names, stay."""
    d = tmp_path / "ckpt"
    Checkpointer().save(d, {"w": _full(0), "job": 0})
    real_fsync = os.fsync
    failed = []

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode) and (d / META).exists() and b'"job":7' in (d / META).read_bytes():
            failed.append(fd)
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    meta, _ = Checkpointer().save(d, {"w": _full(7), "job": 7}, save_overwrite=True)
    monkeypatch.undo()
    assert failed
    assert sorted(os.listdir(d)) == sorted([META, *meta.data_files()])
    _assert_holds_exactly_local(d, 7)
