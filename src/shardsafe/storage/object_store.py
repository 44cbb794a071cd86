"""Object-store storage (S3, GCS, Azure Blob) through obstore, the Python face of Rust ``object_store``.

How the :class:`~shardsafe.storage.Storage` calls map onto requests:

- ``write_file``: a multipart upload (S3/GCS parts, Azure blocks), ``concurrency`` parts of
  ``part_bytes`` in flight; memory stays near ``(concurrency + 1) * part_bytes`` whatever the
  file size, and nothing goes to local disk. The object appears only when the upload
  completes; if the body or an upload request fails, the upload is aborted. A file smaller
  than one part is sent with one PUT.
- ``put_atomic``: one PUT. ``overwrite=False`` is a conditional create (``If-None-Match: *`` on
  S3 and Azure, ``x-goog-if-generation-match: 0`` on GCS), ``if_match`` a conditional replace
  (``If-Match: <etag>`` on S3 and Azure, ``x-goog-if-generation-match: <generation>`` on GCS):
  of two racing commits one wins and the other gets ``FileExistsError``.
- ``read_versioned``: a GET; the version token is the object's ETag and version (generation).
- ``read_into``: ranged GETs of at most ``get_bytes`` each, up to ``concurrency`` in flight,
  each copied into the caller's buffers as it lands. ``read_spans_into`` (not part of the
  ``Storage`` protocol) fetches many separate ranges of one file concurrently.
- ``read``/``list``/``delete``: GET, a delimited LIST of the prefix, DELETE.

Throttling (503 SlowDown), other 5xx, timeouts and connection resets, including a body cut
off mid-transfer, are retried with exponential backoff and jitter, up to ``max_retries`` times
and no later than ``retry_timeout_s`` after the first try. Other errors (403, 404 on the
bucket, 400) fail at once with a :class:`~shardsafe.StorageError` naming the URL and the
server's answer.

obstore runs its requests on one I/O runtime per process, whose threads do not survive
``fork()``: in a process forked after this one made a request, any request would hang. Every
call there fails at once with a ``StorageError`` saying so instead (see :func:`_check_fork`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from ..errors import CorruptCheckpointError, StorageError
from ..knobs import KNOBS, Knobs
from .base import check_name, too_large
from .cloud_config import ObjectStoreOptions, build_store, parse_object_url

__all__ = ["ObjectStorage"]

log = logging.getLogger(__name__)


class _PartWriter:
    """Feeds an obstore writer in slices of at most one part, so that each call waits for a free
    upload slot and no more than ``concurrency`` parts are ever in flight."""

    def __init__(self, storage: ObjectStorage, name: str, sink: Any) -> None:
        self._storage = storage
        self._name = name
        self._sink = sink
        self.nbytes = 0

    def write(self, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        step = self._storage.part_bytes
        try:
            for pos in range(0, view.nbytes, step):
                self._sink.write(view[pos : pos + step])
        except Exception as e:  # obstore errors, or OSError from its runtime
            raise self._storage._error(e, self._name, "upload failed") from e
        self.nbytes += view.nbytes


class ObjectStorage:
    """A checkpoint location in S3, GCS or Azure Blob Storage.

    ``url`` is ``s3://bucket/prefix``, ``gs://bucket/prefix`` or ``az://container/prefix``;
    ``options`` (or keyword arguments of :func:`~shardsafe.storage.open_storage`) override
    what the environment says; see :mod:`shardsafe.storage.cloud_config`. Safe to share
    between threads.
    """

    def __init__(self, url: str, options: ObjectStoreOptions | None = None, *, knobs: Knobs | None = None) -> None:
        self._knobs = knobs
        knobs = knobs or KNOBS
        self.options = options or ObjectStoreOptions()
        self.location = parse_object_url(url)
        self.url = self.location.url
        o = self.options
        self.part_bytes = o.part_bytes or max(knobs.object_part_bytes, 5 << 20)
        self.get_bytes = o.get_bytes or max(knobs.object_get_bytes, 1 << 16)
        self.concurrency = o.concurrency or max(knobs.object_concurrency, 1)
        self.coalesce_gap_bytes = o.coalesce_gap_bytes  # read by the engine's reader
        self.local_root = None
        self._store = build_store(
            self.location,
            o,
            max_retries=knobs.object_max_retries if o.max_retries is None else o.max_retries,
            retry_timeout_s=knobs.object_retry_timeout_s if o.retry_timeout_s is None else o.retry_timeout_s,
        )
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ObjectStorage({self.url!r})"

    # --- writing -------------------------------------------------------------------------------

    @contextmanager
    def write_file(self, name: str) -> Iterator[_PartWriter]:
        _check_fork(self.url)
        import obstore

        check_name(name)
        sink = obstore.open_writer(self._store, name, buffer_size=self.part_bytes, max_concurrency=self.concurrency)
        writer = _PartWriter(self, name, sink)
        try:
            yield writer
        except BaseException as e:
            self._abort(sink, name, e)
            raise
        try:
            sink.close()
        except Exception as e:
            raise self._error(e, name, f"completing the upload of {writer.nbytes} bytes failed") from e

    def _abort(self, sink: Any, name: str, cause: BaseException) -> None:
        """Abort the multipart upload (its parts are deleted); never hides ``cause``."""
        try:
            sink.__exit__(type(cause), cause, cause.__traceback__)
        except Exception as e:  # already closed by a failed write, or the abort itself failed
            if "already closed" not in str(e):
                log.warning("%s/%s: could not abort the multipart upload: %s", self.url, name, _describe(e))

    def put_atomic(self, name: str, data: bytes, *, overwrite: bool, if_match: str | None = None) -> None:
        _check_fork(self.url)
        import obstore
        from obstore.exceptions import AlreadyExistsError, NotFoundError, NotSupportedError, PreconditionError

        check_name(name)
        try:
            if if_match is None and overwrite:
                obstore.put(self._store, name, data, mode="overwrite", use_multipart=False)
                return
            mode: Any = "create" if if_match is None else json.loads(if_match)
            try:
                obstore.put(self._store, name, data, mode=mode, use_multipart=False)
            except (AlreadyExistsError, PreconditionError, NotFoundError) as e:
                if isinstance(e, NotFoundError) and _is_missing_container(e):
                    raise
                # a put retried after a lost answer finds its own first try: same bytes, ours
                if _retries(e) > 0 and self._read_or_none(name) == bytes(data):
                    return
                what = "already exists" if if_match is None else "is no longer the version this writer read"
                raise FileExistsError(f"{self.url}/{name} {what}") from None
            except NotSupportedError:
                log.warning("%s: the store has no conditional put; checking %s, then writing it", self.url, name)
                current = self._read_versioned_or_none(name)
                if (current is not None) if if_match is None else (current is None or current[1] != if_match):
                    what = "already exists" if if_match is None else "is no longer the version this writer read"
                    raise FileExistsError(f"{self.url}/{name} {what}") from None
                obstore.put(self._store, name, data, mode="overwrite", use_multipart=False)
        except FileExistsError:
            raise
        except Exception as e:
            raise self._error(e, name, "write failed") from e

    # --- reading -------------------------------------------------------------------------------

    def read_into(self, name: str, offset: int, buffers: list[memoryview]) -> None:
        _check_fork(self.url)
        check_name(name)
        views = [memoryview(b).cast("B") for b in buffers]
        want = sum(v.nbytes for v in views)
        if want == 0:
            return
        starts = list(range(offset, offset + want, self.get_bytes))
        if len(starts) == 1:
            self._fetch(name, offset, want, views, offset, want)
            return
        pool = self._executor()
        futures = [
            pool.submit(self._fetch, name, s, min(self.get_bytes, offset + want - s), views, offset, want) for s in starts
        ]
        errors = []
        for f in futures:  # wait for all: no request may still write into the buffers after we return
            try:
                f.result()
            except Exception as e:  # noqa: PERF203
                errors.append(e)
        if errors:
            raise errors[0]

    def read_spans_into(self, name: str, spans: list[tuple[int, memoryview]]) -> None:
        """Fill each buffer with the bytes of the file at its offset, all ranges fetched
        concurrently (up to 10 in flight), none merged: for many small reads of one file, such
        as the rows of a strided box, where ``read_into`` per span would wait for each GET."""
        _check_fork(self.url)
        import obstore

        check_name(name)
        spans = [(off, memoryview(buf).cast("B")) for off, buf in spans]
        spans = [(off, v) for off, v in spans if v.nbytes]
        if not spans:
            return
        try:
            got = obstore.get_ranges(
                self._store, name, starts=[o for o, _ in spans], lengths=[v.nbytes for _, v in spans], coalesce=0
            )
        except Exception as e:
            if _status(e) == 416 or _PAST_END.search(str(e)):
                first, last = min(o for o, _ in spans), max(o + v.nbytes for o, v in spans)
                raise self._truncated(name, first, last - first) from None
            if _is_missing_object(e):
                raise CorruptCheckpointError(f"{self.url}/{name}: data file named in the metadata is missing") from None
            raise self._error(e, name, f"read of {len(spans)} byte ranges failed") from e
        for (off, v), data in zip(spans, got):
            data = memoryview(data)
            if data.nbytes < v.nbytes:
                raise self._truncated(name, off, v.nbytes)
            v[:] = data[: v.nbytes]

    def _fetch(self, name: str, start: int, length: int, views: list[memoryview], offset: int, want: int) -> None:
        """GET bytes [start, start + length) and copy them to where they belong in ``views``
        (which hold bytes [offset, offset + want) of the file, in order)."""
        import obstore

        try:
            data = memoryview(obstore.get_range(self._store, name, start=start, length=length))
        except Exception as e:
            if _status(e) == 416 or _PAST_END.search(str(e)):
                raise self._truncated(name, offset, want) from None
            if _is_missing_object(e):
                raise CorruptCheckpointError(f"{self.url}/{name}: data file named in the metadata is missing") from None
            raise self._error(e, name, f"read of bytes [{start}, {start + length}) failed") from e
        if data.nbytes < length:
            raise self._truncated(name, offset, want)
        pos = start - offset  # position of ``data`` within the concatenated views
        for v in views:
            if pos >= v.nbytes:
                pos -= v.nbytes
                continue
            n = min(v.nbytes - pos, data.nbytes)
            v[pos : pos + n] = data[:n]
            data = data[n:]
            pos = 0
            if not data.nbytes:
                break

    def _truncated(self, name: str, offset: int, want: int) -> CorruptCheckpointError:
        import obstore

        try:
            size = f"{obstore.head(self._store, name)['size']} bytes"
        except Exception:  # the answer is only for the message
            size = "fewer bytes"
        return CorruptCheckpointError(f"{self.url}/{name}: truncated: needed bytes [{offset}, {offset + want}) but the file has {size}")

    def read(self, name: str, *, limit: int | None = None) -> bytes:
        return self._get(name, limit)[0]

    def read_versioned(self, name: str) -> tuple[bytes, str]:
        return self._get(name, None)

    def _get(self, name: str, limit: int | None) -> tuple[bytes, str]:
        _check_fork(self.url)
        import obstore

        check_name(name)
        try:
            got = obstore.get(self._store, name)
            size = got.meta["size"]  # from the response's headers, before its body is read
            data = got.bytes().to_bytes() if limit is None or size <= limit else None
        except Exception as e:
            if _is_missing_object(e):
                raise FileNotFoundError(f"{self.url}/{name}") from None
            raise self._error(e, name, "read failed") from e
        if data is None:
            raise too_large(f"{self.url}/{name}", size, limit)
        meta = got.meta
        version = {k: meta[k] for k in ("e_tag", "version") if meta.get(k) is not None}
        return data, json.dumps(version, sort_keys=True)

    def _read_or_none(self, name: str) -> bytes | None:
        got = self._read_versioned_or_none(name)
        return None if got is None else got[0]

    def _read_versioned_or_none(self, name: str) -> tuple[bytes, str] | None:
        try:
            return self.read_versioned(name)
        except FileNotFoundError:
            return None

    def list(self) -> list[str]:
        _check_fork(self.url)
        import obstore

        try:
            found = obstore.list_with_delimiter(self._store)
        except Exception as e:
            raise self._error(e, None, "list failed") from e
        return sorted(o["path"].rsplit("/", 1)[-1] for o in found["objects"])

    def delete(self, name: str) -> None:
        _check_fork(self.url)
        import obstore

        check_name(name)
        try:
            obstore.delete(self._store, name)
        except Exception as e:
            if not _is_missing_object(e):
                raise self._error(e, name, "delete failed") from e

    # --- a root of several checkpoints (see base.Directory) ---------------------------------------

    def list_dirs(self) -> list[str]:
        _check_fork(self.url)
        import obstore

        try:
            found = obstore.list_with_delimiter(self._store)
        except Exception as e:
            raise self._error(e, None, "list failed") from e
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in found["common_prefixes"])

    def child(self, name: str) -> ObjectStorage:
        return ObjectStorage(f"{self.url}/{check_name(name)}", self.options, knobs=self._knobs)

    def remove_dir(self, name: str) -> None:
        check_name(name)  # a prefix exists only while objects are under it: nothing to remove

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and _RUNTIME_PID in (None, os.getpid()):  # a forked child has none of its threads
            pool.shutdown(wait=True)

    def _executor(self) -> ThreadPoolExecutor:
        _check_fork(self.url)  # a forked child has none of the pool's threads: its work would wait forever
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="shardsafe-get")
            return self._pool

    # --- errors --------------------------------------------------------------------------------

    def _error(self, e: BaseException, name: str | None, action: str) -> StorageError:
        where = f"{self.url}/{name}" if name else self.url
        return StorageError(f"{where}: {action}: {_describe(e)}{_hint(e)}")


# --- fork ----------------------------------------------------------------------------------------

_RUNTIME_PID: int | None = None  # the process in which this module first sent a request


def _check_fork(url: str) -> None:
    """Refuse a request in a process forked from one that had already sent requests.

    obstore (through ``pyo3-async-runtimes``) starts one tokio runtime per process, on first
    use, and keeps it for good; ``fork()`` copies the runtime's state but none of its threads,
    so in the child every request, with any store object, old or new, waits forever. A fresh
    client cannot help, so the child fails at once, with the way out in the message.
    """
    global _RUNTIME_PID
    pid = os.getpid()
    if _RUNTIME_PID is None:
        _RUNTIME_PID = pid
    elif _RUNTIME_PID != pid:
        raise StorageError(
            f"{url}: this process (pid {pid}) was forked from process {_RUNTIME_PID} after that process had used an "
            "object store, and the object-store client's I/O runtime does not survive fork(): every request here would "
            "hang. Start worker processes with the 'spawn' or 'forkserver' method (multiprocessing.get_context('spawn'), "
            "DataLoader(..., multiprocessing_context='spawn')), or fork them before the first object-store access"
        )


# Errors come from obstore as text: "<summary>: Error performing GET <url> in 3ms - Server returned
# non-2xx status code: 403 Forbidden: <body>\n\nDebug source:\n<struct dump>". The helpers below
# pull out what a person needs: status, the service's error code and message, retries made.

_STATUS = re.compile(r"status code: (\d{3})([^:\n]*)")
_XML_CODE = re.compile(r"<Code>([^<]+)</Code>")
_XML_MESSAGE = re.compile(r"<Message>([^<\n]+)")
_JSON_MESSAGE = re.compile(r'"message"\s*:\s*"([^"]+)"')
_RETRIES = re.compile(r"\bretries: (\d+)")
_PAST_END = re.compile(r"Wanted range starting at \d+, but object was only \d+ bytes long")  # the client's own check
_MISSING_CONTAINER = ("NoSuchBucket", "ContainerNotFound", "bucket does not exist", "no bucket named")


def _status(e: BaseException) -> int | None:
    m = _STATUS.search(str(e))
    return int(m.group(1)) if m else None


def _retries(e: BaseException) -> int:
    m = _RETRIES.search(str(e))
    return int(m.group(1)) if m else 0


def _is_missing_object(e: BaseException) -> bool:
    """A 404 for the object itself, as opposed to a missing bucket or container."""
    from obstore.exceptions import NotFoundError

    return (isinstance(e, NotFoundError) or isinstance(e, FileNotFoundError)) and not _is_missing_container(e)


def _is_missing_container(e: BaseException) -> bool:
    text = str(e)
    return any(s in text for s in _MISSING_CONTAINER)


def _describe(e: BaseException) -> str:
    text = str(e)
    summary = text.split("\n\nDebug source:")[0]
    m = _STATUS.search(summary)
    if m:
        cause = f"HTTP {m.group(1)}{m.group(2).rstrip()}"
        code, msg = _XML_CODE.search(text), _XML_MESSAGE.search(text) or _JSON_MESSAGE.search(text)
        detail = ": ".join(x.group(1).strip() for x in (code, msg) if x)
        if detail:
            cause += f" ({detail})"
    else:  # no answer from the server: connection refused/reset, timeout, DNS, TLS
        first = summary.strip().splitlines()[0] if summary.strip() else type(e).__name__
        cause = first if len(first) <= 400 else first[:400] + "..."
    n = _retries(e)
    if n:
        cause += f", after {n} retries"
    return cause


def _hint(e: BaseException) -> str:
    from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

    text = str(e)
    if any(s in text for s in _MISSING_CONTAINER):
        return "; the bucket (container) does not exist"
    if isinstance(e, (PermissionDeniedError, UnauthenticatedError)) or _status(e) in (401, 403):
        return "; check the credentials and their permissions on this bucket and prefix"
    return ""
