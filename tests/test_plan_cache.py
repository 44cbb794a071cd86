"""Plan caching: a save with the previous save's structure reuses its plan; any change plans afresh."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardsafe import Checkpointer
from shardsafe.dist import collective_counts
from shardsafe.engine import plan_cache
from shardsafe.knobs import KNOBS

from .helpers import run_ranks


def _state(rank: int, ws: int, *, step: int, shard_dim: int = 0, extra: bool = False, dtype=torch.float32, rows: int = 8):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    g = torch.Generator().manual_seed(step)
    full = {"w": torch.randn(rows, 6, generator=g).to(dtype), "b": torch.randn(5, generator=g).to(dtype)}
    if extra:
        full["new"] = torch.arange(4.0)
    sd: dict = {k: distribute_tensor(v, mesh, [Shard(shard_dim if v.dim() > 1 else 0)]) for k, v in full.items()}
    sd["step"] = step
    return sd, full


def _save_twice(rank: int, ws: int, path: str, change: str) -> dict:
    before = dict(plan_cache.stats())
    sd1, _ = _state(rank, ws, step=1)
    Checkpointer().save(f"{path}/a", sd1)
    counts_after_first = collective_counts()
    kwargs = {
        "same": {},
        "new-key": {"extra": True},
        "shape": {"rows": 10},
        "dtype": {"dtype": torch.float64},
        "placement": {"shard_dim": 1},
    }.get(change, {})
    sd2, full2 = _state(rank, ws, step=2, **kwargs)
    knobs = dataclasses.replace(KNOBS, replica_split_bytes=KNOBS.replica_split_bytes // 2) if change == "knob" else KNOBS
    if change == "coordinator-forgot" and rank == 0:
        plan_cache.reset()
    Checkpointer(knobs=knobs).save(f"{path}/b", sd2)
    counts = {k: v - counts_after_first.get(k, 0) for k, v in collective_counts().items()}
    after = plan_cache.stats()
    # the second checkpoint holds the second state, bit for bit
    got = Checkpointer().unshard(f"{path}/b", no_dist=True)
    for key, want in full2.items():
        assert torch.equal(got[key].view(torch.uint8), want.contiguous().view(torch.uint8)), key
    assert got["step"] == 2
    return {"stats": {k: after.get(k, 0) - before.get(k, 0) for k in ("hit", "miss", "resend")}, "counts": counts}


def test_a_second_save_of_the_same_structure_reuses_the_plan(tmp_path):
    results = run_ranks(2, _save_twice, str(tmp_path), "same")
    assert results[0]["stats"] == {"hit": 1, "miss": 1, "resend": 0}  # the coordinator planned once
    # the same small, fixed number of collectives as a first save; no plan and no description crossed
    assert [r["counts"] for r in results] == [{"arrive": 1, "gather": 2, "scatter": 1, "broadcast": 1}] * 2
    meta_a = Checkpointer().get_metadata(str(tmp_path / "a"), no_dist=True)
    meta_b = Checkpointer().get_metadata(str(tmp_path / "b"), no_dist=True)
    assert not meta_a.data_files() & meta_b.data_files()  # each save its own files
    layout = lambda m: {k: sorted((s.global_offset, s.local_shape, s.byte_range) for _, s in t.chunks()) for k, t in m.tensors.items()}  # noqa: E731
    assert layout(meta_a) == layout(meta_b)


@pytest.mark.parametrize("change", ["new-key", "shape", "dtype", "placement", "knob"])
def test_a_changed_structure_plans_afresh(tmp_path, change):
    results = run_ranks(2, _save_twice, str(tmp_path), change)
    assert results[0]["stats"] == {"hit": 0, "miss": 2, "resend": 0}


def test_a_coordinator_that_lost_its_cache_asks_once_for_full_descriptions(tmp_path):
    results = run_ranks(2, _save_twice, str(tmp_path), "coordinator-forgot")
    assert results[0]["stats"] == {"hit": 0, "miss": 2, "resend": 1}
    assert results[1]["counts"] == {"arrive": 1, "gather": 3, "scatter": 2, "broadcast": 1}  # one more round, once


def _save_on_a_subgroup_then_the_world(rank: int, ws: int, path: str) -> dict:
    import torch.distributed as dist

    before = dict(plan_cache.stats())
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        Checkpointer().save(f"{path}/sub", {"x": torch.arange(4.0), "step": 1}, process_group=sub)
    Checkpointer().save(f"{path}/world", {"x": torch.arange(4.0), "step": 1})  # 4 ranks: another plan
    after = plan_cache.stats()
    return {k: after.get(k, 0) - before.get(k, 0) for k in ("hit", "miss")}


def test_another_world_size_plans_afresh(tmp_path):
    results = run_ranks(4, _save_on_a_subgroup_then_the_world, str(tmp_path))
    assert results[0] == {"hit": 0, "miss": 2}
    got = Checkpointer().unshard(str(tmp_path / "world"), no_dist=True)
    assert torch.equal(got["x"], torch.arange(4.0))


def test_a_single_process_reuses_its_plan(tmp_path):
    plan_cache.reset()  # this test process may have saved this structure before
    before = dict(plan_cache.stats())
    for step in (1, 2, 3):
        Checkpointer().save(str(tmp_path / f"s{step}"), {"w": torch.full((3, 2), float(step)), "step": step})
    after = plan_cache.stats()
    assert {k: after.get(k, 0) - before.get(k, 0) for k in ("hit", "miss")} == {"hit": 2, "miss": 1}
    got = Checkpointer().unshard(str(tmp_path / "s3"), no_dist=True)
    assert torch.equal(got["w"], torch.full((3, 2), 3.0)) and got["step"] == 3


def _stale_part_on_one_rank(rank: int, ws: int, path: str) -> dict:
    """Rank 1 keeps its part of save a's plan while its digest says save b's structure (as if
    b's plan had not reached it). Save c has b's structure: a's part is stale and must not be
    reused."""
    before = dict(plan_cache.stats())
    key = ((0, 1), KNOBS.replica_split_bytes, KNOBS.checksum_block_bytes)
    Checkpointer().save(f"{path}/a", {"x": torch.arange(4.0), "y": torch.ones(3)})
    kept = dataclasses.replace(plan_cache.lookup(key))
    Checkpointer().save(f"{path}/b", {"x": torch.arange(4.0), "y": torch.ones(3), "z": torch.zeros(2)})
    if rank == 1:
        entry = plan_cache.lookup(key)
        entry.rank_plan, entry.rank_plan_id = kept.rank_plan, kept.rank_plan_id
    Checkpointer().save(f"{path}/c", {"x": torch.arange(4.0) * 2, "y": torch.ones(3) * 3, "z": torch.full((2,), 5.0)})
    after = plan_cache.stats()
    got = Checkpointer().unshard(f"{path}/c", no_dist=True)
    assert torch.equal(got["x"], torch.arange(4.0) * 2) and torch.equal(got["z"], torch.full((2,), 5.0))
    return {k: after.get(k, 0) - before.get(k, 0) for k in ("hit", "miss")}


def test_a_rank_with_a_stale_part_gets_a_fresh_plan(tmp_path):
    results = run_ranks(2, _stale_part_on_one_rank, str(tmp_path))
    assert results[0] == {"hit": 0, "miss": 3}
