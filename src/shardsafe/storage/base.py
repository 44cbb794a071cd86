"""The storage interface: bytes in and out of one checkpoint location, nothing about tensors.

A ``Storage`` is bound to one checkpoint root (a directory, or a prefix in a store) and takes
plain file names relative to it; a name with a directory part, ``..`` or an absolute path is
refused, so nothing is ever written or read outside the root. Paths are ``str``, because
``pathlib`` mangles URLs such as ``s3://``.

Call order for a save: the coordinator ``list``s the root and ``read_versioned``s
``metadata.json`` (the version it will replace, if any); every rank ``write_file``s its data
file (durable when the context exits without error); then the coordinator ``put_atomic``s
``metadata.json`` with ``if_match`` set to the version it read, which is the commit: a
compare-and-swap, so of two saves racing to one location at most one commits.
"""

from __future__ import annotations

import os
import re
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from ..errors import CorruptCheckpointError, StorageError

__all__ = ["STORAGE_METHODS", "URL_SCHEME", "Directory", "Location", "Storage", "Writer", "check_local_path", "check_name", "too_large", "url_scheme"]


class Writer(Protocol):
    def write(self, data: memoryview) -> None:
        """Append ``data``; the whole of it is written before this returns."""


class Storage(Protocol):
    url: str
    """Where the files are, for messages (a path or a URL)."""
    local_root: str | None
    """The local directory holding the files, when a read is a copy out of the page cache or off a
    local disk (CPU work, which readers size their threads and steps for, and which a reader of
    another format may open or map directly); None for object stores and memory."""
    coalesce_gap_bytes: int | None
    """The most bytes a reader should read over to join two ranges into one request, where the
    backend asks for fewer than the reader's own knob (object stores bill bytes); None: no limit
    of its own."""

    def write_file(self, name: str) -> AbstractContextManager[Writer]:
        """Stream a new file. On normal exit it is durable (fsynced); on error it is removed."""

    def put_atomic(self, name: str, data: bytes, *, overwrite: bool, if_match: str | None = None) -> None:
        """Write a small file all at once, atomically: readers see the old or the new, never a mix.

        With ``overwrite=False`` an existing file is left alone and ``FileExistsError`` raised.
        With ``if_match`` (and ``overwrite=True``) the file is replaced only if it still is the
        version ``read_versioned`` returned as ``if_match``; if another writer replaced or removed
        it in the meantime, nothing is written and ``FileExistsError`` is raised. The check and
        the replacement are one atomic step against other writers using ``if_match`` or
        ``overwrite=False`` (backends document where that holds only on one host).
        """

    def read_into(self, name: str, offset: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` in order with the bytes starting at ``offset``.

        Raises ``CorruptCheckpointError`` if the file ends first, ``StorageError`` on I/O error.
        """

    def read_spans_into(self, name: str, spans: list[tuple[int, memoryview]]) -> None:
        """Fill each buffer with the bytes of the file at its offset, none merged; an object store
        fetches them concurrently (many small reads of one file, such as a strided box's rows).
        Errors as for ``read_into``."""

    def read(self, name: str, *, limit: int | None = None) -> bytes:
        """The whole file; ``FileNotFoundError`` if it does not exist. With ``limit``, a file that
        holds more than ``limit`` bytes raises ``CorruptCheckpointError`` (naming it, its size and
        the limit) before its bytes are read: its size is known from the open file (a stat) or the
        object's GET response, so the bound costs no extra request."""

    def read_versioned(self, name: str) -> tuple[bytes, str]:
        """The whole file and an opaque token of this version of it, for ``put_atomic(if_match=)``;
        ``FileNotFoundError`` if it does not exist. Tokens of different versions differ."""

    def list(self) -> list[str]:
        """Names of the files at the root (empty if the root does not exist)."""

    def delete(self, name: str) -> None:
        """Remove a file; a missing file is not an error."""

    def close(self) -> None:
        """Release open handles (a reader releases those its reads opened when it is done); the
        storage may be used again afterwards."""


@runtime_checkable
class Directory(Storage, Protocol):
    """A storage whose root holds checkpoints in sub-directories (object-store prefixes), as
    ``shardsafe.CheckpointManager`` keeps its steps. Every backend of this package is one."""

    def list_dirs(self) -> list[str]:
        """Names of the sub-directories directly under the root (empty if the root does not exist)."""

    def child(self, name: str) -> Storage:
        """The storage of sub-directory ``name`` (a plain name), opened with this one's options."""

    def remove_dir(self, name: str) -> None:
        """Remove sub-directory ``name`` once its files are deleted (an object store has no
        directories: nothing to do); a missing one is not an error, one still holding files is a
        ``StorageError`` naming them."""


URL_SCHEME = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*)://(.*)", re.DOTALL)  # fullmatch: a trailing newline is part of the path
_ONE_SLASH_URL = re.compile(r"^([a-z][a-z0-9+.-]*):/", re.IGNORECASE)  # "s3:/bucket": a URL missing a slash
STORAGE_METHODS = ("write_file", "put_atomic", "read_into", "read_spans_into", "read", "list", "delete", "close")


def url_scheme(location: str) -> str | None:
    """The lowercased scheme of a ``scheme://...`` URL, or None for a plain path."""
    m = URL_SCHEME.fullmatch(location)
    return m.group(1).lower() if m else None


def check_local_path(path: str) -> str:
    """``path``, unless it looks like a URL with one slash (``s3:/bucket/x``), which would
    silently become a local ``s3:`` directory: ``StorageError`` suggesting the ``scheme://`` form."""
    url_like = _ONE_SLASH_URL.match(path)
    if url_like and not (len(url_like.group(1)) == 1 and os.name == "nt"):  # C:/ is a Windows drive
        scheme, rest = url_like.group(1), path[url_like.end() - 1 :]  # rest keeps its leading "/"
        fixed = f"{scheme}://{rest if scheme.lower() == 'file' else rest.lstrip('/')}"
        raise StorageError(
            f"{path}: looks like a URL with one slash after '{url_like.group(1)}:'; did you mean {fixed!r}? "
            f"(a local path whose first part ends in a colon: write it as './{path}' or 'file://{os.path.abspath(path)}')"
        )
    return path


DCP_METADATA = ".metadata"
"""torch.distributed.checkpoint's metadata file: the one name starting with a dot that is allowed
(``shardsafe.dcp`` reads DCP checkpoints)."""


def too_large(where: str, size: int | str, limit: int) -> CorruptCheckpointError:
    """The error of ``Storage.read(..., limit=)`` for a file of ``size`` bytes at ``where``."""
    return CorruptCheckpointError(
        f"{where}: holds {size} bytes, more than the {limit} such a file may hold; refusing to read it"
    )


def check_name(name: str) -> str:
    if not name or "/" in name or "\\" in name or name in (".", "..") or (name.startswith(".") and name != DCP_METADATA):
        raise StorageError(f"refusing file name {name!r}: only plain names inside the checkpoint root are allowed")
    return name


Location = str | os.PathLike[str] | Storage
"""Where a checkpoint lives: a path, a URL, or a ``Storage`` opened with options."""
