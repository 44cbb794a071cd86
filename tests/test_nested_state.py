"""Nested state dicts and Stateful values through ``Checkpointer`` (issue 13): stored under the
dotted keys DCP's ``flatten_state_dict`` gives, given back nested; optimizer and scheduler values
(tuples, OrderedDict, NumPy scalars, NaN and infinities) keep their types without pickle; what
cannot be stored is refused naming the element's path."""

from __future__ import annotations

import json
import math
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardsafe.dcp
from shardsafe import Checkpointer, CheckpointError, MissingKeyError, PickleNotAllowedError

from .helpers import assert_bits, assert_same, run_ranks


def _param_groups() -> list[dict[str, Any]]:
    """An optimizer's param groups as DCP users' state dicts hold them, with every type JSON lacks."""
    return [
        {
            "lr": np.float64(3e-4), "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0, "step_count": np.int64(12),
            "max_grad_norm": float("inf"), "min_lr": -math.inf, "last_loss": float("nan"), "ema": np.float32(0.999),
            "extra": OrderedDict([("b", (1, [2.5, None])), ("a", {"k": True})]), "params": [0, 1],
        },
        {"lr": 0.1, "betas": (0.8, 0.9), "params": [2]},
    ]


def _nested_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": OrderedDict(
            [("embed.weight", torch.randn(5, 3, generator=g)), ("layers", {"0": {"w": torch.randn(3, 3, generator=g, dtype=torch.float64)}})]
        ),
        "optim": {
            "state": {
                0: {"step": torch.tensor(12.0), "exp_avg": torch.randn(5, 3, generator=g)},
                1: {"step": torch.tensor(12.0), "exp_avg": torch.randint(0, 100, (3, 3), generator=g, dtype=torch.int32)},
            },
            "param_groups": _param_groups(),
        },
        "step": 12,
        "rng": {"torch": torch.randint(0, 255, (8,), generator=g, dtype=torch.uint8), "seed": np.int64(1234)},
        "config": {"name": "run-1", "dims": (5, 3)},
    }


def _zeros_like(state: Any) -> Any:
    """A load target with the structure of ``state``: zeroed tensors, None for values."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        holds = any(isinstance(v, (torch.Tensor, dict)) for v in state.values())
        return type(state)((k, _zeros_like(v) if holds or isinstance(v, torch.Tensor) else None) for k, v in state.items())
    return None


def _tensor_keys(state: dict[str, Any]) -> set[str]:
    flat, _ = flatten_state_dict(state)
    return {k for k, v in flat.items() if isinstance(v, torch.Tensor)}


# --- one process ---------------------------------------------------------------------------


def test_nested_state_round_trips_under_dcp_keys(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    state = _nested_state(0)
    meta, _ = Checkpointer().save(d, state)
    assert set(meta.tensors) == _tensor_keys(state)  # the keys DCP's flatten_state_dict gives
    assert "optim.state.0.exp_avg" in meta.tensors and "model.layers.0.w" in meta.tensors
    assert set(meta.objects) == {"optim.param_groups", "step", "rng.seed", "config"} and meta.pickled_objects == {}
    assert meta.objects["optim.param_groups"][1] == {"lr": 0.1, "betas": {"__shardsafe__": "tuple", "items": [0.8, 0.9]}, "params": [2]}

    target = _zeros_like(state)
    inner = target["model"]["layers"]["0"]["w"]
    Checkpointer().load(d, target)
    assert target["model"]["layers"]["0"]["w"] is inner  # filled in place
    assert_same(target, state, "state")
    assert type(target["model"]) is OrderedDict

    flat = Checkpointer().unshard(d)  # without a target: the stored flat keys
    assert_same(flat["optim.param_groups"], state["optim"]["param_groups"])
    assert_bits(flat["optim.state.1.exp_avg"], state["optim"]["state"][1]["exp_avg"])


def test_a_flat_state_dict_is_stored_as_before(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    state = {"w": torch.ones(2), "step": 3, "cfg": {"lr": 0.1, "names": ["a", "b"], "__shardsafe__": "mine"}, "none": None}
    meta, _ = Checkpointer().save(d, state)
    raw = (d / "metadata.json").read_text()
    assert set(meta.tensors) == {"w"}
    # plain JSON values are stored verbatim, as encode_objects always stored them (a dict with the
    # reserved key included, as shardsafe.lightning and shardsafe.megatron pass their tagged values)
    assert '"objects":{"step":3,"cfg":{"lr":0.1,"names":["a","b"],"__shardsafe__":"mine"},"none":null},"pickled_objects":{}' in raw


def test_tagged_values_keep_their_types(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    groups = _param_groups()
    Checkpointer().save(d, {"optim": {"state": {"0": {"m": torch.ones(2)}}, "param_groups": groups}})
    stored = json.loads((d / "metadata.json").read_text())["objects"]["optim.param_groups"][0]
    assert stored["max_grad_norm"] == {"__shardsafe__": "float", "v": "inf"}
    assert stored["lr"] == {"__shardsafe__": "numpy", "dtype": "<f8", "b64": "YTJVMCqpMz8="}
    target: dict[str, Any] = {"optim": {"state": {"0": {"m": torch.zeros(2)}}, "param_groups": None}}
    Checkpointer().load(d, target)
    got = target["optim"]["param_groups"]
    assert_same(got, groups, "param_groups")
    assert type(got[0]["betas"]) is tuple and type(got[0]["lr"]) is np.float64 and type(got[0]["step_count"]) is np.int64
    assert type(got[0]["ema"]) is np.float32 and got[0]["ema"].tobytes() == np.float32(0.999).tobytes()
    assert got[0]["min_lr"] == -math.inf and math.isnan(got[0]["last_loss"])


class _Opaque:
    pass


def test_a_value_with_no_json_form_is_refused_by_its_path(tmp_path: Path) -> None:
    groups = _param_groups()
    groups[0]["betas"] = (0.9, _Opaque())
    state = {"model": {"w": torch.ones(2)}, "optim": {"state": {0: {"m": torch.ones(2)}}, "param_groups": groups}}
    with pytest.raises(PickleNotAllowedError) as info:
        Checkpointer().save(tmp_path / "a", state)
    msg = str(info.value)
    assert msg.startswith(f"'optim.param_groups[0].betas[1]' is a {__name__}._Opaque, which has no JSON form (shardsafe stores ")
    assert msg.endswith("Convert it, or pass allow_pickle=True to store 'optim.param_groups' with pickle")
    groups[0]["betas"] = _Opaque()
    with pytest.raises(PickleNotAllowedError, match=r"^'optim\.param_groups\[0\]\.betas' is a "):
        Checkpointer().save(tmp_path / "b", state)
    assert not (tmp_path / "a").exists() or not (tmp_path / "a" / "metadata.json").exists()

    meta, _ = Checkpointer(allow_pickle=True).save(tmp_path / "c", state)  # opted in: that one value pickled
    assert set(meta.pickled_objects) == {"optim.param_groups"} and set(meta.tensors) == {"model.w", "optim.state.0.m"}


def test_a_tensor_inside_a_list_is_refused_without_suggesting_pickle(tmp_path: Path) -> None:
    state = {"optim": {"state": {"0": {"m": torch.ones(2)}}, "param_groups": [{"lr": 0.1, "params": [torch.ones(1)]}]}}
    with pytest.raises(PickleNotAllowedError) as info:
        Checkpointer().save(tmp_path / "a", state)
    msg = str(info.value)
    assert msg.startswith("'optim.param_groups[0].params[0]' is a torch.Tensor inside a list, tuple or other value, which cannot be stored")
    assert msg.endswith("Put the tensors in a dict, keyed by name or by str(index)")
    assert "pickle" not in msg
    with pytest.raises(PickleNotAllowedError, match=r"^'buffers\[1\]' is a torch\.Tensor") as info:
        Checkpointer().save(tmp_path / "b", {"w": torch.ones(1), "buffers": (1, torch.zeros(2))})
    assert "pickle" not in str(info.value)


def test_two_entries_of_one_key_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        Checkpointer().save(tmp_path / "a", {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}})
    assert str(info.value) == (
        "state_dict['a.b'] and state_dict['a']['b'] are both stored under the key 'a.b' (nested keys are joined with '.', "
        "as torch.distributed.checkpoint does); rename one of them"
    )
    with pytest.raises(CheckpointError, match=r"state_dict\['m'\]\['1'\] and state_dict\['m'\]\[1\] are both stored under the key 'm\.1'"):
        Checkpointer().save(tmp_path / "b", {"m": {"1": torch.ones(1), 1: torch.zeros(1)}})


def test_a_missing_nested_key_is_named_dotted(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    Checkpointer().save(d, {"model": {"w": torch.ones(2)}, "optim": {"state": {"0": {"m": torch.ones(2)}}}})
    with pytest.raises(MissingKeyError, match=r"key 'model\.b' is not in the checkpoint"):
        Checkpointer().load(d, {"model": {"w": torch.zeros(2), "b": torch.zeros(2)}})
    with pytest.raises(MissingKeyError, match=r"non-tensor key 'optim\.state\.0\.lr' is not in the checkpoint"):
        Checkpointer().load(d, {"optim": {"state": {"0": {"m": torch.zeros(2), "lr": None}}}})
    # a target dict without tensors, stored as keys under it: entered (a fresh optimizer's empty state)
    target: dict[str, Any] = {"model": {"w": torch.zeros(2)}, "optim": {"state": {}}}
    Checkpointer().load(d, target)
    assert target["optim"] == {"state": {}} and torch.equal(target["model"]["w"], torch.ones(2))
    target = {"optim": {"state": {}}}  # alone, too
    Checkpointer().load(d, target)
    assert target == {"optim": {"state": {}}}
    with pytest.raises(MissingKeyError, match=r"non-tensor key 'cfg' is not in the checkpoint"):
        Checkpointer().load(d, {"optim": {"state": {}}, "cfg": {"a": 1}})


# --- Stateful values -------------------------------------------------------------------------


class Counter:
    """A minimal Stateful: a tensor, a tuple and a NumPy scalar in its state."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.hist = torch.arange(4, dtype=torch.float32) * n
        self.calls = {"state_dict": 0, "load_state_dict": 0}

    def state_dict(self) -> dict[str, Any]:
        self.calls["state_dict"] += 1
        return {"n": self.n, "hist": self.hist, "shape": (self.n,), "scale": np.float64(self.n) / 3}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.calls["load_state_dict"] += 1
        self.n, self.hist, self.shape, self.scale = sd["n"], sd["hist"], sd["shape"], sd["scale"]


class AppState:
    """A DCP-style wrapper (as in the DCP tutorial): model and optimizer through get_state_dict /
    set_state_dict, so the optimizer's state is keyed by parameter name and is there before a load."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _training(seed: int, lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.85, 0.97))
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=lr, total_steps=20)
    return model, optim, sched


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer, sched: Any, i: int) -> float:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 + i))
    loss = model(x).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    sched.step()
    return loss.item()


def test_stateful_values_round_trip(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    model, optim, sched = _training(0, 0.01)
    for i in range(3):
        _step(model, optim, sched, i)
    counter = Counter(5)
    meta, _ = Checkpointer().save(d, {"app": AppState(model, optim), "sched": sched, "counter": counter, "step": 3})
    assert counter.calls == {"state_dict": 1, "load_state_dict": 0}
    assert {"app.model.0.weight", "app.optim.state.0.weight.exp_avg", "app.optim.state.2.bias.step", "counter.hist"} <= set(meta.tensors)
    assert {"app.optim.param_groups", "sched", "counter.n", "counter.shape", "step"} <= set(meta.objects)
    assert meta.pickled_objects == {}

    model2, optim2, sched2 = _training(1, 0.5)  # other weights, a fresh optimizer (no state), another schedule
    counter2 = Counter(2)
    target = {"app": AppState(model2, optim2), "sched": sched2, "counter": counter2, "step": None}
    Checkpointer().load(d, target)
    assert target["app"].model is model2 and target["sched"] is sched2  # the objects stay, restored
    assert target["step"] == 3
    assert counter2.calls == {"state_dict": 1, "load_state_dict": 1}
    assert counter2.n == 5 and counter2.shape == (5,) and type(counter2.scale) is np.float64 and counter2.scale == np.float64(5) / 3
    assert_bits(counter2.hist, torch.arange(4, dtype=torch.float32) * 5)
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert_bits(p2.detach(), p.detach())
        for k, v in optim.state[p].items():
            assert_bits(optim2.state[p2][k], v)
    assert_same(optim2.param_groups, optim.param_groups, "param_groups")  # OneCycleLR cycles betas[0]: a tuple still
    assert sched2.state_dict() == sched.state_dict()
    # training goes on exactly as the uninterrupted run
    assert [_step(model2, optim2, sched2, i) for i in range(3, 6)] == [_step(model, optim, sched, i) for i in range(3, 6)]


def test_async_save_calls_state_dict_before_it_returns(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    counter = Counter(4)
    w = torch.arange(6, dtype=torch.float32)
    handle = Checkpointer().async_save(d, {"counter": counter, "model": {"w": w}, "cfg": {"betas": (0.9, 0.99)}})
    assert counter.calls["state_dict"] == 1
    counter.hist.add_(100)  # after async_save returned: not in the checkpoint
    w.mul_(-1)
    handle.wait()
    target = {"counter": Counter(1), "model": {"w": torch.zeros(6)}, "cfg": None}
    Checkpointer().load(d, target)
    assert_bits(target["counter"].hist, torch.arange(4, dtype=torch.float32) * 4)
    assert_bits(target["model"]["w"], torch.arange(6, dtype=torch.float32))
    assert_same(target["cfg"], {"betas": (0.9, 0.99)})


# --- through DCP and back --------------------------------------------------------------------


def test_dcp_and_checkpointer_read_each_others_nested_saves(tmp_path: Path) -> None:
    """DCP stores param groups as ``optim.param_groups.0.lr``, Checkpointer as one
    ``optim.param_groups`` value: either loads into the same nested target."""
    model, optim, sched = _training(0, 0.01)
    for i in range(2):
        _step(model, optim, sched, i)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd, "step": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialized
        dcp.save(state, storage_writer=shardsafe.dcp.StorageWriter(str(tmp_path / "dcp")))
        Checkpointer().save(tmp_path / "ours", state)
        for src in ("dcp", "ours"):
            model2, optim2, _ = _training(1, 0.5)
            msd2, osd2 = get_state_dict(model2, optim2)
            target = {"model": msd2, "optim": osd2, "step": None}
            if src == "dcp":
                Checkpointer().load(tmp_path / src, target)
            else:
                dcp.load(target, storage_reader=shardsafe.dcp.StorageReader(str(tmp_path / src)))
            assert_same(target, state, src)


# --- two gloo ranks, DTensor leaves ----------------------------------------------------------


def _save_dtensors(rank: int, ws: int, path: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    full = _nested_state(7)
    state = _nested_state(7)
    state["model"]["embed.weight"] = distribute_tensor(full["model"]["embed.weight"], mesh, [Shard(0)])
    state["model"]["layers"]["0"]["w"] = distribute_tensor(full["model"]["layers"]["0"]["w"], mesh, [Shard(1)])
    state["optim"]["state"][0]["exp_avg"] = distribute_tensor(full["optim"]["state"][0]["exp_avg"], mesh, [Shard(0)])
    state["optim"]["state"][1]["exp_avg"] = distribute_tensor(full["optim"]["state"][1]["exp_avg"], mesh, [Replicate()])
    meta, _ = Checkpointer().save(path, state)
    return sorted(meta.tensors)


def test_nested_dtensors_saved_on_two_ranks_load_on_one(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    keys = run_ranks(2, _save_dtensors, path)
    want = _nested_state(7)
    assert keys == [sorted(_tensor_keys(want))] * 2
    target = _zeros_like(want)
    Checkpointer().load(path, target, no_dist=True)
    assert_same(target, want, "state")


class _Picky(Counter):
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise ValueError(f"n must be 1, got {sd['n']}")


class _Broken(Counter):
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("no state yet")


def test_a_failing_state_dict_or_load_state_dict_is_named_by_key(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match=r"^key 'opt\.b': _Broken\.state_dict\(\) raised RuntimeError: no state yet$"):
        Checkpointer().save(d, {"opt": {"a": Counter(1), "b": _Broken(1)}})
    Checkpointer().save(d, {"opt": {"a": Counter(3)}})
    with pytest.raises(CheckpointError, match=r"^key 'opt\.a': _Picky\.load_state_dict\(\) of the loaded state raised ValueError: n must be 1, got 3$"):
        Checkpointer().load(d, {"opt": {"a": _Picky(1)}})
