"""Streaming unshard: a whole checkpoint (or the keys under one prefix) into one safetensors file.

Every shape and dtype is known from ``metadata.json``, so the output's header and layout are
computed first and written before any tensor byte; then the tensors follow in file order.

- A tensor whose every stored chunk is one contiguous run of the output (row slabs, as FSDP and
  ``Shard(0)`` save them, and flat ranges of those) is copied chunk by chunk in blocks of
  ``write_block_bytes`` through a ring of four such buffers: read, checksum, and hand to a
  write-behind thread, so reading the next block overlaps writing the last.
- Any other tensor (``Shard(1)``, 2-D grids, ...) is loaded whole by the
  :class:`~shardsafe.engine.reader.Reader` into one buffer, reused for every such tensor, and
  written from there.

Peak memory is the ring (64 MiB at the default block size), plus the largest tensor of the
second kind and the reader's bounded scratch if there is one. Every chunk read whole is checked
against its checksums before it is written. The output is written to a temporary file beside ``out_path``, fsynced, and
renamed into place (then the directory is fsynced): a crash leaves no file or the complete one.
Needs no process group; call it from one process.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from contextlib import AbstractContextManager
from typing import Any

import torch

from .._args import check_arg, check_bool
from ..adapters import describe_state
from ..errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError, MissingKeyError, StorageError
from ..format.checksum import ChunkSums
from ..format.dtypes import SAFETENSORS_CODE
from ..format.metadata import StorageMetadata, TensorStorageMetadata, keys_under
from ..format.safetensors_file import FileEntry, layout_file
from ..knobs import KNOBS, Knobs
from ..planning.geometry import row_major_strides
from ..storage import Writer, open_storage
from ..storage.base import check_local_path, check_name, url_scheme
from ..storage.local import LocalStorage
from .bounds import check_files_hold
from .buffers import WriteBehind, byte_view
from .reader import Reader

__all__ = ["unshard_to_safetensors"]

log = logging.getLogger(__name__)

_RING = 4  # blocks of the direct copy: read, checksummed, queued, being written

# Written into every output's ``__metadata__``: transformers refuses a safetensors file whose
# metadata lacks a known "format".
FORMAT_TAG = ("format", "pt")


def unshard_to_safetensors(
    dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    overwrite: bool = False,
    knobs: Knobs | None = None,
) -> dict[str, int]:
    """Write every tensor of the checkpoint at ``dir`` into one safetensors file at ``out_path``.

    With ``prefix``, only keys that start with it are written, with the prefix removed
    (``prefix="model."`` turns ``"model.layers.0.weight"`` into ``"layers.0.weight"``).
    Non-tensor values stored as JSON (under the prefix, if given) go into the file's
    ``__metadata__`` as JSON strings, under their (stripped) keys, next to ``"format": "pt"``;
    values stored with pickle are never unpickled and are left out (counted in the result).

    Peak memory is four blocks of ``knobs.write_block_bytes`` (64 MiB by default) when every
    chunk is a run of rows (as FSDP / ``Shard(0)`` saves them); tensors saved in other layouts
    add the largest of them and ``knobs.read_buffer_bytes`` of scratch. Every chunk is checked
    against its checksums. The file appears atomically and durably (fsynced
    temporary file, renamed); an existing ``out_path`` is replaced only with ``overwrite=True``.
    ``out_path`` may also be an object-store or ``memory://`` URL (``s3://bucket/dir/model.safetensors``,
    configured by the environment): the object is uploaded as it is written and appears only
    once complete; without ``overwrite`` an existing object is refused (checked before writing).
    Needs no process group.

    Returns counts: ``tensors``, ``bytes`` (tensor data), ``file_bytes`` (the whole file),
    ``values`` (JSON values written to ``__metadata__``), ``skipped_values`` (pickled values left out).
    """
    from ..checkpointer import _read_metadata  # the one metadata reader (incomplete-checkpoint errors)
    from ..dist import get_comm

    check_arg("unshard_to_safetensors", "out_path", out_path, (str, os.PathLike))
    check_arg("unshard_to_safetensors", "prefix", prefix, str, optional=True)
    check_bool("unshard_to_safetensors", "overwrite", overwrite)
    check_arg("unshard_to_safetensors", "knobs", knobs, Knobs, optional=True)
    knobs = knobs or KNOBS
    output = _Output(os.fspath(out_path), overwrite=overwrite, knobs=knobs)
    storage = open_storage(dir)
    meta = _read_metadata(storage, get_comm(no_dist=True))
    tensors, values, skipped = _select(meta, prefix, storage.url)
    check_files_hold(storage, tensors.values())  # before allocating from their sizes
    file_meta = {FORMAT_TAG[0]: FORMAT_TAG[1], **{k: json.dumps(v, separators=(",", ":")) for k, v in values.items()}}

    # the official writer's order: larger itemsize first, then by name, so that every tensor
    # starts at a multiple of its itemsize (the header is padded to 8)
    order = sorted(tensors, key=lambda name: (-tensors[name][1].torch_dtype.itemsize, name))
    entries = [_entry(name, tensors[name][1]) for name in order]
    layout = layout_file(entries, file_meta)
    directs = {name: _direct_runs(tensors[name][1]) for name in order}
    largest_other = max((e.nbytes for name, e in zip(order, entries) if directs[name] is None), default=0)
    block = min(max(knobs.write_block_bytes, 1 << 16), max((r[2] for rs in directs.values() if rs for r in rs), default=0))

    done = False
    try:
        with output.writer() as w, WriteBehind(w, depth=_RING - 2) as behind:
            behind.write(memoryview(layout.header))
            ring = [torch.empty(block, dtype=torch.uint8) for _ in range(_RING if block else 0)]
            slot = 0
            buf = torch.empty(largest_other, dtype=torch.uint8)  # reused for every tensor not copied directly
            with Reader(storage, knobs) as reader:
                for name, entry in zip(order, entries):
                    key, tm = tensors[name]
                    runs = directs[name]
                    if runs is not None:
                        for file, start, nbytes, sums in runs:
                            check = sums.stream()
                            try:
                                for pos in range(0, nbytes, block):
                                    view = byte_view(ring[slot][: min(block, nbytes - pos)])
                                    slot = (slot + 1) % _RING
                                    storage.read_into(file, start + pos, [view])
                                    check.update(view)  # before the bytes are handed on
                                    behind.write(view)
                                check.finish()
                            except CorruptCheckpointError as e:
                                raise CorruptCheckpointError(f"key {key!r}: {e}") from None
                        continue
                    behind.flush()  # the buffer's last tensor is written: reuse it
                    target = buf[: entry.nbytes].view(tm.torch_dtype).view(tm.shape)
                    (lt,), _ = describe_state({key: target})
                    reader.load_tensor(tm, lt)
                    mv = byte_view(target) if entry.nbytes else memoryview(b"")
                    step = max(block, 1 << 24)
                    for pos in range(0, mv.nbytes, step):
                        behind.write(mv[pos : pos + step])
        output.publish()
        done = True
    finally:
        if not done:
            output.discard()
    nbytes = sum(e.nbytes for e in entries)
    return {
        "tensors": len(entries),
        "bytes": nbytes,
        "file_bytes": layout.size,
        "values": len(values),
        "skipped_values": skipped,
    }


def _select(
    meta: StorageMetadata, prefix: str | None, where: str
) -> tuple[dict[str, tuple[str, TensorStorageMetadata]], dict[str, Any], int]:
    """Output name -> (stored key, metadata) for the selected tensors; selected JSON values; pickled count."""

    tensors = {name: (key, meta.tensors[key]) for name, key in keys_under(meta.tensors, prefix).items()}
    values = {name: meta.objects[key] for name, key in keys_under(meta.objects, prefix).items()}
    skipped = len(keys_under(meta.pickled_objects, prefix))
    if skipped:
        log.warning("%s: %d value(s) stored with pickle are not written to the safetensors file", where, skipped)
    if prefix is not None and not tensors and not values and not skipped:
        raise MissingKeyError(
            f"{where}: no key starts with prefix {prefix!r} ({len(meta.tensors)} tensors and "
            f"{len(meta.objects) + len(meta.pickled_objects)} values stored)"
        )
    for name in [*tensors, *values]:
        if name in ("", "__metadata__") or (name == FORMAT_TAG[0] and name in values):
            key = name if prefix is None else prefix + name
            what = "an empty name" if not name else f"the reserved name {name!r}"
            raise CheckpointError(
                f"{where}: key {key!r} would become {what} in the safetensors file; choose a different prefix"
            )
    return tensors, values, skipped


def _direct_runs(tm: TensorStorageMetadata) -> list[tuple[str, int, int, ChunkSums]] | None:
    """If every chunk of ``tm`` is one contiguous run of the row-major tensor: the chunks as
    (file, byte start, bytes, checksums) in output order. Else None."""
    shape = tuple(tm.shape)
    strides = row_major_strides(shape)
    itemsize = tm.torch_dtype.itemsize
    runs = []
    for file, spec in tm.chunks():
        n = spec.local_numel
        if n == 0:
            continue
        off, lens = spec.global_offset, spec.local_shape
        k = next((d for d, ln in enumerate(lens) if ln != 1), len(lens))
        if any(lens[d] != shape[d] for d in range(k + 1, len(lens))):
            return None  # the box skips part of a row: not one run
        first = sum(o * s for o, s in zip(off, strides)) + (spec.flattened_range[0] if spec.flattened_range else 0)
        runs.append((first, (file, spec.byte_range[0], n * itemsize, tm.chunk_sums(file, spec))))
    runs.sort(key=lambda r: r[0])
    return [r for _, r in runs]


def _entry(name: str, tm: TensorStorageMetadata) -> FileEntry:
    dtype = tm.torch_dtype
    numel = 1
    for n in tm.shape:
        numel *= n
    return FileEntry(name, SAFETENSORS_CODE[dtype], tuple(tm.shape), numel * dtype.itemsize)


class _Output:
    """Where the output goes, and how it appears whole or not at all: a local path through an
    fsynced temporary file beside it, renamed into place; a URL through its store's
    ``write_file``, whose object appears only once complete and is removed on error."""

    def __init__(self, out_path: str, *, overwrite: bool, knobs: Knobs) -> None:
        self.overwrite, self.knobs = overwrite, knobs
        scheme = url_scheme(out_path)
        self.store = None
        if scheme not in (None, "file"):
            parent, _, name = out_path.rpartition("/")
            if "://" not in parent or not name:
                raise StorageError(f"{out_path}: an output URL needs a file name after its bucket or prefix, e.g. s3://bucket/model.safetensors")
            self.store, self.name = open_storage(parent), check_name(name)
            self.where = f"{self.store.url.rstrip('/')}/{name}"
            if not overwrite and name in self.store.list():
                raise CheckpointExistsError(f"{self.where}: object exists; pass overwrite=True to replace it")
            return
        self.where = os.path.abspath(out_path[len("file://") :] if scheme == "file" else check_local_path(out_path))
        if not overwrite and os.path.lexists(self.where):
            raise CheckpointExistsError(f"{self.where}: file exists; pass overwrite=True to replace it")
        self.parent, base = os.path.split(self.where)
        self.name = f"tmp-{uuid.uuid4().hex[:12]}-{base}"

    def writer(self) -> AbstractContextManager[Writer]:
        if self.store is not None:
            return self.store.write_file(self.name)
        os.makedirs(self.parent, exist_ok=True)
        return LocalStorage(self.parent, knobs=self.knobs).write_file(self.name)

    def publish(self) -> None:
        if self.store is None:
            _publish(os.path.join(self.parent, self.name), self.where, overwrite=self.overwrite)

    def discard(self) -> None:
        if self.store is None:
            try:
                os.unlink(os.path.join(self.parent, self.name))
            except FileNotFoundError:
                pass


def _publish(tmp: str, out: str, *, overwrite: bool) -> None:
    try:
        if overwrite:
            os.replace(tmp, out)
        else:
            os.link(tmp, out)  # fails if ``out`` appeared meanwhile: never clobber
            os.unlink(tmp)
        dfd = os.open(os.path.dirname(out), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except FileExistsError:
        raise CheckpointExistsError(f"{out}: file exists; pass overwrite=True to replace it") from None
    except OSError as e:
        raise StorageError(f"{out}: cannot move the finished file into place: {e.strerror}") from e
