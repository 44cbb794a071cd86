"""A read-only storage of whole files held in this process's memory, over a base storage for the
rest: what a restore from peers' memory reads from (the files this node holds are read from its
own memory directory, those received from other nodes from the buffers they arrived in).

Only the reads a loader makes are served; writing or deleting through it is refused.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import CorruptCheckpointError, StorageError
from .base import Storage, check_name, too_large

__all__ = ["HeldFiles"]


class HeldFiles:
    """Files ``add``-ed by name (a bytes-like object each) in front of ``base`` (None: nothing
    else). ``url`` names the location in messages; ``held_bytes`` counts what was added."""

    def __init__(self, url: str, base: Storage | None) -> None:
        self.url = url
        self.base = base
        self.local_root = None  # the reader sizes its steps as for a store: whole requests, no page cache
        self.coalesce_gap_bytes = None
        self.held_bytes = 0
        self._files: dict[str, memoryview] = {}
        self._lock = threading.Lock()

    def add(self, name: str, data: Any) -> None:
        """Hold ``data`` (bytes, a bytearray, a memoryview or a numpy array of bytes) as file ``name``."""
        view = memoryview(data).cast("B")
        with self._lock:
            self._files[check_name(name)] = view
            self.held_bytes += view.nbytes

    def holds(self, name: str) -> bool:
        with self._lock:
            return name in self._files

    def _held(self, name: str) -> memoryview | None:
        with self._lock:
            return self._files.get(check_name(name))

    def read_into(self, name: str, offset: int, buffers: list[memoryview]) -> None:
        data = self._held(name)
        if data is None:
            if self.base is None:
                raise CorruptCheckpointError(f"{self.url}/{name}: data file named in the metadata is missing")
            self.base.read_into(name, offset, buffers)
            return
        pos = offset
        for b in buffers:
            view = memoryview(b).cast("B")
            end = pos + view.nbytes
            if end > data.nbytes:
                raise CorruptCheckpointError(f"{self.url}/{name}: truncated: needed bytes up to {end} but the file has {data.nbytes} bytes")
            view[:] = data[pos:end]
            pos = end

    def read_spans_into(self, name: str, spans: list[tuple[int, memoryview]]) -> None:
        for offset, buf in spans:
            self.read_into(name, offset, [buf])

    def read(self, name: str, *, limit: int | None = None) -> bytes:
        data = self._held(name)
        if data is not None:
            if limit is not None and len(data) > limit:
                raise too_large(f"{self.url}/{name}", len(data), limit)
            return bytes(data)
        if self.base is None:
            raise FileNotFoundError(f"{self.url}/{name}")
        return self.base.read(name, limit=limit)

    def read_versioned(self, name: str) -> tuple[bytes, str]:
        data = self._held(name)
        if data is not None:
            return bytes(data), "held"
        if self.base is None:
            raise FileNotFoundError(f"{self.url}/{name}")
        return self.base.read_versioned(name)

    def list(self) -> list[str]:
        with self._lock:
            names = set(self._files)
        return sorted(names | set(self.base.list() if self.base is not None else ()))

    @contextmanager
    def write_file(self, name: str) -> Iterator[Any]:
        raise StorageError(f"{self.url}/{name}: files held for a restore are read-only")
        yield  # pragma: no cover

    def put_atomic(self, name: str, data: bytes, *, overwrite: bool, if_match: str | None = None) -> None:
        raise StorageError(f"{self.url}/{name}: files held for a restore are read-only")

    def delete(self, name: str) -> None:
        raise StorageError(f"{self.url}/{name}: files held for a restore are read-only")

    def close(self) -> None:
        if self.base is not None:
            self.base.close()
