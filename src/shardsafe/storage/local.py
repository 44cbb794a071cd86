"""Local (or network-mounted POSIX) filesystem storage."""

from __future__ import annotations

import errno
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import CorruptCheckpointError, StorageError
from .base import check_name

__all__ = ["LocalStorage"]


class _FileWriter:
    def __init__(self, fd: int) -> None:
        self._fd = fd

    def write(self, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = os.write(self._fd, view)
            view = view[n:]


class LocalStorage:
    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()  # reader threads share the fd cache

    def _path(self, name: str) -> str:
        return os.path.join(self.root, check_name(name))

    def _fsync_root(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @contextmanager
    def write_file(self, name: str) -> Iterator[_FileWriter]:
        path = self._path(name)
        try:
            os.makedirs(self.root, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise StorageError(f"{path}: cannot create data file: {e.strerror}") from e
        ok = False
        try:
            yield _FileWriter(fd)
            os.fsync(fd)
            ok = True
        except OSError as e:
            raise StorageError(f"{path}: write failed: {e.strerror}") from e
        finally:
            os.close(fd)
            if not ok:
                _unlink_quietly(path)
        self._fsync_root()

    def put_atomic(self, name: str, data: bytes, *, overwrite: bool) -> None:
        path = self._path(name)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            os.makedirs(self.root, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _FileWriter(fd).write(memoryview(data))
                os.fsync(fd)
            finally:
                os.close(fd)
            if overwrite:
                os.replace(tmp, path)
            else:
                os.link(tmp, path)  # fails if ``path`` exists: a no-clobber atomic create
                os.unlink(tmp)
            self._fsync_root()
        except FileExistsError:
            _unlink_quietly(tmp)
            raise
        except OSError as e:
            _unlink_quietly(tmp)
            raise StorageError(f"{path}: cannot write: {e.strerror}") from e

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                path = self._path(name)
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    raise CorruptCheckpointError(f"{path}: data file named in the metadata is missing") from None
                except OSError as e:
                    raise StorageError(f"{path}: cannot open: {e.strerror}") from e
                self._fds[name] = fd
            return fd

    def read_into(self, name: str, offset: int, buffers: list[memoryview]) -> None:
        fd = self._fd(name)
        views = [memoryview(b).cast("B") for b in buffers]
        want = sum(v.nbytes for v in views)
        if want == 0:
            return
        pos = offset
        while views:
            try:
                n = os.preadv(fd, views[:1024], pos)  # IOV_MAX is 1024 on Linux
            except OSError as e:
                raise StorageError(f"{self._path(name)}: read failed at byte {pos}: {e.strerror}") from e
            if n == 0:
                size = os.fstat(fd).st_size
                raise CorruptCheckpointError(
                    f"{self._path(name)}: truncated: needed bytes [{offset}, {offset + want}) but the file has {size} bytes"
                )
            pos += n
            while views and n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            if n:
                views[0] = views[0][n:]

    def read(self, name: str) -> bytes:
        path = self._path(name)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise
        except OSError as e:
            raise StorageError(f"{path}: cannot read: {e.strerror}") from e

    def list(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root) if e.is_file())
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise StorageError(f"{self.root}: not a directory") from None

    def delete(self, name: str) -> None:
        _unlink_quietly(self._path(name))

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise StorageError(f"{path}: cannot remove: {e.strerror}") from e
