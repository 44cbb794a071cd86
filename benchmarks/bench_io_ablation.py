"""Where shardsafe's time goes, in one process: each engine feature switched off in turn.

Usage::

    python benchmarks/bench_io_ablation.py [--total-gib 1] [--reps 7] [--only load,save,reshard]

Interleaved, repeated, with wall and CPU seconds (user + system, all threads):

- **load** (same layout, warm page cache): shardsafe as shipped; without CRC32C verification
  (the checksum replaced by a no-op, for measurement only); on one thread; against ``preadv``
  into the same tensors, 1 and 4 threads. The difference between the first two is what
  verification costs; between the second and ``preadv``, everything else.
- **save**: shardsafe as shipped; without early writeback (``writeback_bytes=0``); with
  64 MiB blocks; against the raw writes of ``bench_io`` (``raw``, ``raw-wb``).
- **reshard** (Shard(0) saved by 2 simulated ranks -> Shard(1) half of rank 0): the coalescing
  gap at 4 KiB (the old default), 64 KiB (the default) and 1 MiB.

Numbers from this machine are in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time
from collections.abc import Callable

import torch
from iobench import methods as M
from iobench.states import _fill, synthetic_spec

import shardsafe
from shardsafe import ShardedTensor
from shardsafe.format.checksum import ChunkSums
from shardsafe.knobs import KNOBS
from shardsafe.storage.local import LocalStorage

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _no_crc(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn`` with block checks switched off: for measurement only."""

    def run() -> None:
        real = ChunkSums.check
        ChunkSums.check = lambda self, start, data: None
        try:
            fn()
        finally:
            ChunkSums.check = real

    return run


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _interleave(variants: dict[str, Callable[[], None]], reps: int, prepare: Callable[[str], None] | None = None) -> None:
    names = list(variants)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        for n in names[rep % len(names) :] + names[: rep % len(names)]:
            if prepare:
                prepare(n)
            c, t = _cpu(), time.perf_counter()
            variants[n]()
            wall[n].append(time.perf_counter() - t)
            cpu[n].append(_cpu() - c)
    for n in names:
        w, c = sorted(wall[n]), sorted(cpu[n])
        print(f"  {n:22} median {w[len(w) // 2]:6.3f} s  (min {w[0]:.3f}, max {w[-1]:.3f})  CPU {c[len(c) // 2]:6.3f} s")


def _state(total: int) -> dict[str, torch.Tensor]:
    state = {}
    for key, shape, dtype in synthetic_spec(total):
        t = torch.empty(shape, dtype=dtype)
        _fill(t, key, shape, (0,) * len(shape))
        state[key] = t
    return state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--only", default="load,save,reshard")
    ap.add_argument("--dir", default="/tmp/shardsafe-ablation")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    total = int(args.total_gib * 2**30)
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)

    def ckpt(**kw) -> shardsafe.Checkpointer:
        return shardsafe.Checkpointer(knobs=dataclasses.replace(KNOBS, **kw))

    try:
        state = _state(total)
        print(f"{sum(t.numel() * t.element_size() for t in state.values()) / 2**30:.2f} GiB, {len(state)} tensors, "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
        if "load" in only:
            ss, raw = os.path.join(root, "ss"), os.path.join(root, "raw")
            shardsafe.Checkpointer().save(ss, state)
            M.SAVES["raw"](state, raw)
            print("load, same layout, warm page cache:")
            _interleave(
                {
                    "shardsafe": lambda: ckpt().load(ss, state),
                    "shardsafe no-verify": _no_crc(lambda: ckpt().load(ss, state)),
                    "shardsafe 1 thread": lambda: ckpt(io_threads=1).load(ss, state),
                    "preadv": lambda: M.LOADS["preadv"][0](state, raw),
                    "preadv-mt": lambda: M.LOADS["preadv-mt"][0](state, raw),
                },
                args.reps,
            )
            shutil.rmtree(ss)
            shutil.rmtree(raw)
        if "save" in only:
            print("save, durable:")

            def save(**kw) -> Callable[[], None]:
                knobs = dataclasses.replace(KNOBS, **kw)
                path = os.path.join(root, "save")
                return lambda: shardsafe.Checkpointer(knobs=knobs).save(LocalStorage(path, knobs=knobs), state)

            _interleave(
                {
                    "shardsafe": save(),
                    "shardsafe no-writeback": save(writeback_bytes=0),
                    "shardsafe 64 MiB blocks": save(write_block_bytes=64 << 20),
                    "raw": lambda: M.SAVES["raw"](state, os.path.join(root, "save")),
                    "raw-wb": lambda: M.SAVES["raw-wb"](state, os.path.join(root, "save")),
                },
                args.reps,
                prepare=lambda _n: shutil.rmtree(os.path.join(root, "save"), ignore_errors=True),
            )
        if "reshard" in only:
            sys.path.insert(0, _REPO)
            from tests.simulate import simulate_save

            ranks: list[dict] = [{}, {}]
            target = {}
            for key, t in state.items():
                if t.dim() != 2:
                    continue
                for r in range(2):
                    ranks[r][key] = ShardedTensor.from_rank_offsets(key, t.chunk(2)[r].clone(), (0, r, 2))
                target[key] = ShardedTensor.from_rank_offsets(key, torch.empty_like(t.chunk(2, dim=1)[0]), (1, 0, 2))
            state = {}
            path = os.path.join(root, "reshard")
            simulate_save(path, ranks)
            del ranks
            print("load Shard(0) of 2 -> Shard(1), half of the columns, warm page cache:")
            _interleave(
                {f"coalesce gap {g >> 10} KiB": (lambda g=g: ckpt(coalesce_gap_bytes=g).load(path, target)) for g in (4 << 10, 64 << 10, 1 << 20)},
                args.reps,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
