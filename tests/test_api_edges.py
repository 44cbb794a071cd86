"""save/load_model_and_optim_state beyond the cross-topology matrix of ``test_api.py``.

SGD (momentum), Adam and AdamW with retuned hyper-parameters in two groups; the names stored
(no wrapper parts, no integer ids, no pickle) and the files readable by the official
safetensors; persistent vs non-persistent buffers; loading in place (``data_ptr`` identity: no
second copy of the model or of the optimizer state, no tensor allocated twice); every refusal,
by exception type and message; ``unshard_*`` with and without a process group; activation
checkpointing, ``torch.compile`` and tied weights.

Multi-rank cases run in two ws2 sessions (one FSDP2 + DDP, one FSDP1) shared by several tests
through module fixtures, to keep the file fast.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re

import pytest
import torch
from safetensors import safe_open

import shardsafe
from shardsafe import api
from shardsafe.format.file_index import SUMS_ENTRY

from .distributed import run_ranks
from .test_api import _assert_same, _build, _cfg, _train_step, full_state

# one worker runs the whole module, so its module-scoped checkpoints and ws2 sessions are made once
pytestmark = pytest.mark.xdist_group("api_edges")

OPTIMS = ("sgd", "adam", "adamw")
WRAPPER_PARTS = ("module.", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "_flat_param")


# --- helpers --------------------------------------------------------------------------------


def _model(kind="plain", ws=1, seed=0):
    return _build(kind, ws, seed)[0]  # its AdamW is dropped: tests pick their optimizer


def _optim(model, kind):
    from tiny_llama import make_optimizer

    return make_optimizer(model, kind)


def _retune(optim):
    """Hyper-parameters, per group, that differ from a fresh optimizer's (and between groups)."""
    for gi, g in enumerate(optim.param_groups):
        g["lr"] = 2e-4 * (gi + 1)
        g["weight_decay"] = 0.03 * (gi + 1)
        if "betas" in g:
            g["betas"] = (0.8 - 0.1 * gi, 0.99)
        if "momentum" in g:
            g["momentum"] = 0.7 - 0.1 * gi


def _trained(kind="plain", ws=1, opt="adamw", steps=2):
    """A model and optimizer after ``steps`` steps, retuned: every value differs from a fresh pair's."""
    model = _model(kind, ws)
    optim = _optim(model, opt)
    for s in range(steps):
        _train_step(model, optim, s)
    _retune(optim)
    return model, optim


def _plain_names(model=None):
    """Parameter and persistent-buffer names of the unwrapped model."""
    model = model or _model()
    return [n for n, _ in model.named_parameters()] + ["tokens_seen"]


def _expected_keys(opt):
    state = {
        "sgd": ["momentum_buffer"],
        "adam": ["exp_avg", "exp_avg_sq", "step"],
        "adamw": ["exp_avg", "exp_avg_sq", "step"],
    }[opt]
    names = [n for n, _ in _model().named_parameters()]
    keys = {f"model.{n}" for n in _plain_names()}
    keys |= {f"optim.state.{n}.{s}" for n in names for s in state}
    return keys | {"optim.param_groups", "optim.class"}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _ptrs(model, optim):
    """data_ptr of every parameter, buffer and optimizer state tensor (local part of a DTensor)."""
    out = {f"model.{n}": _local(p).data_ptr() for n, p in model.named_parameters()}
    out.update({f"model.{n}": b.data_ptr() for n, b in model.named_buffers()})
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in optim.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{names[id(p)]}.{k}"] = _local(v).data_ptr()
    return out


def _state_ids(optim):
    return {(id(p), k): id(v) for p, st in optim.state.items() for k, v in st.items() if isinstance(v, torch.Tensor)}


def _groups_hp(optim):
    return [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]


# --- 1. optimizers, single process ----------------------------------------------------------


@pytest.mark.parametrize("opt", OPTIMS)
def test_optimizer_round_trip_into_fresh_optimizer(tmp_path, opt):
    model, optim = _trained(opt=opt)
    truth = full_state(model, optim)
    shardsafe.save_model_and_optim_state(str(tmp_path), model, optim)

    model2 = _model(seed=7)
    optim2 = _optim(model2, opt)
    assert not optim2.state  # fresh: no dummy step
    assert _groups_hp(optim2) != _groups_hp(optim)  # the retuned hyper-parameters really differ
    shardsafe.load_model_and_optim_state(str(tmp_path), model2, optim2)

    _assert_same(full_state(model2, optim2), truth, True, f"{opt}: loaded")  # tensors, step, groups
    assert _groups_hp(optim2) == _groups_hp(optim)
    assert [g["lr"] for g in optim2.param_groups] == [2e-4, 4e-4]
    for g in optim2.param_groups:
        if "betas" in g:
            assert type(g["betas"]) is tuple
    want_state = {
        "sgd": {"momentum_buffer"},
        "adam": {"exp_avg", "exp_avg_sq", "step"},
        "adamw": {"exp_avg", "exp_avg_sq", "step"},
    }[opt]
    for p in model2.parameters():
        assert set(optim2.state[p]) == want_state
        if "step" in want_state:
            assert optim2.state[p]["step"].item() == 2.0
    # the restored optimizer steps exactly as the original (the hyper-parameters are in use)
    _train_step(model, optim, 5)
    _train_step(model2, optim2, 5)
    _assert_same(full_state(model2, optim2), full_state(model, optim), True, f"{opt}: a step after loading")


# --- 2. stored names, single process --------------------------------------------------------


def test_stored_names_plain_have_no_ids_or_pickle(tmp_path):
    model, optim = _trained(opt="adamw")
    shardsafe.save_model_and_optim_state(str(tmp_path), model, optim)
    meta = shardsafe.Checkpointer().get_metadata(str(tmp_path))
    assert set(meta.tensors) | set(meta.objects) == _expected_keys("adamw")
    assert meta.pickled_objects == {}
    groups = meta.objects["optim.param_groups"]
    assert [g["params"] for g in groups] == [
        [n for n, _ in model.named_parameters() if "norm" not in n],
        [n for n, _ in model.named_parameters() if "norm" in n],
    ]
    assert [g["lr"] for g in groups] == [2e-4, 4e-4] and groups[0]["betas"] == [0.8, 0.99]
    raw = json.loads((tmp_path / "metadata.json").read_text())
    assert set(raw["objects"]) == {"optim.param_groups", "optim.class"} and not raw.get("pickled_objects")


# --- 3. buffers -----------------------------------------------------------------------------


def test_persistent_buffer_saved_non_persistent_not(tmp_path):
    model, optim = _trained()
    assert model.tokens_seen.item() == 2 * 4 * 32
    shardsafe.save_model_and_optim_state(str(tmp_path), model, optim)
    meta = shardsafe.Checkpointer().get_metadata(str(tmp_path))
    assert "model.tokens_seen" in meta.tensors
    assert not [k for k in meta.tensors if "rope" in k]

    model2 = _model(seed=7)
    with torch.no_grad():
        model2.rope_cos.fill_(3.0)  # not stored, so loading leaves it alone
    shardsafe.load_model_and_optim_state(str(tmp_path), model2)
    assert model2.tokens_seen.item() == 256 and model2.tokens_seen.dtype == torch.int64
    assert bool((model2.rope_cos == 3.0).all())
    assert "tokens_seen" in shardsafe.unshard_model_state(str(tmp_path))


# --- 4. in place ----------------------------------------------------------------------------


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_load_is_in_place(tmp_path, opt):
    model, optim = _trained(opt=opt)
    truth = full_state(model, optim)
    shardsafe.save_model_and_optim_state(str(tmp_path), model, optim)
    _train_step(model, optim, 3)  # values move away from the checkpoint
    before, ids = _ptrs(model, optim), _state_ids(optim)
    shardsafe.load_model_and_optim_state(str(tmp_path), model, optim)
    _assert_same(full_state(model, optim), truth, True, "loaded in place")
    assert _ptrs(model, optim) == before  # nothing reallocated: no second copy anywhere
    assert _state_ids(optim) == ids  # the optimizer keeps its own state tensors


def test_fresh_optimizer_state_allocated_once(tmp_path, monkeypatch):
    model, optim = _trained(opt="adamw")
    shardsafe.save_model_and_optim_state(str(tmp_path), model, optim)
    meta = shardsafe.Checkpointer().get_metadata(str(tmp_path))
    stored = {k for k in meta.tensors if k.startswith("optim.state.")}

    made: dict = {}
    real = api.optim_targets

    def spy(*args, **kwargs):
        targets, apply = real(*args, **kwargs)
        made.update(targets)
        return targets, apply

    monkeypatch.setattr(api, "optim_targets", spy)
    model2 = _model(seed=7)
    optim2 = _optim(model2, "adamw")
    shardsafe.load_model_and_optim_state(str(tmp_path), model2, optim2)
    assert set(made) == stored  # the param groups come from the metadata, not a target
    allocated = {id(t) for k, t in made.items() if k in stored}
    assert len(allocated) == len(stored)  # one tensor per stored state
    held = {id(v) for st in optim2.state.values() for v in st.values()}
    assert held == allocated  # and the optimizer holds exactly those: load_state_dict copied nothing

    before, ids = _ptrs(model2, optim2), _state_ids(optim2)
    made.clear()
    shardsafe.load_model_and_optim_state(str(tmp_path), model2, optim2)
    assert {id(t) for k, t in made.items() if k in stored} == allocated  # a second load reuses them
    assert _ptrs(model2, optim2) == before and _state_ids(optim2) == ids


# --- 5. refusals ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A plain AdamW checkpoint and its truth."""
    path = str(tmp_path_factory.mktemp("saved") / "ckpt")
    model, optim = _trained(opt="adamw")
    truth = full_state(model, optim)
    shardsafe.save_model_and_optim_state(path, model, optim)
    return path, truth


def test_model_key_the_checkpoint_lacks(saved):
    path, _ = saved
    model = _model(seed=7)
    model.register_buffer("extra", torch.zeros(3))
    with pytest.raises(shardsafe.MissingKeyError, match=r"lacks 1 model key\(s\) the model has: \['extra'\]") as e:
        shardsafe.load_model_and_optim_state(path, model)
    assert isinstance(e.value, KeyError)


def test_extra_model_key_in_checkpoint(tmp_path):
    model, optim = _trained()
    model.register_buffer("extra", torch.arange(3.0))
    truth = full_state(model, optim)
    del truth["model.extra"]
    shardsafe.save_model_and_optim_state(str(tmp_path), model, optim)

    model2 = _model(seed=7)
    optim2 = _optim(model2, "adamw")
    untouched = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(
        shardsafe.CheckpointError, match=r"model key\(s\) the model lacks: \['extra'\]; pass validate=False"
    ) as e:
        shardsafe.load_model_and_optim_state(str(tmp_path), model2, optim2)
    assert type(e.value) is shardsafe.CheckpointError
    assert not optim2.state  # refused up front: nothing was loaded
    _assert_same(model2.state_dict(), untouched, True, "refused load")
    shardsafe.load_model_and_optim_state(str(tmp_path), model2, optim2, validate=False)
    _assert_same(full_state(model2, optim2), truth, True, "validate=False")


def test_extra_parameter_in_checkpoint_optimizer(tmp_path):
    """A parameter the target model dropped (with its optimizer state): refused, or skipped with validate=False."""
    model = _model()
    model.extra = torch.nn.Parameter(torch.randn(5))
    optim = _optim(model, "adamw")
    _train_step(model, optim, 0)
    saved_truth = full_state(model, optim)
    shardsafe.save_model_and_optim_state(str(tmp_path), model, optim)

    model2 = _model(seed=7)  # the model dropped it
    optim2 = _optim(model2, "adamw")
    with pytest.raises(shardsafe.CheckpointError, match=r"\['extra'\].*validate=False"):
        shardsafe.load_model_and_optim_state(str(tmp_path), model2, optim2)
    shardsafe.load_model_and_optim_state(str(tmp_path), model2, optim2, validate=False)
    truth = {k: v for k, v in saved_truth.items() if ".extra" not in k}
    _assert_same(full_state(model2, optim2), truth, True, "validate=False, parameter dropped")

    model3 = _model(seed=7)  # the model keeps it, the optimizer does not (frozen): only group 0 differs
    optim3 = _optim(model3, "adamw")
    model3.extra = torch.nn.Parameter(torch.zeros(5))
    with pytest.raises(
        shardsafe.CheckpointError,
        match=r"param group 0 differs .*only in the checkpoint \['extra'\] \(pass validate=False",
    ):
        shardsafe.load_model_and_optim_state(str(tmp_path), model3, optim3)
    shardsafe.load_model_and_optim_state(str(tmp_path), model3, optim3, validate=False)
    truth = {k: v for k, v in saved_truth.items() if not k.startswith("optim.extra.")}
    _assert_same(full_state(model3, optim3), truth, True, "validate=False, parameter frozen")
    assert torch.equal(model3.extra, saved_truth["model.extra"]) and model3.extra not in optim3.state


def test_param_group_count_differs(saved):
    path, _ = saved
    model = _model(seed=7)
    optim = torch.optim.AdamW(model.parameters())
    with pytest.raises(
        shardsafe.CheckpointError, match=r"checkpoint has 2 optimizer param group\(s\), the optimizer has 1"
    ):
        shardsafe.load_model_and_optim_state(path, model, optim)
    assert not optim.state


def test_parameter_moved_between_groups(saved):
    path, _ = saved
    model = _model(seed=7)
    moved = "norm.weight"
    g0 = [p for n, p in model.named_parameters() if "norm" not in n or n == moved]
    g1 = [p for n, p in model.named_parameters() if "norm" in n and n != moved]
    optim = torch.optim.AdamW([{"params": g0}, {"params": g1}])
    for validate in (True, False):  # a moved parameter is refused even without validation
        with pytest.raises(
            shardsafe.CheckpointError,
            match=r"param group 0 differs from the checkpoint's: parameters only in the optimizer \['norm.weight'\]",
        ):
            shardsafe.load_model_and_optim_state(path, model, optim, validate=validate)
    assert not optim.state


def test_optimizer_into_checkpoint_without_one(tmp_path):
    model = _model()
    shardsafe.save_model_and_optim_state(str(tmp_path), model)
    model2 = _model(seed=7)
    optim2 = _optim(model2, "adamw")
    with pytest.raises(
        shardsafe.CheckpointError, match="no optimizer state in the checkpoint.*saved with an optimizer"
    ):
        shardsafe.load_model_and_optim_state(str(tmp_path), model2, optim2)
    with pytest.raises(shardsafe.CheckpointError, match="no optimizer state in the checkpoint"):
        shardsafe.unshard_optim_state(str(tmp_path))
    shardsafe.load_model_and_optim_state(str(tmp_path), model2)  # the model alone loads
    _assert_same(model2.state_dict(), model.state_dict(), True, "model only")


def test_optimizer_of_another_class(saved):
    path, _ = saved  # AdamW state
    model = _model(seed=7)
    sgd = _optim(model, "sgd")
    with pytest.raises(
        shardsafe.CheckpointError,
        match=r"holds the state of a torch\.optim\.adamw\.AdamW optimizer, the target is a torch\.optim\.sgd\.SGD",
    ):
        shardsafe.load_model_and_optim_state(path, model, sgd)
    assert not sgd.state and sgd.param_groups[0]["lr"] == 1e-2  # untouched
    assert shardsafe.Checkpointer().get_metadata(path).objects["optim.class"] == "torch.optim.adamw.AdamW"


def test_optimizer_with_a_foreign_parameter(saved, tmp_path):
    path, _ = saved
    model = _model(seed=7)
    optim = _optim(model, "adamw")
    optim.add_param_group({"params": [torch.nn.Parameter(torch.zeros(7, 3))]})
    for call in (
        lambda: shardsafe.load_model_and_optim_state(path, model, optim),
        lambda: shardsafe.save_model_and_optim_state(str(tmp_path / "out"), model, optim),
    ):
        with pytest.raises(
            shardsafe.CheckpointError,
            match=r"param group 2 holds a parameter of shape \[7, 3\] that is not a parameter of the model",
        ):
            call()
    assert not (tmp_path / "out" / "metadata.json").exists()


def test_model_of_another_shape(saved):
    path, _ = saved
    from tiny_llama import Transformer

    model = Transformer(dataclasses.replace(_cfg(), vocab_size=128))
    with pytest.raises(
        shardsafe.ShapeMismatchError,
        match=r"'model.tok_embeddings.weight': checkpoint has global shape \[256, 64\], target has \[128, 64\]",
    ):
        shardsafe.load_model_and_optim_state(path, model)
    with pytest.raises(
        shardsafe.ShapeMismatchError,
        match=r"shape \[256, 64\] for parameter 'tok_embeddings.weight' of shape \[128, 64\]",
    ):
        shardsafe.load_model_and_optim_state(path, model, _optim(model, "adamw"))


def test_not_a_committed_checkpoint(tmp_path):
    model = _model()
    empty = tmp_path / "empty"
    empty.mkdir()
    interrupted = tmp_path / "interrupted"
    shardsafe.save_model_and_optim_state(str(interrupted), model)
    os.remove(interrupted / "metadata.json")  # the data is there, the commit is not
    for where, what in (
        (empty, "not a checkpoint: nothing is there (an empty directory, or no object under this prefix); a checkpoint holds metadata.json"),
        (tmp_path / "absent", "no such checkpoint: the directory does not exist (is the path mistyped?)"),
        (interrupted, r"not a committed checkpoint: it holds \d+ file\(s\) but has no metadata.json"),
    ):
        for call in (
            functools.partial(shardsafe.load_model_and_optim_state, str(where), model),
            functools.partial(shardsafe.unshard_model_state, str(where)),
            functools.partial(shardsafe.unshard_optim_state, str(where)),
        ):
            with pytest.raises(
                shardsafe.IncompleteCheckpointError, match=f"^{re.escape(str(where))}: {what}"
            ):
                call()


# --- 6. unshard in a plain process ------------------------------------------------------------


def test_unshard_in_plain_process(tmp_path):
    model, optim = _trained(opt="adam")
    shardsafe.save_model_and_optim_state(str(tmp_path), model, optim)
    full = shardsafe.unshard_model_state(str(tmp_path))
    want = model.state_dict()
    assert full.keys() == want.keys()  # clean names; rope_* (non-persistent) absent from both
    for k, v in want.items():
        assert full[k].dtype == v.dtype and torch.equal(full[k], v), k
    assert shardsafe.unshard_model_state(str(tmp_path), device="cpu").keys() == want.keys()

    osd = shardsafe.unshard_optim_state(str(tmp_path))
    name_of = {id(p): n for n, p in model.named_parameters()}
    names = [name_of[id(p)] for g in optim.param_groups for p in g["params"]]  # state_dict()'s integer ids
    sd = optim.state_dict()
    assert set(osd) == {"state", "param_groups"}
    assert set(osd["state"]) == set(names)
    for i, n in enumerate(names):
        assert osd["state"][n].keys() == sd["state"][i].keys()
        for k, v in sd["state"][i].items():
            assert osd["state"][n][k].dtype == v.dtype and torch.equal(osd["state"][n][k], v), (n, k)
    for got, g in zip(osd["param_groups"], sd["param_groups"], strict=True):
        assert got["params"] == [names[i] for i in g["params"]]
        assert {k: v for k, v in got.items() if k not in ("params", "betas")} == {
            k: v for k, v in g.items() if k not in ("params", "betas")
        }
        assert got["betas"] == list(g["betas"])  # JSON, as stored


# --- multi-rank: FSDP2 + DDP (ws2), then FSDP1 (ws2) ----------------------------------------


def _save_with_truth(rank, path, model, optim):
    """Save, and keep the full state (gathered with torch collectives) beside it for the parent."""
    truth = full_state(model, optim)
    shardsafe.save_model_and_optim_state(path, model, optim)
    if rank == 0:
        torch.save(truth, path + ".truth.pt")
    return truth


def _fsdp2_ddp_session(rank, ws, base):
    """FSDP2 + SGD: save, load in place, unshard with rank0_only and no_dist. DDP + Adam: save."""
    path = os.path.join(base, "fsdp2_sgd")
    model, optim = _trained("fsdp2", ws, "sgd")
    truth = _save_with_truth(rank, path, model, optim)

    _train_step(model, optim, 3)  # values move away from the checkpoint
    before, ids = _ptrs(model, optim), _state_ids(optim)
    assert all(hasattr(p, "to_local") for p in model.parameters())
    assert all(hasattr(st["momentum_buffer"], "to_local") for st in optim.state.values())
    shardsafe.load_model_and_optim_state(path, model, optim)
    _assert_same(full_state(model, optim), truth, True, f"fsdp2 rank {rank}: loaded in place")
    assert _ptrs(model, optim) == before and _state_ids(optim) == ids

    full_model = shardsafe.unshard_model_state(path, rank0_only=True)
    full_optim = shardsafe.unshard_optim_state(path, rank0_only=True)
    rank0_only = (len(full_model), len(full_optim))
    if rank == 0:
        _check_unsharded(full_model, full_optim, truth)
    else:
        assert full_model == {} and full_optim == {}
    _check_unsharded(
        shardsafe.unshard_model_state(path, no_dist=True), shardsafe.unshard_optim_state(path, no_dist=True), truth
    )

    path = os.path.join(base, "ddp_adam")
    model, optim = _trained("ddp", ws, "adam", steps=1)
    truth = _save_with_truth(rank, path, model, optim)
    return rank0_only


def _check_unsharded(full_model, full_optim, truth):
    """unshard_* results against full_state's truth, bit-exact, under clean names."""
    want_model = {k[len("model.") :]: v for k, v in truth.items() if k.startswith("model.")}
    assert full_model.keys() == want_model.keys()
    for k, v in want_model.items():
        assert full_model[k].dtype == v.dtype and torch.equal(full_model[k], v), k
    got = {f"optim.{n}.{s}": v for n, st in full_optim["state"].items() for s, v in st.items()}
    want = {k: v for k, v in truth.items() if k.startswith("optim.") and not k.startswith("optim.group")}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    for gi, g in enumerate(full_optim["param_groups"]):
        hp = {k: tuple(v) if k == "betas" else v for k, v in g.items() if k != "params"}
        assert hp == truth[f"optim.group{gi}"]


def _fsdp1_session(rank, ws, base):
    """FSDP1: use_orig_params=False refused; the FSDP2 and DDP checkpoints load into fresh
    optimizers; an FSDP1 checkpoint is saved, then loaded back in place."""
    from tiny_llama import Block, Transformer
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    flat = FullyShardedDataParallel(
        Transformer(_cfg()),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=False,
        device_id=torch.device("cpu"),
    )
    errors = []
    for call in (
        lambda: shardsafe.save_model_and_optim_state(os.path.join(base, "never"), flat),
        lambda: shardsafe.load_model_and_optim_state(os.path.join(base, "fsdp2_sgd"), flat),
    ):
        with pytest.raises(shardsafe.ShardingError, match=r"use_orig_params=False.*use_orig_params=True") as e:
            call()
        errors.append((type(e.value).__name__, str(e.value)))
    assert not os.path.exists(os.path.join(base, "never", "metadata.json"))

    for name, opt in (("fsdp2_sgd", "sgd"), ("ddp_adam", "adam")):
        path = os.path.join(base, name)
        truth = torch.load(path + ".truth.pt", weights_only=False)
        model = _model("fsdp1", ws, seed=7)
        optim = _optim(model, opt)
        assert not optim.state
        shardsafe.load_model_and_optim_state(path, model, optim)
        _assert_same(full_state(model, optim), truth, True, f"{name} -> fsdp1 rank {rank}")
        assert all(type(g.get("betas", ())) is tuple for g in optim.param_groups)

    path = os.path.join(base, "fsdp1_adamw")
    model, optim = _trained("fsdp1", ws, "adamw", steps=1)
    truth = _save_with_truth(rank, path, model, optim)
    _train_step(model, optim, 3)
    before, ids = _ptrs(model, optim), _state_ids(optim)
    shardsafe.load_model_and_optim_state(path, model, optim)
    _assert_same(full_state(model, optim), truth, True, f"fsdp1 rank {rank}: loaded in place")
    assert _ptrs(model, optim) == before and _state_ids(optim) == ids
    # no state_dict_type was needed, and none was left behind: FSDP1's default is untouched
    assert FullyShardedDataParallel.get_state_dict_type(model).state_dict_type == StateDictType.FULL_STATE_DICT
    return errors


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("multi"))
    rank0_only = run_ranks(2, _fsdp2_ddp_session, base)
    errors = run_ranks(2, _fsdp1_session, base)
    return base, rank0_only, errors


def test_multi_rank_fsdp2_in_place_and_unshard(sessions):
    _, rank0_only, _ = sessions
    n_model = len(_plain_names())
    assert rank0_only[0] == (n_model, 2) and rank0_only[1] == (0, 0)


def test_fsdp1_without_orig_params_is_refused(sessions):
    _, _, errors = sessions
    for per_rank in errors:
        assert [t for t, _ in per_rank] == ["ShardingError", "ShardingError"]
        assert all(
            "FSDP1 module '<root>' has use_orig_params=False" in m and "use_orig_params=True" in m for _, m in per_rank
        )


@pytest.mark.parametrize("name,opt", [("fsdp2_sgd", "sgd"), ("ddp_adam", "adam"), ("fsdp1_adamw", "adamw")])
def test_multi_rank_checkpoint_into_plain_process(sessions, name, opt):
    """ws2 (FSDP2 / DDP / FSDP1) -> one plain process with a fresh optimizer, and unshard_* there."""
    base, _, _ = sessions
    path = os.path.join(base, name)
    truth = torch.load(path + ".truth.pt", weights_only=False)
    model = _model(seed=7)
    optim = _optim(model, opt)
    shardsafe.load_model_and_optim_state(path, model, optim)
    _assert_same(full_state(model, optim), truth, True, f"{name} -> plain")
    if opt == "sgd":
        assert all(set(optim.state[p]) == {"momentum_buffer"} for p in model.parameters())
    assert all(type(g.get("betas", ())) is tuple for g in optim.param_groups)
    _check_unsharded(shardsafe.unshard_model_state(path), shardsafe.unshard_optim_state(path), truth)


def _read_with_safetensors(path, meta):
    """Every stored tensor reassembled from the data files with the official ``safe_open`` only."""
    whole = {k: torch.zeros(tm.shape, dtype=tm.torch_dtype) for k, tm in meta.tensors.items()}
    covered = {k: torch.zeros(tm.shape, dtype=torch.int32) for k, tm in meta.tensors.items()}
    for file in sorted(meta.data_files()):
        with safe_open(os.path.join(path, file), framework="pt") as f:
            entries = list(f.keys())
            assert SUMS_ENTRY in entries, f"{file}: no {SUMS_ENTRY} entry"  # v3: the block digests, not a tensor
            for entry in entries:
                if entry == SUMS_ENTRY:
                    continue
                t = f.get_tensor(entry)
                key, _, where = entry.partition("@")
                if not where:  # the whole tensor; FSDP1 stores it flattened (v3 names a whole flat range as the box)
                    assert t.shape == whole[key].shape or t.shape == (whole[key].numel(),), (entry, t.shape)
                    whole[key].copy_(t.reshape(whole[key].shape))
                    covered[key] += 1
                    continue
                offsets, _, start = where.partition("+")
                offsets = tuple(int(o) for o in offsets.split(",")) if offsets else ()
                if start:  # a flattened range of the whole tensor (FSDP1)
                    assert not any(offsets)
                    s = int(start)
                    whole[key].view(-1)[s : s + t.numel()] = t.reshape(-1)
                    covered[key].view(-1)[s : s + t.numel()] += 1
                else:  # a box at ``offsets``
                    box = tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))
                    whole[key][box] = t
                    covered[key][box] += 1
    for k, c in covered.items():
        assert bool((c == 1).all()), f"{k}: elements stored {c.min().item()}..{c.max().item()} times"
    return whole


@pytest.mark.parametrize("name,opt", [("ddp_adam", "adam"), ("fsdp1_adamw", "adamw"), ("fsdp2_sgd", "sgd")])
def test_stored_names_after_wrapped_saves(sessions, name, opt):
    base, _, _ = sessions
    path = os.path.join(base, name)
    meta = shardsafe.Checkpointer().get_metadata(path)
    keys = set(meta.tensors) | set(meta.objects)
    assert keys == _expected_keys(opt)  # the plain model's names, nothing else
    assert not [k for k in keys if any(w in k for w in WRAPPER_PARTS)]
    assert meta.pickled_objects == {}
    groups = meta.objects["optim.param_groups"]
    plain = [n for n, _ in _model().named_parameters()]
    assert [g["params"] for g in groups] == [[n for n in plain if "norm" not in n], [n for n in plain if "norm" in n]]
    assert all(type(n) is str for g in groups for n in g["params"])  # names, never integer ids

    truth = torch.load(path + ".truth.pt", weights_only=False)
    stored = _read_with_safetensors(path, meta)
    for key, t in stored.items():
        want = truth[key if key.startswith("model.") else "optim." + key[len("optim.state.") :]]
        assert t.dtype == want.dtype and torch.equal(t, want), key


# --- 7. wrapper names: activation checkpointing, torch.compile -------------------------------


def _wrap(model, how):
    if how == "checkpoint_wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
        assert any("_checkpoint_wrapped_module." in n for n, _ in model.named_parameters())
        return model
    # eager backend: dynamo traces and wraps (the names are the same for every backend) in
    # seconds, where inductor compiles C++ for a minute on this CPU
    wrapped = torch.compile(model, backend="eager")
    assert all(n.startswith("_orig_mod.") for n, _ in wrapped.named_parameters())
    return wrapped


@pytest.mark.parametrize("how", ["checkpoint_wrapper", "compile"])
def test_wrapped_model_saves_plain_names(tmp_path, how, saved):
    model = _wrap(_model(), how)
    optim = _optim(model, "adamw")
    for s in range(2):
        _train_step(model, optim, s)
    _retune(optim)
    truth = full_state(model, optim)
    shardsafe.save_model_and_optim_state(str(tmp_path), model, optim)
    meta = shardsafe.Checkpointer().get_metadata(str(tmp_path))
    plain_meta = shardsafe.Checkpointer().get_metadata(saved[0])
    assert (
        set(meta.tensors) == set(plain_meta.tensors)
        and meta.objects["optim.param_groups"][0]["params"] == plain_meta.objects["optim.param_groups"][0]["params"]
    )
    _assert_same(truth, saved[1], True, f"{how}: trains as the plain model")  # the same training, so the same values

    plain = _model(seed=7)
    plain_optim = _optim(plain, "adamw")
    shardsafe.load_model_and_optim_state(str(tmp_path), plain, plain_optim)
    _assert_same(full_state(plain, plain_optim), truth, True, f"{how} -> plain")
    again = _wrap(_model(seed=7), how)  # and the plain checkpoint loads into the wrapped model
    again_optim = _optim(again, "adamw")
    shardsafe.load_model_and_optim_state(saved[0], again, again_optim)
    _assert_same(full_state(again, again_optim), saved[1], True, f"plain -> {how}")
    if how == "compile":
        torch._dynamo.reset()


# --- 8. tied weights ---------------------------------------------------------------------------


def _tied(seed):
    model = _model(seed=seed)
    model.output.weight = model.tok_embeddings.weight
    return model


def test_tied_weights_saved_once_and_stay_tied(tmp_path):
    model = _tied(0)
    optim = _optim(model, "adamw")
    _train_step(model, optim, 0)
    truth = full_state(model, optim)
    shardsafe.save_model_and_optim_state(str(tmp_path), model, optim)
    meta = shardsafe.Checkpointer().get_metadata(str(tmp_path))
    assert "model.tok_embeddings.weight" in meta.tensors
    assert not [k for k in meta.tensors if "output.weight" in k]  # once, under its first name

    model2 = _tied(7)
    optim2 = _optim(model2, "adamw")
    shardsafe.load_model_and_optim_state(str(tmp_path), model2, optim2)
    assert model2.output.weight is model2.tok_embeddings.weight
    _assert_same(full_state(model2, optim2), truth, True, "tied")
    assert torch.equal(model2.output.weight, truth["model.tok_embeddings.weight"])

    with pytest.raises(shardsafe.MissingKeyError, match=r"\['output.weight'\]"):
        shardsafe.load_model_and_optim_state(str(tmp_path), _model(seed=7))  # an untied model needs both


# --- 9. refusals at the entry points: nothing to unshard, URLs with one slash, wrong types ---------


def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_unshard_of_a_prefix_no_key_starts_with_is_refused(tmp_path):
    d = str(tmp_path / "ckpt")
    shardsafe.Checkpointer().save(d, {"w": torch.ones(2), "step": 3})  # no model, no optimizer
    with pytest.raises(
        shardsafe.MissingKeyError,
        match=rf"{d}: no model state in the checkpoint .*: {d}: no key starts with 'model\.'; the checkpoint holds 2 key\(s\), such as \['step', 'w'\]",
    ):
        shardsafe.unshard_model_state(d)
    with pytest.raises(shardsafe.MissingKeyError, match=r"no optimizer state in the checkpoint .*no key starts with 'optim\.'"):
        shardsafe.unshard_optim_state(d)
    with pytest.raises(shardsafe.MissingKeyError, match=r"no key starts with 'layers\.'"):
        shardsafe.Checkpointer().unshard(d, no_dist=True, prefix="layers.")
    out = shardsafe.Checkpointer().unshard(d, no_dist=True, prefix="w")
    assert list(out) == [""] and torch.equal(out[""], torch.ones(2))


@pytest.mark.parametrize("url", ["s3:/bucket/ckpt", "gs:/bucket/ckpt", "file:/tmp/ckpt", "memory:/x"])
def test_a_url_with_one_slash_is_refused_not_made_a_local_directory(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    scheme, rest = url.split(":/", 1)
    fixed = f"{scheme}://{'/' if scheme == 'file' else ''}{rest}"
    pattern = rf"{url}(/model\.safetensors)?: looks like a URL with one slash after '{scheme}:'; did you mean '{fixed}(/model\.safetensors)?'\?"
    model, optim = _tiny()
    d = str(tmp_path / "ckpt")
    shardsafe.save_model_and_optim_state(d, model, optim)
    for call in (
        lambda: shardsafe.save_model_and_optim_state(url, model, optim),
        lambda: shardsafe.load_model_and_optim_state(url, model, optim),
        lambda: shardsafe.unshard_model_state(url),
        lambda: shardsafe.verify(url),
        lambda: shardsafe.unshard_to_safetensors(d, url + "/model.safetensors"),
        lambda: shardsafe.unshard_to_safetensors(url, tmp_path / "model.safetensors"),
    ):
        with pytest.raises(shardsafe.StorageError, match=pattern):
            call()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_unshard_to_safetensors_writes_to_a_url(tmp_path):
    from safetensors.torch import load

    model, optim = _tiny()
    d = str(tmp_path / "ckpt")
    shardsafe.save_model_and_optim_state(d, model, optim)
    out = f"memory://export-{os.getpid()}-{id(tmp_path)}"
    summary = shardsafe.unshard_to_safetensors(d, f"{out}/model.safetensors", prefix="model.")
    store = shardsafe.storage.open_storage(out)
    exported = load(store.read("model.safetensors"))
    assert summary["tensors"] == 4 and exported.keys() == model.state_dict().keys()
    for name, want in model.state_dict().items():
        assert torch.equal(exported[name].view(torch.uint8), want.view(torch.uint8)), name
    with pytest.raises(shardsafe.CheckpointExistsError, match=rf"{out}/model\.safetensors: object exists"):
        shardsafe.unshard_to_safetensors(d, f"{out}/model.safetensors", prefix="model.")
    shardsafe.unshard_to_safetensors(d, f"{out}/model.safetensors", overwrite=True)  # everything, replaced
    assert set(load(store.read("model.safetensors"))) == {f"model.{n}" for n in model.state_dict()}
    with pytest.raises(shardsafe.StorageError, match=r"an output URL needs a file name"):
        shardsafe.unshard_to_safetensors(d, f"{out}/", overwrite=True)


def test_unshard_to_safetensors_writes_to_an_object_store(tmp_path, monkeypatch):
    from safetensors.torch import load

    from .servers import cloud

    c = cloud("s3")
    for k, v in c.env.items():
        monkeypatch.setenv(k, v)
    model, optim = _tiny()
    d = str(tmp_path / "ckpt")
    shardsafe.save_model_and_optim_state(d, model, optim)
    url = c.url()
    shardsafe.unshard_to_safetensors(d, f"{url}/model.safetensors", prefix="model.")
    exported = load(shardsafe.storage.open_storage(url).read("model.safetensors"))
    for name, want in model.state_dict().items():
        assert torch.equal(exported[name].view(torch.uint8), want.view(torch.uint8)), name
    assert not (tmp_path / "s3:").exists() and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_public_arguments_of_the_wrong_type_are_named(tmp_path):
    model, optim = _tiny()
    d = str(tmp_path / "ckpt")
    shardsafe.save_model_and_optim_state(d, model, optim)
    cases = [
        (lambda: shardsafe.load_model_and_optim_state(d, model, optim, validate="no"),
         r"load_model_and_optim_state: argument 'validate' must be True or False, got str 'no'"),
        (lambda: shardsafe.save_model_and_optim_state(d, model.state_dict()),
         r"save_model_and_optim_state: argument 'model' must be a torch\.Module, got .*OrderedDict \(a state dict\? pass the module itself"),
        (lambda: shardsafe.load_model_and_optim_state(d, optim),
         r"argument 'model' must be a torch\.Module, got torch\.optim\.sgd\.SGD \(an optimizer\? the model comes first"),
        (lambda: shardsafe.load_model_and_optim_state(d, model, model),
         r"argument 'optim' must be a torch\.Optimizer or None, got torch\.nn\.modules\.container\.Sequential \(a model\?"),
        (lambda: shardsafe.save_model_and_optim_state(d, model, optim, save_overwrite="yes"),
         r"argument 'save_overwrite' must be True or False"),
        (lambda: shardsafe.Checkpointer().save(d, [torch.ones(1)]), r"Checkpointer\.save: argument 'state_dict' must be a dict, got list"),
        (lambda: shardsafe.Checkpointer().load(d, {}, no_dist="yes"), r"Checkpointer\.load: argument 'no_dist' must be True or False"),
        (lambda: shardsafe.Checkpointer(allow_pickle=1), r"Checkpointer: argument 'allow_pickle' must be True or False, got int 1"),
        (lambda: shardsafe.Checkpointer().unshard(d, rank0_only=None), r"Checkpointer\.unshard: argument 'rank0_only'"),
        (lambda: shardsafe.unshard_model_state(d, device=0), r"unshard_model_state: argument 'device' must be a torch\.device or str or None, got int 0"),
        (lambda: shardsafe.verify(d, collect_all="all"), r"verify: argument 'collect_all' must be True or False"),
        (lambda: shardsafe.unshard_to_safetensors(d, tmp_path / "o.safetensors", overwrite="no"), r"unshard_to_safetensors: argument 'overwrite'"),
        (lambda: shardsafe.Checkpointer().save({"w": torch.ones(1)}, {}), r"open_storage: argument 'location' must be a path, a URL or a Storage, got dict"),
    ]
    for call, pattern in cases:
        with pytest.raises(TypeError, match=pattern):
            call()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_missing_model_state_names_the_url_of_an_opened_storage(tmp_path):
    from shardsafe.storage import open_storage

    d = str(tmp_path / "c")
    shardsafe.Checkpointer().save(d, {"w": torch.ones(2), "step": 1})
    storage = open_storage(d)
    with pytest.raises(shardsafe.MissingKeyError, match=rf"^{storage.url}: no model state in the checkpoint") as info:
        shardsafe.unshard_model_state(storage)
    assert "object at 0x" not in str(info.value)
