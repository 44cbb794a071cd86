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

import errno
import re
from typing import TYPE_CHECKING

from ..errors import CheckpointError, ForeignCheckpointError, IncompleteCheckpointError
from ..format.metadata import megatron_advice
from ..storage.base import DCP_METADATA

if TYPE_CHECKING:
    from ..storage import Storage

__all__ = ["missing_metadata_error", "source_format"]

LIGHTNING_META = "meta.pt"
MEGATRON_COMMON = "common.pt"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
_OUR_DATA_FILE = re.compile(r"shard-r\d+-[0-9a-f]+\.safetensors")  # docs/format.md §2, what a save of ours leaves
_TRACKER_BYTES = 64  # "release" or an iteration number


def missing_metadata_error(storage: Storage, metadata_name: str, cause: OSError | None = None) -> CheckpointError:
    """The error for ``storage`` holding no ``metadata_name`` (shardsafe's commit record):
    :class:`ForeignCheckpointError` naming the format and its way in when it holds another
    library's checkpoint, else :class:`IncompleteCheckpointError`: a save that never committed,
    a folder that is no checkpoint (saying what it holds), a location that does not exist.
    ``cause``: the error reading ``metadata_name`` raised (a local location that does not exist,
    or is a file, says so there)."""
    url = storage.url.rstrip("/")
    name = url.rsplit("/", 1)[-1]
    if name.endswith(".safetensors") or name.endswith(".safetensors.index.json"):
        return _hf(url, f"a Hugging Face safetensors {'index' if name.endswith('.json') else 'file'}")
    root = cause is not None and (cause.filename or "").rstrip("/") == url
    if root and cause.errno == errno.ENOTDIR:
        return _single_file(url)
    if root and cause.errno == errno.ENOENT:
        return IncompleteCheckpointError(f"{url}: no such checkpoint: the directory does not exist (is the path mistyped?)")
    files = storage.list()
    names = set(files)
    if MEGATRON_TRACKER in names:
        return _megatron_root(storage, url)
    if MEGATRON_COMMON in names:
        backend = "torch_dist" if DCP_METADATA in names else "zarr"
        return _tagged(ForeignCheckpointError(
            f"{url}: this is a checkpoint Megatron-Core's dist_checkpointing wrote ({MEGATRON_COMMON}; backend {backend}), "
            f"not a shardsafe one (no {metadata_name}): {megatron_advice(url)}"
        ), "megatron")
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
        return _tagged(ForeignCheckpointError(
            f"{url}: this is a {what}, not a shardsafe one (no {metadata_name}): convert it with shardsafe.dcp.convert({url!r}, dst) "
            f"or `shardsafe convert {url} DST --from dcp`, or load it as it is with "
            f"dcp.load(state_dict, storage_reader=shardsafe.dcp.StorageReader({url!r})){extra}"
        ), "dcp")
    hf = [f for f in files if f.endswith(".safetensors.index.json") or (f.endswith(".safetensors") and not _OUR_DATA_FILE.fullmatch(f))]
    if hf and not any(_OUR_DATA_FILE.fullmatch(f) for f in files):
        return _hf(url, f"a Hugging Face safetensors model ({', '.join(hf[:3])}{', ...' if len(hf) > 3 else ''})")
    if not files:
        return IncompleteCheckpointError(
            f"{url}: not a checkpoint: nothing is there (an empty directory, or no object under this prefix); "
            f"a checkpoint holds {metadata_name} and its data files"
        )
    if not any(_OUR_DATA_FILE.fullmatch(f) or f.startswith(metadata_name) for f in files):
        shown = ", ".join(files[:5]) + (", ..." if len(files) > 5 else "")
        kinds = sorted({f.rsplit(".", 1)[-1] if "." in f else "(no extension)" for f in files})
        return IncompleteCheckpointError(
            f"{url}: not a checkpoint: it holds {len(files)} file(s) ({shown}; kinds: {', '.join(kinds)}) and none of "
            f"a checkpoint's: no {metadata_name} and no shard-r*.safetensors data file. Point at the directory a save "
            "wrote (it holds metadata.json)"
        )
    return IncompleteCheckpointError(
        f"{url}: not a committed checkpoint: it holds {len(files)} file(s) but has no {metadata_name} "
        "(was the save interrupted before it committed?)"
    )


_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


def source_format(location: str) -> str:
    """What ``shardsafe convert`` reads at ``location``: ``"dcp"``, ``"megatron"``, ``"torch"``
    (a ``torch.save`` file) or ``"hf"``, told apart as :func:`missing_metadata_error` tells them
    apart for ``inspect``. Raises :class:`CheckpointError` for a shardsafe checkpoint (nothing to
    convert) or a location of none of these kinds (naming ``--from``)."""
    from ..storage import open_storage  # the storage layer opens it; this module only reads what it lists

    storage = open_storage(location)
    try:
        storage.read("metadata.json")
    except FileNotFoundError as e:
        error = missing_metadata_error(storage, "metadata.json", e)
    else:
        raise CheckpointError(
            f"{storage.url}: this is a shardsafe checkpoint already (it holds metadata.json): nothing to convert; "
            "inspect, verify and export read it as it is"
        )
    kind = getattr(error, "source_format", None)
    if kind is None:
        raise CheckpointError(f"{error}; cannot tell what to convert from: pass --from dcp, megatron, torch or hf")
    return kind


def _single_file(url: str) -> CheckpointError:
    """``url`` is a local file, not a directory: a ``torch.save`` file is named as such."""
    head = b""
    try:
        with open(url, "rb") as f:  # a local file (only LocalStorage reports ENOTDIR): its first bytes name its format
            head = f.read(512)
    except OSError:
        pass
    if head.startswith(_ZIP_MAGIC) and b"data.pkl" in head or head.startswith(_PICKLE_MAGIC):
        kind = "a zip archive holding data.pkl" if head.startswith(_ZIP_MAGIC) else "a pickle"
        return _tagged(ForeignCheckpointError(
            f"{url}: this is a torch.save file ({kind}), not a shardsafe checkpoint (a directory with metadata.json): "
            f"convert it with `shardsafe convert {url} DST --from torch` or shardsafe.convert.convert_torch({url!r}, dst)"
            " (read with torch.load(weights_only=True); nothing else is unpickled)"
        ), "torch")
    return IncompleteCheckpointError(f"{url}: not a checkpoint: it is a file, and a checkpoint is a directory holding metadata.json")


def _tagged(error: ForeignCheckpointError, kind: str) -> ForeignCheckpointError:
    error.source_format = kind  # what `shardsafe convert --from` calls it
    return error


def _hf(url: str, what: str) -> ForeignCheckpointError:
    return _tagged(ForeignCheckpointError(
        f"{url}: this is {what}, not a shardsafe checkpoint: load it into a model with shardsafe.load_hf_safetensors({url!r}, model), "
        f"or convert it with shardsafe.convert.convert_hf({url!r}, dst) or `shardsafe convert {url} DST --from hf`"
    ), "hf")


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
        return _tagged(ForeignCheckpointError(
            f"{url}: this is the root of a Megatron run ({MEGATRON_TRACKER} holds {text!r}, not an iteration): "
            f"point at one of its iter_* folders and {megatron_advice(url + '/iter_NNNNNNN')}"
        ), "megatron")
    src = f"{url}/{newest}"
    return _tagged(ForeignCheckpointError(
        f"{url}: this is the root of a Megatron run, not a checkpoint: its newest checkpoint ({MEGATRON_TRACKER}: {text}) "
        f"is {src}; {megatron_advice(src)}"
    ), "megatron")
