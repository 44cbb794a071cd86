"""Save and load on real gloo process groups: DTensor layouts, resharding, balancing, errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

import shardsafe
from shardsafe import Checkpointer, ShardedTensor
from shardsafe.knobs import KNOBS

from .helpers import built_once, device_mesh, dtensor, full_tensor, run_ranks


def _save_dtensors(rank, ws, path, tensors):
    sd = {key: dtensor(key, shape, mesh, spec) for key, (shape, mesh, spec) in tensors.items()}
    sd["step"] = 7
    meta, files = Checkpointer().save(path, sd)
    return [os.path.basename(f) for f in files], sorted(meta.tensors)


def _load_dtensors(rank, ws, path, tensors):
    sd = {}
    for key, (shape, mesh, spec) in tensors.items():
        dt = dtensor(key, shape, mesh, spec)
        dt.to_local().fill_(float("nan"))
        sd[key] = dt
    sd["step"] = 0
    Checkpointer().load(path, sd)
    for key, (shape, _, _) in tensors.items():
        assert torch.equal(sd[key].full_tensor(), full_tensor(key, shape)), key
    return sd["step"]


SAVE_LAYOUTS = {
    "w0": ((10, 6), (2,), ["S0"]),
    "w1": ((7, 5), (2,), ["S1"]),  # uneven
    "rep": ((3, 4), (2,), ["R"]),
    "vec": ((5,), (2,), ["S0"]),
}


def _build_ws2(base):
    os.makedirs(base)
    _, keys = run_ranks(2, _save_dtensors, os.path.join(base, "ckpt"), SAVE_LAYOUTS)[0]
    with open(os.path.join(base, "keys.json"), "w") as f:
        json.dump(keys, f)


@pytest.fixture
def saved_ws2(tmp_path_factory) -> tuple[str, list[str]]:
    """SAVE_LAYOUTS saved on 2 ranks, once per test run for all three load world sizes: read it, never change it."""
    base = built_once(tmp_path_factory, "dtensor-ws2", _build_ws2)
    with open(os.path.join(base, "keys.json")) as f:
        return os.path.join(base, "ckpt"), json.load(f)


@pytest.mark.parametrize("load_ws", [1, 3, 4])
def test_dtensor_save_ws2_load_other_world_sizes(saved_ws2, load_ws):
    path, keys = saved_ws2
    assert keys == sorted(SAVE_LAYOUTS)
    # load with different placements in a different world size
    flip = {k: (shape, (load_ws,), ["S1" if len(shape) > 1 else "S0"]) for k, (shape, _, _) in SAVE_LAYOUTS.items()}
    if load_ws == 1:
        assert _load_plain(path, SAVE_LAYOUTS) == 7
    else:
        assert run_ranks(load_ws, _load_dtensors, path, flip) == [7] * load_ws


def _load_plain(path, tensors):
    """DTensor checkpoint into regular tensors, in a process with no process group."""
    sd = {k: torch.full(shape, float("nan")) for k, (shape, _, _) in tensors.items()}
    sd["step"] = 0
    Checkpointer().load(path, sd)
    for k, (shape, _, _) in tensors.items():
        assert torch.equal(sd[k], full_tensor(k, shape)), k
    return sd["step"]


MESH_LAYOUTS = {
    # FSDP2 + TP: right-to-left sharding expressed with _StridedShard
    "fsdp_tp": ((9, 6), (2, 2), ["SS0/2", "S0"]),
    "grid": ((6, 7), (2, 2), ["S0", "S1"]),
    "hsdp": ((5, 3), (2, 2), ["R", "S0"]),  # sharded within a group, replicated across groups
    "strided_alone": ((11, 2), (2, 2), ["SS0/3", "R"]),
    "same_dim_twice": ((13,), (2, 2), ["S0", "S0"]),
}


def test_2d_meshes_and_strided_shard_ws4_to_ws2(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(4, _save_dtensors, path, MESH_LAYOUTS)
    out = Checkpointer().unshard(path)
    for k, (shape, _, _) in MESH_LAYOUTS.items():
        assert torch.equal(out[k], full_tensor(k, shape)), k
    assert out["step"] == 7
    flip = {k: (shape, (2,), ["S0"]) for k, (shape, _, _) in MESH_LAYOUTS.items()}
    assert run_ranks(2, _load_dtensors, path, flip) == [7, 7]
    # and back onto a 2x2 mesh with other placements
    back = {k: (shape, (2, 2), ["S0", "SS0/2"] if k != "grid" else ["S1", "S0"]) for k, (shape, _, _) in MESH_LAYOUTS.items()}
    assert run_ranks(4, _load_dtensors, path, back) == [7] * 4


def _save_sharded_rows(rank, ws, path, shape):
    full = full_tensor("m", shape)
    sd = {"m": ShardedTensor.from_rank_offsets("m", full.chunk(ws)[rank].clone(), (0, rank, ws))}
    Checkpointer().save(path, sd, save_overwrite=True)


def _load_sharded_cols(rank, ws, path, shape):
    full = full_tensor("m", shape)
    target = torch.full((shape[0], shape[1] // ws), float("nan"))
    sd = {"m": ShardedTensor.from_rank_offsets("m", target, (1, rank, ws))}
    Checkpointer().load(path, sd)
    assert torch.equal(target, full.chunk(ws, dim=1)[rank])
    return True


def test_world_size_chain_4_2_1_3(tmp_path):
    """Save on 4, reload on 2 and save again, then 1, then load on 3."""
    shape = (12, 12)
    p4, p2, p1 = (str(tmp_path / n) for n in ("ws4", "ws2", "ws1"))
    run_ranks(4, _save_sharded_rows, p4, shape)
    assert run_ranks(2, _reload_and_save, p4, p2, shape) == [True, True]
    sd = {"m": torch.zeros(shape)}
    Checkpointer().load(p2, sd)
    Checkpointer().save(p1, sd)
    assert run_ranks(3, _load_sharded_cols, p1, shape) == [True] * 3


def _reload_and_save(rank, ws, src, dst, shape):
    _load_sharded_cols(rank, ws, src, shape)
    target = torch.empty(shape[0] // ws, shape[1])
    Checkpointer().load(src, {"m": ShardedTensor.from_rank_offsets("m", target, (0, rank, ws))})
    Checkpointer().save(dst, {"m": ShardedTensor.from_rank_offsets("m", target, (0, rank, ws))})
    return True


def _save_replicated(rank, ws, path, n, big_shape):
    sd = {f"r{i}": full_tensor(f"r{i}", (64, 32)) for i in range(n)}
    sd["big"] = full_tensor("big", big_shape)
    knobs = type(KNOBS)(**{**{f: getattr(KNOBS, f) for f in KNOBS.__slots__}, "replica_split_bytes": 1 << 16})
    meta, files = Checkpointer(knobs=knobs).save(path, sd)
    return len(files), meta.model_dump()


def test_replicated_tensors_written_once_and_spread_over_ranks(tmp_path):
    path = str(tmp_path / "ckpt")
    results = run_ranks(4, _save_replicated, path, 8, (256, 256))
    assert [n for n, _ in results] == [1, 1, 1, 1]  # every rank wrote a file
    assert shardsafe.StorageMetadata.model_validate(results[0][1]).format_version == 3
    meta = Checkpointer().get_metadata(path)  # bound: chunks() reads where each chunk is from the files
    for i in range(8):  # each small replicated tensor stored exactly once
        assert meta.tensors[f"r{i}"].chunk_count() == 1
        assert len(list(meta.tensors[f"r{i}"].chunks())) == 1
    big = meta.tensors["big"]  # 256 KiB > 64 KiB split threshold: split over the 4 replicas
    assert big.chunk_count() == 4
    assert len({f for f, _ in big.chunks()}) == 4
    assert sorted(s.global_offset for _, s in big.chunks()) == [(0, 0), (64, 0), (128, 0), (192, 0)]
    sizes = [os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors")]
    assert max(sizes) < 2 * min(sizes)  # balanced: 8 x 8 KiB + 256 KiB over 4 ranks
    out = Checkpointer().unshard(path)
    assert torch.equal(out["big"], full_tensor("big", (256, 256)))


def _save_bad_shape(rank, ws, path):
    shape = (4, 4) if rank == 0 else (4, 5)
    try:
        Checkpointer().save(path, {"x": full_tensor("x", shape)})
    except shardsafe.ShapeMismatchError as e:
        return str(e)
    return "no error"


def test_disagreeing_ranks_all_raise(tmp_path):
    path = str(tmp_path / "ckpt")
    msgs = run_ranks(2, _save_bad_shape, path)
    assert all("key 'x': rank 0 has global shape [4, 4], rank 1 has [4, 5]" in m for m in msgs), msgs
    assert not os.path.exists(os.path.join(path, "metadata.json"))


def _load_expect_error(rank, ws, path):
    target = torch.empty(6 // ws, 4)
    try:
        Checkpointer().load(path, {"m": ShardedTensor.from_rank_offsets("m", target, (0, rank, ws))})
    except shardsafe.CorruptCheckpointError as e:
        return type(e).__name__, str(e)
    return "none", ""


def test_corruption_seen_by_one_rank_fails_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save_sharded_rows, path, (6, 4))
    meta = Checkpointer().get_metadata(path)
    (file, spec), = [(f, s) for f, s in meta.tensors["m"].chunks() if s.global_offset == (3, 0)]
    with open(os.path.join(path, file), "r+b") as f:  # damage the chunk of rows 3-5, which only rank 1 reads
        f.seek(spec.byte_range[1] - 1)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    results = run_ranks(2, _load_expect_error, path)
    assert [r[0] for r in results] == ["CorruptCheckpointError"] * 2
    assert f"rank 1: CorruptCheckpointError: key 'm': checksum mismatch in chunk {file}:m@3,0" in results[0][1]


def _save_partial(rank, ws, path):
    from torch.distributed.tensor import DTensor, Partial

    mesh = device_mesh(ws, (ws,))
    dt = DTensor.from_local(torch.ones(2, 2), mesh, [Partial()])
    try:
        Checkpointer().save(path, {"p": dt})
    except shardsafe.ShardingError as e:
        return str(e)
    return "no error"


def test_partial_placement_is_refused(tmp_path):
    msgs = run_ranks(2, _save_partial, str(tmp_path / "c"))
    assert all("key 'p': DTensor placement" in m and "Partial" in m for m in msgs), msgs


def _objects(rank, ws, path, conflict):
    sd = {"x": full_tensor("x", (2,)), "epoch": 3, f"rank{rank}_seed": rank}
    if conflict:
        sd["lr"] = 0.1 * (rank + 1)
    try:
        Checkpointer().save(path, sd)
    except shardsafe.CheckpointError as e:
        return str(e)
    out = Checkpointer().unshard(path, rank0_only=True)
    return {k: v for k, v in out.items() if not isinstance(v, torch.Tensor)}


def test_non_tensor_values_merge_across_ranks(tmp_path):
    ok = run_ranks(2, _objects, str(tmp_path / "a"), False)
    assert ok[1] == {}  # rank0_only
    assert ok[0]["epoch"] == 3 and ok[0]["rank0_seed"] == 0 and ok[0]["rank1_seed"] == 1
    bad = run_ranks(2, _objects, str(tmp_path / "b"), True)
    assert all("non-tensor value 'lr' differs between rank 0 and rank 1" in m for m in bad), bad
