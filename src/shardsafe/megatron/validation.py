"""Sharding integrity, load strictness and the choice of load strategy, as in
``megatron.core.dist_checkpointing.validation``.

The checks themselves live in :mod:`shardsafe.megatron.integrity`, below the strategies that run
them; this module adds what needs the strategies: :func:`verify_checkpoint_and_load_strategy`
(Megatron-Core's tools import it from here) and the choice of the strategy that reads a
checkpoint, which :mod:`shardsafe.megatron.serialization` uses too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..dcp.distcp import DCP_METADATA
from .core import (
    SHARDSAFE_BACKEND,
    CheckpointingConfig,
    CheckpointingException,
    config_from_document,
    maybe_load_config,
    megatron_errors,
    opened,
)
from .integrity import (
    StrictHandling,
    adjust_non_strict_load,
    check_global_sharding,
    describe_local,
    determine_global_metadata,
    maybe_report_missing_and_unexpected_keys,
    parse_strict_flag,
    validate_sharding_integrity,
)
from .strategies.base import LoadCommonStrategy, LoadShardedStrategy, StrategyAction, get_default_strategy
from .strategies.common import COMMON_FNAME
from .strategies.native import ShardsafeLoadShardedStrategy, location, read_metadata
from .strategies.torch_dist import TorchDistLoadShardedStrategy
from .strategies.zarr import ZarrLoadShardedStrategy

__all__ = [
    "StrictHandling",
    "adjust_non_strict_load",
    "check_global_sharding",
    "config_of",
    "describe_local",
    "determine_global_metadata",
    "is_megatron_checkpoint",
    "load_strategy",
    "maybe_report_missing_and_unexpected_keys",
    "megatron_reader",
    "parse_strict_flag",
    "reads_torch_dist",
    "strategy_for_dir",
    "validate_sharding_integrity",
    "verify_checkpoint_and_load_strategy",
]


def megatron_reader(checkpoint_dir: Any) -> TorchDistLoadShardedStrategy | None:
    """The strategy that reads the checkpoint megatron-core's own ``torch_dist`` (DCP files and
    Megatron's config) or ``zarr`` backend wrote at ``checkpoint_dir``; None for any other."""
    with opened(location(checkpoint_dir)) as storage:
        files = storage.list()
    # a listing first: a shardsafe checkpoint's metadata.json (it may be large) is not read here
    torch_dist = DCP_METADATA in files
    if not torch_dist and (COMMON_FNAME not in files or any(f.endswith(".safetensors") for f in files)):
        return None
    config = maybe_load_config(location(checkpoint_dir))
    if config is None:
        return None
    if config.sharded_backend == "torch_dist" and torch_dist:
        return TorchDistLoadShardedStrategy()
    if config.sharded_backend == "zarr":
        return ZarrLoadShardedStrategy()
    return None


def is_megatron_checkpoint(checkpoint_dir: Any) -> bool:
    """True for a checkpoint megatron-core's torch_dist or zarr backend wrote."""
    return megatron_reader(checkpoint_dir) is not None


def reads_torch_dist(strategy: Any) -> bool:
    """Whether ``strategy`` (or the strategy it wraps) reads megatron-core torch_dist checkpoints."""
    return isinstance(strategy, TorchDistLoadShardedStrategy) or isinstance(getattr(strategy, "base_strategy", None), TorchDistLoadShardedStrategy)


def strategy_for_dir(checkpoint_dir: Any, sharded_strategy: Any) -> Any:
    """``sharded_strategy``, or for None the strategy that reads the checkpoint at ``checkpoint_dir``."""
    if sharded_strategy is None:
        return megatron_reader(checkpoint_dir)
    return sharded_strategy


def config_of(meta: Any) -> CheckpointingConfig:
    """The :class:`CheckpointingConfig` of a shardsafe checkpoint's metadata (see
    :func:`~shardsafe.megatron.core.config_from_document`)."""
    return config_from_document({"format_version": meta.format_version, "objects": meta.objects})  # type: ignore[return-value]


@megatron_errors
def verify_checkpoint_and_load_strategy(
    checkpoint_dir: str | Path,
    sharded_strategy: LoadShardedStrategy | tuple[str, int] | None = None,
    common_strategy: LoadCommonStrategy | tuple[str, int] | None = None,
) -> tuple[LoadShardedStrategy, LoadCommonStrategy]:
    """The strategies that load the checkpoint at ``checkpoint_dir`` (shardsafe's strategy loads
    both parts), after checking that it is a checkpoint they read."""
    strategy = load_strategy(strategy_for_dir(checkpoint_dir, sharded_strategy), common_strategy)
    if reads_torch_dist(strategy):
        config = maybe_load_config(location(checkpoint_dir))
        if config is None or not is_megatron_checkpoint(checkpoint_dir):
            raise CheckpointingException(
                f"{checkpoint_dir} is not a megatron-core torch_dist or zarr checkpoint (no Megatron metadata.json, or a "
                "torch_dist one without .metadata)"
            )
    else:
        config = config_of(read_metadata(checkpoint_dir, no_dist=True))
    strategy.check_backend_compatibility(config.sharded_backend)
    strategy.check_version_compatibility(config.sharded_backend_version)
    return strategy, strategy


def load_strategy(sharded_strategy: Any, common_strategy: Any) -> ShardsafeLoadShardedStrategy:
    if common_strategy is not None and common_strategy is not sharded_strategy:
        raise CheckpointingException(
            f"common_strategy {common_strategy!r} is not supported: the sharded strategy loads the common state; pass None"
        )
    if sharded_strategy is None:
        sharded_strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, SHARDSAFE_BACKEND, 1)
    elif isinstance(sharded_strategy, tuple):
        sharded_strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, *sharded_strategy)
    if not isinstance(sharded_strategy, ShardsafeLoadShardedStrategy):
        raise CheckpointingException(
            f"sharded_strategy {sharded_strategy!r} is not supported: shardsafe.megatron loads with "
            "shardsafe.megatron.strategies.ShardsafeLoadShardedStrategy (the default)"
        )
    return sharded_strategy
