"""Strategy interfaces and the registry of defaults, as in ``megatron.core.dist_checkpointing.strategies.base``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core import CheckpointingException
from ..mapping import ShardedStateDict, StateDict

if TYPE_CHECKING:
    from .async_utils import AsyncRequest

__all__ = [
    "AsyncSaveShardedStrategy",
    "LoadCommonStrategy",
    "LoadShardedStrategy",
    "LoadStrategyBase",
    "SaveCommonStrategy",
    "SaveShardedStrategy",
    "SaveStrategyBase",
    "StrategyAction",
    "default_strategies",
    "get_default_strategy",
    "register_default_strategy",
]


class StrategyAction(Enum):
    """Save or load, of the sharded or the common part."""

    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


default_strategies: defaultdict[str, dict[tuple[str, int], Any]] = defaultdict(dict)
"""action value -> (backend, version) -> strategy."""


def get_default_strategy(action: StrategyAction, backend: str, version: int) -> Any:
    """The strategy registered for ``action`` on ``(backend, version)`` (shardsafe's own are
    registered when the package ``shardsafe.megatron.strategies``, which holds this module, is
    imported)."""
    try:
        return default_strategies[action.value][(backend, version)]
    except KeyError:
        known = sorted(default_strategies[action.value])
        raise CheckpointingException(
            f"no default strategy for {(action.value, backend, version)}; shardsafe.megatron has {known}"
        ) from None


def register_default_strategy(
    action: StrategyAction, backend: str, version: int, strategy: SaveStrategyBase | LoadStrategyBase
) -> None:
    """Make ``strategy`` the default for ``action`` on ``(backend, version)``."""
    default_strategies[action.value][(backend, version)] = strategy


class LoadStrategyBase(ABC):
    """A load strategy: checks that it reads a checkpoint's backend and version."""

    @abstractmethod
    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raise ``CheckpointingException`` unless this strategy reads ``loaded_backend``."""

    @abstractmethod
    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raise ``CheckpointingException`` unless this strategy reads ``loaded_version``."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether this strategy loads ShardedObjects too."""
        return False


class SaveStrategyBase(ABC):  # noqa: B024 - abstract like Megatron-Core's, without abstract methods
    """A save strategy, writing ``backend`` at format ``version``."""

    def __init__(self, backend: str, version: int) -> None:
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether this strategy saves ShardedObjects too."""
        return False

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.backend}, {self.version})"


class LoadCommonStrategy(LoadStrategyBase):
    """Loads the common (not sharded) part."""

    @abstractmethod
    def load_common(self, checkpoint_dir: str | Path) -> StateDict:
        """The common state of the checkpoint."""

    @abstractmethod
    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> Any:
        """Replace the ShardedObjects of ``sharded_objects_state_dict`` by their stored values."""

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        """The ShardedObjects of the checkpoint, without data, by unique key."""
        if not self.can_handle_sharded_objects:
            return {}
        raise NotImplementedError


class LoadShardedStrategy(LoadStrategyBase):
    """Loads the sharded part."""

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> StateDict:
        """The sharded part, loaded."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        """Every stored tensor as a ShardedTensor without data or sharding, by key."""

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        """Every stored tensor and ShardedObject, without data (objects by unique key)."""
        if not self.can_handle_sharded_objects:
            return self.load_tensors_metadata(checkpoint_dir)
        raise NotImplementedError

    def remove_sharded_tensors(self, checkpoint_dir: str | Path, key_prefix: str) -> None:
        """Remove the tensors whose key starts with ``key_prefix`` from the checkpoint."""
        raise NotImplementedError


class SaveCommonStrategy(SaveStrategyBase):
    """Saves the common part."""

    @abstractmethod
    def save_common(self, common_state_dict: StateDict, checkpoint_dir: str | Path) -> None:
        """Save the common state."""

    def save_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        """Save the ShardedObjects."""
        raise NotImplementedError


class SaveShardedStrategy(SaveStrategyBase):
    """Saves the sharded part."""

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        """Save the sharded part."""


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A sharded save that can return before its writes are done."""

    @abstractmethod
    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> AsyncRequest:
        """Start the save; the returned request completes it."""

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        """The asynchronous save, completed before returning."""
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()
