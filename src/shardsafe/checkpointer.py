"""``Checkpointer``: save, load and unshard flat state dicts of (sharded) tensors and values."""

from __future__ import annotations

from typing import Any

import torch

from ._args import check_arg, check_bool
from ._gc import paused_gc
from .adapters import LocalTensor, describe_state
from .dist import Comm, get_comm
from .engine.bounds import check_files_hold
from .engine.objects import decode_objects
from .engine.reader import Reader
from .engine.writer import save_state
from .errors import DtypeMismatchError, IncompleteCheckpointError, MissingKeyError, ShapeMismatchError
from .format.metadata import METADATA_FILENAME, StorageMetadata, keys_under
from .knobs import KNOBS, Knobs
from .storage import Location, Storage, open_storage

__all__ = ["Checkpointer"]



class Checkpointer:
    """A distributed checkpointer for flat state dicts.

    Values may be ``torch.Tensor`` / ``nn.Parameter`` (replicated), ``DTensor`` (any Shard,
    _StridedShard or Replicate placements), :class:`~shardsafe.ShardedTensor`, or non-tensor
    values that JSON can hold. Other values need ``allow_pickle=True``, on save and on load.

    In a distributed context every rank calls :meth:`save` together; :meth:`load` and
    :meth:`unshard` are collective unless ``no_dist=True``. A checkpoint is committed by its
    ``metadata.json``, written last and atomically by rank 0.
    """

    METADATA_FILENAME = METADATA_FILENAME

    def __init__(self, *, allow_pickle: bool = False, knobs: Knobs | None = None) -> None:
        check_bool("Checkpointer", "allow_pickle", allow_pickle)
        check_arg("Checkpointer", "knobs", knobs, Knobs, optional=True)
        self.allow_pickle = allow_pickle
        self.knobs = knobs or KNOBS

    def save(self, dir: Location, state_dict: dict[str, Any], save_overwrite: bool = False) -> tuple[StorageMetadata, list[str]]:
        """Save ``state_dict``; returns the storage metadata and the files this rank created.

        Each rank writes only its own pieces; replicated pieces are written once, by one of the
        ranks holding them. Raises ``CheckpointExistsError`` if a checkpoint is already
        committed at ``dir`` and ``save_overwrite`` is False. With ``save_overwrite=True`` the
        old checkpoint stays loadable until the new one commits, then its files are removed.
        """
        check_arg("Checkpointer.save", "state_dict", state_dict, dict)
        check_bool("Checkpointer.save", "save_overwrite", save_overwrite)
        return save_state(
            open_storage(dir), state_dict, save_overwrite=save_overwrite, allow_pickle=self.allow_pickle,
            comm=get_comm(), knobs=self.knobs,
        )

    def load(self, dir: Location, state_dict: dict[str, Any], no_dist: bool = False, metadata: StorageMetadata | None = None) -> None:
        """Fill the tensors of ``state_dict`` in place and replace its non-tensor values.

        Any save layout loads into any target layout. Each rank reads only the bytes its pieces
        need. Raises ``MissingKeyError``, ``ShapeMismatchError`` or ``DtypeMismatchError`` when a
        target does not match the checkpoint, ``CorruptCheckpointError`` when stored bytes fail
        their checksum, ``IncompleteCheckpointError`` when ``dir`` holds no committed checkpoint.
        Every element of every target tensor is overwritten, or an error is raised.
        """
        check_arg("Checkpointer.load", "state_dict", state_dict, dict)
        check_bool("Checkpointer.load", "no_dist", no_dist)
        check_arg("Checkpointer.load", "metadata", metadata, StorageMetadata, optional=True)
        comm = get_comm(no_dist)
        storage = open_storage(dir)
        meta = metadata if metadata is not None else _read_metadata(storage, comm)

        def run() -> dict[str, Any]:
            tensors, objects = describe_state(state_dict, targets=True)
            _check_targets(meta, tensors, list(objects), storage.url)
            values = decode_objects(meta.objects, meta.pickled_objects, list(objects), allow_pickle=self.allow_pickle, where=storage.url)
            with Reader(storage, self.knobs) as reader:
                reader.load_tensors((meta.tensors[t.key], t) for t in tensors)
            return values

        state_dict.update(comm.check(run))

    def unshard(
        self,
        dir: Location,
        device: torch.device | str | None = None,
        rank0_only: bool = False,
        no_dist: bool = False,
        num_threads: int | None = None,
        *,
        prefix: str | None = None,
    ) -> dict[str, Any]:
        """The full (unsharded) state dict: every tensor whole, and the non-tensor values.

        Works in a plain process with no process group. With ``rank0_only`` only rank 0 reads
        and the other ranks get ``{}``; with ``no_dist`` no collective is used at all. With
        ``prefix``, only the keys that start with it are read, and returned without it; a prefix
        that no key starts with raises ``MissingKeyError``.
        """
        check_arg("Checkpointer.unshard", "device", device, (torch.device, str), optional=True)
        check_bool("Checkpointer.unshard", "rank0_only", rank0_only)
        check_bool("Checkpointer.unshard", "no_dist", no_dist)
        check_arg("Checkpointer.unshard", "num_threads", num_threads, int, optional=True)
        check_arg("Checkpointer.unshard", "prefix", prefix, str, optional=True)
        comm = get_comm(no_dist)
        storage = open_storage(dir)
        meta = _read_metadata(storage, comm)
        if rank0_only and comm.rank != 0:
            return {}
        device = torch.device(device) if device is not None else torch.device("cpu")
        out: dict[str, Any] = {}
        selected = keys_under(meta.tensors, prefix)
        wanted = keys_under([*meta.objects, *meta.pickled_objects], prefix)
        if prefix is not None and not selected and not wanted:
            stored = sorted([*meta.tensors, *meta.objects, *meta.pickled_objects])
            raise MissingKeyError(
                f"{storage.url}: no key starts with {prefix!r}; the checkpoint holds {len(stored)} key(s)"
                + (f", such as {stored[:5]}" if stored else "")
            )
        check_files_hold(storage, ((key, meta.tensors[key]) for key in selected.values()))  # before allocating
        with Reader(storage, self.knobs, num_threads=num_threads) as reader:
            for name, key in selected.items():
                tm = meta.tensors[key]
                full = torch.empty(tm.shape, dtype=tm.torch_dtype)
                (target,), _ = describe_state({key: full})
                reader.load_tensor(tm, target)
                out[name] = full if device.type == "cpu" else full.to(device)
        values = decode_objects(meta.objects, meta.pickled_objects, list(wanted.values()), allow_pickle=self.allow_pickle, where=storage.url)
        out.update((name, values[key]) for name, key in wanted.items())
        return out

    def get_metadata(self, dir: Location, no_dist: bool = False) -> StorageMetadata:
        """The checkpoint's metadata (read once by rank 0 and broadcast, unless ``no_dist``)."""
        check_bool("Checkpointer.get_metadata", "no_dist", no_dist)
        return _read_metadata(open_storage(dir), get_comm(no_dist))


def _read_metadata(storage: Storage, comm: Comm) -> StorageMetadata:
    where = f"{storage.url.rstrip('/')}/{METADATA_FILENAME}"

    def read() -> bytes:
        try:
            return storage.read(METADATA_FILENAME)
        except FileNotFoundError:
            files = storage.list()
            state = f"it holds {len(files)} file(s) but" if files else "it is empty or missing, and"
            raise IncompleteCheckpointError(
                f"{storage.url}: not a committed checkpoint: {state} has no {METADATA_FILENAME} "
                "(was the save interrupted before it committed?)"
            ) from None

    raw = comm.broadcast(read)
    with paused_gc():
        return StorageMetadata.from_json(raw, where=where)


def _check_targets(meta: StorageMetadata, tensors: list[LocalTensor], objects: list[str], where: str) -> None:
    for t in tensors:
        stored = meta.tensors.get(t.key)
        if stored is None:
            raise MissingKeyError(f"{where}: key {t.key!r} is not in the checkpoint ({len(meta.tensors)} tensors stored)")
        if stored.shape != t.shape:
            raise ShapeMismatchError(
                f"{where}: key {t.key!r}: checkpoint has global shape {list(stored.shape)}, target has {list(t.shape)}"
            )
        if stored.dtype != t.dtype_name:
            raise DtypeMismatchError(f"{where}: key {t.key!r}: checkpoint has dtype {stored.dtype}, target has {t.dtype_name}")
    for key in objects:
        if key not in meta.objects and key not in meta.pickled_objects:
            kind = "a tensor" if key in meta.tensors else "not in the checkpoint"
            raise MissingKeyError(f"{where}: non-tensor key {key!r} is {kind}")
