"""Spreading the work on replicated pieces over a process group, as in
``megatron.core.dist_checkpointing.exchange_utils``.

The fully-parallel wrappers (:mod:`.strategies.fully_parallel`) use this for a wrapped strategy
that is not shardsafe's own (a user's, or a test's mock): every rank of the group describes its
pieces, each rank computes the same assignment of each distinct piece to one rank
(:func:`distribute_shards_to_ranks`), and after each rank has loaded its share, the pieces are
exchanged (:func:`exchange_by_distribution`). shardsafe's own strategies spread the work in the
engine (planning, balanced writes, group reads) and do not come here.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, NamedTuple, TypeVar

import torch

from ..dist import all_gather_objects, broadcast_in, group_rank, group_size, uses_nccl
from .core import CheckpointingException
from .dict_utils import nested_values
from .mapping import ShardedStateDict, ShardedTensor, is_main_replica
from .utils import _sharded_tensor_shard_id, _ShardId

__all__ = [
    "ShardDistribution",
    "determine_main_replica_uniform_distribution",
    "distribute_main_replicas_with_precomputed_distribution",
    "distribute_shards_to_ranks",
    "exchange_by_distribution",
    "exchange_loaded_objects_gather_object",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ALGOS = ("broadcast", "gather_object", "gather_rounds", "all_gather")


class ShardDistribution(NamedTuple):
    """Who does the work on each piece, within one process group (ranks are group ranks)."""

    main_rank_for_shard: dict[_ShardId, int]
    """piece -> the rank that saves (or loads) it"""
    shards_in_this_group: set[_ShardId]
    """the pieces this group handles (for a save: those whose main replica is in the group)"""
    shard_to_metadata: dict[_ShardId, ShardedTensor]
    """piece -> its description (without data)"""
    all_ranks_for_shard: dict[_ShardId, list[int]]
    """piece -> every rank of the group that holds (or requests) it"""


def _group_rank(group: Any) -> int:
    return group_rank(group)


def _group_size(group: Any) -> int:
    return group_size(group)


def _shard_size(sh_ten: ShardedTensor) -> int:
    """Bytes of a piece."""
    r = sh_ten.flattened_range
    numel = (r.stop - r.start) if r is not None else int(torch.Size(sh_ten.local_shape).numel())
    return numel * torch.empty((), dtype=sh_ten.dtype).element_size()


def distribute_shards_to_ranks(
    shard_to_ranks: dict[T, list[int]],
    shard_to_size: dict[T, int],
    num_ranks: int,
    cross_parallelization_group_loads: set[T] | frozenset[T] = frozenset(),
) -> dict[T, int]:
    """Assign each piece to one of the ranks that hold it, spreading bytes evenly.

    A greedy pass, deterministic on every rank: pieces whose main replica lives in another
    group (``cross_parallelization_group_loads``) go last, then pieces held by fewer ranks first,
    then larger pieces first, then by id; each goes to the holding rank with the fewest bytes so
    far (ties: the lowest rank).
    """
    load = [0] * num_ranks
    out: dict[T, int] = {}
    order = sorted(
        shard_to_ranks,
        key=lambda s: (s in cross_parallelization_group_loads, len(shard_to_ranks[s]), -shard_to_size[s], s),
    )
    for shard in order:
        rank = min(shard_to_ranks[shard], key=lambda r: (load[r], r))
        out[shard] = rank
        load[rank] += shard_to_size[shard]
    logger.debug("distribute_shards_to_ranks: bytes per rank %s", load)
    return out


def determine_main_replica_uniform_distribution(
    sharded_state_dict: ShardedStateDict, parallelization_group: Any = None, ignore_groups: bool = False
) -> ShardDistribution | None:
    """Gather every rank's pieces in ``parallelization_group`` and assign each distinct piece to
    one rank (None for a group of one rank). A save (``ignore_groups=False``) handles only the
    pieces whose main replica is in the group; a load (``ignore_groups=True``) every requested
    piece, those whose main replica is elsewhere assigned last."""
    group = parallelization_group
    size = _group_size(group)
    if size <= 1:
        return None
    local = [v.without_data() for v in nested_values(sharded_state_dict) if isinstance(v, ShardedTensor)]
    gathered = all_gather_objects(local, group)
    shard_to_ranks: dict[_ShardId, list[int]] = defaultdict(list)
    sizes: dict[_ShardId, int] = {}
    metadata: dict[_ShardId, ShardedTensor] = {}
    has_main: set[_ShardId] = set()
    has_other: set[_ShardId] = set()
    for rank, pieces in enumerate(gathered):
        for sh_ten in pieces:
            sid = _sharded_tensor_shard_id(sh_ten)
            shard_to_ranks[sid].append(rank)
            if sid not in sizes:
                sizes[sid] = _shard_size(sh_ten)
                metadata[sid] = sh_ten
            (has_main if is_main_replica(sh_ten.replica_id) else has_other).add(sid)
    in_group = has_main | has_other if ignore_groups else set(has_main)
    cross = in_group - has_main
    shard_to_ranks = {sid: ranks for sid, ranks in shard_to_ranks.items() if sid in in_group}
    main = distribute_shards_to_ranks(shard_to_ranks, sizes, size, cross)
    return ShardDistribution(main, in_group, metadata, shard_to_ranks)


def distribute_main_replicas_with_precomputed_distribution(
    sharded_state_dict: ShardedStateDict, parallelization_group: Any, precomputed_distribution: ShardDistribution | None
) -> None:
    """Mark this rank's assigned pieces as main replicas (``replica_id`` 0) and every other piece
    as a non-main one (1), in place."""
    group = parallelization_group
    if _group_size(group) <= 1:
        return
    if precomputed_distribution is None:
        raise CheckpointingException("a group of more than one rank needs a distribution (see determine_main_replica_uniform_distribution)")
    me = _group_rank(group)
    for sh_ten in nested_values(sharded_state_dict):
        if isinstance(sh_ten, ShardedTensor):
            sid = _sharded_tensor_shard_id(sh_ten)
            mine = sid in precomputed_distribution.shards_in_this_group and precomputed_distribution.main_rank_for_shard[sid] == me
            sh_ten.replica_id = 0 if mine else 1


def _exchange_device(group: Any) -> torch.device:
    """Where exchanged tensors live: the GPU for an NCCL group, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if uses_nccl(group) else torch.device("cpu")


def _get_empty_tensor_for_exchange(
    shard_id: _ShardId,
    needed_shards: dict[_ShardId, ShardedTensor],
    unneeded_shards: dict[_ShardId, ShardedTensor],
    loaded_tensors: dict[_ShardId, torch.Tensor],
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.device | None]:
    """A tensor to receive piece ``shard_id`` into, and the device this rank wants it on (None
    when this rank does not request it: the tensor is dropped after the exchange). A requested
    piece is recorded in ``loaded_tensors``."""
    requested = needed_shards.get(shard_id)
    if requested is None:
        meta = unneeded_shards[shard_id]
        shape = (meta.flattened_range.stop - meta.flattened_range.start,) if meta.flattened_range is not None else meta.local_shape
        return torch.empty(shape, dtype=meta.dtype, device=device), None
    requested.init_data(device)
    orig_device = requested.data.device
    tensor = requested.data
    if tensor.device != torch.device(device):
        tensor = torch.empty_like(tensor, device=device)
    loaded_tensors[shard_id] = tensor
    return tensor, orig_device


def exchange_by_distribution(
    loaded_tensors: dict[_ShardId, torch.Tensor],
    unloaded_shards: dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Any = None,
    exchange_algo: str = "broadcast",
) -> dict[_ShardId, torch.Tensor]:
    """Send each piece from the rank that loaded it to the group's other ranks that request it;
    returns every piece this rank requested (``loaded_tensors`` included).

    Every algorithm (``"broadcast"``, ``"gather_object"``, ``"gather_rounds"``) broadcasts each
    piece that more than one rank holds, once, from its loader, in the same order on every rank.
    """
    if exchange_algo not in _ALGOS:
        raise CheckpointingException(f"exchange_algo {exchange_algo!r} is not one of {list(_ALGOS)}")
    group = parallelization_group
    me = _group_rank(group)
    device = _exchange_device(group)
    out = dict(loaded_tensors)
    for sid, src in shard_distribution.main_rank_for_shard.items():
        holders = shard_distribution.all_ranks_for_shard[sid]
        if len(holders) == 1:
            if holders[0] != src:
                raise CheckpointingException(f"piece {sid} is held by rank {holders[0]} alone but assigned to rank {src}")
            continue
        if src == me:
            if sid not in out:
                raise CheckpointingException(f"piece {sid} was assigned to this rank ({me}) but the wrapped strategy did not load it")
            orig_device = out[sid].device
            tensor = out[sid].to(device)
        else:
            tensor, orig_device = _get_empty_tensor_for_exchange(sid, unloaded_shards, shard_distribution.shard_to_metadata, out, device)
        broadcast_in(tensor, src, group)
        if orig_device is not None:
            out[sid] = tensor.to(orig_device)
    return out


def exchange_loaded_objects_gather_object(loaded_objects: dict[_ShardId, Any], parallelization_group: Any = None) -> dict[_ShardId, Any]:
    """Every rank's loaded objects, merged (one all-gather of Python objects)."""
    group = parallelization_group
    gathered = all_gather_objects(loaded_objects, group)
    out: dict[_ShardId, Any] = {}
    for part in gathered:
        out.update(part)
    return out
