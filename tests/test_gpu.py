"""CUDA paths: FSDP2 and FSDP1 models on a GPU saved and loaded in place (sync and async), a CPU
checkpoint loaded into CUDA parameters at another world size, and Lightning's FSDPStrategy (which
refuses CPU) through ``shardsafe.lightning.FSDPStrategy``.

All need a CUDA device (marker ``gpu``; skipped elsewhere). One process per rank as in the rest of
the suite: one rank uses NCCL for CUDA tensors; two ranks share the one GPU of a test machine
through gloo (NCCL refuses two ranks on one device). Truth: DCP's ``get_state_dict`` of the same
model, full and on the CPU, compared bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

import shardsafe

from .helpers import bits, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

NCCL = "cpu:gloo,cuda:nccl"


def _backend(ws: int) -> str:
    return NCCL if ws == 1 else "gloo"


def _full(model, optim) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _same(got: tuple[dict, dict], want: tuple[dict, dict]) -> list[str]:
    """Names whose values differ between two (model, optim) full state dicts; [] when all agree."""
    bad = [k for k in want[0] if k not in got[0] or not torch.equal(bits(got[0][k]), bits(want[0][k]))]
    for name, st in want[1]["state"].items():
        for k, t in st.items():
            mine = got[1]["state"].get(name, {}).get(k)
            if mine is None or not torch.equal(bits(mine), bits(t)):
                bad.append(f"optim.{name}.{k}")
    return bad


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 33), torch.nn.ReLU(), torch.nn.Linear(33, 8))


def _wrap(kind: str, model: torch.nn.Module, ws: int) -> torch.nn.Module:
    dev = torch.device("cuda", 0)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda", (ws,))
        model = model.to(dev)
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(model, device_id=dev, use_orig_params=True, auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))
    if kind == "plain":
        return model.to(dev)
    raise ValueError(kind)


def _train(model, optim, rank: int, steps: int = 2) -> None:
    for s in range(steps):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * rank + s)).cuda()
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()


def _local(model, optim) -> dict[str, torch.Tensor]:
    """This rank's own bytes of every parameter and optimizer state, by name, on the CPU: no
    collective (two ranks share the one GPU through gloo, where DCP's full state dict gathers hang)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        out[name] = bits(t).clone()
        for k, v in optim.state.get(p, {}).items():
            v = v.to_local() if hasattr(v, "to_local") else v
            out[f"optim.{name}.{k}"] = bits(v).clone()
    return out


def _stage(path: str, rank: int, what: str) -> None:
    with open(f"{path}.rank{rank}.log", "a") as f:
        f.write(what + "\n")


def _save_then_load(rank, ws, kind, path, mode):
    """Train a CUDA model 2 steps, save (``mode``: sync or async, then zero every parameter before
    the commit), load into a fresh wrapping of the same kind; returns the names that differ (rank
    0, which holds the full state dicts compared)."""
    import faulthandler

    stacks = open(f"{path}.rank{rank}.stacks", "w")  # noqa: SIM115 - read by the test if this rank hangs
    faulthandler.dump_traceback_later(70, exit=True, file=stacks)
    torch.cuda.set_device(0)
    model = _wrap(kind, _mlp(), ws)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optim, rank)
    torch.cuda.synchronize()
    _stage(path, rank, "trained")
    want = _local(model, optim)
    if mode == "async":
        pending = shardsafe.async_save_model_and_optim_state(path, model, optim)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # queued right after the call returns: must not reach the checkpoint
        pending.wait()
    else:
        shardsafe.save_model_and_optim_state(path, model, optim)
    _stage(path, rank, "saved")
    fresh = _wrap(kind, _mlp(seed=7), ws)
    optim2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    shardsafe.load_model_and_optim_state(path, fresh, optim2)
    _stage(path, rank, "loaded")
    assert all(p.is_cuda for p in fresh.parameters())
    got = _local(fresh, optim2)
    faulthandler.cancel_dump_traceback_later()
    # every parameter; the optimizer state of those this rank holds a part of (FSDP1 gives a rank that
    # holds none of a parameter an empty view, which AdamW keeps no state for)
    assert sum(not k.startswith("optim.") for k in want) == 6 and sum(k.startswith("optim.") for k in want) % 3 == 0
    assert sum(k.startswith("optim.") for k in want) >= (3 * 6 if kind == "fsdp2" or ws == 1 else 3)
    return [k for k in want if k not in got or not torch.equal(got[k], want[k])]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_a_cuda_model_saves_and_loads_in_place_bit_exact(tmp_path, kind, ws, mode):
    path = str(tmp_path / "ckpt")
    try:
        got = run_ranks(ws, _save_then_load, kind, path, mode, backend=_backend(ws), timeout=100)
    except BaseException as e:
        for f in sorted(tmp_path.glob("ckpt.rank*")):
            e.add_note(f"--- {f.name}\n{f.read_text()[-3000:]}")
        raise
    assert got == [[]] * ws
    assert not shardsafe.verify(path).errors


def _cpu_save(rank, ws, path, truth_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    mesh = init_device_mesh("cpu", (ws,))
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    optim.step()
    shardsafe.save_model_and_optim_state(path, model, optim)
    want = _full(model, optim)
    if rank == 0:
        torch.save(want, truth_path)


def _cuda_load(rank, ws, kind, path, truth_path):
    torch.cuda.set_device(0)
    model = _wrap(kind, _mlp(seed=5), ws)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    shardsafe.load_model_and_optim_state(path, model, optim)
    assert all(p.is_cuda for p in model.parameters())
    return _same(_full(model, optim), torch.load(truth_path))


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1", "plain"])
def test_a_cpu_checkpoint_of_two_ranks_loads_into_cuda_parameters_on_one(tmp_path, kind):
    path, truth = str(tmp_path / "ckpt"), str(tmp_path / "truth.pt")
    run_ranks(2, _cpu_save, path, truth)
    assert run_ranks(1, _cuda_load, kind, path, truth, backend=NCCL, timeout=120) == [[]]


def _lightning_fit(rank, ws, ckpt_dir, max_steps, ckpt_path, truth_path=None):
    """``trainer.fit`` with ``shardsafe.lightning.FSDPStrategy`` on the GPU; returns the losses, the
    final global step and epoch."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from .lightning_runs import net

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(ws))
    strategy = shardsafe.lightning.FSDPStrategy(auto_wrap_policy={torch.nn.Linear})
    model = net()(fsdp=False)
    trainer = L.Trainer(
        accelerator="cuda", devices=ws, strategy=strategy, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=2, save_top_k=-1, save_last=True)],
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    if truth_path is not None:
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.state_dict_type(trainer.strategy.model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True)):
            sd = trainer.strategy.model.state_dict()
        if rank == 0:
            torch.save({k.replace("_fsdp_wrapped_module.", ""): v for k, v in sd.items()}, truth_path)
    return model.losses, trainer.global_step, trainer.current_epoch


@pytest.mark.filterwarnings("ignore")
def test_lightning_fsdp_strategy_resumes_with_the_same_losses(tmp_path):
    pytest.importorskip("lightning")
    import shardsafe.lightning

    ckpts = str(tmp_path / "ckpts")
    truth = str(tmp_path / "truth.pt")
    (full,) = run_ranks(1, _lightning_fit, ckpts, 6, None, truth, backend=NCCL, timeout=120)
    step4 = os.path.join(ckpts, "step=4.ckpt")
    assert sorted(os.listdir(ckpts)) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]
    assert "metadata.json" in os.listdir(step4) and not shardsafe.verify(step4).errors
    assert shardsafe.lightning.read_meta(step4)["global_step"] == 4
    (again,) = run_ranks(1, _lightning_fit, str(tmp_path / "again"), 6, step4, backend=NCCL, timeout=120)
    assert again[0] == full[0][4:] and again[1:] == full[1:] == (6, 3)

    # the same checkpoint resumes on 2 CPU ranks under shardsafe's DDPStrategy: each rank takes half of
    # the batch, so the mean of the two ranks' losses is the GPU run's loss at each step (up to rounding)
    from .lightning_runs import fit

    two = run_ranks(2, fit, "ddp", str(tmp_path / "cpu"), 6, step4, timeout=120)
    assert [r[1:] for r in two] == [(6, 3)] * 2
    assert [(a + b) / 2 for a, b in zip(two[0][0], two[1][0])] == pytest.approx(full[0][4:], rel=1e-4)

    # the final checkpoint consolidates to Lightning's single-file layout, equal to FSDP's own full state dict
    out = str(tmp_path / "last.consolidated")
    shardsafe.lightning.consolidate(os.path.join(ckpts, "step=6.ckpt"), out)
    ckpt = torch.load(out, weights_only=True)
    want = torch.load(truth)
    assert sorted(ckpt["state_dict"]) == sorted(want) == ["net.0.bias", "net.0.weight", "net.2.bias", "net.2.weight"]
    assert all(torch.equal(bits(ckpt["state_dict"][k]), bits(v)) for k, v in want.items())
