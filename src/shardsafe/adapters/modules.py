"""Models -> flat state of this rank's pieces, keyed by the parameter's name without wrapper parts.

The same parameter is named the same in a plain module, under DDP (``module.``), FSDP1
(``_fsdp_wrapped_module.``), activation checkpointing (``_checkpoint_wrapped_module.``) and
``torch.compile`` (``_orig_mod.``) and Lightning Fabric (``_forward_module.``), so one checkpoint
loads into all of them. Values are views on
the model's own memory, so filling them loads the model in place:

- plain tensors (plain modules, DDP, buffers everywhere): replicated;
- DTensors (FSDP2, HSDP, tensor parallel, FSDP2 + TP): as they are;
- FSDP1 with ``use_orig_params=True``: each original parameter is a 1-D view on this rank's part
  of the flat parameter, described as a flattened range of the full parameter;
- OLMo-core's FSDP (``ShardedFlatParameter``): a 1-D tensor carrying its own flat sharding spec,
  described by that spec as a flattened range in the same way (:mod:`.flat_sharded`).

FSDP keeps some parameters unsharded after a forward pass with no backward after it (an evaluation
pass, the Hugging Face flow): FSDP2 the root's (every module's with ``reshard_after_forward=False``),
FSDP1 the root's flat parameter. Those unsharded copies are not the parameters the optimizer holds,
and the next forward replaces them from the sharded ones; so, as torch's own ``state_dict()`` does,
:func:`model_params` first switches every FSDP module back to its sharded parameters (local only:
no collective, no copy).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ShardingError
from .flat_sharded import flat_sharding
from .sharded_tensor import ShardedTensor, view_as

__all__ = ["ParamInfo", "model_params", "model_state", "reshard_fsdp"]

# child names that wrapper modules give the module they wrap; dropped from names
_WRAPPED_CHILD = {"module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}


@dataclass(frozen=True)
class ParamInfo:
    """A parameter (or buffer) as this rank holds it, under its wrapper-free name."""

    fqn: str
    tensor: torch.Tensor  # the module's own tensor: a Parameter, DTensor, buffer, or FSDP1 view
    flat: tuple[tuple[int, ...], int, int] | None = None  # FSDP1, OLMo-core: (full shape, start, stop) of this rank's part

    @property
    def holds_nothing(self) -> bool:
        """An FSDP1 parameter none of which lives on this rank."""
        return self.flat is not None and self.flat[1] == self.flat[2]

    def sharded(self, key: str, value: torch.Tensor) -> Any:
        """``value`` (the tensor or a same-shaped optimizer state) as a checkpoint value under ``key``;
        a flat value is described as a view of its memory (loads fill it in place)."""
        if self.flat is None or flat_sharding(key, value) is not None:
            return value  # plain, DTensor, or carrying its own flat spec
        shape, start, stop = self.flat
        data = view_as(value.detach(), (value.numel(),), key)
        return ShardedTensor(key, data, shape, (0,) * len(shape), shape, flattened_range=slice(start, stop))


def model_params(model: nn.Module) -> list[ParamInfo]:
    """Every parameter once (tied parameters under their first name), in module order; FSDP
    modules are first switched back to their sharded parameters (:func:`reshard_fsdp`)."""
    reshard_fsdp(model)
    flat = _fsdp1_ranges(model)
    seen: set[int] = set()
    out: list[ParamInfo] = []
    for fqn, _, p in _walk(model, "parameters"):
        if id(p) in seen:
            continue
        seen.add(id(p))
        out.append(ParamInfo(fqn, p, flat.get(id(p)) or _own_flat_range(fqn, p)))
    return out


def _own_flat_range(fqn: str, p: torch.Tensor) -> tuple[tuple[int, ...], int, int] | None:
    """(full shape, start, stop) for a parameter that carries its own flat sharding spec."""
    spec = flat_sharding(fqn, p)
    if spec is None:
        return None
    if len(spec.ranges) > 1:
        raise ShardingError(
            f"parameter {fqn!r} holds {len(spec.ranges)} flat ranges {[list(r) for r in spec.ranges]} on this rank; "
            "parameters and their optimizer state are saved by name with at most one range per rank (a state "
            "dict of such tensors saves with shardsafe.Checkpointer)"
        )
    start, stop = spec.ranges[0] if spec.ranges else (0, 0)
    return spec.shape, start, stop


def model_state(model: nn.Module) -> tuple[list[ParamInfo], list[ParamInfo]]:
    """``(parameters, persistent buffers)`` of ``model``."""
    params = model_params(model)
    names = {p.fqn for p in params}
    buffers, seen = [], set()
    for fqn, module, b in _walk(model, "buffers"):
        name = fqn.rsplit(".", 1)[-1]
        if name in module._non_persistent_buffers_set or id(b) in seen:
            continue
        seen.add(id(b))
        if fqn in names:  # pragma: no cover - a module cannot hold both
            raise ShardingError(f"{fqn!r} is both a parameter and a buffer")
        buffers.append(ParamInfo(fqn, b))
    return params, buffers


def _walk(model: nn.Module, what: str):
    """``(clean name, owning module, tensor)`` for every parameter or buffer."""
    stack = [(model, "")]
    while stack:
        module, prefix = stack.pop()
        _check_fsdp1(module, prefix)
        tensors = module._parameters if what == "parameters" else module._buffers
        for name, t in tensors.items():
            if t is not None:
                yield prefix + name, module, t
        wrapper = _is_wrapper(module)
        children = []
        if type(module).__name__ == "_FabricModule":  # Lightning Fabric: the module it runs, unnamed (its
            stack.append((module._modules["_forward_module"], prefix))  # _original_module is the same one, or inside it)
            continue
        for name, child in module._modules.items():
            if child is None:
                continue
            drop = wrapper and name in _WRAPPED_CHILD
            children.append((child, prefix if drop else f"{prefix}{name}."))
        stack.extend(reversed(children))


def reshard_fsdp(model: nn.Module) -> None:
    """Switch every FSDP module of ``model`` back to its sharded parameters, as torch's own
    ``state_dict()`` and ``load_state_dict()`` do: after a forward with no backward, FSDP2 keeps
    the root's parameters (every module's with ``reshard_after_forward=False``) unsharded and FSDP1
    the root's flat parameter. Local to this rank; call it outside forward and backward."""
    if "torch.distributed.fsdp" not in sys.modules:
        return  # no FSDP module can exist
    fsdp2 = _fsdp2_module_class()
    for name, module in model.named_modules():
        if fsdp2 is not None and isinstance(module, fsdp2):
            module.reshard()  # FSDP2's public call: frees the unsharded parameters, registers the sharded ones
        elif type(module).__name__ == "FullyShardedDataParallel":
            _reshard_fsdp1(module, name)


def _fsdp2_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # torch 2.4, 2.5
        except ImportError:  # pragma: no cover - a torch without FSDP2
            return None
    return FSDPModule


def _reshard_fsdp1(module: nn.Module, name: str) -> None:
    handle = getattr(module, "_handle", None)
    if handle is None or not handle.uses_sharded_strategy:
        return
    # after a forward FSDP1 points the root's parameters back at its shard but keeps the gathered copy, which
    # the next forward then uses as it is, without gathering: what a load writes into the shard would be ignored
    if handle.is_sharded(handle.flat_param) and (not hasattr(handle.flat_param, "_full_param_padded") or handle.needs_unshard()):
        return  # sharded, nothing gathered held (or no forward yet: FSDP1 allocates its gather buffer lazily)
    state = str(getattr(handle, "_training_state", "")).rsplit(".", 1)[-1]
    if state != "IDLE":
        raise ShardingError(
            f"FSDP1 module {name or '<root>'!r} holds its parameters unsharded ({state}: inside "
            f"{'FullyShardedDataParallel.summon_full_params' if state == 'SUMMON_FULL_PARAMS' else 'a forward or backward'}); "
            "save and load outside it, where FSDP holds each rank's shard"
        )
    try:
        from torch.distributed.fsdp._runtime_utils import _reshard
    except ImportError:  # pragma: no cover - a torch that moved it: say what to do rather than guess
        raise ShardingError(
            f"FSDP1 module {name or '<root>'!r} holds its parameters unsharded (after a forward with no backward); "
            "run a backward first, or call model.state_dict() before saving, so that FSDP reshards them"
        ) from None
    # as FSDP1 does after a backward: the sharded flat parameter (and its views) back, the gathered copy freed,
    # so that the next forward gathers again (what a load wrote into the shards)
    _reshard(module, handle, True)


def _is_wrapper(module: nn.Module) -> bool:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(module, DistributedDataParallel | DataParallel):
        return True
    name = type(module).__name__
    return name in ("FullyShardedDataParallel", "CheckpointWrapper", "OffloadWrapper", "OptimizedModule")


def _check_fsdp1(module: nn.Module, prefix: str) -> None:
    if type(module).__name__ != "FullyShardedDataParallel":
        return
    if not getattr(module, "_use_orig_params", True):
        raise ShardingError(
            f"FSDP1 module {prefix.rstrip('.') or '<root>'!r} has use_orig_params=False: its parameters exist only "
            "inside one flat parameter, so optimizer state cannot be keyed by parameter name. Wrap the model with "
            "FullyShardedDataParallel(..., use_orig_params=True), or use FSDP2 (fully_shard)"
        )


def _fsdp1_ranges(model: nn.Module) -> dict[int, tuple[tuple[int, ...], int, int]]:
    """For FSDP1 original parameters: id -> (full shape, start, stop) of this rank's flat part."""
    out: dict[int, tuple[tuple[int, ...], int, int]] = {}
    for module in model.modules():
        if type(module).__name__ != "FullyShardedDataParallel":
            continue
        handle = getattr(module, "_handle", None)
        if handle is None:
            continue
        fp = handle.flat_param
        if not handle.uses_sharded_strategy:
            continue  # NO_SHARD: every rank holds whole parameters, plain replicated tensors
        params = fp._params or []
        for p, info, shape in zip(params, fp._shard_param_infos, fp._shapes):
            shape = tuple(int(s) for s in shape)
            if info.in_shard:
                start, stop = info.intra_param_start_idx, info.intra_param_end_idx + 1
            else:
                start = stop = 0
            if p.numel() != stop - start:
                raise ShardingError(
                    f"FSDP1 parameter of shape {list(shape)} holds {p.numel()} elements on this rank, its shard "
                    f"says {stop - start}: save and load outside forward/backward, with parameters resharded"
                )
            out[id(p)] = (shape, start, stop)
    return out
