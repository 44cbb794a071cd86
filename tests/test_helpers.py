"""The tests' own helpers (tests/helpers.py): comparisons that see every bit, a hang detector
that a busy machine does not trip, the per-run cache, the rank spawner's failure reports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from .helpers import CTX, Watchdog, assert_bits, assert_same, bits, built_once, flip_byte, run_process, run_ranks


def test_bits_tell_apart_what_equality_hides() -> None:
    assert torch.equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not torch.equal(bits(torch.tensor([0.0])), bits(torch.tensor([-0.0])))
    quiet, payload = torch.tensor([float("nan")]), torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert not torch.equal(bits(quiet), bits(payload))
    assert torch.equal(bits(torch.arange(6.0).reshape(2, 3).t()), bits(torch.tensor([[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]])))


def test_assert_bits_names_what_differs() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert_bits(t.clone(), t, "w")
    with pytest.raises(AssertionError, match=r"^w: dtype torch.float64 != torch.float32"):
        assert_bits(t.double(), t, "w")
    with pytest.raises(AssertionError, match=r"^w: shape \(3, 2\) != \(2, 3\)"):
        assert_bits(t.reshape(3, 2), t, "w")
    other = t.clone()
    other[1, 2] = -0.0 if other[1, 2] == 0 else other[1, 2].neg()
    with pytest.raises(AssertionError, match=r"^w: bytes differ"):
        assert_bits(other, t, "w")
    with pytest.raises(AssertionError, match=r"^z: bytes differ"):
        assert_bits(torch.tensor([-0.0]), torch.tensor([0.0]), "z")


def test_assert_same_compares_types_order_nan_and_tensors() -> None:
    want = {"a": (1, [2.5, float("nan")]), "b": OrderedDict(x=np.float64(1.0)), "t": torch.tensor([1.0, -0.0])}
    assert_same({"a": (1, [2.5, float("nan")]), "b": OrderedDict(x=np.float64(1.0)), "t": torch.tensor([1.0, -0.0])}, want)
    for bad in (
        {"a": [1, [2.5, float("nan")]], "b": OrderedDict(x=np.float64(1.0)), "t": torch.tensor([1.0, -0.0])},  # list for tuple
        {"a": (1, [2.5, float("nan")]), "b": OrderedDict(x=1.0), "t": torch.tensor([1.0, -0.0])},  # float for np.float64
        {"b": OrderedDict(x=np.float64(1.0)), "a": (1, [2.5, float("nan")]), "t": torch.tensor([1.0, -0.0])},  # order
        {"a": (1, [2.5, 0.0]), "b": OrderedDict(x=np.float64(1.0)), "t": torch.tensor([1.0, -0.0])},  # NaN lost
        {"a": (1, [2.5, float("nan")]), "b": OrderedDict(x=np.float64(1.0)), "t": torch.tensor([1.0, 0.0])},  # sign of zero
    ):
        with pytest.raises(AssertionError):
            assert_same(bad, want)


def test_flip_byte_changes_exactly_one_byte(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(bytes(range(16)))
    flip_byte(str(tmp_path), "f", 5)
    flip_byte(str(tmp_path), "f", 9, mask=0x10)
    want = bytearray(range(16))
    want[5] ^= 0x5A
    want[9] ^= 0x10
    assert (tmp_path / "f").read_bytes() == bytes(want)


def _until_hang(watch: Watchdog) -> str:
    while (why := watch.check()) is None:
        time.sleep(0.05)
    return why


def test_the_watchdog_calls_a_sleeping_process_hung_and_a_stopped_one_not() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        time.sleep(0.5)  # let it reach its sleep (until then it is runnable: progress)
        assert _until_hang(Watchdog([sleeper.pid], idle_s=1.0, cpu_s=60)) == "every thread slept without using CPU for 1.0 s"
        os.kill(sleeper.pid, signal.SIGSTOP)  # as a loaded machine deschedules it: waiting, not hung
        watch = Watchdog([sleeper.pid], idle_s=0.5, cpu_s=60)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            assert watch.check() is None
            time.sleep(0.05)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_watchdog_bounds_the_cpu_of_a_process_and_its_children() -> None:
    spinner = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', 'while True: pass'])"])
    try:
        why = _until_hang(Watchdog([spinner.pid], idle_s=3600, cpu_s=0.5))  # the child spins, the parent waits
        assert why.startswith("they used ") and why.endswith(" s of CPU without finishing")
    finally:
        for child in Path(f"/proc/{spinner.pid}/task/{spinner.pid}/children").read_text().split():
            os.kill(int(child), signal.SIGKILL)
        spinner.kill()
        spinner.wait()


def _hang_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


def test_run_ranks_reports_a_rank_that_hangs() -> None:
    """Rank 1 sleeps for ever; rank 0 waits for it in the barrier after its function: both hang."""
    with pytest.raises(TimeoutError, match=r"^ranks \[0, 1\] of 2 hang: every thread slept without using CPU for 2.0 s$"):
        run_ranks(2, _hang_on_rank_1, timeout=2.0)


def _raise_on_rank_0(rank: int, world: int) -> int:
    if rank == 0:
        raise ValueError("rank 0 says no")
    return rank


def test_run_ranks_re_raises_a_rank_error_with_its_traceback() -> None:
    with pytest.raises(ValueError, match="rank 0 says no") as info:
        run_ranks(2, _raise_on_rank_0)
    assert "failing rank(s) [0]" in info.value.__notes__[0] and "_raise_on_rank_0" in info.value.__notes__[0]


def _build(counter: Path, path: str) -> None:
    with open(counter, "a") as f:
        f.write("built\n")
    os.makedirs(path)
    Path(path, "x").write_text("made")


def test_built_once_builds_once_per_run_and_again_after_a_failed_build(tmp_path_factory, tmp_path: Path) -> None:
    counter = tmp_path / "count"
    name = f"helpers-{os.getpid()}-{time.monotonic_ns()}"
    first = built_once(tmp_path_factory, name, lambda p: _build(counter, p))
    assert built_once(tmp_path_factory, name, lambda p: _build(counter, p)) == first
    assert Path(first, "x").read_text() == "made" and counter.read_text() == "built\n"
    # another process of the run (an xdist worker) finds it built too
    got = CTX.Process(target=_use_built, args=(tmp_path_factory.getbasetemp(), name, str(counter)))
    got.start()
    got.join()
    assert got.exitcode == 0 and counter.read_text() == "built\n"

    def half(p: str) -> None:
        os.makedirs(p)
        raise RuntimeError("interrupted")

    nested = built_once(tmp_path_factory, f"{name}-dir/iter_0000007", lambda p: _build(counter, p))
    assert nested.endswith(f"{name}-dir/iter_0000007") and Path(nested, "x").read_text() == "made"
    assert counter.read_text() == "built\nbuilt\n"

    other = name + "-b"
    with pytest.raises(RuntimeError, match="interrupted"):
        built_once(tmp_path_factory, other, half)
    again = built_once(tmp_path_factory, other, lambda p: _build(counter, p))
    assert Path(again, "x").read_text() == "made" and counter.read_text() == "built\nbuilt\nbuilt\n"


class _Factory:
    def __init__(self, base: Path) -> None:
        self.base = base

    def getbasetemp(self) -> Path:
        return self.base


def _use_built(base: Path, name: str, counter: str) -> None:
    built_once(_Factory(base), name, lambda p: _build(Path(counter), p))


def test_run_process_returns_what_subprocess_run_does_and_stops_a_hung_process() -> None:
    done = run_process([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                       capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    with pytest.raises(subprocess.CalledProcessError):
        run_process([sys.executable, "-c", "raise SystemExit(1)"], check=True)
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_process([sys.executable, "-c", "import time; time.sleep(3600)"], timeout=1.0, capture_output=True, text=True)
    assert info.value.stderr.endswith("(hung: every thread slept without using CPU for 1.0 s)")


def test_every_test_module_shares_one_forkserver_preload_list():
    """A process has one forkserver: a module that sets its own preload list replaces the one
    every rank of the run starts from (the reliability sandbox did, and each rank of the test run
    then imported torch.distributed.tensor, fsdp and _dynamo itself: about 1.5 s of CPU each)."""
    import multiprocessing.forkserver as forkserver

    from . import helpers
    from .reliability import sandbox  # imported as the test run imports it

    assert forkserver._forkserver._preload_modules == helpers.PRELOAD
    assert sandbox.CONTEXT is helpers.CTX
    assert {"torch.distributed.tensor", "torch.distributed.fsdp", "torch._dynamo"} <= set(helpers.PRELOAD)
