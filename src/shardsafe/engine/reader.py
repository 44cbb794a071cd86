"""Load execution: read plans run as ranged reads, straight into target memory where possible.

Read items run on a small thread pool. An item whose source bytes are contiguous and whose
target is contiguous CPU memory is read in place (``preadv`` into the tensor); when it is
larger than ``read_block_bytes`` its blocks are read concurrently while the calling thread
chains the checksum over the blocks already read. Otherwise the bytes go through a per-thread
scratch buffer, bounded by ``read_buffer_bytes / io_threads``, and are copied into the target
view. Strided source boxes are read as one span when the gaps are small
(``coalesce_gap_bytes``), else run by run. :meth:`Reader.load_tensors` keeps reads of later
tensors going while earlier ones are checked.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from math import prod

import torch

from ..adapters import LocalTensor
from ..errors import CorruptCheckpointError
from ..format.checksum import crc32c
from ..format.metadata import TensorStorageMetadata
from ..knobs import Knobs
from ..planning.geometry import row_major_strides
from ..planning.read_plan import ReadItem, StoredIndex, plan_reads
from ..storage import Storage
from .buffers import Scratch, byte_view, can_read_into

__all__ = ["Reader"]

_WINDOW = 64  # jobs in flight in load_tensors (in-place reads need no memory; scratch is per thread)


@dataclass(slots=True)
class _Pending:
    target: LocalTensor
    parts: list[ReadItem]
    views: list[memoryview]  # in-place blocks, checksummed by _finish; empty for a whole job
    futures: list[Future] = field(default_factory=list)


class Reader:
    """Fills targets from one checkpoint location. Use as a context manager."""

    def __init__(self, storage: Storage, knobs: Knobs, *, num_threads: int | None = None) -> None:
        self.storage = storage
        self.threads = knobs.io_threads if num_threads is None else num_threads
        self.budget = max(knobs.read_buffer_bytes // max(self.threads, 1), 1 << 20)
        # a store may ask for less over-reading than local disk (object stores: bytes are billed)
        self.gap = min(knobs.coalesce_gap_bytes, getattr(storage, "coalesce_gap_bytes", knobs.coalesce_gap_bytes))
        self.block = max(knobs.read_block_bytes, 1 << 16)
        self.scratch = Scratch(self.budget)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shardsafe-read") if self.threads > 1 else None
        self.bytes_read = 0  # bytes fetched from storage, over-reads of coalesced gaps included
        self._count_lock = threading.Lock()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        self.scratch.clear()
        self.storage.close()

    def load_tensor(self, meta: TensorStorageMetadata, target: LocalTensor) -> None:
        """Fill every piece of ``target`` from the stored chunks in ``meta``."""
        self.load_tensors([(meta, target)])

    def load_tensors(self, pairs: Iterable[tuple[TensorStorageMetadata, LocalTensor]]) -> None:
        """Fill every target from its stored chunks; all are complete (or an error raised) on return.

        Reads of later targets go on while the checksums of earlier ones are computed; at most
        about ``_WINDOW`` jobs are in flight. On an error, reads already started finish (they
        write into target memory) before it is raised.
        """
        pending: deque[_Pending] = deque()
        try:
            for meta, target in pairs:
                for job in self._plan(meta, target):
                    pending.append(self._start(job, target))
                    while len(pending) > _WINDOW:
                        self._finish(pending.popleft())
            while pending:
                self._finish(pending.popleft())
        except BaseException:
            futures = [f for p in pending for f in p.futures]
            for f in futures:
                f.cancel()
            wait(futures)
            raise

    def _plan(self, meta: TensorStorageMetadata, target: LocalTensor) -> list[list[ReadItem]]:
        items, covered = plan_reads(StoredIndex(meta), target.pieces)
        for (off, lens, flat), got in zip(target.pieces, covered):
            need = prod(lens) if flat is None else flat[1] - flat[0]
            if got != need:
                raise CorruptCheckpointError(
                    f"key {target.key!r}: the checkpoint covers {got} of the {need} elements of the piece at "
                    f"{list(off)} shape {list(lens)}; its chunks do not tile the tensor"
                )
        itemsize = target.dtype.itemsize
        return [self._split(item, itemsize, target) for item in items]

    def _start(self, parts: list[ReadItem], target: LocalTensor) -> _Pending:
        """Start one job: in-place blocks on the pool (checksum later, here), else the whole job."""
        itemsize = target.dtype.itemsize
        if self.pool is None:
            return _Pending(target, parts, [], self._done(self._run_job, parts, itemsize, target))
        if len(parts) == 1:
            item = parts[0]
            dst = _dst_view(item, target.views[item.dst_piece], target.pieces[item.dst_piece][2] is not None)
            n_runs, run_elems, first, _ = _src_runs(item)
            nbytes = run_elems * itemsize
            if n_runs == 1 and nbytes > self.block and can_read_into(dst):
                buf = byte_view(dst)
                offset = item.src_start + first * itemsize
                views = [buf[pos : pos + self.block] for pos in range(0, nbytes, self.block)]
                futures = [
                    self.pool.submit(self.storage.read_into, item.file, offset + i * self.block, [v])
                    for i, v in enumerate(views)
                ]
                return _Pending(target, parts, views, futures)
        return _Pending(target, parts, [], [self.pool.submit(self._run_job, parts, itemsize, target)])

    @staticmethod
    def _done(fn, *args) -> list[Future]:
        f: Future = Future()
        try:
            f.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - raised by _finish, in order
            f.set_exception(e)
        return [f]

    def _finish(self, p: _Pending) -> None:
        """Wait for one job; for in-place blocks, chain and check the checksum here."""
        try:
            if not p.views:
                p.futures[0].result()
                return
            item = p.parts[0]
            crc = 0
            for view, f in zip(p.views, p.futures):
                f.result()
                if item.crc32c is not None:
                    crc = crc32c(view, crc)
            self._count(sum(v.nbytes for v in p.views))
            if item.crc32c is not None and crc != item.crc32c:
                raise CorruptCheckpointError(
                    f"checksum mismatch in chunk {item.chunk}: stored crc32c {item.crc32c:#010x}, read {crc:#010x}; the file is damaged"
                )
        except CorruptCheckpointError as e:  # storage and checksum errors know the file, not the key
            wait(p.futures)
            raise CorruptCheckpointError(f"key {p.target.key!r}: {e}") from None
        except BaseException:
            wait(p.futures)  # blocks still being read write into the target: let them end first
            raise

    def _count(self, n: int) -> None:
        with self._count_lock:
            self.bytes_read += n

    def _split(self, item: ReadItem, itemsize: int, target: LocalTensor) -> list[ReadItem]:
        """Cut an item along dim 0 so no part needs more scratch than the budget.

        The parts of one item form one job and run in order; when the item reads a whole chunk,
        their bytes are consecutive in the file and the chunk's checksum is chained over them.
        """
        if not item.lengths or item.lengths[0] < 2:
            return [item]
        nbytes = prod(item.lengths) * itemsize
        row = nbytes // item.lengths[0]
        strided = _src_runs(item)[0] > 1
        if strided:  # a coalesced read fetches whole source rows, gaps included: budget for those
            row = max(row, prod(item.src_shape[1:]) * itemsize)
        if row * item.lengths[0] <= self.budget:
            return [item]
        dst = _dst_view(item, target.views[item.dst_piece], target.pieces[item.dst_piece][2] is not None)
        if not strided and can_read_into(dst):
            return [item]  # read straight into the target: no scratch
        step = max(1, self.budget // row)
        out = []
        for r in range(0, item.lengths[0], step):
            n = min(step, item.lengths[0] - r)
            out.append(
                ReadItem(
                    item.file, item.src_start, item.src_shape, (item.src_rel[0] + r, *item.src_rel[1:]), item.dst_piece,
                    item.dst_flat, item.dst_shape, (item.dst_rel[0] + r, *item.dst_rel[1:]), (n, *item.lengths[1:]),
                    item.crc32c, item.chunk,
                )
            )
        return out

    def _run_job(self, parts: list[ReadItem], itemsize: int, target: LocalTensor) -> None:
        expected = parts[0].crc32c
        crc = 0
        for part in parts:
            crc = self._run(part, itemsize, target, crc)
        if expected is not None and crc != expected:
            raise CorruptCheckpointError(
                f"checksum mismatch in chunk {parts[0].chunk}: stored crc32c {expected:#010x}, read {crc:#010x}; the file is damaged"
            )

    def _run(self, item: ReadItem, itemsize: int, target: LocalTensor, crc: int) -> int:
        """Copy one item into its target; returns ``crc`` extended over the bytes read when the
        item belongs to a whole-chunk read (``item.crc32c`` set), else ``crc`` unchanged."""
        dst = _dst_view(item, target.views[item.dst_piece], target.pieces[item.dst_piece][2] is not None)
        n_runs, run_elems, first, kp = _src_runs(item)
        if n_runs == 1:
            nbytes = run_elems * itemsize
            offset = item.src_start + first * itemsize
            if can_read_into(dst):
                buf = byte_view(dst) if nbytes else memoryview(b"")
                self.storage.read_into(item.file, offset, [buf])
            else:
                raw = self.scratch.get(nbytes)
                buf = byte_view(raw)
                self.storage.read_into(item.file, offset, [buf])
                with torch.no_grad():
                    dst.copy_(raw.view(target.dtype).view(item.lengths))
            self._count(nbytes)
            return crc32c(buf, crc) if item.crc32c is not None else crc
        strides = row_major_strides(item.src_shape)
        last = sum((o + n - 1) * s for o, n, s in zip(item.src_rel, item.lengths, strides)) + 1
        span = (last - first) * itemsize
        needed = prod(item.lengths) * itemsize
        gap = (strides[kp - 1] - run_elems) * itemsize  # between runs that differ in dim kp - 1
        if gap <= self.gap or span <= needed + self.gap:
            raw = self.scratch.get(span)
            self.storage.read_into(item.file, item.src_start + first * itemsize, [byte_view(raw)])
            src = raw.view(target.dtype).as_strided(item.lengths, strides)
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
            read_spans = getattr(self.storage, "read_spans_into", None)  # object stores: all runs in flight at once
            if read_spans is not None:
                read_spans(item.file, spans)
            else:
                for offset, buf in spans:
                    self.storage.read_into(item.file, offset, [buf])
            src = raw.view(target.dtype).view(item.lengths)
            self._count(needed)
        with torch.no_grad():
            dst.copy_(src)
        return crc


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


def _dst_view(item: ReadItem, piece_view: torch.Tensor, flat: bool) -> torch.Tensor:
    """The view of the target that receives ``item``: a box of one target segment."""
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
