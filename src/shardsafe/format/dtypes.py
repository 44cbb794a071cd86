"""The dtypes a checkpoint can hold, by the names that metadata and safetensors headers use."""

from __future__ import annotations

import torch

from ..errors import DtypeMismatchError

__all__ = ["DTYPE_NAMES", "SAFETENSORS_CODE", "dtype_name", "itemsize", "torch_dtype"]

# torch dtype -> safetensors header code; the set safetensors itself can store.
SAFETENSORS_CODE: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
if hasattr(torch, "float8_e8m0fnu"):  # torch 2.7+: the scales of MXFP8 (a power of two a byte)
    SAFETENSORS_CODE[torch.float8_e8m0fnu] = "F8_E8M0"
_BY_NAME: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in SAFETENSORS_CODE}
DTYPE_NAMES = frozenset(_BY_NAME)
"""The metadata names of the dtypes safetensors stores (``"bfloat16"``)."""


_NAMES: dict[torch.dtype, str] = {d: n for n, d in _BY_NAME.items()}


def dtype_name(dtype: torch.dtype, *, key: str = "") -> str:
    """The metadata name of ``dtype`` (``"bfloat16"``); raises if safetensors cannot store it."""
    name = _NAMES.get(dtype)
    if name is None:
        where = f" for key {key!r}" if key else ""
        supported = ", ".join(sorted(_BY_NAME))
        raise DtypeMismatchError(f"dtype {dtype}{where} cannot be stored in safetensors; supported: {supported}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a metadata name; raises ``DtypeMismatchError`` for an unknown one."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise DtypeMismatchError(f"unknown dtype {name!r} in checkpoint metadata") from None


def itemsize(name: str) -> int:
    return torch_dtype(name).itemsize
