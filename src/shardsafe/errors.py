"""The one exception hierarchy of shardsafe.

Every error that bad input, a damaged checkpoint or a failing store can cause is a
:class:`CheckpointError`. Subclasses name the cause, and where a builtin exception fits they
are that builtin too (``MissingKeyError`` is a ``KeyError``), so existing ``except`` clauses
keep working. Messages name the key, the file, what was expected and what was found.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CollectiveError",
    "CorruptCheckpointError",
    "DtypeMismatchError",
    "ForeignCheckpointError",
    "IncompleteCheckpointError",
    "MissingKeyError",
    "MissingRanksError",
    "PickleNotAllowedError",
    "RankMismatchError",
    "ShapeMismatchError",
    "ShardingError",
    "StorageError",
    "UnsafePickleError",
]


class CheckpointError(Exception):
    """Base of every error shardsafe raises on purpose.

    ``rank_errors`` maps rank to message when the error was gathered from several ranks of a
    distributed save or load; it is empty for an error raised locally.
    """

    def __init__(self, message: str, *, rank_errors: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.rank_errors: dict[int, str] = dict(rank_errors or {})

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):  # keep the keyword argument through pickling (gathers across ranks)
        return (_rebuild, (type(self), str(self), self.rank_errors))


def _rebuild(cls: type[CheckpointError], message: str, rank_errors: dict[int, str]) -> CheckpointError:
    return cls(message, rank_errors=rank_errors)


class IncompleteCheckpointError(CheckpointError, FileNotFoundError):
    """The location holds no committed checkpoint (``metadata.json`` is missing)."""


class ForeignCheckpointError(CheckpointError, ValueError):
    """The location holds another library's checkpoint, not a shardsafe one: torch.distributed.checkpoint
    (``.metadata``, ``*.distcp``), a Hugging Face safetensors model, or Megatron's (an ``iter_*``
    folder, whose ``metadata.json`` is a config of backends, or a run's root); the message names
    the format and the function or command that converts or loads it."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint is already there and ``save_overwrite`` was not set."""


class CorruptCheckpointError(CheckpointError):
    """Stored bytes or metadata are damaged: bad checksum, truncated file, invalid metadata."""


class UnsafePickleError(CorruptCheckpointError):
    """A pickle in a checkpoint (torch.distributed.checkpoint's ``.metadata``) names a class or
    function outside the allowlist of what such a file holds; nothing of it was run."""


class MissingKeyError(CheckpointError, KeyError):
    """A requested key is not in the checkpoint."""


class ShapeMismatchError(CheckpointError, ValueError):
    """A global shape differs between the checkpoint and the target, or between ranks."""


class DtypeMismatchError(CheckpointError, TypeError):
    """A dtype differs between the checkpoint and the target, or between ranks."""


class ShardingError(CheckpointError, ValueError):
    """The pieces of a tensor do not tile it (gap or overlap), or a placement is unsupported."""


class PickleNotAllowedError(CheckpointError, TypeError):
    """A value needs pickle and the caller did not opt in with ``allow_pickle=True``."""


class StorageError(CheckpointError, OSError):
    """The storage backend failed: permission, missing bucket, I/O error, bad URL."""


class CollectiveError(CheckpointError):
    """Ranks could not complete a step of a save or load together: a rank of the process group
    died or lost its connection, or the process group failed."""


class MissingRanksError(CollectiveError, TimeoutError):
    """Some ranks of the process group did not call a collective save, load or unshard within
    ``knobs.collective_timeout_s`` (every rank of the group must call it, together)."""


class RankMismatchError(CheckpointError, ValueError):
    """Ranks passed arguments to one collective call that must be the same on every rank
    (for example, different directories to one save)."""
