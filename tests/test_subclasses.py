"""Tensor subclasses (issue 25): torchao's NF4 weights, low-bit optimizer states (8-bit, 4-bit,
FP8) and float8 all-gather weights, saved and loaded without pickle, resharded block by block,
dequantized on request, and refused by name when unknown (inside a DTensor too).

torchao's optimizers compile their step with torch.compile; the tests run it eagerly
(``TORCHDYNAMO_DISABLE=1``), which computes the same values."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors import safe_open

import shardsafe
from shardsafe.errors import CheckpointError, DtypeMismatchError, ShardingError

from .helpers import assert_bits, built_once, run_ranks
from .sealing import seal

torchao = pytest.importorskip("torchao")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8  # noqa: E402
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4  # noqa: E402


@pytest.fixture(autouse=True)
def _eager_steps(monkeypatch):
    """torchao's optimizers compile their step; TORCHDYNAMO_DISABLE (read by each torch.compile
    call) runs it eagerly, for this test only: other tests of the same worker compile."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")


def _eager() -> None:  # in a rank's own process
    os.environ["TORCHDYNAMO_DISABLE"] = "1"

NF4_PATH = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor.NF4Tensor"
OPTIMS = {"8bit": AdamW8bit, "4bit": AdamW4bit, "fp8": AdamWFp8}


def _inner(t: torch.Tensor) -> dict[str, torch.Tensor]:
    local = getattr(t, "_local_tensor", t)
    names, _ = local.__tensor_flatten__()
    return {n: getattr(local, n) for n in names}


def _assert_same_subclass(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert type(got) is type(want), (what, type(got), type(want))
    g, w = _inner(got), _inner(want)
    assert list(g) == list(w), what
    for n in w:
        assert_bits(g[n], w[n], f"{what}#{n}")


def _trained(opt_cls, shape=(256, 256), steps=2, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(shape[1], shape[0]), torch.nn.Linear(shape[0], 8))
    o = opt_cls(m.parameters())
    for _ in range(steps):
        m(torch.randn(4, shape[1])).sum().backward()
        o.step()
        o.zero_grad()
    return m, o


# ------------------------------------------------------------------ one process


def test_nf4_round_trip_is_bit_exact_and_stored_as_plain_safetensors(tmp_path):
    torch.manual_seed(0)
    w = to_nf4(torch.randn(256, 256, dtype=torch.bfloat16), 64, 256)
    shardsafe.Checkpointer().save(str(tmp_path / "c"), {"w": w, "step": 3})
    meta = json.loads((tmp_path / "c" / "metadata.json").read_text())
    assert sorted(meta["tensors"]) == sorted(f"w#{n}" for n in w.__tensor_flatten__()[0])
    record = meta["objects"]["w"]
    assert record["class"] == NF4_PATH and record["shape"] == [256, 256] and record["dtype"] == "bfloat16"
    assert record["inner"]["quantized_data"] == {"key": "w#quantized_data", "block": [1, 2], "form": "flat", "dtype": "uint8"}
    assert record["inner"]["quantized_scalers"]["block"] == [1, 64]
    assert record["inner"]["quantization_factor"]["block"] == [64, 256]
    assert record["inner"]["nf4"]["shared"] is True and record["inner"]["scaler_mean"]["shared"] is True
    assert record["ctx"]["tensor_meta"]["fields"]["original_shape"] == {"$outer": "shape"}
    assert not meta.get("pickled_objects")
    # every data file is a safetensors file the official library reads, inner tensors as stored
    found = {}
    for name in os.listdir(tmp_path / "c"):
        if name.endswith(".safetensors"):
            with safe_open(str(tmp_path / "c" / name), "pt") as f:
                found.update({k: f.get_tensor(k) for k in f.keys()})
    assert_bits(found["w#quantized_data"], w.quantized_data.view(256, 128), "quantized_data")
    assert_bits(found["w#quantized_scalers"], w.quantized_scalers.view(256, 4), "quantized_scalers")

    target = to_nf4(torch.zeros(256, 256, dtype=torch.bfloat16), 64, 256)
    sd = {"w": target, "step": 0}
    shardsafe.Checkpointer().load(str(tmp_path / "c"), sd)
    assert sd["w"] is target and sd["step"] == 3
    _assert_same_subclass(target, w, "w")
    assert_bits(target.get_original_weight(), w.get_original_weight(), "dequantized")


@pytest.mark.parametrize("kind", sorted(OPTIMS))
def test_low_bit_optimizer_resumes_bit_exact_without_a_dummy_step(tmp_path, kind):
    opt_cls = OPTIMS[kind]
    m, o = _trained(opt_cls)
    shardsafe.save_model_and_optim_state(str(tmp_path), m, o)
    m2, o2 = _trained(opt_cls, steps=0, seed=1)
    assert not o2.state  # no state yet: shardsafe allocates the stored class
    shardsafe.load_model_and_optim_state(str(tmp_path), m2, o2)
    for p, p2 in zip(m.parameters(), m2.parameters()):
        assert_bits(p2, p, "param")
        for name, v in o.state[p].items():
            if type(v) is torch.Tensor:
                assert_bits(o2.state[p2][name], v, name)
            else:
                _assert_same_subclass(o2.state[p2][name], v, name)
    assert type(o2.state[m2[0].weight]["exp_avg"]).__name__ == {"8bit": "OptimState8bit", "4bit": "OptimState4bit", "fp8": "OptimStateFp8"}[kind]
    x = torch.randn(4, 256)
    for mm, oo in ((m, o), (m2, o2)):  # the resumed run goes on as the uninterrupted one
        mm(x).sum().backward()
        oo.step()
    for p, p2 in zip(m.parameters(), m2.parameters()):
        assert_bits(p2, p, "param after a step")


def test_dequantize_loads_low_bit_state_into_a_plain_optimizer(tmp_path):
    m, o = _trained(AdamW8bit)
    shardsafe.save_model_and_optim_state(str(tmp_path), m, o)
    m2, _ = _trained(AdamW8bit, steps=0, seed=1)
    o2 = torch.optim.AdamW(m2.parameters())
    with pytest.raises(ShardingError, match=re.escape(
        "key 'optim.state.0.weight.exp_avg' is stored as a torchao.optim.subclass_8bit.OptimState8bit (its inner tensors "
        "under 'optim.state.0.weight.exp_avg#'...), the target is a plain tensor: load it into a "
        "torchao.optim.subclass_8bit.OptimState8bit, or pass dequantize=True to load its high-precision values"
    )):
        shardsafe.Checkpointer().load(str(tmp_path), {"optim.state.0.weight.exp_avg": torch.zeros(256, 256)})
    shardsafe.load_model_and_optim_state(str(tmp_path), m2, o2, validate=False, dequantize=True)
    want = o.state[m[0].weight]["exp_avg"].dequantize()
    got = o2.state[m2[0].weight]["exp_avg"]
    assert type(got) is torch.Tensor
    assert_bits(got, want, "dequantized exp_avg")
    assert_bits(o2.state[m2[0].bias]["exp_avg"], o.state[m[0].bias]["exp_avg"], "plain state of a small parameter")
    whole = shardsafe.Checkpointer().unshard(str(tmp_path), prefix="optim.state.0.weight.")
    _assert_same_subclass(whole["exp_avg"], o.state[m[0].weight]["exp_avg"], "unshard")
    assert "exp_avg#codes" not in whole
    deq = shardsafe.Checkpointer().unshard(str(tmp_path), prefix="optim.state.0.weight.", dequantize=True)
    assert_bits(deq["exp_avg"], want, "unshard dequantize")


def test_mismatched_subclass_targets_are_refused_by_name(tmp_path):
    m, o = _trained(AdamW8bit)
    shardsafe.save_model_and_optim_state(str(tmp_path), m, o)
    st = o.state[m[0].weight]
    key = "optim.state.0.weight."
    with pytest.raises(ShardingError, match=re.escape(
        f"key '{key}exp_avg': the checkpoint holds a torchao.optim.subclass_8bit.OptimState8bit with flatten context "
        "[True, {'__shardsafe__': 'dtype', 'v': 'float32'}], the target's is [False, {'__shardsafe__': 'dtype', 'v': "
        "'float32'}]"
    )):
        shardsafe.Checkpointer().load(str(tmp_path), {key + "exp_avg": st["exp_avg_sq"]})
    from torchao.optim.subclass_8bit import OptimState8bit

    other_blocks = OptimState8bit.zeros((256, 256), signed=True, block_size=512)
    with pytest.raises(ShardingError, match=re.escape(
        f"key '{key}exp_avg': inner tensor 'scale' was saved with blocks of [1, 256] elements, the target has blocks of "
        "[2, 256] (its local shape gives other blocks)"
    )):
        shardsafe.Checkpointer().load(str(tmp_path), {key + "exp_avg": other_blocks})
    with pytest.raises(CheckpointError, match=re.escape(
        f"key '{key}step': the target is a torchao.optim.subclass_8bit.OptimState8bit, the checkpoint holds a plain "
        "tensor under that key; load it into a plain tensor"
    )):
        shardsafe.Checkpointer().load(str(tmp_path), {key + "step": OptimState8bit.zeros((256, 256))})
    with pytest.raises(DtypeMismatchError, match=re.escape(
        f"key '{key}exp_avg': the checkpoint's torchao.optim.subclass_8bit.OptimState8bit dequantizes to float32, the "
        "target has bfloat16"
    )):
        shardsafe.Checkpointer().load(str(tmp_path), {key + "exp_avg": torch.zeros(256, 256, dtype=torch.bfloat16)}, dequantize=True)


class Unknown(torch.Tensor):
    pass


def test_unknown_subclass_is_refused_naming_key_and_class(tmp_path):
    t = torch.zeros(4).as_subclass(Unknown)
    with pytest.raises(ShardingError, match=re.escape(
        "key 'w': a tests.test_subclasses.Unknown is a torch.Tensor subclass shardsafe does not know"
    )) as e:
        shardsafe.Checkpointer().save(str(tmp_path / "c"), {"w": t})
    assert "shardsafe.register_tensor_subclass" in str(e.value)
    assert not (tmp_path / "c" / "metadata.json").exists()


def test_allow_list_names_torchao_classes_and_refuses_other_classes_in_a_record(tmp_path):
    allowed = shardsafe.allowed_tensor_subclasses()
    assert "torchao.optim.subclass_8bit.OptimState8bit" in allowed and NF4_PATH in allowed
    m, o = _trained(AdamW8bit)
    shardsafe.save_model_and_optim_state(str(tmp_path), m, o)
    meta_path = tmp_path / "metadata.json"
    doc = json.loads(meta_path.read_text())
    doc["objects"]["optim.state.0.weight.exp_avg"]["class"] = "os.system"
    meta_path.write_bytes(seal(doc))  # a crafted document, sealed as a writer seals one
    with pytest.raises(CheckpointError, match=re.escape(
        "key 'optim.state.0.weight.exp_avg' holds a 'os.system', which is not on the allow-list of tensor subclasses"
    )):
        shardsafe.Checkpointer().unshard(str(tmp_path), prefix="optim.state.0.weight.")


def test_nf4_exports_dequantized_to_hugging_face_safetensors(tmp_path):
    torch.manual_seed(0)
    base = torch.nn.Linear(256, 256, bias=False)
    nf4 = to_nf4(base.weight.detach().to(torch.bfloat16), 64, 256)
    m = torch.nn.Module()
    m.base = torch.nn.Linear(256, 256, bias=False)
    m.base.weight = torch.nn.Parameter(nf4, requires_grad=False)
    m.lora_a = torch.nn.Linear(256, 8, bias=False)
    shardsafe.save_model_and_optim_state(str(tmp_path / "c"), m)
    with pytest.raises(ShardingError, match=re.escape(
        f"key 'model.base.weight' is a {NF4_PATH}; pass dequantize=True to export its high-precision values"
    )):
        shardsafe.unshard_to_safetensors(str(tmp_path / "c"), str(tmp_path / "out.safetensors"), prefix="model.")
    shardsafe.unshard_to_safetensors(str(tmp_path / "c"), str(tmp_path / "out.safetensors"), prefix="model.", dequantize=True)
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["base.weight", "lora_a.weight"]
        assert_bits(f.get_tensor("base.weight"), nf4.get_original_weight(), "exported base")
        assert_bits(f.get_tensor("lora_a.weight"), m.lora_a.weight.detach(), "exported adapter")


# ------------------------------------------------------------------ FSDP2 ranks


def _nf4_lora_model(seed: int):
    torch.manual_seed(seed)
    m = torch.nn.Module()
    m.base = torch.nn.Linear(256, 512, bias=False)
    m.base.weight = torch.nn.Parameter(to_nf4(m.base.weight.detach().to(torch.bfloat16), 64, 256), requires_grad=False)
    m.lora_a = torch.nn.Linear(256, 8, bias=False)
    m.lora_b = torch.nn.Linear(8, 512, bias=False)
    return m


def _save_nf4_fsdp(rank, world, path):
    from torch.distributed.fsdp import fully_shard

    m = _nf4_lora_model(0)
    fully_shard(m)
    assert type(m.base.weight._local_tensor) is NF4Tensor
    o = torch.optim.AdamW([m.lora_a.weight, m.lora_b.weight])
    shardsafe.save_model_and_optim_state(path, m, o)


def _load_nf4(rank, world, path):
    m = _nf4_lora_model(1)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(m)
    shardsafe.load_model_and_optim_state(path, m, None, validate=False)
    want = _nf4_lora_model(0)
    w = m.base.weight
    if world > 1:  # this rank's rows of the NF4 weight, block for block
        local = w._local_tensor
        rows = 512 // world
        got = local.get_original_weight()
        assert_bits(got, want.base.weight.get_original_weight()[rank * rows : (rank + 1) * rows], "NF4 rows")
        assert_bits(m.lora_a.weight.full_tensor(), want.lora_a.weight.detach(), "lora_a")
    else:
        _assert_same_subclass(w, want.base.weight, "NF4")
        assert_bits(m.lora_b.weight.detach(), want.lora_b.weight.detach(), "lora_b")
    return True


@pytest.mark.parametrize("load_world", [1, 4])
def test_nf4_lora_under_fsdp2_saved_at_2_loads_at_1_and_4(tmp_path_factory, load_world):
    path = built_once(tmp_path_factory, "subclasses/nf4-lora-fsdp2", lambda p: run_ranks(2, _save_nf4_fsdp, p))
    assert run_ranks(load_world, _load_nf4, path) == [True] * load_world


def _lowbit_model(seed: int, rows: int = 64, cols: int = 256):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(cols, rows), torch.nn.Linear(rows, 8))


def _save_lowbit_fsdp(rank, world, path, kind, rows, cols):
    from torch.distributed.fsdp import fully_shard

    _eager()
    m = _lowbit_model(0, rows, cols)
    fully_shard(m)
    o = OPTIMS[kind](m.parameters())
    torch.manual_seed(10 + rank)
    for _ in range(2):
        m(torch.randn(4, cols)).sum().backward()
        o.step()
        o.zero_grad()
    assert type(o.state[m[0].weight]["exp_avg"]._local_tensor).__name__.startswith("OptimState")
    shardsafe.save_model_and_optim_state(path, m, o)


def _lowbit_saved(tmp_path_factory, kind: str, rows: int, cols: int) -> str:
    """A 2-rank FSDP2 checkpoint of ``kind`` low-bit state, saved once per test run (loads only read it)."""
    return built_once(
        tmp_path_factory, f"subclasses/lowbit-{kind}-{rows}x{cols}", lambda p: run_ranks(2, _save_lowbit_fsdp, p, kind, rows, cols)
    )


def _load_lowbit(rank, world, path, kind, rows, cols):
    _eager()
    m = _lowbit_model(1, rows, cols)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(m)
    o = OPTIMS[kind](m.parameters())
    shardsafe.load_model_and_optim_state(path, m, o)
    whole = shardsafe.Checkpointer().unshard(path, prefix="optim.state.0.weight.", no_dist=True)
    st = o.state[m[0].weight]
    for name in ("exp_avg", "exp_avg_sq"):
        got = st[name]
        local = getattr(got, "_local_tensor", got)
        assert type(local) is type(whole[name]), (type(local), type(whole[name]))
        n = rows // world
        want = whole[name].dequantize()[rank * n : (rank + 1) * n]
        assert_bits(local.dequantize().view(n, cols), want, f"{name} rows of rank {rank}")
    return True


@pytest.mark.parametrize("kind", ["8bit", "4bit", "fp8"])
@pytest.mark.parametrize("load_world", [1, 4])
def test_low_bit_state_saved_at_2_ranks_resumes_at_1_and_4(tmp_path_factory, kind, load_world):
    path = _lowbit_saved(tmp_path_factory, kind, 64, 256)
    assert run_ranks(load_world, _load_lowbit, path, kind, 64, 256) == [True] * load_world


def _load_lowbit_expect_error(rank, world, path, kind, rows, cols):
    _eager()
    from torch.distributed.fsdp import fully_shard

    m = _lowbit_model(1, rows, cols)
    fully_shard(m)
    o = OPTIMS[kind](m.parameters())
    try:
        shardsafe.load_model_and_optim_state(path, m, o)
    except ShardingError as e:
        return str(e)
    return None


def test_low_bit_state_is_refused_where_a_cut_falls_inside_a_block(tmp_path_factory):
    """128 x 64 parameters: 8-bit blocks of 256 elements are 4 rows; three ranks cut at rows 43 and 86."""
    path = _lowbit_saved(tmp_path_factory, "8bit", 128, 64)
    errors = run_ranks(3, _load_lowbit_expect_error, path, "8bit", 128, 64)
    for e in errors:
        assert e is not None and "key 'optim.state.0.weight.exp_avg'" in e and "blocks of [4, 64] elements" in e, e
        assert "quantized state reshards only where cuts fall on block edges" in e, e


def _save_float8_fsdp(rank, world, path):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 32, bias=False))
    convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    fully_shard(m)
    assert type(m[0].weight._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor"
    shardsafe.save_model_and_optim_state(path, m)


def _load_float8_back(rank, world, path):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(5)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 32, bias=False))
    convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    fully_shard(m)
    shardsafe.load_model_and_optim_state(path, m)
    torch.manual_seed(0)
    want = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 32, bias=False))
    local = m[0].weight._local_tensor
    assert type(local).__name__ == "WeightWithDynamicFloat8CastTensor"
    rows = 64 // world
    assert_bits(local._tensor, want[0].weight.detach()[rank * rows : (rank + 1) * rows], "float8 weight's high precision")
    return True


def test_float8_all_gather_weights_store_their_high_precision_tensor(tmp_path):
    path = str(tmp_path / "c")
    run_ranks(2, _save_float8_fsdp, path)
    meta = json.loads((tmp_path / "c" / "metadata.json").read_text())
    assert sorted(meta["tensors"]) == ["model.0.weight", "model.1.weight"]  # no record: plain tensors
    torch.manual_seed(0)
    want = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 32, bias=False))
    plain = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 32, bias=False))
    shardsafe.load_model_and_optim_state(path, plain)  # a model without float8
    for p, q in zip(plain.parameters(), want.parameters()):
        assert_bits(p.detach(), q.detach(), "float8 checkpoint into a plain model")
    assert run_ranks(4, _load_float8_back, path) == [True] * 4


def _unknown_in_dtensor(rank, world):
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    local = torch.zeros(4).as_subclass(Unknown)
    return _save_error({"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False)})


def _save_error(state: dict) -> str | None:
    """The ShardingError a save of ``state`` raises (None: it saved); nothing is written."""
    try:
        shardsafe.Checkpointer().save("/nonexistent-never-written", state)
    except ShardingError as e:
        return str(e)
    return None


def test_unknown_subclass_inside_a_dtensor_is_refused_by_name():
    for msg in run_ranks(2, _unknown_in_dtensor):
        assert msg is not None and (
            "rank 0: ShardingError: key 'w': a tests.test_subclasses.Unknown (the local tensor of a DTensor) is a "
            "torch.Tensor subclass shardsafe does not know"
        ) in msg, msg


def test_cli_export_refuses_nf4_without_dequantize_and_writes_it_with(tmp_path, capsys):
    from shardsafe.cli import main

    torch.manual_seed(0)
    nf4 = to_nf4(torch.randn(256, 256, dtype=torch.bfloat16), 64, 256)
    m = torch.nn.Module()
    m.base = torch.nn.Linear(256, 256, bias=False)
    m.base.weight = torch.nn.Parameter(nf4, requires_grad=False)
    shardsafe.save_model_and_optim_state(str(tmp_path / "c"), m)
    out = tmp_path / "m.safetensors"
    assert main(["export", str(tmp_path / "c"), str(out)]) == 2
    assert capsys.readouterr().err == (
        f"shardsafe export: error: {tmp_path / 'c'}: key 'model.base.weight' is a {NF4_PATH}; pass dequantize=True to "
        "export its high-precision values (--dequantize on the command line)\n"
    )
    assert not out.exists()
    assert main(["export", str(tmp_path / "c"), str(out), "--dequantize"]) == 0
    assert capsys.readouterr().out == f"exported 1 tensors (131.1 KB) to {out}\n"
    with safe_open(str(out), "pt") as f:
        assert_bits(f.get_tensor("base.weight"), nf4.get_original_weight(), "exported")


def test_async_save_of_low_bit_state_and_nf4_loads_bit_exact(tmp_path):
    m, o = _trained(AdamW4bit)
    nf4 = to_nf4(torch.randn(256, 256, dtype=torch.bfloat16), 64, 256)
    m.add_module("frozen", torch.nn.Linear(256, 256, bias=False))
    m.frozen.weight = torch.nn.Parameter(nf4, requires_grad=False)
    for _ in range(2):  # the second save reuses the first one's descriptions of the plain tensors
        shardsafe.async_save_model_and_optim_state(str(tmp_path / "c"), m, o, save_overwrite=True).wait()
    m2, o2 = _trained(AdamW4bit, steps=0, seed=1)
    m2.add_module("frozen", torch.nn.Linear(256, 256, bias=False))
    m2.frozen.weight = torch.nn.Parameter(to_nf4(torch.zeros(256, 256, dtype=torch.bfloat16), 64, 256), requires_grad=False)
    shardsafe.load_model_and_optim_state(str(tmp_path / "c"), m2, o2)
    _assert_same_subclass(m2.frozen.weight, nf4, "NF4 after an async save")
    _assert_same_subclass(o2.state[m2[0].weight]["exp_avg_sq"], o.state[m[0].weight]["exp_avg_sq"], "4-bit state")


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(inner=[]), "names no inner tensors"),
    (lambda r: r.update(shape="256"), "has shape '256'; expected a list of at most 64 non-negative integers"),
    (lambda r: r["inner"]["scale"].update(key="model.0.weight"),
     "stores inner tensor 'scale' as {'key': 'model.0.weight', 'block': [1, 256], 'form': 'flat', 'dtype': 'float32'}; "
     "expected it under 'optim.state.0.weight.exp_avg#scale'"),
    (lambda r: r["inner"]["scale"].update(block=[0, 256]), "gives inner tensor 'scale' blocks [0, 256]; expected 2 positive integers"),
    (lambda r: r["inner"]["codes"].update(form="outer", block=[1, 2]), "gives inner tensor 'codes' form 'outer' with blocks [1, 2]"),
    (lambda r: r.update(dtype="float128"), "has dtype 'float128', which safetensors does not store"),
])
@pytest.mark.parametrize("path", ["load", "unshard"])
def test_a_damaged_record_is_refused_as_corrupt_naming_what(tmp_path, edit, message, path):
    from shardsafe.errors import CorruptCheckpointError

    m, o = _trained(AdamW8bit)
    shardsafe.save_model_and_optim_state(str(tmp_path), m, o)
    meta_path = tmp_path / "metadata.json"
    doc = json.loads(meta_path.read_text())
    edit(doc["objects"]["optim.state.0.weight.exp_avg"])
    meta_path.write_bytes(seal(doc))
    with pytest.raises(CorruptCheckpointError, match=re.escape(
        f"key 'optim.state.0.weight.exp_avg': the tensor subclass record {message}"
    )):
        if path == "load":
            m2, o2 = _trained(AdamW8bit, steps=0, seed=1)
            shardsafe.load_model_and_optim_state(str(tmp_path), m2, o2)
        else:
            shardsafe.Checkpointer().unshard(str(tmp_path), prefix="optim.state.0.weight.")


def test_a_context_class_that_is_not_a_dataclass_is_never_called(tmp_path):
    torch.manual_seed(0)
    w = to_nf4(torch.randn(256, 256, dtype=torch.bfloat16), 64, 256)
    shardsafe.Checkpointer().save(str(tmp_path / "c"), {"w": w})
    meta_path = tmp_path / "c" / "metadata.json"
    doc = json.loads(meta_path.read_text())
    doc["objects"]["w"]["ctx"]["tensor_meta"]["$class"] = NF4_PATH.rpartition(".")[0] + ".to_nf4"
    meta_path.write_bytes(seal(doc))
    with pytest.raises(CheckpointError, match=re.escape(
        f"key 'w': the flatten context names '{NF4_PATH.rpartition('.')[0]}.to_nf4', which is not a dataclass"
    )):
        shardsafe.Checkpointer().unshard(str(tmp_path / "c"))


def test_dcp_plugin_refuses_quantized_subclasses_by_name_and_stores_float8_weights(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    from torchao.optim.subclass_8bit import OptimState8bit

    import shardsafe.dcp as sdcp

    state = OptimState8bit.zeros((256, 256))
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as e:  # DCP wraps every rank's error (a BaseException)
        dcp.save({"w": state}, storage_writer=sdcp.StorageWriter(str(tmp_path / "q")), no_dist=True)
    from .helpers import dcp_failure

    err = dcp_failure(e.value)
    assert type(err) is ShardingError and str(err) == (
        "key 'w': a torchao.optim.subclass_8bit.OptimState8bit is a tensor subclass; DCP's planner sees it as one "
        "tensor, not the inner tensors it holds, so shardsafe.dcp cannot store it. Save it with shardsafe.Checkpointer "
        "or shardsafe.save_model_and_optim_state, which store allow-listed subclasses by their inner tensors (README, "
        "Tensor subclasses)"
    )
    assert not (tmp_path / "q" / "metadata.json").exists()

    torch.manual_seed(0)
    high = torch.randn(64, 64)
    from torchao.float8.float8_training_tensor import LinearMMConfig

    w = WeightWithDynamicFloat8CastTensor(high.clone(), LinearMMConfig(), torch.float8_e4m3fn)
    dcp.save({"w": w}, storage_writer=sdcp.StorageWriter(str(tmp_path / "f")), no_dist=True)
    plain = torch.zeros(64, 64)
    dcp.load({"w": plain}, storage_reader=sdcp.StorageReader(str(tmp_path / "f")), no_dist=True)
    assert_bits(plain, high, "float8 weight through the DCP plugin")
    target = WeightWithDynamicFloat8CastTensor(torch.zeros(64, 64), LinearMMConfig(), torch.float8_e4m3fn)
    dcp.load({"w": target}, storage_reader=sdcp.StorageReader(str(tmp_path / "f")), no_dist=True)
    assert_bits(target._tensor, high, "back into a float8 weight")
    with pytest.raises(CheckpointException) as e:
        dcp.load({"w": OptimState8bit.zeros((64, 64))}, storage_reader=sdcp.StorageReader(str(tmp_path / "f")), no_dist=True)
    err = dcp_failure(e.value)
    assert type(err) is ShardingError and str(err).startswith(
        "key 'w': the target is a torchao.optim.subclass_8bit.OptimState8bit, a tensor subclass; DCP's planner sees one "
        "tensor, not the inner tensors it holds, so shardsafe.dcp will not write into it (that would quantize the "
        "values again)"
    ), err


def test_a_subclass_key_loaded_as_a_value_is_refused_naming_its_class(tmp_path):
    w = to_nf4(torch.randn(256, 256, dtype=torch.bfloat16), 64, 256)
    shardsafe.Checkpointer().save(str(tmp_path / "c"), {"w": w})
    with pytest.raises(ShardingError, match=re.escape(
        f"key 'w': the stored value at key path  (the value itself) is a {NF4_PATH} tensor subclass (its inner tensors "
        "are stored beside it, docs/format.md section 14), not a value: load it into a tensor of its class, or with "
        "dequantize=True into a plain tensor"
    )):
        shardsafe.Checkpointer().load(str(tmp_path / "c"), {"w": {"not": "a tensor"}})


def test_a_sharded_tensor_of_a_quantized_subclass_is_refused_and_of_a_float8_weight_stored(tmp_path):
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    from torchao.optim.subclass_8bit import OptimState8bit

    st = shardsafe.ShardedTensor("s", OptimState8bit.zeros((256, 256)), (512, 256), (0, 0), (256, 256))
    with pytest.raises(ShardingError, match=re.escape(
        "key 's': the data of this ShardedTensor is a torchao.optim.subclass_8bit.OptimState8bit; shardsafe stores its "
        "blocks for a DTensor or a plain tensor holding it, not for a ShardedTensor's box or flattened range"
    )):
        shardsafe.Checkpointer().save(str(tmp_path / "q"), {"s": st})
    high = torch.randn(4, 8)
    w = WeightWithDynamicFloat8CastTensor(high.clone(), LinearMMConfig(), torch.float8_e4m3fn)
    shardsafe.Checkpointer().save(str(tmp_path / "f"), {"w": shardsafe.ShardedTensor("w", w, (4, 8), (0, 0), (4, 8))})
    out = shardsafe.Checkpointer().unshard(str(tmp_path / "f"))
    assert_bits(out["w"], high, "float8 weight in a ShardedTensor")


class RowQuantized(torch.Tensor):
    """A user's own traceable wrapper subclass: int8 codes and one scale per row."""

    @staticmethod
    def __new__(cls, q: torch.Tensor, s: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, q.shape, dtype=torch.float32, device=q.device)

    def __init__(self, q: torch.Tensor, s: torch.Tensor) -> None:
        self.q, self.s = q, s

    def __tensor_flatten__(self):
        return ["q", "s"], {"rows": self.q.shape[0]}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return RowQuantized(inner["q"], inner["s"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"RowQuantized has no {func}")

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.s[:, None]


def test_a_registered_class_of_ones_own_round_trips_and_an_unregistered_one_is_refused(tmp_path, monkeypatch):
    from shardsafe.adapters import subclasses

    monkeypatch.setattr(subclasses, "_RULES", dict(subclasses._RULES))  # the registration ends with the test
    torch.manual_seed(0)
    value = RowQuantized(torch.randint(-128, 127, (8, 16), dtype=torch.int8), torch.rand(8))
    with pytest.raises(ShardingError, match=re.escape(
        "key 'w': a tests.test_subclasses.RowQuantized is a torch.Tensor subclass shardsafe does not know"
    )):
        shardsafe.Checkpointer().save(str(tmp_path / "c"), {"w": value})
    with pytest.raises(CheckpointError, match=re.escape(
        "tests.test_subclasses.Unknown has no __tensor_flatten__/__tensor_unflatten__: only traceable wrapper "
        "subclasses can be registered"
    )):
        shardsafe.register_tensor_subclass(Unknown)
    shardsafe.register_tensor_subclass(RowQuantized)
    assert "tests.test_subclasses.RowQuantized" in shardsafe.allowed_tensor_subclasses()
    shardsafe.Checkpointer().save(str(tmp_path / "c"), {"w": value})
    record = json.loads((tmp_path / "c" / "metadata.json").read_text())["objects"]["w"]
    assert record["ctx"] == {"rows": 8}
    assert record["inner"]["s"] == {"key": "w#s", "block": [1, 16], "form": "flat", "dtype": "float32"}
    target = RowQuantized(torch.zeros(8, 16, dtype=torch.int8), torch.zeros(8))
    shardsafe.Checkpointer().load(str(tmp_path / "c"), {"w": target})
    _assert_same_subclass(target, value, "RowQuantized")
    whole = shardsafe.Checkpointer().unshard(str(tmp_path / "c"))["w"]
    _assert_same_subclass(whole, value, "rebuilt by __tensor_unflatten__")
    plain = torch.zeros(8, 16)
    shardsafe.Checkpointer().load(str(tmp_path / "c"), {"w": plain}, dequantize=True)
    assert_bits(plain, value.dequantize(), "dequantized")


def test_an_async_save_of_float8_weights_stores_their_values_not_nans(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 32, bias=False))
    want = [p.detach().clone() for p in m.parameters()]
    convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    assert type(m[0].weight).__name__ == "WeightWithDynamicFloat8CastTensor"
    o = torch.optim.AdamW(m.parameters())
    shardsafe.async_save_model_and_optim_state(str(tmp_path / "c"), m, o).wait()
    plain = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 32, bias=False))
    shardsafe.load_model_and_optim_state(str(tmp_path / "c"), plain, torch.optim.AdamW(plain.parameters()))
    for p, w in zip(plain.parameters(), want):
        assert not torch.isnan(p).any()
        assert_bits(p.detach(), w, "float8 weight after an async save")


def test_a_subclass_target_missing_from_the_checkpoint_is_a_missing_key(tmp_path):
    from torchao.optim.subclass_8bit import OptimState8bit

    from shardsafe.errors import MissingKeyError

    shardsafe.Checkpointer().save(str(tmp_path / "c"), {"other": torch.zeros(3)})
    with pytest.raises(MissingKeyError, match=re.escape("key 'w' is not in the checkpoint (1 tensors stored)")):
        shardsafe.Checkpointer().load(str(tmp_path / "c"), {"w": OptimState8bit.zeros((256, 256))})


def test_cli_inspect_names_the_subclasses_and_their_inner_tensors(tmp_path, capsys):
    from shardsafe.cli import main

    w = to_nf4(torch.randn(256, 256, dtype=torch.bfloat16), 64, 256)
    shardsafe.Checkpointer().save(str(tmp_path / "c"), {"w": w, "step": 3})
    assert main(["inspect", str(tmp_path / "c")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "values          1 JSON, 0 pickled" in lines
    assert "subclasses      1 tensor subclass(es): NF4Tensor (inner tensors under <key>#<name>)" in lines
    assert any(line.split()[:2] == ["w#quantized_data", "[256,"] for line in lines), lines
    assert f"w      tensor subclass {NF4_PATH} [256, 256]" in lines, lines


def _tp_model(world: int, seed: int):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    torch.manual_seed(seed)
    m = torch.nn.Linear(256, 256, bias=False)
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        m.weight = torch.nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Shard(1)]))
    return m


def _save_tp_8bit(rank, world, path):
    from torch.distributed.tensor import DTensor

    _eager()
    m = _tp_model(world, 0)
    o = AdamW8bit(m.parameters())
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        full = torch.randn(256, 256, generator=g)
        m.weight.grad = DTensor.from_local(full[:, rank * 128 : (rank + 1) * 128].clone(), m.weight.device_mesh, m.weight.placements)
        o.step()
    shardsafe.save_model_and_optim_state(path, m, o)
    return _local_bytes(o.state[m.weight]["exp_avg"])


def _local_bytes(state) -> list[bytes]:
    local = state._local_tensor
    return [getattr(local, n).contiguous().numpy().tobytes() for n in ("codes", "scale", "qmap")]


def _load_tp_8bit(rank, world, path):
    _eager()
    m = _tp_model(world, 1)
    o = AdamW8bit(m.parameters())
    shardsafe.load_model_and_optim_state(path, m, o)
    return _local_bytes(o.state[m.weight]["exp_avg"])


def test_tensor_parallel_low_bit_state_reloads_in_its_layout_and_is_refused_in_another(tmp_path):
    """Shard(1) over 2 ranks: a rank's 256-element blocks are 2 rows of its 128 columns, which
    are neither the blocks of a whole row nor consecutive in the whole tensor."""
    path = str(tmp_path / "c")
    saved = run_ranks(2, _save_tp_8bit, path)
    assert run_ranks(2, _load_tp_8bit, path) == saved
    record = json.loads((tmp_path / "c" / "metadata.json").read_text())["objects"]["optim.state.weight.exp_avg"]
    assert record["inner"]["scale"]["block"] == [2, 128]
    m = _tp_model(1, 1)
    o = AdamW8bit(m.parameters())
    m(torch.randn(2, 256)).sum().backward()
    o.step()  # the target holds 8-bit state of its own layout: blocks of whole rows
    with pytest.raises(ShardingError, match=re.escape(
        "key 'optim.state.weight.exp_avg': inner tensor 'scale' was saved with blocks of [2, 128] elements, the target "
        "has blocks of [1, 256] (its local shape gives other blocks)"
    )):
        shardsafe.load_model_and_optim_state(path, m, o)
    plain = _tp_model(1, 1)
    with pytest.raises(ShardingError, match=re.escape(
        "key 'optim.state.weight.exp_avg': inner tensor 'scale' was saved with blocks of [2, 128] elements, which are not "
        "consecutive in the flattened whole tensor of shape [256, 256]"
    )):
        shardsafe.load_model_and_optim_state(path, plain, torch.optim.AdamW(plain.parameters()), validate=False, dequantize=True)


def _strided_subclass(rank, world):
    from torch.distributed.tensor import DTensor, init_device_mesh
    from torch.distributed.tensor.placement_types import _StridedShard
    from torchao.optim.subclass_8bit import OptimState8bit

    mesh = init_device_mesh("cpu", (world,))
    local = OptimState8bit.zeros((128, 256))  # rows 64r..64r+63 and 128+64r..: two pieces of a [256, 256] tensor
    d = DTensor.from_local(local, mesh, [_StridedShard(0, split_factor=2)], run_check=False,
                           shape=torch.Size((256, 256)), stride=(256, 1))
    return _save_error({"s": d})


def test_a_subclass_local_tensor_of_several_pieces_is_refused():
    for msg in run_ranks(2, _strided_subclass):
        assert msg is not None and "key 's': the local OptimState8bit of this DTensor holds 2 pieces of the global tensor" in msg, msg


def _load_lowbit_dequantized(rank, world, path, rows, cols):
    from torch.distributed.fsdp import fully_shard

    m = _lowbit_model(1, rows, cols)
    fully_shard(m)
    o = torch.optim.AdamW(m.parameters())
    shardsafe.load_model_and_optim_state(path, m, o, validate=False, dequantize=True)
    whole = shardsafe.Checkpointer().unshard(path, prefix="optim.state.0.weight.", no_dist=True)
    mine = torch.arange(rows).chunk(world)[rank]  # Shard(0)'s rows of this rank
    for name in ("exp_avg", "exp_avg_sq"):
        got = o.state[m[0].weight][name]
        assert type(got._local_tensor) is torch.Tensor
        assert_bits(got._local_tensor, whole[name].dequantize()[mine[0] : mine[-1] + 1], f"{name} rows of rank {rank}")
    return True


@pytest.mark.parametrize("load_world", [2, 3])
def test_low_bit_state_dequantized_into_plain_fsdp2_state_at_2_and_3_ranks(tmp_path_factory, load_world):
    """Each rank builds the high-precision rows of its own shard, widened to whole blocks (at 3
    ranks the cuts, rows 43 and 86, fall inside blocks of 4 rows: dequantized, they load)."""
    path = _lowbit_saved(tmp_path_factory, "8bit", 128, 64)
    assert run_ranks(load_world, _load_lowbit_dequantized, path, 128, 64) == [True] * load_world


def test_the_independent_spec_reader_rebuilds_inner_tensors_from_section_14(tmp_path):
    """docs/format.md §14 alone (tests/spec_reader.py) gives back each class's inner tensors."""
    from torchao.optim.subclass_4bit import OptimState4bit

    from .spec_reader import read_checkpoint, subclass_parts

    torch.manual_seed(0)
    values = {
        "nf4": to_nf4(torch.randn(256, 256, dtype=torch.bfloat16), 64, 256),
        "q8": _trained(AdamW8bit)[1].state_dict()["state"][0]["exp_avg"],
        "q4": OptimState4bit.zeros((256, 256), signed=True),
        "f8": _float8(_float8_weight()),  # its scale a grid: one per row
        "mx": _mx(_float8_weight()),  # float8_e8m0fnu scales, one per 32 of a row
    }
    shardsafe.Checkpointer().save(str(tmp_path / "c"), values)
    out = read_checkpoint(str(tmp_path / "c"))
    for key, value in values.items():
        names, _ = value.__tensor_flatten__()
        parts = subclass_parts(out, key)
        assert sorted(parts) == sorted(names), key
        for n in names:
            assert_bits(parts[n], getattr(value, n), f"{key}#{n}")


# ------------------------------------------------------------------ float8 weights (quantize_'s Float8Tensor)

FLOAT8_PATH = "torchao.quantization.Float8Tensor"


def _float8(w: torch.Tensor, per: str = "row"):
    """A float8 weight with the context quantize_'s Float8DynamicActivationFloat8WeightConfig gives it
    (a named tuple, a dataclass holding a granularity dataclass and a dtype, an enum): quantize_
    itself needs a GPU of compute capability 8.9, from_hp runs on CPU."""
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import Float8Tensor, PerRow, PerTensor
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import QuantizeTensorToFloat8Kwargs

    g = PerRow() if per == "row" else PerTensor()
    return Float8Tensor.from_hp(
        w, granularity=g, mm_config=Float8MMConfig(use_fast_accum=True), act_quant_kwargs=QuantizeTensorToFloat8Kwargs(torch.float8_e4m3fn, g)
    )


def _float8_weight(seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(64, 128, dtype=torch.bfloat16)


@pytest.mark.parametrize("per", ["row", "tensor"])
def test_float8_weights_with_row_and_tensor_scales_round_trip_bit_exact(tmp_path, per):
    want = _float8(_float8_weight(), per)
    path = str(tmp_path / "c")
    shardsafe.Checkpointer().save(path, {"w": want})
    record = json.loads((tmp_path / "c" / "metadata.json").read_text())["objects"]["w"]
    assert record["class"] == FLOAT8_PATH and record["dtype"] == "bfloat16"
    grid_block = [1, 128] if per == "row" else [64, 128]
    assert record["inner"]["scale"] == {"key": "w#scale", "block": grid_block, "form": "grid", "dtype": "float32"}
    assert record["inner"]["qdata"] == {"key": "w#qdata", "block": [1, 1], "form": "outer", "dtype": "float8_e4m3fn"}
    kinds = record["ctx"]["act_quant_kwargs"]["fields"]
    assert kinds["kernel_preference"] == {  # an enum is the values codec's (docs/format.md §13)
        "__shardsafe__": "enum", "class": "torchao.quantization.quantize_.common.kernel_preference:KernelPreference", "name": "AUTO"
    }
    assert record["ctx"]["mm_config"]["$class"] == "torchao.float8.inference.Float8MMConfig"
    with safe_open(str(next((tmp_path / "c").glob("*.safetensors"))), "pt") as f:  # plain safetensors: the codes and the scales
        assert_bits(f.get_tensor("w#qdata"), want.qdata, "qdata as stored")
        assert_bits(f.get_tensor("w#scale"), want.scale, "scale as stored")

    target = {"w": _float8(torch.zeros(64, 128, dtype=torch.bfloat16), per)}
    shardsafe.Checkpointer().load(path, target)
    _assert_same_subclass(target["w"], want, "loaded in place")
    assert target["w"].__tensor_flatten__()[1] == want.__tensor_flatten__()[1]
    whole = shardsafe.Checkpointer().unshard(path)["w"]
    _assert_same_subclass(whole, want, "unsharded")
    assert whole.__tensor_flatten__()[1] == want.__tensor_flatten__()[1]  # the enum, named tuple and dataclasses rebuilt
    assert_bits(shardsafe.Checkpointer().unshard(path, dequantize=True)["w"], want.dequantize(), "dequantized")


def _save_float8_rows(rank, world, path, dim, kind="float8"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    w = _float8_weight()
    local = w.chunk(world, dim=dim)[rank].contiguous()
    quantized = _float8 if kind == "float8" else _mx
    state = {"w": DTensor.from_local(quantized(local), mesh, [Shard(dim)], run_check=False, shape=w.shape, stride=w.stride())}
    shardsafe.Checkpointer().save(path, state)


def _load_float8_rows(rank, world, path, kind="float8"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    shape = (64, 128)
    zeros = torch.zeros(shape[0] // world, shape[1], dtype=torch.bfloat16)
    quantized = _float8 if kind == "float8" else _mx
    target = {"w": DTensor.from_local(quantized(zeros), mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=(128, 1))}
    shardsafe.Checkpointer().load(path, target)
    want = quantized(_float8_weight().chunk(world)[rank].contiguous())  # scales per row (or per 32 of a row): a row's are its own
    _assert_same_subclass(target["w"]._local_tensor, want, f"rows of rank {rank}")
    return True


@pytest.mark.parametrize("load_world", [1, 4])
def test_float8_row_scaled_weights_sharded_by_rows_at_2_load_at_1_and_4(tmp_path_factory, load_world):
    """Tensor parallel by rows: each rank's Float8Tensor holds its rows and their scales; the
    scales are a grid of [1, 128] blocks, resharded with the codes."""
    path = built_once(tmp_path_factory, "subclasses/float8-rows", lambda p: run_ranks(2, _save_float8_rows, p, 0))
    assert run_ranks(load_world, _load_float8_rows, path) == [True] * load_world
    if load_world == 1:
        _assert_same_subclass(shardsafe.Checkpointer().unshard(path)["w"], _float8(_float8_weight()), "unsharded")


def _load_float8_columns(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    zeros = torch.zeros(64, 128 // world, dtype=torch.bfloat16)
    target = {"w": DTensor.from_local(_float8(zeros), mesh, [Shard(1)], run_check=False, shape=torch.Size((64, 128)), stride=(128, 1))}
    shardsafe.Checkpointer().load(path, target)
    _assert_same_subclass(target["w"]._local_tensor, _float8(_float8_weight().chunk(world, dim=1)[rank].contiguous()), f"columns of rank {rank}")
    return True


def test_float8_weights_sharded_by_columns_keep_their_half_row_scales(tmp_path):
    """Each rank quantized its own columns: a scale per half row, stored as a grid of [1, 64]
    blocks. That layout loads back bit-exact; a whole-row target (blocks of [1, 128]) is refused,
    naming the context that differs; dequantize=True builds the whole high-precision tensor."""
    path = str(tmp_path / "c")
    run_ranks(2, _save_float8_rows, path, 1)
    record = json.loads((tmp_path / "c" / "metadata.json").read_text())["objects"]["w"]
    assert record["inner"]["scale"]["block"] == [1, 64] and record["ctx"]["block_size"] == [1, 64]
    assert run_ranks(2, _load_float8_columns, path) == [True, True]
    with pytest.raises(ShardingError, match=re.escape("key 'w': the checkpoint holds a torchao.quantization.Float8Tensor with flatten context")) as e:
        shardsafe.Checkpointer().load(path, {"w": _float8(torch.zeros(64, 128, dtype=torch.bfloat16))})
    assert "'block_size': [1, 64]" in str(e.value) and "'block_size': [1, 128]" in str(e.value), str(e.value)
    halves = [_float8(half.contiguous()).dequantize() for half in _float8_weight().chunk(2, dim=1)]
    assert_bits(shardsafe.Checkpointer().unshard(path, dequantize=True)["w"], torch.cat(halves, dim=1), "dequantized whole")


def test_a_context_class_off_the_rules_is_never_imported_and_a_bad_enum_is_refused(tmp_path):
    shardsafe.Checkpointer().save(str(tmp_path / "c"), {"w": _float8(_float8_weight())})
    meta_path = tmp_path / "c" / "metadata.json"
    doc = json.loads(meta_path.read_text())
    doc["objects"]["w"]["ctx"]["mm_config"]["$class"] = "os.Enum"
    meta_path.write_bytes(seal(doc))
    with pytest.raises(CheckpointError, match=re.escape(
        "key 'w': the flatten context names class 'os.Enum', which is neither in the module of an allow-listed "
        "subclass nor in its rule's context classes; shardsafe imports no other class"
    )):
        shardsafe.Checkpointer().unshard(str(tmp_path / "c"))
    doc = json.loads(meta_path.read_text())
    doc["objects"]["w"]["ctx"]["mm_config"]["$class"] = "torchao.float8.inference.Float8MMConfig"
    doc["objects"]["w"]["ctx"]["kernel_preference"]["name"] = "FASTEST"
    meta_path.write_bytes(seal(doc))
    with pytest.raises(shardsafe.CorruptCheckpointError, match=re.escape(
        "enum torchao.quantization.quantize_.common.kernel_preference.KernelPreference has no member 'FASTEST'"
    )):
        shardsafe.Checkpointer().unshard(str(tmp_path / "c"))


def _mx(w: torch.Tensor):
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    return MXTensor.to_mx(w, torch.float8_e4m3fn, 32)


def test_mxfp8_round_trips_bit_exact_with_its_e8m0_scales_and_loads_by_rows_in_place(tmp_path):
    """MXFP8: float8 codes and a float8_e8m0fnu scale per 32 elements of a row, a grid of [1, 32]
    blocks, stored as plain safetensors (F8_E8M0)."""
    w = _float8_weight()
    want = _mx(w)
    path = str(tmp_path / "c")
    shardsafe.Checkpointer().save(path, {"w": want})
    record = json.loads((tmp_path / "c" / "metadata.json").read_text())["objects"]["w"]
    assert record["class"] == "torchao.prototype.mx_formats.mx_tensor.MXTensor"
    assert record["inner"]["scale"] == {"key": "w#scale", "block": [1, 32], "form": "grid", "dtype": "float8_e8m0fnu"}
    with safe_open(str(next((tmp_path / "c").glob("*.safetensors"))), "pt") as f:
        assert_bits(f.get_tensor("w#scale"), want.scale, "e8m0 scale as the safetensors library reads it")
    target = {"w": _mx(torch.zeros_like(w))}
    shardsafe.Checkpointer().load(path, target)
    _assert_same_subclass(target["w"], want, "loaded in place")
    assert target["w"].__tensor_flatten__()[1] == want.__tensor_flatten__()[1]
    _assert_same_subclass(shardsafe.Checkpointer().unshard(path)["w"], want, "unsharded")
    assert_bits(shardsafe.Checkpointer().unshard(path, dequantize=True)["w"], want.dequantize(), "dequantized")


def test_mx_scales_swizzled_for_a_kernel_are_refused_by_name(tmp_path):
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    m = _mx(torch.zeros(128, 128, dtype=torch.bfloat16))
    names, ctx = m.__tensor_flatten__()
    swizzled = MXTensor.__tensor_unflatten__({n: getattr(m, n) for n in names}, {**ctx, "is_swizzled_scales": True}, m.shape, m.stride())
    with pytest.raises(ShardingError, match=re.escape(
        "key 'w': a torchao.prototype.mx_formats.mx_tensor.MXTensor with is_swizzled_scales=True holds its inner tensors "
        "in a layout of its own, not as blocks of the tensor, so shardsafe cannot store or reshard them"
    )):
        shardsafe.Checkpointer().save(str(tmp_path / "c"), {"w": swizzled})
    assert not (tmp_path / "c").exists()


def test_mxfp8_sharded_by_rows_at_2_loads_at_4_bit_exact(tmp_path_factory):
    """MXFP8 under tensor parallel by rows: its e8m0 scales (blocks of [1, 32]) reshard with its codes."""
    path = built_once(tmp_path_factory, "subclasses/mx-rows", lambda p: run_ranks(2, _save_float8_rows, p, 0, "mx"))
    assert run_ranks(4, _load_float8_rows, path, "mx") == [True] * 4
