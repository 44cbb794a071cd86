"""``shardsafe.dcp.StorageWriter``: ``torch.distributed.checkpoint.save`` writes a shardsafe checkpoint.

DCP's planner decides what each rank writes (its own shards; a replicated value once, by one
rank); this writer decides how, in the format every shardsafe save writes (v3,
``docs/format.md``): each rank streams its tensor chunks into its own safetensors file, laid out
by :func:`shardsafe.planning.save_plan.file_layout` (entry names of §4.4) and ending with the
``__shardsafe_checksums__`` entry (the XXH3-64 of every block, §4.2, §6); non-tensor values go
into ``metadata.json`` as JSON; the coordinator builds the file table and each tensor's chunk
table and commits ``metadata.json`` last, by the same compare-and-swap as
:mod:`shardsafe.engine.writer`.

Call order (DCP's; one instance plays the coordinator on rank 0 and a follower elsewhere):

1. ``reset(checkpoint_id)`` (all ranks): a new save; ``checkpoint_id`` replaces the location.
2. ``set_up_storage_writer`` (all ranks).
3. ``prepare_local_plan`` (all ranks): refuses dtypes safetensors cannot hold, before any write.
4. ``prepare_global_plan`` (coordinator): lists the location and reads the version of its
   ``metadata.json``; refuses a committed checkpoint unless ``overwrite``; draws the save id.
5. ``write_data`` (all ranks): writes this rank's data file (none if it holds no chunk) and
   returns each chunk's box and its file's row of the file table (name, size, header length,
   header and checksum-entry digests), and each value encoded.
6. ``finish`` (coordinator): builds ``metadata.json``, checks that the chunks tile every tensor,
   commits it only over the version read in step 4, then removes earlier saves' files.

A failure on any rank before step 6 leaves the location's committed checkpoint (if any) as it
was; the failed save's data files stay until the next save there commits and removes them.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import uuid
from dataclasses import dataclass, replace
from math import prod
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._args import check_bool
from ..adapters.subclasses import as_plain, class_path
from ..engine.buffers import WriteBehind, byte_view, resolve_lazy
from ..engine.commit import CommitUnknownError, committed_version, put_metadata, sweep
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    DtypeMismatchError,
    ShapeMismatchError,
    ShardingError,
    StorageError,
)
from ..format.checksum import DEFAULT_ALGORITHM, digest_blocks, file_digest
from ..format.chunk_table import ChunkTable
from ..format.dtypes import SAFETENSORS_CODE, dtype_name
from ..format.geometry import check_tiling
from ..format.metadata import ChecksumConfig, DataFile, StorageMetadata
from ..format.metadata import TensorStorageMetadata as OurTensorMetadata
from ..format.values import encode_tagged, merge_rank_objects
from ..knobs import KNOBS, Knobs
from ..planning.save_plan import data_file_name, file_layout
from ..storage import Location
from ..storage.base import DCP_METADATA
from ._location import Located
from .values import value_of

__all__ = ["StorageWriter"]

_OPT_IN = "or pass allow_pickle=True to shardsafe.dcp.StorageWriter to store it with pickle"

log = logging.getLogger(__name__)
_USED_SAVE_IDS: set[str] = set()  # a plan DCP replays from its plan cache carries an old id: never reuse one


@dataclass(frozen=True)
class _RankPlan:
    """The coordinator's word to one rank (``SavePlan.storage_data``)."""

    rank: int
    save_id: str
    block_bytes: int  # the checksum block size every rank's file uses: the coordinator's knob


@dataclass(frozen=True)
class _StoredFile:
    """A rank's data file, as the coordinator's file table needs it (format v3, §3.3), and the
    checksum block size it was written with."""

    name: str
    size: int
    header_bytes: int
    header: str
    sums: str
    block_bytes: int


@dataclass(frozen=True)
class _StoredChunk:
    """Where a rank wrote one tensor chunk (``WriteResult.storage_data``): its file (one object
    shared by the rank's chunks, so it travels once) and its box. Its entry name, byte range and
    block digests are in the file's header and checksum entry."""

    file: _StoredFile
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclass(frozen=True)
class _StoredValue:
    """A non-tensor value, encoded (``WriteResult.storage_data``)."""

    as_json: dict[str, Any]
    pickled: dict[str, str]


class StorageWriter(Located, _DcpStorageWriter):
    """A ``torch.distributed.checkpoint`` storage writer that writes shardsafe checkpoints.

    ``dcp.save(state_dict, storage_writer=shardsafe.dcp.StorageWriter(path))`` on every rank
    writes a checkpoint that ``shardsafe.Checkpointer``, ``shardsafe.verify`` and
    :class:`shardsafe.dcp.StorageReader` read. ``path`` is anything ``shardsafe`` takes as a
    location: a directory, ``s3://``/``gs://``/``az://`` URLs (``storage_options`` go to
    :func:`shardsafe.storage.open_storage`), or a ``Storage``; it may be left out and given as
    ``dcp.save(..., checkpoint_id=path)``.

    ``overwrite``: replace a checkpoint already committed there (it stays loadable until the new
    one commits); otherwise such a save fails with ``CheckpointExistsError`` before writing.
    Non-tensor values that JSON cannot hold but shardsafe's tagged JSON can (tuples such as
    AdamW's ``betas``, ``OrderedDict``, NaN and infinities, NumPy scalars, sets, bytes, torch
    dtypes; ``docs/format.md`` §13) are stored as tagged JSON and come back as they were.
    ``allow_pickle``: store the other values (arbitrary objects) with pickle; otherwise they are
    refused with ``PickleNotAllowedError`` naming the key path of the offending part.
    Saving with ``use_collectives=False`` (rank-local metadata) is refused: a shardsafe
    checkpoint is committed by one ``metadata.json``.
    """

    _name, _dcp_call = "shardsafe.dcp.StorageWriter", "dcp.save"

    def __init__(
        self,
        path: Location | None = None,
        *,
        overwrite: bool = False,
        allow_pickle: bool = False,
        knobs: Knobs | None = None,
        **storage_options: Any,
    ) -> None:
        super().__init__()
        check_bool("shardsafe.dcp.StorageWriter", "overwrite", overwrite)
        check_bool("shardsafe.dcp.StorageWriter", "allow_pickle", allow_pickle)
        self._set_location(path, storage_options)
        self.overwrite = overwrite
        self.allow_pickle = allow_pickle
        self.knobs = knobs or KNOBS
        self._reset_save()

    # -- DCP's interface ------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._relocate(checkpoint_id)
        self._reset_save()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise CheckpointError(
                f"{self._url()}: shardsafe.dcp.StorageWriter needs use_collectives=True: a shardsafe checkpoint is committed "
                "by one metadata.json that the coordinator writes after every rank has written"
            )
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:
            if item.tensor_data is not None:
                dtype_name(item.tensor_data.properties.dtype, key=item.index.fqn)  # DtypeMismatchError before any write
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        storage = self._open()
        self._listed = storage.list()  # before this save writes anything (see engine.commit.sweep)
        self._seen = committed_version(storage)
        if not self.overwrite and (self._seen is not None or DCP_METADATA in self._listed):
            kind = "shardsafe checkpoint" if self._seen is not None else "torch.distributed.checkpoint checkpoint"
            raise CheckpointExistsError(
                f"{storage.url}: a {kind} is already committed there; pass overwrite=True to shardsafe.dcp.StorageWriter "
                "to replace it, or save to a new location"
            )
        save_id = uuid.uuid4().hex[:12]
        self._save_id = save_id
        block_bytes = self.knobs.checksum_block_bytes
        return [replace(p, storage_data=_RankPlan(rank, save_id, block_bytes)) for rank, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rp = plan.storage_data
        if not isinstance(rp, _RankPlan):
            raise CheckpointError(f"{self._url()}: the save plan carries no shardsafe file assignment; was it made by this writer?")
        save_id = rp.save_id if rp.save_id not in _USED_SAVE_IDS else uuid.uuid4().hex[:12]
        _USED_SAVE_IDS.add(save_id)
        results: list[WriteResult] = []
        tensors: list[WriteItem] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                results.append(self._value_result(item, planner))
            elif item.tensor_data is not None and prod(item.tensor_data.chunk.sizes):
                tensors.append(item)
            else:  # no elements: nothing is stored (format: pieces with no elements are not stored)
                results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=None))
        if tensors:
            results += self._write_file(rp, data_file_name(rp.rank, save_id), tensors, planner)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = self._open()
        written = sorted({sd.file.name for rs in results for r in rs if isinstance(sd := r.storage_data, _StoredChunk)})
        try:
            meta = self._metadata(metadata, results)
            raw = meta.to_json()
            put_metadata(storage, raw, seen=self._seen, save_overwrite=self.overwrite)
        except CommitUnknownError:
            raise  # the data files stay: a metadata.json naming them may have been committed
        except BaseException:
            for name in written:  # leave nothing of a failed save behind
                try:
                    storage.delete(name)
                except StorageError as e:
                    log.warning("%s: removing a data file of a failed save failed: %s", storage.url, e)
            raise
        sweep(storage, self._listed, keep=meta.data_files())

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self._url())

    @property
    def checkpoint_id(self) -> str:
        return self._url()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # -- the work --------------------------------------------------------------------------------

    def _reset_save(self) -> None:
        self.is_coordinator = False
        self._listed: list[str] = []
        self._seen: str | None = None
        self._save_id: str | None = None

    def _value_result(self, item: WriteItem, planner: SavePlanner) -> WriteResult:
        key = item.index.fqn
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

        if isinstance(planner, DefaultSavePlanner) and type(planner).transform_object is DefaultSavePlanner.transform_object:
            value = planner.lookup_object(item.index)  # the object itself, before DCP would pickle it
        else:  # a planner of its own: what it resolves is what is stored
            value = value_of(planner.resolve_data(item), key, allow_pickle=self.allow_pickle)
        as_json, pickled = encode_tagged({key: value}, allow_pickle=self.allow_pickle, opt_in=_OPT_IN)
        size = len(pickled[key]) if key in pickled else len(json.dumps(as_json[key]))
        return WriteResult(index=item.index, size_in_bytes=size, storage_data=_StoredValue(as_json, pickled))

    def _write_file(self, rp: _RankPlan, file: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        """Lay out and write this rank's data file (format v3): the header, each chunk's bytes
        (each block digested on the way), then the checksum entry holding those digests."""
        cblock = rp.block_bytes
        facts = {}
        for item in items:
            td = item.tensor_data
            facts[item.index.fqn] = (tuple(td.size), SAFETENSORS_CODE[td.properties.dtype], td.properties.dtype.itemsize)
        chunks = [(item.index.fqn, tuple(item.tensor_data.chunk.offsets), tuple(item.tensor_data.chunk.sizes), None) for item in items]
        layout = file_layout(chunks, facts, cblock, who=f"rank {rp.rank}")
        block = max(cblock, self.knobs.write_block_bytes - self.knobs.write_block_bytes % cblock)
        digests: list[int] = []  # every block of the file, entry after entry (the entries' byte order)
        with self._open().write_file(file) as out, WriteBehind(out) as behind:
            behind.write(memoryview(layout.header))
            for item in items:
                view = byte_view(_resolved_tensor(item, planner))  # checked against the plan: end - begin bytes
                for pos in range(0, view.nbytes, block):
                    part = view[pos : pos + block]
                    digest_blocks(part, cblock, digests)
                    behind.write(part)
            sums = struct.pack(f"<{len(digests)}Q", *digests)  # ceil(bytes / block) per entry: what the layout made room for
            behind.write(memoryview(sums))
        stored = _StoredFile(file, layout.size, len(layout.header), file_digest(layout.header), file_digest(sums), cblock)
        return [
            WriteResult(index=item.index, size_in_bytes=end - begin, storage_data=_StoredChunk(stored, offsets, lengths))
            for item, (_key, offsets, lengths, _flat), (begin, end) in zip(items, chunks, layout.byte_ranges)
        ]

    def _metadata(self, metadata: Metadata, results: list[list[WriteResult]]) -> StorageMetadata:
        """``metadata.json`` (format v3) from DCP's global metadata and every rank's results."""
        chunks: dict[str, list[_StoredChunk]] = {}
        files: dict[str, _StoredFile] = {}
        values = []
        for rank_results in results:
            for r in rank_results:
                sd = r.storage_data
                if isinstance(sd, _StoredChunk):
                    chunks.setdefault(r.index.fqn, []).append(sd)
                    files[sd.file.name] = sd.file
                elif isinstance(sd, _StoredValue):
                    values.append((sd.as_json, sd.pickled))
        block_bytes = {f.block_bytes for f in files.values()} or {self.knobs.checksum_block_bytes}
        if len(block_bytes) > 1:  # each rank uses the size its plan carries: plans of two saves mixed
            raise CheckpointError(
                f"{self._url()}: the ranks wrote their data files with different checksum block sizes "
                f"({sorted(block_bytes)} bytes); were their save plans made by one shardsafe.dcp.StorageWriter?"
            )
        table = [
            DataFile(name=f.name, size=f.size, header_bytes=f.header_bytes, header=f.header, sums=f.sums)
            for f in sorted(files.values(), key=lambda f: f.name)  # rank order: data_file_name pads the rank
        ]
        numbers = {f.name: i for i, f in enumerate(table)}
        as_json, pickled = merge_rank_objects(values)
        tensors: dict[str, OurTensorMetadata] = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                if key not in as_json and key not in pickled:
                    raise CheckpointError(f"{self._url()}: value {key!r} is in the save plan but no rank wrote it")
                continue
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"{self._url()}: key {key!r}: DCP metadata of type {type(md).__name__} cannot be stored")
            shape = tuple(md.size)
            mine = chunks.pop(key, [])
            check_tiling(key, shape, [(c.offsets, c.lengths, None) for c in mine])  # ShardingError naming the gap
            whole = len(mine) == 1 and mine[0].lengths == shape
            rows = [(numbers[c.file.name], c.offsets, c.lengths, None) for c in mine]
            tensors[key] = OurTensorMetadata.from_table(
                shape, dtype_name(md.properties.dtype, key=key), not whole, ChunkTable.from_chunks(rows, len(shape))
            )
        if chunks:
            raise CheckpointError(f"{self._url()}: ranks wrote chunks of {sorted(chunks)[:5]}, which DCP's metadata does not name")
        return StorageMetadata(
            checksum=ChecksumConfig(algorithm=DEFAULT_ALGORITHM, block_bytes=block_bytes.pop()),
            file_table=table,
            tensors=tensors,
            objects=as_json,
            pickled_objects=pickled,
        )


def _resolved_tensor(item: WriteItem, planner: SavePlanner) -> torch.Tensor:
    """The chunk's data as a contiguous CPU tensor, checked against the plan."""
    key = item.index.fqn
    data = planner.resolve_data(item)
    if not isinstance(data, torch.Tensor):
        raise CheckpointError(f"key {key!r}: the save planner resolved a {type(data).__name__} for a tensor chunk")
    plain = as_plain(key, data)  # a float8 all-gather weight: the high-precision tensor it stands for
    if plain is None:  # its inner tensors are not in DCP's plan: its bytes are not the tensor's
        raise ShardingError(
            f"key {key!r}: a {class_path(type(data))} is a tensor subclass; DCP's planner sees it as one tensor, not "
            "the inner tensors it holds, so shardsafe.dcp cannot store it. Save it with shardsafe.Checkpointer or "
            "shardsafe.save_model_and_optim_state, which store allow-listed subclasses by their inner tensors "
            "(README, Tensor subclasses)"
        )
    data = plain
    td = item.tensor_data
    if data.dtype != td.properties.dtype:
        raise DtypeMismatchError(f"key {key!r}: the save planner resolved a {data.dtype} tensor, its plan says {td.properties.dtype}")
    if tuple(data.shape) != tuple(td.chunk.sizes):
        raise ShapeMismatchError(
            f"key {key!r}: the save planner resolved a chunk of shape {list(data.shape)}, its plan says {list(td.chunk.sizes)}"
        )
    data = resolve_lazy(data.detach())
    if data.device.type != "cpu":
        data = data.to("cpu")
    return data.contiguous()
