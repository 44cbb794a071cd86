"""Whole values of stored tensor subclasses: rebuilt from their inner tensors (``unshard``),
or dequantized to their high-precision tensor (``dequantize=True`` loads and exports)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..adapters import LocalTensor
from ..adapters.subclasses import allocate, check_whole, dequantized, valid_record
from ..errors import CorruptCheckpointError, DtypeMismatchError, ShapeMismatchError
from ..format.dtypes import torch_dtype
from ..format.metadata import StorageMetadata
from .reader import Reader

__all__ = ["DequantizedEntry", "load_whole"]


def load_whole(
    reader: Reader, meta: StorageMetadata, where: str, key: str, *, dequantize: bool, rows: tuple[int, int] | None = None
) -> tuple[torch.Tensor, int]:
    """The value of the subclass stored under ``key`` (the subclass itself, or with ``dequantize``
    its high-precision tensor), whole or, with ``rows``, for the rows ``[start, stop)`` of its
    first dimension widened to whole blocks; and the first row it holds. Every inner byte it
    covers is read and checked."""
    record = valid_record(where, key, meta.objects[key])
    check_whole(where, key, record)
    shape = tuple(record["shape"])
    first, last = 0, shape[0] if shape else 0
    if rows is not None and shape:
        step = math.lcm(*(doc["block"][0] for doc in record["inner"].values() if not doc.get("shared")), 1)
        first, last = rows[0] // step * step, min(shape[0], -(-rows[1] // step) * step)
    sub = (last - first, *shape[1:]) if shape else shape
    value, grids = allocate(where, key, record, sub)
    for name, grid in grids.items():
        doc = record["inner"][name]
        ikey = doc["key"]
        tm = meta.tensors.get(ikey)
        if tm is None:
            raise CorruptCheckpointError(f"{where}: key {key!r}: inner tensor {name!r} is not stored (no key {ikey!r})")
        whole = tuple(doc["shape"]) if doc.get("shared") else tuple(n // b for n, b in zip(shape, doc["block"]))
        if tuple(tm.shape) != whole or tm.torch_dtype != grid.dtype:
            raise CorruptCheckpointError(
                f"{where}: key {key!r}: inner tensor {ikey!r} is stored with shape {list(tm.shape)} and dtype {tm.dtype}; "
                f"its record implies {list(whole)} and {str(grid.dtype).removeprefix('torch.')}"
            )
        offset = (0,) * grid.dim() if doc.get("shared") or not shape else (first // doc["block"][0], *(0,) * (grid.dim() - 1))
        reader.load_tensor(tm, LocalTensor(ikey, grid.dtype, tm.dtype, whole, [(offset, tuple(grid.shape), None)], [grid]))
    return (dequantized(where, key, value) if dequantize else value), first


def check_dequantized(where: str, key: str, record: dict[str, Any], shape: tuple[int, ...], dtype_name: str) -> None:
    valid_record(where, key, record)
    if tuple(record["shape"]) != tuple(shape):
        raise ShapeMismatchError(f"{where}: key {key!r}: checkpoint has global shape {record['shape']}, target has {list(shape)}")
    if record["dtype"] != dtype_name:
        raise DtypeMismatchError(
            f"{where}: key {key!r}: the checkpoint's {record['class']} dequantizes to {record['dtype']}, the target has "
            f"{dtype_name}"
        )


class DequantizedEntry:
    """A stored subclass as an export sees a tensor: its shape and high-precision dtype, and the
    stored inner tensors it is built from (key, metadata)."""

    def __init__(self, record: dict[str, Any], meta: StorageMetadata) -> None:
        self.meta = meta
        self.inner = [(doc["key"], meta.tensors[doc["key"]]) for doc in record["inner"].values() if doc["key"] in meta.tensors]
        self.shape = tuple(record["shape"])
        self.torch_dtype = torch_dtype(record["dtype"])
