"""The campaigns' sandbox sees what it must: memory over the bound, hangs, crashes, files outside."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from shardsafe.errors import CorruptCheckpointError

from .sandbox import Sandbox


def _allocate(nbytes: int) -> int:
    return len(bytearray(nbytes))


def _sleep(seconds: float) -> str:
    time.sleep(seconds)
    return "woke"


def _spin() -> None:
    while True:
        pass


def _mark_and_sleep(path: str, seconds: float) -> str:
    open(path, "w").close()
    time.sleep(seconds)
    return "woke"


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _raise_corrupt() -> None:
    raise CorruptCheckpointError("/x/metadata.json: damaged")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture(scope="module")
def box():
    with Sandbox(memory_bytes=256 << 20, timeout=5.0, grace=5.0) as b:
        yield b


def test_memory_beyond_the_bound_fails_and_is_reported(box: Sandbox) -> None:
    assert box.call(_allocate, 16 << 20, roots=[]).value == 16 << 20
    res = box.call(_allocate, 4 << 30, roots=[])
    assert (res.kind, res.error_type, res.memory) == ("raised", "MemoryError", True)


def test_a_call_past_its_cpu_time_is_a_hang_and_the_worker_survives_it(box: Sandbox) -> None:
    assert box.call(_sleep, 0.0, roots=[]).value == "woke"
    pid = box.pid
    res = box.call(_spin, roots=[], timeout=0.3)
    assert (res.kind, res.message) == ("hang", "no answer within 0.3 s of CPU time")  # the worker's own alarm
    assert box.call(_sleep, 0.0, roots=[]).value == "woke"
    assert box.pid == pid


def test_a_call_blocked_without_using_cpu_is_killed_as_a_hang(box: Sandbox) -> None:
    res = box.call(_sleep, 3600.0, roots=[], timeout=0.3)
    assert (res.kind, res.message) == ("hang", "no answer: every thread slept without using CPU for 5.0 s (killed)")
    assert box.pid is None
    assert box.call(_sleep, 0.0, roots=[]).value == "woke"  # a new worker


def test_a_call_slowed_down_by_a_busy_machine_is_not_a_hang(box: Sandbox, tmp_path: Path) -> None:
    """The worker is descheduled (SIGSTOP, as a loaded machine does to it) for longer than the
    call's time: that time is not the call's, so it still answers."""
    assert box.call(_sleep, 0.0, roots=[]).value == "woke"
    pid, mark, done = box.pid, tmp_path / "in-call", threading.Event()

    def deschedule() -> None:
        while not mark.exists() and not done.is_set():
            time.sleep(0.01)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(2.0)
        os.kill(pid, signal.SIGCONT)

    pauser = threading.Thread(target=deschedule)
    pauser.start()
    try:
        res = box.call(_mark_and_sleep, str(mark), 0.2, roots=[str(tmp_path)], timeout=1.0)
    finally:
        done.set()
        pauser.join()
    assert (res.kind, res.value) == ("returned", "woke")
    assert box.pid == pid


def test_a_symlink_out_of_the_root_is_an_outside_access(box: Sandbox, tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "secret").write_bytes(b"s3cret")
    (tmp_path / "root" / "inside").write_bytes(b"ok")
    os.symlink(tmp_path / "secret", tmp_path / "root" / "link")
    root = [str(tmp_path / "root")]
    res = box.call(_read, str(tmp_path / "root" / "inside"), roots=root)
    assert (res.value, res.outside) == (b"ok", [])
    res = box.call(_read, str(tmp_path / "root" / "link"), roots=root)
    assert res.value == b"s3cret"
    assert res.outside == [f"open {tmp_path / 'root' / 'link'} -> {tmp_path / 'secret'}"]


def test_errors_are_classified_and_a_crash_is_survived(box: Sandbox) -> None:
    res = box.call(_raise_corrupt, roots=[])
    assert (res.kind, res.checkpoint_error, res.message) == ("raised", True, "/x/metadata.json: damaged")
    res = box.call(_read, "/nonexistent/x", roots=["/nonexistent"])
    assert (res.kind, res.error_type, res.checkpoint_error) == ("raised", "FileNotFoundError", False)
    res = box.call(_die, roots=[])
    assert res.kind == "crashed"
    assert box.call(_sleep, 0.0, roots=[]).value == "woke"  # a new worker
