"""shardsafe.lightning: real Lightning Trainer runs on CPU gloo ranks (``tests/helpers.py``).

Lightning sees the ranks as launched externally (``LOCAL_RANK`` set, process group already
initialised), so it runs in the test's own processes. FSDP2 through Lightning's
``ModelParallelStrategy`` (CPU-capable), and DDP. Truth: an uninterrupted run's losses and
Lightning's own checkpoint dicts.
"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import shardsafe  # noqa: E402
import shardsafe.lightning  # noqa: E402

from .helpers import assert_bits, run_ranks  # noqa: E402
from .lightning_runs import fit, fits, net  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_trainer_resumes_at_another_world_size_with_the_same_losses(tmp_path, kind):
    ckpts = str(tmp_path / "ckpts")
    step4 = os.path.join(ckpts, "step=4.ckpt")
    # uninterrupted: 6 steps on 2 ranks, saved every 2 steps; then, in the same ranks, a new
    # Trainer resumed from step 4 on the same world size
    full, again = zip(*run_ranks(2, fits, (kind, ckpts, 6, None), (kind, str(tmp_path / "again"), 6, step4)))
    assert sorted(os.listdir(ckpts)) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]
    assert shardsafe.lightning.read_meta(os.path.join(ckpts, "last.ckpt"))["global_step"] == 6  # replaced at each save
    assert "metadata.json" in os.listdir(step4) and "meta.pt" not in os.listdir(step4)
    assert not shardsafe.verify(step4).errors
    meta = shardsafe.lightning.read_meta(step4)
    assert meta["global_step"] == 4 and meta["lr_schedulers"][0]["last_epoch"] == 4

    # resumed on the same world size: bit-exact losses of steps 5 and 6 on each rank
    for rank in range(2):
        assert again[rank][0] == full[rank][0][4:], rank
        assert again[rank][1:] == full[rank][1:] == (6, 3)

    # resumed on 1 rank (a batch of 8 where two ranks had 4 each): the first loss after resuming is
    # the mean of the two ranks' at that step, up to rounding, and so are the next
    one = run_ranks(1, fit, kind, str(tmp_path / "one"), 6, step4)
    losses, step, epoch = one[0]
    assert (step, epoch, len(losses)) == (6, 3, 2)
    want = [(a + b) / 2 for a, b in zip(full[0][0][4:], full[1][0][4:])]
    assert losses == pytest.approx(want, rel=1e-5)


def test_a_folder_lightnings_own_strategy_wrote_resumes_through_shardsafe(tmp_path):
    ckpts = str(tmp_path / "ckpts")
    step4 = os.path.join(ckpts, "step=4.ckpt")
    # Lightning's own strategy trains and saves; a new Trainer in the same ranks resumes through shardsafe's
    full, again = zip(*run_ranks(2, fits, ("lightning-fsdp", ckpts, 6, None), ("fsdp", str(tmp_path / "again"), 6, step4)))
    assert {".metadata", "meta.pt"} <= set(os.listdir(step4))
    for rank in range(2):
        assert again[rank][0] == full[rank][0][4:], rank
        assert again[rank][1:] == full[rank][1:] == (6, 3)

    # consolidated (.metadata through the allowlist, meta.pt with weights_only) as Lightning's own tool does
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

    ours = shardsafe.lightning.consolidate(step4)
    out = tmp_path / "step=4.ckpt.consolidated"
    counts = shardsafe.lightning.consolidate(step4, out)
    f = io.BytesIO()
    torch.save(ours, f)
    assert out.read_bytes() == f.getvalue()  # the file torch.save writes for the dict
    with zipfile.ZipFile(out) as z:
        assert counts["tensors"] == _count_tensors(ours) == len([n for n in z.namelist() if "/data/" in n])
    theirs = _load_distributed_checkpoint(Path(step4))
    theirs.setdefault("model", theirs.pop("state_dict"))  # (their tool expects FSDPStrategy's name)
    theirs = _format_checkpoint(theirs)
    assert sorted(ours) == sorted(theirs) and ours["global_step"] == 4 and ours["loops"] == theirs["loops"]
    for name, t in theirs["state_dict"].items():
        assert_bits(ours["state_dict"][name], t, name)
    (mine,), (want,) = ours["optimizer_states"], theirs["optimizer_states"]
    assert mine["param_groups"] == want["param_groups"]
    for name, st in want["state"].items():
        for k, t in st.items():
            assert_bits(mine["state"][name][k], t, f"{name}.{k}")


def _count_tensors(value) -> int:
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, dict):
        return sum(_count_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_count_tensors(v) for v in value)
    return 0


def test_consolidate_writes_lightnings_single_file_layout(tmp_path):
    ckpts = str(tmp_path / "ckpts")
    run_ranks(2, fit, "fsdp", ckpts, 2, None, str(tmp_path / "truth.pt"))
    step2 = os.path.join(ckpts, "step=2.ckpt")
    out = str(tmp_path / "step=2.ckpt.consolidated")
    shardsafe.lightning.consolidate(step2, out)
    ckpt = torch.load(out, weights_only=True)
    assert ckpt["global_step"] == 2 and ckpt["epoch"] == 0
    model = net()(fsdp=False)
    model.load_state_dict(ckpt["state_dict"], strict=True)
    assert sorted(ckpt["state_dict"]) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
    want = shardsafe.unshard_model_state(step2, no_dist=True)
    assert sorted(want) == sorted(ckpt["state_dict"])
    (optim,) = ckpt["optimizer_states"]
    assert optim["param_groups"][0]["betas"] == [0.8, 0.95]  # (stored as JSON: a list; AdamW takes either)
    truth = torch.load(tmp_path / "truth.pt")  # the trained model and optimizer after step 2, by DCP's get_state_dict
    assert optim["param_groups"][0]["params"] == truth["optim"]["param_groups"][0]["params"]
    assert optim["param_groups"][0]["lr"] == truth["optim"]["param_groups"][0]["lr"] == 5e-3  # StepLR halved it
    assert sorted(truth["model"]) == sorted(ckpt["state_dict"])
    for name, t in truth["model"].items():
        assert_bits(ckpt["state_dict"][name], t, name)
    assert sorted(truth["optim"]["state"]) == sorted(optim["state"])
    for name, st in truth["optim"]["state"].items():
        for k, t in st.items():
            assert_bits(optim["state"][name][k], t, f"{name}.{k}")


def _parallelize(model, mesh):
    from torch.distributed.fsdp import fully_shard

    dp = mesh["data_parallel"]
    fully_shard(model[0], mesh=dp)
    fully_shard(model[2], mesh=dp)
    return fully_shard(model, mesh=dp)


def _fabric(rank, ws, path, truth_path, load, own=False):
    """Fabric + FSDP2: train 2 steps and ``fabric.save`` on 2 ranks, or ``fabric.load`` elsewhere
    (``own``: through Lightning's own Fabric ModelParallelStrategy, DCP files and meta.pt)."""
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(ws))
    kind = ModelParallelStrategy if own else shardsafe.lightning.FabricModelParallelStrategy
    strategy = kind(_parallelize, data_parallel_size=ws, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=ws, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    optim = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95)))
    state = {"model": model, "optimizer": optim, "step": 0, "history": ()}
    if load:
        fabric.load(path, state)
    else:
        for s in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + s))
            fabric.backward(model(x).square().mean())
            optim.step()
            optim.zero_grad()
        state.update(step=2, history=(1.5, float("inf")))
        fabric.save(path, state)
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, truth_path)
    return state["step"], state["history"], [g["betas"] for g in optim.param_groups]


def test_fabric_save_and_load_on_another_world_size(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _fabric, path, str(tmp_path / "saved.pt"), False)
    assert not shardsafe.verify(path).errors
    (got,) = run_ranks(1, _fabric, path, str(tmp_path / "loaded.pt"), True)
    assert got == (2, (1.5, float("inf")), [(0.8, 0.95)])
    want, loaded = torch.load(tmp_path / "saved.pt"), torch.load(tmp_path / "loaded.pt")
    for name, t in want["model"].items():
        assert_bits(loaded["model"][name], t, name)
    for name, st in want["optim"]["state"].items():
        for k, t in st.items():
            assert_bits(loaded["optim"]["state"][name][k], t, f"{name}.{k}")


def test_loop_state_without_a_json_form_needs_allow_pickle(tmp_path):
    import io

    from torch import nn

    from shardsafe import CheckpointError, PickleNotAllowedError

    model = nn.Linear(2, 2)
    path = str(tmp_path / "ckpt")
    meta = {"global_step": 5, "callbacks": {"cb": {"buf": io.StringIO("x"), "best": torch.tensor(0.25)}}}
    with pytest.raises(PickleNotAllowedError, match=r"(?s)lightning\.meta.*\['callbacks'\]\['cb'\]\['buf'\].*StringIO.*allow_pickle=True to the shardsafe\.lightning strategy"):
        shardsafe.lightning.save_checkpoint(path, model, [], meta)
    assert not os.path.exists(os.path.join(path, "metadata.json"))
    shardsafe.lightning.save_checkpoint(path, model, [], meta, allow_pickle=True)
    with pytest.raises(PickleNotAllowedError, match=r"\['callbacks'\]\['cb'\]\['buf'\].*pickle.*allow_pickle=True to the shardsafe\.lightning strategy"):
        shardsafe.lightning.read_meta(path)
    got = shardsafe.lightning.read_meta(path, allow_pickle=True)
    assert got["global_step"] == 5 and got["callbacks"]["cb"]["buf"].getvalue() == "x"
    assert_bits(got["callbacks"]["cb"]["best"], torch.tensor(0.25), "best")

    two = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)]
    with pytest.raises(CheckpointError, match="one optimizer per checkpoint, the module has 2"):
        shardsafe.lightning.save_checkpoint(str(tmp_path / "two"), model, two, {})


def test_fabric_wrapper_names_are_not_stored(tmp_path):
    import lightning as L
    from torch import nn

    fabric = L.Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    wrapped, optim = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    wrapped(torch.randn(4, 3)).sum().backward()
    optim.step()
    path = str(tmp_path / "ckpt")
    shardsafe.save_model_and_optim_state(path, wrapped, optim.optimizer)
    meta = shardsafe.Checkpointer().get_metadata(path, no_dist=True)
    assert sorted(k for k in meta.tensors if k.startswith("model.")) == [
        "model.0.bias", "model.0.weight", "model.1.bias", "model.1.num_batches_tracked", "model.1.running_mean",
        "model.1.running_var", "model.1.weight",
    ]
    assert meta.objects["optim.param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    plain = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    shardsafe.load_model_and_optim_state(path, plain)
    for (name, a), b in zip(plain.state_dict().items(), model.state_dict().values()):
        assert_bits(a, b, name)


def _assert_same_model_and_optim(want_path, got_path) -> None:
    want, got = torch.load(want_path), torch.load(got_path)
    assert sorted(got["model"]) == sorted(want["model"]) and sorted(got["optim"]["state"]) == sorted(want["optim"]["state"])
    for name, t in want["model"].items():
        assert_bits(got["model"][name], t, name)
    for name, st in want["optim"]["state"].items():
        for k, t in st.items():
            assert_bits(got["optim"]["state"][name][k], t, f"{name}.{k}")


def test_a_folder_lightnings_own_fabric_strategy_wrote_loads_through_shardsafe(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _fabric, path, str(tmp_path / "saved.pt"), False, True)  # Lightning's own Fabric ModelParallelStrategy
    assert {".metadata", "meta.pt"} <= set(os.listdir(path)) and "metadata.json" not in os.listdir(path)
    (got,) = run_ranks(1, _fabric, path, str(tmp_path / "loaded.pt"), True)  # shardsafe's, on 1 rank
    assert got == (2, (1.5, float("inf")), [(0.8, 0.95)])
    _assert_same_model_and_optim(tmp_path / "saved.pt", tmp_path / "loaded.pt")


def test_a_folder_of_lightnings_trainer_fsdp_strategy_loads_from_its_model_key(tmp_path):
    """Lightning's Trainer FSDPStrategy (state_dict_type="sharded") stores the model under "model"
    (its ModelParallelStrategy under "state_dict") and optimizer i under "optimizer_<i>", with the
    rest of the checkpoint dict in meta.pt."""
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from shardsafe import MissingKeyError
    from shardsafe.lightning.strategies import _load_lightning_dcp_folder

    def made(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))

    model, optim = made(0)
    for s in range(2):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(s))).square().mean().backward()
        optim.step()
        optim.zero_grad()
    path = tmp_path / "step=2.ckpt"
    converted = {"model": get_model_state_dict(model), "optimizer_0": get_optimizer_state_dict(model, optim)}
    dcp.save(converted, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    torch.save({"epoch": 0, "global_step": 2, "loops": {"fit_loop": {"epoch_progress": {"current": 1}}}}, path / "meta.pt")

    other, other_optim = made(1)
    meta = _load_lightning_dcp_folder(path, other, [other_optim], strict=True)
    assert meta == {"epoch": 0, "global_step": 2, "loops": {"fit_loop": {"epoch_progress": {"current": 1}}}}
    for (name, a), b in zip(other.state_dict().items(), model.state_dict().values()):
        assert_bits(a, b, name)
    want, got = optim.state_dict(), other_optim.state_dict()
    assert got["param_groups"] == want["param_groups"] and sorted(got["state"]) == sorted(want["state"]) == [0, 1, 2, 3]
    for i, st in want["state"].items():
        for k, t in st.items():
            assert_bits(got["state"][i][k], t, f"{i}.{k}")

    bare = tmp_path / "bare"
    dcp.save({"weights": get_model_state_dict(model)}, storage_writer=dcp.FileSystemWriter(str(bare)), no_dist=True)
    with pytest.raises(MissingKeyError, match=r"holds its model under 'state_dict' \(ModelParallelStrategy\) or 'model' \(FSDPStrategy\); this one holds \['weights'\]"):
        _load_lightning_dcp_folder(bare, other, [], strict=True)
