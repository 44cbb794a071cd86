"""Save and load strategies, as in ``megatron.core.dist_checkpointing.strategies``.

shardsafe.megatron has one backend, shardsafe's format (:mod:`.shardsafe`), registered as the
default for ``"shardsafe"`` and, so that code asking Megatron's default ``"torch_dist"`` backend
gets it, for ``"torch_dist"`` too. Checkpoints megatron-core's own ``torch_dist`` and ``zarr``
backends wrote load through :class:`TorchDistLoadShardedStrategy` and
:class:`ZarrLoadShardedStrategy` (chosen by ``shardsafe.megatron.load`` from the checkpoint).
"""

from .async_utils import AsyncCallsQueue, AsyncRequest
from .base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    LoadStrategyBase,
    SaveCommonStrategy,
    SaveShardedStrategy,
    SaveStrategyBase,
    StrategyAction,
    get_default_strategy,
    register_default_strategy,
)
from .fully_parallel import FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper
from .native import ShardsafeLoadShardedStrategy, ShardsafeSaveShardedStrategy
from .torch_dist import TorchDistLoadShardedStrategy
from .zarr import ZarrLoadShardedStrategy

__all__ = [
    "AsyncCallsQueue",
    "AsyncRequest",
    "AsyncSaveShardedStrategy",
    "FullyParallelLoadStrategyWrapper",
    "FullyParallelSaveStrategyWrapper",
    "LoadCommonStrategy",
    "LoadShardedStrategy",
    "LoadStrategyBase",
    "SaveCommonStrategy",
    "SaveShardedStrategy",
    "SaveStrategyBase",
    "ShardsafeLoadShardedStrategy",
    "ShardsafeSaveShardedStrategy",
    "StrategyAction",
    "TorchDistLoadShardedStrategy",
    "ZarrLoadShardedStrategy",
    "get_default_strategy",
    "register_default_strategy",
]
