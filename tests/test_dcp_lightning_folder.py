"""A folder Lightning's sharded save writes (DCP files from torch's own ``FileSystemWriter`` and
``meta.pt``, the rest of the checkpoint dict, ``torch.save``d on rank 0) converts with
``shardsafe.dcp.convert``: tensors bit-exact, the loop state carried as JSON (``lightning.meta``)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import shardsafe
import shardsafe.dcp
import shardsafe.lightning
from shardsafe import Checkpointer, PickleNotAllowedError

from .helpers import assert_bits, run_ranks
from .helpers import full_tensor as full

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable):UserWarning")

W, B = (10, 6), (10,)
META = {
    "epoch": 1,
    "global_step": 4,
    "pytorch-lightning_version": "2.5.0",
    "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 2, "completed": 1}}, "state_dict": {}}},
    "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_score": torch.tensor(0.25), "dirpath": "/ckpts"}},
    "lr_schedulers": [{"last_epoch": 4, "_last_lr": [0.01], "base_lrs": (0.01,), "min_lr": float("inf")}],
    "hyper_parameters": {"width": 6, "names": ("a", "b")},
}


def _lightning_style_save(rank, ws, path):
    """What Lightning's ``ModelParallelStrategy.save_checkpoint`` writes, with DCP's own writer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    sd = {
        "state_dict": {"net.0.weight": distribute_tensor(full("w", W), mesh, [Shard(0)]), "net.0.bias": full("b", B)},
        "optimizer_0": {
            "state": {"net.0.weight": {"exp_avg": distribute_tensor(full("m", W), mesh, [Shard(0)]), "step": torch.tensor(4.0)}},
            "param_groups": [{"lr": 0.01, "betas": (0.8, 0.95), "params": ["net.0.weight", "net.0.bias"]}],
        },
    }
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))
    if rank == 0:
        torch.save(META, os.path.join(path, "meta.pt"))


def test_lightning_folder_converts_with_its_loop_state(tmp_path):
    src, dst = str(tmp_path / "step=4.ckpt"), str(tmp_path / "ours")
    run_ranks(2, _lightning_style_save, src)
    assert sorted(os.listdir(src)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]

    shardsafe.dcp.convert(src, dst)
    assert not shardsafe.verify(dst).errors
    got = Checkpointer().unshard(dst)
    assert_bits(got["state_dict.net.0.weight"], full("w", W), "weight")
    assert_bits(got["state_dict.net.0.bias"], full("b", B), "bias")
    assert_bits(got["optimizer_0.state.net.0.weight.exp_avg"], full("m", W), "exp_avg")
    assert_bits(got["optimizer_0.state.net.0.weight.step"], torch.tensor(4.0), "step")
    assert got["optimizer_0.param_groups.0.betas"] == (0.8, 0.95)

    meta = shardsafe.lightning.read_meta(dst)  # the loop state, as JSON in metadata.json: no pickle
    assert Checkpointer().get_metadata(dst, no_dist=True).pickled_objects == {}
    score = meta["callbacks"]["ModelCheckpoint{'monitor': None}"].pop("best_model_score")
    want = pickle.loads(pickle.dumps(META))
    assert_bits(score, want["callbacks"]["ModelCheckpoint{'monitor': None}"].pop("best_model_score"), "best_model_score")
    assert meta == want
    assert meta["lr_schedulers"][0]["base_lrs"] == (0.01,) and meta["hyper_parameters"]["names"] == ("a", "b")


class _Opaque:
    def __init__(self) -> None:
        self.x = 1


def test_lightning_meta_pt_with_an_object_needs_allow_pickle(tmp_path):
    src = str(tmp_path / "step=4.ckpt")
    run_ranks(2, _lightning_style_save, src)
    torch.save({**META, "datamodule": _Opaque()}, os.path.join(src, "meta.pt"))
    with pytest.raises(PickleNotAllowedError, match=r"meta\.pt.*allow_pickle=True to shardsafe\.dcp\.convert"):
        shardsafe.dcp.convert(src, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out" / "metadata.json")
