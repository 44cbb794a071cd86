"""Megatron-Core's ``strategies.torch`` names, on shardsafe's engine.

Megatron-Core's ``torch_dist`` backend writes through PyTorch DCP; shardsafe.megatron writes its
own format for that name (see :mod:`.shardsafe`). :class:`TorchDistSaveShardedStrategy` is the
default save strategy under Megatron's class name; :class:`TorchDistLoadShardedStrategy` reads
checkpoints megatron-core's own ``torch_dist`` wrote. DCP's planners (:class:`MCoreLoadPlanner`,
:class:`MCoreSavePlanner`) have no role in shardsafe (it plans its reads and writes itself) and
refuse to be built; the n-d flattened reformulation (:func:`get_reformulation_metadata`) is never
needed, because shardsafe reads any flattened range from any saved layout directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core import CheckpointingException
from ..mapping import ShardedStateDict
from .base import StrategyAction, register_default_strategy
from .native import ShardsafeLoadShardedStrategy, ShardsafeSaveShardedStrategy
from .torch_dist import TorchDistLoadShardedStrategy

__all__ = [
    "MCoreLoadPlanner",
    "MCoreSavePlanner",
    "TorchDistLoadShardedStrategy",
    "TorchDistSaveShardedStrategy",
    "get_reformulation_metadata",
    "register_default_torch_strategies",
]


class TorchDistSaveShardedStrategy(ShardsafeSaveShardedStrategy):
    """The default save strategy, under Megatron-Core's name and signature: it writes a shardsafe
    checkpoint whatever ``backend`` says. ``thread_count``, ``process_group``,
    ``separation_hint`` and ``cached_metadata`` tune DCP's writer in Megatron-Core; shardsafe's
    engine sizes its own I/O and plans once per layout, so they are accepted and have no effect.
    ``keep_only_main_replica=False`` (every replica written) is refused: shardsafe writes each piece once."""

    def __init__(
        self,
        backend: str = "torch_dist",
        version: int = 1,
        keep_only_main_replica: bool = True,
        thread_count: int = 2,
        process_group: Any = None,
        separation_hint: str | None = None,
        cached_metadata: bool = False,
        **kwargs: Any,
    ) -> None:
        if not keep_only_main_replica:
            raise CheckpointingException(
                "TorchDistSaveShardedStrategy(keep_only_main_replica=False) is not supported: shardsafe writes each "
                "piece once, from one replica; leave keep_only_main_replica at True"
            )
        super().__init__(allow_pickle=kwargs.pop("allow_pickle", False), knobs=kwargs.pop("knobs", None))
        if kwargs:
            raise TypeError(f"TorchDistSaveShardedStrategy got unexpected arguments {sorted(kwargs)}")
        self.requested_backend = (backend, version)
        self.thread_count = thread_count
        self.process_group = process_group
        self.separation_hint = separation_hint
        self.use_cached_ckpt_structure = cached_metadata


def _no_dcp_planner(name: str) -> CheckpointingException:
    return CheckpointingException(
        f"{name} is a PyTorch DCP planner; shardsafe.megatron does not save or load through DCP (its engine plans "
        "reads and writes itself), so there is nothing to plan with it. Use shardsafe.megatron.save/load, or "
        "megatron-core itself for DCP-level customisation"
    )


class MCoreLoadPlanner:
    """Megatron-Core's DCP load planner: not used by shardsafe; building one raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _no_dcp_planner("MCoreLoadPlanner")

    def create_local_plan(self) -> Any:
        raise _no_dcp_planner("MCoreLoadPlanner")


class MCoreSavePlanner:
    """Megatron-Core's DCP save planner: not used by shardsafe; building one raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _no_dcp_planner("MCoreSavePlanner")

    def create_local_plan(self) -> Any:
        raise _no_dcp_planner("MCoreSavePlanner")


def get_reformulation_metadata(sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> dict[str, Any]:
    """Which requested n-d flattened tensors must be reformulated to the saved layout before a
    load: none with shardsafe (``{}``), which reads any flattened range of any saved layout
    directly."""
    return {}


def register_default_torch_strategies() -> None:
    """Register the default save and load strategies for ``("torch_dist", 1)`` (done on import)."""
    register_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1, TorchDistSaveShardedStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1, ShardsafeLoadShardedStrategy())


