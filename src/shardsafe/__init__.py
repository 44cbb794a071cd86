"""shardsafe: fast, lean, safe distributed checkpoints for PyTorch, on safetensors files.

Models and optimizers (every rank, together; any parallelism, any world size on load):
    save_model_and_optim_state, async_save_model_and_optim_state, load_model_and_optim_state,
    unshard_model_state, unshard_optim_state
Flat state dicts: Checkpointer (save, async_save, load, unshard, get_metadata); AsyncSave
Training loops: CheckpointManager; RNGState; ShardedTensor (Megatron-style boxes)
Hugging Face: unshard_to_safetensors (one file or a sharded folder), load_hf_safetensors
Checks: verify -> VerifyReport
Errors: CheckpointError and its subclasses (every error bad input or damage can cause)
Submodules: shardsafe.dcp (torch.distributed.checkpoint), shardsafe.megatron, shardsafe.storage
(object stores), shardsafe.cli (the ``shardsafe`` command). The metadata models
(StorageMetadata, TensorStorageMetadata, TensorShardSpec) are importable from here and
documented in shardsafe.format.metadata.
"""

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
from .format.metadata import StorageMetadata as StorageMetadata
from .format.metadata import TensorShardSpec as TensorShardSpec
from .format.metadata import TensorStorageMetadata as TensorStorageMetadata
from .hf import load_hf_safetensors
from .manager import CheckpointManager
from .rng import RNGState
from .verify import VerifyReport, verify

__version__ = "0.1.0"

# ``__all__`` is what ``help(shardsafe)`` documents: the pydantic metadata models (hundreds of
# inherited methods each) stay importable from here but are documented in their own module.

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
