"""Background saves: the handle an ``async_save`` returns, and the queue of saves in flight.

(Skeleton: the API is final; the staging and background writer land next.)
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["AsyncSave"]

T = TypeVar("T")


class AsyncSave(Generic[T]):
    """A save that goes on in the background.

    ``staged`` completes once the state was copied (the caller may change every tensor from
    then on: ``async_save`` returns only after that); ``committed`` completes with what the
    synchronous call returns once the checkpoint is committed, or with the save's
    ``CheckpointError``. ``location`` is the checkpoint's URL or path.
    """

    def __init__(self, location: str, staged: cf.Future[None], committed: cf.Future[T]) -> None:
        self.location = location
        self.staged = staged
        self.committed = committed

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self.committed.done()

    def wait(self, timeout: float | None = None) -> T:
        """Wait until the save committed and return what the synchronous call returns; raise
        the save's error (the same ``CheckpointError`` on every rank), or ``TimeoutError``
        after ``timeout`` seconds (the save goes on)."""
        return self.committed.result(timeout)

    def __repr__(self) -> str:
        state = "committed" if self.committed.done() and self.committed.exception() is None else (
            "failed" if self.committed.done() else "in flight")
        return f"AsyncSave({self.location!r}, {state})"


def completed(location: str, fn: Callable[[], T]) -> AsyncSave[T]:
    """An ``AsyncSave`` of ``fn`` run now, in the caller's thread (the skeleton's path)."""
    staged: cf.Future[None] = cf.Future()
    committed: cf.Future[T] = cf.Future()
    result = fn()
    staged.set_result(None)
    committed.set_result(result)
    return AsyncSave(location, staged, committed)
