"""In-memory storage, for tests and for moving a checkpoint between objects in one process.

Stores are process-global, keyed by URL (``memory://name``), so a save and a later load in
the same process see the same files.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import CorruptCheckpointError, StorageError
from .base import check_name, too_large

__all__ = ["MemoryStorage"]

_LOCK = threading.Lock()
_STORES: dict[str, dict[str, bytes]] = {}
_VERSIONS: dict[str, dict[str, int]] = {}  # url -> name -> version, each write a new number
_NEXT_VERSION = itertools.count(1)


class _BufferWriter:
    def __init__(self) -> None:
        self.buf = bytearray()

    def write(self, data: memoryview) -> None:
        self.buf += memoryview(data).cast("B")


class MemoryStorage:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.local_root = None
        self.coalesce_gap_bytes = None
        with _LOCK:
            self._files = _STORES.setdefault(self.url, {})
            self._versions = _VERSIONS.setdefault(self.url, {})

    def _set(self, name: str, data: bytes) -> None:  # with _LOCK held
        self._files[name] = data
        self._versions[name] = next(_NEXT_VERSION)

    @contextmanager
    def write_file(self, name: str) -> Iterator[_BufferWriter]:
        check_name(name)
        w = _BufferWriter()
        yield w
        with _LOCK:
            self._set(name, bytes(w.buf))

    def put_atomic(self, name: str, data: bytes, *, overwrite: bool, if_match: str | None = None) -> None:
        check_name(name)
        with _LOCK:
            if if_match is not None:
                if name not in self._files or str(self._versions[name]) != if_match:
                    raise FileExistsError(f"{self.url}/{name} is no longer the version this writer read")
            elif not overwrite and name in self._files:
                raise FileExistsError(f"{self.url}/{name}")
            self._set(name, bytes(data))

    def read_spans_into(self, name: str, spans: list[tuple[int, memoryview]]) -> None:
        for offset, buf in spans:
            self.read_into(name, offset, [buf])

    def read_into(self, name: str, offset: int, buffers: list[memoryview]) -> None:
        data = self._get(name)
        pos = offset
        for b in buffers:
            view = memoryview(b).cast("B")
            end = pos + view.nbytes
            if end > len(data):
                raise CorruptCheckpointError(
                    f"{self.url}/{name}: truncated: needed bytes up to {end} but the file has {len(data)} bytes"
                )
            view[:] = data[pos:end]
            pos = end

    def _get(self, name: str) -> bytes:
        try:
            return self.read(name)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.url}/{name}: data file named in the metadata is missing") from None

    def read(self, name: str, *, limit: int | None = None) -> bytes:
        data = self.read_versioned(name)[0]
        if limit is not None and len(data) > limit:
            raise too_large(f"{self.url}/{name}", len(data), limit)
        return data

    def read_versioned(self, name: str) -> tuple[bytes, str]:
        check_name(name)
        with _LOCK:
            data = self._files.get(name)
            version = self._versions.get(name)
        if data is None:
            raise FileNotFoundError(f"{self.url}/{name}")
        return data, str(version)

    def list(self) -> list[str]:
        with _LOCK:
            return sorted(self._files)

    def delete(self, name: str) -> None:
        with _LOCK:
            self._files.pop(check_name(name), None)
            self._versions.pop(name, None)

    def close(self) -> None:
        pass

    # --- a root of several checkpoints (see base.Directory) ---------------------------------------

    def list_dirs(self) -> list[str]:
        base = self.url + "/"
        with _LOCK:
            names = {u[len(base) :].split("/", 1)[0] for u, files in _STORES.items() if u.startswith(base) and files}
        return sorted(names)

    def child(self, name: str) -> MemoryStorage:
        return MemoryStorage(f"{self.url}/{check_name(name)}")

    def remove_dir(self, name: str) -> None:
        url = f"{self.url}/{check_name(name)}"
        with _LOCK:
            if _STORES.get(url):
                raise StorageError(f"{url}: cannot remove the directory: it still holds {sorted(_STORES[url])[:5]}")
            _STORES.pop(url, None)
            _VERSIONS.pop(url, None)
