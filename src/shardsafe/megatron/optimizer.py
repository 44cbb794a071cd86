"""Sharding of optimizer state after the model's, as in ``megatron.core.dist_checkpointing.optimizer``."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from copy import deepcopy
from dataclasses import replace
from typing import Any

import torch

from .core import CheckpointingException
from .dict_utils import nested_values
from .mapping import LocalNonpersistentObject, ShardedStateDict, ShardedTensor, ShardedTensorFactory, StateDict
from .utils import extract_sharded_tensors_and_factories

__all__ = [
    "KEEP_VARS_HINT",
    "get_optim_param_to_id_map",
    "get_param_id_to_sharded_param_map",
    "make_sharded_optimizer_tensor",
    "optim_state_to_sharding_state",
]

log = logging.getLogger(__name__)

KEEP_VARS_HINT = (
    " The state dict must hold the model's torch.nn.Parameter objects themselves (call"
    " `.state_dict(keep_vars=True)`), not tensors detached from them; transform a parameter"
    " through a ShardedTensorFactory instead."
)
"""Appended by Megatron-Core's optimizers to errors about parameters missing from a state dict."""


def _local(t: Any) -> Any:
    """The local tensor of a DTensor (FSDP2 parameters), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) and type(t).__name__ == "DTensor" else t


def get_optim_param_to_id_map(optim_params_iter: Iterable[torch.nn.Parameter]) -> dict[int, int]:
    """``id(parameter)`` -> its index in the optimizer's parameter order (the first, if repeated)."""
    out: dict[int, int] = {}
    for i, p in enumerate(optim_params_iter):
        out.setdefault(id(_local(p)), i)
    return out


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict, optim_params_iter: Iterable[torch.nn.Parameter]
) -> dict[int, ShardedTensor | ShardedTensorFactory]:
    """Optimizer state id -> the model's ShardedTensor (or factory) whose ``data`` is that
    parameter. The model's state dict must hold the parameters themselves (``keep_vars=True``)."""
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    ids = get_optim_param_to_id_map(optim_params_iter)
    out: dict[int, ShardedTensor | ShardedTensorFactory] = {}
    for t in nested_values(sharded):
        i = ids.get(id(t.data))
        if i is not None:
            out[i] = t
    if not out:
        log.warning(
            "no ShardedTensor of the model state dict holds a parameter of the optimizer; build the model's "
            "sharded state dict from the parameters themselves (state_dict(keep_vars=True))"
        )
    return out


def make_sharded_optimizer_tensor(
    model_param: ShardedTensor | ShardedTensorFactory, optim_param: torch.Tensor, prefix: str
) -> ShardedTensor | ShardedTensorFactory:
    """``optim_param`` sharded like ``model_param``, under the key ``<prefix>.<model key>``."""
    optim_param = _local(optim_param)
    if isinstance(model_param, ShardedTensorFactory):
        return replace(model_param, key=f"{prefix}.{model_param.key}", data=optim_param)
    if tuple(optim_param.shape) != model_param.local_shape:
        raise CheckpointingException(
            f"optimizer state {prefix}.{model_param.key}: shape {tuple(optim_param.shape)} differs from the parameter's "
            f"local shape {model_param.local_shape}"
        )
    out = replace(model_param, key=f"{prefix}.{model_param.key}", data=optim_param, dtype=optim_param.dtype)
    out.validate_metadata_integrity()
    return out


def optim_state_to_sharding_state(
    optim_state_dict: StateDict,
    id_to_sharded_param_map: dict[int, ShardedTensor],
    exclude_keys: tuple[str, ...] = (),
) -> None:
    """Turn a ``torch.optim`` state dict into a sharded one, in place: every tensor of
    ``state[id][name]`` (``name`` not in ``exclude_keys``) becomes a ShardedTensor
    ``optimizer.state.<name>.<parameter key>``; ``param_groups`` stay common state with their
    ``params`` kept locally (LocalNonpersistentObject)."""
    sharded: dict[int, dict[str, Any]] = {}
    for param_id, param_state in optim_state_dict["state"].items():
        if param_id not in id_to_sharded_param_map:
            raise CheckpointingException(f"optimizer state of parameter {param_id} matches no ShardedTensor of the model")
        sharded[param_id] = {
            name: make_sharded_optimizer_tensor(id_to_sharded_param_map[param_id], value, prefix=f"optimizer.state.{name}")
            for name, value in param_state.items()
            if name not in exclude_keys
        }
    optim_state_dict["param_groups"] = deepcopy(optim_state_dict["param_groups"])
    for group in optim_state_dict["param_groups"]:
        group["params"] = LocalNonpersistentObject(group["params"])
    optim_state_dict["state"] = sharded
