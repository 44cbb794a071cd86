"""Megatron-Core ``torch_dist`` checkpoints (DCP ``.distcp`` + ``.metadata``, ``common.pt``,
Megatron's ``metadata.json``), written by real megatron-core 0.15 on 2 gloo ranks at TP2 x PP2
(a distributed optimizer's flattened state included), load through
``shardsafe.megatron.serialization.load`` into other layouts, bit-exact, with no megatron-core
in the loading process and no unpickling beyond shardsafe's restricted unpickler (what megatron-core's own
``safe_globals`` admit).
"""

from __future__ import annotations

import argparse
import fractions
import os
import shutil

import pytest
import torch

from shardsafe.megatron import CheckpointingException, ShardedObject, ShardedTensor, load, load_common_state_dict
from tests.distributed import run_ranks

pytest.importorskip("megatron.core.dist_checkpointing")


def _truth() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(4, 6, generator=g),  # TP: split along dim 0
        "layers": torch.randn(2, 3, 4, generator=g),  # PP: one layer per rank, prepend_axis_num=1
        "b": torch.randn(5, generator=g).bfloat16(),  # replicated
        "opt": torch.randn(3, 4, generator=g),  # distributed optimizer: flattened ranges [0, 5) and [5, 12)
    }


_CUTS = (0, 5, 12)


def _megatron_save(rank: int, world: int, path: str) -> None:
    import multiprocessing

    multiprocessing.current_process()._config["daemon"] = False  # torch_dist's writer forks workers
    torch.cuda.synchronize = lambda *a, **k: None  # megatron-core's torch_dist save on CPU
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import ShardedObject as MShardedObject
    from megatron.core.dist_checkpointing import ShardedTensor as MShardedTensor

    t = _truth()
    flat = slice(_CUTS[rank], _CUTS[rank + 1])
    sd = {
        "w": MShardedTensor.from_rank_offsets("w", t["w"][2 * rank : 2 * rank + 2].clone(), (0, rank, world)),
        "layers": MShardedTensor.from_rank_offsets("layers", t["layers"][rank].clone(), (0, rank, world), prepend_axis_num=1),
        "b": MShardedTensor.from_rank_offsets("b", t["b"].clone(), replica_id=rank),
        "opt": MShardedTensor.from_rank_offsets_flat("opt", t["opt"].flatten()[flat].clone(), (3, 4), flattened_range=flat),
        "rng": MShardedObject("rng", {"seed": rank, "state": torch.arange(3) + rank}, (world,), (rank,)),
        "iteration": 7,
        "args": argparse.Namespace(lr=0.25, tensor_model_parallel_size=world, dtype=torch.bfloat16),
    }
    os.makedirs(path, exist_ok=True)
    mdc.save(sd, path)


@pytest.fixture(scope="module")
def torch_dist_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("megatron") / "iter_0000007")
    run_ranks(2, _megatron_save, path, timeout=240)
    return path


def test_a_torch_dist_checkpoint_loads_whole_in_a_plain_process(torch_dist_dir):
    assert sorted(f for f in os.listdir(torch_dist_dir) if not f.endswith(".distcp")) == [".metadata", "common.pt", "metadata.json"]
    t = _truth()
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in t.items()}
    request["opt_range"] = ShardedTensor.from_rank_offsets_flat("opt", torch.zeros(6), (3, 4), flattened_range=slice(3, 9), replica_id=1)
    request["rng"] = [ShardedObject("rng", None, (2,), (r,), replica_id=1) for r in range(2)]
    got = load(request, torch_dist_dir, validate_access_integrity=False)
    for k, v in t.items():
        assert torch.equal(got[k], v), k
    assert torch.equal(got["opt_range"], t["opt"].flatten()[3:9])
    assert [o["seed"] for o in got["rng"]] == [0, 1] and torch.equal(got["rng"][1]["state"], torch.arange(3) + 1)
    assert got["iteration"] == 7
    assert vars(got["args"]) == {"lr": 0.25, "tensor_model_parallel_size": 2, "dtype": torch.bfloat16}


def _reshard(rank: int, world: int, path: str) -> dict:
    t = _truth()
    flat = slice(0, 8) if rank == 0 else slice(8, 12)  # other cuts than the save's
    request = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3), (1, rank, world)),  # now split along dim 1
        "layers": ShardedTensor.from_rank_offsets("layers", torch.zeros(2, 3, 2), (2, rank, world)),  # every layer, half of each
        "b": ShardedTensor.from_rank_offsets("b", torch.zeros(5, dtype=torch.bfloat16), replica_id=rank),
        "opt": ShardedTensor.from_rank_offsets_flat("opt", torch.zeros(flat.stop - flat.start), (3, 4), flattened_range=flat),
        "rng": ShardedObject("rng", None, (world,), (1 - rank,)),  # the other rank's cell
    }
    got = load(request, path)
    return {
        "w": torch.equal(got["w"], t["w"][:, 3 * rank : 3 * rank + 3]),
        "layers": torch.equal(got["layers"], t["layers"][:, :, 2 * rank : 2 * rank + 2]),
        "b": torch.equal(got["b"], t["b"]),
        "opt": torch.equal(got["opt"], t["opt"].flatten()[flat]),
        "rng": got["rng"]["seed"],
        "iteration": got["iteration"],
    }


def test_a_torch_dist_checkpoint_loads_into_another_layout_on_two_ranks(torch_dist_dir):
    results = run_ranks(2, _reshard, torch_dist_dir)
    assert results == [
        {"w": True, "layers": True, "b": True, "opt": True, "rng": 1, "iteration": 7},
        {"w": True, "layers": True, "b": True, "opt": True, "rng": 0, "iteration": 7},
    ]


def test_torch_dist_refusals(torch_dist_dir, tmp_path):
    with pytest.raises(CheckpointingException, match=r"key 'nope' is not in the checkpoint"):
        load({"nope": ShardedTensor.from_rank_offsets("nope", torch.zeros(2))}, torch_dist_dir)
    with pytest.raises(CheckpointingException, match=r"key 'w' is stored with global shape \[4, 6\], requested with \[4, 7\]"):
        load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 7))}, torch_dist_dir)
    copy = str(tmp_path / "c")
    shutil.copytree(torch_dist_dir, copy)
    torch.save({"ratio": fractions.Fraction(1, 3)}, os.path.join(copy, "common.pt"))
    with pytest.raises(CheckpointingException, match=r"common\.pt: the pickle names fractions\.Fraction, which is not one of the globals.*allow_pickle=True"):
        load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6))}, copy)
    from shardsafe.megatron.strategies import TorchDistLoadShardedStrategy

    got = load({}, copy, sharded_strategy=TorchDistLoadShardedStrategy(allow_pickle=True))
    assert got == {"ratio": fractions.Fraction(1, 3)}
    assert load_common_state_dict(torch_dist_dir)["iteration"] == 7


def test_torch_dist_metadata_readers_need_no_process_group(torch_dist_dir):
    from shardsafe.megatron import load_plain_tensors, load_sharded_metadata, load_tensors_metadata

    t = _truth()
    meta = load_tensors_metadata(torch_dist_dir)
    assert {k: (v.global_shape, v.dtype) for k, v in meta.items()} == {k: (tuple(v.shape), v.dtype) for k, v in t.items()}
    assert sorted(load_sharded_metadata(torch_dist_dir)) == ["b", "layers", "opt", "rng/shard_0_2", "rng/shard_1_2", "w"]
    from shardsafe.megatron import serialization
    from shardsafe.megatron.strategies import TorchDistLoadShardedStrategy

    assert type(serialization.get_default_load_sharded_strategy(torch_dist_dir)) is TorchDistLoadShardedStrategy
    plain = load_plain_tensors(torch_dist_dir)
    assert sorted(plain) == sorted(t) and all(torch.equal(plain[k], t[k]) for k in t)


def _fully_parallel_torch_dist(rank: int, world: int, path: str) -> dict:
    from shardsafe.megatron.strategies import FullyParallelLoadStrategyWrapper, TorchDistLoadShardedStrategy
    from tests.test_megatron_fully_parallel import CountingStorage

    t = _truth()
    out = {}
    for name, strategy in (("plain", TorchDistLoadShardedStrategy()), ("parallel", FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()))):
        storage = CountingStorage(path)
        request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v), replica_id=rank) for k, v in t.items()}  # DP replicas
        got = load(request, storage, sharded_strategy=strategy)
        out[name] = (storage.data_bytes, all(torch.equal(got[k], t[k]) for k in t), got["iteration"])
    return out


def test_fully_parallel_load_of_a_torch_dist_checkpoint_reads_each_chunk_once_per_group(torch_dist_dir):
    from shardsafe.dcp import dcp_format
    from shardsafe.storage import open_storage

    ckpt = dcp_format.read_dcp_checkpoint(open_storage(torch_dist_dir))
    stored = sum(item.length for _, _, chunks in ckpt.tensors.values() for _, _, item in chunks)
    results = run_ranks(2, _fully_parallel_torch_dist, torch_dist_dir)
    assert all(r[name][1:] == (True, 7) for r in results for name in ("plain", "parallel"))
    assert [r["plain"][0] for r in results] == [stored, stored]  # every replica reads every chunk
    assert sum(r["parallel"][0] for r in results) == stored  # the group reads each chunk once
