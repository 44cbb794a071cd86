"""Tunables, in one table, each overridable by an environment variable.

``SHARDSAFE_<NAME>`` overrides the default, read once at import. The table is the single
source: add a row, not a copy of the lookup code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["KNOBS", "Knobs"]

_KiB, _MiB = 1 << 10, 1 << 20

# name: (default, doc)
_TABLE: dict[str, tuple[int, str]] = {
    "io_threads": (4, "threads per rank that read byte ranges concurrently"),
    "read_buffer_bytes": (32 * _MiB, "bound on the scratch memory of a load, all reader threads together (bytes): only reads that cannot go straight into the target use it"),
    "coalesce_gap_bytes": (64 * _KiB, "byte gap under which two ranged reads become one (the gap is read and dropped: one large read beats many small ones, locally and on object stores)"),
    "write_block_bytes": (16 * _MiB, "largest single write call when streaming a chunk; the checksum of one block overlaps the write of the previous (bytes)"),
    "replica_split_bytes": (16 * _MiB, "replicated tensors larger than this are split across replicas"),
    "object_part_bytes": (16 * _MiB, "object stores: multipart upload part size (bytes, at least 5 MiB)"),
    "object_get_bytes": (8 * _MiB, "object stores: largest single ranged GET; larger reads are split (bytes)"),
    "object_concurrency": (8, "object stores: parts in flight per uploaded file, ranged GETs in flight per rank"),
    "object_max_retries": (10, "object stores: retries of a request that failed with 5xx, throttling or a reset"),
    "object_retry_timeout_s": (180, "object stores: no retry starts later than this after the first try (seconds)"),
    "writeback_bytes": (16 * _MiB, "local files: start writing back every this many bytes written (sync_file_range), so the final fsync has little left; 0: off"),
    "checksum_block_bytes": (1 * _MiB, "saves: each chunk gets one XXH3-64 digest per block of this many bytes (a multiple of 16), so a load that reads part of a chunk verifies only the blocks it touches"),
    "read_block_bytes": (32 * _MiB, "in-place reads larger than this are split into blocks read concurrently while the checksum runs (bytes)"),
    "async_max_in_flight": (1, "async saves: how many may be in flight at once; the next one first waits for the oldest to commit (each in flight holds its own staging buffer)"),
    "async_staging_bytes": (32 << 30, "async saves: the most host memory one save stages into (bytes); a rank whose state is larger stages in parts, and async_save returns once the last part is copied"),
    "collective_timeout_s": (600, "collective calls (save, load, unshard): how long the ranks that called wait for the others to call too before raising MissingRanksError (seconds)"),
}


@dataclass(frozen=True, slots=True)
class Knobs:
    io_threads: int
    read_buffer_bytes: int
    coalesce_gap_bytes: int
    write_block_bytes: int
    replica_split_bytes: int
    # rows added after the first release have defaults, so Knobs(...) built field by field still works
    object_part_bytes: int = _TABLE["object_part_bytes"][0]
    object_get_bytes: int = _TABLE["object_get_bytes"][0]
    object_concurrency: int = _TABLE["object_concurrency"][0]
    object_max_retries: int = _TABLE["object_max_retries"][0]
    object_retry_timeout_s: int = _TABLE["object_retry_timeout_s"][0]
    writeback_bytes: int = _TABLE["writeback_bytes"][0]
    read_block_bytes: int = _TABLE["read_block_bytes"][0]
    collective_timeout_s: int = _TABLE["collective_timeout_s"][0]
    checksum_block_bytes: int = _TABLE["checksum_block_bytes"][0]
    async_max_in_flight: int = _TABLE["async_max_in_flight"][0]
    async_staging_bytes: int = _TABLE["async_staging_bytes"][0]

    def __post_init__(self) -> None:
        if self.checksum_block_bytes < 16 or self.checksum_block_bytes % 16:
            raise ValueError(f"checksum_block_bytes={self.checksum_block_bytes} must be a positive multiple of 16")
        if self.async_max_in_flight < 1:
            raise ValueError(f"async_max_in_flight={self.async_max_in_flight} must be at least 1")
        if self.async_staging_bytes < 1:
            raise ValueError(f"async_staging_bytes={self.async_staging_bytes} must be at least 1")

    @classmethod
    def from_env(cls) -> Knobs:
        values = {}
        for name, (default, _doc) in _TABLE.items():
            raw = os.environ.get(f"SHARDSAFE_{name.upper()}")
            if raw is None:
                values[name] = default
                continue
            try:
                values[name] = int(raw)
            except ValueError:
                raise ValueError(f"SHARDSAFE_{name.upper()}={raw!r} is not an integer") from None
            if values[name] < 0:
                raise ValueError(f"SHARDSAFE_{name.upper()}={raw!r} must be >= 0")
        return cls(**values)


KNOBS = Knobs.from_env()
