"""The gloo groups shardsafe creates for itself (background commits, CPU transport) are named the
same on every rank, in jobs whose ranks belong to different numbers of process groups.

torch names a group created with ``use_local_synchronization=True`` from the number of groups
the calling rank belongs to; with Megatron's pipeline-parallel embedding groups ([0, 3] of 4
ranks, [0, 6] and [1, 7] of TP2 x PP4) ranks disagreed on the background group's name, and an
async save waited on different store keys until the collective timeout. Here, real gloo ranks
save (sync and async, and an async save followed by a sync one before it committed) and load
back bit-exact, with the whole job's group and with a subgroup. A save that one rank gives up
before its background part fails at once on every rank, not after the timeout.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from shardsafe import Checkpointer, CheckpointError
from shardsafe.knobs import KNOBS
from tests.helpers import run_ranks

pytestmark = pytest.mark.xdist_group("dist_groups")

LONG = dataclasses.replace(KNOBS, collective_timeout_s=3600.0)  # a wait that ran into it would hang the test, not pass it


def _full(version: int, ws: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(4 * ws, 3, generator=g), "b": torch.randn(5, generator=g).bfloat16()}


def _state(rank: int, ws: int, version: int) -> dict:
    """Rows of ``w`` sharded by rank (a DTensor), ``b`` replicated, and a step."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    full = _full(version, ws)
    mesh = init_device_mesh("cpu", (ws,))
    return {"w": distribute_tensor(full["w"], mesh, [Shard(0)]), "b": full["b"].clone(), "step": version}


def _loaded_equal(ckpt: Checkpointer, path: str, rank: int, ws: int, version: int, group=None) -> bool:
    target = _state(rank, ws, 0)
    target["w"].to_local().zero_()
    target["b"].zero_()
    ckpt.load(path, target, process_group=group)
    want = _full(version, ws)
    return (
        torch.equal(target["w"].to_local(), want["w"][4 * rank : 4 * rank + 4])
        and torch.equal(target["b"], want["b"])
        and target["step"] == version
    )


def _megatron_like_groups(rank: int, ws: int, tp: int) -> None:
    """Megatron's groups, created by every rank in the same order: TP, PP, and the embedding
    groups (the first and last stage of each pipeline), which only some ranks belong to."""
    pp = ws // tp
    for start in range(0, ws, tp):
        dist.new_group(list(range(start, start + tp)))
    for t in range(tp):
        dist.new_group(list(range(t, ws, tp)))
    for t in range(tp):
        dist.new_group(sorted({t, t + (pp - 1) * tp}))


def _saves_in_a_job_with_embedding_groups(rank: int, ws: int, root: str, tp: int) -> list[bool]:
    _megatron_like_groups(rank, ws, tp)
    ckpt = Checkpointer(knobs=LONG)
    path = {name: os.path.join(root, name) for name in ("async", "sync", "async_then", "sync_after")}
    ckpt.async_save(path["async"], _state(rank, ws, 1)).wait()
    ckpt.save(path["sync"], _state(rank, ws, 2))
    pending = ckpt.async_save(path["async_then"], _state(rank, ws, 3))
    ckpt.save(path["sync_after"], _state(rank, ws, 4))  # before the async save is finalized: Megatron allows this order
    pending.wait()
    return [_loaded_equal(ckpt, path[name], rank, ws, v) for name, v in (("async", 1), ("sync", 2), ("async_then", 3), ("sync_after", 4))]


@pytest.mark.parametrize("ws,tp", [(4, 1), (8, 2)])  # embedding groups [0, 3]; [0, 6] and [1, 7]
def test_saves_and_loads_in_a_job_whose_ranks_belong_to_different_numbers_of_groups(tmp_path, ws, tp):
    assert run_ranks(ws, _saves_in_a_job_with_embedding_groups, str(tmp_path), tp, timeout=900) == [[True] * 4] * ws


def _async_then_sync(rank: int, ws: int, root: str) -> list[bool]:
    ckpt = Checkpointer(knobs=LONG)
    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    pending = ckpt.async_save(a, _state(rank, ws, 5))
    ckpt.save(b, _state(rank, ws, 6))
    pending.wait()
    return [_loaded_equal(ckpt, a, rank, ws, 5), _loaded_equal(ckpt, b, rank, ws, 6)]


@pytest.mark.parametrize("ws", [2, 4])
def test_a_sync_save_right_after_an_async_one_commits_both(tmp_path, ws):
    assert run_ranks(ws, _async_then_sync, str(tmp_path), timeout=600) == [[True, True]] * ws


def _subgroup_saves(rank: int, ws: int, root: str) -> list[bool] | None:
    pair = dist.new_group([0, 3])  # the process group of the saves
    dist.new_group([0, 1])  # rank 0 belongs to one more group than rank 3
    if rank not in (0, 3):
        return None
    ckpt = Checkpointer(knobs=LONG)
    full = _full(7, 2)
    own = full["w"][:4] if rank == 0 else full["w"][4:]
    state = {"b": full["b"].clone(), f"w{rank}": own.clone(), "step": 7}
    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    pending = ckpt.async_save(a, state, process_group=pair)
    ckpt.save(b, state, process_group=pair)
    pending.wait()
    out = []
    for path in (a, b):
        target = {"b": torch.zeros(5, dtype=torch.bfloat16), "w0": torch.zeros(4, 3), "w3": torch.zeros(4, 3), "step": 0}
        ckpt.load(path, target, process_group=pair)
        out.append(
            torch.equal(target["b"], full["b"]) and torch.equal(target["w0"], full["w"][:4]) and torch.equal(target["w3"], full["w"][4:])
            and target["step"] == 7
        )
    return out


def test_saves_over_a_subgroup_whose_ranks_belong_to_different_numbers_of_groups(tmp_path):
    assert run_ranks(4, _subgroup_saves, str(tmp_path), timeout=600) == [[True, True], None, None, [True, True]]


def _one_rank_gives_up(rank: int, ws: int, root: str) -> dict:
    from fractions import Fraction

    ckpt = Checkpointer(knobs=LONG)
    state = _state(rank, ws, 8)
    if rank == 1:
        state["ratio"] = Fraction(1, 3)  # no JSON form and no allow_pickle: this rank's async save fails before its background part
    out: dict = {}
    try:
        pending = ckpt.async_save(os.path.join(root, "a"), state)
    except CheckpointError as e:
        out["async"] = type(e).__name__
    try:
        ckpt.save(os.path.join(root, "b"), _state(rank, ws, 9))  # rank 0 waits here for its own async save first
    except CheckpointError as e:
        out["sync"] = str(e)
    if rank == 0:
        out["wait"] = str(pending.committed.exception())
    return out


def test_a_save_that_a_rank_gave_up_fails_at_once_on_every_rank(tmp_path):
    """Without the notice, rank 0's background commit would wait for rank 1 for the whole
    collective timeout (an hour here), and the sync save on both ranks with it."""
    r0, r1 = run_ranks(2, _one_rank_gives_up, str(tmp_path), timeout=600)
    assert r1["async"] == "PickleNotAllowedError"
    gave_up = "rank 1 gave up this call before checking in, so it cannot complete: PickleNotAllowedError"
    assert gave_up in r0["wait"]
    assert "an earlier async save to" in r0["sync"] and gave_up in r0["sync"]
    assert gave_up in r1["sync"]  # rank 0's error, through the sync save's first collective
    assert not os.path.exists(os.path.join(tmp_path, "a", "metadata.json"))
    assert not os.path.exists(os.path.join(tmp_path, "b", "metadata.json"))
