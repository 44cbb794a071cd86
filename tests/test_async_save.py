"""``async_save``: what it promises, proved on real files and real gloo ranks.

- the checkpoint holds the state as it was when ``async_save`` returned, whatever the caller
  changes afterwards (plain tensors, views, DTensors, FSDP2 models and optimizers, replicated
  tensors split over ranks, a save staged in parts under a small staging budget);
- saves commit in call order, one in flight by default (``knobs.async_max_in_flight`` allows more);
- a failure in the background on one rank (a real ``EFBIG`` from ``RLIMIT_FSIZE``) surfaces on
  every rank from ``wait()``, from ``committed``, and from the next save if nobody looked; the
  failed save leaves nothing behind and the checkpoint it would have replaced still loads;
- a rank killed with SIGKILL during its background write: the other ranks' ``wait()`` raises
  instead of hanging, the last committed checkpoint loads bit-exact, the new one is refused;
- a process that returns from ``main`` with a save in flight commits it before it exits;
- object stores: a save still in flight (retrying throttled requests) is not ``done()``, and
  loads bit-exact once it is.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing as mp
import os
import resource
import signal
import sys
import time
from collections import Counter
from datetime import timedelta

import pytest
import torch

import shardsafe
from shardsafe import Checkpointer, CheckpointError, IncompleteCheckpointError, StorageMetadata
from shardsafe.knobs import KNOBS, Knobs
from shardsafe.storage import open_storage

from .helpers import dtensor, free_port, full_tensor, run_process, run_ranks
from .servers import fresh
from .training import assert_states_match, build, full_state, train_step

pytestmark = pytest.mark.xdist_group("async_save")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def knobs(**changes: int) -> Knobs:
    return dataclasses.replace(KNOBS, **changes)


# --- a plain state, one process ------------------------------------------------------------------

PLAIN = {  # key: (shape, dtype)
    "w": ((1024, 1024), torch.float32),
    "b": ((333,), torch.bfloat16),
    "m": ((64, 48), torch.float64),
    "mask": ((100,), torch.bool),
    "i": ((50,), torch.int64),
    "s": ((), torch.float32),
    "base": ((96, 40), torch.float32),
}


def _plain(version: int) -> dict:
    """The tensors of ``PLAIN`` at ``version`` and ``"wt"``, a transposed view of ``"base"``
    (saved as its own values, not its base's layout)."""
    sd = {k: full_tensor(f"{k}@{version}", shape, dtype) for k, (shape, dtype) in PLAIN.items()}
    sd["wt"] = sd["base"].t()
    return sd


def _change(tensors) -> None:
    """Change every element of every tensor, in place, as a training step would."""
    for t in tensors:
        if t.dtype == torch.bool:
            t.logical_not_()
            continue
        t.add_(1)
        if t.numel() > 1 and t.is_contiguous():
            t.view(-1)[::2].zero_()


def _assert_plain(out: dict, version: int) -> None:
    want = _plain(version)
    assert sorted(k for k in out if isinstance(out[k], torch.Tensor)) == sorted(want)
    for k, w in want.items():
        assert out[k].dtype == w.dtype and torch.equal(out[k], w), k


def test_tensors_changed_after_async_save_returns_are_not_in_the_checkpoint(tmp_path):
    path = str(tmp_path / "c")
    sd = _plain(1)
    h = Checkpointer().async_save(path, sd)
    assert h.staged.done() and h.location == path
    _change(t for k, t in sd.items() if k != "wt")  # "wt" changes with "base"
    meta, files = h.wait()
    _assert_plain(Checkpointer().unshard(path), 1)
    assert meta == Checkpointer().get_metadata(path) and len(files) == 1


def test_values_changed_after_async_save_returns_are_not_in_the_checkpoint(tmp_path):
    path = str(tmp_path / "c")
    sd = {"t": full_tensor("t", (8, 8)), "step": 5, "cfg": {"lr": 0.5, "betas": [0.9, 0.99]}}
    h = Checkpointer().async_save(path, sd)
    sd["step"] = 6
    sd["cfg"]["lr"] = 0.25
    sd["cfg"]["betas"].append(0.999)
    sd["new"] = 1
    del sd["t"]
    h.wait()
    out = Checkpointer().unshard(path)
    assert out.keys() == {"t", "step", "cfg"}
    assert out["step"] == 5 and out["cfg"] == {"lr": 0.5, "betas": [0.9, 0.99]}
    assert torch.equal(out["t"], full_tensor("t", (8, 8)))


def test_saves_commit_in_call_order_one_in_flight_by_default(tmp_path):
    ckpt = Checkpointer()
    sd = _plain(1)
    first = ckpt.async_save(str(tmp_path / "a"), sd)
    _change(t for k, t in sd.items() if k != "wt")
    for t, new in zip(sd.values(), _plain(2).values()):
        t.copy_(new)
    second = ckpt.async_save(str(tmp_path / "b"), sd)
    assert first.done(), "the second async_save must first wait for the first save's commit"
    for t, new in zip(sd.values(), _plain(3).values()):
        t.copy_(new)
    meta, files = ckpt.save(str(tmp_path / "c"), sd)
    assert second.done(), "a synchronous save must first wait for the save in flight"
    for h in (first, second):  # observed after the fact: the result, at once, as often as asked
        assert h.done() and h.staged.done()
        assert h.wait(timeout=0.0) == h.committed.result(timeout=0.0) == h.wait()
        assert "committed" in repr(h)
    assert first.wait()[0] == ckpt.get_metadata(str(tmp_path / "a")) != second.wait()[0]
    for name, version in (("a", 1), ("b", 2), ("c", 3)):
        _assert_plain(Checkpointer().unshard(str(tmp_path / name)), version)


def test_a_load_of_a_location_with_a_save_in_flight_reads_what_that_save_commits(tmp_path):
    path = str(tmp_path / "c")
    sd = _plain(1)
    h = Checkpointer().async_save(path, sd)
    _change(t for k, t in sd.items() if k != "wt")
    target = {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in PLAIN.items()}
    Checkpointer().load(path, target)  # no wait() first
    assert h.done()
    for k, w in _plain(1).items():
        if k != "wt":
            assert torch.equal(target[k], w), k


def test_async_max_in_flight_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("SHARDSAFE_ASYNC_MAX_IN_FLIGHT", "3")
    monkeypatch.setenv("SHARDSAFE_ASYNC_STAGING_BYTES", str(5 << 20))
    k = Knobs.from_env()
    assert (k.async_max_in_flight, k.async_staging_bytes) == (3, 5 << 20)
    assert KNOBS.async_max_in_flight == 1


# --- the descriptions and staging layout reused from save to save -----------------------------------


def test_tensors_given_new_memory_between_two_async_saves_are_saved_from_it(tmp_path):
    # the second save reuses the first one's descriptions only for tensors that kept their memory
    ckpt = Checkpointer()
    sd = _plain(1)
    ckpt.async_save(str(tmp_path / "a"), sd).wait()
    new = _plain(2)
    sd["w"].data = new["w"].clone()  # new storage, same tensor object
    sd["m"].set_(new["m"].clone())  # the same, through set_
    sd["b"] = new["b"].clone()  # a new tensor object under the key
    sd["i"].resize_(25)  # the same memory, another shape
    sd["i"].copy_(new["i"][:25])
    for key in ("mask", "s", "base"):  # the same memory, changed in place
        sd[key].copy_(new[key])
    ckpt.async_save(str(tmp_path / "b"), sd).wait()
    out = Checkpointer().unshard(str(tmp_path / "b"))
    for key in ("w", "m", "b", "mask", "s", "base"):
        assert torch.equal(out[key], new[key]), key
    assert torch.equal(out["wt"], new["base"].t()) and torch.equal(out["i"], new["i"][:25])
    _assert_plain(Checkpointer().unshard(str(tmp_path / "a")), 1)


def test_a_saved_state_that_is_dropped_is_not_kept_alive_by_the_next_saves_caches(tmp_path):
    import gc
    import weakref

    from shardsafe.engine import writer
    from shardsafe.engine.staging import RINGS

    ckpt = Checkpointer()
    sd = _plain(1)
    for name in ("a", "b"):  # the second save reuses the first one's descriptions and layout
        ckpt.async_save(str(tmp_path / name), sd).wait()
    ids = {id(v) for v in sd.values()}
    assert ids <= writer._DESCRIBED._entries.keys()
    layouts = [r.layout for r in RINGS._free if r.layout is not None and len(r.layout.tensors) == len(sd)]
    assert layouts and all(ref() is not None for ref in layouts[-1].tensors)
    refs = [weakref.ref(v) for v in sd.values()]
    del sd
    gc.collect()
    assert all(r() is None for r in refs)
    assert not ids & writer._DESCRIBED._entries.keys()  # and with them the views on their memory
    assert all(ref() is None for ref in layouts[-1].tensors)
    _assert_plain(Checkpointer().unshard(str(tmp_path / "b")), 1)


def _dtensors_given_new_memory(rank, ws, root):
    ckpt = Checkpointer()
    sd = _dist_state(ws, 1)
    ckpt.async_save(os.path.join(root, "a"), sd).wait()
    new = _dist_state(ws, 2)
    sd["sharded"]._local_tensor.set_(new["sharded"]._local_tensor.clone())  # the same local tensor object, new memory
    sd["cols"] = new["cols"]  # a new DTensor under the key
    sd["rep_dt"]._local_tensor.copy_(new["rep_dt"]._local_tensor)  # in place
    for key in ("big_rep", "small_rep"):
        sd[key].copy_(new[key])
    ckpt.async_save(os.path.join(root, "b"), sd).wait()
    return True


def test_dtensors_given_new_memory_between_two_async_saves_are_saved_from_it(tmp_path):
    assert run_ranks(2, _dtensors_given_new_memory, str(tmp_path)) == [True, True]
    _assert_dist(str(tmp_path / "a"), 1)
    _assert_dist(str(tmp_path / "b"), 2)


# --- sharded and replicated tensors on gloo ranks --------------------------------------------------

SPLIT = 64 << 10
DIST = {  # key: (global shape, placement: "S0" / "R" DTensor, "plain": a replicated torch.Tensor)
    "sharded": ((96, 300), "S0"),
    "cols": ((10, 37), "S1"),  # uneven
    "rep_dt": ((32, 32), "R"),
    "big_rep": ((512, 256), "plain"),  # 512 KiB > SPLIT: written in parts by every rank
    "small_rep": ((10, 10), "plain"),
}


def _dist_state(ws: int, version: int) -> dict:
    out = {}
    for key, (shape, placement) in DIST.items():
        name = f"{key}@{version}"
        out[key] = full_tensor(name, shape) if placement == "plain" else dtensor(name, shape, (ws,), [placement])
    return out


def _locals(sd: dict) -> list[torch.Tensor]:
    return [v.to_local() if hasattr(v, "to_local") else v for v in sd.values() if isinstance(v, torch.Tensor)]


def _assert_dist(path: str, version: int) -> None:
    out = Checkpointer().unshard(path)
    for key, (shape, _) in DIST.items():
        assert torch.equal(out[key], full_tensor(f"{key}@{version}", shape)), key


def _async_then_change(rank, ws, path):
    sd = _dist_state(ws, 1)
    h = Checkpointer(knobs=knobs(replica_split_bytes=SPLIT)).async_save(path, {**sd, "step": 3})
    _change(_locals(sd))
    meta, files = h.wait()
    return meta.model_dump(), [os.path.basename(f) for f in files]


@pytest.mark.parametrize("ws", [2, 4])
def test_sharded_and_split_replicated_tensors_changed_after_return_are_not_in_the_checkpoint(tmp_path, ws):
    path = str(tmp_path / "c")
    results = run_ranks(ws, _async_then_change, path)
    _assert_dist(path, 1)
    meta = Checkpointer().get_metadata(path)
    assert StorageMetadata.model_validate(results[0][0]) == meta  # what the save returned is what it committed
    big = meta.tensors["big_rep"]
    assert big.chunk_count() == ws and len({file for file, _ in big.chunks()}) == ws  # split over every rank
    assert [len(files) for _, files in results] == [1] * ws


class _Said(logging.Handler):
    """The lines of shardsafe's loggers, DEBUG and louder (shardsafe logs its diagnostics at DEBUG)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _staged_in_parts(rank, ws, root, budget):
    """Save twice, in a fresh process (no staging buffer kept from an earlier save): over the
    budget, then with the default budget; what shardsafe logged during each."""
    logger = logging.getLogger("shardsafe")
    said, level = _Said(), logger.level
    logger.addHandler(said)
    logger.setLevel(logging.DEBUG)
    try:
        lines = []
        for name, ckpt in (("parts", Checkpointer(knobs=knobs(replica_split_bytes=SPLIT, async_staging_bytes=budget))),
                           ("whole", Checkpointer(knobs=knobs(replica_split_bytes=SPLIT)))):
            sd = {**_dist_state(ws, 1), **_bulk(ws, 1)}
            h = ckpt.async_save(os.path.join(root, name), sd)
            _change(_locals(sd))
            h.wait()
            lines.append(said.lines[:])
            said.lines.clear()
        return lines
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)


def _bulk(ws: int, version: int) -> dict:
    """3 MiB of rows on every rank, and a 2 MiB replicated tensor that is a transposed view."""
    return {"bulk": dtensor(f"bulk@{version}", (ws * 768, 1024), (ws,), ["S0"]), "wt": full_tensor(f"wt@{version}", (512, 1024)).t()}


@pytest.mark.parametrize(("ws", "budget"), [(1, 1 << 20), (2, 1 << 20), (2, 64 << 10)], ids=["ws1-1MiB", "ws2-1MiB", "ws2-64KiB"])
def test_a_save_larger_than_the_staging_budget_is_staged_in_parts_and_says_so(tmp_path, ws, budget):
    results = run_ranks(ws, _staged_in_parts, str(tmp_path), budget)
    for rank, (parts, whole) in enumerate(results):
        assert [line for line in parts if "in parts" in line], f"rank {rank}: no DEBUG line on logger shardsafe says the save staged in parts: {parts}"
        assert not [line for line in whole if "in parts" in line], f"rank {rank}: {whole}"
    for name in ("parts", "whole"):
        _assert_dist(str(tmp_path / name), 1)
        out = Checkpointer().unshard(str(tmp_path / name))
        assert torch.equal(out["bulk"], full_tensor("bulk@1", (ws * 768, 1024)))
        assert torch.equal(out["wt"], full_tensor("wt@1", (512, 1024)).t())


def _fsdp2_train_after_async_save(rank, ws, path):
    model, optim = build("fsdp2", ws, seed=0)
    train_step(model, optim, 0)
    truth = full_state(model, optim)
    h = shardsafe.async_save_model_and_optim_state(path, model, optim)
    train_step(model, optim, 1)  # changes every parameter and every optimizer state in place
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    files = h.wait()
    fresh_model, fresh_optim = build("fsdp2", ws, seed=7)
    shardsafe.load_model_and_optim_state(path, fresh_model, fresh_optim)
    assert_states_match(full_state(fresh_model, fresh_optim), truth, True, f"rank {rank}: loaded after training on")
    return [os.path.basename(f) for f in files]


def test_fsdp2_model_and_optimizer_trained_on_right_after_async_save(tmp_path):
    files = run_ranks(2, _fsdp2_train_after_async_save, str(tmp_path / "c"))
    assert [len(f) for f in files] == [1, 1]


def _two_in_flight(rank, ws, root):
    ckpt = Checkpointer(knobs=knobs(async_max_in_flight=2))
    sd = _dist_state(ws, 1)
    handles = []
    for name, version in (("a", 1), ("b", 2), ("over", 3), ("over", 4)):
        for t, new in zip(_locals(sd), _locals(_dist_state(ws, version))):
            t.copy_(new)
        handles.append(ckpt.async_save(os.path.join(root, name), sd, save_overwrite=name == "over"))
    _change(_locals(sd))
    order, results = [], {}
    for i in (3, 1, 2, 0):  # waited out of order: the commits still happen in call order
        results[i] = handles[i].wait()
        order.append([h.done() for h in handles[:i]])
    return order, [(results[i][0].model_dump(), [os.path.basename(f) for f in results[i][1]]) for i in range(4)]


def test_two_saves_in_flight_commit_in_call_order(tmp_path):
    root = str(tmp_path)
    results = run_ranks(2, _two_in_flight, root)
    for order, _ in results:
        assert order == [[True] * 3, [True], [True] * 2, []], "a save committed before an earlier one"
    _assert_dist(os.path.join(root, "a"), 1)
    _assert_dist(os.path.join(root, "b"), 2)
    _assert_dist(os.path.join(root, "over"), 4)  # the later of the two saves to one directory
    last = StorageMetadata.model_validate(results[0][1][3][0])
    assert Checkpointer().get_metadata(os.path.join(root, "over")) == last
    # the overwritten save's files are gone: the directory holds the last commit and its files only
    assert sorted(os.listdir(os.path.join(root, "over"))) == sorted({"metadata.json", *last.data_files()})


# --- a failure in the background ------------------------------------------------------------------

LIMIT = 256 << 10  # rank 1 may not write a file larger than this: its 1 MiB data file fails with EFBIG


def _rank_state(ws: int, version: int, rows_per_rank: int) -> dict:
    """A (ws * rows_per_rank, 1024) float32 tensor sharded by rows, and a step."""
    return {"w": dtensor(f"w@{version}", (ws * rows_per_rank, 1024), (ws,), ["S0"]), "step": version}


def _limit_file_size() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, hard))


def _caught(fn) -> dict | None:
    try:
        fn()
    except CheckpointError as e:
        return {"type": type(e).__name__, "message": str(e), "rank_errors": dict(e.rank_errors)}
    except BaseException as e:  # noqa: BLE001 - reported to the test as what it is
        return {"type": f"not a CheckpointError: {type(e).__module__}.{type(e).__qualname__}", "message": str(e), "rank_errors": {}}
    return None


def _fail_on_rank_1(rank, ws, root, scenario):
    ckpt = Checkpointer()
    target = os.path.join(root, "failed")
    listed = None
    if scenario == "overwrite":  # a checkpoint committed before: the failed save must leave it whole
        ckpt.save(target, _rank_state(ws, 0, 256))
        listed = sorted(os.listdir(target))
    big = _rank_state(ws, 1, 256)  # 1 MiB on every rank
    if rank == 1:
        _limit_file_size()
    h = ckpt.async_save(target, big, save_overwrite=scenario == "overwrite")
    _change(_locals(big))
    small = _rank_state(ws, 2, 1)  # 4 KiB per rank: under the limit
    out = {"listed": listed}
    if scenario in ("wait", "overwrite", "observed"):
        out["wait"] = _caught(h.wait)
        out["result"] = _caught(h.committed.result)
        out["again"] = _caught(h.wait)
        if scenario == "observed":  # seen by the caller: the next save goes on
            out["next"] = _caught(lambda: ckpt.save(os.path.join(root, "next"), small))
    else:  # never looked at: the next save raises it
        if scenario == "next-save":
            out["next"] = _caught(lambda: ckpt.save(os.path.join(root, "next"), small))
        else:
            out["next"] = _caught(lambda: ckpt.async_save(os.path.join(root, "next"), small))
        out["wait"] = _caught(h.wait)  # it never disappears
        out["after"] = _caught(lambda: ckpt.async_save(os.path.join(root, "after"), small).wait())
    return out


def _assert_rank_1_efbig(caught: dict | None, what: str) -> None:
    """A CheckpointError whose message gives the cause and whose ``rank_errors`` names rank 1."""
    assert caught is not None, f"{what}: raised nothing"
    assert not caught["type"].startswith("not a CheckpointError"), (what, caught)
    assert "File too large" in caught["message"], (what, caught)
    assert 1 in caught["rank_errors"] and "File too large" in caught["rank_errors"][1], (what, caught)


def _assert_left_nothing(root: str, name: str) -> None:
    d = os.path.join(root, name)
    assert not os.path.exists(os.path.join(d, "metadata.json"))
    assert not os.path.exists(d) or os.listdir(d) == [], os.listdir(d)


@pytest.mark.parametrize("ws", [2, 4])
def test_a_background_write_failing_on_one_rank_fails_wait_on_every_rank(tmp_path, ws):
    results = run_ranks(ws, _fail_on_rank_1, str(tmp_path), "wait")
    for rank, out in enumerate(results):
        for what in ("wait", "result", "again"):
            _assert_rank_1_efbig(out[what], f"rank {rank}: {what}")
            assert "rank 1" in out[what]["message"], f"rank {rank}: {what}: the message must name the failing rank: {out[what]}"
    assert len({out["wait"]["type"] for out in results}) == 1, "the same error on every rank"
    _assert_left_nothing(str(tmp_path), "failed")


def test_a_failed_overwrite_leaves_the_checkpoint_it_would_have_replaced(tmp_path):
    results = run_ranks(2, _fail_on_rank_1, str(tmp_path), "overwrite")
    for rank, out in enumerate(results):
        _assert_rank_1_efbig(out["wait"], f"rank {rank}: wait")
    target = str(tmp_path / "failed")
    assert sorted(os.listdir(target)) == results[0]["listed"]  # not a file more, not a file less
    out = Checkpointer().unshard(target)
    assert torch.equal(out["w"], full_tensor("w@0", (2 * 256, 1024))) and out["step"] == 0
    assert shardsafe.verify(target).ok


@pytest.mark.parametrize("call", ["next-save", "next-async_save"])
def test_an_unobserved_background_failure_is_raised_by_the_next_save_on_every_rank(tmp_path, call):
    results = run_ranks(2, _fail_on_rank_1, str(tmp_path), call)
    for rank, out in enumerate(results):
        _assert_rank_1_efbig(out["next"], f"rank {rank}: next save")
        _assert_rank_1_efbig(out["wait"], f"rank {rank}: wait after the next save raised")
        assert out["after"] is None, f"rank {rank}: once raised, saving goes on: {out['after']}"
    _assert_left_nothing(str(tmp_path), "failed")
    _assert_left_nothing(str(tmp_path), "next")
    after = Checkpointer().unshard(str(tmp_path / "after"))
    assert torch.equal(after["w"], full_tensor("w@2", (2, 1024))) and after["step"] == 2


def test_a_background_failure_seen_by_wait_does_not_fail_the_next_save(tmp_path):
    results = run_ranks(2, _fail_on_rank_1, str(tmp_path), "observed")
    for rank, out in enumerate(results):
        _assert_rank_1_efbig(out["wait"], f"rank {rank}: wait")
        assert out["next"] is None, f"rank {rank}: {out['next']}"
    out = Checkpointer().unshard(str(tmp_path / "next"))
    assert torch.equal(out["w"], full_tensor("w@2", (2, 1024))) and out["step"] == 2


# --- kill -9 during a background write --------------------------------------------------------------

KILL_ROWS = 8192  # 32 MiB per rank, written in 16 KiB blocks: the write takes a while


def _has_bytes(directory: str, marker: str) -> bool:
    """Whether a file of ``directory`` whose name holds ``marker`` has bytes in it."""
    try:
        return any(marker in e.name and e.stat().st_size > 0 for e in os.scandir(directory))
    except FileNotFoundError:  # the directory, or a file listed a moment ago
        return False


def _killed_in_background_write(rank: int, ws: int, port: int, root: str) -> None:
    """Rank ``rank`` of ``ws``: commit step 1, start saving step 2 in the background; rank 1
    SIGKILLs itself once its step-2 data file has bytes in it. The others write what their
    ``wait()`` raised to ``wait-r<rank>.txt`` and exit at once (their peer is gone)."""
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws, timeout=timedelta(seconds=120))
    ckpt = Checkpointer(knobs=knobs(write_block_bytes=16 << 10, collective_timeout_s=20))
    ckpt.save(os.path.join(root, "step1"), _rank_state(ws, 1, 64))
    step2 = os.path.join(root, "step2")
    state = _rank_state(ws, 2, KILL_ROWS)
    h = ckpt.async_save(step2, state)
    if rank == 1:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _has_bytes(step2, "r00001"):
            time.sleep(0.0005)
        if _has_bytes(step2, "r00001") and not os.path.exists(os.path.join(step2, "metadata.json")):
            open(os.path.join(root, "killed-mid-write"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    caught = _caught(h.wait)
    took = time.monotonic() - start
    with open(os.path.join(root, f"wait-r{rank}.json.tmp"), "w") as f:
        json.dump({"caught": caught, "took": took}, f)
    os.rename(os.path.join(root, f"wait-r{rank}.json.tmp"), os.path.join(root, f"wait-r{rank}.json"))
    os._exit(0)  # no barrier, no destroy_process_group: a peer is dead


def test_kill_9_during_a_background_write_leaves_the_last_commit_and_refuses_the_new_one(tmp_path):
    root, ws = str(tmp_path), 2
    ctx = mp.get_context("forkserver")  # torch preloaded (tests.helpers sets it up)
    port = free_port()
    procs = [ctx.Process(target=_killed_in_background_write, args=(r, ws, port, root), daemon=True) for r in range(ws)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    hung = [r for r, p in enumerate(procs) if p.exitcode is None]
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join()
    assert not hung, f"rank(s) {hung} hung after rank 1 was killed"
    assert [p.exitcode for p in procs] == [0, -signal.SIGKILL]
    assert os.path.exists(os.path.join(root, "killed-mid-write")), "rank 1 was meant to die while its data file was being written"
    with open(os.path.join(root, "wait-r0.json")) as f:
        report = json.load(f)
    caught, took = report["caught"], report["took"]
    assert caught is not None, "rank 0's wait() returned although rank 1 died before its write was done"
    assert not caught["type"].startswith("not a CheckpointError"), caught
    assert took < 60
    out = Checkpointer().unshard(os.path.join(root, "step1"))
    assert torch.equal(out["w"], full_tensor("w@1", (ws * 64, 1024))) and out["step"] == 1
    assert os.listdir(os.path.join(root, "step2")) == []  # rank 0 removed the new save's files, rank 1's too
    with pytest.raises(IncompleteCheckpointError, match="step2: not a checkpoint: nothing is there"):
        Checkpointer().unshard(os.path.join(root, "step2"))
    with pytest.raises(IncompleteCheckpointError):
        Checkpointer().load(os.path.join(root, "step2"), {"w": torch.zeros(ws * KILL_ROWS, 1024), "step": 0})


# --- interpreter exit ---------------------------------------------------------------------------------

EXIT_SCRIPT = """
import sys, torch, shardsafe
def main(path):
    g = torch.Generator().manual_seed(11)
    state = {"w": torch.randn(4096, 4096, generator=g), "step": 9}  # 64 MiB
    shardsafe.Checkpointer().async_save(path, state)
    state["w"].zero_()
    print("returned", flush=True)
main(sys.argv[1])
"""


def test_a_process_that_exits_with_a_save_in_flight_commits_it_first(tmp_path):
    path = str(tmp_path / "c")
    src = os.path.dirname(os.path.dirname(shardsafe.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, ROOT]), "OMP_NUM_THREADS": "1"}
    out = run_process([sys.executable, "-c", EXIT_SCRIPT, path], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "returned", out.stderr[-3000:]
    got = Checkpointer().unshard(path)
    assert torch.equal(got["w"], torch.randn(4096, 4096, generator=torch.Generator().manual_seed(11))) and got["step"] == 9


# --- object store -------------------------------------------------------------------------------------


@pytest.fixture
def s3():
    yield from fresh("s3")


def test_async_save_to_s3_is_in_flight_while_throttled_then_loads_bit_exact(s3):
    storage = open_storage(s3.url(), **s3.options, part_bytes=5 << 20)
    sd = _plain(4)
    # the first three uploads answer 503 SlowDown: the client retries after 100 ms or more
    s3.proxy.faults(1.0, ("503",), methods={"PUT", "POST"}, limit=3)
    h = Checkpointer().async_save(storage, sd)
    _change(t for k, t in sd.items() if k != "wt")
    assert not h.done()
    with pytest.raises(TimeoutError):
        h.wait(timeout=0.0)
    with pytest.raises(TimeoutError):
        h.committed.result(timeout=0.0)
    meta, _ = h.wait()
    assert h.done() and "committed" in repr(h)
    faults = Counter(r.fault for r in s3.proxy.snapshot() if r.fault)
    assert faults == {"503": 3}
    _assert_plain(Checkpointer().unshard(storage), 4)
    assert Checkpointer().get_metadata(storage) == meta


def _async_save_s3(rank, ws, url, env):
    os.environ.update(env)
    sd = _dist_state(ws, 5)
    h = Checkpointer(knobs=knobs(replica_split_bytes=SPLIT)).async_save(url, {**sd, "step": 5})
    _change(_locals(sd))
    h.wait()
    return True


def test_async_save_on_ranks_to_s3_loads_bit_exact(s3):
    url = s3.url()
    assert run_ranks(2, _async_save_s3, url, s3.env) == [True, True]
    out = Checkpointer().unshard(open_storage(url, **s3.options))
    for key, (shape, _) in DIST.items():
        assert torch.equal(out[key], full_tensor(f"{key}@5", shape)), key
    assert out["step"] == 5
