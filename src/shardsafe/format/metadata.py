"""``metadata.json``: the versioned JSON document that commits a checkpoint.

Follows the reference ``StorageMetadata`` / ``TensorStorageMetadata`` / ``TensorShardSpec``
models, extended for this format: a file may hold several chunks of one tensor (so
``shard_spec_per_file`` maps a file to a *list* of specs), and each spec carries the entry name
in the file, the absolute byte range and a CRC32C of the chunk's bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from math import prod
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import CorruptCheckpointError, DtypeMismatchError
from . import strict_json
from .dtypes import torch_dtype

__all__ = [
    "FORMAT_VERSION",
    "METADATA_FILENAME",
    "StorageMetadata",
    "TensorShardSpec",
    "TensorStorageMetadata",
    "is_data_file_name",
    "keys_under",
]

FORMAT_VERSION = 1
METADATA_FILENAME = "metadata.json"
MAX_SIZE = 1 << 62
"""Bound on every size and position in the metadata: dims, element counts, bytes, byte offsets."""
MAX_NDIM = 64
_DATA_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\.safetensors$")


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
    crc32c: int = Field(ge=0, lt=1 << 32)
    """CRC32C of the chunk's bytes."""

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
        from ..planning.geometry import flat_segments

        strides = _row_major_strides(full_shape)
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


def _row_major_strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return strides[::-1]


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


class TensorStorageMetadata(BaseModel):
    """A stored tensor: its global shape and dtype, and where its chunks lie."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    shape: tuple[int, ...]
    """Shape of the full (unsharded) tensor."""
    dtype: str
    """dtype name without the ``torch.`` prefix, e.g. ``"bfloat16"``."""
    is_sharded: bool
    """Whether the tensor was sharded (not replicated) when saved."""
    shard_spec_per_file: dict[str, list[TensorShardSpec]]
    """Data file name -> the chunks of this tensor stored in it."""

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

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    def materialize_empty(self, *, device: torch.device | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        return torch.empty(shape if shape is not None else self.shape, dtype=self.torch_dtype, device=device)

    def chunks(self) -> Iterator[tuple[str, TensorShardSpec]]:
        for file, specs in self.shard_spec_per_file.items():
            for spec in specs:
                yield file, spec

    def get_flattened_offsets_in_file(self, filename: str) -> Iterator[tuple[int, int]]:
        for spec in self.shard_spec_per_file.get(filename, []):
            yield from spec.get_flattened_offsets(self.shape)

    def get_numel_in_file(self, filename: str) -> int:
        return sum(spec.local_numel for spec in self.shard_spec_per_file.get(filename, []))


class StorageMetadata(BaseModel):
    """The whole of ``metadata.json``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: int = FORMAT_VERSION
    tensors: dict[str, TensorStorageMetadata]
    objects: dict[str, Any] = {}
    """Non-tensor values, stored as JSON."""
    pickled_objects: dict[str, str] = {}
    """Non-tensor values that needed pickle (base64), present only if the saver opted in."""

    def to_json(self) -> bytes:
        return self.model_dump_json(indent=None).encode()

    @classmethod
    def from_json(cls, raw: bytes, *, where: str) -> StorageMetadata:
        """Parse and validate ``metadata.json``; ``where`` names it in errors."""
        try:
            doc = strict_json.loads(raw)
        except ValueError as e:
            raise CorruptCheckpointError(f"{where}: invalid checkpoint metadata: {e}") from None
        version = doc.get("format_version") if isinstance(doc, dict) else None
        if type(version) is not int or version < 1:
            raise CorruptCheckpointError(f"{where}: invalid checkpoint metadata: format_version must be a positive integer, found {version!r}")
        if version > FORMAT_VERSION:  # before the schema: a newer format may have new fields
            raise CorruptCheckpointError(
                f"{where}: format_version {version} is newer than this shardsafe reads ({FORMAT_VERSION}); upgrade shardsafe"
            )
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

    def data_files(self) -> set[str]:
        return {f for t in self.tensors.values() for f in t.shard_spec_per_file}

    def _check(self, where: str) -> None:
        """Everything the schema cannot say: keys, sizes bounded by :data:`MAX_SIZE` (so that no
        size overflows or is allocated unchecked), byte ranges that match their chunks and do not
        share bytes within a file, data file names, and chunks that tile each tensor."""
        from ..planning.geometry import check_tiling

        both = sorted((set(self.objects) | set(self.pickled_objects)) & set(self.tensors))
        both += sorted(set(self.objects) & set(self.pickled_objects))
        if both:
            raise CorruptCheckpointError(f"{where}: keys {both} are stored twice (as a tensor and as a value)")
        for kind, keys in (("tensors", self.tensors), ("objects", self.objects), ("pickled_objects", self.pickled_objects)):
            if "" in keys:
                raise CorruptCheckpointError(f"{where}: invalid checkpoint metadata: an empty key in {kind!r}; keys are non-empty strings")

        checked_files: set[str] = set()
        ranges: dict[str, list[tuple[int, int, str, str]]] = {}  # file -> (begin, end, key, chunk name)
        for key, t in self.tensors.items():
            itemsize = t.torch_dtype.itemsize
            _check_shape(where, key, t.shape, itemsize)
            for file in t.shard_spec_per_file:
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


def _check_shape(where: str, key: str, shape: tuple[int, ...], itemsize: int) -> None:
    if len(shape) > MAX_NDIM:
        raise CorruptCheckpointError(f"{where}: tensor {key!r} has {len(shape)} dimensions; at most {MAX_NDIM} are allowed")
    nbytes = itemsize
    for n in shape:
        if n < 0:
            raise CorruptCheckpointError(f"{where}: tensor {key!r} has shape {list(shape)}: a negative dimension")
        nbytes *= n
        if nbytes >= MAX_SIZE:  # n < MAX_SIZE too, as itemsize >= 1, so no intermediate product is huge
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r} of shape {list(shape)} would hold 2**62 bytes or more; refusing it"
            )
