"""Fully parallel save and load, as in ``megatron.core.dist_checkpointing.strategies.fully_parallel``.

Data-parallel replicas hold the same pieces. :class:`FullyParallelSaveStrategyWrapper` spreads
their writes over the ranks (shardsafe's save already does it: a non-main replica whose piece is
exactly a main replica's may write it instead, balanced by bytes over the job).
:class:`FullyParallelLoadStrategyWrapper` reads each distinct requested piece once per
``parallelization_group``: the group agrees on one reader per piece (among the ranks that
request it, balanced by bytes), each rank reads its share from storage, and the group exchanges
the pieces with collectives (``broadcast`` from each reader, or one ``all_gather``). Each stored
byte a group needs is then read from storage once per group, not once per replica.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
import xxhash

from ... import adapters
from ...dist import Comm, get_comm
from ...format.metadata import StorageMetadata
from ...storage import Storage
from .. import exchange_utils
from ..core import CheckpointingException
from ..dict_utils import dict_list_map_inplace, extract_matching_values, merge, nested_values
from ..exchange_utils import (
    ShardDistribution,
    determine_main_replica_uniform_distribution,
    distribute_main_replicas_with_precomputed_distribution,
)
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from ..utils import _sharded_object_id, _sharded_tensor_shard_id
from .async_utils import AsyncRequest
from .base import LoadShardedStrategy, SaveShardedStrategy
from .native import ShardsafeLoadShardedStrategy, ShardsafeSaveShardedStrategy

__all__ = [
    "FullyParallelLoadStrategyWrapper",
    "FullyParallelSaveStrategyWrapper",
    "_sharded_tensor_shard_id",
    "distribute_main_replicas_with_precomputed_distribution",
]

_EXCHANGE_ALGOS = {"broadcast": "broadcast", "all_gather": "all_gather", "gather_rounds": "all_gather", "gather_object": "all_gather"}
# Megatron's names -> shardsafe's exchange of its own strategy's pieces (a foreign strategy's: see exchange_utils)
_ALIGN = 16  # each piece starts at a multiple of this in an exchange buffer (any dtype views it)
_DIRECT_BYTES = 1 << 20
"""A piece of at least this many bytes is broadcast on its own, from and into the tensors
themselves; smaller ones share one buffer per reader (one collective for many small pieces)."""


class FullyParallelSaveStrategyWrapper(ShardsafeSaveShardedStrategy):
    """``strategy`` with replicated writes spread over the ranks of ``process_group``.

    For shardsafe's own strategy the engine already spreads them (over the whole job, which
    includes every ``process_group``), so the wrapper saves exactly as ``strategy`` does. Any
    other strategy that follows the ``SaveShardedStrategy`` interface (a user's, a test's mock)
    gets Megatron-Core's treatment: the group agrees on one saving rank per distinct piece
    (:func:`~shardsafe.megatron.exchange_utils.distribute_shards_to_ranks`), marks it as the main
    replica there and every other copy as non-main, and calls ``strategy.save``. With
    ``do_cache_distribution`` the agreement is computed once and kept in ``cached_distribution``.
    """

    def __init__(self, strategy: SaveShardedStrategy, process_group: Any = None, do_cache_distribution: bool = False) -> None:
        if isinstance(strategy, ShardsafeSaveShardedStrategy):
            super().__init__(strategy.backend, strategy.version, allow_pickle=strategy.allow_pickle, knobs=strategy.knobs)
        else:
            _check_interface(strategy, ("save",), "FullyParallelSaveStrategyWrapper")
            super().__init__(getattr(strategy, "backend", "custom"), getattr(strategy, "version", 1))
        self.base_strategy = strategy
        self.parallelization_group = process_group
        self.do_cache_distribution = do_cache_distribution
        self.cached_distribution: ShardDistribution | None = None

    @property
    def _ours(self) -> bool:
        return isinstance(self.base_strategy, ShardsafeSaveShardedStrategy)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return bool(getattr(self.base_strategy, "can_handle_sharded_objects", False))

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        if self._ours:
            return super().save(sharded_state_dict, checkpoint_dir)
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.save(sharded_state_dict, checkpoint_dir)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> AsyncRequest:
        if self._ours:
            return super().async_save(sharded_state_dict, checkpoint_dir)
        if not hasattr(self.base_strategy, "async_save"):
            raise CheckpointingException(f"{type(self.base_strategy).__name__} has no async_save: save synchronously")
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir)

    def save_all(self, prepare: Any, checkpoint_dir: str | Path, *, validate: bool, background: bool = False) -> Any:
        if not self._ours:
            raise CheckpointingException(
                f"shardsafe.megatron.save writes shardsafe checkpoints only; it cannot drive the wrapped "
                f"{type(self.base_strategy).__name__}: call the wrapper's save(sharded_state_dict, checkpoint_dir) yourself, "
                "or wrap ShardsafeSaveShardedStrategy (the default save strategy)"
            )
        return super().save_all(prepare, checkpoint_dir, validate=validate, background=background)

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> None:
        """Mark this rank's share of the group's pieces as main replicas (others non-main), in place."""
        if self.do_cache_distribution and self.cached_distribution is not None:
            distribution = self.cached_distribution
        else:
            distribution = determine_main_replica_uniform_distribution(sharded_state_dict, self.parallelization_group)
            if self.do_cache_distribution:
                self.cached_distribution = distribution
        distribute_main_replicas_with_precomputed_distribution(sharded_state_dict, self.parallelization_group, distribution)


def _check_interface(strategy: Any, methods: tuple[str, ...], wrapper: str) -> None:
    missing = [m for m in methods if not callable(getattr(strategy, m, None))]
    if missing:
        raise CheckpointingException(
            f"{wrapper} wraps a strategy with {', '.join(methods)} (the Megatron-Core strategy interface); "
            f"{type(strategy).__name__} has no {', '.join(missing)}"
        )


class _Piece(NamedTuple):
    """A requested piece, as the group compares them: equal pieces are read once."""

    key: str
    offset: tuple[int, ...]
    lengths: tuple[int, ...]
    flat: tuple[int, ...]  # (start, stop) of a flattened range, () for a box
    dtype: str
    nbytes: int


class _Plan(NamedTuple):
    reader: dict[_Piece, int]  # piece -> the group rank that reads it
    wanted: dict[_Piece, list[int]]  # piece -> the group ranks that request it
    sizes: list[int]  # per group rank: bytes it sends to the others


class FullyParallelLoadStrategyWrapper(ShardsafeLoadShardedStrategy):
    """``strategy`` (a :class:`ShardsafeLoadShardedStrategy`) with each distinct piece read from
    storage by one rank of ``parallelization_group`` (default: every rank) and sent to the
    group's other ranks that request it.

    ``exchange_algo`` is ``"broadcast"`` (each reader broadcasts what it read for the others;
    the default) or ``"all_gather"`` (one all-gather of every reader's bytes; Megatron-Core's
    ``"gather_rounds"`` and ``"gather_object"`` mean it too). With ``do_cache_distribution`` the
    group's agreement on readers is kept and reused while every rank requests the same pieces
    (the group then exchanges a digest instead of the descriptions). Loaded values are bit-exact
    the same as the wrapped strategy's.
    """

    def __init__(
        self,
        strategy: LoadShardedStrategy,
        parallelization_group: Any = None,
        do_cache_distribution: bool = False,
        exchange_algo: str = "broadcast",
    ) -> None:
        if exchange_algo not in _EXCHANGE_ALGOS:
            raise CheckpointingException(
                f"FullyParallelLoadStrategyWrapper: exchange_algo {exchange_algo!r} is not one of {sorted(_EXCHANGE_ALGOS)}"
            )
        if isinstance(strategy, ShardsafeLoadShardedStrategy):
            super().__init__(allow_pickle=strategy.allow_pickle, knobs=strategy.knobs)
        else:
            _check_interface(strategy, ("load",), "FullyParallelLoadStrategyWrapper")
            super().__init__()
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = _EXCHANGE_ALGOS[exchange_algo]
        self.requested_exchange_algo = exchange_algo
        self.cached_distribution: Any = None
        """shardsafe's strategy: the group's agreed readers; any other: a :class:`ShardDistribution`."""

    @property
    def _ours(self) -> bool:
        return isinstance(self.base_strategy, ShardsafeLoadShardedStrategy)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return bool(getattr(self.base_strategy, "can_handle_sharded_objects", False))

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> StateDict:
        """The wrapped strategy's load, with each distinct piece loaded by one rank of the group."""
        if self._ours:
            return super().load(sharded_state_dict, checkpoint_dir)
        return self._load_any(sharded_state_dict, checkpoint_dir)

    def _load_any(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> StateDict:
        """Megatron-Core's scheme, for a strategy that is not shardsafe's: agree on one loader per
        piece, let the wrapped strategy load this rank's share (objects first, then tensors),
        broadcast each piece from its loader, gather the objects, and fill in the rest."""
        group = self.parallelization_group if self.parallelization_group is not None else torch.distributed.group.WORLD
        if torch.distributed.get_world_size(group=group) <= 1:
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
        if self.do_cache_distribution and self.cached_distribution is not None:
            distribution = self.cached_distribution
        else:
            distribution = determine_main_replica_uniform_distribution(sharded_state_dict, group, ignore_groups=True)
            if self.do_cache_distribution:
                self.cached_distribution = distribution
        distribute_main_replicas_with_precomputed_distribution(sharded_state_dict, group, distribution)
        tensors, rest = extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedTensor))
        objects, rest = extract_matching_values(rest, lambda v: isinstance(v, ShardedObject))
        if rest:
            raise CheckpointingException(
                f"FullyParallelLoadStrategyWrapper loads ShardedTensors and ShardedObjects only; also got {sorted(map(str, rest))}"
            )
        own_tensors, other_tensors = _split_by_replica(tensors, ShardedTensor, _sharded_tensor_shard_id)
        own_objects, other_objects = _split_by_replica(objects, ShardedObject, _sharded_object_id)
        loaded_objects = self.base_strategy.load(own_objects, checkpoint_dir)
        loaded_tensors = self.base_strategy.load(own_tensors, checkpoint_dir)
        every_tensor = exchange_utils.exchange_by_distribution(
            loaded_tensors, other_tensors, distribution, group, self.requested_exchange_algo
        )
        every_object = exchange_utils.exchange_loaded_objects_gather_object(loaded_objects, group)
        _fill_in(tensors, every_tensor, ShardedTensor, _sharded_tensor_shard_id)
        _fill_in(objects, every_object, ShardedObject, _sharded_object_id)
        out: StateDict = {}
        merge(out, objects)
        merge(out, tensors)
        return out

    # what the wrapped strategy knows of its checkpoints (shardsafe's, torch_dist or any other), it still decides
    def check_backend_compatibility(self, loaded_backend: str) -> None:
        self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        self.base_strategy.check_version_compatibility(loaded_version)

    def common_of(self, meta: Any, checkpoint_dir: str | Path | Storage) -> Any:
        return self.base_strategy.common_of(meta, checkpoint_dir)

    def load_common(self, checkpoint_dir: str | Path) -> Any:
        return self.base_strategy.load_common(checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> Any:
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> Any:
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)

    def view(self, checkpoint_dir: str | Path | Storage) -> Any:
        """The wrapped torch_dist strategy's view of the checkpoint (see ``TorchDistLoadShardedStrategy``)."""
        return self.base_strategy.view(checkpoint_dir)  # type: ignore[attr-defined]

    def _object(self, v: Any, meta: Any, checkpoint_dir: Any) -> Any:
        return self.base_strategy._object(v, meta, checkpoint_dir)

    def read_targets(self, checkpoint_dir: str | Path | Storage, targets: dict[str, adapters.ShardedTensor], meta: StorageMetadata) -> None:
        """Read this rank's share of the group's distinct pieces, then exchange them in the group."""
        comm = get_comm(process_group=self.parallelization_group, call="FullyParallelLoadStrategyWrapper")
        if not comm.distributed:
            super().read_targets(checkpoint_dir, targets, meta)
            return
        by_piece: dict[_Piece, list[adapters.ShardedTensor]] = {}
        for name in sorted(targets):
            t = targets[name]
            by_piece.setdefault(_describe(t), []).append(t)
        plan = self._plan(comm, sorted(by_piece))
        mine = {f"{p.key}#{i}": ts[0] for i, (p, ts) in enumerate(sorted(by_piece.items())) if plan.reader[p] == comm.rank}
        self.base_strategy.read_targets(checkpoint_dir, mine, meta)  # every rank of the job reads its share together
        self._exchange(comm, plan, {p: ts[0] for p, ts in by_piece.items()})
        for ts in by_piece.values():  # the same piece twice on this rank
            for t in ts[1:]:
                t.data.copy_(ts[0].data)

    def _plan(self, comm: Comm, pieces: list[_Piece]) -> _Plan:
        digest = xxhash.xxh3_128_hexdigest(repr(pieces).encode())
        if self.do_cache_distribution and self.cached_distribution is not None:
            digests = comm.all_gather(lambda: digest)
            comm.raise_failures(digests)
            if digests == self.cached_distribution[0]:
                return self.cached_distribution[1]
        gathered = comm.all_gather(lambda: (digest, pieces))
        comm.raise_failures(gathered)
        plan = distribute([g[1] for g in gathered])  # type: ignore[index]
        if self.do_cache_distribution:
            self.cached_distribution = ([g[0] for g in gathered], plan)  # type: ignore[index]
        return plan

    def _exchange(self, comm: Comm, plan: _Plan, local: dict[_Piece, adapters.ShardedTensor]) -> None:
        sent = [[p for p in sorted(plan.reader) if plan.reader[p] == r and len(plan.wanted[p]) > 1] for r in range(comm.world_size)]
        if self.exchange_algo == "all_gather":
            width = max(plan.sizes)
            if width == 0:
                return
            bufs = [torch.empty(width, dtype=torch.uint8) for _ in range(comm.world_size)]
            mine = bufs[comm.rank]
            _pack(mine, sent[comm.rank], local)
            comm.all_gather_tensors(bufs, mine.clone())
            for r in range(comm.world_size):
                if r != comm.rank:
                    _unpack(bufs[r], sent[r], local)
            return
        scratch: list[torch.Tensor] = []  # one buffer for the large pieces this rank does not request
        for r in range(comm.world_size):
            small = [p for p in sent[r] if p.nbytes < _DIRECT_BYTES]
            if small:  # the small pieces in one buffer: one collective for all of them
                buf = torch.empty(sum(_aligned(p.nbytes) for p in small), dtype=torch.uint8)
                if r == comm.rank:
                    _pack(buf, small, local)
                comm.broadcast_tensor(buf, r)
                if r != comm.rank:
                    _unpack(buf, small, local)
            for p in sent[r]:  # a large piece straight from the reader's tensor into the others'
                if p.nbytes >= _DIRECT_BYTES:
                    _broadcast_piece(p, local.get(p), comm, r, r == comm.rank, scratch)


def _split_by_replica(sharded: ShardedStateDict, kind: type, shard_id: Any) -> tuple[dict, dict]:
    """Pieces of ``kind`` this rank loads (main replicas) and the ones other ranks load, by id."""
    own: dict = {}
    other: dict = {}
    for v in nested_values(sharded):
        if isinstance(v, kind):
            (own if is_main_replica(v.replica_id) else other)[shard_id(v)] = v
    return own, other


def _fill_in(sharded: ShardedStateDict, loaded: dict, kind: type, shard_id: Any) -> None:
    """Replace each piece of ``kind`` by its loaded value, in place."""

    def fill(v: Any) -> Any:
        if not isinstance(v, kind):
            return v
        try:
            return loaded[shard_id(v)]
        except KeyError:
            raise CheckpointingException(
                f"{v.key}: piece {shard_id(v)} was not loaded by any rank of the parallelization group"
            ) from None

    dict_list_map_inplace(fill, sharded)


def distribute(per_rank: list[list[_Piece]]) -> _Plan:
    """Which rank of the group reads each distinct piece: one of the ranks that request it, the
    one with the fewest bytes assigned so far, largest pieces first (ties: the lowest rank).
    A pure function of every rank's request, so each rank computes the same plan."""
    wanted: dict[_Piece, list[int]] = {}
    for r, pieces in enumerate(per_rank):
        for p in pieces:
            wanted.setdefault(p, []).append(r)
    load = [0] * len(per_rank)
    reader: dict[_Piece, int] = {}
    for p in sorted(wanted, key=lambda p: (-p.nbytes, p)):
        r = min(wanted[p], key=lambda r: (load[r], r))
        reader[p] = r
        load[r] += p.nbytes
    sizes = [0] * len(per_rank)
    for p in sorted(reader):
        if len(wanted[p]) > 1:
            sizes[reader[p]] += _aligned(p.nbytes)
    return _Plan(reader, wanted, sizes)


def _describe(t: adapters.ShardedTensor) -> _Piece:
    flat = (t.flattened_range.start, t.flattened_range.stop) if t.flattened_range is not None else ()
    return _Piece(t.key, tuple(t.global_offset), tuple(t.local_shape), flat, str(t.data.dtype), t.data.numel() * t.data.element_size())


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _pack(buf: torch.Tensor, pieces: list[_Piece], local: dict[_Piece, adapters.ShardedTensor]) -> None:
    at = 0
    for p in pieces:
        data = local[p].data
        buf[at : at + p.nbytes].view(data.dtype).view(data.shape).copy_(data)
        at += _aligned(p.nbytes)


def _broadcast_piece(
    p: _Piece, t: adapters.ShardedTensor | None, comm: Comm, src: int, sending: bool, scratch: list[torch.Tensor]
) -> None:
    """Broadcast piece ``p`` from its reader ``src`` (``sending`` on the reader): the bytes of
    ``t.data`` where it is contiguous, through a buffer where it is not or where this rank does not
    request ``p`` (``t`` is None)."""
    data = t.data if t is not None else None
    direct = data is not None and data.is_contiguous()
    if direct:
        buf = data.reshape(-1).view(torch.uint8)  # type: ignore[union-attr]
    else:
        if not scratch or scratch[0].numel() < p.nbytes:
            scratch[:] = [torch.empty(p.nbytes, dtype=torch.uint8)]
        buf = scratch[0][: p.nbytes]
        if sending:
            buf.view(data.dtype).view(data.shape).copy_(data)  # type: ignore[union-attr]
    comm.broadcast_tensor(buf, src)
    if not sending and not direct and data is not None:
        data.copy_(buf.view(data.dtype).view(data.shape))


def _unpack(buf: torch.Tensor, pieces: list[_Piece], local: dict[_Piece, adapters.ShardedTensor]) -> None:
    at = 0
    for p in pieces:
        t = local.get(p)
        if t is not None:
            t.data.copy_(buf[at : at + p.nbytes].view(t.data.dtype).view(t.data.shape))
        at += _aligned(p.nbytes)
