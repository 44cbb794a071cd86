"""A minimal re-implementation of OLMo-core's own FSDP parameter classes, for tests only.

Mirrors ``olmo_core.distributed.tensors.sharded_flat_tensor`` and ``sharded_flat_parameter`` of
ai2-olmo-core 0.1.0 (github.com/allenai/OLMo-core, tag v0.1.0; the classes were removed in June
2024): the same class shape, attribute names and semantics, written anew and reduced to what a
checkpointer sees. ``ShardingSpec.unsharded_flattened_offsets`` is indexed by rank in the process
group, each entry a tuple of ``(start, end)`` ranges of the full tensor's row-major flattening;
the tensor itself is this rank's elements, 1-D, and ``sharded_data`` is that same memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree


@dataclass
class ShardingSpec:
    unsharded_shape: tuple[int, ...]
    unsharded_flattened_offsets: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def unsharded_numel(self) -> int:
        return math.prod(self.unsharded_shape)

    @property
    def sharded_numels(self) -> tuple[int, ...]:
        return tuple(sum(b - a for a, b in ranges) for ranges in self.unsharded_flattened_offsets)


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


class ShardedFlatTensor(torch.Tensor):
    __slots__ = ["_local_tensor", "_global_tensor", "_sharding_spec", "_process_group"]

    @staticmethod
    def __new__(cls, data: torch.Tensor, requires_grad: bool = False) -> ShardedFlatTensor:
        if data.ndim != 1:
            raise ValueError(f"{cls.__name__} requires flat data, got shape {tuple(data.shape)}")
        tensor = torch.Tensor._make_subclass(cls, data, requires_grad)
        tensor._local_tensor = data
        tensor._global_tensor = None
        tensor._sharding_spec = None
        tensor._process_group = None
        return tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # as OLMo-core's, torch >= 2.3
        def unwrap(x):
            if isinstance(x, ShardedFlatTensor):
                return x._global_tensor if x._global_tensor is not None else x._local_tensor
            return x

        def wrap(x):
            if isinstance(x, torch.Tensor) and x.shape == self.shape:
                wrapped = ShardedFlatTensor(x, requires_grad=x.requires_grad)
                wrapped.mark_as_sharded(self.sharding_spec, self.process_group)
                return wrapped
            return x

        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
        if func in (torch.ops.aten.empty_like.default, torch.ops.aten.zeros_like.default, torch.ops.aten.ones_like.default):
            out = pytree.tree_map(wrap, out)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(local_tensor={self._local_tensor})"

    @classmethod
    def shard(cls, tensor: torch.Tensor, sharding_spec: ShardingSpec | None = None, process_group=None, requires_grad: bool = False):
        """This rank's part of ``tensor`` (the same full tensor on every rank), evenly split by default."""
        world = dist.get_world_size(process_group) if dist.is_initialized() else 1
        if sharding_spec is None:
            per_rank = math.ceil(tensor.numel() / world)
            sharding_spec = ShardingSpec(
                tuple(tensor.shape),
                tuple(((r * per_rank, min((r + 1) * per_rank, tensor.numel())),) for r in range(world)),
            )
        flat = tensor.detach().reshape(-1)
        local = torch.cat([flat[a:b] for a, b in sharding_spec.unsharded_flattened_offsets[_rank(process_group)]])
        out = cls(local.clone(), requires_grad=requires_grad)
        out.mark_as_sharded(sharding_spec, process_group)
        return out

    def mark_as_sharded(self, sharding_spec: ShardingSpec, process_group=None) -> None:
        if self.numel() != sharding_spec.sharded_numels[_rank(process_group)]:
            raise ValueError("invalid sharding spec: numel differs from the shard's")
        self._sharding_spec = sharding_spec
        self._process_group = process_group

    def unshard_(self, unsharded_data: torch.Tensor) -> None:
        """Gather: the tensor now holds the full data (here given, not all-gathered)."""
        self._global_tensor = unsharded_data
        self.data = unsharded_data

    def reshard_(self) -> None:
        self._global_tensor = None
        self.data = self._local_tensor

    @property
    def is_sharded(self) -> bool:
        return self._global_tensor is None

    @property
    def sharding_spec(self) -> ShardingSpec:
        if self._sharding_spec is None:
            raise ValueError(f"{type(self).__name__} has not been marked as sharded yet")
        return self._sharding_spec

    @property
    def process_group(self):
        return self._process_group

    @property
    def unsharded_flattened_offsets(self) -> tuple[tuple[int, int], ...]:
        return self.sharding_spec.unsharded_flattened_offsets[_rank(self.process_group)]

    @property
    def unsharded_shape(self) -> tuple[int, ...]:
        return self.sharding_spec.unsharded_shape

    @property
    def sharded_data(self) -> torch.Tensor:
        return self._local_tensor


class ShardedFlatParameter(ShardedFlatTensor, nn.Parameter):
    @staticmethod
    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True) -> ShardedFlatParameter:
        param = nn.Parameter.__new__(cls, data=None if data is None else data.data.detach(), requires_grad=requires_grad)
        if isinstance(data, ShardedFlatTensor):
            param._local_tensor = data._local_tensor
            param._sharding_spec = data._sharding_spec
            param._process_group = data._process_group
        else:
            param._local_tensor = None if data is None else data.data.detach()
            param._sharding_spec = None
            param._process_group = None
        param._global_tensor = None
        return param


def shard_module_(module: nn.Module, process_group=None) -> None:
    """Replace every parameter with this rank's ``ShardedFlatParameter`` of it, as OLMo-core's
    FSDP does (each parameter split evenly, as far as it goes, across the group)."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sharded = ShardedFlatTensor.shard(p.detach(), process_group=process_group)
                sub._parameters[name] = ShardedFlatParameter(sharded, requires_grad=p.requires_grad)


class FSDP(nn.Module):
    """OLMo-core's FSDP wrapper (``olmo_core.distributed.fsdp.FSDP`` of v0.1.0) as a checkpointer
    sees it: the wrapped module is the child ``_fsdp_wrapped_module`` (its ``WRAPPED_MODULE_PREFIX``),
    every parameter becomes this rank's ``ShardedFlatParameter``, and ``named_parameters()`` /
    ``state_dict()`` keys leave the wrapper's part out, as OLMo-core's overrides do."""

    WRAPPED_MODULE_PREFIX = "_fsdp_wrapped_module"

    def __init__(self, module: nn.Module, process_group=None) -> None:
        super().__init__()
        setattr(self, self.WRAPPED_MODULE_PREFIX, module)
        shard_module_(module, process_group)

    @property
    def module(self) -> nn.Module:
        return getattr(self, self.WRAPPED_MODULE_PREFIX)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):
        for name, p in super().named_parameters(*args, **kwargs):
            yield name.replace(f"{self.WRAPPED_MODULE_PREFIX}.", ""), p
