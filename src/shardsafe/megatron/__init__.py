"""``shardsafe.megatron``: Megatron-Core's ``dist_checkpointing`` API on shardsafe's engine.

Code written for ``megatron.core.dist_checkpointing`` (v0.15 surface) runs by changing the
import::

    from shardsafe.megatron import ShardedTensor, load, save   # was: from megatron.core.dist_checkpointing import ...

and then writes shardsafe checkpoints: one atomic commit, checksums on every byte read, no
pickle, any layout (TP, PP, DP, EP, distributed-optimizer ranges) into any other. The submodules
have Megatron's names: :mod:`.mapping`, :mod:`.serialization`, :mod:`.validation`, :mod:`.core`,
:mod:`.dict_utils`, :mod:`.utils`, :mod:`.optimizer`, :mod:`.strategies`. megatron-core itself is never imported.
Checkpoints megatron-core's ``torch_dist`` and ``zarr`` backends wrote load through :func:`load` as they are, and
:func:`convert_megatron` converts one into shardsafe's format.
"""

from . import core, dict_utils, mapping, optimizer, serialization, strategies, utils, validation
from ._alias import install, installed
from .convert import convert_megatron
from .core import CheckpointingConfig, CheckpointingException, check_is_distributed_checkpoint
from .mapping import (
    LocalNonpersistentObject,
    LocalNonpersitentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from .serialization import (
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
)
from .validation import StrictHandling


def register_with_megatron() -> None:
    """Register shardsafe's strategies with megatron-core (see
    :func:`shardsafe.megatron.registration.register_with_megatron`); needs ``pip install megatron-core``."""
    try:
        from .registration import register_with_megatron as register
    except ImportError as e:
        raise ImportError(f"shardsafe.megatron.register_with_megatron needs megatron-core (pip install megatron-core): {e}") from e
    register()


__all__ = [
    "CheckpointingConfig",
    "CheckpointingException",
    "LocalNonpersistentObject",
    "LocalNonpersitentObject",
    "ShardedObject",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StrictHandling",
    "check_is_distributed_checkpoint",
    "convert_megatron",
    "core",
    "dict_utils",
    "install",
    "installed",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "mapping",
    "optimizer",
    "register_with_megatron",
    "remove_sharded_tensors",
    "save",
    "serialization",
    "strategies",
    "utils",
    "validation",
]
