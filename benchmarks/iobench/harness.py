"""Run the methods side by side: one process per rank, methods interleaved, repeated.

A *phase* is one world size: ``world`` processes (spawned, gloo on a free port) build their part
of each case's state once, then for every operation run every method, ``reps`` times, in an
order rotated each repetition, so that slow drifts of the machine (write bandwidth here swings
several-fold) hit every method alike. Each measurement is bracketed by barriers:

    prepare (outside the clock) -> barrier -> reset peak RSS -> clock -> run -> barrier -> clock

so a rank's time includes waiting for the slowest rank; CPU seconds are summed over ranks
(user + system, all threads), which shows what a method costs when the cores are shared. Peak RSS "beyond the state" is the
high-water mark during the run minus the RSS just before it (Linux ``/proc/self/clear_refs``
resets the mark, and glibc's ``malloc_trim`` first returns what earlier methods freed; elsewhere
a 2 ms psutil sampler stands in). Before each load the checkpoint is read into the page cache
(``warm``) or dropped from it (``cold``, ``posix_fadvise(DONTNEED)``), or (``both``, the default)
same-layout loads both ways in turn and resharding loads warm. After each
load the state's CRC32C is compared with the one it was built with.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

_CTX = mp.get_context("spawn")


@dataclass(frozen=True)
class Config:
    root: str  # scratch directory for checkpoints (same disk as the data that matters)
    cases: dict[str, int]  # case name -> total bytes of its state
    reps: int = 3
    world_sizes: tuple[int, ...] = (1, 2, 4)
    cache: str = "both"  # before each load: "warm" (files read into the page cache), "cold" (dropped), or
    # "both": same-layout loads both ways, resharding loads warm
    saves: tuple[str, ...] = ()
    loads: tuple[str, ...] = ()
    reshards: tuple[str, ...] = ()
    unshards: tuple[str, ...] = ()
    reshard_ops: tuple[str, ...] = ("2->1", "2->4", "S0->S1")
    verbose: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- peak memory


class PeakRSS:
    """Peak resident memory of this process during a block, beyond what it held at the start."""

    def __init__(self) -> None:
        self._proc = os.path.exists("/proc/self/clear_refs") and _can_reset()
        self._psutil = None
        if not self._proc:
            import psutil

            self._psutil = psutil.Process()

    def __enter__(self) -> PeakRSS:
        self.start = _rss(self._psutil)
        if self._proc:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        else:
            self._peak = self.start
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, _rss(self._psutil))

    def __exit__(self, *exc) -> None:
        if self._proc:
            peak = _hwm()
        else:
            self._stop.set()
            self._thread.join()
            peak = max(self._peak, _rss(self._psutil))
        self.extra = max(peak - self.start, 0)


def _can_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss(ps=None) -> int:
    if ps is not None:
        return ps.memory_info().rss
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


# ---------------------------------------------------------------- helpers


def _cpu() -> float:
    """CPU seconds of this process so far (all threads, user + system)."""
    t = os.times()
    return t.user + t.system


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def warm_cache(path: str) -> None:
    """Read every file under ``path`` once, so that the next read finds it in the page cache."""
    buf = bytearray(16 << 20)
    for root, _dirs, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


_LIBC = None


def trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``), so that the RSS before a
    measurement is not inflated by what the previous method freed."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def drop_cache(path: str) -> None:
    """Ask the kernel to forget the (clean, fsynced) pages of every file under ``path``."""
    for root, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def case_dir(cfg: Config, case: str, world: int, method: str) -> str:
    return os.path.join(cfg.root, case, f"ws{world}", method)


def _rotated(names: tuple[str, ...], rep: int) -> list[str]:
    k = rep % len(names) if names else 0
    return list(names[k:] + names[:k])


def _log(cfg: Config, msg: str) -> None:
    if cfg.verbose:
        print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- one rank of a phase


def _rank_entry(run_rank, rank: int, world: int, port: int, cfg: Any, out) -> None:
    """A rank process: ``run_rank(rank, world, port, cfg)``'s records, or its traceback, onto ``out``.
    Every rank runs on this machine, so it is told so as torchrun tells it (``LOCAL_WORLD_SIZE``)."""
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    try:
        out.put((rank, True, run_rank(rank, world, port, cfg)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, False, traceback.format_exc()))


def _run_rank(rank: int, world: int, port: int, cfg: Config) -> list[dict]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from . import methods as M
    from .states import build_state, local_bytes, model_spec, scribble, state_crc, synthetic_spec

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    records: list[dict] = []
    try:
        mesh = init_device_mesh("cpu", (world,))
        peak = PeakRSS()

        def measure(op: str, case: str, method: str, rep: int, fn, prepare, state, expect: int | None, cache=None) -> None:
            prepare()
            gc.collect(1)  # a full collection costs 0.1 s with torch loaded: young generations only
            trim_heap()
            dist.barrier()
            with peak:
                c0, t0 = _cpu(), time.perf_counter()
                fn()
                dist.barrier()
                dt, cpu = time.perf_counter() - t0, _cpu() - c0
            ok = None
            if expect is not None:
                ok = state_crc(state) == expect
            records.append(
                dict(case=case, world=world, op=op, cache=cache, method=method, rep=rep, seconds=dt, cpu_s=cpu,
                     extra_rss=peak.extra, state_bytes=local_bytes(state), ok=ok, rank=rank)
            )
            if rank == 0:
                what = op if cache in (None, "warm") else f"{op} cold"
                _log(cfg, f"  ws{world} {case:9} {what:11} rep {rep} {method:16} {dt:7.3f} s  +{peak.extra / 2**20:7.1f} MiB"
                          + ("" if ok is not False else "  WRONG DATA"))

        def rm(path: str) -> None:
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)

        def load_prep(path: str, target, cache: str) -> None:
            scribble(target)
            if rank == 0:  # the others wait at the barrier
                (drop_cache if cache == "cold" else warm_cache)(path)

        def loads(op: str, case: str, methods: tuple[str, ...], saved_world: int, target, expect_crc: int) -> None:
            # "both" measures cold same-layout loads; resharding loads stay warm (the run must fit in ~15 min)
            modes = (cfg.cache,) if cfg.cache != "both" else (("warm", "cold") if op == "load" else ("warm",))
            for rep in range(cfg.reps):
                for m in _rotated(methods, rep):
                    fn, saved_by = M.LOADS[m]
                    path = case_dir(cfg, case, saved_world, saved_by)
                    expect = None if m in M.LIMIT_LOADS else expect_crc
                    for cache in modes:
                        measure(op, case, m, rep, lambda fn=fn, path=path, t=target: fn(t, path),
                                lambda path=path, t=target, c=cache: load_prep(path, t, c), target, expect, cache)

        for case, total in cfg.cases.items():
            spec = synthetic_spec(total) if case == "synthetic" else model_spec(total)[0]
            state = build_state(spec, mesh, 0)
            crc = state_crc(state)

            for rep in range(cfg.reps):
                for m in _rotated(cfg.saves, rep):
                    path = case_dir(cfg, case, world, m)
                    measure("save", case, m, rep, lambda m=m, path=path, st=state: M.SAVES[m](st, path), lambda path=path: rm(path), state, None)
            # keep in the page cache only what is read next (the machine's memory is not endless)
            needed = {M.LOADS[m][1] for m in cfg.loads}
            for m in cfg.saves:
                if m not in needed:
                    rm(case_dir(cfg, case, world, m))
            dist.barrier()

            loads("load", case, cfg.loads, world, state, crc)
            if world == 2:  # later phases reshard from (and unshard) these three only
                for m in cfg.saves:
                    if m not in ("shardsafe", "dcp", "raw"):
                        rm(case_dir(cfg, case, world, m))
                dist.barrier()

            op = {1: "2->1", 4: "2->4", 2: "S0->S1"}.get(world)
            if op in cfg.reshard_ops and 2 in cfg.world_sizes and cfg.reshards:
                if op == "S0->S1":  # a second layout of the same tensors
                    del state
                    gc.collect()
                    target = build_state(spec, mesh, 1)
                    loads(op, case, cfg.reshards, 2, target, state_crc(target))
                    del target
                else:
                    loads(op, case, cfg.reshards, 2, state, crc)
            state = None
            gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return records


def run_phase(cfg: Config, world: int, timeout: float = 3600.0) -> list[dict]:
    """Every operation of one world size; returns one merged record per (case, op, method, rep)."""
    return merge_ranks(run_ranks_collect(_run_rank, world, cfg, timeout=timeout, daemon=True, join_s=30))


def run_ranks_collect(
    run_rank, world: int, cfg: Any, *, timeout: float = 3600.0, daemon: bool = True, join_s: float = 30
) -> list[dict]:
    """Run ``run_rank(rank, world, port, cfg) -> records`` (a module-level function) in one spawned
    process per rank (gloo on a free port). Returns every rank's records."""
    out = _CTX.Queue()
    port = free_port()
    procs = [_CTX.Process(target=_rank_entry, args=(run_rank, r, world, port, cfg, out), daemon=daemon) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, list[dict]] = {}
    try:
        while len(got) < world:
            try:
                rank, ok, value = out.get(timeout=timeout)
            except queue_mod.Empty:
                raise TimeoutError(f"world size {world}: ranks {sorted(set(range(world)) - set(got))} timed out") from None
            if not ok:
                raise RuntimeError(f"world size {world}, rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=join_s)
            if p.is_alive():
                p.kill()
                p.join()
    return [r for recs in got.values() for r in recs]


def merge_ranks(records: list[dict]) -> list[dict]:
    """One record per measurement: the slowest rank's time, the largest extra RSS and state."""
    merged: dict[tuple, dict] = {}
    for r in records:
        key = (r["case"], r["world"], r["op"], r.get("cache"), r["method"], r["rep"])
        m = merged.get(key)
        if m is None:
            merged[key] = {k: v for k, v in r.items() if k != "rank"}
            continue
        m["seconds"] = max(m["seconds"], r["seconds"])
        m["cpu_s"] = m.get("cpu_s", 0.0) + r.get("cpu_s", 0.0)  # all ranks together
        m["extra_rss"] = max(m["extra_rss"], r["extra_rss"])
        m["state_bytes"] = max(m["state_bytes"], r["state_bytes"])
        if r["ok"] is not None:
            m["ok"] = bool(m["ok"]) and r["ok"]
    return list(merged.values())


# ---------------------------------------------------------------- unshard (one process, no group)


def _unshard_main(cfg: Config, out) -> None:
    try:
        out.put((0, True, _run_unshard(cfg)))
    except BaseException:  # noqa: BLE001
        out.put((0, False, traceback.format_exc()))


def _run_unshard(cfg: Config) -> list[dict]:
    from math import prod

    from . import methods as M
    from .states import model_spec, synthetic_spec

    records = []
    peak = PeakRSS()
    for case, total in cfg.cases.items():
        spec = synthetic_spec(total) if case == "synthetic" else model_spec(total)[0]
        largest = max(prod(s) * d.itemsize for _, s, d in spec)
        src = {m: case_dir(cfg, case, 2, m) for m in ("shardsafe", "dcp", "raw")}
        work = os.path.join(cfg.root, case, "unshard")
        os.makedirs(work, exist_ok=True)
        for rep in range(cfg.reps):
            for m in _rotated(cfg.unshards, rep):
                dest = os.path.join(work, m)
                for ext in (".safetensors", ".pt", ".bin"):
                    if os.path.exists(dest + ext):
                        os.unlink(dest + ext)
                for p in src.values():  # unshard reads a checkpoint just written: warm, unless only cold is asked
                    (drop_cache if cfg.cache == "cold" else warm_cache)(p)
                gc.collect(1)
                trim_heap()
                with peak:
                    c0, t0 = _cpu(), time.perf_counter()
                    M.UNSHARDS[m](src, dest)
                    dt, cpu = time.perf_counter() - t0, _cpu() - c0
                records.append(
                    dict(case=case, world=1, op="unshard", cache=None, method=m, rep=rep, seconds=dt, cpu_s=cpu, extra_rss=peak.extra,
                         state_bytes=0, largest_tensor=largest, ok=None)
                )
                _log(cfg, f"  ws1 {case:9} unshard  rep {rep} {m:18} {dt:7.3f} s  +{peak.extra / 2**20:7.1f} MiB")
        shutil.rmtree(work, ignore_errors=True)
    return records


def run_unshard(cfg: Config, timeout: float = 3600.0) -> list[dict]:
    out = _CTX.Queue()
    p = _CTX.Process(target=_unshard_main, args=(cfg, out), daemon=True)
    p.start()
    try:
        _, ok, value = out.get(timeout=timeout)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()
    if not ok:
        raise RuntimeError(f"unshard failed:\n{value}")
    return value
