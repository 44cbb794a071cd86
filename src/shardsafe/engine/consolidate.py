"""Streaming unshard: a whole checkpoint (or the keys under one prefix) into safetensors files,
the engine of :func:`shardsafe.unshard_to_safetensors` (where the files go and how they appear:
:mod:`shardsafe.engine.outputs`).

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
from collections.abc import Callable
from typing import Any

import torch

from .._progress import Progress
from ..adapters import describe_state
from ..adapters.subclasses import inner_keys, is_record
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    MissingKeyError,
    ShardingError,
)
from ..format.checksum import ChunkSums
from ..format.dtypes import SAFETENSORS_CODE
from ..format.geometry import row_major_strides
from ..format.metadata import StorageMetadata, TensorStorageMetadata, keys_under
from ..format.safetensors_file import FileEntry, layout_file
from ..knobs import Knobs
from ..storage import Storage
from .bounds import check_files_hold
from .buffers import WriteBehind, byte_view
from .outputs import OutputFile
from .reader import Reader
from .subclass_values import DequantizedEntry, load_whole

__all__ = ["FORMAT_TAG", "export_tensors"]

log = logging.getLogger(__name__)

_RING = 4  # blocks of the direct copy: read, checksummed, queued, being written

# Written into every output's ``__metadata__``: transformers refuses a safetensors file whose
# metadata lacks a known "format".
FORMAT_TAG = ("format", "pt")


def export_tensors(
    storage: Storage,
    meta: StorageMetadata,
    *,
    prefix: str | None,
    dtype: torch.dtype | None,
    max_shard_size: int | None,
    open_outputs: Callable[[int], list[OutputFile]],
    progress: Progress | None,
    knobs: Knobs,
    dequantize: bool = False,
) -> tuple[dict[str, int], list[list[str]], list[OutputFile]]:
    """Stream the tensors of the checkpoint ``meta`` describes (those under ``prefix``, without
    it) into safetensors files: one, or files of at most ``max_shard_size`` bytes each (tensors
    in name order; a larger tensor gets a file of its own). ``open_outputs(n)`` gives the ``n``
    files to write; each is published once written. Returns the counts, the tensor names of each
    file and the files. A tensor subclass is written as its high-precision tensor with
    ``dequantize``, and refused without it."""
    tensors, values, skipped = _select(meta, prefix, storage.url, dequantize)
    # before allocating from their sizes; a dequantized subclass is read from its inner tensors
    check_files_hold(storage, [p for k, tm in tensors.values() for p in (tm.inner if isinstance(tm, DequantizedEntry) else [(k, tm)])])
    file_meta = {FORMAT_TAG[0]: FORMAT_TAG[1], **{k: json.dumps(v, separators=(",", ":")) for k, v in values.items()}}
    cast = {name: _cast_to(tm.torch_dtype, dtype) for name, (_, tm) in tensors.items()}
    entries = {name: _entry(name, tm, cast[name]) for name, (_, tm) in tensors.items()}
    groups = [sorted(tensors)] if max_shard_size is None else _shards(sorted(tensors), entries, max_shard_size)
    total = sum(e.nbytes for e in entries.values())
    counter = _Progress(progress, total)
    outputs = open_outputs(len(groups))
    file_bytes = 0
    with Reader(storage, knobs) as reader:
        for names, output in zip(groups, outputs):
            file_bytes += _write_file(storage, reader, output, {n: tensors[n] for n in names}, entries, cast, file_meta, knobs, counter)
            log.debug("unshard %s: wrote %s (%d tensors)", storage.url, output.where, len(names))
    counts = {"tensors": len(entries), "bytes": total, "file_bytes": file_bytes, "values": len(values), "skipped_values": skipped}
    return counts, groups, outputs


def _write_file(
    storage: Any,
    reader: Reader,
    output: OutputFile,
    tensors: dict[str, tuple[str, TensorStorageMetadata]],
    all_entries: dict[str, FileEntry],
    cast: dict[str, torch.dtype | None],
    file_meta: dict[str, str],
    knobs: Knobs,
    counter: _Progress,
) -> int:
    """Stream ``tensors`` (output name -> (stored key, metadata)) into the one file ``output``;
    returns its size. On any error the partial file is discarded."""
    # the official writer's order: larger itemsize first, then by name, so that every tensor
    # starts at a multiple of its itemsize (the header is padded to 8)
    order = sorted(tensors, key=lambda name: (-_out_dtype(tensors[name][1], cast[name]).itemsize, name))
    entries = [all_entries[name] for name in order]
    layout = layout_file(entries, file_meta)
    directs = {name: _direct_runs(tensors[name][1]) for name in order}
    largest_other = max((tensors[name][1].torch_dtype.itemsize * _numel(tensors[name][1]) for name in order if directs[name] is None), default=0)
    largest_cast = max((e.nbytes for name, e in zip(order, entries) if directs[name] is None and cast[name] is not None), default=0)
    block = min(max(knobs.write_block_bytes, 1 << 16), max((r[2] for rs in directs.values() if rs for r in rs), default=0))
    # a cast block holds a block's elements in the output dtype: at most this many bytes
    ratio = max((cast[n].itemsize / tensors[n][1].torch_dtype.itemsize for n in order if cast[n] is not None and directs[n]), default=0)  # type: ignore[union-attr]

    done = False
    try:
        with output.writer() as w, WriteBehind(w, depth=_RING - 2) as behind:
            behind.write(memoryview(layout.header))
            ring = [torch.empty(block, dtype=torch.uint8) for _ in range(_RING if block else 0)]
            cring = [torch.empty(int(block * ratio) + 8, dtype=torch.uint8) for _ in range(_RING if block and ratio else 0)]
            slot = 0
            buf = torch.empty(largest_other, dtype=torch.uint8)  # reused for every tensor not copied directly
            cbuf = torch.empty(largest_cast, dtype=torch.uint8) if largest_cast else None  # the cast of such a tensor
            for name, entry in zip(order, entries):
                key, tm = tensors[name]
                runs = directs[name]
                to = cast[name]
                if runs is not None:
                    for file, start, nbytes, sums in runs:
                        check = sums.stream()
                        try:
                            for pos in range(0, nbytes, block):
                                view = byte_view(ring[slot][: min(block, nbytes - pos)])
                                storage.read_into(file, start + pos, [view])
                                check.update(view)  # before the bytes are handed on
                                if to is not None:
                                    src = ring[slot][: view.nbytes].view(tm.torch_dtype)
                                    dst = cring[slot][: src.numel() * to.itemsize].view(to)
                                    dst.copy_(src)
                                    view = byte_view(dst)
                                slot = (slot + 1) % _RING
                                behind.write(view)
                                counter.add(view.nbytes)
                            check.finish()
                        except CorruptCheckpointError as e:
                            raise CorruptCheckpointError(f"key {key!r}: {e}") from None
                    continue
                behind.flush()  # the buffer's last tensor is written: reuse it
                target = buf[: _numel(tm) * tm.torch_dtype.itemsize].view(tm.torch_dtype).view(tm.shape)
                if isinstance(tm, DequantizedEntry):
                    target.copy_(load_whole(reader, tm.meta, storage.url, key, dequantize=True)[0])
                else:
                    (lt,), _ = describe_state({key: target})
                    reader.load_tensor(tm, lt)
                if to is not None and entry.nbytes:
                    converted = cbuf[: entry.nbytes].view(to).view(tm.shape)  # type: ignore[index]
                    converted.copy_(target)
                    target = converted
                mv = byte_view(target) if entry.nbytes else memoryview(b"")
                step = max(block, 1 << 24)
                for pos in range(0, mv.nbytes, step):
                    behind.write(mv[pos : pos + step])
                counter.add(mv.nbytes)
        output.publish()
        done = True
    finally:
        if not done:
            output.discard()
    return layout.size


def _numel(tm: TensorStorageMetadata) -> int:
    numel = 1
    for n in tm.shape:
        numel *= n
    return numel


def _cast_to(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype a tensor stored as ``stored`` is cast to on export, or None to copy it as is."""
    if dtype is None or dtype == stored or not stored.is_floating_point:
        return None
    return dtype


def _out_dtype(tm: TensorStorageMetadata, cast: torch.dtype | None) -> torch.dtype:
    return cast if cast is not None else tm.torch_dtype


def _shards(names: list[str], entries: dict[str, FileEntry], limit: int) -> list[list[str]]:
    """Names (sorted) split into files of at most ``limit`` bytes each, in order, as
    ``transformers`` splits a state dict; a tensor larger than the limit gets a file of its own."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = entries[name].nbytes
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


class _Progress:
    def __init__(self, fn: Callable[[int, int], None] | None, total: int) -> None:
        self.fn, self.total, self.done = fn, total, 0

    def add(self, n: int) -> None:
        self.done += n
        if self.fn is not None:
            self.fn(self.done, self.total)


def _select(
    meta: StorageMetadata, prefix: str | None, where: str, dequantize: bool = False
) -> tuple[dict[str, tuple[str, Any]], dict[str, Any], int]:
    """Output name -> (stored key, metadata) for the selected tensors (a subclass's stand-in
    with ``dequantize``); selected JSON values; pickled count."""
    inner = inner_keys(meta.objects, where)
    tensors: dict[str, tuple[str, Any]] = {
        name: (key, meta.tensors[key]) for name, key in keys_under([k for k in meta.tensors if k not in inner], prefix).items()
    }
    records = keys_under([k for k, v in meta.objects.items() if is_record(v)], prefix)
    for name, key in records.items():
        if not dequantize:
            raise ShardingError(
                f"{where}: key {key!r} is a {meta.objects[key].get('class')}; pass dequantize=True to export its "
                "high-precision values (--dequantize on the command line)"
            )
        tensors[name] = (key, DequantizedEntry(meta.objects[key], meta))
    values = {name: meta.objects[key] for name, key in keys_under(meta.objects, prefix).items() if key not in records.values()}
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


def _direct_runs(tm: Any) -> list[tuple[str, int, int, ChunkSums]] | None:
    """If every chunk of ``tm`` is one contiguous run of the row-major tensor: the chunks as
    (file, byte start, bytes, checksums) in output order. Else None."""
    if isinstance(tm, DequantizedEntry):  # built whole from its inner tensors
        return None
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


def _entry(name: str, tm: TensorStorageMetadata, cast: torch.dtype | None = None) -> FileEntry:
    dtype = _out_dtype(tm, cast)
    return FileEntry(name, SAFETENSORS_CODE[dtype], tuple(tm.shape), _numel(tm) * dtype.itemsize)


