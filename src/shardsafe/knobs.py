"""Tunables, in one table, each overridable by an environment variable.

``SHARDSAFE_<NAME>`` overrides the default, read once at import. The table is the single
source: add a row, not a copy of the lookup code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["KNOBS", "Knobs"]

_MiB = 1 << 20

# name: (default, doc)
_TABLE: dict[str, tuple[int, str]] = {
    "io_threads": (4, "threads per rank that read byte ranges concurrently"),
    "read_buffer_bytes": (64 * _MiB, "bound on scratch memory per read batch (bytes)"),
    "coalesce_gap_bytes": (4096, "byte gap under which two ranged reads become one"),
    "write_block_bytes": (64 * _MiB, "largest single write call when streaming a chunk (bytes)"),
    "replica_split_bytes": (16 * _MiB, "replicated tensors larger than this are split across replicas"),
}


@dataclass(frozen=True, slots=True)
class Knobs:
    io_threads: int
    read_buffer_bytes: int
    coalesce_gap_bytes: int
    write_block_bytes: int
    replica_split_bytes: int

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
