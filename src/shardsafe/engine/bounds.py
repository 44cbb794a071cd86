"""Sizes come from ``metadata.json``, which may be damaged or hostile: before memory is allocated
for whole tensors, prove that the data files hold the bytes the metadata claims.

Metadata validation (:meth:`~shardsafe.format.metadata.StorageMetadata.from_json`) already bounds
every size below 2**62 and refuses chunks of one file that share bytes, so the chunks of a file
are never more bytes than the file's length; reading the last byte each file must hold then
bounds the memory to allocate by the bytes actually stored.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import CorruptCheckpointError
from ..format.metadata import TensorStorageMetadata
from ..storage import Storage

__all__ = ["check_files_hold", "read_range"]


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


def read_range(storage: Storage, file: str, offset: int, length: int) -> bytearray:
    """Bytes ``[offset, offset + length)`` of ``file``, where both numbers come from foreign
    metadata (a DCP ``.metadata``, a safetensors header): the file's last byte of the range is
    read first, so a length the file does not hold raises ``CorruptCheckpointError``
    (truncated) before the buffer is allocated; memory is then bounded by the bytes the file
    really holds."""
    if length:
        storage.read_into(file, offset + length - 1, [memoryview(bytearray(1))])
    buf = bytearray(length)
    if length:
        storage.read_into(file, offset, [memoryview(buf)])
    return buf
