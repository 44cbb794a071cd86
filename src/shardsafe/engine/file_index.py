"""Format v3: the data files' own headers, read from the checkpoint's storage as a load needs them.

A v3 ``metadata.json`` leaves each chunk's byte range and checksums to its data file's header
(:mod:`shardsafe.format.file_index` parses and checks them, with no I/O). :func:`bind_files`
gives a parsed document a :class:`Resolver` that reads each file's header and checksum entry once,
when a tensor stored in it is first needed, or ahead of time for many files at once.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from ..errors import CorruptCheckpointError
from ..format.file_index import FileIndex
from ..format.metadata import StorageMetadata
from ..storage import Storage

__all__ = ["Resolver", "bind_files", "read_file_index"]

_PROBE_ABOVE = 1 << 20  # reads longer than this check that the file has their last byte first


def bind_files(meta: StorageMetadata, storage: Storage) -> StorageMetadata:
    """Give ``meta`` (format v3) the data files of ``storage``, the checkpoint it came from, to
    read chunk locations and checksums from as they are needed. Returns ``meta``."""
    if meta.file_table is not None:
        meta.attach_files(Resolver(storage, meta))
    return meta


def read_file_index(storage: Storage, info: object, *, block_bytes: int, algorithm: str) -> FileIndex:
    """Read and check the header and the checksum entry of the data file ``info`` (a row of the
    metadata's ``file_table``) describes."""
    name = info.name  # type: ignore[attr-defined]
    where = f"{storage.url.rstrip('/')}/{name}"
    FileIndex.check_header_size(info, where)
    head = _read(storage, name, 0, info.header_bytes)  # type: ignore[attr-defined]
    entries, begin, end = FileIndex.parse_header(head, info, block_bytes=block_bytes, algorithm=algorithm, where=where)
    return FileIndex.from_parts(name, entries, _read(storage, name, begin, end - begin), info, algorithm=algorithm, where=where)


def _read(storage: Storage, name: str, offset: int, nbytes: int) -> bytearray:
    """Bytes ``[offset, offset + nbytes)`` of file ``name``. The lengths come from metadata and
    headers that may be hostile, so a long read first reads its last byte: a file that does not
    have the bytes fails (``read_into`` raises ``CorruptCheckpointError`` naming it) before
    memory for them is allocated."""
    if nbytes > _PROBE_ABOVE:
        storage.read_into(name, offset + nbytes - 1, [memoryview(bytearray(1))])
    buf = bytearray(nbytes)
    storage.read_into(name, offset, [memoryview(buf)])
    return buf


class Resolver:
    """The :class:`FileIndex` of each v3 data file a caller needs, read once (thread-safe)."""

    def __init__(self, storage: Storage, meta: StorageMetadata) -> None:
        self.storage = storage
        self.meta = meta
        self._files: dict[int, FileIndex] = {}
        self._lock = threading.Lock()

    def file(self, index: int) -> FileIndex:
        got = self._files.get(index)
        if got is None:
            cfg = self.meta.checksum
            assert cfg is not None and self.meta.file_table is not None
            got = read_file_index(self.storage, self.meta.file_table[index], block_bytes=cfg.block_bytes, algorithm=cfg.algorithm)
            with self._lock:
                got = self._files.setdefault(index, got)
        return got

    def prefetch(self, keys: dict[int, str], threads: int) -> None:
        """Read the files ``keys`` names (file index -> a key stored in it, for errors) not read
        yet, ``threads`` at a time."""
        todo = sorted(keys.keys() - self._files.keys())

        def one(i: int) -> FileIndex:
            try:
                return self.file(i)
            except CorruptCheckpointError as e:
                raise type(e)(f"key {keys[i]!r}: {e}") from None

        if len(todo) <= 1 or threads <= 1:
            for i in todo:
                one(i)
            return
        with ThreadPoolExecutor(min(threads, len(todo)), thread_name_prefix="shardsafe-headers") as pool:
            list(pool.map(one, todo))
