"""shardsafe.dcp: torch.distributed.checkpoint's storage plugin interfaces, and DCP checkpoints read safely.

Real gloo ranks (``tests/helpers.py``), FSDP2 (``fully_shard``) on CPU. Truth is taken with
DCP's own full state dicts (``get_state_dict(full_state_dict=True)``) and DCP's own
``FileSystemWriter``, never with shardsafe's code.
"""

from __future__ import annotations

import io
import os
import pickle
import re

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import shardsafe
import shardsafe.dcp
from shardsafe import Checkpointer, CheckpointExistsError, CorruptCheckpointError, PickleNotAllowedError, ShardedTensor
from shardsafe.dcp import UnsafePickleError

from .helpers import assert_bits, built_once, dcp_failure, run_ranks
from .helpers import full_tensor as full

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable):UserWarning")


class Counter:
    """A Stateful value: DCP calls state_dict() on save and load_state_dict() on load."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.history = [0.5 * i for i in range(n)]

    def state_dict(self) -> dict:
        return {"n": self.n, "history": list(self.history)}

    def load_state_dict(self, sd: dict) -> None:
        self.n, self.history = sd["n"], list(sd["history"])


# -- FSDP2 model + AdamW, through get_state_dict / set_state_dict ------------------------------


def _fsdp_model(ws: int):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 10, bias=False))
    mesh = init_device_mesh("cpu", (ws,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))


def _train(model, optim, steps: int) -> None:
    for s in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + s))
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()


def _save_truth(rank, model, optim, truth_path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, truth_path)


def _dcp_save_fsdp(rank, ws, path, truth_path, asynchronous, allow_pickle=True):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _fsdp_model(ws)
    _train(model, optim, 2)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "counter": Counter(3)}
    _save_truth(rank, model, optim, truth_path)
    writer = shardsafe.dcp.StorageWriter(path, allow_pickle=allow_pickle)
    if asynchronous:
        pending = dcp.async_save(state, storage_writer=writer)
        with torch.no_grad():
            for p in model.parameters():  # the save goes on from a staged copy
                p.add_(1.0)
        pending.result()
    else:
        dcp.save(state, storage_writer=writer)


def _dcp_load_fsdp(rank, ws, path, out_path, allow_pickle):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = _fsdp_model(ws)
    msd, osd = get_state_dict(model, optim)  # a fresh optimizer: DCP initialises its state
    counter = Counter()
    state = {"model": msd, "optim": osd, "counter": counter}
    dcp.load(state, storage_reader=shardsafe.dcp.StorageReader(path, allow_pickle=allow_pickle))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _save_truth(rank, model, optim, out_path)
    return counter.state_dict(), [g["betas"] for g in optim.param_groups], [g["lr"] for g in optim.param_groups]


def _api_load_fsdp(rank, ws, path, out_path):
    model, optim = _fsdp_model(ws)
    shardsafe.load_model_and_optim_state(path, model, optim)
    _save_truth(rank, model, optim, out_path)
    return [g["betas"] for g in optim.param_groups], [g["lr"] for g in optim.param_groups]


def _built_on_2_ranks(tmp_path_factory, name, fn, *args) -> tuple[str, str]:
    """The checkpoint and truth ``fn`` saves on 2 ranks, once per test run for every test (and
    worker) that reads it: read them, never change them."""

    def build(base):
        os.makedirs(base)
        run_ranks(2, fn, os.path.join(base, "ckpt"), os.path.join(base, "truth.pt"), *args)

    base = built_once(tmp_path_factory, name, build)
    return os.path.join(base, "ckpt"), os.path.join(base, "truth.pt")


@pytest.fixture
def dcp_saved_without_pickle(tmp_path_factory) -> tuple[str, str]:
    """``dcp.save`` through our StorageWriter (allow_pickle=False) of a trained FSDP2 model + AdamW, and its truth."""
    return _built_on_2_ranks(tmp_path_factory, "dcp-fsdp2-no-pickle", _dcp_save_fsdp, False, False)


@pytest.fixture
def our_saved(tmp_path_factory) -> tuple[str, str]:
    """``save_model_and_optim_state`` of a trained FSDP2 model + AdamW on 2 ranks, and its truth."""
    return _built_on_2_ranks(tmp_path_factory, "dcp-fsdp2-ours", _our_save_fsdp)


@pytest.mark.parametrize("ws", [1, 4])
def test_dcp_get_state_dict_save_loads_with_load_model_and_optim_state(tmp_path, ws, dcp_saved_without_pickle):
    """``dcp.save`` of ``get_state_dict``'s FSDP2 model + AdamW state (param groups flattened by
    DCP to ``optim.param_groups.0.*``, betas a tuple) with no pickle, loaded by our API."""
    path, truth = dcp_saved_without_pickle
    meta = Checkpointer().get_metadata(path, no_dist=True)
    assert meta.pickled_objects == {} and "optim.param_groups" not in meta.objects
    out = str(tmp_path / "loaded.pt")
    got = run_ranks(ws, _api_load_fsdp, path, out)
    _compare_states(torch.load(out), torch.load(truth))
    assert got[0] == ([(0.8, 0.95)], [1e-2])
    assert type(got[0][0][0]) is tuple

    # and unsharded (what shardsafe.lightning.consolidate writes)
    want = torch.load(truth)
    full_optim = shardsafe.unshard_optim_state(path, no_dist=True)
    (group,) = full_optim["param_groups"]
    assert group["betas"] == (0.8, 0.95) and group["lr"] == 1e-2 and group["params"] == want["optim"]["param_groups"][0]["params"]
    for fqn, st in want["optim"]["state"].items():
        for name, t in st.items():
            assert_bits(full_optim["state"][fqn][name], t, f"{fqn}.{name}")


def _checkpointer_load_cols(rank, ws, path, keys_shapes, out_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    sd = {k: distribute_tensor(torch.full(s, float("nan")), mesh, [Shard(len(s) - 1)]) for k, s in keys_shapes.items()}
    Checkpointer().load(path, sd)
    got = {k: v.full_tensor() for k, v in sd.items()}  # a collective: every rank
    if rank == 0:
        torch.save(got, out_path)  # (tensors do not travel back through run_ranks' queue)


def _compare_states(got: dict, want: dict) -> None:
    for fqn, t in want["model"].items():
        assert_bits(got["model"][fqn], t, fqn)
    for fqn, st in want["optim"]["state"].items():
        for name, t in st.items():
            assert_bits(got["optim"]["state"][fqn][name], t, f"{fqn}.{name}")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "async_save"])
def test_dcp_save_through_writer_is_a_shardsafe_checkpoint(tmp_path, asynchronous):
    path, truth = str(tmp_path / "ckpt"), str(tmp_path / "truth.pt")
    run_ranks(2, _dcp_save_fsdp, path, truth, asynchronous)
    want = torch.load(truth)

    assert not shardsafe.verify(path).errors
    names = sorted(os.listdir(path))
    assert names[0] == "metadata.json" and len(names) == 3 and all(n.startswith(("shard-r00000-", "shard-r00001-")) for n in names[1:])
    meta = Checkpointer().get_metadata(path, no_dist=True)
    assert meta.pickled_objects == {}  # AdamW's betas, a tuple, is tagged JSON
    assert meta.objects["optim.param_groups.0.betas"] == {"__shardsafe__": "tuple", "items": [0.8, 0.95]}
    assert meta.objects["optim.param_groups.0.lr"] == 1e-2 and meta.objects["counter.history"] == [0.0, 0.5, 1.0]

    got = Checkpointer(allow_pickle=True).unshard(path)
    for fqn, t in want["model"].items():
        assert_bits(got[f"model.{fqn}"], t, fqn)
    for fqn, st in want["optim"]["state"].items():
        for name, t in st.items():
            assert_bits(got[f"optim.state.{fqn}.{name}"], t, f"{fqn}.{name}")
    assert got["optim.param_groups.0.betas"] == (0.8, 0.95) and got["counter.n"] == 3

    if asynchronous:  # one rank, through DCP: get_state_dict -> dcp.load -> set_state_dict
        out = str(tmp_path / "loaded.pt")
        counters = run_ranks(1, _dcp_load_fsdp, path, out, True)
        _compare_states(torch.load(out), want)
        assert counters[0][0] == {"n": 3, "history": [0.0, 0.5, 1.0]}
        return
    # resharded: 4 ranks, columns instead of FSDP's rows, through Checkpointer
    shapes = {"model.0.weight": (24, 16), "optim.state.2.weight.exp_avg_sq": (10, 24)}
    run_ranks(4, _checkpointer_load_cols, path, shapes, str(tmp_path / "cols.pt"))
    cols = torch.load(tmp_path / "cols.pt")
    assert_bits(cols["model.0.weight"], want["model"]["0.weight"], "model.0.weight")
    assert_bits(cols["optim.state.2.weight.exp_avg_sq"], want["optim"]["state"]["2.weight"]["exp_avg_sq"], "exp_avg_sq")

    # and back through DCP on 4 ranks: get_state_dict -> dcp.load -> set_state_dict
    out = str(tmp_path / "loaded.pt")
    counters = run_ranks(4, _dcp_load_fsdp, path, out, True)
    _compare_states(torch.load(out), want)
    assert counters[0][0] == {"n": 3, "history": [0.0, 0.5, 1.0]}
    assert counters[0][1] == [(0.8, 0.95)] and counters[0][2] == [1e-2]


def _our_save_fsdp(rank, ws, path, truth_path):
    model, optim = _fsdp_model(ws)
    _train(model, optim, 2)
    shardsafe.save_model_and_optim_state(path, model, optim)
    _save_truth(rank, model, optim, truth_path)


@pytest.mark.parametrize("ws", [1, 4])
def test_save_model_and_optim_state_loads_through_dcp_on_other_world_sizes(tmp_path, ws, our_saved):
    (path, truth), out = our_saved, str(tmp_path / "loaded.pt")
    # the stored param groups are one JSON list; DCP asks for optim.param_groups.0.lr and the like
    results = run_ranks(ws, _dcp_load_fsdp_model_optim, path, out)
    _compare_states(torch.load(out), torch.load(truth))
    betas, lrs = results[0]
    assert list(betas[0]) == [0.8, 0.95] and lrs == [1e-2]


def _dcp_load_fsdp_model_optim(rank, ws, path, out_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = _fsdp_model(ws)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=shardsafe.dcp.StorageReader(path))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _save_truth(rank, model, optim, out_path)
    return [g["betas"] for g in optim.param_groups], [g["lr"] for g in optim.param_groups]


# -- Checkpointer saves (DTensor rows, flattened ranges) read by dcp.load, resharded ---------------

SHAPES = {"w": (10, 6), "u": (7, 5), "flat": (6, 5)}


def _checkpointer_save_rows(rank, ws, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    sd = {k: distribute_tensor(full(k, SHAPES[k]), mesh, [Shard(0)]) for k in ("w", "u")}
    whole = full("flat", SHAPES["flat"]).reshape(-1)
    lo, hi = ((0, 13), (13, 30))[rank]  # a flattened range that cuts rows: not a box
    sd["flat"] = ShardedTensor.from_rank_offsets_flat("flat", whole[lo:hi].clone(), SHAPES["flat"], flattened_range=slice(lo, hi))
    sd["bf16"] = full("bf16", (4, 3), torch.bfloat16)  # replicated
    sd["cfg"] = {"name": "run", "sizes": [1, 2]}
    sd["step"] = 11
    Checkpointer().save(path, sd)


def _dcp_load_cols(rank, ws, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    sd = {k: distribute_tensor(torch.full(s, float("nan")), mesh, [Shard(1)]) for k, s in SHAPES.items()}
    sd["bf16"] = torch.zeros(4, 3, dtype=torch.bfloat16)
    sd["cfg"] = {"name": "", "sizes": []}  # DCP flattens it to cfg.name and cfg.sizes
    sd["step"] = 0
    dcp.load(sd, storage_reader=shardsafe.dcp.StorageReader(path))
    for k, s in SHAPES.items():
        assert_bits(sd[k].full_tensor(), full(k, s), k)
    assert_bits(sd["bf16"], full("bf16", (4, 3), torch.bfloat16), "bf16")
    return sd["cfg"], sd["step"]


def test_checkpointer_save_loads_through_dcp_resharded(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _checkpointer_save_rows, path)
    assert run_ranks(4, _dcp_load_cols, path) == [({"name": "run", "sizes": [1, 2]}, 11)] * 4


def test_reader_checks_checksums(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    Checkpointer().save(path, {"w": full("w", (64, 64)), "secret": {"x": 1}})
    data = next(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    with open(data, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\xff")
    sd = {"w": torch.zeros(64, 64)}
    with pytest.raises(CheckpointException) as info:  # DCP wraps every rank's error (and is a BaseException)
        dcp.load(sd, storage_reader=shardsafe.dcp.StorageReader(path), no_dist=True)
    cause = dcp_failure(info.value)
    assert isinstance(cause, CorruptCheckpointError) and "checksum mismatch" in str(cause) and "'w'" in str(cause)


def test_reader_converts_dtypes_and_rebuilds_state_dicts_from_metadata(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    path = str(tmp_path / "ckpt")
    Checkpointer().save(path, {"w": full("w", (5, 4)), "optim.param_groups": [{"lr": 0.1, "params": ["w"]}], "step": 3})
    target = {"w": torch.zeros(5, 4, dtype=torch.bfloat16)}
    dcp.load(target, storage_reader=shardsafe.dcp.StorageReader(path), no_dist=True)
    assert_bits(target["w"], full("w", (5, 4)).to(torch.bfloat16), "w")  # as DCP's FileSystemReader converts

    # a state dict built from the metadata alone (DCP's _EmptyStateDictLoadPlanner, as dcp_to_torch_save uses)
    rebuilt = _load_state_dict_from_keys(storage_reader=shardsafe.dcp.StorageReader(path))
    assert sorted(rebuilt) == ["optim.param_groups", "step", "w"]
    assert rebuilt["optim.param_groups"] == [{"lr": 0.1, "params": ["w"]}] and rebuilt["step"] == 3
    assert_bits(rebuilt["w"], full("w", (5, 4)), "w")


def test_plan_caching_never_reuses_a_file_name(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    names = []
    for i in range(3):  # DCP replays its cached plan (with the first save's file assignment) from the second save on
        path = str(tmp_path / ("same" if i else "first"))
        sd = {"w": full("w", (6, 2)) + i, "step": i}
        planner = DefaultSavePlanner(enable_plan_caching=True)
        dcp.save(sd, storage_writer=shardsafe.dcp.StorageWriter(path, overwrite=True), planner=planner, no_dist=True)
        assert not shardsafe.verify(path).errors
        got = Checkpointer().unshard(path)
        assert_bits(got["w"], full("w", (6, 2)) + i, "w") and got["step"] == i
        names += [n for n in os.listdir(path) if n.endswith(".safetensors")]
    assert len(set(names)) == 3


# -- DCP's own checkpoints: convert, and read directly ---------------------------------------------


def _dcp_native_save(rank, ws, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    sd = {k: distribute_tensor(full(k, SHAPES[k]), mesh, [Shard(0)]) for k in ("w", "u")}
    sd["rep"] = full("rep", (5, 3), torch.bfloat16)  # on every rank: DCP stores it once
    sd["scalar"] = torch.tensor(2.5)
    sd["extra"] = {"epoch": 4, "names": ["a", "b"]}
    sd["counter"] = Counter(2)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))


def _dcp_native_load_cols(rank, ws, path, options=None):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    sd = {k: distribute_tensor(torch.full(SHAPES[k], float("nan")), mesh, [Shard(1)]) for k in ("w", "u")}
    sd["rep"] = distribute_tensor(torch.zeros(5, 3, dtype=torch.bfloat16), mesh, [Shard(0)])
    sd["scalar"] = torch.tensor(0.0)
    sd["extra"] = {"epoch": 0, "names": []}
    sd["counter"] = Counter()
    dcp.load(sd, storage_reader=shardsafe.dcp.StorageReader(path, **(options or {})))
    for k in ("w", "u"):
        assert_bits(sd[k].full_tensor(), full(k, SHAPES[k]), k)
    assert_bits(sd["rep"].full_tensor(), full("rep", (5, 3), torch.bfloat16), "rep")
    assert_bits(sd["scalar"], torch.tensor(2.5), "scalar")
    return sd["extra"], sd["counter"].state_dict()


def test_dcp_checkpoint_converts_and_loads_directly(tmp_path):
    src, dst = str(tmp_path / "dcp"), str(tmp_path / "ours")
    run_ranks(2, _dcp_native_save, src)
    assert sorted(os.listdir(src)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    seen = []
    meta = shardsafe.dcp.convert(src, dst, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1][0] == seen[-1][1] == sum(t.torch_dtype.itemsize * _numel(t.shape) for t in meta.tensors.values())
    assert not shardsafe.verify(dst).errors
    got = Checkpointer().unshard(dst)
    for k in ("w", "u"):
        assert_bits(got[k], full(k, SHAPES[k]), k)
    assert_bits(got["rep"], full("rep", (5, 3), torch.bfloat16), "rep")
    assert meta.tensors["rep"].chunk_count() == 1 and not meta.tensors["rep"].is_sharded
    assert got["extra.epoch"] == 4 and got["extra.names"] == ["a", "b"] and got["counter.n"] == 2
    with pytest.raises(CheckpointExistsError, match="already committed"):
        shardsafe.dcp.convert(src, dst)

    want = ({"epoch": 4, "names": ["a", "b"]}, {"n": 2, "history": [0.0, 0.5]})
    assert run_ranks(4, _dcp_native_load_cols, src) == [want] * 4  # DCP's folder, read directly
    assert run_ranks(2, _dcp_native_load_cols, dst) == [want] * 2  # and the converted one


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _dcp_single(path, sd):
    import torch.distributed.checkpoint as dcp

    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def test_truncated_distcp_file_is_detected(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = str(tmp_path / "dcp")
    _dcp_single(src, {"w": full("w", (32, 32)), "v": full("v", (8,))})
    data = os.path.join(src, "__0_0.distcp")
    os.truncate(data, os.path.getsize(data) - 1000)
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp"):
        shardsafe.dcp.convert(src, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out" / "metadata.json")
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(32, 32), "v": torch.zeros(8)}, storage_reader=shardsafe.dcp.StorageReader(src), no_dist=True)
    assert isinstance(dcp_failure(info.value), CorruptCheckpointError)


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_Evil.marker}",))


def test_metadata_pickle_with_a_foreign_class_is_refused_unrun(tmp_path):
    src = str(tmp_path / "dcp")
    _dcp_single(src, {"w": full("w", (4, 4))})
    marker = tmp_path / "pwned"
    _Evil.marker = str(marker)
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    with open(os.path.join(src, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    meta.planner_data = {"w": ("w",), "x": _Evil()}  # anywhere inside the document
    meta.state_dict_metadata["x"] = BytesStorageMetadata()
    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump(meta, f)

    with pytest.raises(UnsafePickleError, match=r"names posix\.system, which is not one of the globals a torch\.distributed\.checkpoint metadata file holds"):
        shardsafe.dcp.StorageReader(src).read_metadata()
    with pytest.raises(UnsafePickleError, match=r"posix\.system"):
        shardsafe.dcp.convert(src, str(tmp_path / "out"))
    assert not marker.exists()
    assert issubclass(UnsafePickleError, CorruptCheckpointError)


def test_tuples_and_the_like_are_tagged_json_not_pickle(tmp_path):
    import collections

    import numpy as np
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    values = {
        "betas": (0.9, 0.99),
        "od": (collections.OrderedDict([("b", 1), ("a", (2, float("inf")))]),),  # (DCP flattens a bare mapping)
        "nan": float("nan"),
        "np": np.float32(1.5),
        "plain": ({"__shardsafe__": 1},),  # a dict holding the tag key is escaped, not misread
    }
    dcp.save({"w": full("w", (3,)), **values}, storage_writer=shardsafe.dcp.StorageWriter(path), no_dist=True)
    meta = Checkpointer().get_metadata(path, no_dist=True)
    assert meta.pickled_objects == {} and meta.objects["betas"] == {"__shardsafe__": "tuple", "items": [0.9, 0.99]}
    for got in (
        Checkpointer().unshard(path, no_dist=True),
        _dcp_loaded(path, {"w": torch.zeros(3), **dict.fromkeys(values)}),
    ):
        assert got["betas"] == (0.9, 0.99) and type(got["betas"]) is tuple
        od = got["od"][0]
        assert type(od) is collections.OrderedDict and list(od.items()) == [("b", 1), ("a", (2, float("inf")))]
        assert got["nan"] != got["nan"] and got["plain"] == ({"__shardsafe__": 1},)
        assert type(got["np"]) is np.float32 and got["np"] == np.float32(1.5)
        assert_bits(got["w"], full("w", (3,)), "w")


def _dcp_loaded(path, target):
    import torch.distributed.checkpoint as dcp

    dcp.load(target, storage_reader=shardsafe.dcp.StorageReader(path), no_dist=True)
    return target


def test_values_json_cannot_hold_need_allow_pickle(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    sd = {"w": full("w", (3,)), "opt": [{"z": 1 + 2j}]}
    with pytest.raises(CheckpointException) as info:
        dcp.save(sd, storage_writer=shardsafe.dcp.StorageWriter(path), no_dist=True)
    cause = dcp_failure(info.value)
    assert isinstance(cause, PickleNotAllowedError) and "key 'opt.0.z'" in str(cause) and "complex" in str(cause)
    assert "allow_pickle=True to shardsafe.dcp.StorageWriter" in str(cause)
    assert not os.path.exists(os.path.join(path, "metadata.json"))

    dcp.save(sd, storage_writer=shardsafe.dcp.StorageWriter(path, allow_pickle=True), no_dist=True)
    target = {"w": torch.zeros(3), "opt": [{"z": None}]}
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=shardsafe.dcp.StorageReader(path), no_dist=True)
    assert isinstance(dcp_failure(info.value), PickleNotAllowedError)
    dcp.load(target, storage_reader=shardsafe.dcp.StorageReader(path, allow_pickle=True), no_dist=True)
    assert target["opt"][0]["z"] == 1 + 2j
    assert_bits(target["w"], full("w", (3,)), "w")

    # a committed checkpoint is not replaced unless asked
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(3)}, storage_writer=shardsafe.dcp.StorageWriter(path), no_dist=True)
    assert isinstance(dcp_failure(info.value), CheckpointExistsError)
    dcp.save({"w": torch.ones(3)}, storage_writer=shardsafe.dcp.StorageWriter(path, overwrite=True), no_dist=True)
    assert_bits(Checkpointer().unshard(path)["w"], torch.ones(3), "w")
    assert len([n for n in os.listdir(path) if n.endswith(".safetensors")]) == 1  # the replaced save's file is gone


def test_dcp_value_that_safe_loader_refuses_needs_allow_pickle(tmp_path):
    import torch.distributed.checkpoint as dcp

    src = str(tmp_path / "dcp")
    _dcp_single(src, {"w": full("w", (2,)), "obj": io.StringIO("x")})
    with pytest.raises(CheckpointException) as info:
        dcp.load({"w": torch.zeros(2), "obj": None}, storage_reader=shardsafe.dcp.StorageReader(src), no_dist=True)
    cause = dcp_failure(info.value)
    assert isinstance(cause, PickleNotAllowedError) and "'obj'" in str(cause)
    with pytest.raises(PickleNotAllowedError, match="'obj'"):
        shardsafe.dcp.convert(src, str(tmp_path / "out"))


# -- object store ----------------------------------------------------------------------------------


def _s3_save(rank, ws, url, options):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    sd = {"w": distribute_tensor(full("w", (64, 48)), mesh, [Shard(0)]), "step": 9}
    dcp.save(sd, storage_writer=shardsafe.dcp.StorageWriter(url, **options))


def _s3_load(rank, ws, url, options):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    sd = {"w": distribute_tensor(torch.zeros(64, 48), mesh, [Shard(1)]), "step": 0}
    dcp.load(sd, storage_reader=shardsafe.dcp.StorageReader(url, **options))
    assert_bits(sd["w"].full_tensor(), full("w", (64, 48)), "w")
    return sd["step"]


def test_s3_round_trip(tmp_path):
    from .servers import cloud

    s3 = cloud("s3")
    url = s3.url()
    run_ranks(2, _s3_save, url, s3.options)
    assert not shardsafe.verify(shardsafe.storage.open_storage(url, **s3.options)).errors
    assert run_ranks(2, _s3_load, url, s3.options) == [9, 9]
    dst = s3.url()  # convert reads and writes object stores too
    src = str(tmp_path / "dcp")
    _dcp_single(src, {"w": full("w", (64, 48))})
    shardsafe.dcp.convert(src, shardsafe.storage.open_storage(dst, **s3.options))
    assert_bits(Checkpointer().unshard(shardsafe.storage.open_storage(dst, **s3.options))["w"], full("w", (64, 48)), "w")


def test_a_dcp_checkpoint_in_s3_converts_and_loads_directly(tmp_path):
    """A folder DCP's FileSystemWriter wrote, uploaded to a bucket as it is: read there by
    ``dcp.load`` through our reader on 2 ranks, and converted bucket to bucket, bit-exact."""
    from shardsafe import ForeignCheckpointError
    from shardsafe.storage import open_storage

    from .servers import cloud

    s3 = cloud("s3")
    local = str(tmp_path / "dcp")
    run_ranks(2, _dcp_native_save, local)
    url = s3.url()
    src = open_storage(url, **s3.options)
    for name in sorted(os.listdir(local)):
        with open(os.path.join(local, name), "rb") as f, src.write_file(name) as w:
            w.write(memoryview(f.read()))
    assert src.list() == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    want = ({"epoch": 4, "names": ["a", "b"]}, {"n": 2, "history": [0.0, 0.5]})
    assert run_ranks(2, _dcp_native_load_cols, url, s3.options) == [want] * 2  # the DCP checkpoint in the bucket, read directly

    with pytest.raises(ForeignCheckpointError, match=re.escape(f"{src.url}: this is a torch.distributed.checkpoint (DCP) checkpoint")):
        Checkpointer().get_metadata(src, no_dist=True)  # named as such in an object store too
    dst = s3.url()
    meta = shardsafe.dcp.convert(src, open_storage(dst, **s3.options), progress=False)
    assert meta.tensors["rep"].chunk_count() == 1
    assert not shardsafe.verify(open_storage(dst, **s3.options)).errors
    got = Checkpointer().unshard(open_storage(dst, **s3.options))
    for k in ("w", "u"):
        assert_bits(got[k], full(k, SHAPES[k]), k)
    assert_bits(got["rep"], full("rep", (5, 3), torch.bfloat16), "rep")
    assert_bits(got["scalar"], torch.tensor(2.5), "scalar")
    assert got["extra.epoch"] == 4 and got["extra.names"] == ["a", "b"] and got["counter.n"] == 2
    assert run_ranks(2, _dcp_native_load_cols, dst, s3.options) == [want] * 2  # and the converted one, through DCP
