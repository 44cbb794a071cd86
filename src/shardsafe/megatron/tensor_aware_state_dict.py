"""Megatron-Core's ``tensor_aware_state_dict`` name.

``MCoreTensorAwareStateDict`` is the state-dict container of Megatron-LM's *local* (non-persistent,
node-local) checkpoints, built on nvidia-resiliency-ext. shardsafe does not implement it: its
node-local tier is :class:`shardsafe.CheckpointManager` (memory tiers and peers), and a global
checkpoint is ``shardsafe.megatron.save``. Megatron-LM reaches it only with
``--non-persistent-ckpt-type local``; use ``global`` (the default) with shardsafe.
"""

from __future__ import annotations

from typing import Any

from .core import CheckpointingException

__all__ = ["MCoreTensorAwareStateDict"]


def _unsupported() -> CheckpointingException:
    return CheckpointingException(
        "MCoreTensorAwareStateDict (Megatron-LM's local, nvidia-resiliency-ext checkpoints) is not supported by "
        "shardsafe.megatron: use global checkpoints (shardsafe.megatron.save, Megatron-LM's default "
        "--non-persistent-ckpt-type global) or shardsafe.CheckpointManager's memory tiers for node-local copies"
    )


class MCoreTensorAwareStateDict:
    """Not supported (see the module's docstring): every constructor raises ``CheckpointingException``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _unsupported()

    @classmethod
    def from_state_dict(cls, *args: Any, **kwargs: Any) -> Any:
        raise _unsupported()
