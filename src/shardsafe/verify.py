"""``verify``: read every byte a checkpoint names and check it: ``metadata.json`` (its own
checksum, when it is parsed), each data file's size and safetensors header (its digest in v2,
and that it parses and agrees with the metadata), and every block of every chunk."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ._args import check_arg, check_bool
from ._progress import progress_callback
from .engine.bounds import read_header_prefix
from .errors import CheckpointError, CorruptCheckpointError
from .format.checksum import file_digest
from .format.dtypes import SAFETENSORS_CODE
from .format.metadata import StorageMetadata
from .format.safetensors_file import parse_header
from .knobs import KNOBS
from .storage import open_storage

__all__ = ["VerifyReport", "verify", "verify_report"]

log = logging.getLogger("shardsafe.verify")



@dataclass
class VerifyReport:
    """What :func:`verify` checked, and what it found wrong (empty when all is well)."""

    files: int = 0
    chunks: int = 0
    bytes: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def verify(
    dir: str | os.PathLike[str],
    *,
    collect_all: bool = False,
    threads: int = 1,
    progress: bool | Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Read every chunk of the checkpoint at ``dir`` and check it against the metadata.

    Raises ``CorruptCheckpointError`` at the first bad chunk, or with ``collect_all=True``
    returns a report listing every problem. ``threads``: data files checked at once (each with a read buffer of up to
    ``KNOBS.read_buffer_bytes``).
    ``progress``: ``True`` draws a progress bar (tqdm) on stderr; a callable is called as
    ``progress(done, total)`` with the bytes of chunks checked so far (from the thread that
    checked them). Needs no process group.
    """
    check_bool("verify", "collect_all", collect_all)
    report = verify_report(dir, stop_at_first=not collect_all, threads=threads, progress=progress)
    if not collect_all and report.errors:
        raise CorruptCheckpointError(report.errors[0])
    return report


def verify_report(
    dir: str | os.PathLike[str],
    *,
    stop_at_first: bool = False,
    threads: int = 1,
    progress: bool | Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """:func:`verify`, returning the report whether or not it finds damage: with
    ``stop_at_first`` it stops at the first bad chunk or file, whose message is then the
    report's one error, and counts what was checked up to there. (For callers that report
    damage rather than raise it, as the command line does.) A ``metadata.json`` that cannot be
    read still raises: nothing else can be checked then.
    """
    check_bool("verify", "stop_at_first", stop_at_first)
    check_arg("verify", "threads", threads, int)
    progress = progress_callback(progress, "verify")
    if threads < 1:
        raise CheckpointError(f"verify: threads must be at least 1, got {threads}")
    started = time.monotonic()
    storage = open_storage(dir)
    from .dist import get_comm
    from .engine.loader import read_metadata

    meta: StorageMetadata = read_metadata(storage, get_comm(no_dist=True))
    v3 = meta.file_table is not None
    by_file: dict[str, list] = {}
    infos: dict[str, Any] = dict(meta.files or {})
    if v3:  # chunks by file from the tables; their places are read (and checked) file by file below
        infos = {f.name: f for f in meta.file_table or ()}
        total = 0
        for key, t in meta.tensors.items():
            table = t._table
            assert table is not None
            total += int(table.numels().sum()) * t.torch_dtype.itemsize
            for i, f in enumerate(table.files.tolist()):
                by_file.setdefault(meta.file_table[f].name, []).append((key, t, i))  # type: ignore[index]
    else:
        total = sum(spec.byte_range[1] - spec.byte_range[0] for t in meta.tensors.values() for _, spec in t.chunks())
        for key, t in meta.tensors.items():
            for file, spec in t.chunks():
                by_file.setdefault(file, []).append((key, t, spec))
    lock = threading.Lock()
    done = [0]

    def advance(n: int) -> None:
        if progress is not None:
            with lock:
                done[0] += n
                progress(done[0], total)

    block = KNOBS.read_buffer_bytes
    stop = threading.Event()  # with stop_at_first: set at the first problem, every file stops at its next chunk

    def check_file(item: tuple[str, list]) -> VerifyReport:
        report = VerifyReport()
        try:
            _check_file(item, report)
        except _Stop:
            pass
        return report

    def _check_file(item: tuple[str, list], report: VerifyReport) -> None:
        file, chunks = item

        def fail(msg: str) -> None:
            report.errors.append(msg)
            if stop_at_first:
                stop.set()
                raise _Stop

        if stop.is_set():
            return
        report.files = 1
        where = f"{storage.url.rstrip('/')}/{file}"
        info = infos.get(file)
        try:
            prefix = read_header_prefix(storage, file, None if info is None else info.size)
            if info is not None and file_digest(prefix) != info.header:
                raise ValueError(
                    f"header checksum mismatch: metadata says {info.header}, the header hashes to {file_digest(prefix)}"
                )
            data_start, header = parse_header(bytes(prefix))
        except (ValueError, CorruptCheckpointError) as e:
            fail(f"{where}: not a valid safetensors file: {e}")
            return
        if v3:  # where each chunk is, from the header and the checksum entry (both checked)
            try:
                meta.resolver.file(meta._file_number(file))  # type: ignore[union-attr]
            except CorruptCheckpointError as e:
                fail(str(e))
                return
            placed = []
            for key, t, i in chunks:
                try:
                    placed.extend((key, t, spec) for _, spec in t._resolved([i]))
                except CorruptCheckpointError as e:
                    report.chunks += 1
                    fail(f"{where}: key {key!r}: {e}")
            chunks = placed
        for key, t, spec in chunks:
            if stop.is_set():
                return
            report.chunks += 1
            entry = header.get(spec.name)
            shape = list(spec.local_shape) if spec.flattened_range is None else [spec.local_numel]
            expect = {
                "dtype": SAFETENSORS_CODE[t.torch_dtype],
                "shape": shape,
                "data_offsets": [spec.byte_range[0] - data_start, spec.byte_range[1] - data_start],
            }
            if v3 and spec.flattened_range is None and isinstance(entry, dict) and entry.get("shape") == [spec.local_numel]:
                expect["shape"] = [spec.local_numel]  # a flattened range over its whole box: either shape (docs/format.md §4.2)
            start, end = spec.byte_range
            if entry != expect:
                advance(end - start)  # the chunk is done with: its bytes are not read
                fail(f"{where}: key {key!r}, entry {spec.name!r}: header has {entry}, metadata expects {expect}")
                continue
            pos = start
            buf = bytearray(min(block, end - pos))
            try:
                check = t.chunk_sums(file, spec).stream()
                while pos < end:
                    view = memoryview(buf)[: min(block, end - pos)]
                    storage.read_into(file, pos, [view])
                    pos += view.nbytes
                    advance(view.nbytes)
                    check.update(view)
                check.finish()
            except CorruptCheckpointError as e:
                report.bytes += pos - start  # a bad chunk's bytes were checked too, up to the bad block
                advance(end - pos)
                fail(f"{where}: key {key!r}: {e}")
                continue
            report.bytes += end - start
        if info is not None:  # after the chunks: a cut into a chunk is reported with its key
            try:
                _check_size(storage, file, info.size)
            except (ValueError, CorruptCheckpointError) as e:
                fail(f"{where}: not a valid safetensors file: {e}")

    report = VerifyReport()
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="shardsafe-verify") as pool:
            try:
                for part in pool.map(check_file, sorted(by_file.items())):
                    report.files += part.files
                    report.chunks += part.chunks
                    report.bytes += part.bytes
                    report.errors.extend(part.errors)
                    if stop_at_first and report.errors:  # the first problem, in file order; the files after it are not counted
                        pool.shutdown(cancel_futures=True)
                        break
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise
    finally:
        storage.close()
    seconds = time.monotonic() - started
    log.debug(
        "verify %s: %d files, %d chunks, %d bytes, %d problem(s), %.2f s, %.2f GB/s",
        storage.url, report.files, report.chunks, report.bytes, len(report.errors), seconds, report.bytes / max(seconds, 1e-9) / 1e9,
    )
    return report


class _Stop(Exception):
    """Raised by a file's check at its first problem when stopping there (caught by the file's check)."""


def _check_size(storage, file: str, size: int) -> None:
    """The file is exactly ``size`` bytes: its last byte reads, the byte after it does not."""
    last = bytearray(1)
    storage.read_into(file, size - 1, [memoryview(last)])  # raises CorruptCheckpointError if shorter
    try:
        storage.read_into(file, size, [memoryview(bytearray(1))])
    except CorruptCheckpointError:
        return
    raise ValueError(f"the file is longer than the {size} bytes the metadata records")
