"""Megatron-Core ``torch_dist`` checkpoints (DCP ``.distcp`` + ``.metadata``, ``common.pt``,
Megatron's ``metadata.json``), written by real megatron-core 0.15 on 2 gloo ranks at TP2 x PP2
(a distributed optimizer's flattened state included), load through
``shardsafe.megatron.serialization.load`` into other layouts, bit-exact, with no megatron-core
in the loading process and no unpickling beyond shardsafe's restricted unpickler (what megatron-core's own
``safe_globals`` admit).
"""

from __future__ import annotations

import fractions
import os
import shutil

import pytest
import torch

from shardsafe.megatron import CheckpointingException, ShardedObject, ShardedTensor, load, load_common_state_dict
from tests.helpers import megatron_reshard, megatron_truth, run_ranks

pytest.importorskip("megatron.core.dist_checkpointing")


def test_a_torch_dist_checkpoint_loads_whole_in_a_plain_process(torch_dist_dir):
    assert sorted(f for f in os.listdir(torch_dist_dir) if not f.endswith(".distcp")) == [".metadata", "common.pt", "metadata.json"]
    t = megatron_truth()
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


def test_a_torch_dist_checkpoint_loads_into_another_layout_on_two_ranks(torch_dist_dir):
    results = run_ranks(2, megatron_reshard, torch_dist_dir)
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

    t = megatron_truth()
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
    from tests.counting_storage import CountingStorage

    t = megatron_truth()
    out = {}
    for name, strategy in (("plain", TorchDistLoadShardedStrategy()), ("parallel", FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()))):
        storage = CountingStorage(path)
        request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v), replica_id=rank) for k, v in t.items()}  # DP replicas
        got = load(request, storage, sharded_strategy=strategy)
        out[name] = (storage.data_bytes, all(torch.equal(got[k], t[k]) for k in t), got["iteration"])
    return out


def test_fully_parallel_load_of_a_torch_dist_checkpoint_reads_each_chunk_once_per_group(torch_dist_dir):
    from shardsafe.dcp import distcp
    from shardsafe.storage import open_storage

    ckpt = distcp.read_dcp_checkpoint(open_storage(torch_dist_dir))
    stored = sum(item.length for _, _, chunks in ckpt.tensors.values() for _, _, item in chunks)
    results = run_ranks(2, _fully_parallel_torch_dist, torch_dist_dir)
    assert all(r[name][1:] == (True, 7) for r in results for name in ("plain", "parallel"))
    assert [r["plain"][0] for r in results] == [stored, stored]  # every replica reads every chunk
    assert sum(r["parallel"][0] for r in results) == stored  # the group reads each chunk once
