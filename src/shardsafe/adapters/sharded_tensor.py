"""``ShardedTensor``: hand-sharded tensors described as in Megatron's dist_checkpointing."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from ..errors import ShardingError

__all__ = ["ShardedTensor", "flattened_range_problem", "view_as"]


def flattened_range_problem(fr: Any, local_shape: tuple[int, ...], data_shape: tuple[int, ...] | None) -> str | None:
    """What is wrong with a piece's ``flattened_range`` ``fr`` (a ``slice(start, stop)`` of its box
    ``local_shape`` flattened row-major, holding ``data`` of ``data_shape``), or ``None``.

    The one rule for both front ends: :class:`ShardedTensor` raises it as ``ShardingError``,
    ``shardsafe.megatron``'s ``ShardedTensor`` as Megatron's ``CheckpointingException``.
    ``data_shape`` ``None``: the piece has no data yet (Megatron's metadata-only tensors).
    """
    if not isinstance(fr, slice) or fr.step not in (None, 1) or fr.start is None or fr.stop is None:
        return f"flattened_range must be slice(start, stop) without a step, got {fr!r}"
    if not 0 <= fr.start <= fr.stop <= prod(local_shape):
        return f"flattened_range {fr} lies outside the {prod(local_shape)} elements of local_shape {list(local_shape)}"
    if data_shape is not None and (len(data_shape) != 1 or data_shape[0] != fr.stop - fr.start):
        return (
            f"flattened data must be 1-D with {fr.stop - fr.start} elements for flattened_range {fr}, "
            f"got shape {list(data_shape)}"
        )
    return None


@dataclass
class ShardedTensor:
    """This rank's piece of a global tensor ``key``.

    The piece is the box ``global_offset`` + ``local_shape`` of a tensor of ``global_shape``;
    with ``flattened_range`` set, ``data`` holds only that slice of the box flattened row-major
    (as FSDP1 flat parameters and distributed optimizers keep it). Pieces with identical
    geometry on several ranks are replicas and are written once; ``replica_id`` is kept for
    Megatron compatibility and is not needed for that.
    """

    key: str
    data: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    replica_id: int | tuple[int, ...] = 0
    prepend_axis_num: int = 0
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(x) for x in self.global_shape)
        self.global_offset = tuple(int(x) for x in self.global_offset)
        self.local_shape = tuple(int(x) for x in self.local_shape)
        if not isinstance(self.data, torch.Tensor):
            raise ShardingError(f"ShardedTensor {self.key!r}: data must be a torch.Tensor, got {type(self.data).__name__}")
        n = len(self.global_shape)
        if len(self.global_offset) != n or len(self.local_shape) != n:
            raise ShardingError(
                f"ShardedTensor {self.key!r}: global_shape {list(self.global_shape)}, global_offset "
                f"{list(self.global_offset)} and local_shape {list(self.local_shape)} must have the same length"
            )
        if self.flattened_range is not None:
            problem = flattened_range_problem(self.flattened_range, self.local_shape, tuple(self.data.shape))
            if problem is not None:
                raise ShardingError(f"ShardedTensor {self.key!r}: {problem}")
        elif prod(self.data.shape) != prod(self.local_shape):
            raise ShardingError(
                f"ShardedTensor {self.key!r}: data of shape {list(self.data.shape)} does not fill local_shape {list(self.local_shape)}"
            )

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: int | tuple[int, ...] = 0,
        prepend_axis_num: int = 0,
    ) -> ShardedTensor:
        """Describe ``data`` by its position in a grid of equal fragments.

        Each ``(axis, axis_rank_offset, axis_fragmentations)`` says that along ``axis`` (of the
        global tensor, counting the ``prepend_axis_num`` leading size-1 axes) the global tensor is
        split into ``axis_fragmentations`` equal parts and ``data`` is part ``axis_rank_offset``.
        """
        local_shape = (1,) * prepend_axis_num + tuple(data.shape)
        global_shape = list(local_shape)
        global_offset = [0] * len(local_shape)
        seen = set()
        for axis, offset, fragments in rank_offsets:
            if not 0 <= axis < len(local_shape) or axis in seen:
                raise ShardingError(f"ShardedTensor {key!r}: bad or repeated axis {axis} for a {len(local_shape)}-d tensor")
            if not 0 <= offset < fragments:
                raise ShardingError(f"ShardedTensor {key!r}: rank offset {offset} not in [0, {fragments}) on axis {axis}")
            seen.add(axis)
            global_shape[axis] = local_shape[axis] * fragments
            global_offset[axis] = local_shape[axis] * offset
        return cls(key, data, tuple(global_shape), tuple(global_offset), local_shape, replica_id, prepend_axis_num)

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: tuple[int, ...],
        *rank_offsets: tuple[int, int, int],
        flattened_range: slice,
        replica_id: int | tuple[int, ...] = 0,
        prepend_axis_num: int = 0,
    ) -> ShardedTensor:
        """Like :meth:`from_rank_offsets` for a box of ``non_flat_local_shape`` of which
        ``data`` holds the flat slice ``flattened_range``."""
        box = cls.from_rank_offsets(
            key, torch.empty(non_flat_local_shape, device="meta"), *rank_offsets, prepend_axis_num=prepend_axis_num
        )
        return cls(
            key, data, box.global_shape, box.global_offset, box.local_shape, replica_id, prepend_axis_num, flattened_range
        )


def view_as(data: torch.Tensor, shape: tuple[int, ...], key: str) -> torch.Tensor:
    """``data`` viewed as ``shape``, sharing its memory, or ``ShardingError`` naming ``key``."""
    try:
        view = data.view(shape)
    except RuntimeError:
        raise ShardingError(
            f"key {key!r}: a tensor of shape {list(data.shape)} and strides {list(data.stride())} cannot be viewed as "
            f"shape {list(shape)} without a copy, and a load into a copy would leave it unchanged; pass a tensor "
            f"whose memory is laid out as {list(shape)} (for example one of that shape)"
        ) from None
    return view

