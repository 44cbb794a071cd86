"""Staging: copy the bytes a rank will write into reused host memory, so a save can go on in the
background while training changes its tensors.

A :class:`StagingRing` is one host buffer, allocated once and reused from save to save (first
touch of fresh pages costs far more than the copy). :func:`stage` copies this rank's write items
into it as *units* (up to ``write_block_bytes`` of one item, or a whole item that is not
contiguous) and hands each to the consumer, the background writer, which releases it once
written. When everything fits, staging never waits; when it does not (the budget knob
``async_staging_bytes``), the ring is reused as the writer frees it, so the save stages in parts
and the caller is blocked until the last part is copied.

On CUDA the ring is pinned, and copies run non-blocking on a side stream; each unit carries an
event the writer waits on before reading it, and :func:`stage` returns only once every copy has
finished (the caller may then change the tensors).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..errors import CheckpointError
from .buffers import resolve_lazy

__all__ = ["RINGS", "RingAborted", "aligned", "StagingRing", "Unit", "UnitQueue", "live_units", "stage", "stage_pieces"]

_ALIGN = 64  # every unit starts on a 64-byte boundary: any dtype may view it


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the staging alignment: the room a piece takes in a buffer."""
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(slots=True)
class Unit:
    """Bytes of write item ``index``, in order (a memoryview, or a 1-D uint8 host tensor); valid
    until ``release()`` is called."""

    index: int
    data: Any
    release: Callable[[], None] | None = None
    ready: Any = None  # a CUDA event to wait on before reading ``data``, or None


class RingAborted(Exception):
    """Raised in the producer when the consumer gave up (its own error is reported instead)."""


class StagingRing:
    """A circular host buffer: :meth:`alloc` regions in order, :meth:`free` them in the same order."""

    def __init__(self, capacity: int, *, pinned: bool) -> None:
        self.capacity = capacity
        self.pinned = pinned
        self.buf = torch.empty(capacity, dtype=torch.uint8, pin_memory=pinned)
        self._cond = threading.Condition()
        self._live: deque[tuple[int, int]] = deque()  # (start, end) allocated, oldest first
        self._aborted = False
        self.waited = 0  # times alloc had to wait for space (the save staged in parts)
        self.on_wait: Callable[[], None] | None = None  # called before alloc waits (the consumer must run)
        self.layout: _Layout | None = None  # what stage_pieces laid out last, for the next save of the same tensors

    def reset(self) -> None:
        with self._cond:
            self._live.clear()
            self._aborted = False
            self.waited = 0
            self.on_wait = None

    def _place(self, n: int) -> int | None:
        """Where ``n`` bytes fit now, or None. Live regions are one arc of the circle, oldest first."""
        if not self._live:
            return 0
        oldest, head = self._live[0][0], self._live[-1][1]
        if head > oldest:  # not wrapped: free space is [head, cap) and [0, oldest)
            if head + n <= self.capacity:
                return head
            return 0 if n <= oldest else None
        return head if head + n <= oldest else None  # wrapped: free space is [head, oldest)

    def alloc(self, nbytes: int, *, wait: bool = True) -> int:
        """The offset of ``nbytes`` free bytes (aligned); waits until the consumer frees enough
        (or, with ``wait=False``, raises ``ValueError`` when they are not free now)."""
        n = aligned(max(nbytes, 1))
        if n > self.capacity:
            raise ValueError(f"a staging unit of {nbytes} bytes does not fit the {self.capacity}-byte staging buffer")
        with self._cond:
            while True:
                if self._aborted:
                    raise RingAborted
                start = self._place(n)
                if start is not None:
                    self._live.append((start, start + n))
                    return start
                if not wait:
                    raise ValueError(f"a staging unit of {nbytes} bytes does not fit what is left of the {self.capacity}-byte staging buffer")
                self.waited += 1
                if self.on_wait is not None:
                    self.on_wait()
                self._cond.wait()

    def free(self) -> None:
        """Free the oldest allocated region."""
        with self._cond:
            self._live.popleft()
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


def item_data(item: Any, local: dict[str, Any]) -> torch.Tensor:
    """The tensor whose bytes are write item ``item``: a view of the caller's memory (any device,
    maybe not contiguous)."""
    lt = local[item.key]
    view = lt.views[item.piece_index]
    piece_off, piece_lens, _ = lt.pieces[item.piece_index]
    if item.flat is None and (item.offsets, item.lengths) != (piece_off, piece_lens):  # part of a split replica
        start = item.offsets[0] - piece_off[0]
        view = view[start : start + item.lengths[0]]
    return resolve_lazy(view)  # describe_state's views are detached already


def check_size(item: Any, data: torch.Tensor) -> None:
    nbytes = data.numel() * data.element_size()
    expected = item.byte_range[1] - item.byte_range[0]
    if nbytes != expected:
        raise CheckpointError(f"key {item.key!r}: chunk {item.name!r} has {nbytes} bytes, the plan expected {expected}")


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 tensor (no copy)."""
    # as_strided: torch calls a tensor with size-1 dims contiguous whatever their strides
    return t.as_strided((t.numel(),), (1,), t.storage_offset()).view(torch.uint8)


def live_units(items: tuple[Any, ...], local: dict[str, Any], block: int) -> Iterator[Unit]:
    """A synchronous save's units: views of the caller's tensors (host copies of device ones),
    read while the caller waits."""
    for j, item in enumerate(items):
        data = item_data(item, local)
        check_size(item, data)
        if data.device.type != "cpu":
            data = data.to("cpu")
        if not data.numel():
            yield Unit(j, memoryview(b""))
            continue
        flat = _flat_bytes(data.contiguous())
        for pos in range(0, flat.numel(), block):
            yield Unit(j, memoryview(flat[pos : pos + block].numpy()))  # the view keeps the memory alive


@torch.no_grad()
def stage(items: tuple[Any, ...], local: dict[str, Any], ring: StagingRing, block: int, put: Callable[[Unit], None]) -> None:
    """Copy every item's bytes into ``ring`` and ``put`` each unit (for the consumer); returns once
    every copy is complete, so the caller may change its tensors."""
    stream = None
    for j, item in enumerate(items):
        data = item_data(item, local)
        check_size(item, data)
        nbytes = data.numel() * data.element_size()
        if data.device.type == "cuda" and stream is None:
            stream = _side_stream(data.device)
        if nbytes == 0:
            put(Unit(j, memoryview(b"")))
            continue
        if not data.is_contiguous() and nbytes <= ring.capacity:  # one strided copy into the ring
            _copy_unit(ring, j, data, nbytes, stream, put)
            continue
        flat = _flat_bytes(data if data.is_contiguous() else data.contiguous())
        if nbytes <= block:
            _copy_unit(ring, j, flat, nbytes, stream, put)
            continue
        for pos in range(0, nbytes, block):
            part = flat[pos : pos + block]
            _copy_unit(ring, j, part, part.numel(), stream, put)
    if stream is not None:
        stream.synchronize()


def _side_stream(device: torch.device) -> Any:
    """A CUDA stream for staging copies that starts where the caller's stream is (so the copies
    see the state as the caller's queued work leaves it)."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def _copy_unit(ring: StagingRing, j: int, src: torch.Tensor, nbytes: int, stream: Any, put: Callable[[Unit], None]) -> None:
    """Copy ``src`` (``nbytes`` bytes: a byte range, or a whole strided item) into the ring."""
    start = ring.alloc(nbytes)
    dst = ring.buf[start : start + nbytes]
    target = dst if src.dtype == torch.uint8 and src.dim() == 1 else dst.view(src.dtype).view(src.shape)
    ready = None
    if stream is not None:
        with torch.cuda.stream(stream):
            target.copy_(src, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
    else:
        target.copy_(src)
    put(Unit(j, dst, ring.free, ready))  # the writer takes the memoryview: less Python in the caller's thread


class _Layout(NamedTuple):
    """Where :func:`stage_pieces` put each piece of a list of tensors in a ring."""

    tensors: list[weakref.ref[Any]]  # the LocalTensors laid out, weakly: a ring kept for later holds no model
    out: list[Any]  # the descriptions with views on the ring
    dsts: list[torch.Tensor]  # host copy targets, in order
    cuda: list[torch.Tensor]  # device copy targets, in order


@torch.no_grad()
def stage_pieces(tensors: list[Any], ring: StagingRing) -> list[Any]:
    """Copy every piece of every tensor (``LocalTensor``s) into ``ring``, which must hold them all
    (it is this save's alone: laid out back to back, no waiting); returns the same descriptions
    with views on the copies (contiguous, in host memory). Host copies go through one
    ``_foreach_copy_`` (one dispatch, not one per piece).

    When ``tensors`` are the very ``LocalTensor`` objects this ring staged last time (a
    :class:`~shardsafe.adapters.describe.DescribeCache` returns them for unchanged tensors), the
    layout is reused: no view is built again, and the descriptions returned are the same objects.
    """
    layout = ring.layout
    if layout is not None and len(layout.tensors) == len(tensors) and all(r() is t for r, t in zip(layout.tensors, tensors)):
        _copy_pieces(layout, tensors)
        return layout.out
    layout = _lay_out(tensors, ring)
    ring.layout = layout
    _copy_pieces(layout, tensors)
    return layout.out


def _copy_pieces(layout: _Layout, tensors: list[Any]) -> None:
    srcs = [v for t in tensors for v in t.views if v.numel() and v.device.type != "cuda"]
    if srcs:
        torch._foreach_copy_(layout.dsts, srcs)
    if layout.cuda:
        sources = [v for t in tensors for v in t.views if v.numel() and v.device.type == "cuda"]
        stream = _side_stream(sources[0].device)
        with torch.cuda.stream(stream):
            for dst, v in zip(layout.cuda, sources):
                dst.copy_(v, non_blocking=True)
        stream.synchronize()


def _lay_out(tensors: list[Any], ring: StagingRing) -> _Layout:
    """Each piece's place in ``ring``, back to back from its start."""
    buf = ring.buf
    typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer as each dtype (its size is a multiple of 64)
    pos = 0
    out: list[Any] = []
    dsts: list[torch.Tensor] = []
    cuda: list[torch.Tensor] = []
    for t in tensors:
        views = []
        for v in t.views:
            numel = v.numel()
            if numel == 0:
                views.append(torch.empty(v.shape, dtype=v.dtype))
                continue
            size = v.element_size()
            nbytes = numel * size
            if pos + nbytes > ring.capacity:
                raise ValueError(f"{nbytes} bytes do not fit what is left of the {ring.capacity}-byte staging buffer")
            whole = typed.get(v.dtype)
            if whole is None:
                whole = typed[v.dtype] = buf.view(v.dtype)
            start = pos // size  # pos is a multiple of 64: of every element size
            dst = whole[start : start + numel].view(v.shape)
            pos += aligned(nbytes)
            (cuda if v.device.type == "cuda" else dsts).append(dst)
            views.append(dst)
        out.append(type(t)(t.key, t.dtype, t.dtype_name, t.shape, t.pieces, views))
    return _Layout([weakref.ref(t) for t in tensors], out, dsts, cuda)


class UnitQueue:
    """The units of one save, from the stager (caller's thread) to the writer (background).

    Iterating waits until :meth:`start` (called when staging ends, or when the buffer is full
    and the stager needs the writer to free room): while the caller is blocked in staging, the
    writer does not compete with it for the CPU and memory bandwidth. Iteration ends at
    :meth:`close`; a close with an error raises it in the writer.
    """

    _END = object()

    def __init__(self) -> None:
        self._queue: deque[Any] = deque()
        self._cond = threading.Condition()
        self._started = False
        self._error: BaseException | None = None

    def put(self, unit: Unit) -> None:
        with self._cond:
            self._queue.append(unit)
            if self._started:
                self._cond.notify()

    def start(self) -> None:
        with self._cond:
            self._started = True
            self._cond.notify_all()

    def close(self, error: BaseException | None) -> None:
        with self._cond:
            self._error = error
            self._queue.append(self._END)
            self._started = True
            self._cond.notify_all()

    def __iter__(self) -> Iterator[Unit]:
        while True:
            with self._cond:
                while not (self._started and self._queue):
                    self._cond.wait()
                unit = self._queue.popleft()
            if unit is self._END:
                if self._error is not None:
                    raise CheckpointError(
                        f"staging this rank's state failed ({type(self._error).__name__}: {self._error}), so the save "
                        "was abandoned"
                    ) from self._error
                return
            yield unit


class _RingPool:
    """Staging buffers kept between saves: one per save in flight, reused when large enough."""

    def __init__(self) -> None:
        self._free: list[StagingRing] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int, *, pinned: bool) -> StagingRing:
        nbytes = max(nbytes, _ALIGN)
        with self._lock:
            fits = [r for r in self._free if r.pinned == pinned and r.capacity >= nbytes]
            ring = min(fits, key=lambda r: r.capacity) if fits else None
            if ring is not None:
                self._free.remove(ring)
            elif self._free and any(r.pinned == pinned for r in self._free):
                self._free.remove(next(r for r in self._free if r.pinned == pinned))  # too small: dropped first
        if ring is None:
            ring = StagingRing(aligned(nbytes), pinned=pinned)
        ring.reset()
        return ring

    def release(self, ring: StagingRing) -> None:
        with self._lock:
            if ring not in self._free:
                self._free.append(ring)

    def clear(self) -> None:
        """Drop every buffer kept (the next save allocates afresh)."""
        with self._lock:
            self._free.clear()


RINGS = _RingPool()
