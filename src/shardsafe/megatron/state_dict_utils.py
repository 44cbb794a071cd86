"""The preprocessing of a sharded state dict before a save or a load, as in
``megatron.core.dist_checkpointing.state_dict_utils``."""

from __future__ import annotations

from typing import Any

from .dict_utils import dict_list_map_inplace, extract_matching_values
from .mapping import ShardedStateDict, ShardedTensor, ShardedTensorFactory, StateDict, apply_factories
from .utils import extract_nonpersistent, extract_sharded_base

__all__ = ["filter_out_empty_flatten_tensor", "load_preprocess", "save_preprocess"]


def save_preprocess(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict]:
    """Build the factories (in place, as Megatron-Core does), drop the LocalNonpersistentObjects,
    and split the rest into the sharded part and the common state."""
    apply_factories(sharded_state_dict)
    _, persistent = extract_nonpersistent(sharded_state_dict)
    sharded, common = extract_sharded_base(persistent)
    return filter_out_empty_flatten_tensor(sharded), common


def load_preprocess(sharded_state_dict: ShardedStateDict) -> tuple[ShardedStateDict, StateDict, ShardedStateDict]:
    """A copy of the nesting of ``sharded_state_dict`` (the argument stays as it is) with the
    factories built; returns it without the LocalNonpersistentObjects, their values
    (unwrapped), and the factories (without data, for :func:`~.mapping.apply_factory_merges`)."""
    copy, _ = extract_matching_values(sharded_state_dict, lambda x: True)
    copy = filter_out_empty_flatten_tensor(copy)  # type: ignore[arg-type]
    factories, _ = extract_matching_values(copy, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True)
    apply_factories(copy)  # type: ignore[arg-type]
    dict_list_map_inplace(ShardedTensorFactory.without_data, factories)
    nonpersistent, copy = extract_nonpersistent(copy)  # type: ignore[arg-type]
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
    return copy, nonpersistent, factories  # type: ignore[return-value]


def filter_out_empty_flatten_tensor(sharded_state_dict: Any) -> Any:
    """``sharded_state_dict`` without the flattened ShardedTensors whose range is empty."""
    kept, _ = extract_matching_values(
        sharded_state_dict,
        lambda v: not (isinstance(v, ShardedTensor) and v.flattened_range is not None and v.flattened_range.start == v.flattened_range.stop),
    )
    return kept
