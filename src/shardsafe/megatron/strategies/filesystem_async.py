"""Megatron-Core's ``strategies.filesystem_async`` names.

Megatron-Core's asynchronous ``torch_dist`` saves write through DCP's ``FileSystemWriterAsync``
in worker processes that report through ``_results_queue``. shardsafe's saves (sync and async,
``save(..., async_sharded_save=True)``) write through its own engine, in a background thread of
the training process, so there is no such writer and no results queue: ``_results_queue`` stays
None (Megatron-LM's ``async_utils`` checks for that) and building a ``FileSystemWriterAsync`` raises.
"""

from __future__ import annotations

from typing import Any

from ..core import CheckpointingException

__all__ = ["FileSystemWriterAsync", "_results_queue"]

_results_queue: Any = None
"""Megatron-Core's queue of worker results; shardsafe has no worker processes, so it is None."""


def _unsupported() -> CheckpointingException:
    return CheckpointingException(
        "FileSystemWriterAsync is megatron-core's DCP writer; shardsafe.megatron writes through its own engine. "
        "For an asynchronous save call shardsafe.megatron.save(..., async_sharded_save=True) and schedule the returned "
        "AsyncRequest on an AsyncCallsQueue"
    )


class FileSystemWriterAsync:
    """Megatron-Core's asynchronous DCP writer: not used by shardsafe; building one raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _unsupported()

    @staticmethod
    def write_preloaded_data(*args: Any, **kwargs: Any) -> Any:
        raise _unsupported()


def _get_write_results_queue() -> Any:
    """None: shardsafe has no writer processes to collect results from."""
    return _results_queue
