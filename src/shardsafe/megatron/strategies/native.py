"""shardsafe's format as a Megatron-Core backend: sharded state dicts through shardsafe's engine.

How Megatron's objects map onto a shardsafe checkpoint (``docs/format.md`` §11):

- a :class:`~shardsafe.megatron.mapping.ShardedTensor` is a piece of the stored tensor of its
  key: the box ``global_offset`` + ``(1,) * prepend_axis_num + local_shape``, or the flattened
  range of that box. A rank may hold several pieces of one key (layers of a stack, the two
  halves of a GLU weight, several ranges). Main replicas are saved; a non-main replica whose
  box is exactly a main replica's may write it instead (the engine spreads replicated writes),
  and is otherwise left out.
- a :class:`~shardsafe.megatron.mapping.ShardedObject` is one value, under its ``unique_key``,
  in ``metadata.json``'s ``objects``, as tagged JSON (:mod:`shardsafe.megatron._values`).
- the common state (what Megatron writes to ``common.pt`` from rank 0) is rank 0's, one value
  under ``"megatron:common"``; the config Megatron would write to its own ``metadata.json`` is
  the value ``"megatron:config"``.

Everything goes into one shardsafe save, so one atomic commit covers tensors, objects and the
common state.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, replace
from os import PathLike, fspath
from pathlib import Path
from typing import Any, NamedTuple

import torch
import xxhash

from ... import adapters
from ...checkpointer import Checkpointer
from ...dist import Comm, get_comm
from ...engine.background import AsyncSave
from ...engine.file_index import bind_files
from ...engine.loader import read_metadata as read_committed
from ...errors import ForeignCheckpointError, IncompleteCheckpointError
from ...format.metadata import METADATA_FILENAME, StorageMetadata, TensorStorageMetadata
from ...knobs import Knobs
from ...storage import Storage, open_storage
from .._values import decode_value, encode_value
from ..core import (
    CONFIG_KEY,
    SHARDSAFE_BACKEND,
    CheckpointingConfig,
    CheckpointingException,
    NotADistributedCheckpointError,
    location,
    maybe_load_config,
    megatron_errors,
    opened,
)
from ..dict_utils import dict_list_map_inplace, nested_values
from ..integrity import (
    Entry,
    StrictHandling,
    adjust_non_strict_load,
    check_global_sharding,
    describe_local,
    log_common_difference,
)
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from .async_utils import AsyncRequest, request_for
from .base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from .common import read_common_pt

__all__ = ["COMMON_KEY", "ShardsafeLoadShardedStrategy", "ShardsafeSaveShardedStrategy", "read_metadata"]

log = logging.getLogger(__name__)
COMMON_KEY = "megatron:common"
"""The value (in ``metadata.json``'s ``objects``) holding rank 0's common state."""
FORMAT_VERSION = 1
"""Version of the mapping of Megatron's objects onto shardsafe's format (``sharded_backend_version``)."""
_UNIQUE_KEY = re.compile(r"^.+/shard_\d+(\.\d+)*_\d+(\.\d+)*$")

# The last sharding a save validated, per group of ranks: a save whose every rank describes the
# same pieces again (the normal case in training) sends only a digest and is not checked again.
_CHECKED: dict[tuple[int, ...], tuple[list[str | None], list[list[Entry]], list[list[int]]]] = {}  # coordinator
_CHECKED_BY_RANK: dict[tuple[int, ...], str | None] = {}  # every rank: its digest in that save
_STATS: Counter[str] = Counter()  # "hit", "miss", "resend"


class _Sent(NamedTuple):
    """What each rank sends the coordinator before a save."""

    entries: list[Entry] | None  # None: the same as at the last validated save (see digest), or no validation
    digest: str | None  # of this rank's entries
    common: str | None  # digest of the common state to compare with rank 0's


class ShardsafeSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Saves a sharded state dict (tensors, ShardedObjects and the common state) as one
    shardsafe checkpoint.

    ``allow_pickle`` lets values with no JSON form (see :mod:`shardsafe.megatron._values`) be
    stored with pickle; loading them then needs ``ShardsafeLoadShardedStrategy(allow_pickle=True)``.
    ``knobs`` tune the engine (default: ``shardsafe.knobs.KNOBS``).
    """

    common_backend: tuple[str, int] = (SHARDSAFE_BACKEND, FORMAT_VERSION)
    """Where the common state lives, as the stored config says: shardsafe's own saves keep it in
    ``metadata.json``; a save driven by Megatron-Core's ``save`` has it in ``common.pt``."""

    def __init__(self, backend: str = SHARDSAFE_BACKEND, version: int = FORMAT_VERSION, *, allow_pickle: bool = False, knobs: Knobs | None = None) -> None:
        super().__init__(backend, version)
        self.allow_pickle = allow_pickle
        self.knobs = knobs

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    @megatron_errors
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        """Save the ShardedTensors and ShardedObjects of ``sharded_state_dict`` (no common state)."""
        self.save_all(lambda: (list(nested_values(sharded_state_dict)), {}, None), checkpoint_dir, validate=False)

    @megatron_errors
    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> AsyncRequest:
        """:meth:`save` in the background; the request waits for the commit."""
        pending = self.save_all(lambda: (list(nested_values(sharded_state_dict)), {}, None), checkpoint_dir, validate=False, background=True)
        return request_for(pending)  # type: ignore[arg-type]

    def save_all(
        self,
        prepare: Callable[[], tuple[list[Any], StateDict, StateDict | None]],
        checkpoint_dir: str | Path,
        *,
        validate: bool,
        background: bool = False,
    ) -> AsyncSave | None:
        """Save what ``prepare()`` returns: ``values`` (ShardedTensors and ShardedObjects), the
        ``common`` state (rank 0's is saved) and ``common_check`` (or None).

        Every rank calls it together; ``prepare`` runs inside the first collective step, so an
        error it raises on one rank raises on every rank. With ``validate`` the sharding of the whole job is checked
        first (one gather of small descriptions; the coordinator checks), and every rank raises
        the same ``CheckpointingException`` if it is wrong, before anything is written; ranks
        whose ``common_check`` differs from rank 0's are logged (WARNING). Returns the
        background save when ``background``.
        """
        comm = get_comm(call="shardsafe.megatron.save")
        group = tuple(comm.global_ranks)
        state: dict[str, Any] = {}
        mine: dict[str, Any] = {}
        config = CheckpointingConfig(self.backend, self.version, *self.common_backend)

        def describe(full: bool) -> _Sent:
            if not mine:
                values, common, common_check = prepare()
                entries = describe_local(values)
                for v, e in zip(values, entries):
                    if isinstance(v, ShardedObject) and e.main:
                        _put_object(state, v, self.allow_pickle)
                if comm.is_coordinator:
                    state[COMMON_KEY] = encode_value(common, where="the common state", allow_pickle=self.allow_pickle)
                    state[CONFIG_KEY] = asdict(config)
                common_digest = None
                if common_check is not None and comm.distributed:
                    encoded = encode_value(common_check, where="the common state", allow_pickle=True)
                    common_digest = xxhash.xxh3_64_hexdigest(json.dumps(encoded, sort_keys=True).encode())
                digest = xxhash.xxh3_64_hexdigest(repr(entries).encode()) if validate else None
                pieces = {i: _piece(v, saving=True) for i, v in enumerate(values) if isinstance(v, ShardedTensor)}
                mine.update(values=values, pieces=pieces, entries=entries, digest=digest, common=common_digest, common_check=common_check)
            send = validate and (full or _CHECKED_BY_RANK.get(group) != mine["digest"])
            return _Sent(mine["entries"] if send else None, mine["digest"], mine["common"])

        def check(gathered: list[_Sent]) -> list[tuple[list[int] | None, bool]]:
            comm.raise_failures(gathered)
            differ = any(g.common != gathered[0].common for g in gathered)  # each such rank logs how, below
            return [(c, differ) for c in check_sharding(gathered)]

        def check_sharding(gathered: list[_Sent]) -> list[list[int] | None]:
            if not validate:
                return [[] for _ in gathered]
            digests = [g.digest for g in gathered]
            cached = _CHECKED.get(group)
            if cached is not None and cached[0] == digests and all(g.entries is None for g in gathered):
                _STATS["hit"] += 1
                return cached[2]  # every rank describes what the last validated save did
            per_rank = []
            for r, g in enumerate(gathered):
                if g.entries is not None:
                    per_rank.append(g.entries)
                elif cached is not None and r < len(cached[0]) and cached[0][r] == g.digest:
                    per_rank.append(cached[1][r])
                else:  # the coordinator lacks what this rank did not send: every rank sends it all
                    _STATS["resend"] += 1
                    return [None] * len(gathered)
            _STATS["miss"] += 1
            copies = check_global_sharding(per_rank)
            _CHECKED[group] = (digests, per_rank, copies)
            return copies  # type: ignore[return-value]

        for full in (False, True):
            gathered = comm.gather(lambda full=full: describe(full))
            got, common_differs = comm.scatter(lambda gathered=gathered: check(gathered))  # type: ignore[arg-type]
            if got is not None:
                break
        else:  # every rank sent all it has and the coordinator still lacks some: a rank did not validate
            raise CheckpointingException(
                f"{checkpoint_dir}: the ranks passed different validate_access_integrity values to one save; pass the same on every rank"
            )
        if common_differs:  # rank 0's (the saved one) travels only then; each differing rank logs its difference
            rank0_common = comm.broadcast(lambda: mine["common_check"])
            if not comm.is_coordinator and mine["common"] is not None:
                log_common_difference(comm.global_rank, rank0_common, mine["common_check"])
        if validate:
            _CHECKED_BY_RANK[group] = mine["digest"]
        copies = set(got)
        for i, piece in mine["pieces"].items():
            if is_main_replica(piece.replica_id) or i in copies:
                state[f"{piece.key}[{i}]"] = piece
        ckpt = Checkpointer(knobs=self.knobs)
        if background:
            return ckpt.async_save(checkpoint_dir, state, save_overwrite=True)
        ckpt.save(checkpoint_dir, state, save_overwrite=True)
        return None


class ShardsafeLoadShardedStrategy(LoadShardedStrategy, LoadCommonStrategy):
    """Loads a shardsafe checkpoint into a sharded state dict: any saved layout into any
    requested one, each rank reading only the bytes of its pieces, in place into their ``data``.

    ``allow_pickle`` is needed for values that were saved with pickle (and only then).
    """

    def __init__(self, *, allow_pickle: bool = False, knobs: Knobs | None = None) -> None:
        self.allow_pickle = allow_pickle
        self.knobs = knobs

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != SHARDSAFE_BACKEND:
            raise CheckpointingException(
                f"the checkpoint's sharded backend is {loaded_backend!r}; shardsafe.megatron reads {SHARDSAFE_BACKEND!r} "
                "checkpoints only (Megatron-Core's own formats load with megatron.core.dist_checkpointing)"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version > FORMAT_VERSION:
            raise CheckpointingException(
                f"the checkpoint's sharded backend version is {loaded_version}, newer than this shardsafe reads ({FORMAT_VERSION}); upgrade shardsafe"
            )

    @megatron_errors
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> StateDict:
        """The ShardedTensors and ShardedObjects of ``sharded_state_dict``, loaded (tensors in place)."""
        comm = get_comm(call="shardsafe.megatron.load")
        meta = read_metadata(checkpoint_dir, no_dist=False, comm=comm)
        loaded, _, _ = self.load_all(
            lambda: sharded_state_dict, checkpoint_dir, meta, comm, validate=False, strict=StrictHandling.ASSUME_OK_UNEXPECTED
        )
        return loaded

    @megatron_errors
    def load_common(self, checkpoint_dir: str | Path) -> StateDict:
        """The common state (no process group needed)."""
        return self.common_of(read_metadata(checkpoint_dir, no_dist=True), checkpoint_dir)

    def common_of(self, meta: StorageMetadata, checkpoint_dir: str | Path) -> StateDict:
        """The common state stored in ``meta`` (``{}`` for a checkpoint saved without one); for a
        checkpoint that megatron-core's ``save`` wrote through shardsafe's strategy (its config says
        ``common_backend="torch"``), Megatron's ``common.pt`` beside it, read safely."""
        config = meta.objects.get(CONFIG_KEY)
        if isinstance(config, dict) and config.get("common_backend") == "torch":
            return read_common_pt(checkpoint_dir, allow_pickle=self.allow_pickle, strategy=type(self).__name__)
        if COMMON_KEY not in meta.objects:
            return {}
        common = decode_value(meta.objects[COMMON_KEY], where=f"{checkpoint_dir}: the common state", allow_pickle=self.allow_pickle)
        if not isinstance(common, dict):
            raise CheckpointingException(f"{checkpoint_dir}: the stored common state is a {type(common).__name__}, not a dict")
        return common

    @megatron_errors
    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> Any:
        """Replace every ShardedObject by its stored value, in place (no process group needed)."""
        meta = read_metadata(checkpoint_dir, no_dist=True)
        return dict_list_map_inplace(lambda v: self._object(v, meta, checkpoint_dir), sharded_objects_state_dict)

    @megatron_errors
    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        """Every stored tensor as an unsharded ShardedTensor without data, by key."""
        meta = read_metadata(checkpoint_dir, no_dist=True)
        return tensors_metadata(meta)

    @megatron_errors
    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        """Every stored tensor (by key) and ShardedObject (by unique key), without data."""
        return sharded_metadata(read_metadata(checkpoint_dir, no_dist=True))

    @megatron_errors
    def remove_sharded_tensors(self, checkpoint_dir: str | Path, key_prefix: str) -> None:
        """Remove the tensors whose key starts with ``key_prefix``: commit a ``metadata.json``
        without them (atomically), then delete the data files no tensor is left in. Not collective:
        call it on one process."""
        with opened(str(checkpoint_dir)) as storage:
            try:
                raw, version = storage.read_versioned(METADATA_FILENAME)
            except FileNotFoundError:
                raise NotADistributedCheckpointError(f"{checkpoint_dir} is not a distributed checkpoint: it has no {METADATA_FILENAME}") from None
            meta = bind_files(StorageMetadata.from_json(raw, where=f"{storage.url}/{METADATA_FILENAME}"), storage)
            gone = [k for k in meta.tensors if k.startswith(key_prefix)]
            if not gone:
                log.warning("%s: no tensor key starts with %r; nothing removed", checkpoint_dir, key_prefix)
                return
            new = meta.with_tensors(k for k in meta.tensors if not k.startswith(key_prefix))
            named = new.data_files()
            try:
                storage.put_atomic(METADATA_FILENAME, new.to_json(), overwrite=True, if_match=version)
            except FileExistsError:
                raise CheckpointingException(
                    f"{checkpoint_dir}: {METADATA_FILENAME} changed while the tensors under {key_prefix!r} were being removed; "
                    "nothing was removed, try again"
                ) from None
            for f in sorted(meta.data_files() - named):
                storage.delete(f)

    def load_all(
        self,
        prepare: Callable[[], ShardedStateDict],
        checkpoint_dir: str | Path,
        meta: StorageMetadata,
        comm: Comm,
        *,
        validate: bool,
        strict: StrictHandling,
    ) -> tuple[StateDict, set[str], set[str]]:
        """Load the ShardedBase values of the nesting ``prepare()`` returns (a copy of the
        caller's, with factories built). Returns the loaded nesting, the missing keys (``*_ALL``
        modes) and this rank's unexpected keys. Every rank calls it together; an error on any
        rank (in ``prepare``, a mismatch that ``strict`` raises, a bad sharding with ``validate``,
        a missing key, a checksum) raises on every rank.
        """
        ckpt_keys = set(meta.tensors) | {k.rpartition("/")[0] for k in meta.objects if _UNIQUE_KEY.match(k)}
        need_global = validate or StrictHandling.requires_global_app_metadata(strict)
        prepared: dict[str, Any] = {}

        def local_step() -> tuple[list[Entry] | None, list[str]]:
            sharded_state_dict = prepare()
            requested = describe_local(nested_values(sharded_state_dict))
            unexpected: set[str] = set()
            if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
                unexpected = {e.key for e in requested} - ckpt_keys
                sharded_state_dict = adjust_non_strict_load(sharded_state_dict, unexpected)
            prepared["unexpected"] = unexpected
            prepared["sharded"] = sharded_state_dict
            prepared["targets"], prepared["objects"], prepared["casts"] = self._targets(sharded_state_dict, meta, checkpoint_dir)
            return (requested if need_global else None), sorted(unexpected)

        raising = strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL)

        def coordinate(gathered: list[Any] | None) -> set[str]:
            comm.raise_failures(gathered)
            per_rank = [g[0] for g in gathered]  # type: ignore[union-attr]
            if validate:
                check_global_sharding(per_rank)  # type: ignore[arg-type]
            missing: set[str] = set()
            if StrictHandling.requires_global_app_metadata(strict):
                missing = ckpt_keys - {e.key for entries in per_rank for e in entries}  # type: ignore[union-attr]
            if raising:
                unexpected = {comm.global_ranks[r]: g[1] for r, g in enumerate(gathered) if g[1]}  # type: ignore[arg-type, index]
                _raise_mismatch(missing if strict == StrictHandling.RAISE_ALL else set(), unexpected, str(checkpoint_dir))
            return missing

        missing: set[str] = set()
        if not (need_global or raising):  # nothing to check across ranks: only failures travel (one all-reduce)
            comm.check(local_step)
        else:
            gathered = comm.gather(local_step)
            if StrictHandling.requires_global_app_metadata(strict):
                missing = comm.broadcast(lambda: coordinate(gathered))
            else:  # only the verdict travels (one all-reduce when the check passes)
                comm.check_at_coordinator(lambda: coordinate(gathered))
        unexpected = prepared["unexpected"]
        if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL) and (missing or unexpected):
            log.warning("%s", _mismatch_text(missing, {comm.global_rank: sorted(unexpected)} if unexpected else {}, str(checkpoint_dir)))
        if strict == StrictHandling.IGNORE_ALL:
            missing, unexpected = set(), set()
        self.read_targets(checkpoint_dir, prepared["targets"], meta)
        with torch.no_grad():  # requested may be a parameter that requires grad
            for stored_dtype, requested in prepared["casts"]:
                requested.copy_(stored_dtype)
        objects = prepared["objects"]

        def result(v: Any) -> Any:
            if isinstance(v, ShardedTensor):
                return v.data
            return objects[id(v)] if isinstance(v, ShardedObject) else v

        loaded = dict_list_map_inplace(result, prepared["sharded"])
        return loaded, set(missing), set(unexpected)  # type: ignore[return-value]

    def read_targets(self, checkpoint_dir: str | Path | Storage, targets: dict[str, adapters.ShardedTensor], meta: StorageMetadata) -> None:
        """Fill ``targets`` (the engine's pieces, sharing the requested tensors) from the checkpoint.
        Every rank calls it together, each with its own targets; an error on any rank raises on
        every rank. The ranks checked in together when the load began: each reads with no
        check-in of its own (one round trip through the store less per load)."""
        ckpt = Checkpointer(allow_pickle=False, knobs=self.knobs)
        get_comm(call=None).check(lambda: ckpt.load(location(checkpoint_dir), targets, no_dist=True, metadata=meta))

    def _targets(
        self, sharded_state_dict: ShardedStateDict, meta: StorageMetadata, checkpoint_dir: Any
    ) -> tuple[dict[str, Any], dict[int, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
        """The engine's targets, a piece per ShardedTensor sharing its ``data`` (allocated if
        None), the ShardedObjects' values by ``id`` (decoded now: errors come before any read),
        and ``(read, requested)`` for each tensor stored in another dtype than requested: it is read
        as stored and cast into the requested tensor after the load, as Megatron-Core's loads cast."""
        targets: dict[str, Any] = {}
        objects: dict[int, Any] = {}
        casts: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, v in enumerate(nested_values(sharded_state_dict)):
            if isinstance(v, ShardedObject):
                objects[id(v)] = self._object(v, meta, checkpoint_dir)
            elif isinstance(v, ShardedTensor):
                if v.data is None:
                    v.init_data("cpu", torch.zeros if v.allow_shape_mismatch else torch.empty)
                elif v.allow_shape_mismatch:
                    with torch.no_grad():  # data may be the model's parameter itself (a leaf that requires grad)
                        v.data.zero_()
                stored = meta.tensors.get(v.key)
                into = v
                if stored is not None and stored.torch_dtype != v.data.dtype:  # read as stored, cast after (as Megatron-Core's DCP load does)
                    blank = torch.zeros_like if v.allow_shape_mismatch else torch.empty_like  # padding outside the stored shape stays 0
                    into = replace(v, data=blank(v.data, dtype=stored.torch_dtype), dtype=stored.torch_dtype)
                    casts.append((into.data, v.data))
                piece = _piece(into, saving=False, stored_shape=stored.shape if stored is not None else None)
                if piece is not None:
                    targets[f"{v.key}[{i}]"] = piece
        return targets, objects, casts

    def _object(self, v: Any, meta: StorageMetadata, checkpoint_dir: Any) -> Any:
        if not isinstance(v, ShardedObject):
            return v
        key = v.unique_key
        if key not in meta.objects:
            cells = sorted(k for k in meta.objects if k.startswith(f"{v.key}/shard_"))
            raise CheckpointingException(
                f"{checkpoint_dir}: ShardedObject {key!r} is not in the checkpoint"
                + (f" (it holds {cells[:5]} of key {v.key!r}: was it saved with another global shape?)" if cells else "")
            )
        return decode_value(meta.objects[key], where=f"{checkpoint_dir}: ShardedObject {key!r}", allow_pickle=self.allow_pickle)


def _put_object(state: dict[str, Any], v: ShardedObject, allow_pickle: bool) -> None:
    key = v.unique_key
    encoded = encode_value(v.data, where=f"ShardedObject {key!r}", allow_pickle=allow_pickle)
    if key in state and state[key] != encoded:
        raise CheckpointingException(
            f"ShardedObject {key!r}: this rank holds two main replicas of it with different values; give one of them "
            "a replica_id other than 0"
        )
    state[key] = encoded


def _piece(v: ShardedTensor, *, saving: bool, stored_shape: tuple[int, ...] | None = None) -> adapters.ShardedTensor | None:
    """``v`` as the engine's :class:`shardsafe.ShardedTensor`, sharing ``v.data``. For a load of
    an ``allow_shape_mismatch`` tensor stored with another global shape, the part of ``v``'s
    box inside the stored tensor (None if there is none)."""
    if v.data is None:
        raise CheckpointingException(f"ShardedTensor {v.key!r} has no data to save (data is None)")
    p = v.prepend_axis_num
    lengths = (1,) * p + tuple(v.local_shape)
    flat = v.flattened_range
    data = v.data if flat is not None or not p else v.data[(None,) * p]
    shape = v.global_shape
    if not saving and v.allow_shape_mismatch and stored_shape is not None and tuple(stored_shape) != tuple(shape):
        if flat is not None:
            raise CheckpointingException(
                f"ShardedTensor {v.key!r}: allow_shape_mismatch with a flattened_range is not supported (stored global shape "
                f"{list(stored_shape)}, requested {list(shape)})"
            )
        if len(stored_shape) != len(shape):
            raise CheckpointingException(
                f"ShardedTensor {v.key!r}: stored with {len(stored_shape)} dimensions {list(stored_shape)}, requested with "
                f"{len(shape)} {list(shape)}"
            )
        lengths = tuple(max(0, min(o + n, s) - o) for o, n, s in zip(v.global_offset, lengths, stored_shape))
        if 0 in lengths:
            return None
        data = data[tuple(slice(0, n) for n in lengths)]
        shape = tuple(stored_shape)
    return adapters.ShardedTensor(
        v.key, data, shape, v.global_offset, lengths, v.replica_id, p,
        slice(flat.start, flat.stop) if flat is not None else None,
    )


def read_metadata(checkpoint_dir: str | Path, *, no_dist: bool, comm: Comm | None = None) -> StorageMetadata:
    """The checkpoint's metadata (read once and broadcast unless ``no_dist``), or
    ``CheckpointingException`` when the directory holds none or holds Megatron-Core's own format.
    ``comm``: the ranks of the calling load, which have checked in already (its broadcast is the
    only collective); without it the ranks check in as ``Checkpointer.get_metadata`` does."""
    try:
        if comm is not None and not no_dist:
            return read_committed(open_storage(location(checkpoint_dir)), comm)
        return Checkpointer().get_metadata(location(checkpoint_dir), no_dist=no_dist)
    except ForeignCheckpointError as e:
        config = maybe_load_config(str(checkpoint_dir))
        if config is None:  # not Megatron's: a DCP or Hugging Face checkpoint, named by the error
            raise NotADistributedCheckpointError(f"{checkpoint_dir} is not a distributed checkpoint: {e}") from e
        backend = config.sharded_backend if config is not None else "unknown"
        raise CheckpointingException(
            f"{checkpoint_dir} holds a checkpoint Megatron-Core wrote (sharded_backend {backend!r}), not a shardsafe one: "
            "shardsafe.megatron.serialization.load and its metadata readers read 'torch_dist' checkpoints (with the "
            "default sharded_strategy); other Megatron formats load with megatron.core.dist_checkpointing"
        ) from e
    except IncompleteCheckpointError as e:
        local = isinstance(checkpoint_dir, (str, PathLike)) and "://" not in fspath(checkpoint_dir)
        if local and not os.path.exists(checkpoint_dir):  # Megatron-Core's words for it
            raise NotADistributedCheckpointError(f"Checkpoint directory {checkpoint_dir} does not exist") from e
        raise NotADistributedCheckpointError(f"{checkpoint_dir} is not a distributed checkpoint: {e}") from e


def tensors_metadata(meta: StorageMetadata) -> ShardedStateDict:
    """Every stored tensor as an unsharded ShardedTensor without data, by key. A tensor of more
    than one dimension saved in flattened ranges (a distributed optimizer's state) is described
    as Megatron-Core describes it: its whole range, ``flattened_range=slice(0, numel)``, so that
    loading the description returns the 1-D flattening."""
    out: ShardedStateDict = {}
    for key, t in meta.tensors.items():
        whole = torch.empty(t.shape, dtype=t.torch_dtype, device="meta")
        if len(t.shape) > 1 and _saved_flattened(t):
            st = ShardedTensor.from_rank_offsets_flat(key, whole.flatten(), whole.shape, flattened_range=slice(0, whole.numel()))
        else:
            st = ShardedTensor.from_rank_offsets(key, whole)
        out[key] = st.without_data()
    return out


def _saved_flattened(t: Any) -> bool:
    """Whether any stored chunk of ``t`` is a flattened range (a v3 chunk table has ``flat`` only then)."""
    if not isinstance(t, TensorStorageMetadata):  # a tensor of megatron-core's own torch_dist checkpoint: as stored
        return False
    table = t.__pydantic_private__["_table"]
    if table is not None:
        return table.flat is not None
    return any(spec.flattened_range is not None for _, spec in t.chunks())


def sharded_metadata(meta: StorageMetadata) -> ShardedStateDict:
    """:func:`tensors_metadata` and every stored ShardedObject (by unique key), without data."""
    out = tensors_metadata(meta)
    for key in meta.objects:
        if _UNIQUE_KEY.match(key):
            out[key] = ShardedObject.empty_from_unique_key(key)
    return out


def _mismatch_text(missing: set[str], unexpected: dict[int, list[str]], where: str) -> str:
    parts = [f"{where}:"]
    if missing:
        parts.append(
            "Some keys found in the checkpoint are missing in the provided sharded state dict. "
            f"Missing keys (for all ranks): {sorted(missing)}."
        )
    if unexpected:
        per_rank = "; ".join(f"rank {r}: {keys}" for r, keys in sorted(unexpected.items()))
        parts.append(
            "Unexpected keys (not found in the checkpoint) encountered in the provided sharded state dict. "
            f"Unexpected keys: {per_rank}."
        )
    return " ".join(parts)


def _raise_mismatch(missing: set[str], unexpected: dict[int, list[str]], where: str) -> None:
    if missing or unexpected:
        raise CheckpointingException(_mismatch_text(missing, unexpected, where))


for _backend in (SHARDSAFE_BACKEND, "torch_dist"):
    register_default_strategy(StrategyAction.SAVE_SHARDED, _backend, 1, ShardsafeSaveShardedStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, _backend, 1, ShardsafeLoadShardedStrategy())
