"""``shardsafe.dcp.StorageReader``: ``torch.distributed.checkpoint.load`` reads shardsafe checkpoints,
and DCP's own checkpoints safely.

The location's kind is found when the metadata is read: ``metadata.json`` is a shardsafe
checkpoint (written by ``Checkpointer``, ``save_model_and_optim_state`` or
:class:`shardsafe.dcp.StorageWriter`), ``.metadata`` is a checkpoint of DCP's file system writers.

shardsafe checkpoints: every stored chunk is shown to DCP's planner as boxes. A box chunk is one
DCP chunk; a flattened-range chunk (FSDP1 flat parameters, distributed optimizers) is the
row-major slice of a box, which is exactly a few boxes (at most ``2 * ndim - 1``, see
:func:`shardsafe.format.geometry.flat_segments`), each contiguous in the file: each is one DCP
chunk. Every read item DCP plans is then a box copy out of one of them, run by shardsafe's reader:
in place into the target where it can, widened to whole checksum blocks, every block checked.
Non-tensor values are shown under their own keys and, for containers stored whole under one key
(``optim.param_groups``), under the dotted keys of their leaves as DCP's flattening names them
(``optim.param_groups.0.lr``), so a DCP state dict finds them.

DCP checkpoints: ``.metadata`` is unpickled through an allowlist (:mod:`.distcp`); each stored
chunk is read once (exactly its byte range), loaded by shardsafe's restricted unpickler and
copied into every target box that needs it. DCP stores no checksums.

Call order (DCP's): ``reset`` -> ``read_metadata`` (all ranks) -> ``set_up_storage_reader`` ->
``prepare_local_plan`` -> ``prepare_global_plan`` (coordinator) -> ``read_data`` (all ranks).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from math import prod
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _DcpStorageReader
from torch.futures import Future

from .._args import check_bool
from ..adapters import LocalTensor
from ..adapters.subclasses import as_plain, class_path
from ..engine.background import wait_for_location
from ..engine.file_index import bind_files
from ..engine.foreign import missing_metadata_error
from ..engine.reader import Reader
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    ForeignCheckpointError,
    IncompleteCheckpointError,
    ShapeMismatchError,
    ShardingError,
    StorageError,
)
from ..format.dtypes import dtype_name
from ..format.metadata import METADATA_FILENAME, StorageMetadata
from ..format.values import decode_objects
from ..knobs import KNOBS, Knobs
from ..planning.read_plan import ReadItem as OurReadItem
from ..planning.read_plan import StoredIndex
from ..storage import Location
from ..storage.base import DCP_METADATA
from . import distcp
from ._location import Located
from .values import dcp_leaves, get_path, torch_saved

__all__ = ["StorageReader"]


class StorageReader(Located, _DcpStorageReader):
    """A ``torch.distributed.checkpoint`` storage reader for shardsafe checkpoints and DCP's own.

    ``dcp.load(state_dict, storage_reader=shardsafe.dcp.StorageReader(path))`` on every rank
    fills ``state_dict`` in place from the checkpoint at ``path`` (any location shardsafe takes;
    ``storage_options`` go to :func:`shardsafe.storage.open_storage`), whatever layout it was
    saved in. Every byte read from a shardsafe checkpoint is checked against its checksum.
    ``allow_pickle``: load values stored with pickle (a shardsafe checkpoint saved with
    ``allow_pickle=True``; a DCP checkpoint's values that shardsafe's restricted unpickler refuses); they are
    refused with ``PickleNotAllowedError`` otherwise.
    """

    _name, _dcp_call = "shardsafe.dcp.StorageReader", "dcp.load"

    def __init__(self, path: Location | None = None, *, allow_pickle: bool = False, knobs: Knobs | None = None, **storage_options: Any) -> None:
        super().__init__()
        check_bool("shardsafe.dcp.StorageReader", "allow_pickle", allow_pickle)
        self._set_location(path, storage_options)
        self.allow_pickle = allow_pickle
        self.knobs = knobs or KNOBS
        self._ours: _OurCheckpoint | None = None
        self._dcp: distcp.DcpCheckpoint | None = None
        self.load_id = uuid.uuid4().hex

    # -- DCP's interface ------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._relocate(checkpoint_id)
        self._ours = self._dcp = None
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **_options: Any) -> Metadata:
        # (not named **kwargs: DCP would take that as support for rank-local metadata and retry with rank=)
        storage = self._open()
        wait_for_location(storage.url)  # a save in flight from this process to it commits first
        try:
            raw = storage.read(METADATA_FILENAME)
        except FileNotFoundError:
            raw = None
        if raw is not None:
            meta = bind_files(StorageMetadata.from_json(raw, where=f"{storage.url.rstrip('/')}/{METADATA_FILENAME}"), storage)
            self._ours = _OurCheckpoint(meta)
            return self._ours.dcp_metadata(storage.url, self.load_id)
        try:
            listed = storage.list()
        except StorageError:  # the location is a file (a model.safetensors named as a checkpoint)
            listed = []
        if DCP_METADATA not in listed:
            foreign = missing_metadata_error(storage, METADATA_FILENAME)  # a Hugging Face model, a Megatron run's root
            if isinstance(foreign, ForeignCheckpointError):
                raise foreign from None
            files = storage.list()
            state = f"it holds {len(files)} file(s) but" if files else "it is empty or missing, and"
            raise IncompleteCheckpointError(
                f"{storage.url}: not a committed checkpoint: {state} has neither {METADATA_FILENAME} (shardsafe) nor "
                f"{DCP_METADATA} (torch.distributed.checkpoint)"
            )
        self._dcp = distcp.read_dcp_checkpoint(storage)  # .metadata streamed to the unpickler
        meta = self._dcp.metadata
        meta.storage_meta = StorageMeta(checkpoint_id=storage.url, load_id=self.load_id)
        return meta

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._ours is None and self._dcp is None:
            self.read_metadata()
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._ours is not None:
            self._read_ours(self._ours, plan, planner)
        elif self._dcp is not None:
            self._read_dcp(self._dcp, plan, planner)
        else:
            raise CheckpointError("shardsafe.dcp.StorageReader.read_data: read_metadata was not called first")
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @property
    def checkpoint_id(self) -> str:
        return self._url()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # -- the work --------------------------------------------------------------------------------

    def _read_ours(self, ckpt: _OurCheckpoint, plan: LoadPlan, planner: LoadPlanner) -> None:
        storage = self._open()
        values = [it for it in plan.items if it.type == LoadItemType.BYTE_IO]
        if values:
            stored = {ckpt.values[it.storage_index.fqn][0] for it in values}
            decoded = decode_objects(
                ckpt.meta.objects, ckpt.meta.pickled_objects, sorted(stored), allow_pickle=self.allow_pickle, where=storage.url
            )
            for it in values:
                key, path = ckpt.values[it.storage_index.fqn]
                planner.load_bytes(it, torch_saved(get_path(decoded[key], path)))
        pending: dict[int, tuple[ReadItem, torch.Tensor, torch.Tensor]] = {}

        def batches() -> Iterator[tuple[list[OurReadItem], LocalTensor]]:
            for it in plan.items:
                if it.type == LoadItemType.BYTE_IO:
                    continue
                seg, dtype = ckpt.segment(it)
                dest = _plain_target(it.dest_index.fqn, planner.resolve_tensor(it)).detach()
                lengths = tuple(it.lengths)
                if tuple(dest.shape) != lengths:
                    raise ShapeMismatchError(
                        f"key {it.dest_index.fqn!r}: the load planner resolved a target of shape {list(dest.shape)} for a read of {list(lengths)}"
                    )
                buf = dest if dest.dtype == dtype else torch.empty(lengths, dtype=dtype)  # converted when done, as DCP does
                zeros = (0,) * len(lengths)
                target = LocalTensor(it.dest_index.fqn, dtype, dtype_name(dtype), lengths, [(zeros, lengths, None)], [buf])
                pending[id(target)] = (it, dest, buf)
                yield [seg.read_item(tuple(it.storage_offsets), lengths)], target

        def done(target: LocalTensor) -> None:
            it, dest, buf = pending.pop(id(target))
            if buf is not dest:
                with torch.no_grad():
                    dest.copy_(buf)
            planner.commit_tensor(it, dest)

        with Reader(storage, self.knobs) as reader:
            reader.load_planned(batches(), done=done)

    def _read_dcp(self, ckpt: distcp.DcpCheckpoint, plan: LoadPlan, planner: LoadPlanner) -> None:
        storage = self._open()
        try:
            by_chunk: dict[tuple[str, tuple[int, ...]], list[ReadItem]] = {}
            for it in plan.items:
                fqn = it.storage_index.fqn
                if it.type == LoadItemType.BYTE_IO:
                    item = ckpt.values.get(fqn)
                    if item is None:
                        raise CorruptCheckpointError(f"{ckpt.where}: no stored value {fqn!r}")
                    value = distcp.load_value(distcp.read_item(storage, item), item, ckpt.where, allow_pickle=self.allow_pickle)
                    planner.load_bytes(it, torch_saved(value))
                    continue
                by_chunk.setdefault((fqn, tuple(it.storage_index.offset or ())), []).append(it)
            for (fqn, offsets), items in sorted(by_chunk.items(), key=lambda kv: _chunk_order(ckpt, kv[0])):
                dtype, _, chunks = ckpt.tensors[fqn]
                found = next(((lens, loc) for off, lens, loc in chunks if off == offsets), None)
                if found is None:
                    raise CorruptCheckpointError(f"{ckpt.where}: key {fqn!r} has no stored chunk at {list(offsets)}")
                lens, loc = found
                src = distcp.load_tensor(distcp.read_item(storage, loc), loc, dtype, lens, ckpt.where)
                for it in items:
                    part = src
                    for d, (o, n) in enumerate(zip(it.storage_offsets, it.lengths)):
                        part = part.narrow(d, o, n)
                    dest = _plain_target(it.dest_index.fqn, planner.resolve_tensor(it)).detach()
                    if dest.shape != part.shape:
                        raise ShapeMismatchError(
                            f"key {it.dest_index.fqn!r}: the load planner resolved a target of shape {list(dest.shape)} for a read of {list(part.shape)}"
                        )
                    with torch.no_grad():
                        dest.copy_(part)
                    planner.commit_tensor(it, dest)
                del src
        finally:
            storage.close()


def _plain_target(key: str, dest: torch.Tensor) -> torch.Tensor:
    """``dest`` itself, the tensor a float8 all-gather weight wraps, or ``ShardingError`` for
    another tensor subclass: writing into it through DCP's planner would quantize the loaded
    values again (or fail inside the class)."""
    plain = as_plain(key, dest)
    if plain is None:
        raise ShardingError(
            f"key {key!r}: the target is a {class_path(type(dest))}, a tensor subclass; DCP's planner sees one tensor, "
            "not the inner tensors it holds, so shardsafe.dcp will not write into it (that would quantize the values "
            "again). Load with shardsafe.Checkpointer or shardsafe.load_model_and_optim_state (README, Tensor subclasses)"
        )
    return plain


def _chunk_order(ckpt: distcp.DcpCheckpoint, chunk: tuple[str, tuple[int, ...]]) -> tuple[str, int]:
    """Read chunks in file order."""
    fqn, offsets = chunk
    for off, _, loc in ckpt.tensors.get(fqn, (None, None, []))[2]:
        if off == offsets:
            return loc.file, loc.offset
    return "", 0


class _Segment:
    """A box of a stored shardsafe chunk that is contiguous in its file: one DCP chunk."""

    __slots__ = ("file", "start", "lengths", "chunk_start", "sums", "chunk")

    def __init__(self, file: str, start: int, lengths: tuple[int, ...], spec, sums) -> None:
        self.file = file
        self.start = start
        self.lengths = lengths
        self.chunk_start = spec.byte_range[0]
        self.sums = sums
        self.chunk = f"{file}:{spec.name}"

    def read_item(self, rel: tuple[int, ...], lengths: tuple[int, ...]) -> OurReadItem:
        """The engine's read of box ``rel`` + ``lengths`` of this segment into a whole target."""
        zeros = (0,) * len(lengths)
        return OurReadItem(
            self.file, self.start, self.lengths, rel, 0, 0, lengths, zeros, lengths, self.chunk_start, self.sums, self.chunk
        )


class _OurCheckpoint:
    """A shardsafe checkpoint's metadata, shown to DCP: chunks as boxes, values by DCP's keys."""

    def __init__(self, meta: StorageMetadata) -> None:
        self.meta = meta
        self._indexes: dict[str, StoredIndex] = {}
        self._segments: dict[str, dict[tuple[int, ...], Any]] = {}
        # DCP key -> (stored key, path inside its value): the leaves DCP's flattening of a state
        # dict holding the value would name (a value that is a leaf itself: its own key). Pickled
        # values cannot be looked into unpickled: they are shown whole.
        self.values: dict[str, tuple[str, tuple[str | int, ...]]] = {key: (key, ()) for key in meta.pickled_objects}
        taken = set(meta.tensors) | set(self.values)
        for key, value in meta.objects.items():
            for leaf, path in dcp_leaves(key, value):
                if leaf not in taken:  # (a stored key that equals another value's leaf: the first one named)
                    self.values[leaf] = (key, path)
                    taken.add(leaf)

    def dcp_metadata(self, url: str, load_id: str) -> Metadata:
        sdm: dict[str, Any] = {}
        planner_data: dict[str, tuple[str | int, ...]] = {}
        for key, tm in self.meta.tensors.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(lens)) for off, lens, *_ in self._index(key).segments]
            sdm[key] = TensorStorageMetadata(properties=TensorProperties(dtype=tm.torch_dtype), size=torch.Size(tm.shape), chunks=chunks)
            planner_data[key] = (key,)
        for dcp_key, (key, path) in self.values.items():
            sdm[dcp_key] = BytesStorageMetadata()
            planner_data[dcp_key] = (key, *path)
        return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_meta=StorageMeta(checkpoint_id=url, load_id=load_id))

    def _index(self, key: str) -> StoredIndex:
        index = self._indexes.get(key)
        if index is None:
            index = StoredIndex(self.meta.tensors[key])
            index.segments = [s for s in index.segments if prod(s[1])]  # boxes with no elements are not chunks
            self._indexes[key] = index
        return index

    def segment(self, it: ReadItem) -> tuple[_Segment, torch.dtype]:
        """The stored segment a DCP read item reads from, and the stored dtype."""
        fqn = it.storage_index.fqn
        tm = self.meta.tensors.get(fqn)
        if tm is None:
            raise CorruptCheckpointError(f"no tensor {fqn!r} in the checkpoint")
        segs = self._segments.get(fqn)
        if segs is None:
            index = self._index(fqn)
            segs = self._segments[fqn] = {
                off: _Segment(file, start, lens, spec, index.sums(file, spec)) for off, lens, file, start, spec in index.segments
            }
        offsets = tuple(it.storage_index.offset or ())
        seg = segs.get(offsets)
        if seg is None:
            raise CorruptCheckpointError(f"key {fqn!r}: no stored chunk starts at {list(offsets)}")
        return seg, tm.torch_dtype
