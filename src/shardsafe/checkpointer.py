"""``Checkpointer``: save, load and unshard state dicts of (sharded) tensors and values."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ._args import check_arg, check_bool
from ._progress import rank_progress
from .dist import Comm, get_comm
from .engine.background import AsyncSave
from .engine.file_index import bind_files
from .engine.loader import load_state, read_metadata, unshard_state
from .engine.writer import async_save_state, save_state
from .format.metadata import METADATA_FILENAME, StorageMetadata
from .knobs import KNOBS, Knobs
from .storage import Location, open_storage

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Checkpointer"]


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
        return save_state(  # type: ignore[return-value]  # want_meta: the metadata is there
            storage, state_dict, save_overwrite=save_overwrite, allow_pickle=self.allow_pickle, comm=comm, knobs=self.knobs,
            progress=rank_progress(progress, "save", comm.is_coordinator),
        )

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
        return async_save_state(
            storage, state_dict, save_overwrite=save_overwrite, allow_pickle=self.allow_pickle, comm=comm, knobs=self.knobs,
            progress=bar,
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
        dequantize: bool = False,
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

        Tensor subclasses on the allow-list (README, "Tensor subclasses") load in place into a
        target of the same class with the same blocks. ``dequantize``: a plain target whose key
        holds a quantized subclass gets its high-precision values instead of an error.
        """
        check_arg("Checkpointer.load", "state_dict", state_dict, dict)
        check_bool("Checkpointer.load", "no_dist", no_dist)
        check_bool("Checkpointer.load", "dequantize", dequantize)
        check_arg("Checkpointer.load", "metadata", metadata, StorageMetadata, optional=True)
        storage = open_storage(dir)
        comm = self._comm("load", no_dist, process_group)
        bar = rank_progress(progress, "load", comm.is_coordinator)
        meta = metadata if metadata is not None else read_metadata(storage, comm)
        if meta.resolver is None or meta.resolver.storage.url != storage.url:  # given by the caller: read this location's files
            bind_files(meta, storage)
        load_state(
            storage, state_dict, comm, meta, allow_pickle=self.allow_pickle, knobs=self.knobs, progress=bar, dequantize=dequantize
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
        dequantize: bool = False,
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

        A tensor subclass comes back whole as its class (imported from the allow-list only), or
        with ``dequantize`` as its high-precision tensor.
        """
        check_bool("Checkpointer.unshard", "dequantize", dequantize)
        check_arg("Checkpointer.unshard", "device", device, (torch.device, str), optional=True)
        check_bool("Checkpointer.unshard", "rank0_only", rank0_only)
        check_bool("Checkpointer.unshard", "no_dist", no_dist)
        check_arg("Checkpointer.unshard", "num_threads", num_threads, int, optional=True)
        check_arg("Checkpointer.unshard", "prefix", prefix, str, optional=True)
        storage = open_storage(dir)
        comm = self._comm("unshard", no_dist, process_group)
        bar = rank_progress(progress, "unshard", comm.is_coordinator)
        return unshard_state(
            storage, comm, allow_pickle=self.allow_pickle, knobs=self.knobs, device=device, rank0_only=rank0_only,
            num_threads=num_threads, prefix=prefix, progress=bar, dequantize=dequantize,
        )

    def get_metadata(self, dir: Location, no_dist: bool = False, *, process_group: ProcessGroup | None = None) -> StorageMetadata:
        """The checkpoint's metadata (read once by the group's first rank and broadcast, unless ``no_dist``)."""
        check_bool("Checkpointer.get_metadata", "no_dist", no_dist)
        storage = open_storage(dir)
        return read_metadata(storage, self._comm("get_metadata", no_dist, process_group))

    def _comm(self, method: str, no_dist: bool, process_group: ProcessGroup | None, *, arrive: bool = True) -> Comm:
        """The ranks of this call, once every one of them has called (see :func:`shardsafe.dist.get_comm`)."""
        return get_comm(
            no_dist, process_group, call=f"shardsafe.Checkpointer.{method}", timeout_s=self.knobs.collective_timeout_s, arrive=arrive
        )
