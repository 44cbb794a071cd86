"""Megatron-Core ``zarr`` checkpoints: ``tests/data/megatron_zarr`` was written by real
megatron-core 0.15.3 with its deprecated zarr backend (zarr 2.18, 2 gloo ranks; see
``tests/data/make_megatron_zarr.py``). It loads through ``shardsafe.megatron`` into any layout,
bit-exact, with neither zarr nor megatron-core installed, and converts into shardsafe's format.
"""

from __future__ import annotations

import fractions
import json
import os
import shutil

import pytest
import torch

from shardsafe import verify
from shardsafe.megatron import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    convert_megatron,
    load,
    load_common_state_dict,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
)
from shardsafe.megatron.strategies import ZarrLoadShardedStrategy
from tests.helpers import megatron_reshard, megatron_truth, run_ranks

ZARR_DIR = os.path.join(os.path.dirname(__file__), "data", "megatron_zarr")
_CUTS = (0, 5, 12)


def _whole_request() -> dict:
    t = megatron_truth()
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in t.items()}
    request["opt_range"] = ShardedTensor.from_rank_offsets_flat("opt", torch.zeros(6), (3, 4), flattened_range=slice(3, 9), replica_id=1)
    request["rng"] = [ShardedObject("rng", None, (2,), (r,), replica_id=1) for r in range(2)]
    return request


def _check_whole(got: dict) -> None:
    t = megatron_truth()
    for k, v in t.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert torch.equal(got["opt_range"], t["opt"].flatten()[3:9])
    assert [o["seed"] for o in got["rng"]] == [0, 1] and torch.equal(got["rng"][1]["state"], torch.arange(3) + 1)
    assert got["iteration"] == 7
    assert vars(got["args"]) == {"lr": 0.25, "tensor_model_parallel_size": 2, "dtype": torch.bfloat16}


def test_a_zarr_checkpoint_loads_whole_in_a_plain_process():
    _check_whole(load(_whole_request(), ZARR_DIR, validate_access_integrity=False))
    t = megatron_truth()
    plain = load_plain_tensors(ZARR_DIR)
    assert sorted(plain) == sorted(t) and all(plain[k].dtype == t[k].dtype and torch.equal(plain[k], t[k]) for k in t)
    assert {k: (v.global_shape, v.dtype) for k, v in load_tensors_metadata(ZARR_DIR).items()} == {k: (tuple(v.shape), v.dtype) for k, v in t.items()}
    assert sorted(load_sharded_metadata(ZARR_DIR)) == ["b", "layers", "opt", "rng/shard_0_2", "rng/shard_1_2", "w"]
    assert load_common_state_dict(ZARR_DIR)["iteration"] == 7
    from shardsafe.megatron import serialization

    assert type(serialization.get_default_load_sharded_strategy(ZARR_DIR)) is ZarrLoadShardedStrategy


def test_a_zarr_checkpoint_loads_into_another_layout_on_two_ranks():
    assert run_ranks(2, megatron_reshard, ZARR_DIR) == [
        {"w": True, "layers": True, "b": True, "opt": True, "rng": 1, "iteration": 7},
        {"w": True, "layers": True, "b": True, "opt": True, "rng": 0, "iteration": 7},
    ]


def test_a_zarr_checkpoint_converts_into_one_that_loads_the_same(tmp_path):
    dst = str(tmp_path / "converted")
    meta = convert_megatron(ZARR_DIR, dst, progress=False)
    assert meta.format_version == 3 and len(meta.file_table) == 1 and sorted(meta.objects) == ["megatron:common", "megatron:config", "rng/shard_0_2", "rng/shard_1_2"]
    assert verify(dst).ok
    _check_whole(load(_whole_request(), dst, validate_access_integrity=False))
    assert run_ranks(2, megatron_reshard, dst)[0] == {"w": True, "layers": True, "b": True, "opt": True, "rng": 1, "iteration": 7}


def _copy(tmp_path) -> str:
    path = str(tmp_path / "z")
    shutil.copytree(ZARR_DIR, path)
    return path


def test_zarr_refusals(tmp_path):
    path = _copy(tmp_path)
    with open(os.path.join(path, "w", ".zarray")) as f:
        doc = json.load(f)
    doc["compressor"] = {"id": "blosc"}
    with open(os.path.join(path, "w", ".zarray"), "w") as f:
        json.dump(doc, f)
    with pytest.raises(
        CheckpointingException,
        match=r"array 'w' \(w/\.zarray\): compressor \{'id': 'blosc'\}; shardsafe reads the uncompressed, unfiltered C-order arrays",
    ):
        load_plain_tensors(path)

    path = _copy(tmp_path / "t")
    with open(os.path.join(path, "w", "1.0"), "r+b") as f:
        f.truncate(40)
    with pytest.raises(CheckpointingException, match=r"chunk w/1\.0 holds 40 bytes, not the 48 bytes of a \[2, 6\] chunk of torch\.float32"):
        load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6))}, path)
    os.remove(os.path.join(path, "w", "1.0"))
    with pytest.raises(CheckpointingException, match=r"array 'w' has no chunk file '1\.0'"):
        load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6))}, path)
    half = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 6), (0, 0, 2))}  # reads only chunk 0.0
    assert torch.equal(load(half, path, validate_access_integrity=False)["w"], megatron_truth()["w"][:2])

    path = _copy(tmp_path / "p")
    torch.save({"ratio": fractions.Fraction(1, 3)}, os.path.join(path, "rng", "shard_0_2.pt"))
    request = {"rng": ShardedObject("rng", None, (2,), (0,))}
    with pytest.raises(CheckpointingException, match=r"rng/shard_0_2\.pt: the pickle names fractions\.Fraction, which is not one of the globals.*refusing to load it \(nothing of it was run\).*allow_pickle=True"):
        load(request, path, validate_access_integrity=False)
    got = load(request, path, sharded_strategy=ZarrLoadShardedStrategy(allow_pickle=True), validate_access_integrity=False)
    assert got["rng"] == {"ratio": fractions.Fraction(1, 3)}
    with pytest.raises(CheckpointingException, match=r"Pass allow_pickle=True to shardsafe\.megatron\.convert_megatron only if you trust"):
        convert_megatron(path, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out" / "metadata.json")
