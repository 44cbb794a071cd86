"""Tensors that carry their own flat sharding spec, as OLMo-core's FSDP keeps its parameters.

OLMo-core (``ai2-olmo-core`` 0.1.0, ``olmo_core.distributed.tensors``) shards each parameter as a
``ShardedFlatTensor`` / ``ShardedFlatParameter``: a 1-D ``torch.Tensor`` subclass holding this
rank's elements, with a ``sharding_spec`` (``unsharded_shape``, and per rank of its process group
the ``(start, end)`` ranges of the full tensor's row-major flattening it holds). That is exactly a
set of flattened ranges of one box, the whole tensor: the path FSDP1 flat parameters take.

Recognised by duck typing (the class's attribute names), so olmo-core is never imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ShardingError

__all__ = ["FlatSharding", "flat_sharding"]


@dataclass(frozen=True, slots=True)
class FlatSharding:
    shape: tuple[int, ...]
    """Shape of the full (unsharded) tensor."""
    ranges: tuple[tuple[int, int], ...]
    """This rank's ``[start, stop)`` ranges of the full tensor's row-major flattening, in the order
    their elements follow each other in ``local``; empty ranges left out."""
    local: torch.Tensor
    """This rank's elements: a plain 1-D tensor sharing the sharded tensor's memory."""


def _carries_flat_spec(cls: type) -> bool:
    return all(hasattr(cls, name) for name in ("sharding_spec", "unsharded_flattened_offsets", "sharded_data", "is_sharded"))


def flat_sharding(key: str, value: torch.Tensor) -> FlatSharding | None:
    """The flat sharding ``value`` carries, or None for a tensor that carries none.

    Raises ``ShardingError`` naming ``key`` for such a tensor that cannot be described: not
    marked as sharded yet, gathered (unsharded) at the moment, or inconsistent with its spec.
    """
    cls = type(value)
    if cls is torch.Tensor or not _carries_flat_spec(cls):
        return None
    name = f"{cls.__module__}.{cls.__qualname__}"
    try:
        spec = value.sharding_spec
        ranges = tuple((int(a), int(b)) for a, b in value.unsharded_flattened_offsets)
        shape = tuple(int(n) for n in spec.unsharded_shape)
    except (ValueError, AttributeError, TypeError) as e:
        raise ShardingError(f"key {key!r}: the {name} carries no usable sharding spec ({e}); mark it as sharded first") from None
    if not value.is_sharded:
        raise ShardingError(
            f"key {key!r}: the {name} is unsharded (gathered) right now; save and load outside forward/backward, "
            "after reshard_()"
        )
    local = value.sharded_data.detach()
    if type(local) is not torch.Tensor:
        local = local.as_subclass(torch.Tensor)
    numel = 1
    for n in shape:
        numel *= n
    held = [(a, b) for a, b in ranges if b != a]
    if (
        local.dim() != 1
        or local.numel() != sum(b - a for a, b in held)
        or any(not 0 <= a < b <= numel for a, b in held)
    ):
        raise ShardingError(
            f"key {key!r}: the {name} holds {local.numel()} element(s) of shape {list(local.shape)}, its spec says "
            f"ranges {[list(r) for r in ranges]} of a tensor of shape {list(shape)}"
        )
    if local.numel() and local.data_ptr() != value.data_ptr():
        raise ShardingError(
            f"key {key!r}: the {name}'s sharded data is not the memory the tensor itself holds; loading into it would "
            "leave the tensor unchanged"
        )
    return FlatSharding(shape, tuple(held), local)
