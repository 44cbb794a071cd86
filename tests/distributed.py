"""Run a function on N real gloo ranks (CPU), each in its own process, on a free port.

``run_ranks(world_size, fn, *args)`` returns each rank's return value, in rank order. If any
rank raises, the first failing rank's exception is re-raised here with every rank's traceback
attached; a rank that hangs past ``timeout`` fails the test instead of hanging it.

Processes come from a forkserver that has already imported torch, so a rank starts in well
under a second. ``fn`` must be a module-level function (it is pickled by reference), and should return plain
values: tensors sent back through the queue outlive their process badly.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import random
import socket
import traceback
from collections.abc import Callable
from typing import Any

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "shardsafe.api", "shardsafe.manager", "shardsafe.hf", "shardsafe.verify"])  # shardsafe imports its parts on first use


_PORTS = (20000, 32000)  # below the kernel's ephemeral range (32768-60999 here), which client sockets take ports from


def free_port() -> int:
    """A port free now, outside the ephemeral range: a port the kernel hands out for port 0 can be
    taken by any client connection before our server binds it (seen in CI: EADDRINUSE)."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(*_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the range is crowded: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue, backend: str = "gloo") -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        try:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            )
        except Exception as e:
            if "EADDRINUSE" in str(e):  # another process took the port after free_port: run_ranks tries another
                queue.put((rank, False, _PortTaken(port), traceback.format_exc()))
                return
            raise
        try:
            result = fn(rank, world_size, *args)
            dist.barrier()  # gloo aborts at exit without it, now and then
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, result, ""))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        try:
            queue.put((rank, False, e, traceback.format_exc()))
        except Exception:  # unpicklable exception: send its text
            queue.put((rank, False, RuntimeError(repr(e)), traceback.format_exc()))


class _PortTaken(Exception):
    """Rank 0 could not listen on the port free_port gave: another process took it meanwhile."""


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, backend: str = "gloo") -> list[Any]:
    """``backend`` is ``init_process_group``'s (e.g. ``"cpu:gloo,cuda:nccl"`` for CUDA tests).
    A port taken by another process before rank 0 listens on it is retried with another (3 tries)."""
    for attempt in range(3):
        try:
            return _run_ranks(world_size, fn, args, timeout, backend)
        except _PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_ranks(world_size: int, fn: Callable[..., Any], args: tuple, timeout: float, backend: str) -> list[Any]:
    queue = _CTX.Queue()
    port = free_port()
    procs = [_CTX.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any, str]] = {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, value, tb = queue.get(timeout=timeout)
            except queue_mod.Empty:
                missing = sorted(set(range(world_size)) - set(results))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout}s") from None
            results[rank] = (ok, value, tb)
            if not ok:  # the others may be blocked in a collective; give them a moment, then stop
                break
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world_size else 10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    failed = sorted(r for r, (ok, _, _) in results.items() if not ok)
    if failed:
        err = results[failed[0]][1]
        detail = "\n".join(f"--- rank {r} ---\n{results[r][2]}" for r in failed)
        err.add_note(f"failing rank(s) {failed}:\n{detail}")
        raise err
    return [results[r][1] for r in range(world_size)]
