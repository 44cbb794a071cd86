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
import torch.distributed as dist
import xxhash

from ... import adapters
from ...dist import Comm, get_comm
from ...format.metadata import StorageMetadata
from ...storage import Storage
from ..core import CheckpointingException
from .shardsafe import ShardsafeLoadShardedStrategy, ShardsafeSaveShardedStrategy

__all__ = ["FullyParallelLoadStrategyWrapper", "FullyParallelSaveStrategyWrapper"]

_EXCHANGE_ALGOS = {"broadcast": "broadcast", "all_gather": "all_gather", "gather_rounds": "all_gather", "gather_object": "all_gather"}
_ALIGN = 16  # each piece starts at a multiple of this in an exchange buffer (any dtype views it)
_DIRECT_BYTES = 1 << 20
"""A piece of at least this many bytes is broadcast on its own, from and into the tensors
themselves; smaller ones share one buffer per reader (one collective for many small pieces)."""


class FullyParallelSaveStrategyWrapper(ShardsafeSaveShardedStrategy):
    """``strategy`` (a :class:`ShardsafeSaveShardedStrategy`) with replicated writes spread over
    the ranks. shardsafe's save always spreads them (over the whole job, which includes every
    ``process_group``), so this wrapper saves exactly as ``strategy`` does; it exists so that
    Megatron-Core code that wraps its strategy runs unchanged."""

    def __init__(self, strategy: ShardsafeSaveShardedStrategy, process_group: Any = None, do_cache_distribution: bool = False) -> None:
        if not isinstance(strategy, ShardsafeSaveShardedStrategy):
            raise CheckpointingException(
                f"FullyParallelSaveStrategyWrapper wraps a ShardsafeSaveShardedStrategy, not {type(strategy).__name__}"
            )
        super().__init__(strategy.backend, strategy.version, allow_pickle=strategy.allow_pickle, knobs=strategy.knobs)
        self.base_strategy = strategy
        self.parallelization_group = process_group
        self.do_cache_distribution = do_cache_distribution


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
        strategy: ShardsafeLoadShardedStrategy,
        parallelization_group: Any = None,
        do_cache_distribution: bool = False,
        exchange_algo: str = "broadcast",
    ) -> None:
        if not isinstance(strategy, ShardsafeLoadShardedStrategy):
            raise CheckpointingException(
                f"FullyParallelLoadStrategyWrapper wraps a ShardsafeLoadShardedStrategy, not {type(strategy).__name__}"
            )
        if exchange_algo not in _EXCHANGE_ALGOS:
            raise CheckpointingException(
                f"FullyParallelLoadStrategyWrapper: exchange_algo {exchange_algo!r} is not one of {sorted(_EXCHANGE_ALGOS)}"
            )
        super().__init__(allow_pickle=strategy.allow_pickle, knobs=strategy.knobs)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = _EXCHANGE_ALGOS[exchange_algo]
        self.cached_distribution: tuple[list[str], _Plan] | None = None

    # what the wrapped strategy knows of its checkpoints (shardsafe's or torch_dist), it still decides
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
        group = comm._cpu_group()
        sent = [[p for p in sorted(plan.reader) if plan.reader[p] == r and len(plan.wanted[p]) > 1] for r in range(comm.world_size)]
        if self.exchange_algo == "all_gather":
            width = max(plan.sizes)
            if width == 0:
                return
            bufs = [torch.empty(width, dtype=torch.uint8) for _ in range(comm.world_size)]
            mine = bufs[comm.rank]
            _pack(mine, sent[comm.rank], local)
            dist.all_gather(bufs, mine.clone(), group=group)
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
                dist.broadcast(buf, src=comm.global_ranks[r], group=group)
                if r != comm.rank:
                    _unpack(buf, small, local)
            for p in sent[r]:  # a large piece straight from the reader's tensor into the others'
                if p.nbytes >= _DIRECT_BYTES:
                    _broadcast_piece(p, local.get(p), comm.global_ranks[r], r == comm.rank, group, scratch)


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
    p: _Piece, t: adapters.ShardedTensor | None, src: int, sending: bool, group: Any, scratch: list[torch.Tensor]
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
    dist.broadcast(buf, src=src, group=group)
    if not sending and not direct and data is not None:
        data.copy_(buf.view(data.dtype).view(data.shape))


def _unpack(buf: torch.Tensor, pieces: list[_Piece], local: dict[_Piece, adapters.ShardedTensor]) -> None:
    at = 0
    for p in pieces:
        t = local.get(p)
        if t is not None:
            t.data.copy_(buf[at : at + p.nbytes].view(t.data.dtype).view(t.data.shape))
        at += _aligned(p.nbytes)
