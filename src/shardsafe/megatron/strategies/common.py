"""Megatron-Core's ``strategies.common`` names, and the readers of Megatron-Core's own pickled files.

Megatron-Core keeps a checkpoint's common state in ``common.pt`` (pickle, through ``torch.save``)
and its ShardedObjects in ``.pt`` files. shardsafe.megatron keeps both in ``metadata.json`` as
JSON (read ``load_common_state_dict``), so the common strategies have nothing to register; a
``common.pt`` of a megatron-core checkpoint, and the ShardedObjects of its ``torch_dist``
checkpoints, are still read (safely: :mod:`shardsafe.format.safe_pickle`) when one is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

from ...dcp import distcp
from ...engine.bounds import StoredFile
from ...errors import CheckpointError, PickleNotAllowedError
from ...format import safe_pickle
from ...storage import Storage, open_storage
from ..core import CheckpointingException, location
from ..mapping import StateDict

__all__ = [
    "COMMON_FNAME",
    "COMMON_STATE_FNAME",
    "is_torch_dist_checkpoint",
    "read_common_pt",
    "read_sharded_object",
    "register_default_common_strategies",
    "safe_torch_load",
]


COMMON_FNAME = "common.pt"


def safe_torch_load(raw: bytes | BinaryIO, where: str, *, allow_pickle: bool, strategy: str, opt_in: str | None = None) -> Any:
    """What ``torch.save`` wrote in ``raw`` (its bytes, or a seekable file of them), read by
    :func:`shardsafe.format.safe_pickle.load_value_file` (megatron-core's safe globals); a pickle
    that names any other global raises ``CheckpointingException`` naming it unless
    ``allow_pickle``, ending with ``opt_in`` (by default: pass ``sharded_strategy=<strategy>(allow_pickle=True)``)."""
    if opt_in is None:
        opt_in = f"Pass sharded_strategy={strategy}(allow_pickle=True) only if you trust this checkpoint"
    try:
        return safe_pickle.load_value_file(raw, where=where, allow_pickle=allow_pickle, opt_in=opt_in)
    except PickleNotAllowedError as e:
        raise CheckpointingException(str(e)) from None
    except CheckpointError as e:  # a damaged file
        raise CheckpointingException(str(e)) from None


def read_common_pt(checkpoint_dir: str | Path | Storage, *, allow_pickle: bool, strategy: str, opt_in: str | None = None) -> StateDict:
    """Megatron's ``common.pt`` in ``checkpoint_dir`` (``{}`` if there is none); see :func:`safe_torch_load`."""
    storage = open_storage(location(checkpoint_dir))
    where = f"{storage.url.rstrip('/')}/{COMMON_FNAME}"  # the location, also when given a Storage
    try:
        if COMMON_FNAME not in storage.list():
            return {}
        # streamed: torch reads the parts of the archive it needs, whatever size the file claims
        common = safe_torch_load(StoredFile(storage, COMMON_FNAME), where, allow_pickle=allow_pickle, strategy=strategy, opt_in=opt_in)
    finally:
        if storage is not checkpoint_dir:
            storage.close()
    if not isinstance(common, dict):
        raise CheckpointingException(f"{where} holds a {type(common).__name__}, not a dict")
    return common


def read_sharded_object(storage: Storage, item: distcp.DcpItem, where: str, *, allow_pickle: bool, strategy: str, opt_in: str | None = None) -> Any:
    """The value of the ShardedObject stored as ``item`` (see :func:`safe_torch_load`)."""
    stored = safe_torch_load(bytes(distcp.read_item(storage, item)), where, allow_pickle=allow_pickle, strategy=strategy, opt_in=opt_in)
    if not isinstance(stored, list) or not stored:  # Megatron saves [value] (the values of the cell's holders on one rank)
        raise CheckpointingException(f"{where}: holds a {type(stored).__name__}, not the one-item list megatron-core stores")
    return stored[0]


def is_torch_dist_checkpoint(checkpoint_dir: str | Path | Storage) -> bool:
    """True if ``checkpoint_dir`` holds DCP's ``.metadata`` (a torch_dist checkpoint)."""
    storage = open_storage(location(checkpoint_dir))
    try:
        return distcp.DCP_METADATA in storage.list()
    finally:
        if storage is not checkpoint_dir:
            storage.close()


COMMON_STATE_FNAME = COMMON_FNAME
"""The file megatron-core writes the common state to (``common.pt``)."""


def register_default_common_strategies() -> None:
    """Nothing to register: shardsafe's sharded strategy saves and loads the common state too."""
