"""Megatron-Core's ``strategies.common`` names.

Megatron-Core keeps a checkpoint's common state in ``common.pt`` (pickle, through ``torch.save``)
and its ShardedObjects in ``.pt`` files. shardsafe.megatron keeps both in ``metadata.json`` as
JSON (read ``load_common_state_dict``), so the common strategies have nothing to register; a
``common.pt`` of a megatron-core checkpoint is still read (safely) when one is loaded.
"""

from __future__ import annotations

from .torch_dist import COMMON_FNAME

__all__ = ["COMMON_STATE_FNAME", "register_default_common_strategies"]

COMMON_STATE_FNAME = COMMON_FNAME
"""The file megatron-core writes the common state to (``common.pt``)."""


def register_default_common_strategies() -> None:
    """Nothing to register: shardsafe's sharded strategy saves and loads the common state too."""
