"""Load execution: read plans run as ranged reads, straight into target memory where possible.

Every byte a load returns is verified: a read item (a box of one stored chunk) is widened to
the whole checksum blocks of its chunk that it touches, and those blocks are checked before
their bytes are used. An item whose bytes are one contiguous run and whose target is
contiguous CPU memory reads its whole blocks in place (``preadv`` into the tensor), in pieces
of about ``read_block_bytes`` run concurrently on a small thread pool, each piece checked by
the thread that read it (from local storage, in steps of about 1 MiB, each checked while it is
still in the cache); the partial blocks at either end go through a per-thread scratch
buffer. Any other item (strided source boxes, non-contiguous or non-CPU targets) reads its
block span into scratch, bounded by ``read_buffer_bytes / io_threads``, checks it and copies
the box out. :meth:`Reader.load_tensors` keeps reads of later tensors going while earlier
ones finish.

Format v1 stored one CRC32C per chunk: a v1 chunk is one block, so a part of it is verified by
reading the whole chunk when that fits the scratch budget; a part of a larger v1 chunk is read
exactly and cannot be verified (re-save in v2 to cover it).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from math import prod

import torch

from .._gc import paused_gc
from ..adapters import LocalTensor
from ..errors import CorruptCheckpointError
from ..format.checksum import UNCHECKED
from ..format.geometry import row_major_strides
from ..format.metadata import TensorStorageMetadata
from ..knobs import Knobs
from ..planning.read_plan import ReadItem, StoredIndex, plan_reads
from ..storage import Storage
from .buffers import Scratch, byte_view, can_read_into

__all__ = ["Reader"]

_WINDOW = 64  # tasks in flight in load_tensors (in-place reads need no memory; scratch is per thread)
# From local storage an in-place read is checked in steps of about this many bytes, each read and
# then hashed while it is still in the core's L2 cache: a 32 MiB read hashed afterwards fetches
# it from L3 or memory again. One rank alone, page cache to tensor, with XXH3: 0.14 ms per MiB in
# 32 MiB steps, 0.10 in 1 MiB steps (reading alone: 0.07; hashing alone: 0.035).
_HOT_BYTES = 1 << 20
# From local storage a read of at most this many bytes runs on the calling thread: handing it to
# the pool costs more than the read (a queue, a wake-up, the GIL passed back and forth), and a
# load of many small tensors (a quantized optimizer state's scales and tables, steps, biases)
# spent most of its time there.
_INLINE_BYTES = 64 << 10
_DONE: Future = Future()  # a finished future: the end of a target's reads in load_planned's queue, and a task run inline that succeeded
_DONE.set_result(None)


_SHARED: dict[tuple[int, int], tuple[ThreadPoolExecutor | None, Scratch]] = {}
_SHARED_LOCK = threading.Lock()


def _shared(threads: int, budget: int) -> tuple[ThreadPoolExecutor | None, Scratch]:
    """The reader threads and their scratch buffers for ``threads`` threads of ``budget`` scratch
    bytes each, kept for the life of the process: a load starts no threads and touches no fresh
    scratch pages (on a small host, first-touch page faults cost more than the copies; a 64 MiB
    load into strided targets took 26 ms of CPU with threads and scratch of its own, 18 ms
    without, and 31-528 page faults instead of 8).
    The scratch stays resident between loads: at most ``read_buffer_bytes`` per process and
    setting of the knobs. Loads running at once share the threads; a task never waits on
    another, so sharing cannot deadlock. A forked child starts afresh (threads do not survive a
    fork). These idle threads are the one thing of shardsafe that outlives a call (they hold no
    tensor of the caller's, and exit with the interpreter's thread shutdown, before finalization;
    ``tests/test_dist.py`` checks that processes exiting right after a load never abort)."""
    key = (threads, budget)
    with _SHARED_LOCK:
        got = _SHARED.get(key)
        if got is None:
            pool = ThreadPoolExecutor(threads, thread_name_prefix="shardsafe-read") if threads > 1 else None
            got = _SHARED[key] = (pool, Scratch(budget))
        return got


def _forget_shared_after_fork() -> None:
    global _SHARED_LOCK
    _SHARED.clear()
    _SHARED_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_shared_after_fork)


def reader_threads(storage: Storage, knobs: Knobs) -> int:
    """``knobs.io_threads``; but from local storage, where a read is a copy out of the page cache
    or off a local disk (CPU work), no more than this rank's share of the CPUs it may run on: their
    number over the ranks on this machine (``LOCAL_WORLD_SIZE``, which torchrun sets; 1 without
    it). Object stores keep every thread: their reads wait on the network. Four ranks with four
    threads each on two cores spent 15-20% more CPU on a load than with one
    (``benchmarks/bench_megatron.py``)."""
    if storage.local_root is None:
        return knobs.io_threads
    try:
        ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks_here = 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(knobs.io_threads, cpus // ranks_here))


class Reader:
    """Fills targets from one checkpoint location. Use as a context manager."""

    def __init__(self, storage: Storage, knobs: Knobs, *, num_threads: int | None = None) -> None:
        self.storage = storage
        self.threads = reader_threads(storage, knobs) if num_threads is None else num_threads
        self.budget = max(knobs.read_buffer_bytes // max(self.threads, 1), 1 << 20)
        # a store may ask for less over-reading than local disk (object stores: bytes are billed)
        self.gap = knobs.coalesce_gap_bytes if storage.coalesce_gap_bytes is None else min(knobs.coalesce_gap_bytes, storage.coalesce_gap_bytes)
        self.block = max(knobs.read_block_bytes, 1 << 16)
        # object stores: one ranged request per in-place piece; local storage: cache-sized steps
        self.hot = _HOT_BYTES if storage.local_root is not None else None
        self.pool, self.scratch = _shared(self.threads, self.budget)
        self.bytes_read = 0  # bytes fetched from storage, over-reads of blocks and coalesced gaps included
        self._count_lock = threading.Lock()
        # (id(target), piece) -> (target, its piece's bytes and shape, or None): see _box_bytes
        self._pieces: dict[tuple[int, int], tuple[LocalTensor, tuple[memoryview, tuple[int, ...]] | None]] = {}

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.storage.close()  # the threads and their scratch stay for the next load (see _shared)

    def load_tensor(self, meta: TensorStorageMetadata, target: LocalTensor) -> None:
        """Fill every piece of ``target`` from the stored chunks in ``meta``."""
        self.load_tensors([(meta, target)])

    def load_tensors(
        self, pairs: Iterable[tuple[TensorStorageMetadata, LocalTensor]], done: Callable[[LocalTensor], None] | None = None
    ) -> None:
        """Fill every target from its stored chunks; all are complete (or an error raised) on return.
        ``done(target)`` is called, in order, once a target is complete.

        Reads of later targets go on while earlier ones finish; at most about ``_WINDOW`` tasks
        are in flight. On an error, reads already started finish (they write into target
        memory) before it is raised.
        """
        with paused_gc():  # plans and tasks: small acyclic objects, a few dozen per tensor
            pairs = list(pairs)
            hits = [meta.overlapping([(off, lens) for off, lens, _ in target.pieces]) for meta, target in pairs]
            self._read_headers(pairs, hits)
            self.load_planned(((self._plan(meta, target, idx), target) for (meta, target), idx in zip(pairs, hits)), done)

    def _read_headers(self, pairs: list[tuple[TensorStorageMetadata, LocalTensor]], hits: list[list[int] | None]) -> None:
        """Format v3: read the headers of every file the targets need (``hits``: each target's
        overlapping chunks), on the pool, before planning reads tensor by tensor (which would
        read them one at a time)."""
        needed: dict[int, str] = {}  # file index -> a key stored in it
        resolver = None
        for (meta, _), idx in zip(pairs, hits):
            if idx is None:
                continue
            private = meta.__pydantic_private__  # not pydantic's __getattr__: every tensor of a load
            for f in meta.files_of(idx):
                needed.setdefault(f, private["_key"])
            resolver = private["_doc"].resolver
        if resolver is not None:
            resolver.prefetch(needed, self.threads)

    def load_planned(
        self,
        batches: Iterable[tuple[list[ReadItem], LocalTensor]],
        done: Callable[[LocalTensor], None] | None = None,
    ) -> None:
        """Fill each target from read items already planned against it (as :func:`plan_reads`
        makes them); ``done(target)`` is called, in order, once every read of a target has
        completed. All are complete (or an error raised) on return; ``batches`` is consumed
        lazily, at most about ``_WINDOW`` tasks ahead of the reads.
        """
        pending: deque[tuple[str, Future, LocalTensor | None]] = deque()

        def pop() -> None:
            key, f, finished = pending.popleft()
            self._finish(key, f)
            if finished is not None and done is not None:
                done(finished)

        try:
            for items, target in batches:
                itemsize = target.dtype.itemsize
                for item in items:
                    inline = self.hot is not None and prod(item.lengths) * itemsize <= _INLINE_BYTES
                    for part in self._split(item, itemsize, target):
                        for task in self._tasks(part, target):
                            pending.append((target.key, self._run(task) if inline else self._submit(task), None))
                            while len(pending) > _WINDOW:
                                pop()
                if done is not None:
                    pending.append((target.key, _DONE, target))
            while pending:
                pop()
        except BaseException:
            futures = [f for _, f, _ in pending]
            for f in futures:
                f.cancel()
            wait(futures)
            raise
        finally:
            self._pieces.clear()

    def _plan(self, meta: TensorStorageMetadata, target: LocalTensor, indices: list[int] | None = None) -> list[ReadItem]:
        items, covered = plan_reads(StoredIndex(meta, target.pieces, indices=indices), target.pieces)
        for (off, lens, flat), got in zip(target.pieces, covered):
            need = prod(lens) if flat is None else flat[1] - flat[0]
            if got != need:
                raise CorruptCheckpointError(
                    f"key {target.key!r}: the checkpoint covers {got} of the {need} elements of the piece at "
                    f"{list(off)} shape {list(lens)}; its chunks do not tile the tensor"
                )
        return items

    def _submit(self, task: Callable[[], None]) -> Future:
        if self.pool is not None:
            return self.pool.submit(task)
        return self._run(task)

    @staticmethod
    def _run(task: Callable[[], None]) -> Future:
        """``task`` run here, as a finished future (its error raised by ``_finish``, in order)."""
        try:
            task()
        except BaseException as e:  # noqa: BLE001 - raised by _finish, in order
            f: Future = Future()
            f.set_exception(e)
            return f
        return _DONE

    @staticmethod
    def _finish(key: str, f: Future) -> None:
        try:
            f.result()
        except CorruptCheckpointError as e:  # storage and checksum errors know the file, not the key
            raise CorruptCheckpointError(f"key {key!r}: {e}") from None

    def _count(self, n: int) -> None:
        with self._count_lock:
            self.bytes_read += n

    def _split(self, item: ReadItem, itemsize: int, target: LocalTensor) -> list[ReadItem]:
        """Cut an item along dim 0 so no part needs more scratch than the budget.

        Parts are independent: each is widened to whole checksum blocks on its own.
        """
        if not item.lengths or item.lengths[0] < 2:
            return [item]
        sums = item.sums
        if sums.block_bytes >= sums.nbytes and sums.nbytes <= self.budget:
            return [item]  # a one-block chunk that fits: read it whole once and check it
        nbytes = prod(item.lengths) * itemsize
        row = nbytes // item.lengths[0]
        strided = _src_runs(item)[0] > 1
        if strided:  # a strided read fetches whole source rows, gaps included: budget for those
            row = max(row, prod(item.src_shape[1:]) * itemsize)
        room = self.budget - 2 * sums.block_bytes if sums.block_bytes < sums.nbytes else self.budget
        if row * item.lengths[0] <= room:
            return [item]
        dst = _dst_view(item, target)
        if not strided and can_read_into(dst):
            return [item]  # read straight into the target: scratch only for the end blocks
        step = max(1, room // row)
        out = []
        for r in range(0, item.lengths[0], step):
            n = min(step, item.lengths[0] - r)
            out.append(
                ReadItem(
                    item.file, item.src_start, item.src_shape, (item.src_rel[0] + r, *item.src_rel[1:]), item.dst_piece,
                    item.dst_flat, item.dst_shape, (item.dst_rel[0] + r, *item.dst_rel[1:]), (n, *item.lengths[1:]),
                    item.chunk_start, item.sums, item.chunk,
                )
            )
        return out

    def _tasks(self, item: ReadItem, target: LocalTensor) -> list[Callable[[], None]]:
        """The reads that fill ``item``'s box, each checking the blocks it reads."""
        itemsize = target.dtype.itemsize
        n_runs, run_elems, first, _ = _src_runs(item)
        strides = row_major_strides(item.src_shape)
        seg = item.src_start - item.chunk_start  # the source segment's offset in its chunk
        lo = seg + first * itemsize
        if n_runs == 1:
            hi = lo + run_elems * itemsize
        else:
            hi = seg + (sum((o + n - 1) * s for o, n, s in zip(item.src_rel, item.lengths, strides)) + 1) * itemsize
        sums = item.sums
        if hi <= lo:
            return []
        span_lo, span_hi = sums.aligned_span(lo, hi)
        dst: torch.Tensor | None = None
        into = self._box_bytes(item, target, hi - lo) if n_runs == 1 else None
        if into is None:
            dst = _dst_view(item, target)
            if n_runs == 1 and can_read_into(dst):  # a contiguous box of a piece view _box_bytes does not see through
                into = byte_view(dst)
        if into is not None:
            a, b = sums.aligned_inside(lo, hi)
            if a < b:
                out = self._in_place(item, into, lo, a, b)
                if lo < a:
                    out.append(lambda: self._via_scratch(item, None, span_lo, a, lo, a, into=into[: a - lo]))
                if b < hi:
                    out.append(lambda: self._via_scratch(item, None, b, span_hi, b, hi, into=into[b - lo :]))
                return out
        if (span_hi - span_lo > self.budget and sums.block_bytes >= sums.nbytes and sums.algorithm == "crc32c") or (
            n_runs > 1 and sums.algorithm == UNCHECKED
        ):  # a part of a large v1 chunk, or runs that carry no digests (gaps under the knob coalesced)
            box = dst if dst is not None else _dst_view(item, target)
            return [lambda: self._run_unverified(item, itemsize, box)]
        if into is not None:
            return [lambda: self._via_scratch(item, None, span_lo, span_hi, lo, hi, into=into)]
        return [lambda: self._via_scratch(item, dst, span_lo, span_hi, lo, hi)]

    def _box_bytes(self, item: ReadItem, target: LocalTensor, nbytes: int) -> memoryview | None:
        """The ``nbytes`` bytes of target memory that receive ``item``'s box, if they are one
        contiguous run of a CPU piece; else None. Computed from the piece's byte view (made once
        per piece and load) with no torch call: a torch call on this thread gives up the GIL
        and waits for it behind the reading threads, once per task."""
        entry = self._pieces.get((id(target), item.dst_piece))
        if entry is None:  # the entry holds the target: an id() key is never reused while cached
            view = target.views[item.dst_piece]
            entry = self._pieces[(id(target), item.dst_piece)] = (
                target, (byte_view(view), tuple(view.shape)) if can_read_into(view) and view.numel() else None
            )
        if entry[1] is None:
            return None
        mv, piece_shape = entry[1]
        flat = target.pieces[item.dst_piece][2] is not None
        shape = item.dst_shape if flat else piece_shape
        start = item.dst_flat if flat else 0
        partial = False  # the box is one run when, after its leading 1s, only its first dim is partial
        for o, n, size in zip(item.dst_rel, item.lengths, shape):
            if partial and (o != 0 or n != size):
                return None
            if n != 1:
                partial = True
        stride = 1
        for o, size in zip(reversed(item.dst_rel), reversed(shape)):
            start += o * stride
            stride *= size
        begin = start * target.dtype.itemsize
        return mv[begin : begin + nbytes]

    def _in_place(self, item: ReadItem, dst: memoryview, lo: int, a: int, b: int) -> list[Callable[[], None]]:
        """Tasks reading whole blocks ``[a, b)`` of the chunk into ``dst`` (which starts at ``lo``)."""
        bb = item.sums.block_bytes
        piece = max(bb, self.block - self.block % bb)
        out = []
        for pos in range(a, b, piece):
            end = min(b, pos + piece)
            out.append(lambda pos=pos, view=dst[pos - lo : end - lo]: self._read_checked(item, pos, view))
        return out

    def _read_checked(self, item: ReadItem, pos: int, view: memoryview) -> None:
        """Read whole blocks from chunk offset ``pos`` into ``view`` and check them."""
        for _ in self._steps(item, pos, view):
            pass

    def _steps(self, item: ReadItem, pos: int, view: memoryview) -> Iterator[int]:
        """Read whole blocks from chunk offset ``pos`` into ``view``, checking them as they come:
        from local storage in steps of whole blocks near ``_HOT_BYTES``, each checked right after
        its read (while it is in the cache); from an object store in one request. Yields, after
        each step, the chunk offset up to which ``view`` holds checked bytes."""
        bb = item.sums.block_bytes
        step = view.nbytes if self.hot is None or bb > self.hot else self.hot - self.hot % bb
        start = item.chunk_start + pos
        for at in range(0, view.nbytes, step):
            part = view[at : at + step]
            self.storage.read_into(item.file, start + at, [part])
            item.sums.check(pos + at, part)
            yield pos + at + part.nbytes
        self._count(view.nbytes)

    def _via_scratch(
        self, item: ReadItem, dst: torch.Tensor | None, span_lo: int, span_hi: int, lo: int, hi: int, *, into: memoryview | None = None
    ) -> None:
        """Read blocks ``[span_lo, span_hi)`` of the chunk into scratch, check them, and copy out
        bytes ``[lo, hi)``: to ``into`` (target bytes), or (``into`` None) to ``dst`` as the
        item's box, which starts at ``lo``. Into CPU memory the box goes out row by row (along its
        first dimension) as soon as a step has checked a row's bytes: a second pass over a large
        scratch span would fetch it from memory again."""
        raw = self.scratch.get(span_hi - span_lo)
        buf = byte_view(raw)
        if into is not None:
            self._read_checked(item, span_lo, buf)
            into[:] = buf[lo - span_lo : hi - span_lo]
            return
        assert dst is not None
        strides = row_major_strides(item.src_shape)
        src = raw[lo - span_lo :].view(dst.dtype).as_strided(item.lengths, strides)
        if not item.lengths or dst.device.type != "cpu":  # one copy: a device copy per step costs more than it saves
            self._read_checked(item, span_lo, buf)
            with torch.no_grad():
                dst.copy_(src)
            return
        itemsize = dst.dtype.itemsize
        tail = sum((n - 1) * st for n, st in zip(item.lengths[1:], strides[1:])) + 1  # a row's elements, first to last
        rows, done = item.lengths[0], 0
        with torch.no_grad():
            for got in self._steps(item, span_lo, buf):
                ready = max(0, min(rows, ((got - lo) // itemsize - tail) // strides[0] + 1))  # rows wholly checked
                if ready > done:
                    dst[done:ready].copy_(src[done:ready])
                    done = ready
        if done != rows:  # the span covers the box: unreachable unless the planning above is wrong
            raise AssertionError(f"{item.chunk}: copied {done} of the box's {rows} rows")

    def _run_unverified(self, item: ReadItem, itemsize: int, dst: torch.Tensor) -> None:
        """Copy a part of a format-v1 chunk too large to read whole, or strided runs of bytes that
        carry no digests (a Hugging Face file): exact reads, gaps over ``coalesce_gap_bytes``
        skipped, no checksum."""
        n_runs, run_elems, first, kp = _src_runs(item)
        if n_runs == 1:
            nbytes = run_elems * itemsize
            offset = item.src_start + first * itemsize
            if can_read_into(dst):
                self.storage.read_into(item.file, offset, [byte_view(dst)])
            else:
                raw = self.scratch.get(nbytes)
                self.storage.read_into(item.file, offset, [byte_view(raw)])
                with torch.no_grad():
                    dst.copy_(raw.view(dst.dtype).view(item.lengths))
            self._count(nbytes)
            return
        strides = row_major_strides(item.src_shape)
        last = sum((o + n - 1) * s for o, n, s in zip(item.src_rel, item.lengths, strides)) + 1
        span = (last - first) * itemsize
        needed = prod(item.lengths) * itemsize
        gap = (strides[kp - 1] - run_elems) * itemsize  # between runs that differ in dim kp - 1
        if gap <= self.gap or span <= needed + self.gap:
            raw = self.scratch.get(span)
            self.storage.read_into(item.file, item.src_start + first * itemsize, [byte_view(raw)])
            src = raw.view(dst.dtype).as_strided(item.lengths, strides)
            self._count(span)
        else:
            raw = self.scratch.get(needed)
            run_bytes = run_elems * itemsize
            mv = byte_view(raw)
            outer = item.lengths[:kp]
            spans = [
                (item.src_start + (first + sum(j * s for j, s in zip(idx, strides))) * itemsize, mv[i * run_bytes : (i + 1) * run_bytes])
                for i, idx in enumerate(_ndindex(outer))
            ]
            self.storage.read_spans_into(item.file, spans)  # object stores: all runs in flight at once
            src = raw.view(dst.dtype).view(item.lengths)
            self._count(needed)
        with torch.no_grad():
            dst.copy_(src)


def _contiguous_tail(item: ReadItem) -> int:
    """How many trailing dims the copied box spans in full in its source segment."""
    n = 0
    for o, ln, s in zip(reversed(item.src_rel), reversed(item.lengths), reversed(item.src_shape)):
        if o != 0 or ln != s:
            break
        n += 1
    return n


def _src_runs(item: ReadItem) -> tuple[int, int, int, int]:
    """Where the copied box lies in its source segment, as contiguous runs of elements.

    Returns (number of runs, elements per run, flat index of the first element, kp) where
    ``kp`` is the last dim the box covers only partly: dims after it are whole, so each index
    of dims ``[0, kp)`` is one run. Leading dims of length 1 do not split runs.
    """
    ndim = len(item.lengths)
    if ndim == 0:
        return 1, 1, 0, 0
    tail = _contiguous_tail(item)
    kp = ndim - tail - 1 if tail < ndim else 0
    strides = row_major_strides(item.src_shape)
    first = sum(o * s for o, s in zip(item.src_rel, strides))
    return prod(item.lengths[:kp]), item.lengths[kp] * strides[kp], first, kp


def _dst_view(item: ReadItem, target: LocalTensor) -> torch.Tensor:
    """The view of ``target`` that receives ``item``: a box of one target segment."""
    piece_view, flat = target.views[item.dst_piece], target.pieces[item.dst_piece][2] is not None
    seg = piece_view[item.dst_flat : item.dst_flat + prod(item.dst_shape)].view(item.dst_shape) if flat else piece_view
    return seg[tuple(slice(o, o + n) for o, n in zip(item.dst_rel, item.lengths))]


def _ndindex(shape: tuple[int, ...]):
    if not shape:
        yield ()
        return
    idx = [0] * len(shape)
    for _ in range(prod(shape)):
        yield tuple(idx)
        for d in range(len(idx) - 1, -1, -1):
            idx[d] += 1
            if idx[d] < shape[d]:
                break
            idx[d] = 0
