"""``Checkpointer``: save, load and unshard state dicts of (sharded) tensors and values."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ._args import check_arg, check_bool
from ._gc import paused_gc
from ._progress import Progress, bytes_counter, rank_progress, targets_done
from .adapters import LocalTensor, describe_state
from .adapters.nested import Targets, load_targets
from .dist import Comm, get_comm
from .engine.background import AsyncSave, wait_for_location
from .engine.bounds import check_files_hold
from .engine.objects import decode_objects
from .engine.reader import Reader
from .engine.writer import async_save_state, save_state
from .errors import DtypeMismatchError, MissingKeyError, ShapeMismatchError
from .foreign import missing_metadata_error
from .format.metadata import METADATA_FILENAME, StorageMetadata, keys_under
from .knobs import KNOBS, Knobs
from .storage import Location, Storage, open_storage

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Checkpointer"]

log = logging.getLogger(__name__)



class Checkpointer:
    """A distributed checkpointer for state dicts.

    Values may be ``torch.Tensor`` / ``nn.Parameter`` (replicated), ``DTensor`` (any Shard,
    _StridedShard or Replicate placements), :class:`~shardsafe.ShardedTensor`, non-tensor
    values, dicts of these (nested as deep as needed: ``{"model": model_sd, "optim": optim_sd}``),
    and objects with ``state_dict()`` / ``load_state_dict()`` (modules, optimizers, LR
    schedulers: DCP's ``Stateful``). A dict that holds tensors or such objects is stored under
    dotted keys as ``torch.distributed.checkpoint`` flattens it (``optim.state.0.exp_avg``); any
    other value as one JSON value, where tuples, ``OrderedDict``, sets, NaN and infinities, NumPy
    scalars and the like keep their types (tagged JSON, ``docs/format.md`` §13). Values with no
    such form need ``allow_pickle=True``, on save and on load; a tensor inside a list or tuple is
    refused (put it in a dict).

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

    def save(
        self,
        dir: Location,
        state_dict: dict[str, Any],
        save_overwrite: bool = False,
        *,
        process_group: ProcessGroup | None = None,
        progress: bool | Callable[[int, int], None] | None = None,
    ) -> tuple[StorageMetadata, list[str]]:
        """Save ``state_dict``; returns the storage metadata and the files this rank created.

        Each rank writes only its own pieces; replicated pieces are written once, by one of the
        ranks holding them. Raises ``CheckpointExistsError`` if a checkpoint is already
        committed at ``dir`` and ``save_overwrite`` is False. With ``save_overwrite=True`` the
        old checkpoint stays loadable until the new one commits, then its files are removed.
        Every rank of ``process_group`` (default: all ranks) calls this together, with the same
        ``dir``; ``MissingRanksError`` is raised if some do not call within
        ``knobs.collective_timeout_s``. ``PickleNotAllowedError`` names the element of a value
        that cannot be stored (``optim.param_groups[0].betas``).

        ``progress``: ``True`` draws a progress bar (tqdm, on stderr) on the coordinator only; a
        callable is called on every rank as ``progress(done, total)`` with the bytes of this
        rank's data file written so far, out of its tensor bytes (known once the save is
        planned), from the thread that writes; ``(total, total)`` once the file is complete.
        """
        check_arg("Checkpointer.save", "state_dict", state_dict, dict)
        check_bool("Checkpointer.save", "save_overwrite", save_overwrite)
        storage = open_storage(dir)
        comm = self._comm("save", False, process_group)
        return self._save(storage, state_dict, save_overwrite, comm, progress=rank_progress(progress, "save", comm.is_coordinator))

    def async_save(
        self,
        dir: Location,
        state_dict: dict[str, Any],
        save_overwrite: bool = False,
        *,
        process_group: ProcessGroup | None = None,
        progress: bool | Callable[[int, int], None] | None = None,
    ) -> AsyncSave[tuple[StorageMetadata, list[str]]]:
        """:meth:`save` in the background: returns once ``state_dict`` is staged (copied), so the
        caller may change every tensor at once (the ``state_dict()`` of each ``Stateful`` value is
        called before it returns); the writes, checksums and commit go on in the background. ``wait()`` / ``committed.result()`` on the returned :class:`AsyncSave` give
        what :meth:`save` returns, or raise its error. Every rank calls it together.

        ``progress``: as for :meth:`save`; the bar is drawn, and a callable called, by the
        background thread that writes, after this call has returned (the last call, with
        ``(total, total)``, comes before ``committed`` completes).
        """
        check_arg("Checkpointer.async_save", "state_dict", state_dict, dict)
        check_bool("Checkpointer.async_save", "save_overwrite", save_overwrite)
        storage = open_storage(dir)
        comm = self._comm("async_save", False, process_group, arrive=False)  # the ranks meet in the background
        bar = rank_progress(progress, "async_save", comm.is_coordinator)
        return self._async_save(storage, state_dict, save_overwrite, comm, progress=bar)

    def _async_save(
        self, storage: Storage, state_dict: dict[str, Any], save_overwrite: bool, comm: Comm, *, result: Any = None,
        want_meta: bool = True, progress: Progress | None = None,
    ) -> AsyncSave[Any]:
        return async_save_state(
            storage, state_dict, save_overwrite=save_overwrite, allow_pickle=self.allow_pickle, comm=comm, knobs=self.knobs,
            result=result, want_meta=want_meta, progress=progress,
        )

    def _save(
        self, storage: Storage, state_dict: dict[str, Any], save_overwrite: bool, comm: Comm, *, want_meta: bool = True,
        progress: Progress | None = None,
    ) -> tuple[StorageMetadata, list[str]]:
        return save_state(  # type: ignore[return-value]  # the metadata is there when want_meta
            storage, state_dict, save_overwrite=save_overwrite, allow_pickle=self.allow_pickle, comm=comm, knobs=self.knobs,
            want_meta=want_meta, progress=progress,
        )

    def load(
        self,
        dir: Location,
        state_dict: dict[str, Any],
        no_dist: bool = False,
        metadata: StorageMetadata | None = None,
        *,
        process_group: ProcessGroup | None = None,
        progress: bool | Callable[[int, int], None] | None = None,
    ) -> None:
        """Fill the tensors of ``state_dict`` in place and replace its non-tensor values.

        ``state_dict`` may nest as on save: tensors in nested dicts are filled in place and values
        replaced in the dict that holds them; for a ``Stateful`` value, the target is its
        ``state_dict()``, and its ``load_state_dict`` gets the loaded state once every rank has
        loaded. A missing key is named dotted (``optim.state.0.exp_avg``).

        Any save layout loads into any target layout. Each rank reads only the bytes its pieces
        need. Raises ``MissingKeyError``, ``ShapeMismatchError`` or ``DtypeMismatchError`` when a
        target does not match the checkpoint, ``CorruptCheckpointError`` when stored bytes fail
        their checksum, ``IncompleteCheckpointError`` when ``dir`` holds no committed checkpoint,
        ``ForeignCheckpointError`` (naming the format and its converter) when it holds another
        library's (DCP, Hugging Face, Megatron). Every element of every target tensor is overwritten, or an error is raised. Unless
        ``no_dist``, every rank of ``process_group`` (default: all ranks) calls this together;
        if any rank fails, every rank raises.

        ``progress``: ``True`` draws a progress bar (tqdm, on stderr) on the coordinator only; a
        callable is called on every rank as ``progress(done, total)`` with the bytes of this
        rank's targets filled so far (from the thread that loads).
        """
        check_arg("Checkpointer.load", "state_dict", state_dict, dict)
        check_bool("Checkpointer.load", "no_dist", no_dist)
        check_arg("Checkpointer.load", "metadata", metadata, StorageMetadata, optional=True)
        storage = open_storage(dir)
        comm = self._comm("load", no_dist, process_group)
        bar = rank_progress(progress, "load", comm.is_coordinator)
        meta = metadata if metadata is not None else _read_metadata(storage, comm)
        if meta.resolver is None or meta.resolver.storage.url != storage.url:  # given by the caller: read this location's files
            meta.bind(storage)
        self._load(storage, state_dict, comm, meta, bar)

    def _load(
        self, storage: Storage, state_dict: dict[str, Any], comm: Comm, meta: StorageMetadata, progress: Progress | None = None
    ) -> None:
        started = time.monotonic()
        nread = [0]

        def run() -> tuple[Targets, dict[str, Any]]:
            targets = load_targets(
                state_dict, _StoredValues(meta), lambda: [*meta.tensors, *meta.objects, *meta.pickled_objects]
            )
            tensors, objects = describe_state(targets.flat, targets=True)
            _check_targets(meta, tensors, list(objects), storage.url)
            values = decode_objects(meta.objects, meta.pickled_objects, list(objects), allow_pickle=self.allow_pickle, where=storage.url)
            with Reader(storage, self.knobs) as reader:
                reader.load_tensors(((meta.tensors[t.key], t) for t in tensors), targets_done(progress, tensors))
                nread[0] = reader.bytes_read
            log.debug(
                "load %s: rank %d of %d filled %d tensors and %d values, %d bytes read, %.2f s",
                storage.url, comm.rank, comm.world_size, len(tensors), len(values), nread[0], time.monotonic() - started,
            )
            return targets, values

        targets, values = comm.check(run)  # only success or failure travels; the values stay here
        targets.apply(values)  # the values in place, then each Stateful's load_state_dict
        if comm.is_coordinator:
            seconds = time.monotonic() - started
            log.debug(
                "load %s: %d targets, %d bytes read on the coordinator, %.2f s, %.2f GB/s",
                storage.url, len(state_dict), nread[0], seconds, nread[0] / max(seconds, 1e-9) / 1e9,
            )

    def unshard(
        self,
        dir: Location,
        device: torch.device | str | None = None,
        rank0_only: bool = False,
        no_dist: bool = False,
        num_threads: int | None = None,
        *,
        prefix: str | None = None,
        process_group: ProcessGroup | None = None,
        progress: bool | Callable[[int, int], None] | None = None,
    ) -> dict[str, Any]:
        """The full (unsharded) state dict: every tensor whole, and the non-tensor values.

        Works in a plain process with no process group. In a distributed context every rank of
        ``process_group`` (default: all ranks) calls it together (the metadata is read once and
        broadcast); with ``rank0_only`` only the group's first rank reads and the other ranks
        get ``{}``; with ``no_dist`` no collective is used at all, so any rank may call it
        alone. With ``prefix``, only the keys that start with it are read, and returned without
        it; a prefix that no key starts with raises ``MissingKeyError``.

        ``progress``: ``True`` draws a progress bar (tqdm, on stderr) on the coordinator only; a
        callable is called on every rank as ``progress(done, total)`` with the bytes of the
        tensors this rank has filled so far (from the thread that unshards; a rank that reads
        nothing, with ``rank0_only``, reports ``(0, 0)``).
        """
        check_arg("Checkpointer.unshard", "device", device, (torch.device, str), optional=True)
        check_bool("Checkpointer.unshard", "rank0_only", rank0_only)
        check_bool("Checkpointer.unshard", "no_dist", no_dist)
        check_arg("Checkpointer.unshard", "num_threads", num_threads, int, optional=True)
        check_arg("Checkpointer.unshard", "prefix", prefix, str, optional=True)
        storage = open_storage(dir)
        comm = self._comm("unshard", no_dist, process_group)
        bar = rank_progress(progress, "unshard", comm.is_coordinator)
        return self._unshard(storage, comm, device=device, rank0_only=rank0_only, num_threads=num_threads, prefix=prefix, progress=bar)

    def _unshard(
        self,
        storage: Storage,
        comm: Comm,
        *,
        device: torch.device | str | None,
        rank0_only: bool,
        num_threads: int | None = None,
        prefix: str | None,
        progress: Progress | None = None,
    ) -> dict[str, Any]:
        meta = _read_metadata(storage, comm)
        if rank0_only and comm.rank != 0:
            if progress is not None:
                progress(0, 0)
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
        if meta.resolver is not None:  # format v3: the headers of every file holding these tensors, read at once
            holders: dict[int, str] = {}
            for key in selected.values():
                table = meta.tensors[key]._table
                for f in table.files.tolist() if table is not None else ():
                    holders.setdefault(f, key)
            meta.resolver.prefetch(holders, self.knobs.io_threads)
        check_files_hold(storage, ((key, meta.tensors[key]) for key in selected.values()))  # before allocating
        started = time.monotonic()
        add = bytes_counter(progress, sum(math.prod(meta.tensors[k].shape) * meta.tensors[k].torch_dtype.itemsize for k in selected.values()))
        with Reader(storage, self.knobs, num_threads=num_threads) as reader:
            for name, key in selected.items():
                tm = meta.tensors[key]
                full = torch.empty(tm.shape, dtype=tm.torch_dtype)
                (target,), _ = describe_state({key: full})
                reader.load_tensor(tm, target)
                if add is not None:
                    add(full.numel() * full.element_size())
                out[name] = full if device.type == "cpu" else full.to(device)
            nread = reader.bytes_read
        values = decode_objects(meta.objects, meta.pickled_objects, list(wanted.values()), allow_pickle=self.allow_pickle, where=storage.url)
        out.update((name, values[key]) for name, key in wanted.items())
        if comm.is_coordinator:
            seconds = time.monotonic() - started
            log.debug(
                "unshard %s: %d tensors, %d bytes read, %.2f s, %.2f GB/s",
                storage.url, len(selected), nread, seconds, nread / max(seconds, 1e-9) / 1e9,
            )
        return out

    def get_metadata(self, dir: Location, no_dist: bool = False, *, process_group: ProcessGroup | None = None) -> StorageMetadata:
        """The checkpoint's metadata (read once by the group's first rank and broadcast, unless ``no_dist``)."""
        check_bool("Checkpointer.get_metadata", "no_dist", no_dist)
        storage = open_storage(dir)
        return _read_metadata(storage, self._comm("get_metadata", no_dist, process_group))

    def _comm(self, method: str, no_dist: bool, process_group: ProcessGroup | None, *, arrive: bool = True) -> Comm:
        """The ranks of this call, once every one of them has called (see :func:`shardsafe.dist.get_comm`)."""
        return get_comm(
            no_dist, process_group, call=f"shardsafe.Checkpointer.{method}", timeout_s=self.knobs.collective_timeout_s, arrive=arrive
        )


def _read_metadata(storage: Storage, comm: Comm) -> StorageMetadata:
    where = f"{storage.url.rstrip('/')}/{METADATA_FILENAME}"
    wait_for_location(storage.url)  # a save in flight from this process to it commits first

    def read() -> bytes:
        try:
            return storage.read(METADATA_FILENAME)
        except FileNotFoundError:
            raise missing_metadata_error(storage, METADATA_FILENAME) from None  # another library's checkpoint, or uncommitted

    raw = comm.broadcast(read)
    with paused_gc():
        return StorageMetadata.from_json(raw, where=where).bind(storage)


class _StoredValues:
    """The keys ``meta`` stores as values (``in`` only)."""

    def __init__(self, meta: StorageMetadata) -> None:
        self.meta = meta

    def __contains__(self, key: object) -> bool:
        return key in self.meta.objects or key in self.meta.pickled_objects


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
