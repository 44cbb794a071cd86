"""Megatron's common state and ShardedObjects as JSON, through the one value codec
(:mod:`shardsafe.format.values`), with Megatron's opt-in wording and its exception type: a value
that cannot be stored (nested too deep, containing itself, too large to inline, an enum whose
module is not imported) raises :class:`~shardsafe.megatron.core.CheckpointingException`, and
``PickleNotAllowedError`` or ``CorruptCheckpointError`` one that is still an instance of its own
class (:func:`~shardsafe.megatron.core.megatron_errors`).
"""

from __future__ import annotations

from typing import Any

from ..format import values
from .core import megatron_errors

__all__ = ["decode_value", "encode_value"]

_SAVE_OPT_IN = (
    "wrap it in a LocalNonpersistentObject if it need not be saved, or opt in to pickle with "
    "sharded_strategy=shardsafe.megatron.strategies.ShardsafeSaveShardedStrategy(allow_pickle=True)"
)
_LOAD_OPT_IN = "sharded_strategy=shardsafe.megatron.strategies.ShardsafeLoadShardedStrategy(allow_pickle=True)"


@megatron_errors
def encode_value(value: Any, *, where: str, allow_pickle: bool, opt_in: str = _SAVE_OPT_IN) -> Any:
    """:func:`shardsafe.format.values.encode_value`, raising Megatron's exception type."""
    return values.encode_value(value, where=where, allow_pickle=allow_pickle, opt_in=opt_in)


@megatron_errors
def decode_value(value: Any, *, where: str, allow_pickle: bool, opt_in: str = _LOAD_OPT_IN) -> Any:
    """:func:`shardsafe.format.values.decode_value`, raising Megatron's exception type."""
    return values.decode_value(value, where=where, allow_pickle=allow_pickle, opt_in=opt_in)
