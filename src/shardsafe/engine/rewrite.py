"""Write chunks read from another checkpoint as a committed shardsafe checkpoint (format v3).

The converters of DCP and Megatron-Core checkpoints (:mod:`shardsafe.dcp.convert`,
:mod:`shardsafe.megatron.convert`) decide which chunks go into which new data file (one per
source file, read front to back); this module lays the files out, streams each chunk in as it
is loaded (one chunk written while the next loads), checksums it, and commits ``metadata.json``
last with the same compare-and-swap as a save. A failure removes the files written so far.
"""

from __future__ import annotations

import logging
import struct
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .._gc import paused_gc
from ..errors import CorruptCheckpointError, StorageError
from ..format.checksum import DEFAULT_ALGORITHM, digest_blocks, file_digest
from ..format.chunk_table import ChunkTable
from ..format.dtypes import SAFETENSORS_CODE, dtype_name
from ..format.metadata import ChecksumConfig, DataFile, StorageMetadata, TensorStorageMetadata
from ..knobs import Knobs
from ..planning.save_plan import data_file_name, file_layout
from ..storage import Storage
from .buffers import WriteBehind, byte_view
from .commit import CommitUnknownError, put_metadata, sweep
from .file_index import bind_files

__all__ = ["Chunk", "write_checkpoint"]

log = logging.getLogger(__name__)

Shape = tuple[int, ...]
_SMALL_CHUNK = 64 << 10  # chunks below this are copied into a batch, not queued one by one
_BATCH = 1 << 20  # a batch of small chunks is written once it holds this many bytes


class Chunk(NamedTuple):
    """One chunk to write: its tensor, box, flattened range (None: the whole box), and whatever
    the caller's ``load`` needs to read it."""

    key: str
    offsets: Shape
    lengths: Shape
    flat: tuple[int, int] | None
    source: Any


class _Row(NamedTuple):
    """A chunk as its tensor's chunk table holds it: which file, its box and flattened range."""

    file: int
    offsets: Shape
    lengths: Shape
    flat: tuple[int, int] | None


@paused_gc()  # an object or more per chunk, none of them cyclic: no collector passes over a growing heap
def write_checkpoint(
    out: Storage,
    files: list[list[Chunk]],
    tensors: dict[str, tuple[torch.dtype, Shape]],
    load: Callable[[Chunk], torch.Tensor],
    *,
    objects: dict[str, Any],
    pickled: dict[str, str],
    listed: list[str],
    seen: str | None,
    overwrite: bool,
    knobs: Knobs,
    report: Callable[[int], None],
    where: str,
) -> StorageMetadata:
    """Write ``files`` (each a list of chunks, in the order to read them) into ``out`` and commit.

    ``tensors[key]`` is each tensor's dtype and global shape (a tensor may have no chunk: no
    elements); ``load(chunk)`` returns the chunk's elements (its box, or its flattened range).
    ``listed`` and ``seen`` are what ``out`` held before (see :func:`.commit.sweep`);
    ``report(bytes done)`` is called after each chunk. Returns the committed metadata, bound to ``out``.
    """
    cblock = knobs.checksum_block_bytes
    facts = {key: (shape, SAFETENSORS_CODE[dtype], dtype.itemsize) for key, (dtype, shape) in tensors.items()}
    save_id = uuid.uuid4().hex[:12]
    plans = [
        (data_file_name(i, save_id), chunks, file_layout([c[:4] for c in chunks], facts, cblock, who=f"data file {i}"))
        for i, chunks in enumerate(files)
        if chunks
    ]
    rows: dict[str, list[_Row]] = {key: [] for key in tensors}
    table: list[DataFile] = []
    written: list[str] = []
    done = 0
    try:
        for number, (name, chunks, layout) in enumerate(plans):
            written.append(name)
            digests: list[int] = []
            with out.write_file(name) as raw_out, WriteBehind(raw_out, depth=1) as w:  # one chunk written while the next loads
                small = bytearray(layout.header)  # small chunks are copied together, written a batch at a time
                for c, (begin, end) in zip(chunks, layout.byte_ranges):
                    t = load(c).contiguous()
                    data = byte_view(t)
                    if data.nbytes != end - begin:
                        raise CorruptCheckpointError(
                            f"{where}: tensor {c.key!r}, chunk at {list(c.offsets)}: read {data.nbytes} bytes, its box needs {end - begin}"
                        )
                    digest_blocks(data, cblock, digests)
                    if data.nbytes < _SMALL_CHUNK:
                        small += data
                        if len(small) >= _BATCH:
                            w.write(memoryview(small))  # the writing thread keeps it alive; the next batch is a new one
                            small = bytearray()
                    else:
                        if small:
                            w.write(memoryview(small))
                            small = bytearray()
                        w.write(data)
                    del t, data
                    rows[c.key].append(_Row(number, tuple(c.offsets), tuple(c.lengths), None if c.flat is None else tuple(c.flat)))
                    done += end - begin
                    report(done)
                sums = struct.pack(f"<{len(digests)}Q", *digests)
                small += sums
                w.write(memoryview(small))
            table.append(
                DataFile(name=name, size=layout.size, header_bytes=len(layout.header), header=file_digest(layout.header), sums=file_digest(sums))
            )
        stored = {}
        same: dict[tuple, tuple[ChunkTable, dict[str, Any]]] = {}  # tensors of one layout share their table (as a load does)
        for key, (dtype, shape) in tensors.items():
            mine = tuple(rows.pop(key))
            whole = len(mine) == 1 and mine[0].flat is None and tuple(mine[0].lengths) == tuple(shape)
            if (mine, len(shape)) not in same:
                chunk_table = ChunkTable.from_chunks(mine, len(shape))
                same[mine, len(shape)] = (chunk_table, chunk_table.to_json())
            chunk_table, doc = same[mine, len(shape)]
            stored[key] = TensorStorageMetadata.from_table(shape, dtype_name(dtype, key=key), not whole, chunk_table, table_json=doc)
        meta = StorageMetadata(
            checksum=ChecksumConfig(algorithm=DEFAULT_ALGORITHM, block_bytes=cblock),
            file_table=table,
            tensors=stored,
            objects=objects,
            pickled_objects=pickled,
        )
        put_metadata(out, meta.to_json(), seen=seen, save_overwrite=overwrite)
    except CommitUnknownError:
        raise  # the data files stay: a metadata.json naming them may have been committed
    except BaseException:
        for name in written:
            try:
                out.delete(name)
            except StorageError as e:
                log.warning("%s: removing a data file of a failed conversion failed: %s", out.url, e)
        raise
    sweep(out, listed, keep=meta.data_files())
    return bind_files(meta, out)
