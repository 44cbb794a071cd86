"""Checkpoints that real megatron-core 0.15 wrote (``torch_dist``, on 4 gloo ranks, CPU), holding
what Megatron-LM stores: TP x PP layers, TP-split weights replicated over DP, a distributed
optimizer's flattened ranges over DP, and a Megatron-LM-like ``common.pt`` (an
``argparse.Namespace`` of args with ``ModelType``/``AttnBackend``, a torch dtype, the rerun state
machine's enums) with an ``rng_state`` ShardedObject of numpy, Python and torch RNG states.

Each loads through ``shardsafe.megatron.load`` and converts through ``convert_megatron``,
bit-exact, in a process that unpickles nothing beyond megatron-core's own safe globals; a
``common.pt`` or ShardedObject that names ``os.system`` is refused naming it, without running it.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil

import numpy as np
import pytest
import torch

from shardsafe.megatron import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    convert_megatron,
    load,
    load_common_state_dict,
)
from tests.helpers import built_once, run_ranks

pytest.importorskip("megatron.core.dist_checkpointing")

TP, OTHER = 2, 2  # rank = other * TP + tp; "other" is the PP stage of the layers and the DP rank of the rest


def _truth() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    return {
        "decoder.layers.weight": torch.randn(OTHER, 4, 6, generator=g).bfloat16(),  # PP over layers, TP over dim 1
        "embedding.weight": torch.randn(8, 5, generator=g),  # TP over dim 0, replicated over DP
        "optimizer.state.exp_avg.embedding.weight": torch.randn(8, 5, generator=g),  # TP, then DP ranges of each TP shard
    }


_CUT = 13  # DP rank 0 holds [0, 13) of its TP shard's 20 elements, DP rank 1 [13, 20)


def _rng_state(pp: int, tp: int) -> dict:
    random.seed(100 + 10 * pp + tp)
    np.random.seed(200 + 10 * pp + tp)
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.manual_seed(300 + 10 * pp + tp).get_state(),
        "rng_tracker_states": {"model-parallel-rng": torch.full((8,), pp * 10 + tp, dtype=torch.uint8)},
    }


def _common(enums: tuple) -> dict:
    model_type, attn_backend, rerun_mode, rerun_state = enums
    args = argparse.Namespace(
        model_type=model_type.encoder_or_decoder, attention_backend=attn_backend.flash, params_dtype=torch.bfloat16,
        tensor_model_parallel_size=TP, pipeline_model_parallel_size=OTHER, lr=1.5e-4, data_path=["/data/x"], save=None,
    )
    return {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": 250,
        "num_floating_point_operations_so_far": 987654321012,
        "rerun_state_machine": {"mode": rerun_mode.DISABLED, "state": rerun_state.NOT_RUNNING_YET},
    }


def _enums() -> tuple:
    from megatron.core.enums import ModelType
    from megatron.core.rerun_state_machine import RerunMode, RerunState
    from megatron.core.transformer.enums import AttnBackend

    return ModelType, AttnBackend, RerunMode, RerunState


def _megatron_save(rank: int, world: int, path: str) -> None:
    import multiprocessing

    multiprocessing.current_process()._config["daemon"] = False  # torch_dist's writer forks workers
    torch.cuda.synchronize = lambda *a, **k: None  # megatron-core's torch_dist save on CPU
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import ShardedObject as MObject
    from megatron.core.dist_checkpointing import ShardedTensor as MTensor

    tp, other = rank % TP, rank // TP
    t = _truth()
    layers, emb, opt = t["decoder.layers.weight"], t["embedding.weight"], t["optimizer.state.exp_avg.embedding.weight"]
    rows = slice(4 * tp, 4 * tp + 4)
    flat = slice(0, _CUT) if other == 0 else slice(_CUT, 20)
    sd = {
        "layers": MTensor.from_rank_offsets(  # this stage's layer (axis 0 prepended), half of its rows
            "decoder.layers.weight", layers[other, 2 * tp : 2 * tp + 2].clone(), (0, other, OTHER), (1, tp, TP), prepend_axis_num=1,
        ),
        "emb": MTensor.from_rank_offsets("embedding.weight", emb[rows].clone(), (0, tp, TP), replica_id=other),
        "opt": MTensor.from_rank_offsets_flat(
            "optimizer.state.exp_avg.embedding.weight", opt[rows].flatten()[flat].clone(), (4, 5), (0, tp, TP), flattened_range=flat,
        ),
        "rng_state": MObject("rng_state", [_rng_state(other, tp)], (OTHER, TP), (other, tp), replica_id=0),
        **_common(_enums()),
    }
    os.makedirs(path, exist_ok=True)
    mdc.save(sd, path)


@pytest.fixture(autouse=True)
def _nothing_registered_with_torch():
    """Loads as in a process that never imported megatron-core: importing it (this module does,
    to save) registers its safe globals with torch for the whole process, which would let
    ``torch.load(weights_only=True)`` pass what these tests must see shardsafe read by itself."""
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    yield
    torch.serialization.add_safe_globals(registered)


@pytest.fixture(scope="module")
def megatron_dir(tmp_path_factory) -> str:
    """Built once per test run for every xdist worker (the tests spread over both): read it, never change it."""
    return built_once(tmp_path_factory, "megatron-lm/iter_0000250", lambda path: run_ranks(TP * OTHER, _megatron_save, path, timeout=600))


def _request() -> dict:
    t = _truth()
    out: dict = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in t.items()}
    out["opt_range"] = ShardedTensor.from_rank_offsets_flat(  # a range across the DP cut of TP shard 1
        "optimizer.state.exp_avg.embedding.weight", torch.zeros(10), (4, 5), (0, 1, TP), flattened_range=slice(8, 18), replica_id=1,
    )
    out["rng_state"] = [[ShardedObject("rng_state", None, (OTHER, TP), (pp, tp), replica_id=1) for tp in range(TP)] for pp in range(OTHER)]
    return out


def _assert_rng_equal(got: dict, want: dict) -> None:
    assert got["random_rng_state"] == want["random_rng_state"]
    g_np, w_np = got["np_rng_state"], want["np_rng_state"]
    assert g_np[0] == w_np[0] and g_np[2:] == w_np[2:]
    assert g_np[1].dtype == np.uint32 and g_np[1].tobytes() == w_np[1].tobytes()
    assert torch.equal(got["torch_rng_state"], want["torch_rng_state"])
    assert torch.equal(got["rng_tracker_states"]["model-parallel-rng"], want["rng_tracker_states"]["model-parallel-rng"])


def _assert_loaded(got: dict) -> None:
    t = _truth()
    for key, want in t.items():
        assert got[key].dtype == want.dtype and torch.equal(got[key], want), key
    assert torch.equal(got["opt_range"], t["optimizer.state.exp_avg.embedding.weight"][4:8].flatten()[8:18])
    for pp in range(OTHER):
        for tp in range(TP):
            assert len(got["rng_state"][pp][tp]) == 1  # Megatron-LM stores a one-item list per cell
            _assert_rng_equal(got["rng_state"][pp][tp][0], _rng_state(pp, tp))
    want_common = _common(_enums())
    assert vars(got["args"]) == vars(want_common["args"])
    assert got["args"].model_type is want_common["args"].model_type and got["args"].params_dtype is torch.bfloat16
    for key in ("checkpoint_version", "iteration", "num_floating_point_operations_so_far", "rerun_state_machine"):
        assert got[key] == want_common[key], key


def test_a_megatron_lm_checkpoint_loads_bit_exact(megatron_dir):
    _assert_loaded(load(_request(), megatron_dir, validate_access_integrity=False))
    common = load_common_state_dict(megatron_dir)
    assert sorted(common) == ["args", "checkpoint_version", "iteration", "num_floating_point_operations_so_far", "rerun_state_machine"]


def test_a_megatron_lm_checkpoint_converts_and_the_conversion_loads_bit_exact(megatron_dir, tmp_path):
    out = str(tmp_path / "converted")
    convert_megatron(megatron_dir, out)
    assert "common.pt" not in os.listdir(out)  # the common state is JSON in metadata.json now
    _assert_loaded(load(_request(), out, validate_access_integrity=False))


def _reshard(rank: int, world: int, path: str) -> list[bool]:
    """Another layout on 2 ranks: the layers split along their last dim, the embedding along dim 1,
    the optimizer state in two other flat ranges of the whole tensor."""
    t = _truth()
    layers = ShardedTensor.from_rank_offsets("decoder.layers.weight", torch.zeros(OTHER, 4, 3, dtype=torch.bfloat16), (2, rank, world))
    emb = ShardedTensor.from_rank_offsets("embedding.weight", torch.zeros(8, 5), replica_id=rank)
    flat = slice(0, 17) if rank == 0 else slice(17, 40)
    opt = ShardedTensor.from_rank_offsets_flat(
        "optimizer.state.exp_avg.embedding.weight", torch.zeros(flat.stop - flat.start), (8, 5), flattened_range=flat
    )
    got = load({"layers": layers, "emb": emb, "opt": opt}, path)
    return [
        torch.equal(got["layers"], t["decoder.layers.weight"][:, :, 3 * rank : 3 * rank + 3]),
        torch.equal(got["emb"], t["embedding.weight"]),
        torch.equal(got["opt"], t["optimizer.state.exp_avg.embedding.weight"].flatten()[flat]),
    ]


def test_a_megatron_lm_checkpoint_loads_into_another_layout_on_two_ranks(megatron_dir, tmp_path):
    assert run_ranks(2, _reshard, megatron_dir) == [[True] * 3, [True] * 3]


class _Evil:
    marker = ""

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_common_pt_or_sharded_object_naming_os_system_is_refused_naming_it_and_not_run(megatron_dir, tmp_path):
    marker = tmp_path / "pwned"
    _Evil.marker = str(marker)
    bad = str(tmp_path / "bad")
    shutil.copytree(megatron_dir, bad)
    torch.save({"iteration": 1, "x": _Evil()}, os.path.join(bad, "common.pt"))
    with pytest.raises(CheckpointingException, match=r"common\.pt: the pickle names posix\.system, which is not one of the globals"):
        load_common_state_dict(bad)
    with pytest.raises(CheckpointingException, match=r"common\.pt: the pickle names posix\.system"):
        convert_megatron(bad, str(tmp_path / "out"))
    assert not marker.exists()
    assert not os.path.exists(tmp_path / "out" / "metadata.json")


def test_without_megatron_core_the_enums_convert_as_stand_ins_and_load_as_megatrons_where_it_is(megatron_dir, tmp_path, monkeypatch):
    import sys

    real = _enums()
    for module in ("megatron.core.enums", "megatron.core.transformer.enums", "megatron.core.rerun_state_machine"):
        monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError: as where megatron-core is not installed
    out = str(tmp_path / "converted")
    convert_megatron(megatron_dir, out)
    args = load_common_state_dict(out)["args"]
    assert type(args.model_type).__module__ == "shardsafe.format.safe_pickle"
    assert (args.model_type.name, args.model_type.value) == ("encoder_or_decoder", 1)
    assert (args.attention_backend.name, args.attention_backend.value) == ("flash", 1)
    monkeypatch.undo()
    common = load_common_state_dict(out)
    assert common["args"].model_type is real[0].encoder_or_decoder and common["args"].attention_backend is real[1].flash
    assert common["rerun_state_machine"] == {"mode": real[2].DISABLED, "state": real[3].NOT_RUNNING_YET}
