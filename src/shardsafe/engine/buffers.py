"""Byte views on tensor memory, and reusable scratch buffers (first touch is costly: reuse)."""

from __future__ import annotations

import threading

import torch

__all__ = ["Scratch", "byte_view", "can_read_into"]


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (no copy)."""
    # as_strided: torch calls a tensor with size-1 dims contiguous whatever their strides
    flat = t.detach().as_strided((t.numel(),), (1,), t.storage_offset())
    return memoryview(flat.view(torch.uint8).numpy())


def can_read_into(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous()


class Scratch:
    """One growable uint8 buffer per thread, kept between uses."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
            self._local.buf = buf
        return buf[:nbytes]

    def clear(self) -> None:
        self._local = threading.local()
