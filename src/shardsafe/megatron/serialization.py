"""Save and load entry points, as in ``megatron.core.dist_checkpointing.serialization``.

:func:`save` and :func:`load` take Megatron-Core v0.15's arguments and write and read
shardsafe checkpoints (``docs/format.md`` §11 says how Megatron's objects are stored): one
atomic commit, checksums on every byte read, no pickle, any save layout into any load layout.
Both are collective: every rank calls them together, and an error on any rank raises on every
rank. The metadata readers (:func:`load_common_state_dict`, :func:`load_tensors_metadata`,
:func:`load_sharded_metadata`, :func:`load_plain_tensors`, :func:`load_sharded_objects`,
:func:`load_content_metadata`) need no process group.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..checkpointer import Checkpointer
from ..dist import get_comm
from .core import (
    CheckpointingException,
    megatron_errors,
)
from .dict_utils import merge, nested_values
from .mapping import CommonStateDict, ShardedObject, ShardedStateDict, ShardedTensor, StateDict, apply_factory_merges
from .state_dict_utils import load_preprocess, save_preprocess
from .strategies.async_utils import AsyncRequest
from .strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
)
from .strategies.native import (
    ShardsafeLoadShardedStrategy,
    ShardsafeSaveShardedStrategy,
    read_metadata,
    request_for,
)
from .utils import extract_sharded_base
from .validation import (
    StrictHandling,
    config_of,
    load_strategy,
    megatron_reader,
    parse_strict_flag,
    reads_torch_dist,
    strategy_for_dir,
    verify_checkpoint_and_load_strategy,
)

__all__ = [
    "CkptShardedMetadata",
    "get_default_load_sharded_strategy",
    "get_default_save_common_strategy",
    "get_default_save_sharded_strategy",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_sharded_objects",
    "load_tensors_metadata",
    "remove_sharded_tensors",
    "save",
    "verify_checkpoint_and_load_strategy",
]

_CONTENT_METADATA_KEY = "content_metadata"

CkptShardedMetadata = dict[str, ShardedTensor | ShardedObject]
"""What :func:`load_sharded_metadata` returns: stored tensors and objects without data, by key."""


@megatron_errors
def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str | Path,
    sharded_strategy: SaveShardedStrategy | tuple[str, int] | None = None,
    common_strategy: SaveCommonStrategy | tuple[str, int] | None = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Callable[[CommonStateDict], StateDict] | None = None,
    content_metadata: dict | None = None,
) -> AsyncRequest | None:
    """Save ``sharded_state_dict`` to ``checkpoint_dir``; every rank calls it together.

    Factories are built (in place, as Megatron-Core does), LocalNonpersistentObjects left out,
    ShardedTensors and ShardedObjects saved from their main replicas, and every other value
    saved from rank 0 as the common state (JSON; see :mod:`shardsafe.megatron._values`). With
    ``validate_access_integrity`` the whole sharding is checked before anything is written:
    main replicas must cover every tensor exactly once (``CheckpointingException`` names the
    key, the ranks and the gap or overlap), and ranks whose common state (after
    ``preprocess_common_before_consistancy_check``) differs from rank 0's are logged.
    ``content_metadata`` is stored with the common state (:func:`load_content_metadata`).

    A checkpoint already committed at ``checkpoint_dir`` is replaced, atomically: it stays
    loadable until this save commits. With ``async_sharded_save`` the writes and the commit
    go on in the background and the returned :class:`AsyncRequest` completes them.
    """
    strategy = _save_strategy(sharded_strategy)
    if common_strategy is not None:
        raise CheckpointingException(
            f"common_strategy {common_strategy!r} is not supported: shardsafe.megatron stores the common state as JSON in "
            "the checkpoint's metadata.json; pass common_strategy=None"
        )

    def prepare() -> tuple[list[Any], StateDict, StateDict | None]:
        if content_metadata is not None:
            sharded_state_dict[_CONTENT_METADATA_KEY] = content_metadata
        sharded, common = save_preprocess(sharded_state_dict)
        check = None
        if validate_access_integrity:
            check = preprocess_common_before_consistancy_check(common) if preprocess_common_before_consistancy_check else common
        return list(nested_values(sharded)), common, check

    pending = strategy.save_all(prepare, checkpoint_dir, validate=validate_access_integrity, background=async_sharded_save)
    return request_for(pending) if pending is not None else None


@megatron_errors
def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str | Path,
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
    common_strategy: LoadCommonStrategy | tuple[str, int] | None = None,
    validate_access_integrity: bool = True,
    strict: str | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
) -> StateDict | tuple[StateDict, set[str], set[str]]:
    """Load the checkpoint at ``checkpoint_dir`` as ``sharded_state_dict`` asks; every rank
    calls it together.

    Returns the common state merged with the loaded values: each ShardedTensor's ``data``
    (filled in place; allocated when None), each ShardedObject's value, factories merged,
    LocalNonpersistentObjects unwrapped. ``sharded_state_dict`` itself is not changed. With
    ``validate_access_integrity`` the requested main replicas must cover every tensor exactly
    once. ``strict`` (a :class:`StrictHandling`) says what a mismatch between the requested
    keys and the stored ones does; the ``RETURN_*`` modes return ``(state_dict, missing_keys,
    unexpected_keys)``.
    """
    strict = parse_strict_flag(strict)
    strategy = load_strategy(strategy_for_dir(checkpoint_dir, sharded_strategy), common_strategy)
    meta: Any
    if reads_torch_dist(strategy):
        meta = strategy.view(checkpoint_dir)  # type: ignore[attr-defined]
        comm = get_comm(call="shardsafe.megatron.load")
    else:
        comm = get_comm(call="shardsafe.megatron.load")  # the one check-in: the metadata's broadcast is the first collective
        meta = read_metadata(checkpoint_dir, no_dist=False, comm=comm)
        config = config_of(meta)
        strategy.check_backend_compatibility(config.sharded_backend)
        strategy.check_version_compatibility(config.sharded_backend_version)
    parts: dict[str, Any] = {}

    def prepare() -> ShardedStateDict:
        parts["common"] = strategy.common_of(meta, checkpoint_dir)
        sharded, nonpersistent, parts["factories"] = load_preprocess(sharded_state_dict)
        merge(parts["common"], nonpersistent)
        return extract_sharded_base(sharded)[0]

    loaded, missing, unexpected = strategy.load_all(
        prepare, checkpoint_dir, meta, comm, validate=validate_access_integrity, strict=strict
    )
    common = parts["common"]
    merge(common, loaded)
    apply_factory_merges(common, parts["factories"])
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common, missing, unexpected
    return common


@megatron_errors
def load_common_state_dict(checkpoint_dir: str | Path) -> StateDict:
    """The checkpoint's common state (no process group needed). Values saved with pickle need
    ``ShardsafeLoadShardedStrategy(allow_pickle=True).load_common(checkpoint_dir)``."""
    reader = megatron_reader(checkpoint_dir)
    if reader is not None:
        return reader.load_common(checkpoint_dir)
    return ShardsafeLoadShardedStrategy().load_common(checkpoint_dir)


@megatron_errors
def load_tensors_metadata(checkpoint_dir: str | Path, sharded_strategy: LoadShardedStrategy | None = None) -> ShardedStateDict:
    """Every stored tensor as a ShardedTensor without data or sharding (global shape and dtype),
    by key (no process group needed)."""
    return load_strategy(strategy_for_dir(checkpoint_dir, sharded_strategy), None).load_tensors_metadata(checkpoint_dir)


@megatron_errors
def load_sharded_metadata(
    checkpoint_dir: str | Path,
    sharded_strategy: LoadShardedStrategy | None = None,
    common_strategy: LoadCommonStrategy | None = None,
) -> ShardedStateDict:
    """:func:`load_tensors_metadata` plus every stored ShardedObject (by unique key), without data."""
    return load_strategy(strategy_for_dir(checkpoint_dir, sharded_strategy), common_strategy).load_sharded_metadata(checkpoint_dir)


@megatron_errors
def load_plain_tensors(checkpoint_dir: str | Path) -> StateDict:
    """Every stored tensor, whole, by key (not the common state). Needs no process group; in
    a distributed job each rank that calls it reads every tensor."""
    reader = megatron_reader(checkpoint_dir)
    if reader is not None:
        return reader.load_plain(checkpoint_dir)
    meta = read_metadata(checkpoint_dir, no_dist=True)
    out = {key: torch.empty(t.shape, dtype=t.torch_dtype) for key, t in meta.tensors.items()}
    Checkpointer().load(str(checkpoint_dir), out, no_dist=True, metadata=meta)
    return out


@megatron_errors
def load_sharded_objects(sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> Any:
    """Replace every ShardedObject of ``sharded_state_dict`` by its stored value, in place."""
    return ShardsafeLoadShardedStrategy().load_sharded_objects(sharded_state_dict, checkpoint_dir)


@megatron_errors
def load_content_metadata(
    checkpoint_dir: str | Path | None = None, *, preloaded_state_dict: StateDict | None = None
) -> dict | None:
    """The ``content_metadata`` given to :func:`save` (None if there was none), from the
    checkpoint or from a common state already loaded."""
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise CheckpointingException("load_content_metadata needs checkpoint_dir or preloaded_state_dict")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir)
    return preloaded_state_dict.get(_CONTENT_METADATA_KEY)


@megatron_errors
def remove_sharded_tensors(checkpoint_dir: str | Path, key_prefix: str) -> None:
    """Remove the tensors whose key starts with ``key_prefix`` from the checkpoint (on one process)."""
    load_strategy(None, None).remove_sharded_tensors(checkpoint_dir, key_prefix)


def get_default_save_sharded_strategy(backend: str = "torch_dist", version: int = 1) -> SaveShardedStrategy:
    """The save strategy for ``(backend, version)``: shardsafe's, for ``"torch_dist"`` and ``"shardsafe"``."""
    return get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)


def get_default_save_common_strategy(backend: str = "torch", version: int = 1) -> None:
    """None: shardsafe.megatron stores the common state itself (pass ``common_strategy=None``)."""
    return None


@megatron_errors
def get_default_load_sharded_strategy(checkpoint_dir: str | Path) -> LoadShardedStrategy:
    """The load strategy for the checkpoint at ``checkpoint_dir``."""
    return verify_checkpoint_and_load_strategy(checkpoint_dir)[0]


def _save_strategy(sharded_strategy: Any) -> ShardsafeSaveShardedStrategy:
    if sharded_strategy is None:
        sharded_strategy = get_default_save_sharded_strategy()
    elif isinstance(sharded_strategy, tuple):
        sharded_strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, *sharded_strategy)
    if not isinstance(sharded_strategy, ShardsafeSaveShardedStrategy):
        raise CheckpointingException(
            f"sharded_strategy {sharded_strategy} is not supported: shardsafe.megatron saves with "
            "shardsafe.megatron.strategies.ShardsafeSaveShardedStrategy (the default, also for ('torch_dist', 1))"
        )
    return sharded_strategy
