"""Lightning strategies that save and load sharded checkpoints through shardsafe (imports Lightning).

The seam: a strategy's ``save_checkpoint`` / ``load_checkpoint``. Lightning's sharded strategies
do not use a ``CheckpointIO`` for sharded checkpoints (``ModelParallelStrategy`` calls
``torch.distributed.checkpoint`` itself and ``torch.save``s ``meta.pt`` on rank 0; a
``CheckpointIO`` is only ever called on rank 0 with the full state), so the switch is the strategy:

    trainer = L.Trainer(strategy=shardsafe.lightning.ModelParallelStrategy(), ...)  # was: ModelParallelStrategy()
    trainer = L.Trainer(strategy=shardsafe.lightning.DDPStrategy(), ...)            # was: "ddp"
    trainer = L.Trainer(strategy=shardsafe.lightning.FSDPStrategy(), ...)           # was: "fsdp" (needs CUDA)
    fabric = L.Fabric(strategy=shardsafe.lightning.FabricModelParallelStrategy(), ...)
    fabric = L.Fabric(strategy=shardsafe.lightning.FabricFSDPStrategy(), ...)       # was: "fsdp" (needs CUDA)

Every rank writes its own shards; the loop state goes into the same checkpoint (one atomic
commit, no ``meta.pt``, no pickle); ``trainer.fit(model, ckpt_path=...)`` resumes at any world
size. A folder Lightning's own sharded save wrote (DCP files and ``meta.pt``) still loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies import FSDPStrategy as _FabricFSDP
from lightning.fabric.strategies import ModelParallelStrategy as _FabricModelParallel
from lightning.pytorch.strategies import DDPStrategy as _DDP
from lightning.pytorch.strategies import FSDPStrategy as _FSDP
from lightning.pytorch.strategies import ModelParallelStrategy as _ModelParallel
from torch import nn

from ._checkpoint import is_lightning_dcp_folder, load_checkpoint, save_checkpoint

__all__ = ["DDPStrategy", "FSDPStrategy", "FabricFSDPStrategy", "FabricModelParallelStrategy", "ModelParallelStrategy"]


class _TrainerCheckpoints:
    """``save_checkpoint`` / ``load_checkpoint`` of a ``Trainer`` strategy through shardsafe: the
    model and optimizer are loaded in place after setup, the loop state is returned."""

    allow_pickle: bool = False

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model is sharded (and the optimizer made) before its state is loaded in place

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint already did

    def _checkpoint_module(self) -> nn.Module:
        """The module whose parameters are saved: the ``LightningModule`` itself where its
        parameters say how they are sharded (plain, DDP, FSDP2/TP DTensors)."""
        return self.lightning_module  # type: ignore[attr-defined]

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        path = Path(self.broadcast(filepath))  # type: ignore[attr-defined]
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        save_checkpoint(path, self._checkpoint_module(), list(self.optimizers), meta, allow_pickle=self.allow_pickle)  # type: ignore[attr-defined]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))  # type: ignore[attr-defined]
        module = self._checkpoint_module()
        strict = self.lightning_module.strict_loading  # type: ignore[attr-defined]
        if is_lightning_dcp_folder(path):
            return _load_lightning_dcp_folder(path, module, list(self.optimizers), strict=strict)  # type: ignore[attr-defined]
        return load_checkpoint(path, module, list(self.optimizers), strict=strict, allow_pickle=self.allow_pickle)  # type: ignore[attr-defined]

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint loaded the model in place

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # load_checkpoint loaded the optimizer in place


class ModelParallelStrategy(_TrainerCheckpoints, _ModelParallel):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallel, set up in
    ``configure_model``) with sharded checkpoints written and read by shardsafe.

    Same arguments as Lightning's, plus ``allow_pickle``: store parts of the loop state that have
    no JSON form with pickle (otherwise such a save fails naming the part)."""

    def __init__(self, *args: Any, allow_pickle: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allow_pickle = allow_pickle


class DDPStrategy(_TrainerCheckpoints, _DDP):
    """Lightning's ``DDPStrategy`` with checkpoints written and read by shardsafe: every rank
    writes a part of the (replicated) state and the result loads at any world size, into DDP
    or into a sharded strategy. Same arguments as Lightning's, plus ``allow_pickle``."""

    def __init__(self, *args: Any, allow_pickle: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allow_pickle = allow_pickle


class FSDPStrategy(_TrainerCheckpoints, _FSDP):
    """Lightning's ``FSDPStrategy`` (FSDP1; Lightning's default ``use_orig_params=True``) with
    sharded checkpoints written and read by shardsafe, whatever ``state_dict_type`` says: every
    rank writes the flat parts of its parameters and optimizer state, and the checkpoint loads at
    any world size and into any other strategy. Lightning runs FSDP on CUDA only. Same arguments
    as Lightning's, plus ``allow_pickle``; ``state_dict_type`` defaults to ``"sharded"`` here, so
    the state dict Lightning collects for its hooks before each save is the local shards, not a
    full copy gathered on every rank."""

    def __init__(self, *args: Any, allow_pickle: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("state_dict_type", "sharded")
        super().__init__(*args, **kwargs)
        self.allow_pickle = allow_pickle

    def _checkpoint_module(self) -> nn.Module:
        # the FSDP-wrapped model: its FullyShardedDataParallel units say which flat range of
        # each parameter this rank holds (the LightningModule inside the root unit does not)
        return self.model  # type: ignore[return-value]


class _FabricCheckpoints:
    """``fabric.save(path, state)`` and ``fabric.load(path, state)`` through shardsafe. ``state``
    holds one module, at most one optimizer, and values (objects with
    ``state_dict()``/``load_state_dict()`` are stored by their state)."""

    allow_pickle: bool = False

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Any | None = None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint: storage_options and filter are not supported")
        path = Path(self.broadcast(path))  # type: ignore[attr-defined]
        module, optims, rest = _split_state(state, str(path))
        meta = {k: (v.state_dict() if _stateful(v) else v) for k, v in rest.items()}
        save_checkpoint(path, module, optims, meta, allow_pickle=self.allow_pickle)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(path))  # type: ignore[attr-defined]
        if not isinstance(state, dict):
            raise TypeError(f"{type(self).__name__}.load_checkpoint: pass state={{'model': model, ...}} (a dict)")
        module, optims, rest = _split_state(state, str(path))
        if is_lightning_dcp_folder(path):  # Fabric's own sharded save: DCP files under the state's keys, and meta.pt
            name_of = {id(v): k for k, v in state.items()}
            optim_keys = [name_of[id(o)] for o in optims]
            meta = _load_lightning_dcp_folder(path, module, optims, strict=strict, model_key=name_of[id(module)], optim_keys=optim_keys)
        else:
            meta = load_checkpoint(path, module, optims, strict=strict, allow_pickle=self.allow_pickle)
        for key, obj in rest.items():
            if key not in meta:
                if strict:
                    from ..errors import MissingKeyError

                    raise MissingKeyError(f"{path}: the checkpoint holds no {key!r} (it holds {sorted(meta)}); pass strict=False to leave it as it is")
                continue
            if _stateful(obj):
                obj.load_state_dict(meta.pop(key))
            else:
                state[key] = meta.pop(key)
        return meta


class FabricModelParallelStrategy(_FabricCheckpoints, _FabricModelParallel):
    """Fabric's ``ModelParallelStrategy`` (FSDP2 / TP) with ``fabric.save`` and ``fabric.load``
    through shardsafe. Same arguments as Fabric's, plus ``allow_pickle``. A folder Lightning's
    own Fabric strategy wrote (DCP files under the state's keys, and ``meta.pt``) loads too."""

    def __init__(self, *args: Any, allow_pickle: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allow_pickle = allow_pickle


class FabricFSDPStrategy(_FabricCheckpoints, _FabricFSDP):
    """Fabric's ``FSDPStrategy`` (FSDP1, CUDA only) with ``fabric.save`` and ``fabric.load``
    through shardsafe. Same arguments as Fabric's, plus ``allow_pickle``."""

    def __init__(self, *args: Any, allow_pickle: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allow_pickle = allow_pickle


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _split_state(state: dict[str, Any], where: str) -> tuple[nn.Module, list[torch.optim.Optimizer], dict[str, Any]]:
    from ..errors import CheckpointError

    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    if len(modules) != 1:
        raise CheckpointError(f"{where}: the state must hold exactly one module, found {len(modules)}")
    optims = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
    rest = {k: v for k, v in state.items() if not isinstance(v, (nn.Module, torch.optim.Optimizer))}
    return modules[0], optims, rest


def _load_lightning_dcp_folder(
    path: Path,
    module: nn.Module,
    optims: list[torch.optim.Optimizer],
    *,
    strict: bool,
    model_key: str | None = None,
    optim_keys: list[str] | None = None,
) -> dict[str, Any]:
    """A folder Lightning's own sharded save wrote: the DCP files through shardsafe's reader
    (checksums where stored, an allowlisted ``.metadata``), ``meta.pt`` with ``weights_only=True``.

    The model is under ``model_key`` and the optimizers under ``optim_keys`` (Fabric: the keys of
    the state the user saved); by default under what the ``.metadata`` holds: ``"state_dict"``
    (the Trainer's ModelParallelStrategy) or ``"model"`` (its FSDPStrategy), and ``"optimizer_<i>"``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from ..dcp import StorageReader
    from ..errors import MissingKeyError
    from ._checkpoint import LIGHTNING_META_FILE

    stored = {key.split(".", 1)[0] for key in StorageReader(str(path)).read_metadata().state_dict_metadata}
    if model_key is None:
        model_key = next((k for k in ("state_dict", "model") if k in stored), None)
        if model_key is None:
            raise MissingKeyError(
                f"{path}: a Lightning sharded checkpoint holds its model under 'state_dict' (ModelParallelStrategy) or 'model' "
                f"(FSDPStrategy); this one holds {sorted(stored)}"
            )
    optim_keys = optim_keys if optim_keys is not None else [f"optimizer_{i}" for i in range(len(optims))]
    for key in (model_key, *optim_keys):
        if key not in stored:
            raise MissingKeyError(f"{path}: the checkpoint holds no {key!r} (it holds {sorted(stored)})")
    model_state = {model_key: get_model_state_dict(module)}
    dcp.load(model_state, storage_reader=StorageReader(str(path)))
    set_model_state_dict(module, model_state[model_key], options=StateDictOptions(strict=strict))
    for key, optim in zip(optim_keys, optims):
        optim_state = {key: get_optimizer_state_dict(module, optim)}
        dcp.load(optim_state, storage_reader=StorageReader(str(path)))
        set_optimizer_state_dict(module, optim, optim_state_dict=optim_state[key])
    meta_file = path / LIGHTNING_META_FILE
    return torch.load(meta_file, map_location="cpu", weights_only=True) if meta_file.is_file() else {}
