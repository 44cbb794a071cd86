"""``shardsafe.lightning.consolidate`` and the ``torch.save`` file it streams
(``shardsafe.lightning._torch_file``), without Lightning: the file is byte for byte what
``torch.save`` writes for the checkpoint dict the in-memory path built, its memory is about the
largest tensor (measured in a process of its own), and it appears whole or not at all."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import shardsafe
import shardsafe.lightning
from shardsafe import CheckpointExistsError, CorruptCheckpointError, MissingKeyError, ShardedTensor
from shardsafe.cli import main
from shardsafe.lightning._torch_file import LazyTensor, save_streamed

from .helpers import assert_same, built_once, run_process, run_ranks
from .simulate import simulate_save
from .terminal import on_a_pty

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}


def _torch_save_bytes(obj) -> bytes:
    f = io.BytesIO()
    torch.save(obj, f)
    return f.getvalue()


class _Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, view: memoryview) -> None:
        self.data += view


# ------------------------------------------------------------------ the streamed torch.save file


def test_save_streamed_writes_the_bytes_torch_save_writes(tmp_path):
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.uint8, torch.bool,
              torch.complex64, torch.uint16, torch.uint32, torch.float8_e4m3fn, torch.float8_e5m2]
    real = {f"{d}".replace("torch.", ""): (torch.randn(3, i + 2, generator=g) * 50).to(d) for i, d in enumerate(dtypes)}
    real["empty"] = torch.empty(0, 5)
    real["empty_middle"] = torch.empty(3, 0, 2, dtype=torch.uint16)
    real["scalar"] = torch.tensor(3.5)
    small = torch.arange(6.0)  # real tensors beside the placeholders, one storage seen twice
    want = {
        "epoch": 1, "hp": {"lr": 1e-3, "betas": (0.9, 0.99), "name": "x", "nan": float("nan")},
        "state_dict": real, "twice": [real["float32"], real["float32"]], "small": small, "small_view": small[2:4],
    }
    placeholders = {k: LazyTensor(v.dtype, tuple(v.shape), k) for k, v in real.items()}
    lazy = {**want, "state_dict": placeholders, "twice": [placeholders["float32"], placeholders["float32"]]}
    filled: list[str] = []

    def fill(t: LazyTensor, target: torch.Tensor) -> None:
        assert target.is_contiguous() and (target.dtype, tuple(target.shape)) == (t.dtype, t.shape)
        filled.append(t.source)
        target.copy_(real[t.source])

    sink, done = _Sink(), []
    assert save_streamed(lazy, sink, fill, done=done.append) == len(sink.data)
    assert bytes(sink.data) == _torch_save_bytes(want)
    assert filled == list(real)  # each once (the placeholder seen twice is one storage), in pickle order
    assert done == [t.nbytes for t in real.values()]
    path = tmp_path / "f.pt"
    path.write_bytes(sink.data)
    for mmap in (False, True):
        got = torch.load(path, weights_only=True, mmap=mmap)
        assert got["hp"]["nan"] != got["hp"]["nan"]
        got["hp"]["nan"] = want["hp"]["nan"] = 0.0
        assert_same(got, want)
        assert got["twice"][0].data_ptr() == got["twice"][1].data_ptr() and got["small_view"].untyped_storage().data_ptr() == got["small"].data_ptr()
        want["hp"]["nan"] = float("nan")


# ------------------------------------------------------------------ consolidate = the in-memory path, streamed


def _fsdp_save(rank, ws, path):
    """An FSDP2 model (float32 parameters, a bfloat16 buffer) and AdamW after 2 steps, saved by
    shardsafe.lightning with a Lightning-like checkpoint dict."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardsafe.lightning import save_checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model.register_buffer("scale", torch.linspace(0, 1, 5).to(torch.bfloat16))
    mesh = init_device_mesh("cpu", (ws,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(2):
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        optim.step()
        optim.zero_grad()
    meta = {
        "epoch": 0, "global_step": 2, "pytorch-lightning_version": "2.5.0",
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 1, "completed": 0}}}},
        "lr_schedulers": [{"step_size": 2, "gamma": 0.5, "base_lrs": [0.01], "last_epoch": 2, "_last_lr": [0.005]}],
        "hyper_parameters": {"hidden": 16, "betas": (0.8, 0.95)}, "callbacks": {"EMA": {"decay": torch.tensor([0.9, 0.99])}},
    }
    save_checkpoint(path, model, [optim], meta)


@pytest.fixture(scope="module")
def fsdp_ckpt(tmp_path_factory) -> str:
    """Built once per test run for every xdist worker (this module's tests spread over both): read it, never change it."""
    return built_once(tmp_path_factory, "lightning-fsdp/step=2.ckpt", lambda path: run_ranks(2, _fsdp_save, path))


def _in_memory(path: str) -> dict:
    """What consolidate built and ``torch.save``d before it streamed."""
    return {
        **shardsafe.lightning.read_meta(path),
        "state_dict": shardsafe.unshard_model_state(path, no_dist=True),
        "optimizer_states": [shardsafe.unshard_optim_state(path, no_dist=True)],
    }


def _records(raw: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        return {name: z.read(name) for name in z.namelist()}


def test_consolidate_writes_what_the_in_memory_path_wrote(fsdp_ckpt, tmp_path):
    out = tmp_path / "step=2.ckpt.consolidated"
    counts = shardsafe.lightning.consolidate(fsdp_ckpt, out)
    raw = out.read_bytes()
    # the file torch.save writes for the same dict, in memory, byte for byte
    assert raw == _torch_save_bytes(shardsafe.lightning.consolidate(fsdp_ckpt))
    # and that dict is the one the in-memory path built: the same tensors, bit for bit, the same
    # values, types and key order, the same storage records; the pickles differ only in which
    # equal strings are one object (the old path parsed metadata.json once per call)
    want = _in_memory(fsdp_ckpt)
    for mmap in (False, True):
        assert_same(torch.load(out, weights_only=True, mmap=mmap), want)
    got, old = _records(raw), _records(_torch_save_bytes(want))
    assert list(got) == list(old)
    assert [n for n in got if got[n] != old[n]] == ["archive/data.pkl", "archive/.data/serialization_id"]
    n = 4 + 1 + 4 * 3 + 1  # parameters, the buffer, AdamW's step/exp_avg/exp_avg_sq per parameter, the EMA tensor
    assert counts == {"tensors": n, "bytes": sum(len(v) for k, v in got.items() if "/data/" in k), "file_bytes": len(raw)}


def test_consolidate_keeps_lightnings_layout(fsdp_ckpt, tmp_path):
    out = tmp_path / "c.ckpt"
    shardsafe.lightning.consolidate(fsdp_ckpt, out)
    ckpt = torch.load(out, weights_only=True)
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert list(ckpt) == ["epoch", "global_step", "pytorch-lightning_version", "loops", "lr_schedulers", "hyper_parameters",
                          "callbacks", "state_dict", "optimizer_states"]
    assert list(ckpt["state_dict"]) == [*names, "scale"]
    assert ckpt["hyper_parameters"]["betas"] == (0.8, 0.95) and ckpt["lr_schedulers"][0]["_last_lr"] == [0.005]
    assert torch.equal(ckpt["callbacks"]["EMA"]["decay"], torch.tensor([0.9, 0.99]))
    (optim,) = ckpt["optimizer_states"]  # one optimizer: a list of one, keyed by parameter name as Lightning's tool keys it
    assert list(optim) == ["state", "param_groups"]
    assert list(optim["state"]) == names and all(list(st) == ["step", "exp_avg", "exp_avg_sq"] for st in optim["state"].values())
    (group,) = optim["param_groups"]
    assert group["params"] == names and group["lr"] == 1e-2 and tuple(group["betas"]) == (0.8, 0.95)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model.register_buffer("scale", torch.zeros(5, dtype=torch.bfloat16))
    model.load_state_dict(ckpt["state_dict"], strict=True)
    fresh = torch.optim.AdamW(model.parameters())
    by_index = {names.index(n): st for n, st in optim["state"].items()}
    fresh.load_state_dict({"state": by_index, "param_groups": [{**group, "params": list(range(4))}]})
    assert torch.equal(fresh.state[model[0].weight]["exp_avg"], optim["state"]["0.weight"]["exp_avg"])


def test_without_an_optimizer_no_optimizer_states(tmp_path):
    model = nn.Linear(3, 2)
    shardsafe.save_model_and_optim_state(tmp_path / "c", model)
    shardsafe.lightning.consolidate(tmp_path / "c", tmp_path / "c.pt")
    got = torch.load(tmp_path / "c.pt", weights_only=True)
    assert list(got) == ["state_dict"]
    assert_same(got["state_dict"], {k: v.detach() for k, v in model.state_dict().items()})


# ------------------------------------------------------------------ memory


_MEASURE = r"""
import json, sys
import torch, shardsafe, shardsafe.lightning
ckpt, streamed, in_memory = sys.argv[1:]
def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}
def peak_growth(run):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status()["VmRSS"]
    run()
    return status()["VmHWM"] - before
growth = {
    "streamed": peak_growth(lambda: shardsafe.lightning.consolidate(ckpt, streamed)),
    # the in-memory path consolidate took before it streamed
    "in_memory": peak_growth(lambda: torch.save({"state_dict": shardsafe.unshard_model_state(ckpt, no_dist=True)}, in_memory)),
}
print(json.dumps(growth))
"""

_MiB = 1 << 20


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_streamed_peak_memory_is_about_the_largest_tensor_not_the_checkpoint(tmp_path):
    # 200 MiB in 20 tensors of 10 MiB, saved by 2 ranks: even tensors in row slabs, odd ones in
    # column shards (their unshard needs the reader's scratch, bounded by read_buffer_bytes)
    g = torch.Generator().manual_seed(0)
    ranks: list[dict] = [{}, {}]
    for i in range(20):
        full = torch.randn(2560, 1024, generator=g)
        dim = i % 2
        for r in range(2):
            ranks[r][f"model.w{i}"] = ShardedTensor.from_rank_offsets(f"model.w{i}", full.chunk(2, dim=dim)[r].clone(), (dim, r, 2))
        del full
    ckpt = str(tmp_path / "c")
    simulate_save(ckpt, ranks)
    del ranks
    largest, total = 10 * _MiB, 200 * _MiB
    # in a process of its own, streamed first (the in-memory path's freed memory would hide its peak)
    args = [sys.executable, "-c", _MEASURE, ckpt, str(tmp_path / "streamed.pt"), str(tmp_path / "in_memory.pt")]
    r = run_process(args, capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    growth = json.loads(r.stdout)
    streamed, in_memory = growth["streamed"], growth["in_memory"]
    print(f"peak RSS growth: streamed {streamed / _MiB:.1f} MiB, in memory {in_memory / _MiB:.1f} MiB "
          f"({total // _MiB} MiB checkpoint, largest tensor {largest // _MiB} MiB)")
    assert streamed < 2 * largest + 64 * _MiB
    assert in_memory > 0.9 * total  # the in-memory path holds about the whole checkpoint (199.8-219 MiB measured)
    got = torch.load(tmp_path / "streamed.pt", weights_only=True, mmap=True)["state_dict"]
    want = torch.load(tmp_path / "in_memory.pt", weights_only=True, mmap=True)["state_dict"]
    assert_same(got, want)


# ------------------------------------------------------------------ output, errors, progress


def test_output_is_atomic_refused_when_present_and_replaced_with_overwrite(fsdp_ckpt, tmp_path):
    out = tmp_path / "c.ckpt"
    out.write_bytes(b"old")
    with pytest.raises(CheckpointExistsError, match=rf"^{out}: file exists; pass overwrite=True to replace it$"):
        shardsafe.lightning.consolidate(fsdp_ckpt, out)
    assert out.read_bytes() == b"old"
    seen: list[tuple[int, int]] = []
    counts = shardsafe.lightning.consolidate(fsdp_ckpt, out, overwrite=True, progress=lambda d, t: seen.append((d, t)))
    assert out.stat().st_size == counts["file_bytes"] and sorted(os.listdir(tmp_path)) == ["c.ckpt"]
    total = counts["bytes"]
    assert seen[0] == (0, total) and seen[-1] == (total, total) and all(t == total for _, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_a_damaged_chunk_is_named_and_leaves_no_file(fsdp_ckpt, tmp_path):
    import shutil

    src = tmp_path / "damaged"
    shutil.copytree(fsdp_ckpt, src)
    meta = shardsafe.Checkpointer().get_metadata(src, no_dist=True)
    file, spec = next(iter(meta.tensors["model.2.weight"].chunks()))
    with open(src / file, "r+b") as f:
        f.seek(spec.byte_range[0] + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = tmp_path / "out" / "c.ckpt"
    with pytest.raises(CorruptCheckpointError, match=r"model\.2\.weight"):
        shardsafe.lightning.consolidate(src, out)
    assert os.listdir(tmp_path / "out") == []


def test_a_checkpoint_without_model_state_is_refused(tmp_path):
    shardsafe.Checkpointer().save(tmp_path / "c", {"w": torch.ones(2), "step": 3})
    with pytest.raises(MissingKeyError, match=rf"^{tmp_path / 'c'}: no model state in the checkpoint \(no key starts with 'model\.'; it holds 2 key\(s\), such as \['step', 'w'\]\)"):
        shardsafe.lightning.consolidate(tmp_path / "c", tmp_path / "c.pt")
    assert not (tmp_path / "c.pt").exists()


def test_without_the_private_torch_names_it_writes_in_memory_with_a_warning(fsdp_ckpt, tmp_path, monkeypatch, caplog):
    monkeypatch.delattr(torch.serialization, "normalize_storage_type")  # as if a torch release dropped it
    with caplog.at_level(logging.WARNING, logger="shardsafe.lightning._checkpoint"):
        shardsafe.lightning.consolidate(fsdp_ckpt, tmp_path / "c.ckpt")
    assert [r.getMessage() for r in caplog.records] == [
        f"shardsafe.lightning.consolidate: torch {torch.__version__} has no torch.serialization.normalize_storage_type; "
        "the whole checkpoint is built in memory to be written"
    ]
    assert (tmp_path / "c.ckpt").read_bytes() == _torch_save_bytes(shardsafe.lightning.consolidate(fsdp_ckpt))


# ------------------------------------------------------------------ command line


def test_cli_consolidate(fsdp_ckpt, tmp_path, capsys):
    out = tmp_path / "c.ckpt"
    r, err = on_a_pty([sys.executable, "-m", "shardsafe", "consolidate", fsdp_ckpt, str(out)], ENV)  # the command, as a shell runs it
    assert r.returncode == 0 and b"\rconsolidate:   0%|" in err and b"/2.58k [" in err  # tqdm: bytes done / total
    size = out.stat().st_size
    assert r.stdout.decode() == f"consolidated 18 tensors (2.6 KB) from {fsdp_ckpt} into {out} ({size / 1000:.1f} KB)\n"
    assert out.read_bytes() == _torch_save_bytes(shardsafe.lightning.consolidate(fsdp_ckpt))
    assert main(["consolidate", fsdp_ckpt, str(out)]) == 2
    assert capsys.readouterr() == ("", f"shardsafe consolidate: error: {out}: file exists; pass --overwrite to replace it\n")
    assert main(["consolidate", fsdp_ckpt, str(out), "--overwrite", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"dir": fsdp_ckpt, "out": str(out), "tensors": 18, "bytes": 2578, "file_bytes": size}
    assert main(["consolidate", fsdp_ckpt, str(out), "--overwrite", "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")  # and no bar: stderr is not a terminal here
    with pytest.raises(SystemExit):
        main(["consolidate", "--help"])
    assert "torch.load(OUT)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "consolidate" in capsys.readouterr().out
