"""Turn a state dict into this rank's pieces: geometry for planning, views for the bytes.

Supported values: ``torch.Tensor`` / ``nn.Parameter`` (replicated: the same on every rank that
holds the key), ``DTensor`` with Shard / _StridedShard / Replicate placements on any mesh,
:class:`ShardedTensor`, tensors that carry their own flat sharding spec (OLMo-core's
``ShardedFlatTensor``, see :mod:`.flat_sharded`), and non-tensor values (returned separately, for
the JSON store). Several :class:`ShardedTensor` values (under different names) may hold pieces of one
key. Any other ``torch.Tensor`` subclass is refused: its sharding is unknown, and
taking it for a replicated tensor could store one rank's part as the whole.
"""

from __future__ import annotations

import functools
import sys
import weakref
from dataclasses import dataclass
from itertools import product
from typing import Any

import torch

from ..errors import CheckpointError, DtypeMismatchError, ShapeMismatchError, ShardingError
from ..format.dtypes import dtype_name
from ..format.geometry import Piece, chunk_bounds
from .flat_sharded import flat_sharding
from .sharded_tensor import ShardedTensor, view_as
from .subclasses import Described, as_plain, class_path, describe_subclass, refuse_unknown, rule_for, unwrap

DTensor: Any = None  # set by _dtensor() once torch.distributed.tensor is imported
Replicate: Any = None
Shard: Any = None
_StridedShard: Any = None


def _dtensor() -> Any:
    """``DTensor``, or None while ``torch.distributed.tensor`` is not imported: no DTensor can
    exist before it is, and importing it here would cost every process that imports shardsafe
    about half a second (the command line's start included)."""
    global DTensor, Replicate, Shard, _StridedShard
    if DTensor is None and "torch.distributed.tensor" in sys.modules:
        try:  # torch >= 2.4 ships DTensor here
            from torch.distributed.tensor import DTensor as dtensor
            from torch.distributed.tensor import Replicate as replicate
            from torch.distributed.tensor import Shard as shard
        except ImportError:  # pragma: no cover - older torch
            return None
        try:
            from torch.distributed.tensor.placement_types import _StridedShard as strided
        except ImportError:  # pragma: no cover - older torch
            strided = None
        Replicate, Shard, _StridedShard = replicate, shard, strided
        DTensor = dtensor  # last: a thread that sees it sees the placements too
    return DTensor


__all__ = ["DescribeCache", "LocalTensor", "describe_state"]


@dataclass(slots=True, weakref_slot=True)
class LocalTensor:
    """One key as this rank holds it: pieces of the global tensor and a view on each."""

    key: str
    dtype: torch.dtype
    dtype_name: str
    shape: tuple[int, ...]
    pieces: list[Piece]
    views: list[torch.Tensor]  # piece box shaped, or 1-D for a flat piece; shares the value's memory
    subclass: tuple[str, dict[str, Any]] | None = None  # an inner tensor of a subclass: (its key, its record)


class DescribeCache:
    """The descriptions of one save's tensors, reused by the next save of the same tensors.

    A training loop saves the same parameter and optimizer-state tensors every time; describing
    a DTensor (its mesh coordinate, placements, pieces and views) costs about 10 µs, which an
    async save's caller would wait for on every tensor. An entry is reused only when the value is
    the very object described before (the cache holds it weakly: an entry goes with its tensor)
    and still has the same memory and layout: the same local tensor and sharding spec for a
    DTensor, the same data pointer, shape, strides and dtype for its bytes. Anything else (a
    ``p.data = ...``, a resize, a redistributed DTensor) is described afresh. A view kept by an
    entry holds the storage it was made from until the next save replaces it.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, ...]] = {}  # id(value) -> (weakref to it, stamp, local, spec, description)

    def _forget(self, ref: weakref.ref[Any], key: int) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry[0] is ref:  # not a newer value that took the same id
            del self._entries[key]

    def describe(self, name: str, value: Any) -> LocalTensor | None | bool:
        """The description of ``value`` under ``name`` (None: not a tensor), or False when this
        kind of value is not cached."""
        cls = type(value)
        if (dt := _dtensor()) is not None and cls is dt:
            local = value._local_tensor
            if type(local) is not torch.Tensor:  # a subclass inside: described each time
                return False
        elif cls is torch.Tensor or cls is torch.nn.Parameter:
            local = value
        else:
            return False
        stamp = (name, local.data_ptr(), local.shape, local.stride(), local.dtype, local.device)
        key = id(value)
        entry = self._entries.get(key)
        if (
            entry is not None and entry[0]() is value and entry[1] == stamp
            and (local is value or (entry[2] is local and entry[3] is value._spec))
        ):
            return entry[4]
        described = _describe(name, value, False)
        ref = weakref.ref(value, lambda r, key=key: self._forget(r, key))
        self._entries[key] = (ref, stamp, None if local is value else local, getattr(value, "_spec", None), described)
        return described


def describe_state(
    state_dict: dict[str, Any], *, targets: bool = False, cache: DescribeCache | None = None
) -> tuple[list[LocalTensor], dict[str, Any]]:
    """Split ``state_dict`` into tensors (described) and other values (returned as is).

    With ``targets`` (the tensors are to be filled by a load) every view is a view of the
    caller's memory, or ``ShardingError`` names the key: filling a copy would leave the caller's
    tensor unchanged without an error. A save may describe a value through a copy. A save may
    pass a :class:`DescribeCache` (not with ``targets``): the same tensors as last time are not
    described again, and come back as the same ``LocalTensor`` objects.
    """
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    tensors: dict[str, LocalTensor] = {}
    objects: dict[str, Any] = {}
    pieced: dict[str, str] = {}  # key -> first state-dict name, for keys described by ShardedTensors
    for name, value in state_dict.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"state_dict keys must be non-empty strings, got {name!r}")
        local = cache.describe(name, value) if cache is not None else False
        if local is False:
            local = _describe(name, value, targets)
        if local is None:
            objects[name] = value
            continue
        if isinstance(local, Described):
            _add_subclass(tensors, objects, local, targets)
            continue
        if local.key in tensors or local.key in objects:
            if local.key in pieced and isinstance(value, ShardedTensor):
                _add_pieces(tensors[local.key], local, pieced[local.key], name)
                continue
            raise CheckpointError(
                f"key {local.key!r} appears twice in the state dict (several pieces of one key on one rank "
                "must each be a shardsafe.ShardedTensor)"
            )
        tensors[local.key] = local
        if isinstance(value, ShardedTensor):
            pieced[local.key] = name
    for key in objects:
        if key in tensors:
            raise CheckpointError(f"key {key!r} appears twice in the state dict")
    return list(tensors.values()), objects


def _add_subclass(tensors: dict[str, LocalTensor], objects: dict[str, Any], d: Described, targets: bool) -> None:
    """A subclass value: its inner tensors as tensors, its record as the value of its key (on save)."""
    if d.key in tensors or d.key in objects:
        raise CheckpointError(f"key {d.key!r} appears twice in the state dict")
    for inner in d.inners:
        if inner.key in tensors or inner.key in objects:
            raise CheckpointError(
                f"key {inner.key!r} is in the state dict, and it is also the key of inner tensor {inner.name!r} of the "
                f"{d.record['class']} under {d.key!r}; rename one of them"
            )
        t = inner.tensor
        offset = inner.offset if inner.offset is not None else (0,) * t.dim()
        tensors[inner.key] = LocalTensor(
            inner.key, t.dtype, dtype_name(t.dtype, key=inner.key), inner.shape, [(offset, tuple(t.shape), None)], [t],
            (d.key, d.record),
        )
    if not targets:
        objects[d.key] = d.record


def _add_pieces(into: LocalTensor, more: LocalTensor, first: str, name: str) -> None:
    """Another piece of a key this rank already holds a piece of (stacked layers, several
    flattened ranges, expert slices): same dtype and global shape, pieces side by side. Whether
    the pieces overlap is for planning to check, with every rank's pieces."""
    if more.dtype != into.dtype:
        raise DtypeMismatchError(
            f"key {into.key!r}: the ShardedTensor under {name!r} has dtype {more.dtype_name}, the one under {first!r} "
            f"has {into.dtype_name}; the pieces of one key share its dtype"
        )
    if more.shape != into.shape:
        raise ShapeMismatchError(
            f"key {into.key!r}: the ShardedTensor under {name!r} has global shape {list(more.shape)}, the one under "
            f"{first!r} has {list(into.shape)}; the pieces of one key share its global shape"
        )
    into.pieces.extend(more.pieces)
    into.views.extend(more.views)


def _describe(name: str, value: Any, targets: bool) -> LocalTensor | Described | None:
    if isinstance(value, ShardedTensor):
        data = as_plain(value.key, value.data)
        if data is None:
            cls = type(value.data)
            if rule_for(cls) is None:
                raise refuse_unknown(value.key, cls, " (the data of a ShardedTensor)")
            raise ShardingError(
                f"key {value.key!r}: the data of this ShardedTensor is a {class_path(cls)}; shardsafe "
                "stores its blocks for a DTensor or a plain tensor holding it, not for a ShardedTensor's box or flattened range"
            )
        _check_tensor(value.key, data)
        data = data.detach()
        flat = None
        if value.flattened_range is not None:
            flat = (value.flattened_range.start, value.flattened_range.stop)
        elif data.shape != value.local_shape:
            data = view_as(data, value.local_shape, value.key) if targets else data.reshape(value.local_shape)
        piece = (value.global_offset, value.local_shape, flat)
        return LocalTensor(value.key, data.dtype, dtype_name(data.dtype, key=value.key), value.global_shape, [piece], [data])
    if (dt := _dtensor()) is not None and isinstance(value, dt):
        return _describe_dtensor(name, value)
    if not isinstance(value, torch.Tensor):
        return None
    if type(value) not in (torch.Tensor, torch.nn.Parameter) and rule_for(type(value)) is not None:
        wrapped = unwrap(name, value)
        if wrapped is not None:  # a float8 all-gather weight: its high-precision tensor
            return _describe(name, wrapped, targets)
        shape = tuple(value.shape)
        return describe_subclass(name, value, shape, (0,) * len(shape), value.dtype)
    flat_spec = flat_sharding(name, value)
    if flat_spec is not None:
        _check_tensor(name, flat_spec.local)
        pieces: list[Piece] = []
        views: list[torch.Tensor] = []
        pos = 0
        for start, stop in flat_spec.ranges:
            pieces.append(((0,) * len(flat_spec.shape), flat_spec.shape, (start, stop)))
            views.append(flat_spec.local[pos : pos + stop - start])
            pos += stop - start
        dtype = flat_spec.local.dtype
        return LocalTensor(name, dtype, dtype_name(dtype, key=name), flat_spec.shape, pieces, views)
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        raise refuse_unknown(name, type(value))
    _check_tensor(name, value)
    shape = tuple(value.shape)
    return LocalTensor(name, value.dtype, dtype_name(value.dtype, key=name), shape, [((0,) * len(shape), shape, None)], [value.detach()])


def _check_tensor(key: str, t: torch.Tensor) -> None:
    if t.is_sparse or t.layout != torch.strided:
        raise CheckpointError(f"key {key!r}: only dense (strided) tensors can be saved, got layout {t.layout}")
    if t.device.type == "meta":
        raise CheckpointError(f"key {key!r}: tensor is on the meta device and holds no data; materialise it first")


def _describe_dtensor(key: str, value: DTensor) -> LocalTensor | Described:
    # not to_local(): no autograd node per tensor per save; a float8 all-gather weight's
    # high-precision tensor, sharded as the DTensor is
    local = as_plain(key, value._local_tensor)
    if local is None:  # a subclass whose bytes are not the tensor's: described by its blocks, or refused
        cls = type(value._local_tensor)
        if rule_for(cls) is None:
            raise refuse_unknown(key, cls, " (the local tensor of a DTensor)")
        return _describe_dtensor_subclass(key, value, value._local_tensor)
    local = local.detach()
    _check_tensor(key, local)
    shape = tuple(value.shape)
    mesh = value.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh: it holds nothing of the tensor
        return LocalTensor(key, local.dtype, dtype_name(local.dtype, key=key), shape, [], [])
    placements = tuple(value.placements)
    try:
        local_shape, pieces, slices = _dtensor_layout(shape, tuple(mesh.shape), tuple(coord), placements)
    except ShardingError:  # again, for a message that names the key
        dtensor_intervals(key, shape, tuple(mesh.shape), tuple(coord), placements)
        raise
    if tuple(local.shape) != local_shape:
        raise ShardingError(
            f"key {key!r}: DTensor local shape {list(local.shape)} differs from {list(local_shape)} implied by "
            f"placements {value.placements} on mesh {tuple(mesh.shape)} at coordinate {tuple(coord)}"
        )
    views = [local if sl is None else local[sl] for sl in slices]
    return LocalTensor(key, local.dtype, dtype_name(local.dtype, key=key), shape, list(pieces), views)


def _describe_dtensor_subclass(key: str, value: DTensor, local: torch.Tensor) -> Described:
    """A DTensor whose local tensor is an allow-listed subclass: its inner tensors, sharded as
    the DTensor is, block by block."""
    shape = tuple(value.shape)
    coord = value.device_mesh.get_coordinate()
    if coord is None:
        raise ShardingError(f"key {key!r}: this rank is outside the mesh of a DTensor of {type(local).__qualname__}")
    local_shape, pieces, _ = _dtensor_layout(shape, tuple(value.device_mesh.shape), tuple(coord), tuple(value.placements))
    if len(pieces) != 1 or tuple(local.shape) != local_shape:
        raise ShardingError(
            f"key {key!r}: the local {type(local).__qualname__} of this DTensor holds {len(pieces)} pieces of the "
            f"global tensor (placements {value.placements}); shardsafe stores a subclass's blocks for a local tensor "
            "that is one box of the global tensor"
        )
    return describe_subclass(key, local, shape, pieces[0][0], value.dtype)


@functools.lru_cache(maxsize=4096)
def _dtensor_layout(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...], placements: tuple[Any, ...]
) -> tuple[tuple[int, ...], tuple[Piece, ...], tuple[tuple[slice, ...] | None, ...]]:
    """This rank's local shape, pieces and the slice of the local tensor holding each (None: all
    of it), for a DTensor layout: the same for every tensor of a layer, and from save to save."""
    dims = dtensor_intervals("", shape, mesh_shape, coord, placements)
    local_shape = tuple(sum(n for _, n in iv) for iv in dims)
    pieces: list[Piece] = []
    slices: list[tuple[slice, ...] | None] = []
    # each dim's intervals sit back to back in local coordinates
    local_starts = []
    for iv in dims:
        starts, acc = [], 0
        for _, n in iv:
            starts.append(acc)
            acc += n
        local_starts.append(starts)
    for combo in product(*[range(len(iv)) for iv in dims]):
        off = tuple(dims[d][k][0] for d, k in enumerate(combo))
        lens = tuple(dims[d][k][1] for d, k in enumerate(combo))
        if 0 in lens:
            continue
        pieces.append((off, lens, None))
        whole = lens == local_shape
        slices.append(None if whole else tuple(slice(local_starts[d][k], local_starts[d][k] + lens[d]) for d, k in enumerate(combo)))
    return local_shape, tuple(pieces), tuple(slices)


def dtensor_intervals(
    key: str, shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...], placements
) -> list[list[tuple[int, int]]]:
    """For each tensor dim, the global ``(start, length)`` intervals this rank's local tensor
    holds, in local order. Placements apply left to right over mesh dims, as DTensor does."""
    _dtensor()  # the placement classes, when a caller reaches here before any DTensor was described
    dims: list[list[tuple[int, int]]] = [[(0, n)] for n in shape]
    for mesh_dim, p in enumerate(placements):
        n, c = mesh_shape[mesh_dim], coord[mesh_dim]
        if _StridedShard is not None and isinstance(p, _StridedShard):
            d, sf = p.dim, int(p.split_factor)
            total = sum(ln for _, ln in dims[d])
            new: list[tuple[int, int]] = []
            for j in range(sf):
                ps, pl = chunk_bounds(total, sf, j)
                cs, cl = chunk_bounds(pl, n, c)
                new += _take(dims[d], ps + cs, cl)
            dims[d] = _merge(new)
        elif isinstance(p, Shard):
            d = p.dim
            s, ln = chunk_bounds(sum(x for _, x in dims[d]), n, c)
            dims[d] = _take(dims[d], s, ln)
        elif isinstance(p, Replicate):
            continue
        else:
            raise ShardingError(
                f"key {key!r}: DTensor placement {p} on mesh dim {mesh_dim} cannot be saved; a Partial tensor is "
                "not a value yet: call .redistribute(placements=[Replicate()...]) or .full_tensor() first"
            )
    return dims


def _take(intervals: list[tuple[int, int]], start: int, length: int) -> list[tuple[int, int]]:
    """The global intervals of local positions ``[start, start + length)``."""
    out, pos, end = [], 0, start + length
    for g, n in intervals:
        lo, hi = max(start, pos), min(end, pos + n)
        if lo < hi:
            out.append((g + lo - pos, hi - lo))
        pos += n
    return _merge(out)


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for g, n in intervals:
        if n == 0:
            continue
        if out and out[-1][0] + out[-1][1] == g:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((g, n))
    return out or [(0, 0)]
