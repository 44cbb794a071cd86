"""Streaming unshard: a whole checkpoint (or the keys under one prefix) into one safetensors file.

Every shape and dtype is known from ``metadata.json``, so the output's header and layout are
computed first and written before any tensor byte. Then tensors are filled one at a time, in
file order, into one reused buffer the size of the largest tensor (loaded in place by the
:class:`~shardsafe.engine.reader.Reader`, which checks every whole chunk's CRC32C), and written
out. Peak memory is the largest tensor plus the reader's bounded scratch, whatever the total.

The output is written to a temporary file beside ``out_path``, fsynced, and renamed into place
(then the directory is fsynced): a crash leaves either no file or the complete one. Needs no
process group; call it from one process.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from typing import Any

import torch

from ..adapters import describe_state
from ..errors import CheckpointError, CheckpointExistsError, MissingKeyError, StorageError
from ..format.dtypes import SAFETENSORS_CODE
from ..format.metadata import StorageMetadata, TensorStorageMetadata
from ..format.safetensors_file import FileEntry, layout_file
from ..knobs import KNOBS, Knobs
from ..storage import open_storage
from .buffers import byte_view
from .reader import Reader

__all__ = ["unshard_to_safetensors"]

log = logging.getLogger(__name__)

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

    Peak memory is about the largest selected tensor plus ``knobs.read_buffer_bytes``. Every whole
    chunk read is checked against its CRC32C. The file appears atomically and durably (fsynced
    temporary file, renamed); an existing ``out_path`` is replaced only with ``overwrite=True``.
    Needs no process group.

    Returns counts: ``tensors``, ``bytes`` (tensor data), ``file_bytes`` (the whole file),
    ``values`` (JSON values written to ``__metadata__``), ``skipped_values`` (pickled values left out).
    """
    from ..checkpointer import _read_metadata  # the one metadata reader (incomplete-checkpoint errors)
    from ..dist import get_comm

    knobs = knobs or KNOBS
    out = os.path.abspath(os.fspath(out_path))
    if not overwrite and os.path.lexists(out):
        raise CheckpointExistsError(f"{out}: file exists; pass overwrite=True to replace it")
    storage = open_storage(dir)
    meta = _read_metadata(storage, get_comm(no_dist=True))
    tensors, values, skipped = _select(meta, prefix, storage.url)
    file_meta = {FORMAT_TAG[0]: FORMAT_TAG[1], **{k: json.dumps(v, separators=(",", ":")) for k, v in values.items()}}

    # the official writer's order: larger itemsize first, then by name, so that every tensor
    # starts at a multiple of its itemsize (the header is padded to 8)
    order = sorted(tensors, key=lambda name: (-tensors[name][1].torch_dtype.itemsize, name))
    entries = [_entry(name, tensors[name][1]) for name in order]
    layout = layout_file(entries, file_meta)
    largest = max((e.nbytes for e in entries), default=0)

    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.tmp-{uuid.uuid4().hex}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as e:
        raise StorageError(f"{tmp}: cannot create: {e.strerror}") from e
    done = False
    try:
        try:
            _write_all(fd, memoryview(layout.header))
            buf = torch.empty(largest, dtype=torch.uint8)  # reused for every tensor: pages fault in once
            with Reader(storage, knobs) as reader:
                for name, entry in zip(order, entries):
                    key, tm = tensors[name]
                    target = buf[: entry.nbytes].view(tm.torch_dtype).view(tm.shape)
                    (lt,), _ = describe_state({key: target})
                    reader.load_tensor(tm, lt)
                    if entry.nbytes:
                        _write_all(fd, byte_view(target), block=knobs.write_block_bytes)
            os.fsync(fd)
        except OSError as e:
            if isinstance(e, CheckpointError):
                raise
            raise StorageError(f"{tmp}: write failed: {e.strerror}") from e
        finally:
            os.close(fd)
        _publish(tmp, out, overwrite=overwrite)
        done = True
    finally:
        if not done:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
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

    def strip(key: str) -> str | None:
        if prefix is None:
            return key
        return key[len(prefix) :] if key.startswith(prefix) else None

    tensors: dict[str, tuple[str, TensorStorageMetadata]] = {}
    values: dict[str, Any] = {}
    for key, tm in meta.tensors.items():
        name = strip(key)
        if name is not None:
            tensors[name] = (key, tm)
    for key, v in meta.objects.items():
        name = strip(key)
        if name is not None:
            values[name] = v
    skipped = sum(1 for key in meta.pickled_objects if strip(key) is not None)
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


def _entry(name: str, tm: TensorStorageMetadata) -> FileEntry:
    dtype = tm.torch_dtype
    numel = 1
    for n in tm.shape:
        numel *= n
    return FileEntry(name, SAFETENSORS_CODE[dtype], tuple(tm.shape), numel * dtype.itemsize)


def _write_all(fd: int, data: memoryview, block: int = 1 << 30) -> None:
    view = data.cast("B") if data.format != "B" else data
    block = max(block, 1)
    while view.nbytes:
        n = os.write(fd, view[:block])
        view = view[n:]


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
