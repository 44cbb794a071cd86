"""shardsafe's strategies inside megatron-core's own ``dist_checkpointing`` (tested with 0.15.3).

:func:`register_with_megatron` makes ``megatron.core.dist_checkpointing.save(...,
sharded_strategy=("shardsafe", 1))`` (or an instance of :class:`MegatronSaveShardedStrategy`)
write the sharded part as a shardsafe checkpoint, and Megatron's ``load`` find the strategy
that reads it from the checkpoint itself. Megatron keeps writing its common state to
``common.pt`` (its common strategy); the stored config then says ``common_backend="torch"``.

Both sides name their file ``metadata.json``: shardsafe's is the commit record (with
``format_version``), Megatron's a four-field config. Megatron's ``maybe_load_config`` would
build ``CheckpointingConfig(**document)`` from shardsafe's and fail, and its ``save_config`` would
overwrite the commit record. Registering therefore wraps those two functions where Megatron's
modules call them: on a directory that holds a shardsafe checkpoint, ``maybe_load_config``
returns the config stored inside the commit record, and ``save_config`` writes nothing (that
config is already in the commit record); on any other directory they do what Megatron's do.
This module imports megatron-core; ``import shardsafe.megatron`` never does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from megatron.core.dist_checkpointing import core as mcore
from megatron.core.dist_checkpointing import mapping as mmap
from megatron.core.dist_checkpointing import serialization as mser
from megatron.core.dist_checkpointing import validation as mval
from megatron.core.dist_checkpointing.strategies import base as mbase
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest as MegatronAsyncRequest

from ..errors import CheckpointError
from ..format import strict_json
from ..storage.local import read_nofollow
from .core import CONFIG_FNAME, SHARDSAFE_BACKEND, config_from_document
from .dict_utils import dict_list_map_outplace, nested_values
from .mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from .strategies.native import FORMAT_VERSION, ShardsafeLoadShardedStrategy, ShardsafeSaveShardedStrategy

__all__ = ["MegatronLoadShardedStrategy", "MegatronSaveShardedStrategy", "register_with_megatron"]

_TENSOR_FIELDS = (
    "key", "data", "dtype", "local_shape", "global_shape", "global_offset", "axis_fragmentations", "replica_id",
    "prepend_axis_num", "allow_shape_mismatch", "flattened_range",
)


def to_shardsafe(sharded_state_dict: Any) -> Any:
    """A copy of the nesting of Megatron-Core's ``sharded_state_dict`` with its ShardedTensors and
    ShardedObjects as :mod:`shardsafe.megatron.mapping`'s (sharing ``data``)."""

    def convert(v: Any) -> Any:
        if isinstance(v, mmap.ShardedTensor):
            return ShardedTensor(**{f: getattr(v, f) for f in _TENSOR_FIELDS})
        if isinstance(v, mmap.ShardedObject):
            return ShardedObject(v.key, v.data, tuple(v.global_shape), tuple(v.global_offset), v.replica_id)
        return v

    return dict_list_map_outplace(convert, sharded_state_dict)


def to_megatron(sharded_state_dict: Any) -> Any:
    """The reverse of :func:`to_shardsafe`: shardsafe's classes as Megatron-Core's."""

    def convert(v: Any) -> Any:
        if isinstance(v, ShardedTensor):
            return mmap.ShardedTensor(**{f: getattr(v, f) for f in _TENSOR_FIELDS})
        if isinstance(v, ShardedObject):
            return mmap.ShardedObject(v.key, v.data, tuple(v.global_shape), tuple(v.global_offset), v.replica_id)
        return v

    return dict_list_map_outplace(convert, sharded_state_dict)


class _SavedByMegatron(ShardsafeSaveShardedStrategy):
    common_backend = ("torch", 1)  # Megatron's own common strategy writes common.pt


class MegatronSaveShardedStrategy(mbase.AsyncSaveShardedStrategy):
    """shardsafe's save as a megatron-core save strategy (backend ``"shardsafe"``, version 1).

    ``save`` writes the ShardedTensors and ShardedObjects Megatron's ``save`` hands it as one
    shardsafe checkpoint; ``async_save`` starts shardsafe's background save and returns a
    Megatron ``AsyncRequest`` with no ``async_fn`` (nothing to run in a forked process) whose
    first finalize function waits for the commit, so Megatron's later finalize functions run
    after it on every rank.
    """

    def __init__(self, backend: str = SHARDSAFE_BACKEND, version: int = FORMAT_VERSION, *, allow_pickle: bool = False) -> None:
        super().__init__(backend, version)
        self.strategy = _SavedByMegatron(backend, version, allow_pickle=allow_pickle)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        values = list(nested_values(to_shardsafe(sharded_state_dict)))
        self.strategy.save_all(lambda: (values, {}, None), checkpoint_dir, validate=False)

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> MegatronAsyncRequest:
        values = list(nested_values(to_shardsafe(sharded_state_dict)))
        pending = self.strategy.save_all(lambda: (values, {}, None), checkpoint_dir, validate=False, background=True)
        assert pending is not None
        return MegatronAsyncRequest(None, (), [pending.wait])


class MegatronLoadShardedStrategy(mbase.LoadShardedStrategy, mbase.LoadCommonStrategy):
    """shardsafe's load as a megatron-core load strategy, for the sharded part and (for
    checkpoints saved through :mod:`shardsafe.megatron`) the common state."""

    def __init__(self, strategy: ShardsafeLoadShardedStrategy | None = None) -> None:
        self.strategy = strategy if strategy is not None else ShardsafeLoadShardedStrategy()

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        self.strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        self.strategy.check_version_compatibility(loaded_version)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> StateDict:
        return self.strategy.load(to_shardsafe(sharded_state_dict), checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        return to_megatron(self.strategy.load_tensors_metadata(checkpoint_dir))

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        return to_megatron(self.strategy.load_sharded_metadata(checkpoint_dir))

    def load_common(self, checkpoint_dir: str | Path) -> StateDict:
        return self.strategy.load_common(checkpoint_dir)

    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> Any:
        return self.strategy.load_sharded_objects(to_shardsafe(sharded_objects_state_dict), checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: str | Path, key_prefix: str) -> None:
        self.strategy.remove_sharded_tensors(checkpoint_dir, key_prefix)


def _shardsafe_document(checkpoint_dir: Any) -> dict | None:
    """The parsed ``metadata.json`` of ``checkpoint_dir`` if it is shardsafe's commit record."""
    if not checkpoint_dir:
        return None
    try:
        raw = read_nofollow(os.path.join(checkpoint_dir, CONFIG_FNAME))
    except (OSError, CheckpointError):
        return None
    if b'"format_version"' not in raw:
        return None
    try:
        doc = strict_json.loads(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and "format_version" in doc else None


def _wrap_maybe_load_config(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def maybe_load_config(checkpoint_dir: Any) -> Any:
        doc = _shardsafe_document(checkpoint_dir)
        if doc is None:
            return original(checkpoint_dir)
        config = config_from_document(doc)
        return mcore.CheckpointingConfig(**asdict(config))  # type: ignore[arg-type]

    maybe_load_config.__doc__ = original.__doc__
    maybe_load_config.shardsafe_wrapped = original  # type: ignore[attr-defined]
    return maybe_load_config


def _wrap_save_config(original: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def save_config(config: Any, checkpoint_dir: Any) -> None:
        if _shardsafe_document(checkpoint_dir) is None:
            original(config, checkpoint_dir)
        # else: the commit record already holds the config shardsafe's strategy saved with it

    save_config.__doc__ = original.__doc__
    save_config.shardsafe_wrapped = original  # type: ignore[attr-defined]
    return save_config


def register_with_megatron() -> None:
    """Register shardsafe's strategies in megatron-core's registry of default strategies, under
    ``("shardsafe", 1)``: save (sharded), load (sharded) and load (common, for checkpoints saved
    through :mod:`shardsafe.megatron`, whose common state is inside ``metadata.json``); and let
    Megatron's ``maybe_load_config`` / ``save_config`` recognise shardsafe's ``metadata.json``
    (see the module's docstring). Calling it again changes nothing."""
    mbase.register_default_strategy(mbase.StrategyAction.SAVE_SHARDED, SHARDSAFE_BACKEND, FORMAT_VERSION, MegatronSaveShardedStrategy())
    load = MegatronLoadShardedStrategy()
    mbase.register_default_strategy(mbase.StrategyAction.LOAD_SHARDED, SHARDSAFE_BACKEND, FORMAT_VERSION, load)
    mbase.register_default_strategy(mbase.StrategyAction.LOAD_COMMON, SHARDSAFE_BACKEND, FORMAT_VERSION, load)
    for module in (mcore, mval):
        if not hasattr(module.maybe_load_config, "shardsafe_wrapped"):
            module.maybe_load_config = _wrap_maybe_load_config(module.maybe_load_config)
    if not hasattr(mser.save_config, "shardsafe_wrapped"):
        mser.save_config = _wrap_save_config(mser.save_config)

