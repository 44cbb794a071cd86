"""Experiment: does a save in flight slow the training step less when its checksums and writes
run in a writer *process* than in a *thread* of the training process? (issue 11, async save)

Self-contained: needs torch, and xxhash if present (else ``zlib.crc32``, said in the output);
no shardsafe code. Usage::

    python benchmarks/exp_background_writer.py [--ranks 1,2] [--mib 64,256] [--threads 2]
        [--reps 4] [--step-ms 30] [--mlp W,H,B] [--opt adamw|sgd] [--variants NAME,...]
        [--dir DIR] [--json PATH] [--no-gil-probe] [--quick]

For each number of ranks R, R processes (spawned, independent: they only meet at a barrier
before every measured save, so their saves overlap as on a machine of several ranks) each
hold a "state" of S MiB (random fp32) and a staging buffer of S MiB in shared memory
(``multiprocessing.shared_memory``), allocated and touched once. Each rank trains a small
MLP (Linear-GELU-Linear, forward, backward, optimizer step; the batch is sized so one step
takes about ``--step-ms`` with ``torch.set_num_threads(--threads)``). A save copies the state
into the staging buffer (``blocked``: the training loop waits for that memcpy only), then a
background carrier checksums the buffer and writes it to ``DIR/rank<r>.bin`` with ``os.pwrite``
(``sync_file_range`` every 16 MiB, as our local storage does) and fsyncs it, while the rank
keeps stepping. Variants (the carrier and what it does):

- ``idle``: a thread that only sleeps ``--idle-s`` (the noise floor of the measurement);
- ``thread-wb`` (a): our ``_write_file``'s shape in one background thread: 1 MiB units, an
  XXH3-64 digest per 1 MiB block in that thread, each unit handed through a bounded queue
  (depth 4) to a second, write-behind thread that pwrites it;
- ``thread-one`` (b): hashing and writing in ONE thread, 16 MiB units, no queue (fewest
  Python steps and GIL hand-offs per byte);
- ``thread-nohash`` (e): ``thread-wb`` without the digests (what the write alone costs);
- ``thread-hashonly``: ``thread-one`` without the writes (what the digests alone cost);
- ``thread-pin``: ``thread-wb`` with the training threads pinned to their own cores and the two
  background threads to others (``os.sched_setaffinity`` per thread); if this still slows the
  step, the cause is the shared interpreter (GIL), not a shared core;
- ``thread-wb-si``: ``thread-wb`` with ``sys.setswitchinterval(0.0005)`` during the save (10x
  shorter than the default): sensitive only if the background holds the GIL in long stretches;
- ``proc`` (c): a writer process per rank (spawned once at start, reused; never a fork of the
  torch process) that attaches the shared staging buffer, receives "save" over a pipe, runs
  exactly ``thread-wb``'s pipeline (hash thread + write-behind thread) and answers with the
  fold of its digests and the time it was durable;
- ``proc-pin`` (d): ``proc`` with the training threads pinned to their own cores and the
  writer process to others (whole physical cores where there are enough; skipped, and said
  so, where there are fewer than R * (threads + 1) cores);
- ``proc-nohash``: ``proc`` without the digests (not in the default set).

Per variant and repetition (the order of the variants rotates each repetition), every rank
first steps ``--base-steps`` times with nothing in flight (its baseline for that variant:
pinned variants have a pinned baseline), then saves and steps until the save is durable.
Reported per variant, for the worst rank: ``base_ms`` (median baseline step), ``step_ms``
(median of the steps that began while the save was in flight), ``slow%``, ``steps`` (how many
such steps, all repetitions), ``lost_ms`` (per save, the time those steps took beyond
``base_ms``), and, the slowest rank's median: ``blocked_ms`` (the memcpy) and ``durable_ms``
(from the save call to fsync returned, training running beside it). With the GIL probe (on by
default), each rank then saves once more per thread variant (and ``proc`` as a control) with
no training, while its main thread loops on a call that releases and retakes the GIL
(``os.write`` to /dev/null): ``gil%`` is the share of that time the probe waited (for the GIL
the background threads held; a core of its own is free on 16 cores), ``gil_max_ms`` the longest
wait, ``bg_py_ms`` the background hashing thread's time outside hashing, queueing, writing and
fsync: its Python overhead per save. ``gil%`` also counts waits for a core (``proc``, whose
work never takes this interpreter's GIL, is the control: its ``gil%`` is the scheduler's share).
The header says whether the digest function releases the GIL on a large buffer
(:func:`hash_gil_check`; python-xxhash 4.x does above 64 KiB) and the file system written to.

Prints a table, then one ``BGW ...`` line per (ranks, MiB, variant). ``--quick``: 16 MiB, 1 and
2 ranks, 2 repetitions, about 30-60 s.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import struct
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from multiprocessing import shared_memory

try:
    import xxhash

    HASH_NAME = f"xxh3_64 (python-xxhash {xxhash.VERSION})"
    _digest = xxhash.xxh3_64_intdigest
except ImportError:  # the device machine may lack it
    HASH_NAME = "crc32 (xxhash absent: zlib.crc32 instead)"
    _digest = zlib.crc32

MiB = 1 << 20
BLOCK = 1 * MiB  # one digest per block, as knobs.checksum_block_bytes
WRITEBACK = 16 * MiB  # sync_file_range every this many bytes, as knobs.writeback_bytes
BEHIND_DEPTH = 4  # WriteBehind's queue depth

# name -> (carrier, unit bytes, hash, write, write-behind thread, pinned, switch interval)
VARIANTS: dict[str, dict] = {
    "idle": dict(carrier="thread", idle=True),
    "thread-wb": dict(carrier="thread", unit=1 * MiB, hash=True, write=True, behind=True),
    "thread-one": dict(carrier="thread", unit=16 * MiB, hash=True, write=True, behind=False),
    "thread-nohash": dict(carrier="thread", unit=1 * MiB, hash=False, write=True, behind=True),
    "thread-hashonly": dict(carrier="thread", unit=16 * MiB, hash=True, write=False, behind=False),
    "thread-pin": dict(carrier="thread", unit=1 * MiB, hash=True, write=True, behind=True, pin=True),
    "thread-wb-si": dict(carrier="thread", unit=1 * MiB, hash=True, write=True, behind=True, si=0.0005),
    "proc": dict(carrier="proc", unit=1 * MiB, hash=True, write=True, behind=True),
    "proc-pin": dict(carrier="proc", unit=1 * MiB, hash=True, write=True, behind=True, pin=True),
    "proc-nohash": dict(carrier="proc", unit=1 * MiB, hash=False, write=True, behind=True),
    # the real thing: shardsafe's Checkpointer.async_save of the state as TENSORS tensors (one process,
    # no process group): its own staging copy, planning, checksums, write and commit in the background
    "shardsafe": dict(carrier="shardsafe"),
}
TENSORS = 336  # bench_async's ws2 state: Llama-style dim 256, 9 layers + AdamW
DEFAULT_VARIANTS = [v for v in VARIANTS if v != "proc-nohash"]
PROBED = ["thread-wb", "thread-one", "thread-nohash", "thread-hashonly", "proc"]


# --------------------------------------------------------------------------- the write pipeline


def _load_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return lambda fd, off, n: fn(fd, off, n, 2)  # SYNC_FILE_RANGE_WRITE (ctypes drops the GIL)


_SFR = _load_sync_file_range()


def _pwrite(fd: int, data: memoryview, off: int, state: list[int]) -> None:
    """pwrite all of ``data`` at ``off``; start writeback every WRITEBACK bytes (state: [synced])."""
    while data.nbytes:
        n = os.pwrite(fd, data, off)
        data, off = data[n:], off + n
    if _SFR is not None and off - state[0] >= WRITEBACK:
        _SFR(fd, state[0], off - state[0])
        state[0] = off


def write_file(buf: memoryview, path: str, unit: int, hash: bool, write: bool, behind: bool,
               cpus: list[int] | None = None, **_: object) -> dict:
    """Checksum ``buf`` (a digest per BLOCK) and/or write it to ``path``, fsync; in this thread,
    with a write-behind thread when ``behind``. Returns when durable: its monotonic time, the
    fold of the digests, and where this thread's time went."""
    t_start = time.monotonic()
    if cpus:
        os.sched_setaffinity(0, cpus)  # this thread (Linux); a write-behind thread inherits it
    digests: list[int] = []
    hash_s = put_s = write_s = fsync_s = 0.0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644) if write else -1
    q: queue.Queue | None = None
    wb_thread = None
    errors: list[BaseException] = []
    if write and behind:
        q = queue.Queue(maxsize=BEHIND_DEPTH)

        def behind_run() -> None:
            state = [0]
            while True:
                item = q.get()
                if item is None:
                    return
                try:
                    _pwrite(fd, item[1], item[0], state)
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

        wb_thread = threading.Thread(target=behind_run, name="exp-write-behind", daemon=True)
        wb_thread.start()
    state = [0]
    try:
        for off in range(0, buf.nbytes, unit):
            data = buf[off : off + unit]
            if hash:
                t = time.monotonic()
                digests.extend(_digest(data[p : p + BLOCK]) for p in range(0, data.nbytes, BLOCK))
                hash_s += time.monotonic() - t
            if write:
                t = time.monotonic()
                if q is not None:
                    q.put((off, data))
                    put_s += time.monotonic() - t
                else:
                    _pwrite(fd, data, off, state)
                    write_s += time.monotonic() - t
        if write:
            t = time.monotonic()
            if q is not None:
                q.put(None)
                wb_thread.join()  # type: ignore[union-attr]
                put_s += time.monotonic() - t
                t = time.monotonic()
            if errors:
                raise errors[0]
            os.fsync(fd)
            fsync_s = time.monotonic() - t
    finally:
        if fd >= 0:
            os.close(fd)
    t_done = time.monotonic()
    fold = _digest(struct.pack(f"<{len(digests)}Q", *(d & (2**64 - 1) for d in digests))) if digests else 0
    total = t_done - t_start
    return dict(t_done=t_done, fold=fold, hash_s=hash_s, put_s=put_s, write_s=write_s, fsync_s=fsync_s,
                py_s=max(0.0, total - hash_s - put_s - write_s - fsync_s), total_s=total)


def _stalls(fn: Callable[[memoryview], object], data: memoryview, one: float) -> int:
    """In how many of ten calls of ``fn(data)`` (about ``one`` s each) in another thread this
    thread, looping on a GIL-releasing call, went ``0.7 * one`` without running."""
    windows: list[tuple[float, float]] = []

    def ten() -> None:
        for _ in range(10):
            t = time.monotonic()
            fn(data)
            windows.append((t, time.monotonic()))

    th = threading.Thread(target=ten, daemon=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    stamps = [time.monotonic()]
    th.start()
    while th.is_alive():
        os.write(devnull, b"x")
        stamps.append(time.monotonic())
    os.close(devnull)
    gaps = [(stamps[i], stamps[i + 1]) for i in range(len(stamps) - 1) if stamps[i + 1] - stamps[i] >= 0.7 * one]
    return sum(any(a_ < b and b_ > a for a_, b_ in gaps) for a, b in windows)


def _call_time(fn: Callable[[memoryview], object], data: memoryview) -> float:
    fn(data)
    best = float("inf")
    for _ in range(2):
        t = time.monotonic()
        fn(data)
        best = min(best, time.monotonic() - t)
    return best


def hash_gil_check() -> str:
    """Whether the digest function lets other threads run while it hashes a large buffer. A
    call that holds the GIL stops this thread's Python for the whole call; so a thread hashes
    256 MiB ten times while this one loops on a GIL-releasing call, and counts the calls in
    which this thread stalled for most of a call. The control is ``zlib.crc32`` (which releases
    the GIL) on a slice that takes as long: the same CPU load, so the stalls it shows are the
    scheduler's."""
    data = memoryview(bytearray(os.urandom(MiB)) * 256)
    one = _call_time(_digest, data)
    crc = _call_time(zlib.crc32, data[: 64 * MiB]) / (64 * MiB)
    ctrl = data[: max(MiB, min(data.nbytes, int(one / crc)))]
    hashed, control = _stalls(_digest, data, one), _stalls(zlib.crc32, ctrl, _call_time(zlib.crc32, ctrl))
    verdict = ("HOLDS the GIL" if hashed >= 8 and control <= 3 else "releases the GIL" if hashed <= control + 2
               else "UNCLEAR (noisy machine)")
    return (f"{verdict} while hashing (one call on 256 MiB: {one * 1e3:.1f} ms; this thread stalled through "
            f"{hashed} of 10 such calls, through {control} of 10 as long zlib.crc32 calls that release it)")


# --------------------------------------------------------------------------- carriers


class ThreadCarrier:
    """Runs one save in a thread of this (the training) process."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self._done = threading.Event()
        self._result: dict | None = None
        self._error: BaseException | None = None

    def start(self, spec: dict) -> None:
        self._done.clear()
        self._result = self._error = None

        def body() -> None:
            try:
                if spec.get("idle"):
                    time.sleep(spec["idle_s"])
                    self._result = dict(t_done=time.monotonic(), fold=0, py_s=0.0)
                else:
                    self._result = write_file(self.buf, **spec)
            except BaseException as e:  # noqa: BLE001
                self._error = e
            finally:
                self._done.set()

        threading.Thread(target=body, name="exp-save", daemon=True).start()

    def poll(self) -> dict | None:
        if not self._done.is_set():
            return None
        if self._error is not None:
            raise self._error
        return self._result


class ShardsafeCarrier:
    """Runs one save with shardsafe's own ``Checkpointer.async_save``: the staging copy is its
    own (``blocked`` is until it returns), the rest goes on in its background thread."""

    def __init__(self, state) -> None:
        import shardsafe

        flat = state.view(-1)
        n = flat.numel() // TENSORS // 4 * 4
        self.sd = {f"t{i}": flat[i * n : (i + 1) * n].view(__import__("torch").float32) for i in range(TENSORS)}
        self.ckpt = shardsafe.Checkpointer()
        self.handle = None
        self.t_done = 0.0

    def start(self, spec: dict) -> None:
        def done(_f) -> None:
            self.t_done = time.monotonic()

        self.handle = self.ckpt.async_save(spec["path"] + ".ckpt", self.sd, save_overwrite=True)
        self.t_returned = time.monotonic()
        self.handle.committed.add_done_callback(done)

    def poll(self) -> dict | None:
        if not self.handle.done():
            return None
        self.handle.wait()
        while not self.t_done:  # the callback runs right after the future completes
            time.sleep(0)
        t, self.t_done = self.t_done, 0.0
        return dict(t_done=t, fold=0, py_s=0.0)


def writer_main(conn, shm_name: str, nbytes: int) -> None:
    """The writer process: attach the staging buffer, then run each save it is sent."""
    shm = shared_memory.SharedMemory(name=shm_name)
    buf = shm.buf[:nbytes]
    everywhere = sorted(os.sched_getaffinity(0))
    conn.send("ready")
    try:
        while True:
            spec = conn.recv()
            if spec is None:
                return
            os.sched_setaffinity(0, spec.get("cpus") or everywhere)
            try:
                conn.send(write_file(buf, **{**spec, "cpus": None}))
            except BaseException as e:  # noqa: BLE001
                conn.send(dict(error=repr(e)))
    finally:
        buf.release()
        shm.close()


class ProcCarrier:
    """Runs each save in a writer process started once (spawn) and reused."""

    def __init__(self, shm_name: str, nbytes: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=writer_main, args=(child, shm_name, nbytes), name="exp-writer")
        self.proc.start()
        child.close()
        assert self.conn.recv() == "ready"

    def start(self, spec: dict) -> None:
        self.conn.send(spec)

    def poll(self) -> dict | None:
        if not self.conn.poll():
            return None
        r = self.conn.recv()
        if "error" in r:
            raise RuntimeError(f"writer process: {r['error']}")
        return r

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(30)


# --------------------------------------------------------------------------- affinity


def _core_groups(cpus: list[int]) -> list[list[int]]:
    """The allowed logical CPUs grouped by physical core (hyperthread siblings together)."""
    seen: set[int] = set()
    groups = []
    for c in cpus:
        if c in seen:
            continue
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                sib = _parse_cpulist(f.read())
        except OSError:
            sib = {c}
        g = sorted(sib & set(cpus)) or [c]
        seen.update(g)
        groups.append(g)
    return groups


def _parse_cpulist(s: str) -> set[int]:
    out: set[int] = set()
    for part in s.strip().split(","):
        if "-" in part:
            a, b = part.split("-")
            out.update(range(int(a), int(b) + 1))
        elif part:
            out.add(int(part))
    return out


def core_plan(ranks: int, threads: int) -> tuple[list[tuple[list[int], list[int]]] | None, str]:
    """Per rank (training cores, writer cores), disjoint; whole physical cores where possible."""
    cpus = sorted(os.sched_getaffinity(0))
    groups = _core_groups(cpus)
    for w in (2, 1):
        need = ranks * (threads + w)
        for pool, what in (([g[0] for g in groups], "physical cores"), (cpus, "logical CPUs")):
            if len(pool) >= need:
                plan = [(pool[r * threads : (r + 1) * threads], pool[ranks * threads + r * w : ranks * threads + (r + 1) * w])
                        for r in range(ranks)]
                return plan, f"{what}, {threads} training + {w} writer per rank: {plan}"
    return None, f"skipped: {len(cpus)} CPUs < ranks * (threads + 1) = {ranks * (threads + 1)}"


def pin_process(cpus: list[int]) -> None:
    """Every thread of this process onto ``cpus`` (sched_setaffinity is per thread on Linux)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # a thread that just ended


# --------------------------------------------------------------------------- a rank


class Trainer:
    def __init__(self, width: int, hidden: int, batch: int, opt: str, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.torch = torch
        self.model = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, width))
        params = self.model.parameters()
        self.opt = torch.optim.AdamW(params, lr=1e-4) if opt == "adamw" else torch.optim.SGD(params, lr=1e-4)
        self.width = width
        self.g = g
        self.resize(batch)

    def resize(self, batch: int) -> None:
        self.batch = batch
        self.x = self.torch.randn(batch, self.width, generator=self.g)
        self.y = self.torch.randn(batch, self.width, generator=self.g)

    def step(self) -> float:
        t = time.monotonic()
        loss = self.torch.nn.functional.mse_loss(self.model(self.x), self.y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return time.monotonic() - t

    def calibrate(self, target_s: float) -> None:
        for _ in range(3):
            med = statistics.median(self.step() for _ in range(5))
            batch = max(8, min(16384, round(self.batch * target_s / med)))
            if abs(batch - self.batch) <= self.batch * 0.1:
                break
            self.resize(batch)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Rank:
    """One rank's measurements at one state size: the state, the staging buffer (shared
    memory), the carriers, and the file it writes."""

    def __init__(self, rank: int, cfg: dict, trainer: Trainer, mib: int, shm: shared_memory.SharedMemory) -> None:
        import torch

        self.rank, self.cfg, self.trainer, self.mib = rank, cfg, trainer, mib
        nbytes = mib * MiB
        self.plan = cfg["core_plan"][rank] if cfg["core_plan"] else None
        self.state = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(1000 + rank)).view(torch.uint8)
        self.buf = shm.buf[:nbytes]
        self.staging = torch.frombuffer(self.buf, dtype=torch.uint8)
        self.staging.fill_(0)  # touched once, reused by every save
        self.path = os.path.join(cfg["dir"], f"rank{rank}.bin")
        self.carriers: dict[str, ThreadCarrier | ProcCarrier] = {"thread": ThreadCarrier(self.buf)}
        if any(VARIANTS[v]["carrier"] == "proc" for v in cfg["variants"]):
            self.carriers["proc"] = ProcCarrier(shm.name, nbytes)
        if "shardsafe" in cfg["variants"]:
            self.carriers["shardsafe"] = ShardsafeCarrier(self.state)

    def spec(self, name: str) -> dict:
        v = VARIANTS[name]
        spec = dict(path=self.path, idle=v.get("idle", False), idle_s=self.cfg["idle_s"], unit=v.get("unit", MiB),
                    hash=v.get("hash", False), write=v.get("write", False), behind=v.get("behind", False))
        if v.get("pin") and self.plan:
            spec["cpus"] = self.plan[1]
        return spec

    def save(self, name: str, work: Callable[[], object]) -> dict:
        """Stage, start the carrier, call ``work()`` until the save is durable."""
        v = VARIANTS[name]
        carrier = self.carriers[v["carrier"]]
        old_si = sys.getswitchinterval()
        t0 = time.monotonic()
        if v["carrier"] != "shardsafe":  # shardsafe stages itself, in async_save
            self.staging.copy_(self.state)
        t_start = time.monotonic()
        if v.get("si"):
            sys.setswitchinterval(v["si"])
        carrier.start(self.spec(name))
        if v["carrier"] == "shardsafe":
            t_start = carrier.t_returned
        spans = []
        while True:
            a = time.monotonic()
            work()
            spans.append((a, time.monotonic()))
            r = carrier.poll()
            if r is not None:
                break
        sys.setswitchinterval(old_si)
        return dict(r, blocked=t_start - t0, durable=r["t_done"] - t0, t_start=t_start, spans=spans)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def run(self, barrier) -> list[dict]:
        cfg, trainer, plan = self.cfg, self.trainer, self.plan
        everywhere = sorted(os.sched_getaffinity(0))
        results = []
        for name in ("thread-wb", "proc"):  # warm-up, untimed
            if VARIANTS[name]["carrier"] in self.carriers:
                self.save(name, trainer.step)
                self.unlink()
        runnable = [v for v in cfg["variants"] if not (VARIANTS[v].get("pin") and not plan)]
        for rep in range(cfg["reps"]):
            k = rep % len(runnable)
            for name in runnable[k:] + runnable[:k]:
                self.unlink()
                pin_process(plan[0] if VARIANTS[name].get("pin") and plan else everywhere)
                barrier.wait()
                base = [trainer.step() for _ in range(cfg["base_steps"])]
                r = self.save(name, trainer.step)
                flight = [b - a for a, b in r["spans"] if a < r["t_done"]]
                results.append(dict(rank=self.rank, mib=self.mib, variant=name, rep=rep, base=base, flight=flight,
                                    blocked=r["blocked"], durable=r["durable"], fold=r["fold"], batch=trainer.batch))
        pin_process(everywhere)
        if cfg["gil_probe"]:
            results += self.probe(barrier)
        self.unlink()
        return results

    def probe(self, barrier) -> list[dict]:
        """Per probed variant, one save with no training: how long a GIL-releasing loop in this
        thread waits while it is in flight."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        marks: list[tuple[float, int, float]] = []  # (time, iterations, longest gap) per batch of 100

        def loop(seconds: float = 0.0) -> None:
            t0 = last = time.monotonic()
            while True:
                mx = 0.0
                for _ in range(100):
                    os.write(devnull, b"x")  # releases and retakes the GIL
                    now = time.monotonic()
                    mx = max(mx, now - last)
                    last = now
                marks.append((now, 100, mx))
                if now - t0 >= seconds:
                    return

        out = []
        try:
            for name in [p for p in PROBED if p in self.cfg["variants"]]:
                self.unlink()
                barrier.wait()
                marks.clear()
                loop(0.2)
                l0 = (marks[-1][0] - marks[0][0]) / (100 * (len(marks) - 1))  # one iteration, nothing in flight
                marks.clear()
                r = self.save(name, loop)
                done = [m for m in marks if m[0] <= r["t_done"]]
                el = (done[-1][0] if done else r["t_done"]) - r["t_start"]
                wait = max(0.0, 1 - sum(m[1] for m in done) * l0 / el) if done and el > 0 else float("nan")
                out.append(dict(rank=self.rank, mib=self.mib, variant=name, probe=True, gil_wait=wait,
                                gil_max=max((m[2] for m in done), default=float("nan")), bg_py=r.get("py_s", 0.0),
                                bg_hash=r.get("hash_s", 0.0), bg_total=r.get("total_s", 0.0)))
        finally:
            os.close(devnull)
        return out

    def close(self) -> None:
        if "proc" in self.carriers:
            self.carriers["proc"].close()  # type: ignore[union-attr]
        self.carriers.clear()
        del self.staging
        try:
            self.buf.release()
        except BufferError:
            pass


def rank_main(rank: int, cfg: dict, barrier, out_q) -> None:
    import torch

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(rank)
    w, h, b = cfg["mlp"]
    trainer = Trainer(w, h, b, cfg["opt"], seed=rank)
    barrier.wait()
    if cfg["calibrate"]:
        trainer.calibrate(cfg["step_ms"] / 1e3)
    for _ in range(3):
        trainer.step()
    results: list[dict] = []
    for mib in cfg["mibs"]:
        shm = shared_memory.SharedMemory(create=True, size=mib * MiB)
        try:
            r = Rank(rank, cfg, trainer, mib, shm)
            try:
                results += r.run(barrier)
            finally:
                r.close()
        finally:
            try:
                shm.close()
            except BufferError:
                pass
            shm.unlink()
    out_q.put(results)


# --------------------------------------------------------------------------- the driver


def _fs_type(path: str) -> str:
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mnt, fs, *_ = line.split()
                if path.startswith(mnt) and len(mnt) > len(best):
                    best, kind = mnt, fs
    except OSError:
        pass
    return f"{kind} at {best or '?'}"


def summarize(rows: list[dict], ranks: int, mib: int, variant: str) -> dict | None:
    runs = [r for r in rows if r["mib"] == mib and r["variant"] == variant and not r.get("probe")]
    if not runs:
        return None
    per_rank = []
    for rank in range(ranks):
        mine = [r for r in runs if r["rank"] == rank]
        base = _median([x for r in mine for x in r["base"]])
        flight = [x for r in mine for x in r["flight"]]
        lost = statistics.mean(sum(x - base for x in r["flight"]) for r in mine)
        per_rank.append(dict(base=base, step=_median(flight), steps=len(flight), lost=lost,
                             blocked=_median([r["blocked"] for r in mine]), durable=_median([r["durable"] for r in mine]),
                             batch=mine[0]["batch"]))
    worst = max(per_rank, key=lambda p: p["step"] / p["base"])
    out = dict(ranks=ranks, mib=mib, variant=variant, base_ms=worst["base"] * 1e3, step_ms=worst["step"] * 1e3,
               slowdown_pct=(worst["step"] / worst["base"] - 1) * 100, overlapped_steps=worst["steps"],
               lost_ms=max(p["lost"] for p in per_rank) * 1e3, blocked_ms=max(p["blocked"] for p in per_rank) * 1e3,
               durable_ms=max(p["durable"] for p in per_rank) * 1e3)
    probes = [r for r in rows if r["mib"] == mib and r["variant"] == variant and r.get("probe")]
    if probes:
        out.update(gil_wait_pct=max(p["gil_wait"] for p in probes) * 100, gil_max_ms=max(p["gil_max"] for p in probes) * 1e3,
                   bg_py_ms=max(p["bg_py"] for p in probes) * 1e3, bg_hash_ms=max(p["bg_hash"] for p in probes) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2", help="comma-separated numbers of rank processes")
    ap.add_argument("--mib", default="64,256", help="comma-separated MiB of state (and staging) per rank")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads per rank")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--base-steps", type=int, default=8, help="baseline steps before every save")
    ap.add_argument("--step-ms", type=float, default=30.0, help="batch sized so a step takes about this (unless --mlp)")
    ap.add_argument("--mlp", default=None, help="width,hidden,batch (no calibration); default 512,2048 and a calibrated batch")
    ap.add_argument("--opt", choices=("adamw", "sgd"), default="adamw", help="optimizer (adamw: as bench_async)")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"of {','.join(VARIANTS)}")
    ap.add_argument("--idle-s", type=float, default=0.4, help="how long the idle variant's thread sleeps")
    ap.add_argument("--dir", default=None, help="where files are written (default: a new temp dir)")
    ap.add_argument("--json", default=None, help="write every raw measurement here")
    ap.add_argument("--no-gil-probe", action="store_true")
    ap.add_argument("--quick", action="store_true", help="16 MiB, 2 reps, 4 baseline steps, idle 0.15 s")
    args = ap.parse_args()
    if args.quick:
        args.mib, args.reps, args.base_steps, args.idle_s = "16", 2, 4, 0.15
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}")
    mibs = [int(x) for x in args.mib.split(",")]
    rank_counts = [int(x) for x in args.ranks.split(",")]
    mlp = [int(x) for x in (args.mlp or "512,2048,128").split(",")]
    workdir = args.dir or tempfile.mkdtemp(prefix="exp-bgwriter-")
    os.makedirs(workdir, exist_ok=True)
    import torch

    print(f"# exp_background_writer: python {platform.python_version()}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} allowed), hash {HASH_NAME}, "
          f"sync_file_range {'yes' if _SFR else 'no'}, dir {workdir} ({_fs_type(os.path.realpath(workdir))})")
    print(f"# threads/rank {args.threads}, opt {args.opt}, mlp {mlp[:2]} batch {mlp[2] if args.mlp else f'calibrated to ~{args.step_ms:g} ms'}, "
          f"reps {args.reps}, baseline steps {args.base_steps}, variants {variants}")
    print(f"# the digest function {hash_gil_check()}", flush=True)
    ctx = mp.get_context("spawn")
    summaries: list[dict] = []
    raw: list[dict] = []
    t_all = time.monotonic()
    for ranks in rank_counts:
        plan, plan_note = core_plan(ranks, args.threads)
        print(f"# {ranks} rank(s): pinning {plan_note}", flush=True)
        cfg = dict(threads=args.threads, mlp=mlp, opt=args.opt, calibrate=args.mlp is None, step_ms=args.step_ms,
                   mibs=mibs, dir=workdir, variants=variants, reps=args.reps, base_steps=args.base_steps,
                   idle_s=args.idle_s, core_plan=plan, gil_probe=not args.no_gil_probe)
        barrier = ctx.Barrier(ranks, timeout=600)
        out_q = ctx.Queue()
        procs = [ctx.Process(target=rank_main, args=(r, cfg, barrier, out_q), name=f"exp-rank{r}") for r in range(ranks)]
        t = time.monotonic()
        for p in procs:
            p.start()
        rows: list[dict] = []
        got = 0
        while got < ranks:
            try:
                rows.extend(out_q.get(timeout=5))
                got += 1
            except queue.Empty:
                if any(p.exitcode for p in procs):
                    for p in procs:
                        if p.exitcode is None:
                            p.terminate()
                    sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        batches = sorted({r["batch"] for r in rows if "batch" in r})
        print(f"# {ranks} rank(s) done in {time.monotonic() - t:.0f} s; batch per rank {batches}", flush=True)
        for r in rows:
            r["ranks"] = ranks
        raw.extend(rows)
        for mib in mibs:
            folds = {(r["rank"], r["fold"]) for r in rows if r["mib"] == mib and not r.get("probe") and r["fold"]}
            agree = len(folds) == len({rk for rk, _ in folds})
            print(f"# {ranks} rank(s), {mib} MiB: digests of every hashing variant {'agree' if agree else 'DIFFER: ' + str(folds)}")
            for v in variants:
                s = summarize(rows, ranks, mib, v)
                if s is not None:
                    summaries.append(s)
    print()
    hdr = (f"{'ranks':>5} {'MiB':>4} {'variant':<16} {'base_ms':>7} {'step_ms':>7} {'slow%':>6} {'steps':>5} {'lost_ms':>7} "
           f"{'blocked_ms':>10} {'durable_ms':>10} {'gil%':>5} {'gil_max_ms':>10} {'bg_py_ms':>8} {'<=10%':>5}")
    print(hdr)
    print("-" * len(hdr))
    for s in summaries:
        g = (f"{s['gil_wait_pct']:5.1f} {s['gil_max_ms']:10.2f} {s['bg_py_ms']:8.1f}" if "gil_wait_pct" in s else f"{'':5} {'':10} {'':8}")
        ok = "n/a" if s["overlapped_steps"] == 0 else "yes" if s["slowdown_pct"] <= 10 else "no"
        print(f"{s['ranks']:>5} {s['mib']:>4} {s['variant']:<16} {s['base_ms']:7.1f} {s['step_ms']:7.1f} {s['slowdown_pct']:+6.0f} "
              f"{s['overlapped_steps']:>5} {s['lost_ms']:7.0f} {s['blocked_ms']:10.1f} {s['durable_ms']:10.0f} {g} {ok:>5}")
    print()
    for s in summaries:
        print("BGW " + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items())
              + f" threads={args.threads} hash={HASH_NAME.split()[0]}")
    print(f"# total {time.monotonic() - t_all:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), hash=HASH_NAME, summaries=summaries, raw=raw), f)
    if not args.dir:
        try:
            os.rmdir(workdir)
        except OSError:
            pass


if __name__ == "__main__":
    main()
