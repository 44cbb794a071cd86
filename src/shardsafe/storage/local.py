"""Local (or network-mounted POSIX) filesystem storage.

Every file inside the root is opened with ``O_NOFOLLOW``: a data file or ``metadata.json``
that is a symbolic link is refused (``CorruptCheckpointError`` naming it), never followed to a
file outside the checkpoint, and a write never goes through a link planted at its name (the
name is removed and the file created with ``O_EXCL``). The root itself may be a symlink.

``put_atomic(..., if_match=)`` takes an exclusive ``flock`` on the current file for the check
and the rename, so two conditional replacements are one-at-a-time between processes. On NFS
that holds across hosts where the mount forwards ``flock`` to the server (NFSv4, or NFSv3 with
``lockd``; not with ``nolock`` or ``local_lock=flock|all``, where it holds on one host only).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..errors import CorruptCheckpointError, StorageError
from ..knobs import KNOBS, Knobs
from .base import check_name, too_large

__all__ = ["LocalStorage", "open_nofollow", "read_nofollow"]


class _FileWriter:
    """Appends to ``fd``; every ``writeback`` bytes, starts writing the new pages back to disk.

    Without that, a file of several GiB sits dirty in the page cache until the final fsync,
    which then writes all of it while nothing else happens (and the kernel may throttle the
    writes meanwhile); starting writeback early overlaps the disk with the copying. The
    final fsync is still what makes the file durable.
    """

    def __init__(self, fd: int, writeback: int = 0) -> None:
        self._fd = fd
        self._writeback = writeback if _sync_file_range is not None else 0
        self._pos = 0
        self._synced = 0  # writeback started for [0, _synced)

    def write(self, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = os.write(self._fd, view)
            view = view[n:]
            self._pos += n
        if self._writeback and self._pos - self._synced >= self._writeback:
            _sync_file_range(self._fd, self._synced, self._pos - self._synced)  # type: ignore[misc]
            self._synced = self._pos


def _load_sync_file_range():
    """``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)`` from libc (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        fn.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None

    def start(fd: int, offset: int, nbytes: int) -> None:
        fn(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; a failure here is only a lost hint

    return start


_sync_file_range = _load_sync_file_range()
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class LocalStorage:
    def __init__(self, root: str, *, knobs: Knobs | None = None) -> None:
        self._knobs = knobs
        self._writeback = (knobs or KNOBS).writeback_bytes
        self.root = os.path.abspath(root)
        self.url = self.root
        self.local_root = self.root
        self.coalesce_gap_bytes = None
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()  # reader threads share the fd cache
        # reuse(path): called before a data file is created at path; True when it moved an existing
        # file there to be overwritten and cut to length (on tmpfs, allocating fresh pages costs
        # more than copying into them: the memory tier recycles a dropped step's files this way)
        self.reuse: Callable[[str], bool] | None = None

    def _path(self, name: str) -> str:
        return os.path.join(self.root, check_name(name))

    def _fsync_root(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _open(self, name: str, flags: int) -> int:
        """``os.open`` of a file inside the root that refuses a symbolic link at ``name``."""
        return open_nofollow(self._path(name), flags)

    @contextmanager
    def write_file(self, name: str) -> Iterator[_FileWriter]:
        path = self._path(name)
        try:
            os.makedirs(self.root, exist_ok=True)
            try:  # a file (or a planted link, never its target) of that name is replaced
                os.unlink(path)
            except FileNotFoundError:
                pass
            reused = self.reuse is not None and self.reuse(path)
            fd = os.open(path, (os.O_WRONLY if reused else os.O_WRONLY | os.O_CREAT | os.O_EXCL) | _NOFOLLOW, 0o644)
        except OSError as e:
            raise StorageError(f"{path}: cannot create data file: {e.strerror}") from e
        ok = False
        try:
            writer = _FileWriter(fd, self._writeback)
            yield writer
            if reused:
                os.ftruncate(fd, writer._pos)
            os.fsync(fd)
            ok = True
        except OSError as e:
            raise StorageError(f"{path}: write failed: {e.strerror}") from e
        finally:
            os.close(fd)
            if not ok:
                _unlink_quietly(path)
        self._fsync_root()

    def put_atomic(self, name: str, data: bytes, *, overwrite: bool, if_match: str | None = None) -> None:
        path = self._path(name)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            os.makedirs(self.root, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
            try:
                _FileWriter(fd).write(memoryview(data))
                os.fsync(fd)
            finally:
                os.close(fd)
            if if_match is not None:
                self._replace_if(name, tmp, if_match)
                self._fsync_root()
            else:
                self._publish(tmp, path, overwrite=overwrite)
        except FileExistsError:
            _unlink_quietly(tmp)
            raise
        except OSError as e:
            _unlink_quietly(tmp)
            raise StorageError(f"{path}: cannot write: {e.strerror}") from e

    def publish(self, tmp_name: str, name: str, *, overwrite: bool) -> None:
        """Move the finished file ``tmp_name`` (written with :meth:`write_file`) to ``name``
        atomically and durably: readers of ``name`` see the old file or the whole new one. With
        ``overwrite=False`` an existing ``name`` is left alone and ``FileExistsError`` raised
        (``tmp_name`` is then left for the caller to remove). ``StorageError`` on I/O error."""
        path = self._path(name)
        try:
            self._publish(self._path(tmp_name), path, overwrite=overwrite)
        except FileExistsError:
            raise
        except OSError as e:
            raise StorageError(f"{path}: cannot move the finished file into place: {e.strerror}") from e

    def _publish(self, tmp: str, path: str, *, overwrite: bool) -> None:
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if ``path`` exists: a no-clobber atomic create
            except FileNotFoundError:
                if os.path.lexists(path):  # our temporary file was swept by the save that committed
                    raise FileExistsError(errno.EEXIST, f"{path} already exists") from None
                raise
            os.unlink(tmp)
        self._fsync_root()

    def _replace_if(self, name: str, tmp: str, if_match: str) -> None:
        """Rename ``tmp`` over ``name`` if ``name`` still is version ``if_match``.

        The check and the rename happen under an exclusive ``flock`` on the file being replaced,
        which every conditional replacement takes: of two writers that read the same version,
        the second gets the lock after the first renamed, finds that the name no longer refers
        to the file it locked, and fails.
        """
        path = self._path(name)
        changed = FileExistsError(errno.EEXIST, f"{path} is no longer the version this writer read")
        try:
            try:
                fd = self._open(name, os.O_RDWR)  # an exclusive flock over NFS needs a writable file
            except PermissionError:
                fd = self._open(name, os.O_RDONLY)
        except (FileNotFoundError, CorruptCheckpointError):  # removed, or replaced by a link
            raise changed from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _version(fd) != if_match or not self._still_at(name, fd):
                raise changed
            os.replace(tmp, path)
        finally:
            os.close(fd)  # releases the lock

    def _still_at(self, name: str, fd: int) -> bool:
        """Whether ``name`` refers to the file open as ``fd`` (opened anew, so an NFS client
        revalidates the name rather than trusting its cache)."""
        try:
            other = self._open(name, os.O_RDONLY)
        except (FileNotFoundError, CorruptCheckpointError):
            return False
        try:
            a, b = os.fstat(fd), os.fstat(other)
        finally:
            os.close(other)
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                path = self._path(name)
                try:
                    fd = self._open(name, os.O_RDONLY)
                except FileNotFoundError:
                    raise CorruptCheckpointError(f"{path}: data file named in the metadata is missing") from None
                except OSError as e:
                    raise StorageError(f"{path}: cannot open: {e.strerror}") from e
                self._fds[name] = fd
            return fd

    def read_spans_into(self, name: str, spans: list[tuple[int, memoryview]]) -> None:
        for offset, buf in spans:
            self.read_into(name, offset, [buf])

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

    def read(self, name: str, *, limit: int | None = None) -> bytes:
        return self._read(name, versioned=False, limit=limit)[0]

    def read_versioned(self, name: str) -> tuple[bytes, str]:
        return self._read(name, versioned=True)

    def _read(self, name: str, *, versioned: bool, limit: int | None = None) -> tuple[bytes, str]:
        path = self._path(name)
        try:
            fd = self._open(name, os.O_RDONLY)
            try:
                if limit is not None:  # the size first (a file grown sparse costs nothing to make), then
                    size = os.fstat(fd).st_size  # at most limit + 1 bytes read: one growing meanwhile is caught too
                    data = _read_all(fd, bound=limit) if size <= limit else b""
                    if size > limit or len(data) > limit:
                        raise too_large(path, max(size, len(data)), limit)
                    return data, ""
                data = _read_all(fd)
                return data, _token(os.fstat(fd), data) if versioned else ""
            finally:
                os.close(fd)
        except FileNotFoundError:
            if not os.path.lexists(self.root):  # the location itself is not there (a mistyped path): say so
                raise FileNotFoundError(errno.ENOENT, "no such directory", self.root) from None
            raise
        except NotADirectoryError:  # the root is a file (a model.safetensors named as a checkpoint): nothing is in it
            raise FileNotFoundError(errno.ENOTDIR, "no such file: the location is a file, not a directory", self.root) from None
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

    # --- a root of several checkpoints (see base.Directory) ---------------------------------------

    def list_dirs(self) -> list[str]:
        try:  # a symbolic link is not followed: removing "its" files would remove the target's
            return sorted(e.name for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False) and not e.name.startswith("."))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise StorageError(f"{self.root}: not a directory") from None
        except OSError as e:
            raise StorageError(f"{self.root}: cannot list: {e.strerror}") from e

    def child(self, name: str) -> LocalStorage:
        return LocalStorage(self._path(name), knobs=self._knobs)

    def remove_dir(self, name: str) -> None:
        path = self._path(name)
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            left = sorted(os.listdir(path)) if e.errno == errno.ENOTEMPTY else []
            raise StorageError(f"{path}: cannot remove the directory: {e.strerror}" + (f" (it still holds {left[:5]})" if left else "")) from e


def open_nofollow(path: str, flags: int = os.O_RDONLY, *, root: str | None = None) -> int:
    """``os.open(path, flags)`` that never follows a symbolic link at ``path`` itself
    (``CorruptCheckpointError`` naming it), the one way shardsafe opens a checkpoint's files.

    With ``root`` (a checkpoint directory holding ``path`` in a sub-directory, as a Zarr array's
    chunk files are), the directories between ``root`` and ``path`` must not lead outside
    ``root`` through a link either. ``root`` itself may be a link."""
    if root is not None:
        base = os.path.realpath(root)
        parent = os.path.realpath(os.path.dirname(path))
        if parent != base and not parent.startswith(base + os.sep):
            raise CorruptCheckpointError(
                f"{path}: a symbolic link among its directories leads outside the checkpoint {root} (to {parent}); "
                "shardsafe does not follow links for the files of a checkpoint: replace it with the directory itself"
            )
    try:
        return os.open(path, flags | _NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise CorruptCheckpointError(
                f"{path}: is a symbolic link; shardsafe does not follow links for the files of a checkpoint "
                f"(it may point outside the checkpoint): replace it with the file itself"
            ) from None
        raise


def read_nofollow(path: str, *, root: str | None = None, size: int | None = None, limit: int | None = None) -> bytes:
    """The bytes of the file at ``path``, opened by :func:`open_nofollow`. Its size is checked
    before anything is read or allocated: ``CorruptCheckpointError`` unless it is ``size``
    bytes (when given) and at most ``limit`` (when given). ``FileNotFoundError`` if missing."""
    fd = open_nofollow(path, root=root)
    try:
        st = os.fstat(fd)
        if size is not None and st.st_size != size:
            raise CorruptCheckpointError(f"{path}: holds {st.st_size} bytes, expected {size}; the file is damaged, truncated or not this checkpoint's")
        if limit is not None and st.st_size > limit:
            raise CorruptCheckpointError(f"{path}: holds {st.st_size} bytes, more than the {limit} such a file may hold; refusing to read it")
        data = _read_all(fd, st.st_size)
        if size is not None and len(data) != size:
            raise CorruptCheckpointError(f"{path}: changed while it was read ({len(data)} bytes, expected {size})")
        return data
    finally:
        os.close(fd)


def _read_all(fd: int, bound: int | None = None) -> bytes:
    """The whole file, or (with ``bound``) at most ``bound`` bytes of it and one more, so that a
    file growing while it is read is noticed without reading all of it."""
    if bound is not None:
        chunks, pos = [], 0
        while pos <= bound:
            chunk = os.pread(fd, min(bound + 1 - pos, 1 << 24), pos)
            if not chunk:
                break
            chunks.append(chunk)
            pos += len(chunk)
        return b"".join(chunks)
    return _read_whole(fd)


def _read_whole(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    chunks, pos = [], 0
    while True:
        chunk = os.pread(fd, max(size - pos, 1 << 16), pos)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        pos += len(chunk)


def _token(st: os.stat_result, data: bytes) -> str:
    """A version token: the file (device, inode, change time) and a hash of its bytes. Every
    commit renames a new file into place, so its inode and ctime differ from the one replaced;
    the hash keeps a reused inode number with other contents from passing for the old file."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_ctime_ns}:{hashlib.sha256(data).hexdigest()}"


def _version(fd: int) -> str:
    return _token(os.fstat(fd), _read_all(fd))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise StorageError(f"{path}: cannot remove: {e.strerror}") from e
