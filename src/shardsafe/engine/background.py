"""Background saves: the handle ``async_save`` returns, and the saves in flight.

An ``async_save`` runs the save's first phases (describe, plan) in the caller's thread, with
the caller's process group, then stages this rank's bytes (:mod:`.staging`) and returns; a
thread of its own writes the data file, checksums it and joins the commit through a gloo group
created once for background saves (:func:`shardsafe.dist.background_comm`), so the caller's
collectives and ours never share a group. A synchronous ``save`` is the same path with no copy
(its bytes are read from the caller's tensors while it waits) and the last phase in the caller's
thread.

Saves commit in call order: each background thread first waits for the one before it, and at
most ``knobs.async_max_in_flight`` saves are in flight (the next save waits for the oldest).
A save's error is kept in its ``committed`` future; if the caller never looked at it, the next
save on this process raises it instead of starting. Interpreter exit waits for saves in flight
(their threads are not daemons), and logs any failure nobody observed.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import logging
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ..errors import CheckpointError

__all__ = ["AsyncSave", "after_in_flight", "before_save", "run_in_background", "wait_for_location"]

T = TypeVar("T")
log = logging.getLogger(__name__)


class _Outcome(cf.Future):
    """A future that remembers whether its owner looked at its outcome."""

    observed = False

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(timeout)
        finally:
            if super().done():
                self.observed = True

    def exception(self, timeout: float | None = None) -> BaseException | None:
        e = super().exception(timeout)
        self.observed = True
        return e


class AsyncSave(Generic[T]):
    """A save that goes on in the background.

    ``staged`` is done once this rank's state was copied (``async_save`` returns only after
    that, so the caller may change every tensor); ``committed`` completes with what the
    synchronous call returns once the checkpoint is committed, or with the save's
    ``CheckpointError`` (the same on every rank, naming each failing rank's cause).
    ``location`` is the checkpoint's URL or path.
    """

    def __init__(self, location: str, staged: cf.Future[None], committed: cf.Future[T]) -> None:
        self.location = location
        self.staged = staged
        self.committed = committed

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self.committed.done()

    def wait(self, timeout: float | None = None) -> T:
        """Wait until the save committed and return what the synchronous call returns; raise the
        save's error, or ``TimeoutError`` after ``timeout`` seconds (the save goes on)."""
        return self.committed.result(timeout)

    def __repr__(self) -> str:
        if not self.committed.done():
            state = "in flight"
        else:
            state = "failed" if cf.Future.exception(self.committed) is not None else "committed"
        return f"AsyncSave({self.location!r}, {state})"


_lock = threading.Lock()
_in_flight: list[AsyncSave[Any]] = []  # oldest first; done ones are dropped by before_save
_last_thread: threading.Thread | None = None
_unobserved: list[AsyncSave[Any]] = []  # failed saves whose error nobody has seen yet


def _settle(max_in_flight: int | None, location: str | None) -> None:
    """Wait until fewer than ``max_in_flight`` saves are in flight (all of them: None) and none
    to ``location``; move the failed ones to ``_unobserved``."""
    while True:
        with _lock:
            for s in [s for s in _in_flight if s.done()]:
                _in_flight.remove(s)
                if cf.Future.exception(s.committed) is not None:
                    _unobserved.append(s)
            pending = [s for s in _in_flight if max_in_flight is None or s.location == location]
            if max_in_flight is not None and len(_in_flight) >= max_in_flight:
                pending.append(_in_flight[0])
            if not pending:
                return
        cf.wait([pending[0].committed])


def before_save(location: str, *, max_in_flight: int | None) -> None:
    """Called by every save before it starts: waits for the saves it must follow (every one for a
    synchronous save, ``max_in_flight``; always an earlier save to the same ``location``), then
    raises the error of a failed save nobody observed, if any (once)."""
    _settle(max_in_flight, location)
    with _lock:
        failed = [s for s in _unobserved if not getattr(s.committed, "observed", True)]
        _unobserved.clear()
    if failed:
        s = failed[0]
        e = cf.Future.exception(s.committed)
        for s2 in failed:
            s2.committed.observed = True  # type: ignore[attr-defined]
        log.error("shardsafe: the background save to %s failed; raising its error from the next save", s.location)
        assert e is not None
        message = f"an earlier async save to {s.location} failed, so this save did not start: {e}"
        if isinstance(e, CheckpointError):
            raise type(e)(message, rank_errors=e.rank_errors) from e
        raise CheckpointError(message) from e


def wait_for_location(location: str) -> None:
    """Wait for every save in flight to ``location`` (a load must see what a save committed)."""
    with _lock:
        pending = [s for s in _in_flight if s.location == location]
    cf.wait([s.committed for s in pending])


def run_in_background(location: str, produce: Callable[[], None], consume: Callable[[], T], *, name: str) -> AsyncSave[T]:
    """Start ``consume`` in a new thread (it begins once the previous background save finished),
    then run ``produce`` (the staging) in the caller's thread and return. ``consume`` must end,
    with an error, if ``produce`` fails: the two share a queue that ``produce``'s caller closes.
    An error of ``produce`` is raised here too (and ``staged`` fails with it)."""
    global _last_thread
    staged: cf.Future[None] = cf.Future()
    committed = _Outcome()
    handle: AsyncSave[T] = AsyncSave(location, staged, committed)
    with _lock:
        previous = _last_thread

    def body() -> None:
        if previous is not None:
            previous.join()
        try:
            result = consume()
        except BaseException as e:  # noqa: BLE001 - kept in the future, raised by wait() and the next save
            committed.set_exception(e)
        else:
            committed.set_result(result)

    thread = threading.Thread(target=body, name=name, daemon=False)
    with _lock:
        _in_flight.append(handle)
        _last_thread = thread
    thread.start()
    try:
        produce()
    except BaseException as e:
        staged.set_exception(e)
        committed.observed = True  # raised to the caller right here: the next save need not raise it again
        raise
    staged.set_result(None)
    return handle


def after_in_flight(fn: Callable[[], None], *, name: str) -> None:
    """Run ``fn`` in a thread of its own once the background saves started before have finished,
    in order with them (the next save's thread waits for it too); for a save abandoned before it
    reached the background, whose other ranks wait for its check-in."""
    global _last_thread
    with _lock:
        previous = _last_thread

        def body() -> None:
            if previous is not None:
                previous.join()
            fn()

        thread = threading.Thread(target=body, name=name, daemon=False)
        _last_thread = thread
        thread.start()


def _announce_exit_wait() -> None:
    """Runs as the interpreter starts to exit, before it joins the save threads: say why it waits."""
    with _lock:
        pending = [s.location for s in _in_flight if not s.done()]
    if pending:
        log.warning("shardsafe: waiting for %d async save(s) in flight before exiting: %s", len(pending), ", ".join(pending))


if hasattr(threading, "_register_atexit"):  # runs before non-daemon threads are joined (Python >= 3.9)
    threading._register_atexit(_announce_exit_wait)  # type: ignore[attr-defined]


@atexit.register
def _report_at_exit() -> None:
    """Non-daemon threads were joined before this runs: every save has finished. Say which
    failed without anyone seeing it."""
    with _lock:
        lost = [s for s in [*_in_flight, *_unobserved] if s.done() and not getattr(s.committed, "observed", True)
                and cf.Future.exception(s.committed) is not None]
    for s in lost:
        log.error("shardsafe: the async save to %s failed and its error was never observed: %s", s.location,
                  cf.Future.exception(s.committed))
