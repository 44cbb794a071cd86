"""Plan caching: a save whose structure matches the previous save's reuses its plan.

In training, every save has the same keys, shapes, dtypes and placements on the same ranks, so
the plan (who writes which chunk where, each file's header) is the same too: only the data and
the non-tensor values change. Each rank keeps the digest of its last description and its part
of the last plan; the coordinator keeps every rank's digest and description and the whole plan.

Every plan has a random id, which each rank keeps with its part. A rank whose description's
digest equals the one it cached sends only the digest, with the id of the plan its part is
from. When every rank did, the coordinator's cached digests are the same and every rank's part
is from the coordinator's cached plan, the coordinator skips planning and tells each rank to
reuse its part (with this save's file name); anything else plans afresh, never reusing a stale
part. If a rank sent only its digest but the coordinator
has no description for it (its cache was lost), every rank is asked once to send its full
description again.

Entries are per process, keyed by the ranks of the process group and every knob that changes a
plan; a plan does not depend on the directory, so saves to new step directories hit too.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass

from ..planning.save_plan import GlobalPlan, RankDescription, RankWritePlan, data_file_name

__all__ = [
    "CacheKey", "Entry", "count", "lookup", "renamed", "reset", "stats",
    "store_coordinator", "store_rank",
]

CacheKey = tuple  # (global ranks of the group, replica_split_bytes, checksum_block_bytes)


@dataclass
class Entry:
    digest: str | None = None  # this rank's last description
    rank_plan: RankWritePlan | None = None  # this rank's part of the last plan
    rank_plan_id: str | None = None  # the plan it is part of
    digests: tuple[str, ...] | None = None  # coordinator: every rank's
    descs: list[RankDescription] | None = None  # coordinator: every rank's description
    plan: GlobalPlan | None = None  # coordinator: the whole plan
    plan_id: str | None = None  # coordinator: its id


_CACHE: dict[CacheKey, Entry] = {}
_STATS: Counter[str] = Counter()  # "hit", "miss", "resend"


def lookup(key: CacheKey) -> Entry:
    return _CACHE.setdefault(key, Entry())


def store_rank(key: CacheKey, digest: str, rank_plan: RankWritePlan, plan_id: str) -> None:
    entry = lookup(key)
    entry.digest, entry.rank_plan, entry.rank_plan_id = digest, rank_plan, plan_id


def store_coordinator(key: CacheKey, digests: tuple[str, ...], descs: list[RankDescription], plan: GlobalPlan) -> str:
    """Keep the whole plan; returns its new id."""
    entry = lookup(key)
    entry.digests, entry.descs, entry.plan, entry.plan_id = digests, descs, plan, uuid.uuid4().hex
    return entry.plan_id


def renamed(rank_plan: RankWritePlan, rank: int, save_id: str) -> RankWritePlan:
    """``rank_plan`` with the data file name of save ``save_id``."""
    if rank_plan.file is None:
        return rank_plan
    return RankWritePlan(data_file_name(rank, save_id), rank_plan.header, rank_plan.items, rank_plan.sums_range, rank_plan.header_digest)


def count(event: str) -> None:
    _STATS[event] += 1


def stats() -> dict[str, int]:
    """How many saves of this process hit, missed or had to resend their description."""
    return dict(_STATS)


def reset() -> None:
    """Forget every cached plan (the next save plans afresh)."""
    _CACHE.clear()
