"""What a location without shardsafe's ``metadata.json`` holds, and the way in for it.

Such a location is a shardsafe save that never committed, or a checkpoint another library wrote:
torch.distributed.checkpoint (``.metadata`` and ``__*_*.distcp`` files; Lightning's sharded
folders add ``meta.pt``), a Hugging Face safetensors model (``model.safetensors``,
``*.safetensors.index.json``, or one ``.safetensors`` file named as the location), or
Megatron (an ``iter_*`` folder with ``common.pt``, or the root of a run holding
``latest_checkpointed_iteration.txt``). :func:`missing_metadata_error` tells them apart from the
location's name and one listing of it (so it works for object stores too) and names the format
and the function or command that converts or loads it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from ..errors import CheckpointError, ForeignCheckpointError, IncompleteCheckpointError
from ..format.metadata import megatron_advice
from ..storage.base import DCP_METADATA

if TYPE_CHECKING:
    from ..storage import Storage

__all__ = ["missing_metadata_error"]

LIGHTNING_META = "meta.pt"
MEGATRON_COMMON = "common.pt"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
_OUR_DATA_FILE = re.compile(r"shard-r\d+-[0-9a-f]+\.safetensors")  # docs/format.md §2, what a save of ours leaves
_TRACKER_BYTES = 64  # "release" or an iteration number


def missing_metadata_error(storage: Storage, metadata_name: str) -> CheckpointError:
    """The error for ``storage`` holding no ``metadata_name`` (shardsafe's commit record):
    :class:`ForeignCheckpointError` naming the format and its way in when it holds another
    library's checkpoint, else :class:`IncompleteCheckpointError` (a save that never committed,
    or nothing)."""
    url = storage.url.rstrip("/")
    name = url.rsplit("/", 1)[-1]
    if name.endswith(".safetensors") or name.endswith(".safetensors.index.json"):
        return _hf(url, f"a Hugging Face safetensors {'index' if name.endswith('.json') else 'file'}")
    files = storage.list()
    names = set(files)
    if MEGATRON_TRACKER in names:
        return _megatron_root(storage, url)
    if MEGATRON_COMMON in names:
        backend = "torch_dist" if DCP_METADATA in names else "zarr"
        return ForeignCheckpointError(
            f"{url}: this is a checkpoint Megatron-Core's dist_checkpointing wrote ({MEGATRON_COMMON}; backend {backend}), "
            f"not a shardsafe one (no {metadata_name}): {megatron_advice(url)}"
        )
    if DCP_METADATA in names:
        shards = sum(f.endswith(".distcp") for f in files)
        what = f"torch.distributed.checkpoint (DCP) checkpoint ({DCP_METADATA} and {shards} .distcp file(s))"
        extra = ""
        if LIGHTNING_META in names:
            what = f"Lightning sharded checkpoint (a {what} with Lightning's {LIGHTNING_META})"
            extra = (
                f"; shardsafe.lightning's strategies resume from it with ckpt_path=, and shardsafe.lightning.consolidate({url!r}, out) "
                "writes Lightning's single-file checkpoint of it"
            )
        return ForeignCheckpointError(
            f"{url}: this is a {what}, not a shardsafe one (no {metadata_name}): convert it with shardsafe.dcp.convert({url!r}, dst) "
            f"or `shardsafe convert {url} DST --from dcp`, or load it as it is with "
            f"dcp.load(state_dict, storage_reader=shardsafe.dcp.StorageReader({url!r})){extra}"
        )
    hf = [f for f in files if f.endswith(".safetensors.index.json") or (f.endswith(".safetensors") and not _OUR_DATA_FILE.fullmatch(f))]
    if hf and not any(_OUR_DATA_FILE.fullmatch(f) for f in files):
        return _hf(url, f"a Hugging Face safetensors model ({', '.join(hf[:3])}{', ...' if len(hf) > 3 else ''})")
    state = f"it holds {len(files)} file(s) but" if files else "it is empty or missing, and"
    return IncompleteCheckpointError(
        f"{url}: not a committed checkpoint: {state} has no {metadata_name} (was the save interrupted before it committed?)"
    )


def _hf(url: str, what: str) -> ForeignCheckpointError:
    return ForeignCheckpointError(
        f"{url}: this is {what}, not a shardsafe checkpoint: load it into a model with shardsafe.load_hf_safetensors({url!r}, model), "
        f"or convert it with shardsafe.convert.convert_hf({url!r}, dst) or `shardsafe convert {url} DST --from hf`"
    )


def _megatron_root(storage: Storage, url: str) -> ForeignCheckpointError:
    """A Megatron run's root: its newest checkpoint is the folder its tracker file names."""
    try:
        text = storage.read(MEGATRON_TRACKER)[:_TRACKER_BYTES].decode("ascii", "replace").strip()
    except (OSError, CheckpointError):
        text = ""
    if text == "release":
        newest = "release"
    elif text.isdigit():
        newest = f"iter_{int(text):07d}"  # Megatron-LM's checkpoint folder name
    else:
        return ForeignCheckpointError(
            f"{url}: this is the root of a Megatron run ({MEGATRON_TRACKER} holds {text!r}, not an iteration): "
            f"point at one of its iter_* folders and {megatron_advice(url + '/iter_NNNNNNN')}"
        )
    src = f"{url}/{newest}"
    return ForeignCheckpointError(
        f"{url}: this is the root of a Megatron run, not a checkpoint: its newest checkpoint ({MEGATRON_TRACKER}: {text}) "
        f"is {src}; {megatron_advice(src)}"
    )
