"""Checkpoint config and the base exception, as in ``megatron.core.dist_checkpointing.core``.

Megatron-Core keeps a ``metadata.json`` of four fields (``sharded_backend``,
``sharded_backend_version``, ``common_backend``, ``common_backend_version``) in every checkpoint
directory; shardsafe's commit record has the same name and other fields. :func:`maybe_load_config`
tells them apart: for a shardsafe checkpoint it returns the config shardsafe.megatron saved with
it (``sharded_backend="shardsafe"``), for one Megatron-Core wrote it returns Megatron's own.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from os import PathLike, fspath
from pathlib import Path
from typing import Any, TypeVar

from ..engine.bounds import read_limited
from ..errors import CheckpointError, IncompleteCheckpointError
from ..format import strict_json
from ..storage import Location, Storage, open_storage

__all__ = [
    "location",
    "CONFIG_FNAME",
    "CheckpointingConfig",
    "CheckpointingException",
    "NotADistributedCheckpointError",
    "check_is_distributed_checkpoint",
    "maybe_load_config",
    "save_config",
]

CONFIG_FNAME = "metadata.json"
SHARDSAFE_BACKEND = "shardsafe"
"""``sharded_backend`` of a checkpoint saved through :mod:`shardsafe.megatron`."""
CONFIG_KEY = "megatron:config"
"""The value (in ``metadata.json``'s ``objects``) holding the :class:`CheckpointingConfig` of a
checkpoint saved through :mod:`shardsafe.megatron`."""


class CheckpointingException(CheckpointError):
    """Base checkpointing exception of :mod:`shardsafe.megatron` (Megatron-Core's name), a
    :class:`shardsafe.CheckpointError` like every error shardsafe raises."""


class NotADistributedCheckpointError(CheckpointingException, IncompleteCheckpointError):
    """The directory holds no committed checkpoint (no ``metadata.json``)."""


_AS_MEGATRON: dict[type, type] = {NotADistributedCheckpointError: NotADistributedCheckpointError}


def as_checkpointing_exception(e: CheckpointError) -> CheckpointingException:
    """``e`` as a :class:`CheckpointingException` that is still an instance of ``e``'s class, with
    its message and per-rank causes: Megatron's ``except CheckpointingException`` catches it, and
    ``except ShapeMismatchError`` (or any shardsafe cause) still does too. Its class is named
    ``<cause>`` (e.g. ``ShapeMismatchError``) and derives from both."""
    if isinstance(e, CheckpointingException):
        return e
    cause = type(e)
    cls = _AS_MEGATRON.get(cause)
    if cls is None:
        cls = type(cause.__name__, (CheckpointingException, cause), {"__module__": __name__, "__qualname__": cause.__name__, "__doc__": cause.__doc__})
        _AS_MEGATRON[cause] = cls
    out = cls.__new__(cls)
    out.args = e.args
    out.__dict__.update(e.__dict__)
    return out


F = TypeVar("F", bound=Callable[..., Any])


def megatron_errors(fn: F) -> F:
    """Make every :class:`shardsafe.CheckpointError` out of ``fn`` a :class:`CheckpointingException`
    (see :func:`as_checkpointing_exception`): put on the public entry points of ``shardsafe.megatron``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CheckpointingException:
            raise
        except CheckpointError as e:
            raise as_checkpointing_exception(e) from e

    return wrapper  # type: ignore[return-value]


@dataclass
class CheckpointingConfig:
    """The backends a checkpoint was written with: ``sharded_backend`` for the sharded tensors
    and objects, ``common_backend`` for the rest. Versions are those of the format, not of the
    checkpoint's content."""

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1


_FIELDS = ("sharded_backend", "sharded_backend_version", "common_backend", "common_backend_version")


def config_from_document(doc: Any) -> CheckpointingConfig | None:
    """The config a parsed ``metadata.json`` describes, or None when it describes none.

    Megatron-Core's document is the config itself. shardsafe's has ``format_version``; the
    config is in its ``objects`` when saved through :mod:`shardsafe.megatron`, else it is
    ``shardsafe`` version 1 (any shardsafe checkpoint loads through :mod:`shardsafe.megatron`).
    """
    if not isinstance(doc, dict):
        return None
    if "format_version" in doc:
        objects = doc.get("objects")
        stored = objects.get(CONFIG_KEY) if isinstance(objects, dict) else None
        if isinstance(stored, dict) and _valid(stored):
            return CheckpointingConfig(**{k: stored[k] for k in _FIELDS if k in stored})
        return CheckpointingConfig(SHARDSAFE_BACKEND, 1, SHARDSAFE_BACKEND, 1)
    if _valid(doc) and set(doc) <= set(_FIELDS):
        return CheckpointingConfig(**doc)
    return None


def _valid(d: dict) -> bool:
    return (
        isinstance(d.get("sharded_backend"), str)
        and all(type(d.get(k, 1)) is int for k in ("sharded_backend_version", "common_backend_version"))
        and isinstance(d.get("common_backend", ""), str)
    )


def maybe_load_config(checkpoint_dir: Location) -> CheckpointingConfig | None:
    """The checkpoint's config if ``checkpoint_dir`` holds a distributed checkpoint (shardsafe's
    or Megatron-Core's), else None. Reads ``metadata.json`` only; needs no process group."""
    if not checkpoint_dir:
        return None
    with opened(checkpoint_dir) as storage:
        try:
            raw = read_limited(storage, CONFIG_FNAME)
        except FileNotFoundError:
            return None
    try:
        doc = strict_json.loads(raw)
    except ValueError:  # not JSON, or nested too deep: no config
        return None
    return config_from_document(doc)


def check_is_distributed_checkpoint(checkpoint_dir: Location) -> bool:
    """True if ``checkpoint_dir`` holds a ``metadata.json`` that :func:`maybe_load_config` reads."""
    return maybe_load_config(checkpoint_dir) is not None


def save_config(config: CheckpointingConfig, checkpoint_dir: Location) -> None:
    """Write ``config`` as Megatron-Core's ``metadata.json`` in ``checkpoint_dir``.

    Refused where a shardsafe checkpoint is committed: its ``metadata.json`` is the commit
    record (shardsafe.megatron's saves store their config inside it).
    """
    if not isinstance(config, CheckpointingConfig):
        raise TypeError(f"save_config: argument 'config' must be a CheckpointingConfig, got {type(config).__name__}")
    with opened(checkpoint_dir) as storage:
        try:
            raw = storage.read(CONFIG_FNAME)
        except FileNotFoundError:
            raw = None
        if raw is not None and b'"format_version"' in raw:
            raise CheckpointingException(
                f"{storage.url}: {CONFIG_FNAME} there is the commit record of a shardsafe checkpoint; writing Megatron's "
                "config over it would make the checkpoint unreadable (shardsafe.megatron keeps the config inside it)"
            )
        storage.put_atomic(CONFIG_FNAME, json.dumps(asdict(config)).encode(), overwrite=raw is not None)


@contextmanager
def opened(location: Location) -> Iterator[Storage]:
    """The storage of ``location``, closed on exit if this call opened it."""
    storage = open_storage(location)
    try:
        yield storage
    finally:
        if storage is not location:
            storage.close()


def location(checkpoint_dir: str | Path | Storage) -> str | Storage:
    """Where the engine finds the checkpoint: a path or URL as a string, or an opened
    :class:`~shardsafe.storage.Storage` as it is."""
    return checkpoint_dir if not isinstance(checkpoint_dir, (str, PathLike)) else fspath(checkpoint_dir)
