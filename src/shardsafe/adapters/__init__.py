"""Adapters: framework objects -> the geometry of this rank's pieces, plus views on their data."""

from .describe import LocalTensor, describe_state
from .sharded_tensor import ShardedTensor

__all__ = ["LocalTensor", "ShardedTensor", "describe_state"]
