"""``metadata.json``: the versioned JSON document that commits a checkpoint.

Follows the reference ``StorageMetadata`` / ``TensorStorageMetadata`` / ``TensorShardSpec``
models, extended for this format: a file may hold several chunks of one tensor (so
``shard_spec_per_file`` maps a file to a *list* of specs), and each spec carries the entry name
in the file, the absolute byte range and its checksums: in format v2 one digest per block of
``checksum.block_bytes`` (v1: one CRC32C per chunk). Format v2 also lists every data file with
its size and the digest of its safetensors header, and ends with a digest of the document
itself (``metadata_checksum``), so that no byte of a checkpoint goes unchecked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from math import prod
from typing import Any, TypeVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from ..errors import CorruptCheckpointError, DtypeMismatchError, ForeignCheckpointError
from . import strict_json
from .checksum import ALGORITHMS, ChunkSums, file_digest
from .chunk_table import ChunkTable
from .dtypes import SAFETENSORS_CODE, torch_dtype
from .file_index import FileSource, entry_name
from .geometry import check_tiling, flat_segments, row_major_strides

__all__ = [
    "ChecksumConfig",
    "DataFile",
    "DataFileInfo",
    "FORMAT_VERSION",
    "METADATA_FILENAME",
    "StorageMetadata",
    "TensorShardSpec",
    "TensorStorageMetadata",
    "is_data_file_name",
    "keys_under",
    "megatron_advice",
    "sealed_data_files",
]

FORMAT_VERSION = 3
METADATA_FILENAME = "metadata.json"
_SELF_CHECKSUM = re.compile(rb',"metadata_checksum":"([0-9a-f]{16})"\}\Z')
MAX_SIZE = 1 << 62
"""Bound on every size and position in the metadata: dims, element counts, bytes, byte offsets."""
MAX_NDIM = 64
MAX_CHECKED_CHUNKS = 1 << 16
"""Format v3: chunks of tables that do not tile their tensor box by box, checked one by one, per document."""
_SMALL_TABLE = 32  # up to this many chunks, a table that is no grid is checked one by one (its error names the pieces)
_MIN_ENTRY_BYTES = 26  # the shortest header entry, '"a":{"data_offsets":[0,0]}'
_DATA_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\.safetensors$")


def _is_none(value: object) -> bool:  # fields of the other format version are not written
    return value is None


def keys_under(keys: Iterable[str], prefix: str | None) -> dict[str, str]:
    """Name -> stored key for the keys that start with ``prefix``, the prefix removed (all keys
    as they are when ``prefix`` is None)."""
    pre = prefix or ""
    return {key[len(pre) :]: key for key in keys if key.startswith(pre)}


def is_data_file_name(name: str) -> bool:
    """True for a plain file name (no directory part) that a data file may have."""
    return bool(_DATA_FILE.fullmatch(name)) and ".." not in name


class TensorShardSpec(BaseModel):
    """One stored chunk: a box of the global tensor, or a flat slice of such a box."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    global_offset: tuple[int, ...]
    """Start of the chunk's box in every dimension of the global tensor."""
    local_shape: tuple[int, ...]
    """Shape of the chunk's box (before any flattening)."""
    flattened_range: tuple[int, int] | None = None
    """If set, the chunk stores only elements ``[start, stop)`` of the box flattened row-major."""
    name: str
    """Entry name of the chunk inside its safetensors file."""
    byte_range: tuple[int, int]
    """Absolute ``[start, end)`` byte offsets of the chunk's data in its file."""
    crc32c: int | None = Field(default=None, ge=0, lt=1 << 32, strict=True, exclude_if=_is_none)
    """Format v1: CRC32C of the chunk's bytes."""
    checksums: str | None = Field(default=None, pattern=r"^[A-Za-z0-9+/]*={0,2}$", exclude_if=_is_none)
    """Format v2: base64 of the little-endian digest of each block of the chunk's bytes."""

    @field_validator("global_offset", "local_shape", "flattened_range", "byte_range", mode="before")
    @classmethod
    def _only_ints(cls, v: Any) -> Any:
        return _strict_ints(v)

    @property
    def local_numel(self) -> int:
        if self.flattened_range is not None:
            return self.flattened_range[1] - self.flattened_range[0]
        return prod(self.local_shape)

    def get_flattened_offsets(self, full_shape: tuple[int, ...]) -> Iterator[tuple[int, int]]:
        """``[start, stop)`` ranges of the full tensor's row-major flattening this chunk covers."""
        strides = row_major_strides(full_shape)
        lo, hi = self.flattened_range if self.flattened_range is not None else (0, prod(self.local_shape))
        for rel, lengths, _ in flat_segments(self.local_shape, lo, hi):
            # a segment is a box spanning whole trailing dims after its first non-unit dim
            start = [o + r for o, r in zip(self.global_offset, rel)]
            yield from _box_rows(start, lengths, full_shape, strides)

    def get_merged_flattened_offsets(self, full_shape: tuple[int, ...]) -> Iterator[tuple[int, int]]:
        """Like :meth:`get_flattened_offsets`, with touching ranges merged."""
        current: list[int] | None = None
        for lo, hi in self.get_flattened_offsets(full_shape):
            if current is not None and current[1] == lo:
                current[1] = hi
                continue
            if current is not None:
                yield current[0], current[1]
            current = [lo, hi]
        if current is not None:
            yield current[0], current[1]


def _strict_ints(v: Any) -> Any:
    """A JSON array must hold integers: not ``"12"``, ``12.0`` or ``true`` (which pydantic's
    lax mode would turn into ints). Other shapes of input are left to the field's own type."""
    if type(v) is list or type(v) is tuple:
        for x in v:
            if type(x) is not int:
                raise ValueError(f"must hold integers, found {_brief(x)}")
    return v


def _brief(v: Any) -> str:
    if type(v) in (list, dict):
        return f"a JSON {'array' if type(v) is list else 'object'}"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."



def _box_rows(start, lengths, full_shape, strides) -> Iterator[tuple[int, int]]:
    # innermost dimension gives contiguous runs; enumerate the outer index space row-major
    ndim = len(full_shape)
    if ndim == 0:
        yield 0, 1
        return
    run = lengths[-1]
    outer = list(lengths[:-1])
    idx = [0] * len(outer)
    for _ in range(prod(outer)):
        flat = sum((start[d] + idx[d]) * strides[d] for d in range(ndim - 1)) + start[-1]
        yield flat, flat + run
        for d in range(len(idx) - 1, -1, -1):
            idx[d] += 1
            if idx[d] < outer[d]:
                break
            idx[d] = 0


_M = TypeVar("_M", bound=BaseModel)


_IMMUTABLE = (type(None), bool, int, float, str, bytes, tuple, frozenset)
_DEFAULTS: dict[type, list[tuple[str, Any, Any]]] = {}


def _field_defaults(cls: type[BaseModel]) -> list[tuple[str, Any, Any]]:
    """``(name, default, field)`` per field of ``cls``: an immutable default as it is (``field``
    None), else the field, whose ``get_default`` makes a fresh value each time. Built once per
    class: pydantic's ``model_fields`` and ``get_default`` cost microseconds a call, which a
    header of 300k tensors pays 600k times."""
    got = _DEFAULTS.get(cls)
    if got is None:
        got = []
        for name, f in cls.model_fields.items():
            fixed = f.default_factory is None and type(f.default) in _IMMUTABLE  # PydanticUndefined: not fixed
            got.append((name, f.default, None) if fixed else (name, None, f))
        _DEFAULTS[cls] = got
    return got


def built(cls: type[_M], fields: dict[str, Any], private: dict[str, Any] | None = None) -> _M:
    """``cls.model_construct(**fields)`` with ``private`` as its private attributes (every one),
    for values a writer made (not validated), without model_construct's per-call work (13 us a
    tensor against 3): the coordinator of a save builds one per tensor and one per data file,
    in the background thread of an async save. Fields missing from ``fields`` take their
    defaults."""
    obj = cls.__new__(cls)
    values = {}
    for name, default, field in _field_defaults(cls):
        if name in fields:
            values[name] = fields[name]
        else:
            values[name] = default if field is None else field.get_default(call_default_factory=True)
    object.__setattr__(obj, "__dict__", values)
    object.__setattr__(obj, "__pydantic_fields_set__", set(fields))
    object.__setattr__(obj, "__pydantic_extra__", None)
    object.__setattr__(obj, "__pydantic_private__", private)
    return obj


class TensorStorageMetadata(BaseModel):
    """A stored tensor: its global shape and dtype, and where its chunks lie."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    shape: tuple[int, ...]
    """Shape of the full (unsharded) tensor."""
    dtype: str
    """dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``."""
    is_sharded: bool
    """Whether the tensor was sharded (not replicated) when saved."""
    shard_spec_per_file: dict[str, list[TensorShardSpec]] | None = Field(default=None, exclude_if=_is_none)
    """Formats v1 and v2: data file name -> the chunks of this tensor stored in it. In v3 the
    chunks are in ``table``; :meth:`chunks` yields them in every format."""
    table: dict[str, Any] | None = Field(default=None, exclude_if=_is_none)
    """Format v3: the chunks as a run-length coded :class:`~.chunk_table.ChunkTable`."""
    _checksum: ChecksumConfig | None = PrivateAttr(default=None)  # the document's (v2, v3); None for v1
    _table: ChunkTable | None = PrivateAttr(default=None)  # v3: ``table`` decoded and checked
    _doc: Any = PrivateAttr(default=None)  # v3: the StorageMetadata, for its files and their headers
    _key: str = PrivateAttr(default="")

    @field_validator("shape", mode="before")
    @classmethod
    def _only_ints(cls, v: Any) -> Any:
        return _strict_ints(v)

    @field_validator("is_sharded", mode="before")
    @classmethod
    def _only_bool(cls, v: Any) -> Any:
        if type(v) is not bool:
            raise ValueError(f"must be true or false, found {_brief(v)}")
        return v

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        try:
            torch_dtype(v)
        except DtypeMismatchError as e:  # a ValueError, so pydantic reports it as invalid metadata
            raise ValueError(str(e)) from None
        return v

    def __eq__(self, other: object) -> bool:  # the fields: not the decoded table or the document it belongs to
        return type(other) is type(self) and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # equal by value, and holds dicts

    @classmethod
    def from_table(
        cls, shape: tuple[int, ...], dtype: str, is_sharded: bool, table: ChunkTable, *, table_json: dict | None = None
    ) -> TensorStorageMetadata:
        """A format v3 tensor whose chunks are ``table`` (values a writer made: not validated);
        ``table_json``: ``table.to_json()`` if the caller has it (never changed: it may be shared)."""
        fields = {"shape": tuple(shape), "dtype": dtype, "is_sharded": is_sharded, "table": table.to_json() if table_json is None else table_json}
        return built(cls, fields, {"_checksum": None, "_table": table, "_doc": None, "_key": ""})

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    def materialize_empty(self, *, device: torch.device | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        return torch.empty(shape if shape is not None else self.shape, dtype=self.torch_dtype, device=device)

    def chunks(self) -> Iterator[tuple[str, TensorShardSpec]]:
        """Every stored chunk: ``(data file name, spec)``. In format v3 this reads the header of
        every file that holds a chunk of the tensor (once per file; see :meth:`StorageMetadata.bind`)."""
        if self._table is None:
            for file, specs in (self.shard_spec_per_file or {}).items():
                for spec in specs:
                    yield file, spec
            return
        yield from self._resolved(range(len(self._table)))

    def chunk_count(self) -> int:
        """How many chunks are stored (no file is read)."""
        if self._table is not None:
            return len(self._table)
        return sum(len(specs) for specs in (self.shard_spec_per_file or {}).values())

    def overlapping(self, boxes: Iterable[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[int] | None:
        """Format v3: the table indices of the chunks whose box overlaps any of ``boxes``
        (``(offsets, lengths)``), ascending; None for earlier formats (no table). No file is read."""
        table = self.__pydantic_private__["_table"]  # read so, private attributes skip pydantic's slow __getattr__ (every tensor of a load)
        if table is None:
            return None
        picked: list[int] = []
        for off, lens in boxes:
            picked.extend(table.overlapping(off, lens))
        return picked if len(picked) < 2 else sorted(set(picked))

    def chunks_overlapping(
        self, boxes: Iterable[tuple[tuple[int, ...], tuple[int, ...]]], *, indices: list[int] | None = None
    ) -> Iterator[tuple[str, TensorShardSpec]]:
        """The chunks whose box overlaps any of ``boxes`` (``(offsets, lengths)``), and possibly
        others: in format v3 only their files' headers are read. ``indices``: what
        :meth:`overlapping` gave for ``boxes``, if the caller has it."""
        if self.__pydantic_private__["_table"] is None:
            yield from self.chunks()
            return
        yield from self._resolved(self.overlapping(boxes) if indices is None else indices)

    def files_of(self, indices: list[int]) -> set[int]:
        """Format v3: the indices (into ``file_table``) of the files holding the chunks
        ``indices`` (as :meth:`overlapping` gives them)."""
        files = self.__pydantic_private__["_table"].files
        return {int(files[i]) for i in indices}

    def _resolved(self, indices: Iterable[int]) -> Iterator[tuple[str, TensorShardSpec]]:
        private = self.__pydantic_private__
        table, doc, key = private["_table"], private["_doc"], private["_key"]
        assert table is not None
        resolver = doc._bound(key)
        itemsize = self.torch_dtype.itemsize
        code = SAFETENSORS_CODE[self.torch_dtype]
        for i in indices:
            f, off, lens, flat = table.chunk(i)
            try:
                index = resolver.file(f)
            except CorruptCheckpointError as e:  # the file's own damage, named with the key that needed it
                raise type(e)(f"key {key!r}: {e}") from None
            name = entry_name(key, self.shape, off, lens, flat)
            numel = flat[1] - flat[0] if flat is not None else prod(lens)
            begin, end, _ = index.locate(name, numel * itemsize, key=key, dtype=code)
            spec = built(
                TensorShardSpec, {"global_offset": off, "local_shape": lens, "flattened_range": flat, "name": name, "byte_range": (begin, end)}
            )
            yield index.name, spec

    def chunk_sums(self, file: str, spec: TensorShardSpec) -> ChunkSums:
        """The checksums of one of this tensor's chunks (v1: one CRC32C over the whole chunk;
        v3: from the checksum entry of its file)."""
        where = f"{file}:{spec.name}"
        nbytes = spec.byte_range[1] - spec.byte_range[0]
        private = self.__pydantic_private__
        cfg = private["_checksum"]
        if private["_table"] is not None and cfg is not None:
            doc, key = private["_doc"], private["_key"]
            index = doc._bound(key).file(doc._file_number(file))
            first = index.locate(spec.name, nbytes, key=key, dtype=SAFETENSORS_CODE[self.torch_dtype])[2]
            blocks = -(-nbytes // cfg.block_bytes)
            return ChunkSums(cfg.algorithm, cfg.block_bytes, nbytes, tuple(index.digests[first : first + blocks].tolist()), where)
        if cfg is None:
            return ChunkSums.whole(spec.crc32c, algorithm="crc32c", nbytes=nbytes, where=where)  # type: ignore[arg-type]
        return ChunkSums.decode(
            spec.checksums or "", algorithm=cfg.algorithm, block_bytes=cfg.block_bytes, nbytes=nbytes, where=where
        )

    def get_flattened_offsets_in_file(self, filename: str) -> Iterator[tuple[int, int]]:
        for file, spec in self.chunks():
            if file == filename:
                yield from spec.get_flattened_offsets(self.shape)

    def get_numel_in_file(self, filename: str) -> int:
        return sum(spec.local_numel for file, spec in self.chunks() if file == filename)


class ChecksumConfig(BaseModel):
    """How chunk checksums are computed (format v2)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    algorithm: str
    """Digest of each block: ``"xxh3-64"`` (XXH3, 64-bit, seed 0)."""
    block_bytes: int = Field(ge=16, le=1 << 40, multiple_of=16, strict=True)
    """Each chunk is split into blocks of this many bytes (the last may be shorter)."""

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, v: str) -> str:
        if v not in ALGORITHMS or v == "crc32c":
            raise ValueError(f"unknown checksum algorithm {v!r} (this shardsafe knows 'xxh3-64')")
        return v


class DataFileInfo(BaseModel):
    """A data file as a whole (format v2)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    size: int = Field(ge=8, lt=1 << 62, strict=True)
    """The file's length in bytes."""
    header: str = Field(pattern=r"^[0-9a-f]{16}$")
    """XXH3-64 of the file's first ``8 + N`` bytes (the length and the padded JSON header), 16 hex digits."""


class DataFile(BaseModel):
    """A data file as a whole (format v3): its name, its size, and the digests of the two parts
    of it a reader checks before using them (the header, the checksum entry)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """The file's name in the checkpoint directory."""
    size: int = Field(ge=8, lt=1 << 62, strict=True)
    """The file's length in bytes."""
    header_bytes: int = Field(ge=8, lt=1 << 62, strict=True)
    """``8 + N``: the length prefix and the padded JSON header, where the data section starts."""
    header: str = Field(pattern=r"^[0-9a-f]{16}$")
    """XXH3-64 of the file's first ``header_bytes`` bytes, 16 hex digits."""
    sums: str = Field(pattern=r"^[0-9a-f]{16}$")
    """XXH3-64 of the bytes of the file's ``__shardsafe_checksums__`` entry, 16 hex digits."""


class StorageMetadata(BaseModel):
    """The whole of ``metadata.json``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: int = FORMAT_VERSION
    checksum: ChecksumConfig | None = Field(default=None, exclude_if=_is_none)
    """Format v2 (required there): how the chunks' ``checksums`` were computed."""
    files: dict[str, DataFileInfo] | None = Field(default=None, exclude_if=_is_none)
    """Format v2 (required there): every data file, with its size and header digest."""
    file_table: list[DataFile] | None = Field(default=None, exclude_if=_is_none)
    """Format v3 (required there): every data file; a chunk table names a file by its index here."""
    tensors: dict[str, TensorStorageMetadata]
    objects: dict[str, Any] = {}
    """Non-tensor values, stored as JSON."""
    pickled_objects: dict[str, str] = {}
    """Non-tensor values that needed pickle (base64), present only if the saver opted in."""

    _resolver: FileSource | None = PrivateAttr(default=None)
    _file_numbers: dict[str, int] | None = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:  # the fields: not whether, or where, it is bound
        return type(other) is type(self) and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]

    def model_post_init(self, _context: Any) -> None:
        for key, t in self.tensors.items():
            t._checksum = self.checksum
            t._doc = self
            t._key = key

    def attach_files(self, files: FileSource) -> StorageMetadata:
        """Format v3: where chunk locations and checksums are read from, as they are needed (the
        engine attaches its reader of the checkpoint's data files,
        :func:`shardsafe.engine.file_index.bind_files`; :meth:`shardsafe.Checkpointer.get_metadata`
        returns metadata bound so). Returns ``self``."""
        self._resolver = files
        return self

    @property
    def resolver(self) -> Any:
        """Format v3, once bound: the reader of the data files' headers."""
        return self._resolver

    def _bound(self, key: str) -> FileSource:
        resolver = self.__pydantic_private__["_resolver"]
        if resolver is None:
            raise CorruptCheckpointError(
                f"tensor {key!r}: format v3 metadata keeps the chunks' byte ranges and checksums in the data files' headers; "
                "this StorageMetadata is not bound to its checkpoint (call shardsafe.engine.file_index.bind_files(meta, storage), "
                "or use Checkpointer.get_metadata, which does)"
            )
        return resolver

    def _file_number(self, name: str) -> int:
        numbers = self.__pydantic_private__["_file_numbers"]
        if numbers is None:
            numbers = self._file_numbers = {f.name: i for i, f in enumerate(self.file_table or ())}
        return numbers[name]

    def to_json(self) -> bytes:
        """The document as written: compact JSON whose last member, ``metadata_checksum``, is
        the XXH3-64 of every byte before it (v2)."""
        body = self.model_dump_json(indent=None).encode()
        if self.format_version < 2:
            return body
        head = body[:-1]  # without the closing brace
        return head + b',"metadata_checksum":"' + file_digest(head).encode() + b'"}'

    @classmethod
    def from_json(cls, raw: bytes, *, where: str) -> StorageMetadata:
        """Parse and validate ``metadata.json``; ``where`` names it in errors."""
        try:
            doc = strict_json.loads(raw)
        except ValueError as e:
            raise CorruptCheckpointError(f"{where}: invalid checkpoint metadata: {e}") from None
        if isinstance(doc, dict) and "format_version" not in doc and "sharded_backend" in doc:
            src = where[: -len(METADATA_FILENAME) - 1] if where.endswith("/" + METADATA_FILENAME) else where
            raise ForeignCheckpointError(
                f"{where}: this is Megatron-Core's dist_checkpointing config (sharded_backend "
                f"{str(doc['sharded_backend'])[:40]!r}), not shardsafe's commit record: the directory holds a checkpoint "
                f"Megatron-Core wrote; {megatron_advice(src)}"
            )
        version = doc.get("format_version") if isinstance(doc, dict) else None
        if type(version) is not int or version < 1:
            raise CorruptCheckpointError(f"{where}: invalid checkpoint metadata: format_version must be a positive integer, found {version!r}")
        if version > FORMAT_VERSION:  # before the schema: a newer format may have new fields
            raise CorruptCheckpointError(
                f"{where}: format_version {version} is newer than this shardsafe reads ({FORMAT_VERSION}); upgrade shardsafe"
            )
        if version >= 2:
            _check_self_checksum(raw, doc, where)
        objects = doc.get("objects")
        for key, value in objects.items() if isinstance(objects, dict) else ():
            if strict_json.nesting_exceeds(value, strict_json.MAX_DEPTH):
                raise CorruptCheckpointError(
                    f"{where}: invalid checkpoint metadata: value {key!r} nests arrays and objects deeper than "
                    f"{strict_json.MAX_DEPTH} levels"
                )
        try:
            meta = cls.model_validate(doc)
        except ValidationError as e:
            raise CorruptCheckpointError(f"{where}: invalid checkpoint metadata: {e}") from None
        meta._check(where)
        return meta

    @classmethod
    def from_own_json(cls, raw: bytes, *, where: str) -> StorageMetadata:
        """The metadata of a save this job's coordinator has just committed, as it sent it to
        the other ranks: what :meth:`from_json` returns, without checking again what the
        coordinator built and checked (the schema, the tiling, the limits; its own checksum is
        checked, against damage on the way). Format v3 only. A save's every other rank parses
        it, in the background thread of an async save: pydantic's validation was two thirds of
        that time (336 tensors: 9.6 ms)."""
        doc = json.loads(raw)
        _check_self_checksum(raw, doc, where)
        file_table = [built(DataFile, f) for f in doc["file_table"]]
        tables: dict[tuple[tuple[int, ...], str], ChunkTable] = {}
        tensors = {}
        for key, t in doc["tensors"].items():
            shape = tuple(t["shape"])
            same = _layout_key(shape, t["table"])
            table = tables.get(same)
            if table is None:
                table = tables[same] = ChunkTable.from_json(t["table"], shape=shape, nfiles=len(file_table), what=f"{where}: tensor {key!r}")
            tensors[key] = TensorStorageMetadata.from_table(shape, t["dtype"], t["is_sharded"], table, table_json=t["table"])
        fields = {
            "format_version": doc["format_version"], "checksum": built(ChecksumConfig, doc["checksum"]), "file_table": file_table,
            "tensors": tensors, "objects": doc["objects"], "pickled_objects": doc["pickled_objects"],
        }
        meta = built(cls, fields, {"_resolver": None, "_file_numbers": None})
        meta.model_post_init(None)
        return meta

    def with_tensors(self, keys: Iterable[str]) -> StorageMetadata:
        """The same checkpoint with only the tensors ``keys`` (values unchanged): files that no
        kept tensor names are left out (their bytes are then the caller's to delete)."""
        kept = {k: self.tensors[k] for k in keys}
        if self.file_table is None:
            named = {f for t in kept.values() for f in (t.shard_spec_per_file or {})}
            files = None if self.files is None else {f: info for f, info in self.files.items() if f in named}
            return StorageMetadata(
                format_version=self.format_version, checksum=self.checksum, files=files, tensors=kept,
                objects=self.objects, pickled_objects=self.pickled_objects,
            )
        used = sorted({f for t in kept.values() for f in t._table.files.tolist()})  # type: ignore[union-attr]
        renumber = np.full(len(self.file_table), -1, dtype=np.int64)
        renumber[used] = np.arange(len(used))
        tensors = {}
        for key, t in kept.items():
            table = t._table
            assert table is not None
            moved = ChunkTable(renumber[table.files], table.offsets, table.lengths, table.flat)
            tensors[key] = TensorStorageMetadata.from_table(t.shape, t.dtype, t.is_sharded, moved)
        return StorageMetadata(
            format_version=self.format_version, checksum=self.checksum, file_table=[self.file_table[i] for i in used],
            tensors=tensors, objects=self.objects, pickled_objects=self.pickled_objects,
        )

    def file_sizes(self) -> dict[str, int] | None:
        """Each data file's size in bytes (formats v2 and v3; None for v1, which does not record them)."""
        if self.file_table is not None:
            return {f.name: f.size for f in self.file_table}
        return None if self.files is None else {name: info.size for name, info in self.files.items()}

    def data_files(self) -> set[str]:
        if self.file_table is not None:
            return {f.name for f in self.file_table}
        return {f for t in self.tensors.values() for f in (t.shard_spec_per_file or {})}

    def _check_v3(self, where: str) -> None:
        """Format v3: ``checksum`` and ``file_table``, no ``files``; each tensor a chunk table
        (decoded here) whose chunks tile it; file names valid and distinct."""
        for name in ("checksum", "file_table"):
            if getattr(self, name) is None:
                raise CorruptCheckpointError(f"{where}: invalid checkpoint metadata: format_version 3 metadata lacks the {name!r} field")
        if self.files is not None:
            raise CorruptCheckpointError(
                f"{where}: invalid checkpoint metadata: format_version 3 metadata has the 'files' field (format v2's); "
                "its data files are in 'file_table'"
            )
        assert self.file_table is not None
        names = [f.name for f in self.file_table]
        for name in names:
            if not is_data_file_name(name):
                raise CorruptCheckpointError(
                    f"{where}: the file table names data file {name!r}, which is not a plain file name inside the checkpoint "
                    "directory; refusing to read it"
                )
        if len(set(names)) != len(names):
            seen: set[str] = set()
            twice = sorted({n for n in names if n in seen or seen.add(n)})[:5]
            raise CorruptCheckpointError(f"{where}: invalid checkpoint metadata: the file table names {', '.join(map(repr, twice))} twice")
        # every chunk is an entry of its file's header, and an entry takes at least _MIN_ENTRY_BYTES
        # of it: this bounds what the tables may decode to by what the headers hold
        budget = sum(f.header_bytes for f in self.file_table) // _MIN_ENTRY_BYTES
        checked_left = MAX_CHECKED_CHUNKS
        checked: dict[tuple[tuple[int, ...], str], ChunkTable] = {}
        for key, t in self.tensors.items():
            if t.table is None or t.shard_spec_per_file is not None:
                raise CorruptCheckpointError(
                    f"{where}: invalid checkpoint metadata: tensor {key!r}: a format_version 3 tensor has a 'table' and no "
                    "'shard_spec_per_file'"
                )
            _check_shape(where, key, t.shape, t.torch_dtype.itemsize)
            # the tensors of a model share a few layouts: a table is decoded and checked once per
            # (shape, table), and its arrays are shared (never written to)
            same = _layout_key(t.shape, t.table)
            table = checked.get(same)
            if table is None:
                table = ChunkTable.from_json(t.table, shape=t.shape, nfiles=len(names), what=f"{where}: tensor {key!r}", max_count=budget)
                # cheap for a grid, vectorized for any layout that tiles box by box (all a save
                # writes); anything else chunk by chunk, for at most MAX_CHECKED_CHUNKS per document
                if not table.grid_cells(t.shape) and not (len(table) > _SMALL_TABLE and table.tiles_box_by_box(t.shape)):
                    if len(table) > checked_left:
                        raise CorruptCheckpointError(
                            f"{where}: tensor {key!r}: its {len(table)} chunks do not tile its shape {list(t.shape)} box by box, "
                            f"and at most {MAX_CHECKED_CHUNKS} chunks of a document ({checked_left} left) are checked one by one "
                            "(docs/format.md, bounds); the metadata is damaged"
                        )
                    checked_left -= len(table)
                    pieces = [table.chunk(i)[1:] for i in range(len(table))]
                    try:
                        check_tiling(key, t.shape, pieces)
                    except Exception as e:
                        raise CorruptCheckpointError(f"{where}: {e}") from None
                checked[same] = table
            elif len(table) > budget:
                raise CorruptCheckpointError(
                    f"{where}: tensor {key!r}: count {len(table)} is more chunks than the data files' headers can name "
                    f"({budget} left); the metadata is damaged"
                )
            budget -= len(table)
            t._table = table

    def _check_version_fields(self, where: str) -> None:
        """v2 needs ``checksum``, ``files`` and per-chunk ``checksums``; v1 has none of them and a
        ``crc32c`` per chunk."""
        v2 = self.format_version >= 2
        for name in ("checksum", "files"):
            if (getattr(self, name) is None) == v2:
                state = "lacks" if v2 else "has"
                raise CorruptCheckpointError(
                    f"{where}: invalid checkpoint metadata: format_version {self.format_version} metadata {state} the {name!r} field"
                )
        named = self.data_files()
        if v2 and set(self.files) != named:  # type: ignore[arg-type]
            raise CorruptCheckpointError(
                f"{where}: invalid checkpoint metadata: the files table lists {sorted(set(self.files))[:5]}..., the chunks name "  # type: ignore[arg-type]
                f"{sorted(named)[:5]}...; they differ in {sorted(set(self.files) ^ named)[:5]}"  # type: ignore[arg-type]
            )
        size = ALGORITHMS[self.checksum.algorithm].size if v2 else 0  # type: ignore[union-attr]
        for key, t in self.tensors.items():
            for file, spec in t.chunks():
                if not v2:
                    if spec.crc32c is None or spec.checksums is not None:
                        raise CorruptCheckpointError(
                            f"{where}: invalid checkpoint metadata: tensor {key!r}, chunk {spec.name!r} in {file!r}: a format_version 1 chunk needs "
                            "crc32c and no checksums"
                        )
                    continue
                if spec.checksums is None or spec.crc32c is not None:
                    raise CorruptCheckpointError(
                        f"{where}: invalid checkpoint metadata: tensor {key!r}, chunk {spec.name!r} in {file!r}: a format_version 2 chunk needs "
                        "checksums and no crc32c"
                    )
                nbytes = spec.byte_range[1] - spec.byte_range[0]
                blocks = -(-nbytes // self.checksum.block_bytes)  # type: ignore[union-attr]
                if len(spec.checksums) != 4 * -(-blocks * size // 3):
                    raise CorruptCheckpointError(
                        f"{where}: invalid checkpoint metadata: tensor {key!r}, chunk {spec.name!r} in {file!r}: {len(spec.checksums)} characters "
                        f"of checksums, expected {4 * -(-blocks * size // 3)} for {blocks} block(s)"
                    )

    def _check(self, where: str) -> None:
        """Everything the schema cannot say: keys, sizes bounded by :data:`MAX_SIZE` (so that no
        size overflows or is allocated unchecked), byte ranges that match their chunks and do not
        share bytes within a file, data file names, and chunks that tile each tensor."""
        both = sorted((set(self.objects) | set(self.pickled_objects)) & set(self.tensors))
        both += sorted(set(self.objects) & set(self.pickled_objects))
        if both:
            raise CorruptCheckpointError(f"{where}: keys {both} are stored twice (as a tensor and as a value)")
        for kind, keys in (("tensors", self.tensors), ("objects", self.objects), ("pickled_objects", self.pickled_objects)):
            if "" in keys:
                raise CorruptCheckpointError(f"{where}: invalid checkpoint metadata: an empty key in {kind!r}; keys are non-empty strings")
        if self.format_version >= 3:
            self._check_v3(where)
            return
        if self.file_table is not None or any(t.table is not None or t.shard_spec_per_file is None for t in self.tensors.values()):
            raise CorruptCheckpointError(
                f"{where}: invalid checkpoint metadata: format_version {self.format_version} tensors have 'shard_spec_per_file', "
                "and the document has no 'file_table' and no tensor a 'table'"
            )

        checked_files: set[str] = set()
        ranges: dict[str, list[tuple[int, int, str, str]]] = {}  # file -> (begin, end, key, chunk name)
        for key, t in self.tensors.items():
            itemsize = t.torch_dtype.itemsize
            _check_shape(where, key, t.shape, itemsize)
            for file in t.shard_spec_per_file or {}:
                if file not in checked_files and not is_data_file_name(file):
                    raise CorruptCheckpointError(
                        f"{where}: tensor {key!r} names data file {file!r}, which is not a plain "
                        "file name inside the checkpoint directory; refusing to read it"
                    )
                checked_files.add(file)
            for file, spec in t.chunks():
                nbytes = spec.local_numel * itemsize
                if spec.byte_range[1] - spec.byte_range[0] != nbytes or spec.byte_range[0] < 8:  # 8: header length
                    raise CorruptCheckpointError(
                        f"{where}: tensor {key!r}, chunk {spec.name!r} in {file!r}: byte range "
                        f"{list(spec.byte_range)} does not hold {nbytes} bytes"
                    )
                if spec.byte_range[1] >= MAX_SIZE:
                    raise CorruptCheckpointError(
                        f"{where}: tensor {key!r}, chunk {spec.name!r} in {file!r}: byte range "
                        f"{list(spec.byte_range)} ends past the largest offset a checkpoint may use (2**62)"
                    )
                if nbytes:
                    ranges.setdefault(file, []).append((spec.byte_range[0], spec.byte_range[1], key, spec.name))
            pieces = [(s.global_offset, s.local_shape, s.flattened_range) for _, s in t.chunks()]
            try:
                check_tiling(key, t.shape, pieces)
            except Exception as e:
                raise CorruptCheckpointError(f"{where}: {e}") from None
        for file, spans in ranges.items():  # so the chunks of a file are never more bytes than it holds
            spans.sort()
            for (_, end, key, name), (begin, _, key2, name2) in zip(spans, spans[1:]):
                if begin < end:
                    raise CorruptCheckpointError(
                        f"{where}: chunks {name!r} (tensor {key!r}) and {name2!r} (tensor {key2!r}) in {file!r} "
                        "share bytes; every chunk has bytes of its own"
                    )

        self._check_version_fields(where)


def _layout_key(shape: tuple[int, ...], table: dict) -> tuple[tuple[int, ...], str]:
    """Equal for tensors whose parsed chunk tables are equal and shapes too: a model's tensors
    share a few layouts, and each is decoded (and checked) once per document. ``repr`` of a
    parsed JSON value tells values apart as its text does (``1``, ``1.0`` and ``True`` differ),
    in half the time of ``json.dumps``: it runs once per tensor."""
    return shape, repr(table)


def sealed_data_files(raw: bytes, *, where: str) -> set[str]:
    """The data files ``metadata.json`` (``raw``, named ``where`` in errors) names, once it is
    known to be the document a save wrote: formats v2 and v3 check its own checksum
    (``metadata_checksum``), one pass of XXH3 over its bytes, and read no tensor or chunk; format
    v1, which has none, is validated whole. Raises ``CorruptCheckpointError`` naming what is wrong.
    What a step manager counts as committed; loading it checks everything else."""
    try:
        doc = strict_json.loads(raw)
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}: invalid checkpoint metadata: {e}") from None
    version = doc.get("format_version") if isinstance(doc, dict) else None
    if type(version) is not int or version < 2 or version > FORMAT_VERSION:
        return StorageMetadata.from_json(raw, where=where).data_files()  # v1, or the errors from_json words
    _check_self_checksum(raw, doc, where)
    table, files = doc.get("file_table"), doc.get("files")
    if version >= 3 and isinstance(table, list) and all(isinstance(f, dict) and isinstance(f.get("name"), str) for f in table):
        return {f["name"] for f in table}
    if version == 2 and isinstance(files, dict):
        return set(files)
    return StorageMetadata.from_json(raw, where=where).data_files()  # sealed but malformed: from_json says how


def _check_self_checksum(raw: bytes, doc: dict, where: str) -> None:
    """Format v2: the document ends with ``,"metadata_checksum":"<16 hex>"}``, the XXH3-64 of
    every byte before that member. Removes the member from ``doc``."""
    m = _SELF_CHECKSUM.search(raw)
    if m is None or doc.get("metadata_checksum") != m.group(1).decode():
        raise CorruptCheckpointError(
            f"{where}: invalid checkpoint metadata: it does not end with its metadata_checksum member; the file is damaged"
        )
    got = file_digest(raw[: m.start()])
    if got != m.group(1).decode():
        raise CorruptCheckpointError(
            f"{where}: checksum mismatch: metadata_checksum says {m.group(1).decode()}, the document hashes to {got}; "
            "the file is damaged"
        )
    del doc["metadata_checksum"]


def _check_shape(where: str, key: str, shape: tuple[int, ...], itemsize: int) -> None:
    if len(shape) > MAX_NDIM:
        raise CorruptCheckpointError(f"{where}: tensor {key!r} has {len(shape)} dimensions; at most {MAX_NDIM} are allowed")
    nbytes = itemsize
    for n in shape:
        if n < 0:
            raise CorruptCheckpointError(f"{where}: tensor {key!r} has shape {list(shape)}: a negative dimension")
        if n >= MAX_SIZE:  # every dimension, not only the product: a zero elsewhere makes any product 0
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r} has shape {list(shape)}: a dimension of 2**62 or more; refusing it"
            )
        nbytes *= n
        if nbytes >= MAX_SIZE:  # n < MAX_SIZE too, as itemsize >= 1, so no intermediate product is huge
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r} of shape {list(shape)} would hold 2**62 bytes or more; refusing it"
            )


def megatron_advice(src: str) -> str:
    """How a Megatron-Core ``torch_dist`` or ``zarr`` checkpoint at ``src`` converts or loads."""
    return (
        f"convert it with shardsafe.megatron.convert_megatron({src!r}, dst) or `shardsafe convert {src} DST --from megatron`, "
        f"or load it as it is with shardsafe.megatron.load(sharded_state_dict, {src!r})"
    )
