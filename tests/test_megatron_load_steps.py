"""shardsafe.megatron.load on 2 real gloo ranks: the collectives one load runs, and the errors
every rank raises when one step fails on one rank (the check-ins that pass send one int).

A load checks in once, broadcasts the metadata, gathers the requested pieces to validate them
(with ``validate_access_integrity``), and after reading exchanges only whether each rank failed.
"""

from __future__ import annotations

import torch

from shardsafe import Checkpointer
from shardsafe.dist import collective_counts
from shardsafe.megatron import ShardedTensor, ShardedTensorFactory, load, save
from shardsafe.megatron.strategies import ShardsafeLoadShardedStrategy
from tests.helpers import flip_byte, run_ranks


def _rows(rank: int, world: int, fill: float | None = None) -> dict:
    data = torch.full((2, 4), float(rank)) if fill is None else torch.full((2, 4), fill)
    return {"w": ShardedTensor.from_rank_offsets("w", data, (0, rank, world)), "step": 7}


def _counted(fn) -> tuple[dict[str, int], object]:
    before = collective_counts()
    out = fn()
    after = collective_counts()
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}, out


def _counts(rank: int, world: int, path: str) -> dict:
    save(_rows(rank, world), path)
    out = {}
    for name, kwargs in {
        "validated": {},
        "unvalidated": {"validate_access_integrity": False},
        "return_all": {"strict": "return_all"},
    }.items():
        counts, got = _counted(lambda kwargs=kwargs: load(_rows(rank, world, fill=-1.0), path, **kwargs))
        state = got[0] if isinstance(got, tuple) else got
        out[name] = (counts, torch.equal(state["w"], torch.full((2, 4), float(rank))), state["step"])
    counts, got = _counted(lambda: ShardsafeLoadShardedStrategy().load(_rows(rank, world, fill=-1.0), path))
    out["strategy.load"] = (counts, torch.equal(got["w"], torch.full((2, 4), float(rank))), None)
    return out


def test_a_load_checks_in_once_and_exchanges_one_int_after_reading(tmp_path):
    results = run_ranks(2, _counts, str(tmp_path / "c"))
    for rank, r in enumerate(results):
        assert all(exact for _, exact, _ in r.values()), r
        assert r["validated"][2] == 7
        # check-in, metadata (size + bytes), requests gathered (sizes + gather), verdict, read: one int each
        assert r["validated"][0] == {"arrive": 1, "broadcast": 1, "gather": 1, "all_reduce": 2}, (rank, r)
        # nothing to check across ranks: the failures of the local step travel as one int too
        assert r["unvalidated"][0] == {"arrive": 1, "broadcast": 1, "all_reduce": 2}, (rank, r)
        assert r["strategy.load"][0] == {"arrive": 1, "broadcast": 1, "all_reduce": 2}, (rank, r)
        # the missing keys every rank returns are broadcast
        assert r["return_all"][0] == {"arrive": 1, "broadcast": 2, "gather": 1, "all_reduce": 1}, (rank, r)


def _failures(rank: int, world: int, path: str) -> list[tuple[str, str, bool]]:
    """Each failing load: the error's class and message on this rank, and whether its target is untouched."""
    save(_rows(rank, world), path)
    out = []

    def attempt(state: dict, **kwargs) -> None:
        try:
            load(state, path, **kwargs)
            out.append(("loaded", "", False))
        except Exception as e:  # noqa: BLE001 - the class is what is tested
            w = state.get("w")
            out.append((type(e).__name__, str(e), w is not None and torch.equal(w.data, torch.full((2, 4), -1.0))))

    # the coordinator's validation fails: both ranks ask for the main replica of rows 0-1
    attempt({"w": ShardedTensor.from_rank_offsets("w", torch.full((2, 4), -1.0), (0, 0, world))})

    # rank 1's local step fails, without validation: its factory's build_fn raises
    def build(key, t, replica_id, flattened_range):
        if rank == 1:
            raise ValueError("build_fn failed on rank 1")
        return {"x": ShardedTensor.from_rank_offsets(key, t, (0, 0, world))}

    attempt({"f": ShardedTensorFactory("w", torch.zeros(2, 4), build, lambda sd: sd["x"])}, validate_access_integrity=False)
    return out


def _damage_rank1_rows(path: str) -> str:
    meta = Checkpointer().get_metadata(path, no_dist=True)
    ((file, spec),) = [(f, s) for f, s in meta.tensors["w"].chunks() if s.global_offset == (2, 0)]
    flip_byte(path, file, spec.byte_range[0])  # one byte of rank 1's rows
    return file


def _load_rows(rank: int, world: int, path: str) -> tuple[str, str]:
    try:
        load(_rows(rank, world, fill=-1.0), path)
    except Exception as e:  # noqa: BLE001 - the class is what is tested
        return type(e).__name__, str(e)
    return "loaded", ""


def test_a_step_that_fails_on_one_rank_raises_on_every_rank(tmp_path):
    path = str(tmp_path / "c")
    results = run_ranks(2, _failures, path)
    (cls0, msg0, untouched0), (cls1, msg1, untouched1) = results[0][0], results[1][0]
    overlap = "key 'w': main replicas overlap: ranks [0, 1] each hold the piece at offset [0, 0] shape [2, 4]"
    assert cls0 == cls1 == "CheckpointingException" and overlap in msg0 and not msg0.startswith("1 rank(s) failed")
    assert msg1.startswith("1 rank(s) failed: rank 0: CheckpointingException: ") and overlap in msg1
    assert untouched0 and untouched1  # refused before any rank read
    assert results[0][1] == ("CheckpointError", "1 rank(s) failed: rank 1: ValueError: build_fn failed on rank 1", False)
    assert results[1][1] == ("ValueError", "build_fn failed on rank 1", False)

    file = _damage_rank1_rows(path)
    (cls0, msg0), (cls1, msg1) = run_ranks(2, _load_rows, path)
    assert cls0 == cls1 == "CorruptCheckpointError"
    assert msg0.startswith("1 rank(s) failed: rank 1: CorruptCheckpointError: key 'w'") and file in msg0
    assert msg1.startswith("key 'w'") and file in msg1 and "checksum" in msg1
