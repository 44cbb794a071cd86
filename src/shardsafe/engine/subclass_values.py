"""Whole values of stored tensor subclasses: rebuilt from their inner tensors (``unshard``),
or dequantized to their high-precision tensor (``dequantize=True`` loads and exports)."""

from __future__ import annotations

from typing import Any

import torch

from ..adapters import describe_state
from ..adapters.subclasses import allocate, check_whole, dequantized, valid_record
from ..errors import CorruptCheckpointError, DtypeMismatchError, ShapeMismatchError
from ..format.dtypes import torch_dtype
from ..format.metadata import StorageMetadata
from .reader import Reader

__all__ = ["DequantizedEntry", "load_whole"]


def load_whole(reader: Reader, meta: StorageMetadata, where: str, key: str, *, dequantize: bool) -> torch.Tensor:
    """The whole value of the subclass stored under ``key``: the subclass itself, or with
    ``dequantize`` its high-precision tensor. Every inner byte is read and checked."""
    record = valid_record(where, key, meta.objects[key])
    check_whole(where, key, record)
    value, grids = allocate(where, key, record)
    for name, grid in grids.items():
        ikey = record["inner"][name]["key"]
        tm = meta.tensors.get(ikey)
        if tm is None:
            raise CorruptCheckpointError(f"{where}: key {key!r}: inner tensor {name!r} is not stored (no key {ikey!r})")
        if tuple(tm.shape) != tuple(grid.shape) or tm.torch_dtype != grid.dtype:
            raise CorruptCheckpointError(
                f"{where}: key {key!r}: inner tensor {ikey!r} is stored with shape {list(tm.shape)} and dtype {tm.dtype}; "
                f"its record implies {list(grid.shape)} and {str(grid.dtype).removeprefix('torch.')}"
            )
        (target,), _ = describe_state({ikey: grid}, targets=True)
        reader.load_tensor(tm, target)
    return dequantized(where, key, value) if dequantize else value


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
    """A stored subclass as an export sees a tensor: its shape and high-precision dtype."""

    def __init__(self, key: str, record: dict[str, Any], meta: StorageMetadata) -> None:
        self.key = key
        self.record = record
        self.meta = meta
        self.inner = [doc["key"] for doc in record["inner"].values()]
        self.shape = tuple(record["shape"])
        self.dtype = record["dtype"]
        self.torch_dtype = torch_dtype(record["dtype"])
