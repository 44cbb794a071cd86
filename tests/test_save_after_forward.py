"""Save and load right after a forward pass with no backward (an evaluation pass, the Hugging Face
flow): FSDP2 keeps the root's parameters unsharded after a forward (and every module's with
``reshard_after_forward=False``), FSDP1 keeps the root's flat parameter unsharded. A save or load
must switch them back to the sharded parameters first, as torch's own ``state_dict()`` does:
otherwise the save stored whole copies of the root's parameters (or refused the optimizer), and a
load filled copies the next forward throws away."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from .distributed import run_ranks

# (flavour, world size, how the last forward ran)
CASES = [
    ("fsdp2", 2, "grad"),
    ("fsdp2", 2, "no_grad"),
    ("fsdp2", 2, "keep_unsharded"),  # reshard_after_forward=False on every module
    ("fsdp2", 1, "grad"),
    ("fsdp1", 2, "grad"),
    ("fsdp1", 2, "no_grad"),
]


def _model(flavour: str, how: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # the root holds parameters of its own (the last Linear): those stay unsharded after a forward
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    if flavour == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        # by default the root keeps its parameters unsharded after a forward; "keep_unsharded": every module does
        kw = {"reshard_after_forward": False} if how == "keep_unsharded" else {}
        fully_shard(model[0], **kw)
        fully_shard(model, **kw)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel

    model[0] = FullyShardedDataParallel(model[0], use_orig_params=True, device_id=torch.device("cpu"))
    return FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))


def _forward(model: nn.Module, how: str) -> torch.Tensor:
    x = torch.arange(64, dtype=torch.float32).reshape(4, 16) / 64
    if how == "no_grad":
        with torch.no_grad():
            return model(x).detach().clone()
    return model(x).detach().clone()


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, through torch's own state_dict (which reshards first)."""
    out = {}
    for k, v in model.state_dict().items():
        out[k] = v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
    return out


def _save_then_load(rank, ws, flavour, how, with_optim, path):
    import shardsafe

    model = _model(flavour, how, seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1) if with_optim else None
    if optim is not None:  # one training step, so the optimizer has state
        model(torch.ones(4, 16)).sum().backward()
        optim.step()
        optim.zero_grad()
    want = _forward(model, how)  # the last forward: no backward after it
    shardsafe.save_model_and_optim_state(path, model, optim)
    truth = _full(model)
    truth_optim = {k: v for k, v in (optim.state_dict()["state"].items() if optim else [])}
    truth_optim = {
        (i, n): (t.full_tensor() if hasattr(t, "full_tensor") else t).clone() for i, st in truth_optim.items() for n, t in st.items()
    }

    other = _model(flavour, how, seed=1)  # other values; it too has just run a forward
    other_optim = torch.optim.AdamW(other.parameters(), lr=0.1) if with_optim else None
    _forward(other, how)
    shardsafe.load_model_and_optim_state(path, other, other_optim)
    got = _forward(other, how)  # the forward must use the loaded (sharded) parameters
    assert torch.equal(got, want), float((got - want).abs().max())
    loaded = _full(other)
    assert loaded.keys() == truth.keys()
    for k in truth:
        assert torch.equal(loaded[k], truth[k]), k
    if with_optim:
        st = {
            (i, n): (t.full_tensor() if hasattr(t, "full_tensor") else t)
            for i, s in other_optim.state_dict()["state"].items() for n, t in s.items()
        }
        assert st.keys() == truth_optim.keys()
        for k in truth_optim:
            assert torch.equal(st[k], truth_optim[k]), k
    return sorted(truth)


@pytest.mark.parametrize("with_optim", [True, False], ids=["optim", "no-optim"])
@pytest.mark.parametrize("flavour,ws,how", CASES, ids=[f"{f}-ws{w}-{h}" for f, w, h in CASES])
def test_save_and_load_right_after_a_forward(flavour, ws, how, with_optim, tmp_path):
    path = str(tmp_path / "ckpt")
    names = run_ranks(ws, _save_then_load, flavour, how, with_optim, path, timeout=600)
    assert names == [["0.bias", "0.weight", "2.bias", "2.weight"]] * ws
    with open(os.path.join(path, "metadata.json")) as f:
        meta = json.load(f)
    from shardsafe.checkpointer import Checkpointer

    stored = Checkpointer().get_metadata(path, no_dist=True)
    model_keys = sorted(k for k in stored.tensors if k.startswith("model."))
    assert model_keys == ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight"]
    assert meta["format_version"] >= 3
    # the root's parameters are stored as the shards each rank holds: one chunk per rank (FSDP1 splits the
    # root's one flat parameter, weight then bias, in halves: the bias lies whole in rank 1's half)
    for key in ("model.2.weight", "model.2.bias"):
        chunks = 1 if flavour == "fsdp1" and key == "model.2.bias" else ws
        assert stored.tensors[key].chunk_count() == chunks, (key, stored.tensors[key].chunk_count())
        assert stored.tensors[key].is_sharded == (ws > 1), key


def _save_inside_summon_full_params(rank, ws, path):
    from torch.distributed.fsdp import FullyShardedDataParallel

    import shardsafe
    from shardsafe import ShardingError

    model = _model("fsdp1", "grad", seed=0)
    _forward(model, "grad")
    with FullyShardedDataParallel.summon_full_params(model):
        try:
            shardsafe.save_model_and_optim_state(path, model)
        except ShardingError as e:
            return str(e)
    return "saved"


def test_fsdp1_inside_summon_full_params_is_refused_with_the_reason(tmp_path):
    got = run_ranks(2, _save_inside_summon_full_params, str(tmp_path / "ckpt"), timeout=600)
    assert got == [
        "FSDP1 module '<root>' holds its parameters unsharded (SUMMON_FULL_PARAMS: inside "
        "FullyShardedDataParallel.summon_full_params); save and load outside it, where FSDP holds each rank's shard"
    ] * 2
    assert not (tmp_path / "ckpt" / "metadata.json").exists()
