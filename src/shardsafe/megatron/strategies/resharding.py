"""Megatron-Core's ``strategies.resharding`` names.

Megatron-Core's DCP backend cannot read a flattened range of an n-d tensor saved under another
sharding, so it rewrites such requests into the saved layout first ("reformulation") and back
after the load. shardsafe reads any flattened range from any saved layout directly: there is
never anything to reformulate, and these functions pass state dicts through unchanged.
"""

from __future__ import annotations

from typing import Any

from ..core import CheckpointingException
from ..mapping import ShardedStateDict, ShardedTensor, StateDict

__all__ = [
    "apply_nd_flattened_tensors_reformulation",
    "is_nd_flattened_tensor",
    "restore_nd_flattened_tensors_formulation",
]


def is_nd_flattened_tensor(sh_ten: Any) -> bool:
    """Whether ``sh_ten`` is a flattened range of a tensor of more than one dimension."""
    return isinstance(sh_ten, ShardedTensor) and sh_ten.flattened_range is not None and len(sh_ten.global_shape) > 1


def apply_nd_flattened_tensors_reformulation(
    sharded_state_dict: ShardedStateDict, reformulation_metadata: dict[str, Any]
) -> tuple[ShardedStateDict, dict[str, Any]]:
    """``(sharded_state_dict, {})``: nothing to reformulate for shardsafe (see the module's docstring).
    ``reformulation_metadata`` must be what :func:`~.torch.get_reformulation_metadata` returned (empty)."""
    if reformulation_metadata:
        raise CheckpointingException(
            f"reformulation metadata for {sorted(reformulation_metadata)[:5]} is megatron-core's: shardsafe reads "
            "flattened ranges in any layout directly; pass the state dict to shardsafe.megatron.load as it is"
        )
    return sharded_state_dict, {}


def restore_nd_flattened_tensors_formulation(state_dict: StateDict, formulation_restore_metadata: dict[str, Any]) -> StateDict:
    """``state_dict`` unchanged: nothing was reformulated (see :func:`apply_nd_flattened_tensors_reformulation`)."""
    if formulation_restore_metadata:
        raise CheckpointingException(
            "formulation restore metadata is megatron-core's: shardsafe loaded the requested ranges directly"
        )
    return state_dict
