"""The job the kill campaign SIGKILLs: one rank (of 1 or 2, gloo) saving a sequence of checkpoints.

:func:`child` is started by :mod:`tests.reliability.kill` as a forkserver process (torch already
imported) with a plan:

- ``saves``: ``(directory name, version, save_overwrite)`` in order: fresh directories and
  overwrites of one directory;
- ``point``: ``None`` (the parent kills at a random moment) or ``{"fn", "n", "when", "rank"}``:
  on that rank, the ``n``-th call made by shardsafe to ``os.<fn>`` kills this process with
  SIGKILL, ``"before"`` the call, ``"after"`` it returned, or (``write`` only) ``"mid"``: after
  writing half of its bytes;
- ``count``: no kill; write how often shardsafe called each patched function to
  ``counts-r<rank>.json``, to plan exact points.

Rank 0 appends ``start <i>`` before save ``i`` and ``done <i>`` after it returned to ``log``
(unbuffered, so a SIGKILL loses nothing written); every rank touches ``ready-r<rank>`` once its
state is built, just before the first save. A rank that raises (as one whose peer was killed
may) writes the exception's type and traceback to ``error-r<rank>.txt`` and exits with 1. The
patches live in this process only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["PATCHED", "child", "install", "report_errors"]

PATCHED = ("open", "write", "fsync", "replace", "link", "unlink")


def install(point: dict[str, Any] | None, rank: int, counts: Counter, fns: tuple[str, ...] = PATCHED) -> None:
    """Patch ``os.<fn>`` for each of ``fns`` in this process: count shardsafe's calls in
    ``counts`` and, on rank ``point["rank"]``, SIGKILL this process at ``point`` (see the module
    docstring). Used by the manager campaign too."""
    kill = os.kill
    getpid = os.getpid

    def die() -> None:
        kill(getpid(), signal.SIGKILL)

    for fn in fns:
        original = getattr(os, fn)

        def wrapper(*args, _fn=fn, _original=original, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not caller.startswith("shardsafe"):
                return _original(*args, **kwargs)
            counts[_fn] += 1
            if point is None or point["rank"] != rank or point["fn"] != _fn or counts[_fn] != point["n"]:
                return _original(*args, **kwargs)
            if point["when"] == "before":
                die()
            if point["when"] == "mid":
                fd, data = args
                view = memoryview(data).cast("B")
                _original(fd, view[: max(view.nbytes // 2, 1)])
                die()
            result = _original(*args, **kwargs)
            die()
            return result

        setattr(os, fn, wrapper)


def report_errors(path: str, body: Callable[[], None]) -> None:
    """Run ``body``; a rank whose body raises writes the exception's class and traceback to
    ``path`` (renamed into place when whole: the rank may be killed meanwhile) and exits 1."""
    try:
        body()
    except BaseException as e:  # noqa: BLE001 - e.g. a rank whose peer was killed: reported by the parent
        with open(path + ".tmp", "w") as f:
            f.write(f"{type(e).__module__}.{type(e).__qualname__}\n{traceback.format_exc()}")
        os.rename(path + ".tmp", path)
        sys.exit(1)


def child(rank: int, world: int, port: int, root: str, plan: dict[str, Any]) -> None:
    """Run ``plan`` as rank ``rank`` of ``world``; see the module docstring."""
    report_errors(os.path.join(root, f"error-r{rank}.txt"), lambda: _run(rank, world, port, root, plan))


def _run(rank: int, world: int, port: int, root: str, plan: dict[str, Any]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    from shardsafe import Checkpointer
    from shardsafe.knobs import KNOBS

    from .states import sharded_rank_state, single_state

    torch.set_num_threads(1)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # small write blocks: a save makes dozens of write calls, so "mid-write" has many moments
    ckpt = Checkpointer(knobs=dataclasses.replace(KNOBS, write_block_bytes=plan.get("block", 1 << 14)))
    states = {}
    for _, version, _ in plan["saves"]:
        states[version] = sharded_rank_state(rank, version, large=True) if world > 1 else single_state(version, large=True)
    counts: Counter = Counter()
    install(plan.get("point"), rank, counts)
    log = open(os.path.join(root, "log"), "ab", buffering=0) if rank == 0 else None
    open(os.path.join(root, f"ready-r{rank}"), "w").close()
    for i, (name, version, overwrite) in enumerate(plan["saves"]):
        if log:
            log.write(f"start {i}\n".encode())
        ckpt.save(os.path.join(root, name), states[version], save_overwrite=overwrite)
        if log:
            log.write(f"done {i}\n".encode())
    if plan.get("count"):
        with open(os.path.join(root, f"counts-r{rank}.json"), "w") as f:
            json.dump(dict(counts), f)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
