"""The only module that calls ``torch.distributed``.

A :class:`Comm` is either the default process group or a single process (``no_dist=True``,
world size 1, or no process group at all). Its collectives carry a value *or* an exception,
so that when one rank fails every rank raises the same gathered error instead of the others
waiting forever in the next collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from .errors import CheckpointError

__all__ = ["Comm", "Failed", "get_comm", "raise_failures"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Failed:
    """A rank's exception, as sent through a collective."""

    error: BaseException


def _capture(fn: Callable[[], T]) -> T | Failed:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - sent to every rank and re-raised there
        return Failed(e)


def raise_failures(results: list[Any], *, rank: int) -> None:
    """Raise one error if any rank's result is a :class:`Failed`.

    The local rank's own exception is re-raised as is (with its traceback); other ranks raise an
    error of the first failing rank's class (when it is a ``CheckpointError``) whose message names
    every failing rank, and whose ``rank_errors`` maps rank to message.
    """
    failures = {r: f.error for r, f in enumerate(results) if isinstance(f, Failed)}
    if not failures:
        return
    mine = failures.get(rank)
    if mine is not None and len(failures) == 1:
        raise mine
    by_rank = {r: f"{type(e).__name__}: {e}" for r, e in failures.items()}
    first = failures[min(failures)]
    cls = type(first) if isinstance(first, CheckpointError) else CheckpointError
    detail = "; ".join(f"rank {r}: {m}" for r, m in by_rank.items())
    err = cls(f"{len(failures)} rank(s) failed: {detail}", rank_errors=by_rank)
    raise err from mine


class Comm:
    """Collectives over the default process group, or trivial ones for a single process."""

    def __init__(self, distributed: bool) -> None:
        self.distributed = distributed
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def gather(self, fn: Callable[[], T]) -> list[T | Failed] | None:
        """Run ``fn`` on every rank; the coordinator gets every result (others: None)."""
        value = _capture(fn)
        if not self.distributed:
            return [value]
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(value, out, dst=0)
        return out

    def all_gather(self, fn: Callable[[], T]) -> list[T | Failed]:
        value = _capture(fn)
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def scatter(self, fn: Callable[[], list[T]]) -> T:
        """The coordinator computes one value per rank; each rank gets its own, or the error."""
        values: list[Any] | Failed | None = None
        if self.is_coordinator:
            values = _capture(fn)
            if isinstance(values, Failed):
                values = [values] * self.world_size
        if not self.distributed:
            got = values[0]  # type: ignore[index]
        else:
            out: list[Any] = [None]
            dist.scatter_object_list(out, values, src=0)
            got = out[0]
        if isinstance(got, Failed):
            raise got.error
        return got

    def broadcast(self, fn: Callable[[], T]) -> T:
        """The coordinator computes a value; every rank gets it, or raises its error."""
        value: Any = _capture(fn) if self.is_coordinator else None
        if self.distributed:
            box = [value]
            dist.broadcast_object_list(box, src=0)
            value = box[0]
        if isinstance(value, Failed):
            raise value.error
        return value

    def check(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank; if any rank fails, every rank raises."""
        results = self.all_gather(fn)
        raise_failures(results, rank=self.rank)
        return results[self.rank]  # type: ignore[return-value]


def get_comm(no_dist: bool = False) -> Comm:
    return Comm(not no_dist and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
