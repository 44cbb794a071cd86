"""``progress=`` on the saves, unshards and model loads (``Checkpointer.save`` / ``async_save`` /
``unshard``, ``save_model_and_optim_state`` and its async form, ``load_model_and_optim_state``,
``unshard_model_state`` / ``unshard_optim_state``, ``CheckpointManager.save`` / ``restore``), on 2
real gloo ranks: a callable sees this rank's bytes, read back from what was written; ``True``
draws a bar on the coordinator only."""

from __future__ import annotations

import io
import json
import os
import struct
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import shardsafe
from shardsafe import Checkpointer, CheckpointManager

from .helpers import run_ranks

CHECKSUMS = "__shardsafe_checksums__"


def _tensor_bytes(path: str) -> int:
    """The bytes of the tensors in a data file: its safetensors header's entries, less the checksums."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k not in ("__metadata__", CHECKSUMS))


class _Recorder:
    """A progress callable that also notes the size of this rank's data file in ``dir`` at each call."""

    def __init__(self, dir: Path | None = None, rank: int = 0) -> None:
        self.calls: list[tuple[int, int]] = []
        self.sizes: list[int] = []
        self.dir, self.rank = dir, rank

    def __call__(self, done: int, total: int) -> None:
        self.calls.append((done, total))
        if self.dir is not None:
            mine = [f for f in os.listdir(self.dir) if f.startswith(f"shard-r{self.rank:05d}-")] if self.dir.exists() else []
            self.sizes.append(os.path.getsize(self.dir / mine[0]) if mine else -1)


def _check_calls(calls: list[tuple[int, int]], total: int) -> None:
    assert calls[0] == (0, total) and calls[-1] == (total, total), calls
    assert {t for _, t in calls} == {total}
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def _sharded_state(rank: int, ws: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    mesh = init_device_mesh("cpu", (ws,))
    return {
        "w": distribute_tensor(torch.randn(40, 30, generator=g), mesh, [Shard(0)]),
        "e": distribute_tensor(torch.randn(10, 6, generator=g).to(torch.bfloat16), mesh, [Replicate()]),
        "i": torch.arange(7),  # replicated: written by one rank
        "step": 5,
    }


def _ranks_save(rank, ws, root):
    root = Path(root)
    state = _sharded_state(rank, ws)
    out = {}
    rec = _Recorder(root / "sync", rank)
    _, files = Checkpointer().save(root / "sync", state, progress=rec)
    out["sync"] = (rec.calls, rec.sizes, files)
    rec = _Recorder(root / "async", rank)
    handle = Checkpointer().async_save(root / "async", state, progress=rec)
    _, files = handle.wait()
    out["async"] = (rec.calls, rec.sizes, files)
    rec = _Recorder()
    full = Checkpointer().unshard(root / "sync", progress=rec)
    out["unshard"] = (rec.calls, sum(v.numel() * v.element_size() for v in full.values() if isinstance(v, torch.Tensor)))
    rec = _Recorder()
    again = Checkpointer().unshard(root / "sync", rank0_only=True, progress=rec)
    assert (again == {}) if rank else all(torch.equal(again[k], full[k]) for k in ("w", "e", "i"))
    out["rank0_only"] = rec.calls[-1]
    return out


def test_save_async_save_and_unshard_count_this_ranks_bytes(tmp_path):
    got = run_ranks(2, _ranks_save, str(tmp_path))
    everything = 40 * 30 * 4 + 10 * 6 * 2 + 7 * 8
    for kind in ("sync", "async"):
        totals = []
        for out in got:
            calls, sizes, files = out[kind]
            total = _tensor_bytes(files[0])
            assert total > 0
            _check_calls(calls, total)
            assert calls.count((total, total)) == 1 and sizes[-1] == os.path.getsize(files[0])  # once the file is complete
            assert sizes[0] == -1 or sizes[0] < sizes[-1]
            totals.append(total)
        assert sum(totals) == everything  # each byte written once, by one rank
    for out in got:
        calls, whole = out["unshard"]
        assert whole == everything
        _check_calls(calls, everything)
        assert len(calls) == 4  # (0, total), then one per tensor
    assert got[0]["rank0_only"] == (everything, everything) and got[1]["rank0_only"] == (0, 0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 10))


def _local_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[int, int]:
    """This rank's bytes of the model's parameters, and of its optimizer state tensors."""

    def nbytes(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    return sum(nbytes(p) for p in model.parameters()), sum(
        nbytes(v) for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )


def _ranks_model(rank, ws, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    root = Path(root)
    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (ws,)))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 16)).sum().backward()
    optim.step()
    out = {"local": _local_bytes(model, optim)}
    rec = _Recorder(root / "m", rank)
    files = shardsafe.save_model_and_optim_state(root / "m", model, optim, progress=rec)
    out["save"] = (rec.calls, files)
    rec = _Recorder(root / "am", rank)
    files = shardsafe.async_save_model_and_optim_state(root / "am", model, optim, progress=rec).wait()
    out["async"] = (rec.calls, files)
    rec = _Recorder()
    shardsafe.load_model_and_optim_state(root / "m", model, optim, progress=rec)
    out["load"] = rec.calls
    rec = _Recorder()
    shardsafe.unshard_model_state(root / "m", progress=rec)
    out["unshard_model"] = rec.calls
    rec = _Recorder()
    shardsafe.unshard_optim_state(root / "m", progress=rec)
    out["unshard_optim"] = rec.calls
    with CheckpointManager(root / "mgr", async_save=True) as mgr:
        rec = _Recorder(root / "mgr" / "step_00000007", rank)
        assert mgr.save(7, model, optim, force=True, progress=rec)
        mgr.wait_until_finished()
        step_dir = root / "mgr" / "step_00000007"
        out["mgr_save"] = (rec.calls, [str(step_dir / f) for f in os.listdir(step_dir) if f.startswith(f"shard-r{rank:05d}-")])
        rec = _Recorder()
        assert mgr.restore(model=model, optim=optim, progress=rec) == 7
        out["mgr_restore"] = rec.calls
    return out


def test_model_and_optim_calls_and_the_manager_count_this_ranks_bytes(tmp_path):
    got = run_ranks(2, _ranks_model, str(tmp_path))
    model_all = (16 * 24 + 24 + 24 * 10 + 10) * 4
    adam_all = 2 * model_all + 4 * 4  # exp_avg, exp_avg_sq and a float32 step per parameter
    for kind in ("save", "async", "mgr_save"):
        totals = []
        for out in got:
            calls, files = out[kind]
            total = _tensor_bytes(files[0])
            _check_calls(calls, total)
            totals.append(total)
        assert sum(totals) == model_all + adam_all  # the steps (replicated) written once
    for out in got:
        model_mine, optim_mine = out["local"]
        assert model_mine == (12 * 16 + 12 + 5 * 24 + 5) * 4  # this rank's half of every parameter
        _check_calls(out["load"], model_mine + optim_mine)
        _check_calls(out["mgr_restore"], model_mine + optim_mine)
        _check_calls(out["unshard_model"], model_all)
        _check_calls(out["unshard_optim"], adam_all)


def _ranks_draw(rank, ws, root):
    sys.stderr = io.StringIO()  # tqdm writes to the sys.stderr of the moment it draws (the background thread's too)
    root = Path(root)
    state = _sharded_state(rank, ws)
    Checkpointer().save(root / "a", state, progress=True)
    Checkpointer().async_save(root / "b", state, progress=True).wait()
    Checkpointer().unshard(root / "a", progress=True)
    return sys.stderr.getvalue()


def test_bar_on_the_coordinator_only(tmp_path):
    err0, err1 = run_ranks(2, _ranks_draw, str(tmp_path))
    assert "\rsave:   0%|" in err0 and "\rasync_save:   0%|" in err0 and "\runshard:   0%|" in err0
    assert "/4.98k [" in err0  # unshard: 40*30*4 + 10*6*2 + 7*8 bytes; tqdm: done / total, rate, ETA
    assert err1 == ""  # rank 1 draws nothing


def test_progress_of_the_wrong_type_is_refused(tmp_path):
    state = {"w": torch.ones(3)}
    with pytest.raises(TypeError, match="save: argument 'progress' must be a bool, a callable or None, got str"):
        Checkpointer().save(tmp_path / "a", state, progress="yes")
    with pytest.raises(TypeError, match="async_save: argument 'progress' must be a bool, a callable or None, got int"):
        Checkpointer().async_save(tmp_path / "b", state, progress=1)
    Checkpointer().save(tmp_path / "c", state)
    with pytest.raises(TypeError, match="unshard: argument 'progress' must be a bool, a callable or None, got int"):
        Checkpointer().unshard(tmp_path / "c", progress=2)
    with pytest.raises(TypeError, match="save_model_and_optim_state: argument 'progress' must be a bool, a callable or None, got str"):
        shardsafe.save_model_and_optim_state(tmp_path / "d", _model(), progress="x")
    with pytest.raises(TypeError, match="load_model_and_optim_state: argument 'progress' must be a bool, a callable or None, got list"):
        shardsafe.load_model_and_optim_state(tmp_path / "c", _model(), progress=[])
