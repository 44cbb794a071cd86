"""Asynchronous saves, as in ``megatron.core.dist_checkpointing.strategies.async_utils``.

``save(..., async_sharded_save=True)`` starts shardsafe's own async save
(:meth:`shardsafe.Checkpointer.async_save`): it returns once this rank's state is staged (copied),
and a thread of the engine's writes the data, checksums it and commits. The returned
:class:`AsyncRequest` carries that :class:`~shardsafe.engine.background.AsyncSave`; its
``async_fn`` waits for the commit. :class:`AsyncCallsQueue` schedules such requests and
finalizes them as Megatron-Core's does: in call order, each once it is done on every rank, its
``finalize_fns`` on every rank after the checkpoint is committed. No process is forked and no
second background mechanism exists: a request that carries no shardsafe save (a foreign
``async_fn``) runs in the caller's thread when it is scheduled.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from ...dist import get_comm
from ...engine.background import AsyncSave
from ..core import CheckpointingException, megatron_errors

__all__ = ["AsyncCallsQueue", "AsyncRequest", "request_for", "wait_for_save"]


class AsyncRequest(NamedTuple):
    """A save to complete later: ``async_fn(*async_fn_args, **async_fn_kwargs)``, then each of
    ``finalize_fns`` in order (once ``async_fn`` is done on every rank)."""

    async_fn: Callable[..., Any] | None
    async_fn_args: tuple
    finalize_fns: list[Callable[[], Any]]
    async_fn_kwargs: dict = {}
    preload_fn: Callable[[], Any] | None = None
    is_frozen: bool = False
    call_idx: int = 0

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` after the finalize functions already added."""
        if self.is_frozen:
            raise CheckpointingException("cannot add a finalize function to a frozen AsyncRequest (it was scheduled already)")
        self.finalize_fns.append(fn)

    @megatron_errors
    def execute_sync(self) -> None:
        """Complete the request in the caller's thread: ``async_fn``, then every finalize function."""
        _run_async_fn(self)
        for fn in self.finalize_fns:
            fn()

    def freeze(self) -> AsyncRequest:
        """This request, refusing further finalize functions."""
        return self._replace(is_frozen=True)


@megatron_errors
def wait_for_save(pending: AsyncSave) -> None:
    """The ``async_fn`` of a request for a shardsafe save: wait until it committed (raise its
    error, as a ``CheckpointingException``)."""
    pending.wait()


def request_for(pending: AsyncSave) -> AsyncRequest:
    """The :class:`AsyncRequest` that completes the shardsafe save ``pending``."""
    return AsyncRequest(wait_for_save, (pending,), [])


def _save_of(request: AsyncRequest) -> AsyncSave | None:
    if request.async_fn is wait_for_save and request.async_fn_args and isinstance(request.async_fn_args[0], AsyncSave):
        return request.async_fn_args[0]
    return None


def _run_async_fn(request: AsyncRequest) -> None:
    args = list(request.async_fn_args)
    if request.preload_fn is not None:
        staged = request.preload_fn()
        if len(args) == 3:  # Megatron's convention: the preload gives async_fn's second argument
            args[1] = staged
    if request.async_fn is not None:
        request.async_fn(*args, **request.async_fn_kwargs)


class _Call(NamedTuple):
    idx: int
    request: AsyncRequest
    save: AsyncSave | None
    error: BaseException | None  # what a foreign async_fn raised when it ran


class _State(NamedTuple):
    """What each rank tells the others about the oldest call in its queue."""

    idx: int  # -1: the queue is empty
    done: bool
    error: str | None


class AsyncCallsQueue:
    """The asynchronous saves of this process, finalized in call order.

    :meth:`schedule_async_request` and :meth:`maybe_finalize_async_calls` are collective: every
    rank calls them, in the same order. ``persistent`` is accepted for Megatron-Core's signature;
    shardsafe's saves always run in the engine's background threads.
    """

    def __init__(self, persistent: bool = False) -> None:
        self.persistent = persistent
        self.call_idx = -1
        self.async_calls: deque[_Call] = deque()

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start ``async_request`` and return its index (0, 1, ... in call order). A request of
        :func:`shardsafe.megatron.serialization.save` is already running (this only queues it);
        any other ``async_fn`` runs now, in the caller's thread, and an error it raises is raised
        by the :meth:`maybe_finalize_async_calls` that reaches it, on every rank."""
        if not isinstance(async_request, AsyncRequest):
            raise TypeError(f"AsyncCallsQueue.schedule_async_request: async_request must be an AsyncRequest, not {type(async_request).__name__}")
        self.call_idx += 1
        request = async_request.freeze()
        save = _save_of(request)
        error = None
        if save is None:
            try:
                _run_async_fn(request)
            except Exception as e:  # noqa: BLE001 - raised on every rank when the call is finalized
                error = e
        self.async_calls.append(_Call(self.call_idx, request, save, error))
        return self.call_idx

    @megatron_errors
    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> list[int]:
        """Finalize the calls, oldest first, that are done on every rank: run their
        ``finalize_fns`` (on every rank, after the checkpoint is committed) and return their
        indices. Stops at the first call some rank has not finished, unless ``blocking``, which
        waits for every call. ``no_dist`` looks at this rank's saves only (no collective).

        A call that failed on any rank raises on every rank (the save's ``CheckpointError``,
        or a ``CheckpointingException`` naming the ranks of a foreign ``async_fn`` that failed);
        it leaves the queue without running its finalize functions, and later calls stay queued.
        """
        finalized: list[int] = []
        comm = get_comm(no_dist=no_dist)
        while True:
            head = self.async_calls[0] if self.async_calls else None
            if head is not None and head.save is not None and blocking:
                cf.wait([head.save.committed])
            states = comm.all_gather(lambda head=head: self._state(head))
            comm.raise_failures(states)
            if all(s.idx == -1 for s in states):  # type: ignore[union-attr]
                return finalized
            idxs = {s.idx for s in states}  # type: ignore[union-attr]
            if len(idxs) > 1:
                per_rank = {comm.global_ranks[r]: s.idx for r, s in enumerate(states)}  # type: ignore[union-attr]
                raise CheckpointingException(
                    f"the ranks' async call queues differ (oldest call index per rank, -1 for none: {per_rank}); every rank "
                    "must schedule and finalize the same async requests in the same order"
                )
            if not all(s.done for s in states):  # type: ignore[union-attr]
                return finalized
            assert head is not None
            self.async_calls.popleft()
            failed = {comm.global_ranks[r]: s.error for r, s in enumerate(states) if s.error is not None}  # type: ignore[union-attr]
            if failed:
                if head.save is not None:
                    head.save.wait()  # the save's own error: the same on every rank
                own = head.error
                text = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
                raise CheckpointingException(f"async call {head.idx} failed on rank(s) {sorted(failed)}: {text}") from own
            for fn in head.request.finalize_fns:
                fn()
            finalized.append(head.idx)

    @staticmethod
    def _state(head: _Call | None) -> _State:
        if head is None:
            return _State(-1, True, None)
        if head.save is not None:
            if not head.save.done():
                return _State(head.idx, False, None)
            e = head.save.committed.exception()
            return _State(head.idx, True, None if e is None else f"{type(e).__name__}: {e}")
        e = head.error
        return _State(head.idx, True, None if e is None else f"{type(e).__name__}: {e}")

    def get_num_unfinalized_calls(self) -> int:
        """How many scheduled calls are not finalized yet."""
        return len(self.async_calls)

    def close(self, abort: bool = False) -> None:
        """Finalize every call (waiting for each); with ``abort``, forget them instead (their
        saves still commit in the background, without finalize functions)."""
        if not abort:
            self.maybe_finalize_async_calls(blocking=True)
        self.async_calls.clear()
