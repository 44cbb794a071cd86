"""How local tensors and objects map onto global ones, as in ``megatron.core.dist_checkpointing.mapping``.

A sharded state dict is a nested dict (and list) whose leaves are :class:`ShardedTensor`,
:class:`ShardedObject`, :class:`ShardedTensorFactory`, :class:`LocalNonpersistentObject` or
plain values (the "common" state). The classes mirror Megatron-Core v0.15's fields and
methods, so that code written for Megatron runs unchanged; errors are
:class:`~shardsafe.megatron.core.CheckpointingException`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from math import prod
from typing import Any

import numpy as np
import torch

from ..adapters.sharded_tensor import flattened_range_problem
from .core import CheckpointingException
from .dict_utils import dict_list_map_inplace

__all__ = [
    "CommonStateDict",
    "LocalNonpersistentObject",
    "LocalNonpersitentObject",
    "ReplicaId",
    "ShardedBase",
    "ShardedObject",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StateDict",
    "apply_factories",
    "apply_factory_merges",
    "is_main_replica",
]

StateDict = dict[str, Any]
"""A plain (loaded) state dict."""
CommonStateDict = dict[str, Any]
"""The non-sharded part of a state dict."""
ShardedStateDict = dict[str, Any]
"""A state dict whose tensors are wrapped in the classes of this module."""
ReplicaId = int | tuple[int, ...]


class ShardedBase(ABC):
    """A value that maps a local part onto a global tensor or object: ``key`` names the global
    one, ``replica_id`` says which copy this is (see :func:`is_main_replica`)."""

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise ``CheckpointingException`` unless the fields are consistent."""

    @abstractmethod
    def without_data(self) -> ShardedBase:
        """A copy with ``data=None``."""


@dataclass
class ShardedTensor(ShardedBase):
    """This process's part of the global tensor ``key``.

    ``data`` (``local_shape``) sits at ``global_offset`` of a tensor of ``global_shape``, after
    ``prepend_axis_num`` leading axes of size 1 are added to it (a stack of layers stores each
    layer this way). With ``flattened_range``, ``data`` is that slice of the row-major
    flattening of ``local_shape`` (distributed optimizers). ``axis_fragmentations`` is the
    regular grid ``from_rank_offsets`` builds (None for irregular sharding). With
    ``allow_shape_mismatch``, a load accepts a stored tensor of another global shape: the
    overlap is read and the rest of ``data`` is zero (padded vocabularies).
    """

    key: str
    data: torch.Tensor | None = field(repr=False)
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        self.local_shape = tuple(self.local_shape)
        self.global_shape = tuple(self.global_shape)
        self.global_offset = tuple(self.global_offset)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = tuple(self.axis_fragmentations)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Raise ``CheckpointingException`` unless data, shapes, offsets and range agree
        (guaranteed for tensors built with :meth:`from_rank_offsets` / :meth:`from_rank_offsets_flat`)."""
        where = f"ShardedTensor {self.key!r}"
        if not isinstance(self.key, str) or not self.key:
            raise CheckpointingException(f"ShardedTensor key must be a non-empty string, got {self.key!r}")
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"{where}: global_offset {self.global_offset} and global_shape {self.global_shape} differ in length"
            )
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            raise CheckpointingException(
                f"{where}: local_shape {self.local_shape} with prepend_axis_num={self.prepend_axis_num} does not have "
                f"the {len(self.global_shape)} dimensions of global_shape {self.global_shape}"
            )
        fr = self.flattened_range
        if fr is not None:
            problem = flattened_range_problem(fr, self.local_shape, None)
            if problem is not None:
                raise CheckpointingException(f"{where}: {problem}")
        if self.axis_fragmentations is not None:
            for off, n in zip(self.global_offset[self.prepend_axis_num :], self.local_shape):
                if n and off % n:
                    raise CheckpointingException(
                        f"{where}: global offset {off} is not a multiple of the local size {n} on a regular grid"
                    )
        if self.data is None:
            return
        if not isinstance(self.data, torch.Tensor):
            raise CheckpointingException(f"{where}: data must be a torch.Tensor or None, got {type(self.data).__name__}")
        if self.data.dtype != self.dtype:
            raise CheckpointingException(f"{where}: data has dtype {self.data.dtype}, the dtype field says {self.dtype}")
        if fr is None:
            if tuple(self.data.shape) != self.local_shape:
                raise CheckpointingException(
                    f"{where}: data has shape {tuple(self.data.shape)}, local_shape is {self.local_shape}"
                )
        else:
            problem = flattened_range_problem(fr, self.local_shape, tuple(self.data.shape))
            if problem is not None:
                raise CheckpointingException(f"{where}: {problem}")

    @property
    def has_regular_grid(self) -> bool:
        """Whether the tensor is split on a regular grid (``axis_fragmentations`` is set)."""
        return self.axis_fragmentations is not None

    def global_slice(self) -> tuple[int | slice, ...]:
        """The part of the global tensor this one is: an index per prepended axis, then slices."""
        p = self.prepend_axis_num
        return (
            *self.global_offset[:p],
            *(slice(off, off + n) for off, n in zip(self.global_offset[p:], self.local_shape)),
        )

    def global_coordinates(self) -> tuple[np.ndarray, ...]:
        """The global coordinates of the elements of a flattened tensor's ``data``."""
        local = self.local_coordinates()
        return tuple(c + off for c, off in zip((0,) * self.prepend_axis_num + local, self.global_offset))

    def local_coordinates(self) -> tuple[np.ndarray, ...]:
        """The coordinates, within ``local_shape``, of the elements of a flattened tensor's ``data``."""
        if self.flattened_range is None:
            raise CheckpointingException(f"ShardedTensor {self.key!r}: local_coordinates needs a flattened_range")
        flat = np.arange(self.flattened_range.start, self.flattened_range.stop)
        return np.unravel_index(flat, self.local_shape) if self.local_shape else ()

    def local_chunk_offset_in_global(self) -> tuple[int, ...]:
        """Where this part sits in the grid of parts: offsets divided by the local shape."""
        p = self.prepend_axis_num
        out = list(self.global_offset[:p])
        for off, n in zip(self.global_offset[p:], self.local_shape):
            if n == 0 or off % n:
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: offset {off} is not a multiple of the local size {n}: not on a regular grid"
                )
            out.append(off // n)
        return tuple(out)

    def max_allowed_chunks(self) -> tuple[int, ...]:
        """The size of one grid cell along each axis (global size over the axis' fragmentation)."""
        if self.axis_fragmentations is None:
            raise CheckpointingException(f"ShardedTensor {self.key!r}: max_allowed_chunks needs axis_fragmentations")
        out = []
        for size, parts in zip(self.global_shape, self.axis_fragmentations):
            if not self.allow_shape_mismatch and size % parts:
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: axis size {size} is not divisible by its fragmentation {parts}"
                )
            out.append(size // parts)
        return tuple(out)

    def without_data(self) -> ShardedTensor:
        return replace(self, data=None)

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs: Any,
    ) -> ShardedTensor:
        """Place ``data`` on a regular grid: each ``(axis, axis_rank_offset, axis_fragmentations)``
        says the global tensor is cut into ``axis_fragmentations`` equal parts along ``axis``
        (counting the ``prepend_axis_num`` prepended axes) and ``data`` is part
        ``axis_rank_offset``. ``init_kwargs`` go to the constructor (``allow_shape_mismatch``)."""
        if flattened_range is not None:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: from_rank_offsets does not take a flattened_range; use from_rank_offsets_flat"
            )
        if not isinstance(data, torch.Tensor):
            raise CheckpointingException(f"ShardedTensor {key!r}: data must be a torch.Tensor, got {type(data).__name__}")
        ndim = data.dim() + prepend_axis_num
        global_shape = [1] * prepend_axis_num + list(data.shape)
        global_offset = [0] * ndim
        fragments = [1] * ndim
        seen: set[int] = set()
        for entry in rank_offsets:
            if len(entry) != 3:
                raise CheckpointingException(f"ShardedTensor {key!r}: rank offset {entry!r} is not (axis, axis_rank_offset, axis_fragmentations)")
            axis, offset, parts = (int(v) for v in entry)
            if not 0 <= axis < ndim or axis in seen or parts < 1 or not 0 <= offset < parts:
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: invalid rank offsets {rank_offsets} for a {ndim}-d global tensor "
                    f"(each axis in [0, {ndim}) at most once, 0 <= axis_rank_offset < axis_fragmentations)"
                )
            seen.add(axis)
            size = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = size * parts
            global_offset[axis] = size * offset
            fragments[axis] = parts
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(fragments),
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: tuple[int, ...],
        *args: Any,
        flattened_range: slice | None = None,
        **kwargs: Any,
    ) -> ShardedTensor:
        """Like :meth:`from_rank_offsets` for a part of shape ``non_flat_local_shape`` of which
        the 1-D ``data`` holds the slice ``flattened_range`` of its row-major flattening."""
        if flattened_range is None:
            raise CheckpointingException(
                f"ShardedTensor {key!r}: from_rank_offsets_flat needs a flattened_range; use from_rank_offsets otherwise"
            )
        if not isinstance(data, torch.Tensor) or data.dim() != 1:
            raise CheckpointingException(f"ShardedTensor {key!r}: flattened data must be a 1-D tensor")
        box = torch.empty(tuple(non_flat_local_shape), dtype=data.dtype, device="meta")
        st = cls.from_rank_offsets(key, box, *args, **kwargs)
        st = replace(st, data=None, flattened_range=flattened_range)
        st.data = data
        st.validate_metadata_integrity()
        return st

    def init_data(self, device: str | torch.device, init_fn: Callable[..., torch.Tensor] = torch.empty) -> None:
        """Allocate ``data`` with ``init_fn`` on ``device`` if it is None (flattened: the slice)."""
        if self.data is not None:
            return
        self.data = init_fn(self.local_shape, dtype=self.dtype, device=device)
        if self.flattened_range is not None:
            self.data = self.data.flatten()[self.flattened_range.start : self.flattened_range.stop]

    def narrow(self, dim: int, start: int, length: int) -> list[ShardedTensor]:
        """``torch.narrow`` of every process's part: the part keeps ``length`` of its
        ``local_shape[dim]`` elements from ``start``, and the global tensor shrinks alike (a
        regular grid only). A flattened part narrows along dim 0 only and may become empty
        (then the list is empty)."""
        axis = dim + self.prepend_axis_num
        n = self.local_shape[dim]
        if n == 0 or self.global_shape[axis] % n or self.global_offset[axis] % n:
            raise CheckpointingException(f"ShardedTensor {self.key!r}: narrow needs a regular grid along dim {dim}")
        global_shape = list(self.global_shape)
        global_offset = list(self.global_offset)
        global_shape[axis] = self.global_shape[axis] // n * length
        global_offset[axis] = self.global_offset[axis] // n * length
        if self.flattened_range is None:
            data = self.data.narrow(dim, start, length) if self.data is not None else None
            local_shape = list(self.local_shape)
            local_shape[dim] = length
            return [
                replace(self, data=data, local_shape=tuple(local_shape), global_shape=tuple(global_shape), global_offset=tuple(global_offset))
            ]
        if dim != 0:
            raise CheckpointingException(f"ShardedTensor {self.key!r}: a flattened tensor narrows along dim 0 only, got dim={dim}")
        inner = prod(self.local_shape[1:])
        lo = self.flattened_range.start - inner * start
        hi = self.flattened_range.stop - inner * start
        if hi <= 0 or lo >= inner * length:
            return []
        new = slice(max(lo, 0), min(hi, inner * length))
        skip = new.start - lo
        data = self.data[skip : skip + new.stop - new.start] if self.data is not None else None
        return [
            replace(
                self,
                data=data,
                local_shape=(length, *self.local_shape[1:]),
                global_shape=tuple(global_shape),
                global_offset=tuple(global_offset),
                flattened_range=new,
            )
        ]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for the copy that is saved: ``0``, or a tuple of zeros. Setting replica ids right is
    the application's job; the save checks that main replicas tile every tensor exactly once."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class LocalNonpersistentObject:
    """A value that is not saved: a load puts this process's own ``obj`` back in its place."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        """The wrapped value."""
        return self.obj


LocalNonpersitentObject = LocalNonpersistentObject
"""The spelling of Megatron-Core's older documentation."""


@dataclass
class ShardedObject(ShardedBase):
    """One cell of a grid of objects of ``global_shape``: this process's ``data`` at
    ``global_offset`` (in cells). Stored as one value per cell, never resharded."""

    key: str
    data: object
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.global_shape = tuple(self.global_shape)
        self.global_offset = tuple(self.global_offset)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise CheckpointingException(f"ShardedObject key must be a non-empty string, got {self.key!r}")
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"ShardedObject {self.key!r}: global_offset {self.global_offset} and global_shape {self.global_shape} "
                "differ in length"
            )

    def without_data(self) -> ShardedObject:
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        """``<key>/shard_<offsets joined by .>_<shape joined by .>``: the cell's name in the checkpoint."""
        return f"{self.key}/shard_{'.'.join(map(str, self.global_offset))}_{'.'.join(map(str, self.global_shape))}"

    def __str__(self) -> str:
        return f"{type(self).__name__}(key={self.key!r})"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        """The object (``data=None``) that :attr:`unique_key` names. A name without the last
        shape entry (older Megatron) gets ``-1`` there."""
        key, sep, cell = unique_key.rpartition("/")
        parts = cell.split("_")
        try:
            if not sep or len(parts) != 3 or parts[0] != "shard":
                raise ValueError
            offset = tuple(int(v) for v in parts[1].split("."))
            shape = tuple(int(v) for v in parts[2].split("."))
        except ValueError:
            raise CheckpointingException(
                f"{unique_key!r} is not a ShardedObject unique key (<key>/shard_<offset>_<shape>)"
            ) from None
        if len(shape) + 1 == len(offset):
            shape += (-1,)
        return cls(key, None, shape, offset, replica_id)


FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, "slice | None"], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor saved as the sub-state-dict ``build_fn(key, data, replica_id, flattened_range)``
    returns (for example the two halves of a GLU weight) and rebuilt after a load by
    ``merge_fn(loaded sub-state-dict)``."""

    key: str
    data: torch.Tensor
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> ShardedStateDict:
        """The sub-state-dict this factory stands for."""
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Nothing to check before the factory is built."""

    def without_data(self) -> ShardedTensorFactory:
        return replace(self, data=None)


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every :class:`ShardedTensorFactory` by what it builds, in place."""

    def build(x: Any) -> Any:
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    dict_list_map_inplace(build, sharded_state_dict)


def apply_factory_merges(x1: StateDict, x2: ShardedStateDict, key: tuple = ()) -> StateDict:
    """Merge, in place, the parts of the loaded ``x1`` that factories of ``x2`` built (``x2``
    has factories where ``x1`` has their loaded sub-state-dicts); returns ``x1``."""
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v in x2.items():
            if k not in x1:
                raise CheckpointingException(
                    f"apply_factory_merges: key {k!r} at key path {key} of the factories is not in the loaded state dict "
                    f"(it holds {sorted(map(str, x1))[:10]})"
                )
            x1[k] = apply_factory_merges(x1[k], v, key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise CheckpointingException(
                f"apply_factory_merges: lists of different lengths ({len(x1)} and {len(x2)}) at key path {key}"
            )
        for i, v in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v, key + (i,))
    elif isinstance(x1, list) and isinstance(x2, dict):
        for k, v in x2.items():
            if not isinstance(k, int) or not 0 <= k < len(x1):
                raise CheckpointingException(
                    f"apply_factory_merges: key {k!r} at key path {key} is not an index of a list of {len(x1)}"
                )
            x1[k] = apply_factory_merges(x1[k], v, key + (k,))
    else:
        raise CheckpointingException(
            f"apply_factory_merges: at key path {key} the loaded value is a {type(x1).__name__} and the factories "
            f"hold a {type(x2).__name__}; they must be a factory, or dicts or lists of the same shape"
        )
    return x1
