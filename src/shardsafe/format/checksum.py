"""CRC32C (Castagnoli) checksums, hardware-accelerated where the CPU has it (SSE4.2, ARMv8)."""

from __future__ import annotations

import crc32c as _crc32c

__all__ = ["crc32c"]


def crc32c(data, value: int = 0) -> int:
    """CRC32C of a bytes-like object, continuing from ``value`` (the CRC of what came before)."""
    return _crc32c.crc32c(data, value)
