"""Helpers for sharded state dicts, as in ``megatron.core.dist_checkpointing.utils``."""

from __future__ import annotations

from typing import Any

from .core import CheckpointingException
from .dict_utils import dict_list_map_inplace, extract_matching_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)

__all__ = [
    "add_prefix_for_sharding",
    "apply_prefix_mapping",
    "extract_nonpersistent",
    "extract_sharded_base",
    "extract_sharded_tensors",
    "extract_sharded_tensors_and_factories",
    "extract_sharded_tensors_or_nonpersistent",
    "replace_prefix_for_sharding",
]

_KEYED = (ShardedTensor, ShardedTensorFactory, ShardedObject)

_ShardId = tuple[str, tuple, tuple | None]
"""What identifies one piece of a tensor across ranks: key, global offset, and the flattened
range as ``(start, stop)`` (None for a box). Replicas of a piece have the same id."""


def _sharded_tensor_shard_id(sharded_tensor: ShardedTensor) -> _ShardId:
    """The id of ``sharded_tensor``'s piece (the same on every rank holding a replica of it)."""
    r = sharded_tensor.flattened_range
    return (sharded_tensor.key, tuple(sharded_tensor.global_offset), None if r is None else (r.start, r.stop))


def _sharded_object_id(sharded_object: ShardedObject) -> _ShardId:
    """The id of ``sharded_object``'s piece: key, offset and shape in its grid."""
    return (sharded_object.key, tuple(sharded_object.global_offset), tuple(sharded_object.global_shape))


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict]:
    """The :class:`ShardedTensor` leaves, and everything else, both keeping the nesting."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedTensor))  # type: ignore[return-value]


def extract_sharded_tensors_and_factories(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict]:
    """The :class:`ShardedTensor` and :class:`ShardedTensorFactory` leaves, and everything else."""
    return extract_matching_values(  # type: ignore[return-value]
        sharded_state_dict, lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory))
    )


def extract_sharded_tensors_or_nonpersistent(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict]:
    """The :class:`ShardedTensor`, :class:`ShardedTensorFactory` and
    :class:`LocalNonpersistentObject` leaves, and everything else."""
    return extract_matching_values(  # type: ignore[return-value]
        sharded_state_dict, lambda v: isinstance(v, (ShardedTensor, LocalNonpersistentObject, ShardedTensorFactory))
    )


def extract_sharded_base(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict]:
    """The :class:`ShardedBase` leaves, and everything else (the common state)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))  # type: ignore[return-value]


def extract_nonpersistent(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict]:
    """The :class:`LocalNonpersistentObject` leaves, and everything else."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject))  # type: ignore[return-value]


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend ``prefix`` to the key of every :class:`ShardedBase` leaf, in place."""

    def add(x: Any) -> Any:
        if isinstance(x, ShardedBase):
            x.key = f"{prefix}{x.key}"
        return x

    dict_list_map_inplace(add, sharded_state_dict)


def replace_prefix_for_sharding(sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str) -> None:
    """Replace ``old_prefix`` by ``new_prefix`` in every sharded key, in place; every key must
    start with ``old_prefix``."""

    def swap(x: Any) -> Any:
        if isinstance(x, _KEYED):
            if not x.key.startswith(old_prefix):
                raise CheckpointingException(f"key {x.key!r} does not start with the prefix {old_prefix!r} to replace")
            x.key = new_prefix + x.key[len(old_prefix) :]
        return x

    dict_list_map_inplace(swap, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: dict[str, str]) -> None:
    """Replace, in place, the first prefix of ``prefix_map`` (old -> new) that a sharded key
    starts with; keys that start with none stay as they are."""

    def swap(x: Any) -> Any:
        if isinstance(x, _KEYED):
            for old, new in prefix_map.items():
                if x.key.startswith(old):
                    x.key = new + x.key[len(old) :]
                    break
        return x

    dict_list_map_inplace(swap, sharded_state_dict)
