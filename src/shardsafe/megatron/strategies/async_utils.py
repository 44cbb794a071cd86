"""The request an asynchronous save returns, as in ``megatron.core.dist_checkpointing.strategies.async_utils``.

shardsafe's async save already runs in the background once ``save(..., async_sharded_save=True)``
returns (its writes and commit go on in a thread of their own): the request's ``async_fn``
waits for that save to commit, so running the request (:meth:`AsyncRequest.execute_sync`, or a
queue that calls ``async_fn`` and then the ``finalize_fns``) completes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from ..core import CheckpointingException

__all__ = ["AsyncRequest"]


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
            raise CheckpointingException("cannot add a finalize function to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def execute_sync(self) -> None:
        """Complete the request in the caller's thread: ``async_fn``, then every finalize function."""
        if self.preload_fn is not None:
            self.preload_fn()
        if self.async_fn is not None:
            self.async_fn(*self.async_fn_args, **self.async_fn_kwargs)
        for fn in self.finalize_fns:
            fn()

    def freeze(self) -> AsyncRequest:
        """This request, refusing further finalize functions."""
        return self._replace(is_frozen=True)
