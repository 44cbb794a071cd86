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
(:func:`~shardsafe.megatron.strategies.common.safe_torch_load`).
"""

from __future__ import annotations

import os
import stat
from math import prod
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np
import torch

from ...errors import CorruptCheckpointError
from ...format import strict_json
from ...format.metadata import MAX_NDIM as _MAX_NDIM
from ...format.metadata import MAX_SIZE as _MAX_SIZE
from ...storage import Storage
from ...storage.base import DCP_METADATA
from ...storage.local import open_nofollow
from ..core import CheckpointingException, location, opened
from .common import safe_torch_load
from .torch_dist import TorchDistLoadShardedStrategy, _Stored

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
        with _open(_root(storage), path, self.where) as f:  # streamed: torch reads what it needs of the file
            return safe_torch_load(f, f"{self.where}/{path}", allow_pickle=allow_pickle, strategy=strategy, opt_in=opt_in)

    def _chunk(self, key: str, idx: tuple[int, ...]) -> tuple[str, int]:
        """The chunk file of chunk ``idx`` of ``key`` (relative to the checkpoint) and its size."""
        arr = self.arrays[key]
        name = arr.separator.join(map(str, idx)) if idx else "0"
        return f"{key}/{name}", prod(arr.chunks) * self.tensors[key].torch_dtype.itemsize

    def _what(self, key: str) -> str:
        return f"a {list(self.arrays[key].chunks)} chunk of {self.tensors[key].torch_dtype}"

    def check_stored(self, storage: Storage) -> None:
        """Before whole tensors are allocated: every chunk file is there, no link, and of its
        chunk's size (one ``lstat`` each), so the shapes allocated are bounded by the files."""
        root = _root(storage)
        for key in self.tensors:
            for _, _, _, idx in self.pieces(key):
                path, size = self._chunk(key, idx)
                try:
                    st = os.lstat(os.path.join(root, *path.split("/")))
                except FileNotFoundError:
                    name = path.rsplit("/", 1)[1]
                    raise CheckpointingException(f"{self.where}: array {key!r} has no chunk file {name!r} (megatron-core writes every chunk)") from None
                if stat.S_ISLNK(st.st_mode):
                    raise CheckpointingException(
                        f"{self.where}: {os.path.join(root, *path.split('/'))}: is a symbolic link; shardsafe does not follow links "
                        "for the files of a checkpoint (it may point outside the checkpoint): replace it with the file itself"
                    )
                if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                    raise CheckpointingException(_size_error(self.where, path, st.st_size, size, self._what(key)))

    def load_chunk(self, storage: Storage, key: str, idx: tuple[int, ...]) -> torch.Tensor:
        """Chunk ``idx`` of ``key``, clipped to the array (a view of the chunk file's elements)."""
        stored, arr = self.tensors[key], self.arrays[key]
        path, size = self._chunk(key, idx)
        name = path.rsplit("/", 1)[1]
        missing = f"{self.where}: array {key!r} has no chunk file {name!r} (megatron-core writes every chunk)"
        raw = _read(_root(storage), path, self.where, size=size, what=self._what(key), missing=missing)
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
        dcp = False
        for path, _dirs, files in os.walk(root):  # links to directories are not followed
            key = os.path.relpath(path, root).replace(os.sep, "/")
            if key == ".":
                dcp = DCP_METADATA in files
                continue
            if _ZARRAY in files:
                tensors[key], arrays[key] = _read_zarray(root, key, where, len(files) + len(_dirs))
            for f in files:
                if f.startswith("shard_") and f.endswith(".pt"):
                    objects[f"{key}/{f[:-3]}"] = f"{key}/{f}"
        if not tensors and not objects and dcp:
            raise CheckpointingException(
                f"{where}: its metadata.json names the zarr backend, but no Zarr array ({_ZARRAY}) or ShardedObject file "
                f"(shard_*.pt) is there, and DCP's {DCP_METADATA} is: a torch_dist checkpoint whose metadata.json is wrong. "
                'Set "sharded_backend" to "torch_dist" in its metadata.json if that is what wrote it'
            )
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


_ZARRAY_LIMIT = 1 << 20  # a .zarray is a few hundred bytes


def _open(root: str, path: str, where: str) -> BinaryIO:
    """The file ``path`` (relative to the checkpoint ``root``), opened without following links."""
    full = os.path.join(root, *path.split("/"))
    try:
        return os.fdopen(open_nofollow(full, root=root), "rb")
    except FileNotFoundError:
        raise CheckpointingException(f"{where}: no file {path!r}") from None
    except CorruptCheckpointError as e:
        raise CheckpointingException(f"{where}: {e}") from None
    except OSError as e:
        raise CheckpointingException(f"{where}: cannot read {path}: {e.strerror}") from None


def _read(root: str, path: str, where: str, *, size: int | None = None, what: str = "", limit: int | None = None, missing: str = "") -> bytes:
    """The file ``path`` (relative to the checkpoint ``root``) opened without following links
    (:func:`~shardsafe.storage.local.open_nofollow`); its size is checked against ``size`` (a
    chunk of ``what``) or ``limit`` before anything is read or allocated."""
    full = os.path.join(root, *path.split("/"))
    try:
        fd = open_nofollow(full, root=root)
    except FileNotFoundError:
        raise CheckpointingException(missing or f"{where}: no file {path!r}") from None
    except CorruptCheckpointError as e:
        raise CheckpointingException(f"{where}: {e}") from None
    except OSError as e:
        raise CheckpointingException(f"{where}: cannot read {path}: {e.strerror}") from None
    try:
        found = os.fstat(fd).st_size
        if size is not None and found != size:
            raise CheckpointingException(_size_error(where, path, found, size, what))
        if limit is not None and found > limit:
            raise CheckpointingException(f"{where}: {path} holds {found} bytes, more than the {limit} such a file may hold; refusing to read it")
        parts, pos = [], 0
        while pos <= found:  # one byte more than it held when opened: a file growing meanwhile is noticed
            part = os.pread(fd, min(found + 1 - pos, 1 << 24), pos)
            if not part:
                break
            parts.append(part)
            pos += len(part)
        data = b"".join(parts)
    except OSError as e:
        raise CheckpointingException(f"{where}: cannot read {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) != found:
        raise CheckpointingException(f"{where}: {path} changed while it was read ({len(data)} bytes, {found} when opened)")
    return data


def _size_error(where: str, path: str, found: int, size: int, what: str) -> str:
    return f"{where}: chunk {path} holds {found} bytes, not the {size} bytes of {what}; the file is damaged or truncated"


def _read_zarray(root: str, key: str, where: str, entries: int) -> tuple[_Stored, _Array]:
    """The array ``key`` as its ``.zarray`` describes it; its directory holds ``entries`` names
    (chunk files), which bounds the chunks it may declare."""
    at = f"{where}: array {key!r} ({key}/{_ZARRAY})"
    try:
        doc = strict_json.loads(_read(root, f"{key}/{_ZARRAY}", where, limit=_ZARRAY_LIMIT))
    except ValueError as e:
        raise CheckpointingException(f"{at}: not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("zarr_format") != 2:
        raise CheckpointingException(f"{at}: not a Zarr v2 array description (zarr_format {doc.get('zarr_format') if isinstance(doc, dict) else None!r})")
    shape, chunks = doc.get("shape"), doc.get("chunks")
    if not _ints(shape) or not _ints(chunks) or len(shape) != len(chunks) or any(c < 1 for c in chunks) or len(shape) > _MAX_NDIM:
        raise CheckpointingException(f"{at}: shape {str(shape)[:80]} and chunks {str(chunks)[:80]} are not two lists of equal length of sizes")
    grid = tuple(-(-s // c) for s, c in zip(shape, chunks))
    if prod(grid) > entries:  # megatron-core writes every chunk: a file each
        raise CheckpointingException(
            f"{at}: shape {shape} in chunks {chunks} is {prod(grid)} chunks, but the array's directory holds {entries} "
            "entries (megatron-core writes a file for every chunk); the .zarray is damaged or the array incomplete"
        )
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
    return _Stored(tuple(shape), dtype, None), _Array(tuple(chunks), separator, grid)


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int and 0 <= x < _MAX_SIZE for x in v)


def _dtype(name: Any, at: str) -> torch.dtype:
    if name in _DTYPES:
        return _DTYPES[name]
    try:
        if not isinstance(name, str):
            raise TypeError(name)
        np_dtype = np.dtype(name)
        if np_dtype.byteorder == ">" and np_dtype.itemsize > 1:
            raise TypeError("big-endian")
        return torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype
    except Exception:  # noqa: BLE001 - numpy raises TypeError, ValueError, KeyError... for what a hostile name makes it parse
        raise CheckpointingException(f"{at}: dtype {name!r} is not one shardsafe reads (little-endian numbers, bool, 'bfloat16')") from None
