"""Play every rank of a save in one process: the same describe/plan/write/commit functions the
engine runs, minus the collectives. Planning is pure, so resharding can be tested by the
hundred here; real process groups are covered by the multi-process tests."""

from __future__ import annotations

from typing import Any

from shardsafe.adapters import describe_state
from shardsafe.engine.file_index import bind_files
from shardsafe.engine.staging import StagingRing, aligned, live_units, stage
from shardsafe.engine.writer import _build_metadata, _file_row, _unit_bytes, _write_file
from shardsafe.format.metadata import METADATA_FILENAME, StorageMetadata
from shardsafe.knobs import KNOBS
from shardsafe.planning.save_plan import TensorDesc, plan_save
from shardsafe.storage import open_storage


def simulate_save(
    location: str, per_rank: list[dict[str, Any]], *, split_bytes: int | None = None, knobs=KNOBS, staged: bool = False
) -> StorageMetadata:
    """Save ``per_rank`` (rank r's state dict) to ``location`` and commit. With ``staged``, each
    rank's bytes go through a staging buffer first (the async path), copied before any is written."""
    storage = open_storage(location)
    locals_, descs = [], []
    for sd in per_rank:
        tensors, _ = describe_state(sd)
        locals_.append({t.key: t for t in tensors})
        descs.append([TensorDesc(t.key, t.dtype_name, t.shape, tuple(t.pieces)) for t in tensors])
    plan = plan_save(
        descs, save_id="5eed", split_bytes=knobs.replica_split_bytes if split_bytes is None else split_bytes, block_bytes=knobs.checksum_block_bytes
    )
    files = [
        _file_row(plan.ranks[r], _write_file(storage, plan.ranks[r], _units(plan.ranks[r].items, locals_[r], knobs, staged), knobs))
        for r in range(len(per_rank))
    ]
    meta = _build_metadata(plan.plan, files, ({}, {}), knobs.checksum_block_bytes, "5eed")
    storage.put_atomic(METADATA_FILENAME, meta.to_json(), overwrite=True)
    return bind_files(meta, storage)


def _units(items, local, knobs, staged: bool):
    if not staged:
        return live_units(items, local, _unit_bytes(knobs, None))
    ring = StagingRing(max(64, sum(aligned(it.byte_range[1] - it.byte_range[0]) for it in items)), pinned=False)
    units: list = []
    stage(items, local, ring, _unit_bytes(knobs, ring.capacity), units.append)
    return units
