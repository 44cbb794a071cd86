"""Tensor subclasses on CUDA (issue 25): float8 training with FSDP2's float8 all-gather (it
cannot train on gloo) resumed from a shardsafe checkpoint with the same losses as an
uninterrupted run, torchao's 8-bit AdamW state saved from CUDA and resumed in place, and a
model quantized by quantize_ (float8 weights, a scale per row) reloaded with the same outputs.

Marker ``gpu``; skipped without a CUDA device. One rank per GPU with NCCL; the resume at
another world size needs two GPUs (NCCL refuses two ranks on one device), and is skipped on a
machine with one. float8 matmuls need a GPU that has them (compute capability 8.9 or later)."""

from __future__ import annotations

import pytest
import torch

import shardsafe

from .helpers import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
torchao = pytest.importorskip("torchao")

NCCL = "cpu:gloo,cuda:nccl"
STEPS, SAVE_AT = 6, 3


def _float8_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _float8_model(seed: int, ws: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False), torch.nn.ReLU(), torch.nn.Linear(512, 256, bias=False))
    m = m.to(torch.device("cuda", torch.cuda.current_device()))
    convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    mesh = init_device_mesh("cuda", (ws,))
    for layer in (m[0], m[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(32, 256, generator=g).cuda()


def _train(m, o, steps) -> list[float]:
    losses = []
    for step in steps:
        loss = m(_batch(step)).float().pow(2).mean()
        loss.backward()
        o.step()
        o.zero_grad()
        losses.append(loss.item())
    return losses


def _float8_run(rank, ws, path, mode):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    m, o = _float8_model(0, ws)
    assert type(m[0].weight._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor"
    if mode == "whole":
        return _train(m, o, range(STEPS))
    losses = _train(m, o, range(SAVE_AT))
    shardsafe.save_model_and_optim_state(path, m, o)
    return losses


def _float8_resume(rank, ws, path):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    m, o = _float8_model(1, ws)
    shardsafe.load_model_and_optim_state(path, m, o)
    return _train(m, o, range(SAVE_AT, STEPS))


@pytest.mark.skipif(not _float8_ok(), reason="float8 matmuls need compute capability 8.9 or later")
def test_float8_all_gather_training_resumes_with_the_same_losses(tmp_path):
    path = str(tmp_path / "c")
    whole = run_ranks(1, _float8_run, path, "whole", backend=NCCL)[0]
    first = run_ranks(1, _float8_run, path, "first", backend=NCCL)[0]
    rest = run_ranks(1, _float8_resume, path, backend=NCCL)[0]
    assert first + rest == whole, (first + rest, whole)


@pytest.mark.skipif(not _float8_ok() or torch.cuda.device_count() < 2, reason="needs two GPUs with float8 matmuls")
def test_float8_all_gather_training_saved_at_2_gpus_resumes_on_1(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(2, _float8_run, path, "first", backend=NCCL)
    rest = run_ranks(1, _float8_resume, path, backend=NCCL)[0]
    whole = run_ranks(1, _float8_run, str(tmp_path / "unused"), "whole", backend=NCCL)[0]
    # the data-parallel mean of 2 ranks and 1 rank differ in rounding only: the same loss to 1e-3
    assert all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(rest, whole[SAVE_AT:])), (rest, whole[SAVE_AT:])


def test_adamw8bit_state_on_cuda_resumes_in_place_bit_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    from torchao.optim import AdamW8bit

    def run(seed: int):
        torch.manual_seed(seed)
        m = torch.nn.Linear(512, 512).cuda()
        return m, AdamW8bit(m.parameters())

    m, o = run(0)
    for step in range(2):
        m(_batch(step).repeat(1, 2)).sum().backward()
        o.step()
        o.zero_grad()
    shardsafe.save_model_and_optim_state(str(tmp_path), m, o)
    m2, o2 = run(1)
    shardsafe.load_model_and_optim_state(str(tmp_path), m2, o2)
    st = o2.state[m2.weight]["exp_avg"]
    assert type(st).__name__ == "OptimState8bit" and st.codes.is_cuda
    for mm, oo in ((m, o), (m2, o2)):
        mm(_batch(9).repeat(1, 2)).sum().backward()
        oo.step()
    assert torch.equal(m.weight, m2.weight) and torch.equal(m.bias, m2.bias)


@pytest.mark.skipif(not _float8_ok(), reason="quantize_'s float8 weights need compute capability 8.9 or later")
def test_quantize_float8_weights_on_cuda_reload_bit_exact_and_compute_the_same(tmp_path):
    """A model quantized by quantize_ (Float8Tensor weights, a scale per row) saved from CUDA and
    loaded into another quantized model: the same codes, scales and outputs."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    def quantized(seed: int):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)).to(torch.bfloat16).cuda()
        quantize_(m, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
        return m

    m, m2 = quantized(0), quantized(1)
    assert type(m[0].weight).__name__ == "Float8Tensor"
    shardsafe.save_model_and_optim_state(str(tmp_path), m)
    shardsafe.load_model_and_optim_state(str(tmp_path), m2)
    for a, b in ((m[0].weight, m2[0].weight), (m[1].weight, m2[1].weight)):
        assert torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8)) and torch.equal(a.scale, b.scale)
        assert b.qdata.is_cuda
    x = torch.randn(8, 256, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(m(x), m2(x))
