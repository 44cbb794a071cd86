"""The staging ring and unit queue of async saves, alone (the distributed behaviour is in
test_async_save.py)."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardsafe
from shardsafe.engine.staging import RINGS, RingAborted, StagingRing, UnitQueue
from shardsafe.errors import CheckpointError
from shardsafe.knobs import KNOBS


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(64, 4096), ops=st.lists(st.tuples(st.booleans(), st.integers(1, 2048)), max_size=60))
def test_ring_never_hands_out_overlapping_live_regions(capacity: int, ops: list[tuple[bool, int]]) -> None:
    """Allocations that fit now are placed without overlapping any live region; ones that do not
    fit would wait (checked without waiting); frees are oldest first."""
    ring = StagingRing(capacity, pinned=False)
    live: list[tuple[int, int]] = []
    for do_alloc, n in ops:
        if do_alloc or not live:
            size = -(-n // 64) * 64
            if size > capacity:
                with pytest.raises(ValueError, match=f"a staging unit of {n} bytes does not fit the {capacity}-byte"):
                    ring.alloc(n)
                continue
            if ring._place(size) is None:  # would wait: free room and place it then
                continue
            start = ring.alloc(n)
            assert start % 64 == 0 and start + size <= capacity
            assert all(start + size <= s or start >= e for s, e in live), (start, size, live)
            live.append((start, start + size))
        else:
            ring.free()
            live.pop(0)


def test_ring_alloc_waits_for_a_free_and_abort_wakes_it() -> None:
    ring = StagingRing(256, pinned=False)
    assert ring.alloc(128) == 0
    assert ring.alloc(128) == 128
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(ring.alloc(64)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and got == []  # full: waits
    ring.free()
    t.join(5)
    assert got == [0] and ring.waited >= 1  # wrapped to the freed start
    ring.alloc(64)
    t = threading.Thread(target=lambda: got.append(_raises(ring.alloc, 256)))
    t.start()
    ring.abort()
    t.join(5)
    assert got[-1] is RingAborted


def _raises(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - returned for the assertion
        return type(e)
    return None


def test_unit_queue_hands_the_staging_error_to_the_writer() -> None:
    q = UnitQueue()
    q.close(RuntimeError("CUDA out of memory"))
    with pytest.raises(CheckpointError, match=r"staging this rank's state failed \(RuntimeError: CUDA out of memory\)"):
        list(q)


def test_staging_buffer_is_reused_between_saves(tmp_path) -> None:
    RINGS.clear()
    ck = shardsafe.Checkpointer()
    state = {"a": torch.arange(300_000, dtype=torch.float32), "t": torch.arange(6000.0).reshape(60, 100).t()}
    ck.async_save(tmp_path / "one", state).wait()
    (ring,) = RINGS._free
    buf = ring.buf.data_ptr()
    ck.async_save(tmp_path / "two", state).wait()
    assert [r.buf.data_ptr() for r in RINGS._free] == [buf]  # the same memory, not a fresh allocation
    out = ck.unshard(tmp_path / "two")
    assert torch.equal(out["a"], state["a"]) and torch.equal(out["t"], state["t"])


def test_a_state_larger_than_the_budget_stages_in_parts_and_says_so(tmp_path, caplog) -> None:
    RINGS.clear()
    knobs = dataclasses.replace(KNOBS, async_staging_bytes=2 << 20, write_block_bytes=1 << 20)
    state = {"a": torch.randn(1_500_000), "b": torch.randn(700, 900).t()}  # 6 MB and a strided 2.5 MB
    expected = {k: v.clone() for k, v in state.items()}
    with caplog.at_level(logging.DEBUG, logger="shardsafe"):
        pending = shardsafe.Checkpointer(knobs=knobs).async_save(tmp_path / "c", state)
    for t in state.values():
        t.zero_()
    pending.wait()
    assert any("staged 8520000 bytes in parts through a 2097152-byte buffer" in r.getMessage() for r in caplog.records)
    out = shardsafe.Checkpointer().unshard(tmp_path / "c")
    assert all(torch.equal(out[k], v) for k, v in expected.items())
    assert shardsafe.verify(tmp_path / "c").errors == []


needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("budget", [None, 3 << 20])
@needs_cuda[0]
@needs_cuda[1]
def test_cuda_tensors_stage_into_pinned_memory_and_do_not_leak(tmp_path, budget) -> None:
    """On CUDA the ring is pinned and copies run on a side stream; async_save returns only once
    they are done, so kernels the caller queues next cannot change what is written."""
    RINGS.clear()
    knobs = KNOBS if budget is None else dataclasses.replace(KNOBS, async_staging_bytes=budget, write_block_bytes=1 << 20)
    dev = torch.device("cuda")
    state = {"w": torch.randn(2048, 1024, device=dev), "t": torch.randn(512, 300, device=dev).t(), "b": torch.arange(7, device=dev)}
    expected = {k: v.cpu() for k, v in state.items()}
    state["w"].mul_(1.0)  # work queued on the caller's stream before the save: must be in the checkpoint
    pending = shardsafe.Checkpointer(knobs=knobs).async_save(tmp_path / "g", state)
    for t in state.values():
        t.zero_()
    pending.wait()
    assert all(r.pinned for r in RINGS._free)
    out = shardsafe.Checkpointer().unshard(tmp_path / "g")
    assert all(torch.equal(out[k], v) for k, v in expected.items())
