"""Format v3: where each chunk's bytes and checksums are, read from its data file's own header.

A v3 ``metadata.json`` says which chunks a tensor has and which file holds each (a
:class:`~.chunk_table.ChunkTable`), but not where in the file, nor the chunk's checksums: those
are per chunk, so at thousands of ranks they would be most of the document that every loading
rank parses. Each data file already starts with a safetensors header that names each entry and
its byte range, and v3 ends each file with one more entry, ``__shardsafe_checksums__``: the
digest of every block of every other entry, in the order of their bytes. A reader reads the
header and that entry of only the files it needs, and checks each against the digests that
``metadata.json`` gives for the file (``header``, ``sums``).
"""

from __future__ import annotations

from math import prod
from typing import Any, Protocol

import numpy as np

from ..errors import CorruptCheckpointError
from .checksum import ALGORITHMS, file_digest
from .safetensors_file import MAX_HEADER, parse_header

__all__ = ["MAX_HEADER", "SUMS_ENTRY", "FileIndex", "FileSource", "entry_name"]

SUMS_ENTRY = "__shardsafe_checksums__"
_RESERVED = ("__metadata__", SUMS_ENTRY)


def entry_name(key: str, shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...], flat: tuple[int, int] | None) -> str:
    """A chunk's entry name in a v3 data file: ``key`` for a whole tensor whose key has no ``@``
    and is not reserved; otherwise ``key@o0,...,ok``, and ``+start`` after it for a flattened
    chunk. Distinct chunks of a valid checkpoint never share a name in a file (the part after
    the last ``@`` is the offsets), so a reader can compute the name of the chunk it needs. A
    flattened range that is the whole box is the box (the chunk table cannot tell them apart)."""
    if flat is not None and flat[0] == 0 and flat[1] == prod(lengths):
        flat = None
    if flat is None and lengths == shape and not any(offsets) and "@" not in key and key not in _RESERVED:
        return key
    name = f"{key}@{','.join(map(str, offsets))}"
    return name if flat is None else f"{name}+{flat[0]}"


class FileIndex:
    """One v3 data file's entries: ``name -> (absolute begin, end, index of its first digest)``,
    and the digests of every block, checked against the metadata."""

    __slots__ = ("digests", "entries", "name")

    def __init__(self, name: str, entries: dict[str, tuple[int, int, int, Any]], digests: np.ndarray) -> None:
        self.name = name
        self.entries = entries  # name -> (begin, end, first digest, the dtype its header gives)
        self.digests = digests

    @staticmethod
    def check_header_size(info: Any, where: str) -> None:
        """The header length ``info`` (a data-file row of the metadata) gives fits the file and
        safetensors' limit: checked before the header is read."""
        if info.header_bytes > min(info.size, 8 + MAX_HEADER):
            raise CorruptCheckpointError(
                f"{where}: metadata.json says the header is {info.header_bytes} bytes, more than the file's {info.size} bytes "
                f"or the {MAX_HEADER}-byte limit of a safetensors header; the metadata is damaged"
            )

    @staticmethod
    def parse_header(
        head: bytes | bytearray, info: Any, *, block_bytes: int, algorithm: str, where: str
    ) -> tuple[dict[str, tuple[int, int, int, Any]], int, int]:
        """Check a data file's header bytes against ``info`` and parse it: ``(entries, begin,
        end)``, with the byte range of the checksum entry still to be read."""
        got = file_digest(head)
        if got != info.header:
            raise CorruptCheckpointError(
                f"{where}: checksum mismatch in the safetensors header: metadata.json says {info.header}, the header hashes "
                f"to {got}; the file is damaged or is not this checkpoint's"
            )
        try:
            start, header = parse_header(bytes(head))
        except ValueError as e:
            raise CorruptCheckpointError(f"{where}: invalid safetensors header: {e}") from None
        if start != info.header_bytes:
            raise CorruptCheckpointError(f"{where}: the header is {start} bytes, metadata.json says {info.header_bytes}")
        spans = []
        for entry, spec in header.items():
            if entry == "__metadata__":
                continue
            offs = spec.get("data_offsets") if isinstance(spec, dict) else None
            if not (isinstance(offs, list) and len(offs) == 2 and all(type(x) is int for x in offs) and 0 <= offs[0] <= offs[1]):
                raise CorruptCheckpointError(f"{where}: entry {entry!r} has no valid data_offsets")
            spans.append((start + offs[0], start + offs[1], entry, spec.get("dtype")))
        spans.sort()
        pos = start
        for begin, end, entry, _ in spans:
            if begin != pos:
                raise CorruptCheckpointError(f"{where}: entry {entry!r} starts at byte {begin}, expected {pos}: entries must be back to back")
            pos = end
        if pos != info.size:
            raise CorruptCheckpointError(f"{where}: the entries end at byte {pos}, the file is {info.size} bytes")
        if not spans or spans[-1][2] != SUMS_ENTRY:
            raise CorruptCheckpointError(f"{where}: the last entry must be {SUMS_ENTRY!r}, the checksums of the others")
        size = ALGORITHMS[algorithm].size
        entries: dict[str, tuple[int, int, int, Any]] = {}
        blocks = 0
        for begin, end, entry, dtype in spans[:-1]:
            entries[entry] = (begin, end, blocks, dtype)
            blocks += -(-(end - begin) // block_bytes)
        s_begin, s_end, _, _ = spans[-1]
        if s_end - s_begin != blocks * size:
            raise CorruptCheckpointError(
                f"{where}: {SUMS_ENTRY!r} holds {s_end - s_begin} bytes, expected {blocks * size} for {blocks} block(s)"
            )
        return entries, s_begin, s_end

    @classmethod
    def from_parts(cls, name: str, entries: dict[str, tuple[int, int, int, Any]], sums: bytes | bytearray, info: Any, *, algorithm: str, where: str) -> FileIndex:
        """The index of a file from its parsed header and the bytes of its checksum entry, checked
        against ``info``."""
        got = file_digest(sums)
        if got != info.sums:
            raise CorruptCheckpointError(
                f"{where}: checksum mismatch in {SUMS_ENTRY!r}: metadata.json says {info.sums}, its bytes hash to {got}; "
                "the file is damaged"
            )
        return cls(name, entries, np.frombuffer(bytes(sums), dtype="<u8" if ALGORITHMS[algorithm].size == 8 else "<u4"))

    def locate(self, entry: str, nbytes: int, *, key: str, dtype: str) -> tuple[int, int, int]:
        """``(begin, end, first digest)`` of ``entry``, which must hold ``nbytes`` bytes of
        ``dtype`` (its safetensors code, as the metadata gives it): every read path finds its
        chunks here, so none returns bytes that the header says are of another dtype."""
        got = self.entries.get(entry)
        if got is None:
            raise CorruptCheckpointError(
                f"{self.name}: tensor {key!r}: metadata.json places a chunk in this file, but it has no entry {entry!r}"
            )
        if got[1] - got[0] != nbytes:
            raise CorruptCheckpointError(
                f"{self.name}: tensor {key!r}: entry {entry!r} holds {got[1] - got[0]} bytes, the chunk needs {nbytes}"
            )
        if got[3] != dtype:
            raise CorruptCheckpointError(
                f"{self.name}: tensor {key!r}: entry {entry!r} holds dtype {str(got[3])[:20]} by the file's header, "
                f"metadata.json says {dtype}; the metadata or the file is damaged, or they are not of one checkpoint"
            )
        return got[:3]


class FileSource(Protocol):
    """Where a v3 metadata document finds its data files' indexes (the engine reads them from the
    checkpoint's storage: :func:`shardsafe.engine.file_index.bind_files`)."""

    def file(self, index: int) -> FileIndex:
        """The index of the file at ``index`` in the metadata's ``file_table``."""
        ...
