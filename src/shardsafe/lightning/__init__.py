"""shardsafe for Lightning users (``lightning.pytorch`` Trainer and ``lightning.fabric``).

One argument switches a Lightning run to shardsafe checkpoints::

    trainer = L.Trainer(strategy=shardsafe.lightning.ModelParallelStrategy(), ...)  # FSDP2 / TP
    trainer = L.Trainer(strategy=shardsafe.lightning.DDPStrategy(), ...)
    trainer = L.Trainer(strategy=shardsafe.lightning.FSDPStrategy(), ...)  # FSDP1, CUDA only
    fabric = L.Fabric(strategy=shardsafe.lightning.FabricModelParallelStrategy(), ...)

- :func:`consolidate`: a shardsafe checkpoint as the single-file checkpoint Lightning users load
  with ``torch.load(...)["state_dict"]`` (replaces ``python -m
  lightning.pytorch.utilities.consolidate_checkpoint``), streamed one tensor at a time; needs no
  Lightning. Also ``shardsafe consolidate DIR OUT``.
- :func:`save_checkpoint` / :func:`load_checkpoint` / :func:`read_meta`: the functions the
  strategies call, for code of your own.

The strategies import Lightning when first used; ``import shardsafe.lightning`` does not.
"""

from __future__ import annotations

from typing import Any

from ._checkpoint import META_KEY, consolidate, load_checkpoint, read_meta, save_checkpoint

__all__ = [
    "META_KEY", "DDPStrategy", "FSDPStrategy", "FabricFSDPStrategy", "FabricModelParallelStrategy", "ModelParallelStrategy", "consolidate", "load_checkpoint",
    "read_meta", "save_checkpoint",
]

_STRATEGIES = ("DDPStrategy", "FSDPStrategy", "FabricFSDPStrategy", "FabricModelParallelStrategy", "ModelParallelStrategy")


def __getattr__(name: str) -> Any:
    if name in _STRATEGIES:
        from . import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module 'shardsafe.lightning' has no attribute {name!r}")
