"""Layout of one data file: a valid safetensors file whose entries are stored chunks.

safetensors: 8-byte little-endian header length N, N bytes of JSON header, then the raw
little-endian bytes of every entry back to back. The header is padded with spaces so the data
section starts at a multiple of 8 bytes, as the official writer does. Because every chunk's
size is known before any byte is written, the header is written first and chunks are streamed
after it; the layout is a pure function of the entry list, so the planner (which records byte
offsets in the metadata) and the writer agree without talking.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from . import strict_json

__all__ = ["MAX_HEADER", "FileEntry", "FileLayout", "layout_file", "parse_header"]

_ALIGN = 8
MAX_HEADER = 100_000_000
"""safetensors' own limit on a file's JSON header, which every reader of a header enforces."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    name: str
    dtype_code: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class FileLayout:
    header: bytes  # the 8 length bytes and the padded JSON
    byte_ranges: tuple[tuple[int, int], ...]  # absolute [start, end) of each entry, in entry order

    @property
    def size(self) -> int:
        return self.byte_ranges[-1][1] if self.byte_ranges else len(self.header)


def layout_file(entries: list[FileEntry], file_metadata: dict[str, str]) -> FileLayout:
    """Header bytes and absolute byte range of each entry, entries stored in the given order."""
    header: dict[str, object] = {"__metadata__": file_metadata}
    offset = 0
    for e in entries:
        if e.name in header:
            raise ValueError(f"duplicate or reserved entry name {e.name!r} in one safetensors file")
        header[e.name] = {"dtype": e.dtype_code, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    head = struct.pack("<Q", len(raw)) + raw
    base = len(head)
    ranges = []
    for e in entries:
        ranges.append((base, base + e.nbytes))
        base += e.nbytes
    return FileLayout(head, tuple(ranges))


def parse_header(prefix: bytes) -> tuple[int, dict[str, object]]:
    """Parse a safetensors header from the file's first bytes.

    Returns (data section start, header dict). Raises ``ValueError`` when ``prefix`` is not a
    complete, valid header; callers turn that into a ``CorruptCheckpointError`` naming the file.
    """
    if len(prefix) < 8:
        raise ValueError(f"file too short for a safetensors header ({len(prefix)} bytes)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if len(prefix) < 8 + n:
        raise ValueError(f"header says {n} bytes, only {len(prefix) - 8} present")
    header = strict_json.loads(prefix[8 : 8 + n])
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    if strict_json.nesting_exceeds(header, strict_json.MAX_DEPTH):
        raise ValueError(f"safetensors header nests arrays and objects deeper than {strict_json.MAX_DEPTH} levels")
    return 8 + n, header
