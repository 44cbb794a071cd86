"""Sharding integrity and load strictness: the checks behind :mod:`shardsafe.megatron.validation`
(``megatron.core.dist_checkpointing.validation``), kept below the strategies that run them.

The check of a whole job's sharding is a pure function of every rank's descriptions
(:func:`check_global_sharding`): the coordinator runs it on descriptions gathered once, and
every rank raises the same :class:`~shardsafe.megatron.core.CheckpointingException` naming the
key, the ranks and the gap or overlap, before anything is written or read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from enum import Enum
from math import prod
from typing import Any, NamedTuple

import torch

from ..dist import get_comm
from ..errors import ShardingError
from ..format.geometry import check_tiling, flat_segments
from .core import CheckpointingException
from .dict_utils import extract_matching_values, nested_values
from .mapping import (
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)

__all__ = [
    "StrictHandling",
    "adjust_non_strict_load",
    "check_global_sharding",
    "describe_local",
    "determine_global_metadata",
    "maybe_report_missing_and_unexpected_keys",
    "parse_strict_flag",
    "validate_sharding_integrity",
]

log = logging.getLogger(__name__)
_MASK_LIMIT = 1 << 22  # largest tensor whose first uncovered element a gap error names


class StrictHandling(Enum):
    """What a load does when the requested keys and the checkpoint's differ.

    *Unexpected* keys are requested by this rank and absent from the checkpoint; *missing* keys
    are in the checkpoint and requested by no rank (the ``*_ALL`` modes find them, from every
    rank's keys). Every mode but ``ASSUME_OK_UNEXPECTED`` leaves unexpected keys out of the load.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    """No check: an unexpected key fails the load (``MissingKeyError``)."""
    LOG_UNEXPECTED = "log_unexpected"
    """Unexpected keys are logged (WARNING); missing keys are not looked for."""
    LOG_ALL = "log_all"
    """Unexpected and missing keys are logged."""
    RAISE_UNEXPECTED = "raise_unexpected"
    """Unexpected keys raise ``CheckpointingException`` before anything is read."""
    RAISE_ALL = "raise_all"
    """Unexpected or missing keys raise ``CheckpointingException``."""
    RETURN_UNEXPECTED = "return_unexpected"
    """``load`` returns ``(state_dict, set(), unexpected_keys)``."""
    RETURN_ALL = "return_all"
    """``load`` returns ``(state_dict, missing_keys, unexpected_keys)``."""
    IGNORE_ALL = "ignore_all"
    """Mismatches are left out silently."""

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: StrictHandling) -> bool:
        """Whether ``val`` compares the requested keys with the checkpoint's."""
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: StrictHandling) -> bool:
        """Whether ``val`` needs every rank's requested keys (to find missing keys)."""
        return val in (StrictHandling.IGNORE_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL, StrictHandling.LOG_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: StrictHandling) -> bool:
        """Whether ``load`` returns ``(state_dict, missing_keys, unexpected_keys)`` under ``val``."""
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: str | StrictHandling | bool) -> StrictHandling:
    """``strict`` as a :class:`StrictHandling` (from its value, such as ``"raise_all"``; ``True``
    is ``ASSUME_OK_UNEXPECTED`` and ``False`` is ``LOG_UNEXPECTED``, as Megatron-Core documents)."""
    if isinstance(strict, StrictHandling):
        return strict
    if isinstance(strict, bool):
        return StrictHandling.ASSUME_OK_UNEXPECTED if strict else StrictHandling.LOG_UNEXPECTED
    try:
        return StrictHandling(strict)
    except ValueError:
        modes = ", ".join(repr(m.value) for m in StrictHandling)
        raise CheckpointingException(f"invalid strict flag {strict!r}; use a StrictHandling or one of {modes}") from None


class Entry(NamedTuple):
    """One :class:`ShardedBase` as the sharding check sees it (plain, picklable data)."""

    kind: str  # "tensor" or "object"
    key: str
    dtype: str | None  # tensors: "torch.float32"
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    lengths: tuple[int, ...] | None  # tensors: the box, prepended axes included
    flat: tuple[int, int] | None  # tensors: the flattened range of the box
    main: bool
    unique_key: str | None  # objects


def describe_local(values: Iterable[Any]) -> list[Entry]:
    """The :class:`Entry` of each :class:`ShardedTensor` and :class:`ShardedObject` in ``values``."""
    out = []
    for v in values:
        if isinstance(v, ShardedTensor):
            fr = v.flattened_range
            lengths = (1,) * v.prepend_axis_num + tuple(v.local_shape)
            flat = (fr.start, fr.stop) if fr is not None else None
            out.append(Entry("tensor", v.key, str(v.dtype), v.global_shape, v.global_offset, lengths, flat, is_main_replica(v.replica_id), None))
        elif isinstance(v, ShardedObject):
            out.append(Entry("object", v.key, None, v.global_shape, v.global_offset, None, None, is_main_replica(v.replica_id), v.unique_key))
        elif isinstance(v, ShardedTensorFactory):
            raise CheckpointingException(f"ShardedTensorFactory {v.key!r} must be built (apply_factories) before validation")
    return out


def determine_global_metadata(sharded_state_dict: ShardedStateDict) -> tuple[list[ShardedBase], list[list[ShardedBase]]]:
    """This rank's :class:`ShardedBase` values without data, and every rank's (all ranks call it
    together; in a process without a process group, the list of this rank's alone)."""
    local = [v.without_data() for v in nested_values(sharded_state_dict) if isinstance(v, ShardedBase)]
    comm = get_comm(call="shardsafe.megatron.determine_global_metadata")
    gathered = comm.all_gather(lambda: local)
    comm.raise_failures(gathered)
    return local, gathered  # type: ignore[return-value]


def validate_sharding_integrity(global_metadata: Iterable[Any], common_state_dict: dict[str, Any] | None = None) -> None:
    """Raise ``CheckpointingException`` unless the main replicas of every tensor cover it
    exactly once, and each ShardedObject cell has exactly one main replica.

    ``global_metadata`` is every rank's list of :class:`ShardedBase` (Megatron-Core v0.15, as
    :func:`determine_global_metadata` returns it; a pure check, the same on every rank), or this
    rank's values alone (the older signature: then every rank calls it together and the values
    are gathered first). With ``common_state_dict``, ranks whose common state differs from rank
    0's are logged (WARNING): rank 0's is the one saved.
    """
    items = list(global_metadata)
    if not all(isinstance(x, list) for x in items):
        _, items = determine_global_metadata({"local": [x for x in items if isinstance(x, ShardedBase)]})
    elif get_comm(call=None).rank != 0:
        return  # as in Megatron-Core: given every rank's metadata, rank 0 checks (and raises), the others return
    if common_state_dict is not None:
        warn_common_differs(common_state_dict)
    check_global_sharding([describe_local(rank_values) for rank_values in items])


def warn_common_differs(common_state_dict: dict[str, Any]) -> None:
    """Every rank whose common state differs from rank 0's (the one saved) logs a WARNING with
    the key-level difference (:func:`log_common_difference`); every rank calls it together."""
    comm = get_comm(call="shardsafe.megatron.validate_common_state")
    if not comm.distributed:
        return
    rank0 = comm.broadcast(lambda: common_state_dict)
    if not comm.is_coordinator:
        log_common_difference(comm.global_rank, rank0, common_state_dict)


def log_common_difference(rank: int, rank0_common: Any, common: Any) -> bool:
    """Log (WARNING) how rank ``rank``'s common state differs from rank 0's, key by key, in
    Megatron-Core's words, if it does; return whether it does::

        Rank 3 common state dict differs from rank 0 common state dict. Keys only on rank 0: [],
        Keys only on 3: [], Mismatched keys: [(('rank',), <class 'int'>, <class 'int'>)]
    """
    from .dict_utils import diff

    only_rank0, only_here, mismatch = diff(rank0_common, common)
    if not (only_rank0 or only_here or mismatch):
        return False
    log.warning(
        f"Rank {rank} common state dict differs from rank 0 common state dict. Keys only on rank 0: {only_rank0}, "
        f"Keys only on {rank}: {only_here}, Mismatched keys: {mismatch}"
    )
    return True


def check_global_sharding(per_rank: list[list[Entry]]) -> list[list[int]]:
    """Check every rank's entries together; return, for each rank, the indices of its
    non-main tensor pieces that copy a main piece's geometry exactly (a save may let such a
    replica write the piece). Raises ``CheckpointingException`` naming key, ranks and problem.
    """
    by_key: dict[str, list[tuple[int, int, Entry]]] = {}
    for rank, entries in enumerate(per_rank):
        for i, e in enumerate(entries):
            by_key.setdefault(e.key, []).append((rank, i, e))
    copies: list[list[int]] = [[] for _ in per_rank]
    for key, held in by_key.items():
        kinds = {e.kind: r for r, _, e in held}
        if len(kinds) > 1:
            raise CheckpointingException(
                f"key {key!r} is a ShardedTensor on rank {kinds['tensor']} and a ShardedObject on rank {kinds['object']}"
            )
        _check_same(key, held, "global_shape", "global shape")
        if held[0][2].kind == "object":
            _check_objects(key, held)
            continue
        _check_same(key, held, "dtype", "dtype")
        for rank, i in _check_tensor(key, held):
            copies[rank].append(i)
    return copies


def _check_same(key: str, held: list[tuple[int, int, Entry]], field: str, what: str) -> None:
    r0, _, e0 = held[0]
    for rank, _, e in held:
        if getattr(e, field) != getattr(e0, field):
            a, b = getattr(e0, field), getattr(e, field)
            raise CheckpointingException(
                f"key {key!r}: rank {r0} has {what} {list(a) if isinstance(a, tuple) else a}, rank {rank} has "
                f"{list(b) if isinstance(b, tuple) else b}; every piece of one key must agree"
            )


def _piece_text(e: Entry) -> str:
    flat = f" flattened range {list(e.flat)}" if e.flat is not None else ""
    return f"piece at offset {list(e.offset)} shape {list(e.lengths or ())}{flat}"


def _check_tensor(key: str, held: list[tuple[int, int, Entry]]) -> list[tuple[int, int]]:
    shape = held[0][2].global_shape
    mains: dict[tuple, list[int]] = {}
    for rank, _, e in held:
        if e.main:
            mains.setdefault((e.offset, e.lengths, e.flat), []).append(rank)
    for geom, ranks in mains.items():
        if len(ranks) > 1 and _numel(geom):
            e = next(e for r, _, e in held if e.main and (e.offset, e.lengths, e.flat) == geom)
            raise CheckpointingException(
                f"key {key!r}: main replicas overlap: ranks {sorted(ranks)} each hold the {_piece_text(e)} with a main "
                "replica_id; give all but one of them a replica_id other than 0"
            )
    try:
        check_tiling(key, shape, list(mains))
    except ShardingError:
        raise _diagnose(key, shape, held) from None
    return [(rank, i) for rank, i, e in held if not e.main and (e.offset, e.lengths, e.flat) in mains]


def _numel(geom: tuple) -> int:
    off, lens, flat = geom
    return flat[1] - flat[0] if flat is not None else prod(lens)


def _diagnose(key: str, shape: tuple[int, ...], held: list[tuple[int, int, Entry]]) -> CheckpointingException:
    """The error for main replicas that do not tile ``shape``: which ranks overlap, or where the gap is."""
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], int, Entry]] = []
    for rank, _, e in held:
        if not e.main:
            continue
        lens = e.lengths or ()
        if len(e.offset) != len(shape) or any(o < 0 or o + n > s for o, n, s in zip(e.offset, lens, shape)):
            return CheckpointingException(
                f"key {key!r}: rank {rank}'s {_piece_text(e)} lies outside the global shape {list(shape)}"
            )
        if e.flat is None:
            boxes.append((e.offset, lens, rank, e))
            continue
        for rel, seg, _ in flat_segments(lens, e.flat[0], e.flat[1]):
            boxes.append((tuple(o + r for o, r in zip(e.offset, rel)), seg, rank, e))
    boxes = [b for b in boxes if prod(b[1])]
    boxes.sort(key=lambda b: b[0][0] if b[0] else 0)
    active: list[tuple[tuple[int, ...], tuple[int, ...], int, Entry]] = []
    for box in boxes:
        lo = box[0][0] if box[0] else 0
        active = [a for a in active if not a[0] or a[0][0] + a[1][0] > lo]
        for other in active:
            if all(max(a, b) < min(a + m, b + n) for a, m, b, n in zip(box[0], box[1], other[0], other[1])):
                first, second = sorted([other, box], key=lambda b: b[2])
                return CheckpointingException(
                    f"key {key!r}: main replicas overlap: rank {first[2]}'s {_piece_text(first[3])} and rank "
                    f"{second[2]}'s {_piece_text(second[3])} share elements; give one of them a replica_id other than 0"
                )
        active.append(box)
    total = prod(shape)
    covered = sum(prod(b[1]) for b in boxes)
    ranks = sorted({b[2] for b in boxes})
    where = ""
    # Megatron-Core's words first: a gap inside a box that flattened ranges share, or a box no main replica holds
    kind = f"Invalid access pattern for key {key!r}"
    if total <= _MASK_LIMIT:
        mask = torch.zeros(shape, dtype=torch.bool)
        for off, lens, _, _ in boxes:
            mask[tuple(slice(o, o + n) for o, n in zip(off, lens))] = True
        missing = (~mask).nonzero()
        if len(missing):
            first = missing[0].tolist()
            where = f", the first at element {first}"
            flat_box = next(
                (e for _, _, e in held if e.main and e.flat is not None
                 and all(o <= x < o + n for x, o, n in zip(first, e.offset, e.lengths or ()))),
                None,
            )
            if flat_box is not None:
                box = f"ShardedTensor(key={key!r}, global_offset={tuple(flat_box.offset)}, local_shape={tuple(flat_box.lengths or ())})"
                kind = f"Flattened ranges dont cover the whole shard {box}"
    return CheckpointingException(
        f"{kind}: the main replicas (on ranks {ranks}) cover {covered} of the {total} elements of global shape "
        f"{list(shape)}: a gap{where}; every element needs exactly one main replica"
    )


def _check_objects(key: str, held: list[tuple[int, int, Entry]]) -> None:
    shape = held[0][2].global_shape
    cells: dict[str, list[int]] = {}
    for rank, _, e in held:
        if not e.main:
            continue
        if len(e.offset) != len(shape) or any(not 0 <= o < s for o, s in zip(e.offset, shape)):
            raise CheckpointingException(
                f"ShardedObject {key!r}: rank {rank}'s cell at offset {list(e.offset)} lies outside the global shape {list(shape)}"
            )
        cells.setdefault(e.unique_key, []).append(rank)  # type: ignore[arg-type]
    for unique, ranks in cells.items():
        if len(ranks) > 1:
            raise CheckpointingException(
                f"ShardedObject {key!r}: main replicas overlap: ranks {sorted(ranks)} each hold {unique!r} with a main "
                "replica_id; give all but one of them a replica_id other than 0"
            )
    expected = prod(shape)
    if len(cells) != expected:
        seen = {e.offset for _, _, e in held if e.main}
        missing = ""
        if expected <= 1 << 16:
            import itertools

            gaps = [list(c) for c in itertools.product(*(range(s) for s in shape)) if c not in seen]
            missing = f": no rank holds the cells at offsets {gaps[:5]}{' ...' if len(gaps) > 5 else ''}"
        raise CheckpointingException(
            f"ShardedObject {key!r}: {expected - len(cells)} of the {expected} cells of global shape {list(shape)} have no "
            f"main replica{missing}"
        )


def adjust_non_strict_load(sharded_state_dict: ShardedStateDict, sharded_keys_to_remove: set[str]) -> ShardedStateDict:
    """``sharded_state_dict`` without the :class:`ShardedBase` values whose key is in ``sharded_keys_to_remove``."""
    _, kept = extract_matching_values(sharded_state_dict, lambda x: isinstance(x, ShardedBase) and x.key in sharded_keys_to_remove)
    return kept  # type: ignore[return-value]


def maybe_report_missing_and_unexpected_keys(missing_keys: set[str], unexpected_keys: set[str], raise_error: bool = True) -> None:
    """Raise ``CheckpointingException`` (or log a WARNING) naming the mismatched keys, if any."""
    if not missing_keys and not unexpected_keys:
        return
    parts = []
    if missing_keys:
        parts.append(
            f"Some keys found in the checkpoint are missing in the provided sharded state dict. Missing keys (for all ranks): {sorted(missing_keys)}."
        )
    if unexpected_keys:
        parts.append(
            "Unexpected keys (not found in the checkpoint) encountered in the provided sharded state dict. "
            f"Unexpected keys (for this rank): {sorted(unexpected_keys)}."
        )
    msg = " ".join(parts)
    if raise_error:
        raise CheckpointingException(msg)
    log.warning(msg)
