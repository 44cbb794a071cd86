"""shardsafe: fast, lean, safe distributed checkpoints for PyTorch, on safetensors files.

Models and optimizers (every rank, together; any parallelism, any world size on load):
    save_model_and_optim_state, async_save_model_and_optim_state, load_model_and_optim_state,
    unshard_model_state, unshard_optim_state
Flat state dicts: Checkpointer (save, async_save, load, unshard, get_metadata); AsyncSave
Training loops: CheckpointManager; RNGState; ShardedTensor (Megatron-style boxes)
Hugging Face: unshard_to_safetensors (one file or a sharded folder), load_hf_safetensors
Checks: verify -> VerifyReport
Tensor subclasses (torchao's NF4, low-bit optimizer states...): register_tensor_subclass, allowed_tensor_subclasses

Errors: every error bad input, damage or a failed peer can cause is a CheckpointError, importable
from here (documented one by one in shardsafe.errors):
    CheckpointExistsError (also FileExistsError): a committed checkpoint is there, no overwrite
    IncompleteCheckpointError (also FileNotFoundError): no committed checkpoint (no metadata.json)
    ForeignCheckpointError (also ValueError): another library's checkpoint; names its way in
    CorruptCheckpointError: a checksum, a truncated file, invalid metadata
        UnsafePickleError: a pickle (DCP's .metadata) names a class outside the allowlist
    MissingKeyError (also KeyError), ShapeMismatchError, DtypeMismatchError: target vs checkpoint
    ShardingError: pieces that do not tile a tensor, an unsupported placement
    PickleNotAllowedError: a value needs pickle and allow_pickle was not given
    RankMismatchError: ranks passed different arguments to one collective call
    CollectiveError: ranks could not finish a step together
        MissingRanksError (also TimeoutError): some ranks never arrived
    StorageError (also OSError): the storage backend failed
Submodules: shardsafe.dcp (torch.distributed.checkpoint), shardsafe.megatron, shardsafe.storage
(object stores), shardsafe.cli (the ``shardsafe`` command). The metadata models
(StorageMetadata, TensorStorageMetadata, TensorShardSpec) are importable from here and
documented in shardsafe.format.metadata.
"""

import sys
import types
from typing import TYPE_CHECKING

from .errors import (
    CheckpointError,
    CheckpointExistsError,  # noqa: F401 - importable from here, documented in shardsafe.errors
    CollectiveError,  # noqa: F401 - importable from here, documented in shardsafe.errors
    CorruptCheckpointError,  # noqa: F401 - importable from here, documented in shardsafe.errors
    DtypeMismatchError,  # noqa: F401 - importable from here, documented in shardsafe.errors
    ForeignCheckpointError,  # noqa: F401 - importable from here, documented in shardsafe.errors
    IncompleteCheckpointError,  # noqa: F401 - importable from here, documented in shardsafe.errors
    MissingKeyError,  # noqa: F401 - importable from here, documented in shardsafe.errors
    MissingRanksError,  # noqa: F401 - importable from here, documented in shardsafe.errors
    PickleNotAllowedError,  # noqa: F401 - importable from here, documented in shardsafe.errors
    RankMismatchError,  # noqa: F401 - importable from here, documented in shardsafe.errors
    ShapeMismatchError,  # noqa: F401 - importable from here, documented in shardsafe.errors
    ShardingError,  # noqa: F401 - importable from here, documented in shardsafe.errors
    StorageError,  # noqa: F401 - importable from here, documented in shardsafe.errors
    UnsafePickleError,  # noqa: F401 - importable from here, documented in shardsafe.errors
)

# Everything else is imported on first use (PEP 562), so that ``import shardsafe.errors`` and the
# command line (``shardsafe --help``) do not import torch: name -> the module that defines it.
_LAZY = {
    "ShardedTensor": ".adapters",
    "async_save_model_and_optim_state": ".api",
    "load_model_and_optim_state": ".api",
    "save_model_and_optim_state": ".api",
    "unshard_model_state": ".api",
    "unshard_optim_state": ".api",
    "Checkpointer": ".checkpointer",
    "AsyncSave": ".engine.background",
    "unshard_to_safetensors": ".api",
    "StorageMetadata": ".format.metadata",
    "TensorShardSpec": ".format.metadata",
    "TensorStorageMetadata": ".format.metadata",
    "load_hf_safetensors": ".hf",
    "allowed_tensor_subclasses": ".adapters.subclasses",
    "register_tensor_subclass": ".adapters.subclasses",
    "CheckpointManager": ".manager",
    "RNGState": ".rng",
    "VerifyReport": ".verify",
    "verify": ".verify",
}

if TYPE_CHECKING:  # what the names are, for type checkers and IDEs
    from .adapters import ShardedTensor
    from .adapters.subclasses import allowed_tensor_subclasses, register_tensor_subclass
    from .api import (
        async_save_model_and_optim_state,
        load_model_and_optim_state,
        save_model_and_optim_state,
        unshard_model_state,
        unshard_optim_state,
        unshard_to_safetensors,
    )
    from .checkpointer import Checkpointer
    from .engine.background import AsyncSave
    from .format.metadata import StorageMetadata as StorageMetadata
    from .format.metadata import TensorShardSpec as TensorShardSpec
    from .format.metadata import TensorStorageMetadata as TensorStorageMetadata
    from .hf import load_hf_safetensors
    from .manager import CheckpointManager
    from .rng import RNGState
    from .verify import VerifyReport, verify


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shardsafe' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


class _Package(types.ModuleType):
    """The import system binds each submodule to its package's attribute once loaded: the function
    ``shardsafe.verify`` keeps its name over the module ``shardsafe.verify`` (which is in sys.modules)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__version__ = "0.1.0"

# ``__all__`` is what ``help(shardsafe)`` documents: the pydantic metadata models (hundreds of
# inherited methods each) and the error subclasses (each a page of BaseException's methods; the
# docstring above lists them) stay importable from here but are documented in their own modules.

__all__ = [
    "AsyncSave",
    "CheckpointError",
    "CheckpointManager",
    "Checkpointer",
    "RNGState",
    "ShardedTensor",
    "VerifyReport",
    "allowed_tensor_subclasses",
    "async_save_model_and_optim_state",
    "load_hf_safetensors",
    "load_model_and_optim_state",
    "register_tensor_subclass",
    "save_model_and_optim_state",
    "unshard_model_state",
    "unshard_optim_state",
    "unshard_to_safetensors",
    "verify",
]
