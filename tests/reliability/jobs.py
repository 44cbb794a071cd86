"""The jobs the kill and manager campaigns run: ``world`` processes started from a ``target``, each
rank writing ``ready-r<rank>`` once it is under way, killed after a delay or left to end."""

from __future__ import annotations

import json
import multiprocessing.connection as mpc
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from .sandbox import CONTEXT


def kill_all(procs: list) -> None:
    for p in procs:
        if p.exitcode is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.join()


def _wait_ready(procs: list, root: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(root, f"ready-r{r}")) for r in range(len(procs))):
            return True
        if any(p.exitcode is not None for p in procs):
            return False
        time.sleep(0.005)
    return False


def run_job(target: Callable[..., None], world: int, root: str, plan: dict[str, Any], delay: float | None,
            timeout: float) -> tuple[str, float]:
    """Run ``target(rank, world, port, root, plan)`` on ``world`` processes to their end or their kill;
    returns "killed", "finished", "hang" or "child-error", and the seconds from every rank being
    ready to the job's end. ``delay``: SIGKILL every rank that long after all are ready; None: wait
    for the first rank to end, then end the others (as a launcher does)."""
    from ..helpers import free_port

    port = free_port()
    procs = [CONTEXT.Process(target=target, args=(r, world, port, root, plan), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    ready = time.monotonic()
    try:
        if not _wait_ready(procs, root, timeout):
            return ("child-error" if any(p.exitcode not in (None, 0) for p in procs) else "hang"), 0.0
        ready = time.monotonic()
        if delay is not None:
            time.sleep(delay)
        else:
            mpc.wait([p.sentinel for p in procs], timeout=timeout)
            if all(p.exitcode is None for p in procs):
                kill_all(procs)
                return "hang", time.monotonic() - ready
            time.sleep(0.002)
        kill_all(procs)
    finally:
        kill_all(procs)
    took = time.monotonic() - ready
    codes = [p.exitcode for p in procs]
    if -signal.SIGKILL in codes:  # a rank whose peer died may have raised first: that is its right
        return "killed", took
    return ("child-error" if any(codes) else "finished"), took


def rank_errors(root: str) -> str:
    """The ``error-r<rank>.txt`` reports of a job's ranks (each one's last 1500 characters)."""
    out = []
    for name in sorted(os.listdir(root)):
        if name.startswith("error-r"):
            with open(os.path.join(root, name)) as f:
                out.append(f"{name}: {f.read()[-1500:]}")
    return "\n".join(out)


def read_counts(root: str, world: int) -> dict[int, dict[str, int]]:
    """The ``counts-r<rank>.json`` a counting run's ranks wrote: calls per patched function."""
    counts = {}
    for r in range(world):
        with open(os.path.join(root, f"counts-r{r}.json")) as f:
            counts[r] = json.load(f)
    return counts
