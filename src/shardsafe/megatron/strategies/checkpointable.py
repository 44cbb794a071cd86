"""Megatron-Core's ``strategies.checkpointable`` names.

Megatron-Core's ``CheckpointableShardedTensor`` and ``LocalShardsContainer`` let PyTorch DCP itself
(``torch.distributed.checkpoint.save``) write Megatron ShardedTensors. shardsafe.megatron writes
them with its own engine (``shardsafe.megatron.save``), and shardsafe's DCP integration is
``shardsafe.dcp`` (a storage plugin for DCP's own state dicts), so these adapters are not
provided: building one raises ``CheckpointingException`` saying what to use.
"""

from __future__ import annotations

from typing import Any

from ..core import CheckpointingException

__all__ = ["CheckpointableShardedTensor", "LocalShardsContainer"]


def _unsupported(name: str) -> CheckpointingException:
    return CheckpointingException(
        f"{name} (Megatron ShardedTensors written by PyTorch DCP directly) is not supported by shardsafe.megatron: "
        "save the sharded state dict with shardsafe.megatron.save, or save DCP state dicts through shardsafe.dcp"
    )


class CheckpointableShardedTensor:
    """Not supported (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _unsupported("CheckpointableShardedTensor")

    @classmethod
    def from_sh_ten(cls, sh_ten: Any) -> Any:
        raise _unsupported("CheckpointableShardedTensor")


class LocalShardsContainer:
    """Not supported (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _unsupported("LocalShardsContainer")
