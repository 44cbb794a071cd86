"""shardsafe's strategies inside real megatron-core 0.15 (``register_with_megatron``), on real
gloo ranks: Megatron's own ``dist_checkpointing.save`` writes shardsafe's format (sync and
async through Megatron's ``AsyncCallsQueue``) and its ``load`` finds shardsafe's strategy from
the checkpoint. megatron-core's torch_dist code calls ``torch.cuda.synchronize`` and
``torch.cuda.current_device``; the ranks make them CPU no-ops (the device is ``'cpu'``).
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from tests.helpers import run_ranks

pytest.importorskip("megatron.core.dist_checkpointing")


def _cpu_only(monkeypatch_target=torch.cuda) -> None:
    monkeypatch_target.synchronize = lambda *a, **k: None
    monkeypatch_target.current_device = lambda: "cpu"


def _megatron_state(rank: int, world: int, value: float, load: bool = False) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    w = torch.zeros(2, 4) if load else torch.arange(8.0).reshape(2, 4) + 100 * rank + value
    b = torch.zeros(3, dtype=torch.bfloat16) if load else torch.full((3,), value, dtype=torch.bfloat16)
    return {
        "w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world)),  # split along dim 0
        "b": ShardedTensor.from_rank_offsets("b", b, replica_id=rank),  # replicated
        "rng": ShardedObject("rng", None if load else {"seed": rank, "value": value}, (world,), (rank,)),
        "iteration": int(value),
        "args": argparse.Namespace(lr=0.5, tp=world),
    }


def _through_megatron(rank: int, world: int, root: str) -> dict:
    _cpu_only()
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    import shardsafe
    from shardsafe.megatron import register_with_megatron

    out: dict = {}
    sync_dir, async_dir, ours_dir = os.path.join(root, "sync"), os.path.join(root, "async"), os.path.join(root, "ours")
    for d in (sync_dir, async_dir):
        os.makedirs(d, exist_ok=True)
    try:  # before registering, Megatron knows no such backend
        mdc.save(_megatron_state(rank, world, 1.0), sync_dir, sharded_strategy=("shardsafe", 1))
    except mdc.core.CheckpointingException as e:
        out["before"] = str(e)
    register_with_megatron()
    register_with_megatron()  # twice: nothing changes
    mdc.save(_megatron_state(rank, world, 1.0), sync_dir, sharded_strategy=("shardsafe", 1))
    request = mdc.save(_megatron_state(rank, world, 2.0), async_dir, sharded_strategy=("shardsafe", 1), async_sharded_save=True)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    out["finalized"] = queue.maybe_finalize_async_calls(blocking=True)
    for name, d, value in (("sync", sync_dir, 1.0), ("async", async_dir, 2.0)):
        got = mdc.load(_megatron_state(rank, world, 0.0, load=True), d)  # the strategy comes from the checkpoint
        whole = shardsafe.Checkpointer().unshard(d, no_dist=True)["w"] if rank == 0 else None
        out[name] = {
            "w": torch.equal(got["w"], torch.arange(8.0).reshape(2, 4) + 100 * rank + value),
            "b": torch.equal(got["b"], torch.full((3,), value, dtype=torch.bfloat16)),
            "rng": got["rng"],
            "iteration": got["iteration"],
            "args": vars(got["args"]),
            "config": str(mdc.core.maybe_load_config(d)),
            "unshard": None if whole is None else torch.equal(whole, torch.cat([torch.arange(8.0).reshape(2, 4) + 100 * r + value for r in range(world)])),
            "verify": shardsafe.verify(d).chunks if rank == 0 else None,
        }
    # Megatron's checkpoint through shardsafe.megatron (its common state is Megatron's common.pt)
    from shardsafe.megatron import ShardedObject, ShardedTensor, load, save

    got = load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4), (0, rank, world))}, sync_dir)
    out["ours_load"] = (torch.equal(got["w"], torch.arange(8.0).reshape(2, 4) + 100 * rank + 1.0), got["iteration"], vars(got["args"]))
    # shardsafe.megatron's checkpoint through Megatron (the common state is inside metadata.json)
    save({
        "w": ShardedTensor.from_rank_offsets("w", torch.full((2, 4), 3.0 + rank), (0, rank, world)),
        "rng": ShardedObject("rng", {"seed": 10 + rank}, (world,), (rank,)),
        "iteration": 3,
    }, ours_dir)
    got = mdc.load(_megatron_state(rank, world, 0.0, load=True) | {"b": None, "args": None}, ours_dir)
    out["megatron_load"] = (torch.equal(got["w"], torch.full((2, 4), 3.0 + rank)), got["rng"], got["iteration"])
    return out


def test_megatron_save_and_load_run_on_shardsafe_strategies(tmp_path):
    results = run_ranks(2, _through_megatron, str(tmp_path), timeout=240)
    for rank, r in enumerate(results):
        assert r["finalized"] == [0]
        for name, value in (("sync", 1.0), ("async", 2.0)):
            got = r[name]
            assert got["w"] and got["b"]
            assert got["rng"] == {"seed": rank, "value": value}
            assert got["iteration"] == int(value) and got["args"] == {"lr": 0.5, "tp": 2}
            assert got["config"] == (
                "CheckpointingConfig(sharded_backend='shardsafe', sharded_backend_version=1, common_backend='torch', common_backend_version=1)"
            )
        assert r["before"] == "Cannot find a default strategy for: ('save_sharded', 'shardsafe', 1)"
        assert r["ours_load"] == (True, 1, {"lr": 0.5, "tp": 2})
        assert r["megatron_load"] == (True, {"seed": 10 + rank}, 3)
    assert results[0]["sync"]["unshard"] and results[0]["async"]["unshard"]
    assert results[0]["sync"]["verify"] == results[0]["async"]["verify"] > 0
