"""Sizes come from ``metadata.json``, which may be damaged or hostile: before memory is allocated
for whole tensors, prove that the data files hold the bytes the metadata claims.

Metadata validation (:meth:`~shardsafe.format.metadata.StorageMetadata.from_json`) already bounds
every size below 2**62 and refuses chunks of one file that share bytes, so the chunks of a file
are never more bytes than the file's length; reading the last byte each file must hold then
bounds the memory to allocate by the bytes actually stored.
"""

from __future__ import annotations

import io
from collections.abc import Iterable

from ..errors import CorruptCheckpointError
from ..format.metadata import TensorStorageMetadata
from ..format.safetensors_file import MAX_HEADER
from ..storage import Storage

__all__ = ["MAX_JSON_BYTES", "StoredFile", "check_files_hold", "read_header_prefix", "read_limited", "read_range"]


def check_files_hold(storage: Storage, tensors: Iterable[tuple[str, TensorStorageMetadata]]) -> None:
    """Raise ``CorruptCheckpointError`` (truncated, or missing) unless every data file that holds
    chunks of ``tensors`` (key, metadata) is as long as their byte ranges say. One 1-byte read
    per file."""
    ends: dict[str, tuple[int, str]] = {}  # file -> (end of its last chunk, key of that chunk)
    for key, tm in tensors:
        for file, spec in tm.chunks():
            if spec.byte_range[1] > max(ends.get(file, (0, ""))[0], spec.byte_range[0]):
                ends[file] = (spec.byte_range[1], key)
    probe = memoryview(bytearray(1))
    for file, (end, key) in sorted(ends.items()):
        try:
            storage.read_into(file, end - 1, [probe])
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"key {key!r}: {e} (its chunks in that file end at byte {end})") from None


_PROBE_ABOVE = 1 << 20


def read_range(storage: Storage, file: str, offset: int, length: int) -> bytearray:
    """Bytes ``[offset, offset + length)`` of ``file``, where both numbers come from foreign
    metadata (a DCP ``.metadata``, a safetensors header): the file's last byte of the range is
    read first, so a length the file does not hold raises ``CorruptCheckpointError``
    (truncated) before the buffer is allocated; memory is then bounded by the bytes the file
    really holds (plus at most 1 MiB)."""
    if length > _PROBE_ABOVE:  # (a smaller buffer is the constant a read may cost before the file says no)
        storage.read_into(file, offset + length - 1, [memoryview(bytearray(1))])
    buf = bytearray(length)
    if length:
        storage.read_into(file, offset, [memoryview(buf)])
    return buf


def read_header_prefix(storage: Storage, file: str, file_size: int | None = None) -> bytearray:
    """The first ``8 + n`` bytes of safetensors ``file``: its header length ``n`` and its JSON
    header, for :func:`~shardsafe.format.safetensors_file.parse_header`. A length above
    safetensors' own limit, or past ``file_size`` (the size our metadata records, if known),
    raises ``ValueError`` saying which, before anything is allocated; a file too short for its
    header raises ``CorruptCheckpointError`` (truncated), as :func:`read_range`."""
    head = bytearray(8)
    storage.read_into(file, 0, [memoryview(head)])
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER:
        raise ValueError(f"header length {n} exceeds the {MAX_HEADER}-byte limit safetensors allows")
    if file_size is not None and 8 + n > file_size:
        raise ValueError(f"header length {n} runs past the file's size in the metadata ({file_size} bytes)")
    return read_range(storage, file, 0, 8 + n)


class StoredFile(io.RawIOBase):
    """A file of ``storage`` as a read-only, seekable file object, for readers that take one
    (an unpickler, ``torch.load``): bytes are fetched when asked for, in pieces of at most
    ``piece`` bytes, so memory follows what the reader uses, never the file's size (a file grown
    sparse to a terabyte costs what its reader looks at). The size is found by probing single
    bytes (about 2 log2(size) reads), only when the reader seeks from the end or reads to it."""

    def __init__(self, storage: Storage, name: str, *, piece: int = 1 << 20) -> None:
        super().__init__()
        self.storage, self.name, self.piece = storage, name, piece
        self.pos = 0
        self._size: int | None = None
        self._window = (0, b"")  # (start, bytes): the last piece fetched

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size() if whence == 2 else 0}[whence]
        if base + offset < 0:
            raise OSError(f"{self.name}: seek to {base + offset}")
        self.pos = base + offset
        return self.pos

    def _holds(self, n: int) -> bool:
        """Whether the file holds at least ``n`` bytes."""
        if n == 0:
            return True
        try:
            self.storage.read_into(self.name, n - 1, [memoryview(bytearray(1))])
        except CorruptCheckpointError as e:
            if "truncated" not in str(e):  # a link, a missing file: not a question of size
                raise
            return False
        return True

    def size(self) -> int:
        if self._size is None:
            hi = 1
            while self._holds(hi):
                hi *= 2
            lo = hi // 2  # holds lo bytes, not hi
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if self._holds(mid) else (lo, mid)
            self._size = lo if hi > 1 or self._holds(1) else 0
        return self._size

    def readinto(self, buffer) -> int:
        """Fill ``buffer`` from the current position, wholly unless the file ends first."""
        view = memoryview(buffer).cast("B")
        done = 0
        while done < len(view):
            start, data = self._window
            if not start <= self.pos < start + len(data):
                data = self._fetch(self.pos, self.piece)
                start = self.pos
                self._window = (start, data)
            n = min(len(view) - done, start + len(data) - self.pos)
            if n <= 0:
                break
            view[done : done + n] = data[self.pos - start : self.pos - start + n]
            self.pos += n
            done += n
        return done

    def _fetch(self, at: int, n: int) -> bytes:
        if self._size is None and self._holds(at + n):
            out = bytearray(n)
            self.storage.read_into(self.name, at, [memoryview(out)])
            return bytes(out)
        n = max(min(n, self.size() - at), 0)
        out = bytearray(n)
        if n:
            self.storage.read_into(self.name, at, [memoryview(out)])
        return bytes(out)

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = max(self.size() - self.pos, 0)
        parts = []
        while n > 0:  # grows with the bytes there, never allocates ``n`` at once
            chunk = bytearray(min(n, self.piece))
            got = self.readinto(chunk)
            if not got:
                break
            parts.append(bytes(chunk[:got]))
            n -= got
        return b"".join(parts)

    def readall(self) -> bytes:
        return self.read(-1)


MAX_JSON_BYTES = 1 << 30
"""The largest JSON file read whole (``metadata.json``, Megatron's, a Hugging Face index): far
above any real one, far below a file grown sparse to claim a terabyte."""


def read_limited(storage: Storage, name: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """The whole of ``name`` (``FileNotFoundError`` if missing), unless it holds more than
    ``limit`` bytes: ``CorruptCheckpointError`` then, before its bytes are read
    (``Storage.read(limit=)``: a stat on disk, the GET response's size from an object store)."""
    return storage.read(name, limit=limit)
