"""The only module that calls ``torch.distributed``.

A :class:`Comm` is the ranks of one process group taking part in one public call (a save, a
load, an unshard), or a single process (``no_dist=True``, a group of one, or no process group
at all). Call order, on every rank of the group: :func:`get_comm` with the call's name (the
arrival check), then the same sequence of collectives. The coordinator is the group's first
rank.

- **Arrival**: before any collective, every rank checks in through the process group's store.
  A rank that has not arrived within ``knobs.collective_timeout_s``, or within the process
  group's own timeout where that is shorter (:func:`wait_limit`), makes every rank that did
  raise :class:`~shardsafe.errors.MissingRanksError` naming the missing ranks and the timeout
  that fired, instead of waiting in the first collective until the process group's timeout.
  The groups shardsafe creates itself (background commits, a gloo twin of a GPU-only group)
  take the same limit, so no wait of shardsafe's outlasts the caller's own group timeout.
- **Failures travel as records**: each collective carries a value *or* a :class:`Failed`
  record of plain strings (rank, exception class, message, traceback), never the exception
  object, so an exception or a value that cannot be pickled still reaches every rank and no
  rank waits forever. The rank that failed re-raises its own exception; the others raise a
  ``CheckpointError`` (of the failing class when it is one of shardsafe's) naming every failing
  rank.
- **Broken connections**: a collective that fails in the backend (a peer died) raises
  :class:`~shardsafe.errors.CollectiveError` naming the call and the cause.
- **Nothing outlives a call**: each collective returns only once the backend's worker threads
  have let go of its tensors. Otherwise a worker could drop them while the interpreter exits,
  and the process would abort (``terminate called without an active exception``).
"""

from __future__ import annotations

import logging
import pickle
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from .errors import CheckpointError, CollectiveError, MissingRanksError
from .knobs import KNOBS

__all__ = [
    "Comm", "Failed", "RankFailure", "Sending", "all_gather_objects", "background_comm", "broadcast_in", "collective_counts", "get_comm",
    "group_rank", "group_size", "group_timeout_s", "raise_failures", "replication_comm", "uses_nccl", "wait_limit",
]

T = TypeVar("T")
log = logging.getLogger(__name__)

_COUNTS: Counter[str] = Counter()  # collectives run by this process, by kind (every Comm)
_RELEASE_WAIT_S = 2.0  # longest wait for a backend to let go of a collective's tensors


def collective_counts() -> dict[str, int]:
    """How many collectives this process has run, by kind (``arrive``, ``gather``,
    ``all_gather``, ``all_reduce``, ``scatter``, ``broadcast``); a single-process ``Comm`` runs none."""
    return dict(_COUNTS)


@dataclass(frozen=True, slots=True)
class RankFailure:
    """One rank's exception as plain, picklable data."""

    rank: int  # global rank
    type_name: str  # ``ValueError``
    qualname: str  # ``builtins.ValueError``
    message: str
    traceback: str
    # set only for shardsafe's own CheckpointError classes, so other ranks raise the same class
    error_class: type[CheckpointError] | None = None

    @classmethod
    def of(cls, rank: int, e: BaseException) -> RankFailure:
        t = type(e)
        try:
            message = str(e)
        except Exception as inner:  # noqa: BLE001 - a broken __str__ must not stop the report
            message = f"<str() of the exception failed: {type(inner).__name__}>"
        ours = issubclass(t, CheckpointError) and t.__module__.split(".")[0] == "shardsafe"
        text = "".join(traceback.format_exception(t, e, e.__traceback__))
        return cls(rank, t.__name__, f"{t.__module__}.{t.__qualname__}", message, text, t if ours else None)

    def describe(self) -> str:
        return f"{self.type_name}: {self.message}"


@dataclass(frozen=True, slots=True)
class Failed:
    """What a collective carries instead of a value when ranks failed: one record per rank."""

    failures: tuple[RankFailure, ...]


def raise_failures(
    results: list[Any] | None, *, rank: int, own: BaseException | None = None, own_as_is: bool = True
) -> None:
    """Raise one error if any result is a :class:`Failed`.

    ``rank`` is this process's global rank and ``own`` the exception it raised itself, if any:
    when this rank is the only one that failed, ``own`` is re-raised as is (with its
    traceback). Otherwise the error is of the first failing rank's class when that is one of
    shardsafe's ``CheckpointError`` classes, else ``CheckpointError``; its message names every
    failing rank and its ``rank_errors`` maps rank to message.
    """
    failures = [f for r in results or () if isinstance(r, Failed) for f in r.failures]
    if failures:
        raise _error(failures, rank=rank, own=own, own_as_is=own_as_is)


def _error(failures: list[RankFailure], *, rank: int, own: BaseException | None, own_as_is: bool = True) -> BaseException:
    by_rank = {f.rank: f for f in sorted(failures, key=lambda f: f.rank)}
    if own_as_is and own is not None and list(by_rank) == [rank]:
        if isinstance(own, CheckpointError) and not own.rank_errors:  # as the other ranks see it
            own.rank_errors = {rank: by_rank[rank].describe()}
        return own
    first = next(iter(by_rank.values()))
    cls = first.error_class or CheckpointError
    messages = {r: f.describe() for r, f in by_rank.items()}
    detail = "; ".join(f"rank {r}: {m}" for r, m in messages.items())
    err = cls(f"{len(by_rank)} rank(s) failed: {detail}", rank_errors=messages)
    err.__cause__ = own
    err._shardsafe_failed = Failed(tuple(by_rank.values()))  # type: ignore[attr-defined]  # forwarded as is
    if hasattr(err, "add_note"):  # Python >= 3.11: the other ranks' tracebacks, for debugging
        for r, f in by_rank.items():
            if r != rank:
                err.add_note(f"--- rank {r} ---\n{f.traceback[-4000:]}")
    return err


class Comm:
    """The collectives of one public call among the ranks of a process group.

    ``rank`` and ``world_size`` are this process's rank in the group and the group's size;
    every rank list in messages names global ranks. A ``Comm`` of one process runs every
    function locally and sends nothing.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, call: str = "shardsafe", own_as_is: bool = True) -> None:
        self.call = call
        # True: a rank that alone failed re-raises its own exception (its traceback at hand); False:
        # it raises the error every other rank raises, its own exception as the cause
        self.own_as_is = own_as_is
        self.group = group
        if group is None:
            self.rank, self.world_size, self.global_ranks = 0, 1, [0]
        else:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.global_ranks = dist.get_process_group_ranks(group)
        self.distributed = self.world_size > 1
        self.counts: Counter[str] = Counter()
        self._own_error: BaseException | None = None  # the first exception this rank raised in a collective
        self._transport: dist.ProcessGroup | None = None
        self._flag: torch.Tensor | None = None  # any()'s one int, reused

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def global_rank(self) -> int:
        return self.global_ranks[self.rank]

    # --- public collectives: each runs ``fn`` and carries its value or its failure --------------

    def gather(self, fn: Callable[[], T]) -> list[T | Failed] | None:
        """Run ``fn`` on every rank; the coordinator gets every result in rank order (others: None)."""
        value = self._capture(fn)
        self._count("gather")
        if not self.distributed:
            return [value]
        data, value = self._encode(value)
        out = self._gather(data)
        if out is not None:
            out[self.rank] = value  # its own value as it is, not a copy
        return out

    def all_gather(self, fn: Callable[[], T]) -> list[T | Failed]:
        """Run ``fn`` on every rank; every rank gets every result in rank order."""
        value = self._capture(fn)
        self._count("all_gather")
        if not self.distributed:
            return [value]
        data, value = self._encode(value)
        out = self._all_gather(data)
        out[self.rank] = value
        return out

    def scatter(self, fn: Callable[[], list[T]]) -> T:
        """The coordinator computes one value per rank; each rank gets its own, or raises the error."""
        values: Any = self._capture(fn) if self.is_coordinator else None
        self._count("scatter")
        if not self.distributed:
            got = values if isinstance(values, Failed) else values[0]
        elif self.is_coordinator:
            encoded = [self._encode(v) for v in values] if not isinstance(values, Failed) else []
            failed = values if isinstance(values, Failed) else next((v for _, v in encoded if isinstance(v, Failed)), None)
            if failed is not None:  # every rank fails, or none
                encoded = [self._encode(failed)] * self.world_size
            self._scatter([data for data, _ in encoded])
            got = encoded[0][1]
        else:
            got = self._scatter(None)
        if isinstance(got, Failed):
            raise self._failure(got)
        return got

    def broadcast(self, fn: Callable[[], T]) -> T:
        """The coordinator computes a value; every rank gets it, or raises its error.

        When the coordinator's ``fn`` failed and the broadcast fails too, the coordinator
        raises ``fn``'s error (the broadcast's as its context).
        """
        return self._from_coordinator(self._capture(fn) if self.is_coordinator else None)

    def check_at_coordinator(self, fn: Callable[[], T]) -> T | None:
        """:meth:`broadcast` for an ``fn`` whose value only the coordinator needs (a check): the
        coordinator's value (None on the other ranks), or every rank raises ``fn``'s error, as
        :meth:`broadcast` raises it. When ``fn`` succeeds, the ranks exchange one int
        (:meth:`any`), not the pickled value."""
        value: Any = self._capture(fn) if self.is_coordinator else None
        if self.distributed and not self.any(isinstance(value, Failed)):
            return value
        return self._from_coordinator(value)

    def _from_coordinator(self, value: Any) -> Any:
        """The coordinator's ``value`` (its ``fn``'s, or the :class:`Failed` record of it) on
        every rank, or every rank raises the failure."""
        self._count("broadcast")
        if self.distributed:
            data = None
            if self.is_coordinator:
                data, value = self._encode(value)
            try:
                got = self._broadcast(data)
                if not self.is_coordinator:
                    value = got
            except CollectiveError as e:
                if isinstance(value, Failed):
                    raise self._failure(value) from e
                raise
        if isinstance(value, Failed):
            raise self._failure(value)
        return value

    def check(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank; if any rank fails, every rank raises.

        Each rank returns its own ``fn``'s value. When no rank fails, the ranks exchange one int
        (:meth:`any`); the failure records travel (an all-gather) only after a failure.
        """
        value = self._capture(fn)
        sent = value if isinstance(value, Failed) else None
        if self.distributed and not self.any(sent is not None):
            return value  # type: ignore[return-value]
        self._count("all_gather")
        results = [sent]
        if self.distributed:
            results = self._all_gather(self._encode(sent)[0])
            results[self.rank] = sent
        self.raise_failures(results)
        return value  # type: ignore[return-value]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank: one all-reduce (MAX) of one int, no pickling."""
        self._count("all_reduce")
        if not self.distributed:
            return flag
        if self._flag is None:
            self._flag = torch.zeros(1, dtype=torch.int32)
        buf = self._flag
        buf.fill_(int(flag))
        group = self._cpu_group()
        self._run("all_reduce", lambda: dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group, async_op=True), [buf])
        return bool(buf.item())

    def raise_failures(self, results: list[Any] | None) -> None:
        """:func:`raise_failures` for this rank: its own exception is re-raised when it alone failed."""
        raise_failures(results, rank=self.global_rank, own=self._own_error, own_as_is=self.own_as_is)

    # --- failures as records ----------------------------------------------------------------------

    def _capture(self, fn: Callable[[], T]) -> T | Failed:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - sent to every rank and raised there
            forwarded = getattr(e, "_shardsafe_failed", None)
            if isinstance(forwarded, Failed):  # already gathered from several ranks: pass it on
                return forwarded
            if self._own_error is None:
                self._own_error = e
            return Failed((RankFailure.of(self.global_rank, e),))

    def _failure(self, failed: Failed) -> BaseException:
        return _error(list(failed.failures), rank=self.global_rank, own=self._own_error, own_as_is=self.own_as_is)

    def _encode(self, value: Any) -> tuple[bytes, Any]:
        """``value`` pickled, and ``value``; one that cannot be pickled becomes this rank's failure
        record (returned in its place)."""
        try:
            return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), value
        except Exception as e:  # noqa: BLE001 - any __reduce__ may raise anything
            err = CheckpointError(
                f"{self.call}: rank {self.global_rank} computed a value of type {type(value).__qualname__} that "
                f"cannot be sent to the other ranks (pickling failed: {type(e).__name__}: {e})"
            )
            err.__cause__ = e
            if self._own_error is None:
                self._own_error = err
            failed = Failed((RankFailure.of(self.global_rank, err),))
            return pickle.dumps(failed, protocol=pickle.HIGHEST_PROTOCOL), failed

    def _loads(self, raw: memoryview, sender: int) -> Any:
        """A value received from group rank ``sender``; one that cannot be unpickled is its failure."""
        try:
            return pickle.loads(raw)
        except Exception as e:  # noqa: BLE001 - e.g. a class that exists on the sender only
            g = self.global_ranks[sender]
            err = CheckpointError(
                f"{self.call}: the value rank {g} sent cannot be unpickled on rank {self.global_rank}: {type(e).__name__}: {e}"
            )
            return Failed((RankFailure.of(g, err),))

    def _count(self, kind: str) -> None:
        if self.distributed:
            self.counts[kind] += 1
            _COUNTS[kind] += 1

    # --- bytes over the backend ---------------------------------------------------------------------

    def _cpu_group(self) -> dist.ProcessGroup:
        if self._transport is None:
            self._transport = _cpu_group(self.group)  # type: ignore[arg-type]
        return self._transport

    def _run(self, kind: str, start: Callable[[], Any], tensors: list[torch.Tensor]) -> None:
        """Run one backend operation to completion, then wait until the backend has let go of
        ``tensors`` (see the module docstring)."""
        before = _refcounts(tensors)
        try:
            work = start()
            work.wait()
        except RuntimeError as e:  # DistBackendError, DistNetworkError, gloo's own errors
            raise CollectiveError(
                f"{self.call}: a {kind} among ranks {self.global_ranks} failed on rank {self.global_rank}: "
                f"{_first_line(e)} (did a rank of the process group die or lose its connection?)"
            ) from e
        del work
        _await_release(tensors, before)

    def _width(self, n: int) -> int:
        """The largest ``n`` of the group's ranks: one all-reduce (MAX). On gloo an all-gather of
        one int costs several times as much (4 ranks on 2 cores: 1.2-1.4 ms of CPU and 4 ms of wall
        time, against 0.2 and 0.7-1.1), and the sizes themselves travel inside the payloads."""
        width = torch.tensor([n], dtype=torch.int64)
        group = self._cpu_group()
        self._run("all_reduce", lambda: dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group, async_op=True), [width])
        return int(width.item())

    # each returns the values the other ranks sent (None in this rank's place: the caller has it)

    def _gather(self, data: bytes) -> list[Any] | None:
        width = self._width(len(data)) + _LEN
        mine = _framed(data, width)
        out = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world_size)] if self.is_coordinator else None
        group, dst = self._cpu_group(), self.global_ranks[0]
        self._run("gather", lambda: dist.gather(mine, out, dst=dst, group=group, async_op=True), [mine, *(out or [])])
        if out is None:
            return None
        return [self._loads(_unframed(t), r) if r != self.rank else None for r, t in enumerate(out)]

    def _all_gather(self, data: bytes) -> list[Any]:
        width = self._width(len(data)) + _LEN
        mine = _framed(data, width)
        out = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world_size)]
        group = self._cpu_group()
        self._run("all_gather", lambda: dist.all_gather(out, mine, group=group, async_op=True), [mine, *out])
        return [self._loads(_unframed(t), r) if r != self.rank else None for r, t in enumerate(out)]

    def _scatter(self, data: list[bytes] | None) -> Any:
        group, src = self._cpu_group(), self.global_ranks[0]
        size = torch.empty(2, dtype=torch.int64)  # (this rank's size, the largest)
        sizes_in = None
        if data is not None:
            width = max(len(d) for d in data)
            sizes_in = [torch.tensor([len(d), width], dtype=torch.int64) for d in data]
        self._run("scatter", lambda: dist.scatter(size, sizes_in, src=src, group=group, async_op=True), [size, *(sizes_in or [])])
        n, width = (int(x) for x in size.tolist())
        out = torch.empty(width, dtype=torch.uint8)
        parts = [_to_tensor(d, width) for d in data] if data is not None else None
        self._run("scatter", lambda: dist.scatter(out, parts, src=src, group=group, async_op=True), [out, *(parts or [])])
        return self._loads(_view(out, n), 0) if not self.is_coordinator else None

    def _broadcast(self, data: bytes | None) -> Any:
        """One broadcast of ``_FIRST`` bytes (the payload's length and its start), and a second
        of the rest only for a payload that does not fit: on gloo a broadcast of 16 KiB costs
        what one of 8 bytes does (4 ranks on 2 cores: 0.35-0.45 ms of CPU, 1 ms of wall time)."""
        group, src = self._cpu_group(), self.global_ranks[0]
        first = _framed(data, _FIRST) if data is not None else torch.empty(_FIRST, dtype=torch.uint8)
        self._run("broadcast", lambda: dist.broadcast(first, src=src, group=group, async_op=True), [first])
        n = _length(first)
        head = _FIRST - _LEN
        if n <= head:
            return self._loads(_unframed(first), 0) if not self.is_coordinator else None
        rest = _to_tensor(data[head:], n - head) if data is not None else torch.empty(n - head, dtype=torch.uint8)
        self._run("broadcast", lambda: dist.broadcast(rest, src=src, group=group, async_op=True), [rest])
        if self.is_coordinator:
            return None
        whole = torch.empty(n, dtype=torch.uint8)
        whole[:head] = first[_LEN:]
        whole[head:] = rest
        return self._loads(_view(whole, n), 0)

    # --- tensors of the caller's ------------------------------------------------------------------

    def all_gather_tensors(self, bufs: list[torch.Tensor], mine: torch.Tensor) -> None:
        """Fill ``bufs[r]`` with rank ``r``'s ``mine`` (CPU tensors of one size), over the CPU
        transport of this comm's group."""
        group = self._cpu_group()
        self._count("all_gather")
        self._run("all_gather", lambda: dist.all_gather(bufs, mine, group=group, async_op=True), [*bufs, mine])

    def broadcast_tensor(self, buf: torch.Tensor, src: int) -> None:
        """Fill ``buf`` on every rank with rank ``src``'s (a rank of this comm, from 0)."""
        group, global_src = self._cpu_group(), self.global_ranks[src]
        self._count("broadcast")
        self._run("broadcast", lambda: dist.broadcast(buf, src=global_src, group=group, async_op=True), [buf])

    def exchange(self, sends: list[tuple[int, int, torch.Tensor]], recvs: list[tuple[int, int, torch.Tensor]]) -> None:
        """Point-to-point transfers of CPU tensors over this comm's CPU transport: each
        ``(rank, tag, tensor)`` of ``sends`` goes to that rank of this comm, each of ``recvs`` is
        filled from that rank. A send and its receive carry the same tag (callers number their
        transfers from one plan every rank computed alike). Every operation is posted at once and
        all are waited for, so no order of the ranks' lists can deadlock; a peer that died makes
        this raise ``CollectiveError`` (after the process group's timeout at the latest)."""
        if not sends and not recvs:
            return
        if not self.distributed:
            raise CollectiveError(f"{self.call}: a point-to-point transfer needs a process group of more than one rank")
        group = self._cpu_group()
        self._count("exchange")
        tensors = [t for _, _, t in sends] + [t for _, _, t in recvs]
        before = _refcounts(tensors)
        works: list[Any] = []
        try:
            works += [dist.isend(t, dst=self.global_ranks[dst], group=group, tag=tag) for dst, tag, t in sends]
            works += [dist.irecv(t, src=self.global_ranks[src], group=group, tag=tag) for src, tag, t in recvs]
            while works:  # each work dropped once done: a work holds its tensor
                works.pop().wait()
        except RuntimeError as e:
            raise CollectiveError(
                f"{self.call}: a point-to-point transfer among ranks {self.global_ranks} failed on rank {self.global_rank}: "
                f"{_first_line(e)} (did a rank of the process group die or lose its connection?)"
            ) from e
        del works
        _await_release(tensors, before)

    def start_sends(self, sends: list[tuple[int, int, torch.Tensor]]) -> Sending:
        """:meth:`exchange`'s sends, started and not waited for: each ``(rank, tag, tensor)`` goes
        to that rank of this comm (see :meth:`Sending.add`); more may be added to the returned
        :class:`Sending` as bytes become ready, while the receivers wait in :meth:`exchange`."""
        if sends and not self.distributed:
            raise CollectiveError(f"{self.call}: a point-to-point transfer needs a process group of more than one rank")
        out = Sending(self)
        if sends:
            self._count("exchange")
        for dst, tag, t in sends:
            out.add(dst, tag, t)
        return out

    # --- arrival ------------------------------------------------------------------------------------

    def arrive(self, timeout_s: float) -> None:
        """Check in; return once every rank of the group has, or raise ``MissingRanksError``
        on every rank that did after ``timeout_s`` or the group's own timeout, whichever is
        shorter (and at once on a rank that comes later)."""
        self._count("arrive")
        if not self.distributed:
            return
        asked = timeout_s
        timeout_s = wait_limit(self.group, asked)
        group_name = self.group.group_name  # type: ignore[union-attr]
        seq = _ARRIVALS.get(group_name, 0)
        _ARRIVALS[group_name] = seq + 1
        base = f"shardsafe/arrive/{group_name}/{seq}"
        try:
            with _store_client() as (store, blocking):
                store.append(f"{base}/who", f"{self.rank}={self.call};")
                if store.add(f"{base}/count", 1) == self.world_size:
                    store.compare_set(f"{base}/done", "", "ok")
                _wait_for_key(store, blocking, f"{base}/done", timeout_s)
                verdict = store.compare_set(f"{base}/done", "", "timeout")  # timed out: tell later ranks
                if verdict.startswith(_GAVE_UP):
                    raise CollectiveError(f"{self.call}: {verdict[len(_GAVE_UP) :].decode(errors='replace')}")
                if verdict == b"ok":
                    if self.is_coordinator and seq > 0:  # every rank is past the previous check
                        for key in ("who", "count", "done"):
                            store.delete_key(f"shardsafe/arrive/{group_name}/{seq - 1}/{key}")
                    return
                who = store.get(f"{base}/who").decode()
        except RuntimeError as e:
            raise CollectiveError(
                f"{self.call}: rank {self.global_rank} could not check in with the other ranks through the "
                f"process group's store: {_first_line(e)}"
            ) from e
        raise self._missing(who, timeout_s, asked)

    def abandon(self, reason: str) -> None:
        """Take this rank's next check-in (:meth:`arrive`) without waiting, for a call it gave up
        before checking in: the ranks that wait there, or come later, raise ``CollectiveError``
        with ``reason`` at once instead of waiting out the timeout."""
        if not self.distributed:
            return
        group_name = self.group.group_name  # type: ignore[union-attr]
        seq = _ARRIVALS.get(group_name, 0)
        _ARRIVALS[group_name] = seq + 1
        base = f"shardsafe/arrive/{group_name}/{seq}"
        message = f"rank {self.global_rank} gave up this call before checking in, so it cannot complete: {reason}"
        try:
            with _store_client() as (store, _):
                store.append(f"{base}/who", f"{self.rank}=<gave up>;")
                store.compare_set(f"{base}/done", "", _GAVE_UP.decode() + message)
        except RuntimeError as e:
            log.warning("%s: rank %d could not tell the other ranks it gave up: %s", self.call, self.global_rank, _first_line(e))

    def _missing(self, who: str, timeout_s: float, asked: float) -> MissingRanksError:
        calls = dict(entry.split("=", 1) for entry in who.split(";") if entry)
        arrived = {int(r) for r, c in calls.items() if c == self.call}
        others = {self.global_ranks[int(r)]: c for r, c in calls.items() if c != self.call}
        missing = [self.global_ranks[r] for r in range(self.world_size) if r not in arrived]
        hint = (
            "every rank of the process group must call it, together (to use only some ranks, pass a "
            "process_group of those ranks; to read on one rank alone, pass no_dist=True where the call takes it)"
        )
        if not missing:
            what = f"rank {self.global_rank} called it after the other ranks had stopped waiting ({timeout_s:g} s)"
        else:
            what = f"rank(s) {missing} of the {self.world_size} rank(s) of the process group did not call it within {timeout_s:g} s"
        also = "".join(f"; rank {r} called {c} instead" for r, c in sorted(others.items()))
        if timeout_s < asked:
            which = (
                f"the wait was the process group's own timeout, {timeout_s:g} s, shorter than knobs.collective_timeout_s "
                f"({asked:g} s)"
            )
        else:
            which = "the wait is knobs.collective_timeout_s"
        return MissingRanksError(f"{self.call}: {what}{also}: {hint} ({which})")


class Sending:
    """Sends started by :meth:`Comm.start_sends` or :meth:`add`; :meth:`wait` waits for all."""

    def __init__(self, comm: Comm) -> None:
        self._comm = comm
        self._works: list[Any] = []
        self._tensors: list[torch.Tensor] = []
        self._error: BaseException | None = None

    def add(self, dst: int, tag: int, tensor: torch.Tensor) -> None:
        """Start sending ``tensor`` (CPU) to rank ``dst`` of the comm, under ``tag``. ``tensor``
        must be an object no one else keeps (a fresh view, say ``t[a:b]``): the Sending holds it
        until :meth:`wait`, and tells the backend's hold on it by its reference count."""
        self._tensors.append(tensor)
        try:
            group = self._comm._cpu_group()
            self._works.append(dist.isend(tensor, dst=self._comm.global_ranks[dst], group=group, tag=tag))
        except RuntimeError as e:
            self._error = self._error or self._failed(e)

    def extend(self, other: Sending) -> None:
        """Take over ``other``'s sends (to wait for them all at once)."""
        self._works += other._works
        self._tensors += other._tensors
        self._error = self._error or other._error
        other._works, other._tensors = [], []

    def wait(self) -> None:
        """Wait until every send is done (raising ``CollectiveError`` if one failed: a peer died)
        and the backend has let go of its tensor."""
        while self._works:  # each work dropped once done: a work holds its tensor
            try:
                self._works.pop().wait()
            except RuntimeError as e:
                self._error = self._error or self._failed(e)
        _await_release(self._tensors, [_SOLE] * len(self._tensors))
        self._tensors = []
        if self._error is not None:
            raise self._error

    def _failed(self, e: RuntimeError) -> CollectiveError:
        c = self._comm
        err = CollectiveError(
            f"{c.call}: a point-to-point transfer among ranks {c.global_ranks} failed on rank {c.global_rank}: "
            f"{_first_line(e)} (did a rank of the process group die or lose its connection?)"
        )
        err.__cause__ = e
        return err


_STORE_LOCK = threading.Lock()
_STORE_CLIENTS: list[tuple[Any, Any, bool]] = []  # (default store, a client of it, whether it may block), idle


@contextmanager
def _store_client() -> Iterator[tuple[Any, bool]]:
    """A client of the process group's store that no other thread uses while the caller holds it,
    and whether a blocking ``wait`` on it is safe.

    A store client serializes its operations: a thread blocked in ``wait`` on the shared default
    store holds up every other thread's store operation in this process. A background save checks
    in from a thread of its own while the caller's thread may check in for its next call; with
    one client, each rank's two waits could each hold up the one the other rank needs, and both
    would wait out the whole timeout. So each thread checks in through a client of its own (a
    ``clone`` of the store: one more connection per thread checking in at once, kept for reuse).
    A store that cannot be cloned is shared and polled with ``check`` instead of waited on.
    """
    default = dist.distributed_c10d._get_default_store()
    with _STORE_LOCK:
        if _STORE_CLIENTS and _STORE_CLIENTS[0][0] is not default:  # a new default process group
            _STORE_CLIENTS.clear()
        entry = _STORE_CLIENTS.pop() if _STORE_CLIENTS else None
    if entry is None:
        try:
            entry = (default, default.clone(), True)
        except (AttributeError, RuntimeError, NotImplementedError):  # older torch, or a store that cannot
            entry = (default, default, False)
    try:
        yield entry[1], entry[2]
    finally:
        with _STORE_LOCK:
            _STORE_CLIENTS.append(entry)


def _wait_for_key(store: Any, blocking: bool, key: str, timeout_s: float) -> None:
    """Wait until ``key`` is set or ``timeout_s`` passed (no error either way)."""
    if blocking:
        try:
            store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))  # 0 would mean the store's own
        except RuntimeError:  # timed out
            pass
        return
    deadline, pause = time.monotonic() + timeout_s, 0.0002
    while not store.check([key]):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.02)


_GAVE_UP = b"gave up:"  # an arrival's verdict is "ok", "timeout", or this and why (Comm.abandon)
_ARRIVALS: dict[str, int] = {}  # process group name -> arrival checks so far (the same on every rank)
_SIDE_GROUPS: dict[Any, dist.ProcessGroup] = {}  # process group -> its gloo group, for groups without CPU support


# --- a caller's own process group, for the integrations that take one (Megatron's exchange utilities)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group`` (None: the whole job)."""
    return dist.get_rank(group=group)


def group_size(group: dist.ProcessGroup | None) -> int:
    """The number of ranks of ``group`` (None: the whole job)."""
    return dist.get_world_size(group=group)


def uses_nccl(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group``'s backend is NCCL (its tensors live on the GPU)."""
    return "nccl" in str(dist.get_backend(group))


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj`` of ``group``, in rank order (pickled by torch: objects this job made)."""
    out: list[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_in(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> None:
    """Broadcast ``tensor`` from the rank ``src`` of ``group`` (None: the whole job)."""
    dist.broadcast(tensor, src=src if group is None else dist.get_global_rank(group, src), group=group)


def group_timeout_s(group: dist.ProcessGroup | None) -> float | None:
    """The process group's own timeout in seconds (the shortest of its backends'), or None when
    the backend does not say."""
    if group is None:
        return None
    found = []
    for device in getattr(group, "_device_types", ()):
        try:
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):  # a backend without options (a wrapper, a fake group)
            continue
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            found.append(timeout.total_seconds())
    return min(found) if found else None


def wait_limit(group: dist.ProcessGroup | None, timeout_s: float) -> float:
    """The longest shardsafe waits for the ranks of ``group``: ``timeout_s``
    (``knobs.collective_timeout_s``) or the group's own timeout, whichever is shorter. A peer
    that died is then found as soon as the caller's own collectives would find it."""
    own = group_timeout_s(group)
    return timeout_s if own is None else min(timeout_s, own)


def _cpu_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """``group`` if it runs collectives on CPU tensors (gloo, or a ``cpu:gloo,cuda:nccl``
    group), else a gloo group of the same ranks, created once: shardsafe's collectives move
    small pickled payloads, which need no GPU and should not wait on CUDA streams."""
    if "cpu:" in str(dist.get_backend_config(group)):
        return group
    side = _SIDE_GROUPS.get(group)
    if side is None:  # every rank of ``group`` is here: it has just passed the arrival check
        own = group_timeout_s(group)
        side = _gloo_group(group, "cpu", timeout=timedelta(seconds=own) if own is not None else None)
        _SIDE_GROUPS[group] = side
    return side


def _gloo_group(group: dist.ProcessGroup, purpose: str, *, timeout: timedelta | None) -> dist.ProcessGroup:
    """A new gloo group of ``group``'s ranks, named the same on every rank; every rank of
    ``group`` calls this, at the same point of its sequence of shardsafe calls.

    ``new_group(..., use_local_synchronization=True)`` names a group from the number of groups
    the calling rank belongs to, so in a job whose ranks belong to different numbers of groups
    (pipeline-parallel embedding groups, [0, 3] among 4 ranks) the ranks disagree on the name and
    wait on different store keys until the timeout. So: a group of every rank is created without
    local synchronization (every rank of the job is here, and torch names it from the count of
    such groups, the same on every rank); a group of some ranks is named from ``group``'s own
    name (the same on its ranks: they rendezvoused under it) and ``purpose``.
    """
    ranks = dist.get_process_group_ranks(group)
    desc = f"shardsafe {purpose} group of {getattr(group, 'group_desc', None) or group.group_name}"
    if len(ranks) == dist.get_world_size():
        return dist.new_group(ranks, backend="gloo", timeout=timeout, group_desc=desc)
    name = f"shardsafe-{purpose}-{group.group_name}"
    c10d = dist.distributed_c10d
    helper = getattr(c10d, "_new_process_group_helper", None)
    if helper is None:
        raise CollectiveError(
            f"shardsafe needs a gloo group of ranks {ranks} (a subgroup of the job) named the same on every rank, and "
            f"torch {torch.__version__} has no way to name one; pass the whole job's process group"
        )
    pg, _ = helper(
        len(ranks), ranks.index(dist.get_rank()), ranks, "gloo", c10d._get_default_store(), name,
        timeout=timeout or c10d.default_pg_timeout, group_desc=desc,
    )
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg


_SIDE_COMMS: dict[tuple[Any, str], dist.ProcessGroup] = {}  # (process group, purpose) -> a gloo group of its own


def background_comm(comm: Comm, *, timeout_s: float) -> Comm:
    """A ``Comm`` of the same ranks as ``comm`` on a gloo group used only by background saves, so
    a save's commit can run while the caller's own collectives run on its group.

    The group is created once per process group, the first time (every rank of ``comm`` is here:
    it has passed the arrival check); a background collective that waits longer than ``timeout_s``
    or the process group's own timeout, whichever is shorter, for a peer fails with
    ``CollectiveError`` rather than hanging.
    """
    return _side_comm(comm, "background", timeout_s)


def replication_comm(comm: Comm, *, timeout_s: float) -> Comm:
    """A ``Comm`` of the same ranks as ``comm`` on a gloo group of its own for bulk point-to-point
    copies (the memory tier's), made as :func:`background_comm` makes its group: its own
    connections, so megabytes in flight there never hold up a background commit's small
    collectives queued behind them on the same socket."""
    return _side_comm(comm, "replication", timeout_s)


def _side_comm(comm: Comm, purpose: str, timeout_s: float) -> Comm:
    if not comm.distributed:
        return Comm(None, call=comm.call)  # one rank: its own error is the error
    side = _SIDE_COMMS.get((comm.group, purpose))
    if side is None:
        side = _gloo_group(comm.group, purpose, timeout=timedelta(seconds=wait_limit(comm.group, timeout_s)))  # type: ignore[arg-type]
        _SIDE_COMMS[(comm.group, purpose)] = side
    out = Comm(side, call=comm.call, own_as_is=False)  # one error, worded the same on every rank
    if out.global_ranks != comm.global_ranks:  # new_group orders ranks by number; a group given in another order
        raise CollectiveError(
            f"{comm.call}: the {purpose} group's ranks {out.global_ranks} are not in the order of the process group's "
            f"{comm.global_ranks}; pass a process group whose ranks are in increasing order"
        )
    return out


_LEN = 8  # a framed payload starts with its length (int64, little-endian)
_FIRST = 16 << 10  # bytes of a broadcast's first (often only) operation


def _framed(data: bytes, width: int) -> torch.Tensor:
    """``data`` after its length, in a new uint8 tensor of ``width`` bytes (the rest left as is;
    a payload longer than fits is cut, its length still whole)."""
    t = torch.empty(width, dtype=torch.uint8)
    a = t.numpy()
    a[:_LEN] = np.frombuffer(len(data).to_bytes(_LEN, "little"), dtype=np.uint8)
    n = min(len(data), width - _LEN)
    if n:
        a[_LEN : _LEN + n] = np.frombuffer(data, dtype=np.uint8, count=n)
    return t


def _length(t: torch.Tensor) -> int:
    return int.from_bytes(t.numpy()[:_LEN].tobytes(), "little")


def _unframed(t: torch.Tensor) -> memoryview:
    """The payload of a framed tensor that holds all of it."""
    return memoryview(t.numpy())[_LEN : _LEN + _length(t)]


def _to_tensor(data: bytes, width: int) -> torch.Tensor:
    """``data`` copied into a new uint8 tensor of ``width`` bytes (the rest left as is)."""
    t = torch.empty(width, dtype=torch.uint8)
    if data:
        t.numpy()[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    return t


def _view(t: torch.Tensor, n: int) -> memoryview:
    return memoryview(t.numpy())[:n]


def _refcounts(tensors: list[torch.Tensor]) -> list[int]:
    return [sys.getrefcount(t) for t in tensors]


_SOLE = _refcounts([torch.empty(0)])[0]  # what _refcounts counts for a tensor that only its list holds
_release_wait = True  # turned off if a backend keeps its tensors longer than _RELEASE_WAIT_S


def _await_release(tensors: list[torch.Tensor], before: list[int]) -> None:
    """Wait until the backend holds none of ``tensors``.

    While C++ code holds a tensor that Python also holds, the tensor holds a reference to its
    Python object (torch >= 2.10); the backend's worker thread releases it some microseconds
    after the work completes, which takes the GIL. If the interpreter is exiting by then, the
    worker thread is ended inside a ``noexcept`` destructor and the process aborts. Here the
    Python reference count of each tensor tells when the backend has let go.
    """
    global _release_wait
    if not _release_wait:
        return
    deadline = time.monotonic() + _RELEASE_WAIT_S
    pause = 0.0
    while any(now > was for now, was in zip(_refcounts(tensors), before)):
        if time.monotonic() > deadline:
            _release_wait = False
            log.debug("the process group kept a collective's tensors for over %s s; not waiting for it again", _RELEASE_WAIT_S)
            return
        time.sleep(pause)
        pause = min(pause * 2 or 1e-5, 1e-3)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def get_comm(
    no_dist: bool = False,
    process_group: dist.ProcessGroup | None = None,
    *,
    call: str | None = None,
    timeout_s: float | None = None,
    arrive: bool = True,
) -> Comm:
    """The ``Comm`` of one public call.

    Distributed when ``torch.distributed`` is initialized, ``no_dist`` is False and the group
    (``process_group``, default: every rank) has more than one rank. With ``call`` (the public
    function's name, for messages) every rank first checks in (:meth:`Comm.arrive`), waiting at
    most ``timeout_s`` seconds (default ``KNOBS.collective_timeout_s``) for the others, unless
    ``arrive`` is False (the caller checks in later itself, as an async save does in the background).
    """
    if no_dist or not (dist.is_available() and dist.is_initialized()):
        return Comm(None, call=call or "shardsafe")
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise CheckpointError(
            f"{call or 'shardsafe'}: rank {dist.get_rank()} is not in the process_group it was given "
            f"(ranks {dist.get_process_group_ranks(group)}); only the group's ranks may call it"
        )
    comm = Comm(group, call=call or "shardsafe")
    if call is not None and arrive:
        comm.arrive(KNOBS.collective_timeout_s if timeout_s is None else timeout_s)
    return comm
