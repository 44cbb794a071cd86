"""A ``torch.save`` file written one tensor at a time.

``torch.save(obj, f)`` needs every tensor of ``obj`` in memory at once. :func:`save_streamed`
writes the same file from an ``obj`` whose tensors may be :class:`LazyTensor` placeholders:
the structure is pickled first, then the bytes of each placeholder are asked of a ``fill``
callback, into one buffer reused for all of them, and written as that storage's record before
the next is asked for. Peak memory is the largest placeholder, the pickled structure, and what
``fill`` needs itself.

The file is the zip archive ``torch.save`` writes to a file object (``torch.serialization._save``),
byte for byte with the torch that runs it (tests compare the bytes):

- ``data.pkl``: the structure, pickled with torch's protocol (2). Tensors are reduced by torch
  itself; a placeholder is reduced as torch reduces an empty CPU tensor of its dtype, with its
  shape and contiguous strides in place of the empty one's, so which rebuild function and which
  storage class a dtype needs (``_rebuild_tensor_v2`` and ``FloatStorage``,
  ``_rebuild_tensor_v3`` and ``UntypedStorage`` for ``uint16``, float8, ...) stays torch's
  choice. Storages are persistent ids ``("storage", storage class, key, location, numel)``,
  keys ``"0"``, ``"1"``, ... in the order the pickle meets them; a storage shared by several
  tensors is written once.
- ``.format_version`` (``1``: storage records in key order), ``.storage_alignment``,
  ``byteorder``;
- ``data/<key>`` for every storage, in key order, by torch's own zip writer
  (``torch._C.PyTorchFileWriter``: CRC-32, records aligned for ``mmap``, zip64 when large).

So ``torch.load(f, weights_only=True)`` and ``torch.load(f, mmap=True, weights_only=True)``
read it as any file ``torch.save`` wrote. The private torch names it relies on
(``torch.serialization._open_zipfile_writer``, ``location_tag``, ``normalize_storage_type``,
``Tensor.__reduce_ex__``'s argument layout) are all in torch 2.4, the oldest the package
allows; :func:`missing_api` says when a torch lacks one, and callers then save in memory.
"""

from __future__ import annotations

import io
import math
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

import torch

from ..errors import CheckpointError

__all__ = ["FileObject", "LazyTensor", "missing_api", "save_streamed"]


@dataclass(frozen=True, eq=False)
class LazyTensor:
    """A contiguous CPU tensor of ``dtype`` and ``shape`` whose bytes are produced only when
    :func:`save_streamed` writes them. ``source``: what ``fill`` needs to produce them."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    source: Any = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _Sink(Protocol):
    def write(self, data: memoryview) -> Any: ...


def missing_api() -> str | None:
    """Why :func:`save_streamed` cannot run on this torch (a private name it needs is gone, or
    tensors reduce differently), or None when it can."""
    ser = torch.serialization
    for name in ("_open_zipfile_writer", "location_tag", "normalize_storage_type", "DEFAULT_PROTOCOL"):
        if not hasattr(ser, name):
            return f"torch {torch.__version__} has no torch.serialization.{name}"
    try:
        _empty_reduction(torch.float32)
    except (TypeError, ValueError, AttributeError) as e:
        return f"torch {torch.__version__} reduces tensors in a way shardsafe does not know ({e})"
    return None


@cache
def _empty_reduction(dtype: torch.dtype) -> tuple[Callable[..., Any], tuple[Any, ...], Any, str]:
    """How torch pickles an empty CPU tensor of ``dtype``: (rebuild function, its arguments,
    storage class, location)."""
    func, args = torch.empty(0, dtype=dtype).__reduce_ex__(torch.serialization.DEFAULT_PROTOCOL)
    if len(args) < 6 or args[1:5] != (0, (0,), (1,), False):
        raise ValueError(f"an empty {dtype} tensor reduces to {getattr(func, '__name__', func)}{args!r}")
    storage = args[0]
    if isinstance(storage, torch.storage.TypedStorage):
        storage_type = getattr(torch, storage._pickle_storage_type())
        location = torch.serialization.location_tag(storage._untyped_storage)
    elif isinstance(storage, torch.UntypedStorage):
        storage_type = torch.serialization.normalize_storage_type(type(storage))
        location = torch.serialization.location_tag(storage)
    else:
        raise ValueError(f"an empty {dtype} tensor reduces to a {type(storage).__name__} as its storage")
    return func, args, storage_type, location


class _LazyStorage:
    """The storage of a placeholder, in the pickle (a persistent id)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: LazyTensor) -> None:
        self.tensor = tensor


class _Pickler(pickle.Pickler):
    """torch.save's pickler (``torch.serialization._save``), which also reduces placeholders.
    ``storages``: what each key's record holds, in key order."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=torch.serialization.DEFAULT_PROTOCOL)
        self.storages: list[LazyTensor | torch.UntypedStorage] = []
        self._keys: dict[int, str] = {}  # a real storage's _cdata -> its key
        self._dtypes: dict[int, torch.dtype] = {}  # a real storage's data_ptr -> the dtype it was saved as

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is not LazyTensor:
            return NotImplemented
        func, args, _, _ = _empty_reduction(obj.dtype)
        shape = tuple(obj.shape)
        stride = torch.empty(shape, dtype=obj.dtype, device="meta").stride()  # torch's contiguous strides
        return func, (_LazyStorage(obj), 0, shape, stride, False, type(args[5])(), *args[6:])

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is _LazyStorage:
            t = obj.tensor
            _, _, storage_type, location = _empty_reduction(t.dtype)
            numel = t.nbytes if storage_type is torch.UntypedStorage else math.prod(t.shape)
            key = str(len(self.storages))
            self.storages.append(t)
            return ("storage", storage_type, key, location, numel)
        if not (isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj)):
            return None
        # a real tensor's storage, exactly as torch.serialization._save names it
        if isinstance(obj, torch.storage.TypedStorage):
            storage, dtype = obj._untyped_storage, obj.dtype
            storage_type, numel = getattr(torch, obj._pickle_storage_type()), obj._size()
        else:
            storage, dtype = obj, torch.uint8
            storage_type, numel = torch.serialization.normalize_storage_type(type(obj)), obj.nbytes()
        if str(storage.device) != "meta" and storage.data_ptr() != 0:
            if self._dtypes.setdefault(storage.data_ptr(), dtype) != dtype:
                raise CheckpointError(f"cannot save tensors that view the same data as {self._dtypes[storage.data_ptr()]} and as {dtype}")
        key = self._keys.get(storage._cdata)
        if key is None:
            key = self._keys[storage._cdata] = str(len(self.storages))
            self.storages.append(storage)
        return ("storage", storage_type, key, torch.serialization.location_tag(storage), numel)


class FileObject:
    """The writable file object ``torch.save`` and torch's zip writer want, over a sink
    (anything with ``write(memoryview)``); ``size``: the bytes written."""

    def __init__(self, sink: _Sink) -> None:
        self.sink, self.size = sink, 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sink.write(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        pass


def _alignment() -> int:
    get = getattr(torch.serialization, "_get_storage_alignment", None)
    return get() if get is not None else 64  # torch < 2.6 aligns every record to 64 bytes


def save_streamed(
    obj: Any, sink: _Sink, fill: Callable[[LazyTensor, torch.Tensor], None], *, done: Callable[[int], None] | None = None
) -> int:
    """Write ``obj`` to ``sink`` (anything with ``write(memoryview)``) as ``torch.save(obj, f)``
    would; returns the bytes written. Each :class:`LazyTensor` in ``obj`` is produced by
    ``fill(placeholder, target)``, which must fill ``target`` (a contiguous CPU tensor of the
    placeholder's dtype and shape, a view of one buffer reused for every placeholder) before it
    returns; placeholders are filled one at a time, in the order the pickle meets them.
    ``done(nbytes)`` is called after each placeholder's bytes are written. ``obj`` may also hold
    real tensors (CPU or not: they are copied to the CPU to be written, as ``torch.save`` does).
    Call :func:`missing_api` first: on a torch it names, this raises."""
    data = io.BytesIO()
    pickler = _Pickler(data)
    pickler.dump(obj)
    pickled = data.getvalue()
    del data
    storages = pickler.storages
    largest = max((s.nbytes for s in storages if isinstance(s, LazyTensor)), default=0)
    buffer = torch.empty(largest, dtype=torch.uint8)
    out = FileObject(sink)
    with torch.serialization._open_zipfile_writer(out) as writer:  # a torch._C.PyTorchFileWriter
        writer.write_record("data.pkl", pickled, len(pickled))
        alignment = str(_alignment())
        for name, value in ((".format_version", "1"), (".storage_alignment", alignment), ("byteorder", sys.byteorder)):
            writer.write_record(name, value, len(value))
        for key, s in enumerate(storages):
            if isinstance(s, LazyTensor):
                fill(s, buffer[: s.nbytes].view(s.dtype).view(s.shape))
                writer.write_record(f"data/{key}", buffer.untyped_storage(), s.nbytes)
                if done is not None:
                    done(s.nbytes)
            else:
                cpu = s if s.device.type == "cpu" else s.cpu()
                writer.write_record(f"data/{key}", cpu, cpu.nbytes())
    return out.size
