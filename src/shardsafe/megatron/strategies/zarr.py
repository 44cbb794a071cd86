"""Reading checkpoints megatron-core's deprecated ``zarr`` backend wrote, without zarr or megatron-core.

Such a directory holds one Zarr v2 array per tensor (the directory ``<key>/`` with its
``.zarray`` and one file per chunk, named by the chunk's grid index joined with ``.``), one
``torch.save`` file per ShardedObject (``<key>/shard_<offsets>_<shape>.pt``), Megatron's
``common.pt`` and its ``metadata.json`` (``"sharded_backend": "zarr"``). megatron-core writes the
arrays uncompressed, with no filters, in C order, one chunk per ShardedTensor box (a
``flattened_range`` tensor fills whole boxes too), bfloat16 under the dtype name
``"bfloat16"``: a chunk file is the box's elements, little-endian, row-major (an edge chunk
padded to the full chunk shape). :class:`ZarrLoadShardedStrategy` reads exactly that and
refuses other Zarr arrays (compressed, filtered, Fortran order), naming the array.
Read from a local directory only. ``common.pt`` and the ShardedObjects are read as for ``torch_dist``
(:func:`~shardsafe.megatron.strategies.torch_dist.safe_torch_load`).
"""

from __future__ import annotations

import json
import os
from math import prod
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ...storage import Storage
from ..core import CheckpointingException, opened
from .shardsafe import location
from .torch_dist import TorchDistLoadShardedStrategy, _Stored, safe_torch_load

__all__ = ["ZarrLoadShardedStrategy"]

_ZARRAY = ".zarray"
_DTYPES = {"bfloat16": torch.bfloat16, "|b1": torch.bool}


class _Array(NamedTuple):
    chunks: tuple[int, ...]
    separator: str
    grid: tuple[int, ...]  # chunks per dimension


class _ZarrView(NamedTuple):
    """The checkpoint's arrays and ShardedObject files, as the torch_dist flow reads them."""

    tensors: dict[str, _Stored]
    objects: dict[str, str]  # unique key -> file, relative to the checkpoint
    arrays: dict[str, _Array]
    where: str

    def pieces(self, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...], None, tuple[int, ...]]]:
        """Each chunk of ``key`` as (box offset, box shape clipped to the array, None, grid index)."""
        shape, arr = self.tensors[key].shape, self.arrays[key]
        out = []
        for idx in np.ndindex(*arr.grid):
            off = tuple(i * c for i, c in zip(idx, arr.chunks))
            lens = tuple(min(c, s - o) for c, s, o in zip(arr.chunks, shape, off))
            if prod(lens):
                out.append((off, lens, None, tuple(idx)))
        return out

    def read_object(self, storage: Storage, unique_key: str, *, allow_pickle: bool, strategy: str, opt_in: str | None = None) -> Any:
        """The value megatron-core saved with ``torch.save`` for ShardedObject ``unique_key``."""
        path = self.objects[unique_key]
        raw = _read(os.path.join(_root(storage), *path.split("/")))
        return safe_torch_load(raw, f"{self.where}/{path}", allow_pickle=allow_pickle, strategy=strategy, opt_in=opt_in)

    def load_chunk(self, storage: Storage, key: str, idx: tuple[int, ...]) -> torch.Tensor:
        """Chunk ``idx`` of ``key``, clipped to the array (a view of the chunk file's elements)."""
        stored, arr = self.tensors[key], self.arrays[key]
        name = arr.separator.join(map(str, idx)) if idx else "0"
        try:
            raw = _read(os.path.join(_root(storage), *key.split("/"), name))
        except FileNotFoundError:
            raise CheckpointingException(f"{self.where}: array {key!r} has no chunk file {name!r} (megatron-core writes every chunk)") from None
        itemsize = stored.torch_dtype.itemsize
        if len(raw) != prod(arr.chunks) * itemsize:
            raise CheckpointingException(
                f"{self.where}: chunk {key}/{name} holds {len(raw)} bytes, not the {prod(arr.chunks) * itemsize} of a "
                f"{list(arr.chunks)} chunk of {stored.torch_dtype}; the file is damaged or truncated"
            )
        data = torch.frombuffer(bytearray(raw), dtype=stored.torch_dtype).view(arr.chunks) if raw else torch.empty(arr.chunks, dtype=stored.torch_dtype)
        off = [i * c for i, c in zip(idx, arr.chunks)]
        return data[tuple(slice(0, min(c, s - o)) for c, s, o in zip(arr.chunks, stored.shape, off))]


class ZarrLoadShardedStrategy(TorchDistLoadShardedStrategy):
    """Loads a megatron-core ``zarr`` checkpoint (see the module's docstring) into any layout.
    Each rank reads only the chunks its pieces overlap, each once per load."""

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != "zarr":
            raise CheckpointingException(f"the checkpoint's sharded backend is {loaded_backend!r}; this strategy reads 'zarr' checkpoints")

    def view(self, checkpoint_dir: str | Path | Storage) -> _ZarrView:  # type: ignore[override]
        """The checkpoint's arrays (reads every ``.zarray``) and ShardedObject files."""
        with opened(location(checkpoint_dir)) as storage:
            root, where = _root(storage), storage.url
        tensors: dict[str, _Stored] = {}
        arrays: dict[str, _Array] = {}
        objects: dict[str, str] = {}
        for path, _dirs, files in os.walk(root):
            key = os.path.relpath(path, root).replace(os.sep, "/")
            if key == ".":
                continue
            if _ZARRAY in files:
                tensors[key], arrays[key] = _read_zarray(os.path.join(path, _ZARRAY), key, where)
            for f in files:
                if f.startswith("shard_") and f.endswith(".pt"):
                    objects[f"{key}/{f[:-3]}"] = f"{key}/{f}"
        return _ZarrView(tensors, objects, arrays, where)


def _root(storage: Storage) -> str:
    """The local directory of ``storage``: Zarr arrays are read from local directories only (a
    ``.zarray`` is not a name shardsafe's storage layer reads)."""
    root = storage.local_root
    if root is None or not os.path.isdir(root):
        raise CheckpointingException(
            f"{storage.url}: a megatron-core zarr checkpoint is read from a local directory only; copy it to one first"
        )
    return root


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _read_zarray(path: str, key: str, where: str) -> tuple[_Stored, _Array]:
    at = f"{where}: array {key!r} ({key}/{_ZARRAY})"
    try:
        doc = json.loads(_read(path))
    except ValueError as e:
        raise CheckpointingException(f"{at}: not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("zarr_format") != 2:
        raise CheckpointingException(f"{at}: not a Zarr v2 array description (zarr_format {doc.get('zarr_format') if isinstance(doc, dict) else None!r})")
    shape, chunks = doc.get("shape"), doc.get("chunks")
    if not _ints(shape) or not _ints(chunks) or len(shape) != len(chunks) or any(c < 1 for c in chunks):
        raise CheckpointingException(f"{at}: shape {shape!r} and chunks {chunks!r} are not two lists of equal length of sizes")
    unsupported = [f"{k} {doc.get(k)!r}" for k, ok in (("compressor", None), ("filters", None), ("order", "C")) if doc.get(k) != ok]
    if unsupported:
        raise CheckpointingException(
            f"{at}: {', '.join(unsupported)}; shardsafe reads the uncompressed, unfiltered C-order arrays megatron-core "
            "writes (load this checkpoint with megatron.core.dist_checkpointing and save it again)"
        )
    dtype = _dtype(doc.get("dtype"), at)
    separator = doc.get("dimension_separator", ".")
    if separator not in (".", "/"):
        raise CheckpointingException(f"{at}: dimension_separator {separator!r} is not '.' or '/'")
    if separator == "/" and len(shape) > 1:
        raise CheckpointingException(f"{at}: chunks in nested directories (dimension_separator '/') are not supported")
    grid = tuple(-(-s // c) for s, c in zip(shape, chunks))
    return _Stored(tuple(shape), dtype, None), _Array(tuple(chunks), separator, grid)


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)


def _dtype(name: Any, at: str) -> torch.dtype:
    if name in _DTYPES:
        return _DTYPES[name]
    try:
        np_dtype = np.dtype(name)
        if np_dtype.byteorder == ">" and np_dtype.itemsize > 1:
            raise TypeError("big-endian")
        return torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype
    except (TypeError, ValueError):
        raise CheckpointingException(f"{at}: dtype {name!r} is not one shardsafe reads (little-endian numbers, bool, 'bfloat16')") from None
