"""``shardsafe.megatron.convert_megatron``: a checkpoint real megatron-core 0.15 wrote with its
``torch_dist`` backend (2 gloo ranks, TP2 x PP2 with a distributed optimizer's flattened state,
ShardedObjects, a common state with an ``argparse.Namespace``) converts into a shardsafe checkpoint
that ``verify`` passes, that stores what ``shardsafe.megatron.save`` stores for the same state,
and that loads bit-exact as the original into any layout.
"""

from __future__ import annotations

import argparse
import fractions
import os
import shutil

import pytest
import torch

from shardsafe import Checkpointer, verify
from shardsafe.errors import CheckpointError, CheckpointExistsError
from shardsafe.megatron import CheckpointingException, ShardedObject, ShardedTensor, convert_megatron, load
from tests.helpers import megatron_cuts, megatron_reshard, megatron_truth, run_ranks

pytest.importorskip("megatron.core.dist_checkpointing")



@pytest.fixture(scope="module")
def converted(torch_dist_dir, tmp_path_factory) -> str:
    dst = str(tmp_path_factory.mktemp("converted") / "ckpt")
    convert_megatron(torch_dist_dir, dst, progress=False)
    return dst


def _whole_request() -> dict:
    t = megatron_truth()
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in t.items()}
    request["opt_range"] = ShardedTensor.from_rank_offsets_flat("opt", torch.zeros(6), (3, 4), flattened_range=slice(3, 9), replica_id=1)
    request["rng"] = [ShardedObject("rng", None, (2,), (r,), replica_id=1) for r in range(2)]
    return request


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, argparse.Namespace):
        return isinstance(b, argparse.Namespace) and _same(vars(a), vars(b))
    return type(a) is type(b) and a == b


def test_a_converted_checkpoint_loads_as_the_torch_dist_one_and_verifies(torch_dist_dir, converted):
    assert verify(converted).ok
    original = load(_whole_request(), torch_dist_dir, validate_access_integrity=False)
    got = load(_whole_request(), converted, validate_access_integrity=False)
    assert _same(got, original)
    t = megatron_truth()
    assert all(torch.equal(got[k], v) for k, v in t.items())
    assert torch.equal(got["opt_range"], t["opt"].flatten()[3:9])
    assert got["iteration"] == 7 and vars(got["args"]) == {"lr": 0.25, "tensor_model_parallel_size": 2, "dtype": torch.bfloat16}
    assert [o["seed"] for o in got["rng"]] == [0, 1]
    from shardsafe.megatron import load_common_state_dict, load_plain_tensors, load_sharded_metadata

    assert _same(load_common_state_dict(converted), load_common_state_dict(torch_dist_dir))
    assert _same(load_plain_tensors(converted), load_plain_tensors(torch_dist_dir))
    assert sorted(load_sharded_metadata(converted)) == sorted(load_sharded_metadata(torch_dist_dir))


def test_a_converted_checkpoint_loads_into_another_layout_on_two_ranks(converted):
    assert run_ranks(2, megatron_reshard, converted) == [
        {"w": True, "layers": True, "b": True, "opt": True, "rng": 1, "iteration": 7},
        {"w": True, "layers": True, "b": True, "opt": True, "rng": 0, "iteration": 7},
    ]


def _ours_save(rank: int, world: int, path: str) -> None:
    """What ``megatron_torch_dist_save`` saves, through shardsafe.megatron."""
    from shardsafe.megatron import save

    t = megatron_truth()
    flat = slice(megatron_cuts[rank], megatron_cuts[rank + 1])
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", t["w"][2 * rank : 2 * rank + 2].clone(), (0, rank, world)),
        "layers": ShardedTensor.from_rank_offsets("layers", t["layers"][rank].clone(), (0, rank, world), prepend_axis_num=1),
        "b": ShardedTensor.from_rank_offsets("b", t["b"].clone(), replica_id=rank),
        "opt": ShardedTensor.from_rank_offsets_flat("opt", t["opt"].flatten()[flat].clone(), (3, 4), flattened_range=flat),
        "rng": ShardedObject("rng", {"seed": rank, "state": torch.arange(3) + rank}, (world,), (rank,)),
        "iteration": 7,
        "args": argparse.Namespace(lr=0.25, tensor_model_parallel_size=world, dtype=torch.bfloat16),
    }
    save(sd, path)


def test_a_converted_checkpoint_stores_what_shardsafe_megatron_save_stores(converted, tmp_path):
    ours = str(tmp_path / "ours")
    run_ranks(2, _ours_save, ours)
    a = Checkpointer().get_metadata(converted, no_dist=True)
    b = Checkpointer().get_metadata(ours, no_dist=True)
    assert a.objects == b.objects  # the common state, the config, each ShardedObject: the same JSON
    assert {k: (t.shape, t.dtype) for k, t in a.tensors.items()} == {k: (t.shape, t.dtype) for k, t in b.tensors.items()}
    # the flattened optimizer state stays flattened ranges of its one box, as Megatron cut it
    specs = sorted((s.global_offset, s.local_shape, s.flattened_range) for _, s in a.tensors["opt"].chunks())
    assert specs == [((0, 0), (3, 4), (0, 5)), ((0, 0), (3, 4), (5, 12))]


def test_convert_streams_chunk_by_chunk_and_reports_progress(torch_dist_dir, tmp_path):
    from shardsafe.dcp import distcp
    from shardsafe.storage import open_storage

    ckpt = distcp.read_dcp_checkpoint(open_storage(torch_dist_dir))
    chunks = [le for _, _, entries in ckpt.tensors.values() for _, le, _ in entries]
    seen: list[tuple[int, int]] = []
    meta = convert_megatron(torch_dist_dir, str(tmp_path / "p"), progress=lambda done, total: seen.append((done, total)))
    total = sum(t.numel() * t.element_size() for t in megatron_truth().values())
    assert len(seen) == len(chunks) and seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert sorted(meta.objects) == ["megatron:common", "megatron:config", "rng/shard_0_2", "rng/shard_1_2"]


def test_convert_refusals(torch_dist_dir, converted, tmp_path):
    with pytest.raises(CheckpointingException, match=r"not a megatron-core torch_dist or zarr checkpoint: it holds \d+ file\(s\) but no \.metadata; it is a shardsafe checkpoint already"):
        convert_megatron(converted, str(tmp_path / "x"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointingException, match=r"empty: not a megatron-core torch_dist or zarr checkpoint: it holds 0 file\(s\) but no \.metadata$"):
        convert_megatron(str(empty), str(tmp_path / "x"))
    plain_dcp = tmp_path / "plain_dcp"
    shutil.copytree(torch_dist_dir, plain_dcp)
    os.remove(plain_dcp / "metadata.json")
    with pytest.raises(CheckpointingException, match=r"has DCP's \.metadata but no Megatron metadata\.json \(a plain torch\.distributed\.checkpoint folder converts with shardsafe\.dcp\.convert\)"):
        convert_megatron(str(plain_dcp), str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x")
    with pytest.raises(CheckpointExistsError, match=r"a checkpoint is already committed there; pass overwrite=True to replace it"):
        convert_megatron(torch_dist_dir, converted)
    with pytest.raises(CheckpointError, match=r"src and dst are both .*iter_0000007; convert into another directory"):
        convert_megatron(torch_dist_dir, torch_dist_dir, overwrite=True)
    with pytest.raises(TypeError, match=r"overwrite"):
        convert_megatron(torch_dist_dir, str(tmp_path / "x"), overwrite="yes")  # type: ignore[arg-type]
    again = str(tmp_path / "again")
    shutil.copytree(converted, again)
    before = sorted(os.listdir(again))
    convert_megatron(torch_dist_dir, again, overwrite=True)  # replaces it, and sweeps the old data files
    after = sorted(os.listdir(again))
    assert len(after) == len(before) and after != before
    assert verify(again).ok


def test_convert_reads_and_stores_pickles_only_when_allowed(torch_dist_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(torch_dist_dir, src)
    torch.save({"ratio": fractions.Fraction(1, 3)}, src / "common.pt")
    with pytest.raises(
        CheckpointingException,
        match=r"common\.pt: the pickle names fractions\.Fraction, which is not one of the globals.*Pass allow_pickle=True to shardsafe\.megatron\.convert_megatron only if you trust",
    ):
        convert_megatron(str(src), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out" / "metadata.json")
    convert_megatron(str(src), str(tmp_path / "out"), allow_pickle=True)
    from shardsafe.megatron.strategies import ShardsafeLoadShardedStrategy

    with pytest.raises(CheckpointError, match=r"pickle"):
        load({}, str(tmp_path / "out"))
    assert load({}, str(tmp_path / "out"), sharded_strategy=ShardsafeLoadShardedStrategy(allow_pickle=True)) == {"ratio": fractions.Fraction(1, 3)}


def test_the_command_line_converts_from_megatron(torch_dist_dir, tmp_path, capsys):
    from shardsafe.cli import main

    dst = str(tmp_path / "cli")
    assert main(["convert", torch_dist_dir, dst, "--from", "megatron"]) == 0
    assert capsys.readouterr().out == f"converted 4 tensors and 4 values from megatron {torch_dist_dir} to {dst}\n"
    assert _same(load(_whole_request(), dst, validate_access_integrity=False), load(_whole_request(), torch_dist_dir, validate_access_integrity=False))
    assert main(["convert", torch_dist_dir, dst, "--from", "megatron"]) == 2
    assert capsys.readouterr().err == f"shardsafe convert: error: {dst}: a checkpoint is already committed there; pass --overwrite to replace it\n"
