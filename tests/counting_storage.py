"""A local checkpoint directory that counts the bytes its readers fetch from data files' chunks."""

from __future__ import annotations

import json
import os
import struct
import threading
from typing import Any

from shardsafe.format.file_index import SUMS_ENTRY
from shardsafe.storage import open_storage

__all__ = ["CountingStorage"]


class CountingStorage:
    """A local checkpoint directory that counts the bytes read from its data files' chunks (not
    their headers and checksum entries, which a reader reads once per file it needs)."""

    local_root = None  # read as a remote store is: each chunk once, exactly, no cache-sized steps over whole blocks

    def __init__(self, path: str) -> None:
        self.path = path
        self.inner = open_storage(path)
        self.data_bytes = 0
        self._lock = threading.Lock()
        self._chunks: dict[str, tuple[int, int]] = {}

    def _chunk_span(self, name: str) -> tuple[int, int]:
        """Where the file's chunks are: after the header, before the checksum entry (a file of
        another checkpoint format, such as DCP's .distcp: all of it; none of a file that holds no
        tensor data, such as DCP's .metadata or Megatron's common.pt, which importers read through
        read_into too)."""
        if name.endswith(".distcp"):
            return 0, 1 << 62
        if not name.endswith(".safetensors"):
            return 0, 0
        if name not in self._chunks:
            with open(os.path.join(self.path, name), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            sums = header.get(SUMS_ENTRY, {"data_offsets": [os.path.getsize(os.path.join(self.path, name)) - 8 - n] * 2})
            self._chunks[name] = (8 + n, 8 + n + sums["data_offsets"][0])
        return self._chunks[name]

    def read_into(self, name: str, offset: int, buffers: list) -> None:
        self.inner.read_into(name, offset, buffers)
        start, end = self._chunk_span(name)
        if start <= offset < end:
            with self._lock:
                self.data_bytes += sum(memoryview(b).nbytes for b in buffers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


