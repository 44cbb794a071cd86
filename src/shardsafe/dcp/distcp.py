"""Reading checkpoints that torch.distributed.checkpoint wrote (``FileSystemWriter``, and the
fsspec writer: a ``.metadata`` file beside ``__<rank>_<n>.distcp`` data files), without running
foreign code.

``.metadata`` is a pickle of DCP's ``Metadata``. It is read by shardsafe's one restricted
unpickler (:mod:`shardsafe.format.safe_pickle`) with :data:`METADATA_GLOBALS`, which admits only
DCP's own metadata classes, the torch types they hold (``torch.Size``, dtypes, layouts) and
``pathlib`` paths; any other class or function is refused with
:class:`~shardsafe.errors.UnsafePickleError` naming it, before anything of it runs. The result
is then checked field by field (types, sizes, plain file names), so the rest of the code can
trust it.

Each stored item is a byte range of a data file: a tensor chunk as a ``torch.save`` archive, read
by the same unpickler with :data:`~shardsafe.format.safe_pickle.TENSORS`; a non-tensor value as
``torch.save`` of the object, read with :data:`~shardsafe.format.safe_pickle.VALUES` (plain
containers, scalars, numpy arrays, ``argparse.Namespace``...), and with the full unpickler only
when the caller opted in. DCP stores no checksums: what these files hold is checked for
form (an archive, the dtype and shape the metadata names), not for damage.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from ..engine.bounds import StoredFile, read_range
from ..errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from ..format import safe_pickle
from ..storage import Storage
from ..storage.base import DCP_METADATA, check_name

__all__ = [
    "DCP_METADATA",
    "DcpCheckpoint",
    "DcpItem",
    "METADATA_GLOBALS",
    "check_dcp_metadata",
    "check_files_hold",
    "checkpoint_error_of",
    "load_dcp_metadata",
    "load_tensor",
    "load_value",
    "read_dcp_checkpoint",
    "read_item",
]

_DCP_META = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, tuple[str, ...]] = {
    _DCP_META: (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    # the save plans megatron-core's torch_dist backend keeps in .metadata (MCoreMetadata.all_local_plans)
    "torch.distributed.checkpoint.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
    # DCP of torch < 2.2 kept TensorProperties here
    "torch.distributed._shard.sharded_tensor.metadata": ("TensorProperties", "MEM_FORMAT_ENCODING"),
    "torch.serialization": ("_get_layout",),  # a layout by name: torch.strided
    "pathlib": ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"),  # StorageMeta.checkpoint_id
    "pathlib._local": ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"),  # Python >= 3.13
    "collections": ("OrderedDict",),
}
_ZIP_MAGIC = safe_pickle.ZIP_MAGIC  # torch.save's archive format


_MCORE_TORCH = "megatron.core.dist_checkpointing.strategies.torch"


_MCORE_CLASSES: dict[str, type] = {}


def _mcore_class(name: str) -> type:
    """Stand-ins for megatron-core's ``MCoreMetadata`` and ``MCoreSavePlan`` (DCP's ``Metadata``
    and ``SavePlan`` plus ``mcore_data``, what Megatron's ``torch_dist`` backend writes to
    ``.metadata``), so that reading it needs no megatron-core and runs none of its code."""
    if not _MCORE_CLASSES:
        from dataclasses import dataclass

        from torch.distributed.checkpoint.metadata import Metadata
        from torch.distributed.checkpoint.planner import SavePlan

        @dataclass
        class MCoreMetadata(Metadata):
            mcore_data: dict | None = None

        @dataclass(frozen=True)
        class MCoreSavePlan(SavePlan):
            mcore_data: dict | None = None

        _MCORE_CLASSES.update(MCoreMetadata=MCoreMetadata, MCoreSavePlan=MCoreSavePlan)
    return _MCORE_CLASSES[name]


def _metadata_globals() -> dict[str, Any]:
    out: dict[str, Any] = {f"{module}.{name}": safe_pickle.global_named(module, name) for module, names in _ALLOWED.items() for name in names}
    out.update(safe_pickle.DTYPES, **{"torch.Size": safe_pickle.TENSORS["torch.Size"]})
    for name in ("MCoreMetadata", "MCoreSavePlan"):
        out[f"{_MCORE_TORCH}.{name}"] = (lambda n: lambda: _mcore_class(n))(name)
    return out


METADATA_GLOBALS: safe_pickle.Allowlist = _metadata_globals()
"""The globals a DCP ``.metadata`` pickle may name: DCP's metadata classes, the torch types they
hold (``torch.Size``, dtypes, layouts), paths, and megatron-core's metadata (as stand-ins)."""


def load_dcp_metadata(raw: bytes | StoredFile, *, where: str) -> Any:
    """DCP's ``Metadata`` from ``.metadata`` (its bytes, or a stream of them), unpickled with
    :data:`METADATA_GLOBALS` and checked (raises ``UnsafePickleError`` or ``CorruptCheckpointError``)."""
    from torch.distributed.checkpoint.metadata import Metadata

    meta = safe_pickle.load_pickle(raw, where=where, allowed=METADATA_GLOBALS, what="a torch.distributed.checkpoint metadata file")
    if not isinstance(meta, Metadata):
        raise CorruptCheckpointError(f"{where}: holds a {type(meta).__name__}, not a torch.distributed.checkpoint Metadata")
    return meta


@dataclass(frozen=True, slots=True)
class DcpItem:
    """Where one stored item of a DCP checkpoint lies."""

    key: str
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpCheckpoint:
    """A DCP checkpoint's metadata, checked, with each stored item's location."""

    metadata: Any  # torch.distributed.checkpoint.metadata.Metadata
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...], DcpItem]]]]
    """key -> (dtype, global shape, [(chunk offsets, chunk sizes, where)])"""
    values: dict[str, DcpItem]
    """key -> where the ``torch.save`` of a non-tensor value lies"""
    where: str


def read_dcp_checkpoint(storage: Storage, raw: bytes | None = None) -> DcpCheckpoint:
    """Read and check the DCP checkpoint at ``storage`` (``raw``: the bytes of ``.metadata``, if read already)."""
    where = f"{storage.url.rstrip('/')}/{DCP_METADATA}"
    if raw is None:
        listed = storage.list()
        if DCP_METADATA not in listed:
            state = f"it holds {len(listed)} file(s) but" if listed else "it is empty or missing, and"
            hint = "; it is a shardsafe checkpoint already" if "metadata.json" in listed else ""
            raise IncompleteCheckpointError(
                f"{storage.url}: not a torch.distributed.checkpoint checkpoint: {state} has no {DCP_METADATA}{hint}"
            )
    return check_dcp_metadata(load_dcp_metadata(StoredFile(storage, DCP_METADATA) if raw is None else raw, where=where), where=where)


def check_dcp_metadata(meta: Any, *, where: str) -> DcpCheckpoint:
    """Check every field this package uses, so that what it reads is well formed."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: invalid torch.distributed.checkpoint metadata: {msg}")

    sdm = getattr(meta, "state_dict_metadata", None)
    storage_data = getattr(meta, "storage_data", None)
    if not isinstance(sdm, dict):
        raise bad("state_dict_metadata is not a dict")
    if not isinstance(storage_data, dict):
        raise bad("storage_data is not a dict (rank-local metadata, or a storage plugin other than DCP's file system writers)")
    locations: dict[tuple[str, tuple[int, ...] | None], DcpItem] = {}
    for index, info in storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            raise bad(f"a storage_data key is a {type(index).__name__}, not a MetadataIndex")
        offset = None if index.offset is None else _ints(index.offset, bad, f"key {index.fqn!r}: offset")
        locations[(index.fqn, offset)] = _location(index.fqn, info, bad)
    _check_disjoint(locations.values(), bad)
    tensors: dict[str, Any] = {}
    values: dict[str, DcpItem] = {}
    for key, md in sdm.items():
        if not isinstance(key, str) or not key:
            raise bad(f"a key is {key!r}, not a non-empty string")
        if isinstance(md, BytesStorageMetadata):
            found = locations.get((key, None))
            if found is None:
                raise bad(f"value {key!r} has no stored bytes in storage_data")
            values[key] = found
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise bad(f"key {key!r}: a {type(md).__name__}, not tensor or bytes metadata")
        dtype = getattr(md.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise bad(f"key {key!r}: dtype is {dtype!r}")
        shape = _ints(md.size, bad, f"key {key!r}: size")
        chunks = []
        if not isinstance(md.chunks, list):
            raise bad(f"key {key!r}: chunks is not a list")
        for c in md.chunks:
            off = _ints(getattr(c, "offsets", None), bad, f"key {key!r}: chunk offsets")
            lens = _ints(getattr(c, "sizes", None), bad, f"key {key!r}: chunk sizes")
            if len(off) != len(shape) or len(lens) != len(shape) or any(o + n > s for o, n, s in zip(off, lens, shape)):
                raise bad(f"key {key!r}: chunk at {list(off)} of size {list(lens)} does not lie inside shape {list(shape)}")
            found = locations.get((key, off))
            if found is None:
                raise bad(f"key {key!r}: the chunk at {list(off)} has no stored bytes in storage_data")
            if found.length < prod(lens) * dtype.itemsize:  # torch.save stores a tensor's bytes uncompressed
                raise bad(
                    f"key {key!r}: the chunk at {list(off)} of size {list(lens)} holds {prod(lens) * dtype.itemsize} bytes of "
                    f"{dtype}, but its stored item ({found.file} bytes [{found.offset}, {found.offset + found.length})) is shorter"
                )
            chunks.append((off, lens, found))
        tensors[key] = (dtype, shape, chunks)
    return DcpCheckpoint(meta, tensors, values, where)


def _check_disjoint(items: Any, bad) -> None:
    """Stored items of one file must not share bytes (DCP writes them one after another): then
    the items of a file are never more bytes than the file holds, whatever the lengths say."""
    by_file: dict[str, list[DcpItem]] = {}
    for it in set(items):
        if it.length:
            by_file.setdefault(it.file, []).append(it)
    for file, its in by_file.items():
        its.sort(key=lambda it: it.offset)
        for a, b in zip(its, its[1:]):
            if b.offset < a.offset + a.length:
                raise bad(
                    f"items {a.key!r} (bytes [{a.offset}, {a.offset + a.length})) and {b.key!r} (bytes [{b.offset}, "
                    f"{b.offset + b.length})) of {file} overlap"
                )


def check_files_hold(storage: Storage, ckpt: DcpCheckpoint) -> None:
    """``CorruptCheckpointError`` (truncated, or missing) unless every data file is as long as
    the items stored in it say: one 1-byte read per file. With :func:`check_dcp_metadata`'s
    checks (items of a file disjoint, each at least its chunk's bytes), this bounds what the
    metadata's shapes can make a reader allocate by what the files hold."""
    ends: dict[str, DcpItem] = {}
    for it in [*ckpt.values.values(), *(item for _, _, chunks in ckpt.tensors.values() for _, _, item in chunks)]:
        if it.length and it.offset + it.length > (ends[it.file].offset + ends[it.file].length if it.file in ends else 0):
            ends[it.file] = it
    probe = memoryview(bytearray(1))
    for file, it in sorted(ends.items()):
        try:
            storage.read_into(file, it.offset + it.length - 1, [probe])
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{ckpt.where}: key {it.key!r}: {e}") from None


def _ints(v: Any, bad, what: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or not all(type(x) is int and 0 <= x < (1 << 62) for x in v) or len(v) > 64:
        raise bad(f"{what} is {v!r}, not a sequence of non-negative integers")
    return tuple(v)


def _location(key: str, info: Any, bad) -> DcpItem:
    path = getattr(info, "relative_path", None)
    offset = getattr(info, "offset", None)
    length = getattr(info, "length", None)
    if not isinstance(path, str) or "\x00" in path:  # (a NUL makes os.open raise ValueError)
        raise bad(f"key {key!r}: relative_path is {path!r}")
    try:
        check_name(path)
    except Exception:  # noqa: BLE001 - StorageError: a name with a directory part or '..'
        raise bad(f"key {key!r}: data file {path!r} is not a plain file name inside the checkpoint; refusing to read it") from None
    if path == DCP_METADATA:
        raise bad(f"key {key!r}: names the metadata file as its data file")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 or offset + length >= 1 << 62:
        raise bad(f"key {key!r}: byte range offset={offset!r} length={length!r}")
    transforms = getattr(info, "transform_descriptors", None)
    if transforms:
        raise CorruptCheckpointError(
            f"{key!r} in {path}: stored through DCP stream extensions {list(transforms)} (e.g. compression), which "
            "shardsafe does not read; load it with torch.distributed.checkpoint.FileSystemReader and save it with shardsafe"
        )
    return DcpItem(key, path, offset, length)


def read_item(storage: Storage, item: DcpItem) -> bytearray:
    """The stored bytes of one item (``CorruptCheckpointError`` if its file is shorter, found
    before memory for the item is allocated)."""
    return read_range(storage, item.file, item.offset, item.length)


def load_tensor(buf: bytearray, item: DcpItem, dtype: torch.dtype, sizes: tuple[int, ...], where: str) -> torch.Tensor:
    """The tensor chunk a ``torch.save`` archive holds, checked against the metadata."""
    name = f"{where}: key {item.key!r}, {item.file} bytes [{item.offset}, {item.offset + item.length})"
    if bytes(buf[:4]) != _ZIP_MAGIC:
        raise CorruptCheckpointError(
            f"{name}: not a torch.save archive (DCP checkpoints written with serialization_format=SAFETENSORS or by "
            "other storage plugins are not read); the file may be damaged"
        )
    t = safe_pickle.load_archive(buf, where=name, allowed=safe_pickle.TENSORS, what="a torch.distributed.checkpoint tensor chunk")
    if type(t) is not torch.Tensor:
        raise CorruptCheckpointError(f"{name}: holds a {type(t).__name__}, not a tensor")
    if t.dtype != dtype or tuple(t.shape) != sizes:
        raise CorruptCheckpointError(
            f"{name}: holds a {t.dtype} tensor of shape {list(t.shape)}, the metadata says {dtype} of shape {list(sizes)}"
        )
    return t


def load_value(buf: bytearray, item: DcpItem, where: str, *, allow_pickle: bool) -> Any:
    """The non-tensor value of one item, read by :func:`shardsafe.format.safe_pickle.load_value_file`
    (the full unpickler only with ``allow_pickle``; ``PickleNotAllowedError`` otherwise)."""
    name = f"{where}: value {item.key!r} ({item.file} bytes [{item.offset}, {item.offset + item.length}))"
    return safe_pickle.load_value_file(buf, where=name, allow_pickle=allow_pickle, opt_in="Pass allow_pickle=True only if you trust this checkpoint")


def checkpoint_error_of(e: BaseException, where: str) -> CheckpointError:
    """The :class:`CheckpointError` for torch's ``CheckpointException`` (a ``BaseException``
    that torch.distributed.checkpoint raises for what failed on any rank): the error a rank
    raised, when it was shardsafe's, else a ``CorruptCheckpointError`` naming each rank's cause.
    Called where shardsafe's own API runs DCP's load machinery, so that only its hierarchy escapes."""
    failures = getattr(e, "failures", None) or {}
    causes = {rank: getattr(f, "exception", f) for rank, f in failures.items()}
    ours = [c for c in causes.values() if isinstance(c, CheckpointError)]
    if ours and len(ours) == len(causes):
        return ours[0]
    detail = {rank: f"{type(c).__name__}: {str(c)[:300]}" for rank, c in sorted(causes.items())}
    first = next(iter(detail.values()), f"{type(e).__name__}: {str(e)[:300]}")
    return CorruptCheckpointError(f"{where}: torch.distributed.checkpoint could not read it: {first}", rank_errors=detail)


LIGHTNING_META_FILE = "meta.pt"  # Lightning's sharded save: the rest of the checkpoint dict, torch.save'd beside the DCP files


def read_lightning_meta(storage: Storage, *, allow_pickle: bool, opt_in: str) -> dict[str, Any] | None:
    """The dict in Lightning's ``meta.pt`` beside a DCP checkpoint (loop, callback and scheduler
    state; ``None`` when there is no such file), read by
    :func:`shardsafe.format.safe_pickle.load_value_file` (the full unpickler only with
    ``allow_pickle``): ``PickleNotAllowedError`` (its message
    ending with ``opt_in``: how the caller opts in) for globals the restricted unpickler refuses;
    ``CorruptCheckpointError`` for a file that cannot be read or holds no dict."""
    where = f"{storage.url.rstrip('/')}/{LIGHTNING_META_FILE}"
    if LIGHTNING_META_FILE not in storage.list():
        return None
    value = safe_pickle.load_value_file(StoredFile(storage, LIGHTNING_META_FILE), where=where, allow_pickle=allow_pickle, opt_in=opt_in)  # streamed
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{where}: Lightning's checkpoint dict expected, found a {type(value).__name__}")
    return value
