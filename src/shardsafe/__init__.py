"""shardsafe: fast, lean, safe distributed checkpoints for PyTorch, on safetensors files."""

from .adapters import ShardedTensor
from .api import (
    async_save_model_and_optim_state,
    load_model_and_optim_state,
    save_model_and_optim_state,
    unshard_model_state,
    unshard_optim_state,
)
from .checkpointer import Checkpointer
from .engine.background import AsyncSave
from .engine.consolidate import unshard_to_safetensors
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CollectiveError,
    CorruptCheckpointError,
    DtypeMismatchError,
    ForeignCheckpointError,
    IncompleteCheckpointError,
    MissingKeyError,
    MissingRanksError,
    PickleNotAllowedError,
    RankMismatchError,
    ShapeMismatchError,
    ShardingError,
    StorageError,
)
from .format.metadata import StorageMetadata, TensorShardSpec, TensorStorageMetadata
from .hf import load_hf_safetensors
from .manager import CheckpointManager
from .rng import RNGState
from .verify import VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "AsyncSave",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointManager",
    "Checkpointer",
    "CollectiveError",
    "CorruptCheckpointError",
    "DtypeMismatchError",
    "ForeignCheckpointError",
    "IncompleteCheckpointError",
    "MissingKeyError",
    "MissingRanksError",
    "PickleNotAllowedError",
    "RNGState",
    "RankMismatchError",
    "ShapeMismatchError",
    "ShardedTensor",
    "ShardingError",
    "StorageError",
    "StorageMetadata",
    "TensorShardSpec",
    "TensorStorageMetadata",
    "VerifyReport",
    "async_save_model_and_optim_state",
    "load_hf_safetensors",
    "load_model_and_optim_state",
    "save_model_and_optim_state",
    "unshard_model_state",
    "unshard_optim_state",
    "unshard_to_safetensors",
    "verify",
]
