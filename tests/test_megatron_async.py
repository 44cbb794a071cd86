"""shardsafe.megatron asynchronous saves: ``save(..., async_sharded_save=True)`` and
``AsyncCallsQueue``, as a Megatron-Core training loop uses them, on real gloo ranks.

The requests carry shardsafe's own background save (``Checkpointer.async_save``): a tensor
changed after scheduling does not reach the checkpoint, finalize functions run on every rank
after the commit and in call order, and a failure on one rank raises on every rank.
"""

from __future__ import annotations

import os

import pytest
import torch

import shardsafe
from shardsafe.megatron import CheckpointingException, ShardedObject, ShardedTensor, load, load_common_state_dict, save
from shardsafe.megatron.strategies import AsyncCallsQueue, AsyncRequest
from tests.helpers import run_ranks


def _state(rank: int, world: int, value: float) -> dict:
    """A row-split weight (TP), a replicated bias (DP replica_id = rank) and a ShardedObject per rank."""
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((2, 3), value + rank), (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", torch.full((5,), value), replica_id=rank),
        "rng": ShardedObject("rng", {"seed": rank}, (world,), (rank,)),
        "iteration": int(value),
    }


def _expected_w(world: int, value: float) -> torch.Tensor:
    return torch.cat([torch.full((2, 3), value + r) for r in range(world)])


def _queue_in_order(rank: int, world: int, root: str) -> dict:
    queue = AsyncCallsQueue()
    events: list[tuple] = []
    states = []
    for n, value in enumerate((10.0, 20.0)):
        path = os.path.join(root, f"iter_{n}")
        state = _state(rank, world, value)
        states.append(state)
        request = save(state, path, async_sharded_save=True)
        assert isinstance(request, AsyncRequest)
        # what a finalize fn sees: the checkpoint is committed (its common state loads without a group)
        request.add_finalize_fn(lambda n=n, path=path: events.append((n, load_common_state_dict(path)["iteration"])))
        assert queue.schedule_async_request(request) == n
        for v in state.values():  # training goes on: the tensors change at once
            if isinstance(v, ShardedTensor):
                v.data.fill_(-1.0)
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    empty = queue.maybe_finalize_async_calls(blocking=False)
    loaded = []
    for n, value in enumerate((10.0, 20.0)):
        target = {  # every rank reads all of it: a DP replica each
            "w": ShardedTensor.from_rank_offsets("w", torch.zeros(2 * world, 3), replica_id=rank),
            "b": ShardedTensor.from_rank_offsets("b", torch.zeros(5), replica_id=rank),
        }
        got = load(target, os.path.join(root, f"iter_{n}"))
        loaded.append((torch.equal(got["w"], _expected_w(world, value)), torch.equal(got["b"], torch.full((5,), value)), got["iteration"]))
    queue.close()
    return {"finalized": finalized, "empty": empty, "events": events, "loaded": loaded, "left": queue.get_num_unfinalized_calls()}


def test_queue_finalizes_in_call_order_on_every_rank_after_the_commit_and_staged_values_are_saved(tmp_path):
    results = run_ranks(2, _queue_in_order, str(tmp_path))
    for r in results:
        assert r["finalized"] == [0, 1]
        assert r["empty"] == []
        assert r["events"] == [(0, 10), (1, 20)]
        assert r["loaded"] == [(True, True, 10), (True, True, 20)]
        assert r["left"] == 0


def _boom(rank: int) -> None:
    if rank == 1:
        raise OSError(f"disk full on rank {rank}")


def _failure_on_one_rank(rank: int, world: int, root: str) -> dict:
    queue = AsyncCallsQueue()
    ran: list[str] = []
    queue.schedule_async_request(AsyncRequest(_boom, (rank,), [lambda: ran.append("failed call finalized")]))
    request = save(_state(rank, world, 3.0), os.path.join(root, "c"), async_sharded_save=True)
    request.add_finalize_fn(lambda: ran.append("save finalized"))
    queue.schedule_async_request(request)
    with pytest.raises(CheckpointingException, match=r"async call 0 failed on rank\(s\) \[1\]: rank 1: OSError: disk full on rank 1") as info:
        queue.maybe_finalize_async_calls(blocking=True)
    cause = type(info.value.__cause__).__name__ if info.value.__cause__ is not None else None
    after = queue.maybe_finalize_async_calls(blocking=True)
    return {"cause": cause, "after": after, "ran": ran}


def test_a_failed_call_raises_on_every_rank_and_later_calls_still_finalize(tmp_path):
    results = run_ranks(2, _failure_on_one_rank, str(tmp_path))
    assert results[0] == {"cause": None, "after": [1], "ran": ["save finalized"]}
    assert results[1] == {"cause": "OSError", "after": [1], "ran": ["save finalized"]}


def _mismatched_queues(rank: int, world: int) -> str:
    queue = AsyncCallsQueue()
    if rank == 0:
        queue.schedule_async_request(AsyncRequest(None, (), []))
    with pytest.raises(CheckpointingException, match=r"queues differ \(oldest call index per rank, -1 for none: \{0: 0, 1: -1\}\)") as info:
        queue.maybe_finalize_async_calls()
    return str(info.value)


def test_ranks_with_different_queues_are_refused_on_every_rank():
    results = run_ranks(2, _mismatched_queues)
    assert results[0] == results[1]


def test_queue_in_one_process_runs_foreign_requests_and_preload(tmp_path):
    queue = AsyncCallsQueue(persistent=True)
    seen: list = []
    request = AsyncRequest(lambda a, staged, c: seen.append((a, staged, c)), ("a", None, "c"), [lambda: seen.append("fin")],
                           preload_fn=lambda: "staged")
    assert queue.schedule_async_request(request) == 0
    assert seen == [("a", "staged", "c")]  # ran when scheduled
    assert queue.get_num_unfinalized_calls() == 1
    assert queue.maybe_finalize_async_calls(no_dist=True) == [0]
    assert seen[-1] == "fin"
    with pytest.raises(TypeError, match="async_request must be an AsyncRequest, not tuple"):
        queue.schedule_async_request((None, (), []))  # type: ignore[arg-type]
    path = str(tmp_path / "c")
    state = {"x": ShardedTensor.from_rank_offsets("x", torch.arange(4.0))}
    queue.schedule_async_request(save(state, path, async_sharded_save=True))
    state["x"].data.zero_()
    queue.close()
    assert queue.get_num_unfinalized_calls() == 0
    assert torch.equal(load({"x": ShardedTensor.from_rank_offsets("x", torch.zeros(4))}, path)["x"], torch.arange(4.0))


class _FailingWrites:
    """A local checkpoint directory whose data files cannot be written (a full disk)."""

    def __init__(self, path: str) -> None:
        from shardsafe.storage import open_storage

        self.inner = open_storage(path)

    def write_file(self, name: str):
        raise OSError(28, "No space left on device", name)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _save_fails_in_background(rank: int, world: int, root: str) -> dict:
    queue = AsyncCallsQueue()
    ran: list[str] = []
    where = _FailingWrites(os.path.join(root, "c")) if rank == 1 else os.path.join(root, "c")
    request = save(_state(rank, world, 3.0), where, async_sharded_save=True)
    request.add_finalize_fn(lambda: ran.append("finalized"))
    queue.schedule_async_request(request)
    try:
        queue.maybe_finalize_async_calls(blocking=True)
    except Exception as e:  # noqa: BLE001 - returned to the test
        return {"type": type(e).__name__, "is_checkpoint_error": isinstance(e, shardsafe.CheckpointError), "message": str(e),
                "ran": ran, "left": queue.get_num_unfinalized_calls(), "committed": os.path.exists(os.path.join(root, "c", "metadata.json"))}
    return {"ran": ran}


def test_a_background_save_that_fails_on_one_rank_raises_on_every_rank_without_finalizing(tmp_path):
    results = run_ranks(2, _save_fails_in_background, str(tmp_path))
    for r in results:
        assert r["is_checkpoint_error"] and r["ran"] == [] and r["left"] == 0 and not r["committed"]
        assert "rank 1" in r["message"] and "No space left on device" in r["message"], r["message"]
    assert results[0]["type"] == results[1]["type"]
