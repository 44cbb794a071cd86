"""save/load_model_and_optim_state across every parallelism: the cross-topology matrix.

Each source wrapping trains one AdamW step on the same model and batch, records its full state
with torch collectives only (``full_state``: DTensor.full_tensor, an all-gather of FSDP1 flat
parts; nothing of shardsafe's reader), and saves. Each destination wrapping then loads every
source's checkpoint into a fresh model and a fresh optimizer (no state yet) and checks, against
an unsharded reference built from that recorded state:
- every parameter, buffer and optimizer state tensor, and every param group: bit-exact;
- the logits on a fixed batch and the state after one more optimizer step: bit-exact where the
  destination computes in the reference's order, and to float32 rounding where it cannot
  (tensor parallel splits matmul reductions; data parallel averages gradients over ranks).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from .distributed import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

# one worker runs the whole module, so its module-scoped checkpoints are made once
pytestmark = pytest.mark.xdist_group("api_matrix")

TOPOLOGIES = [("plain", 1), ("ddp", 2), ("fsdp2", 2), ("fsdp2", 4), ("hsdp", 4), ("tp", 2), ("fsdp2_tp", 4), ("fsdp1", 2)]
# destinations whose forward/backward runs in the reference's float order (logits and a
# gradient step are bit-exact there); the others split reductions and match to rounding
EXACT_COMPUTE = {("plain", 1), ("ddp", 2), ("fsdp2", 2), ("fsdp1", 2)}


def _cfg():
    from tiny_llama import LlamaConfig

    return LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=172, max_seq_len=32)


def full_state(model, optim) -> dict[str, torch.Tensor | object]:
    """Name -> full tensor of every parameter, buffer and optimizer state, gathered with torch
    collectives (collective: every rank calls it), and the param groups."""
    import torch.distributed as dist

    from shardsafe.adapters.modules import model_state

    params, buffers = model_state(model)
    out: dict = {}

    def full(info, t):
        if hasattr(t, "full_tensor"):
            return t.full_tensor().clone()
        if info.flat is None or not dist.is_initialized():
            return t.detach().clone()
        shape, start, stop = info.flat
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (start, stop, t.detach().reshape(-1).clone()))
        whole = torch.empty(shape, dtype=t.dtype).reshape(-1)
        for s, e, piece in parts:
            whole[s:e] = piece
        return whole.reshape(shape)

    for info in [*params, *buffers]:
        out[f"model.{info.fqn}"] = full(info, info.tensor)
    if optim is None:
        return out
    by_id = {id(i.tensor): i for i in params}
    for gi, group in enumerate(optim.param_groups):
        for p in group["params"]:
            info = by_id[id(p)]
            st = optim.state.get(p, {})
            kinds = {n: (v.dim() == 0 and type(v) is torch.Tensor, v.dtype) for n, v in st.items()}
            if dist.is_initialized():  # FSDP1 ranks without a part of p hold no state for it
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, kinds)
                kinds = {n: k for ks in every for n, k in ks.items()}
            for name in sorted(kinds):
                scalar, dtype = kinds[name]
                v = st.get(name)
                if scalar:
                    if dist.is_initialized():
                        vals = [None] * dist.get_world_size()
                        dist.all_gather_object(vals, None if v is None else v.clone())
                        v = next(x for x in vals if x is not None)
                    out[f"optim.{info.fqn}.{name}"] = v.clone()
                else:
                    out[f"optim.{info.fqn}.{name}"] = full(info, torch.empty(0, dtype=dtype) if v is None else v)
        out[f"optim.group{gi}"] = {k: v for k, v in group.items() if k != "params"}
    return out


def _build(kind, ws, seed):
    from tiny_llama import Transformer, make_optimizer, parallelize

    torch.manual_seed(0)
    model = parallelize(Transformer(_cfg(), seed=seed), kind, ws)
    return model, make_optimizer(model, "adamw")


def _train_step(model, optim, step):
    from tiny_llama import batch, loss_fn

    x, y = batch(_cfg(), step)
    logits = model(x)
    loss = loss_fn(logits, y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return logits.detach()


def _save_source(rank, ws, kind, path, truth_path):
    import shardsafe

    model, optim = _build(kind, ws, seed=0)
    _train_step(model, optim, 0)
    truth = full_state(model, optim)
    files = shardsafe.save_model_and_optim_state(path, model, optim)
    if rank == 0:
        torch.save(truth, truth_path)
    return [os.path.basename(f) for f in files]


def _reference(truth):
    """An unsharded model + optimizer holding ``truth``, set through torch's own APIs."""
    model, optim = _build("plain", 1, seed=99)
    sd = {k[len("model."):]: v for k, v in truth.items() if k.startswith("model.")}
    model.load_state_dict(sd, strict=True)
    names = [n for n, _ in model.named_parameters()]
    state = {}
    for i, n in enumerate(names):
        st = {k.rsplit(".", 1)[1]: v.clone() for k, v in truth.items() if k.startswith(f"optim.{n}.") and k.count(".") == n.count(".") + 2}
        if st:
            state[i] = st
    groups = []
    ids = {n: i for i, n in enumerate(names)}
    for gi, group in enumerate(optim.param_groups):
        g = dict(truth[f"optim.group{gi}"])
        g["params"] = [ids[n] for n, p in model.named_parameters() if any(p is q for q in group["params"])]
        groups.append(g)
    optim.load_state_dict({"state": state, "param_groups": groups})
    return model, optim


def _assert_same(got, want, exact, what):
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    for k, w in want.items():
        g = got[k]
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.shape == w.shape, (what, k, g.dtype, w.dtype, g.shape, w.shape)
            if exact:
                assert torch.equal(g, w), f"{what}: {k} differs, max abs diff {(g.double() - w.double()).abs().max()}"
            else:
                torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-6, msg=lambda m, k=k: f"{what}: {k}: {m}")
        else:
            assert g == w, (what, k, g, w)


def _load_all(rank, ws, kind, sources):
    import shardsafe

    exact_compute = (kind, ws) in EXACT_COMPUTE
    checked = []
    for name, path, truth_path in sources:
        truth = torch.load(truth_path, weights_only=False)
        model, optim = _build(kind, ws, seed=7)  # different values, no optimizer state
        assert not optim.state
        shardsafe.load_model_and_optim_state(path, model, optim)
        _assert_same(full_state(model, optim), truth, True, f"{name} -> {kind} ws{ws}: loaded state")
        ref_model, ref_optim = _reference(truth)
        logits = _train_step(model, optim, 1)
        ref_logits = _train_step(ref_model, ref_optim, 1)
        after, ref_after = full_state(model, optim), full_state(ref_model, ref_optim)
        _assert_same({"logits": logits}, {"logits": ref_logits}, exact_compute, f"{name} -> {kind} ws{ws}: logits")
        _assert_same(after, ref_after, exact_compute, f"{name} -> {kind} ws{ws}: state after a step")
        checked.append(name)
    return checked


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("sources")
    out = []
    for kind, ws in TOPOLOGIES:
        name = f"{kind}-ws{ws}"
        path, truth = str(base / name), str(base / f"{name}.truth.pt")
        files = run_ranks(ws, _save_source, kind, path, truth)
        assert all(len(f) <= 1 for f in files)
        out.append((name, path, truth))
    return out


@pytest.mark.parametrize("kind,ws", TOPOLOGIES, ids=[f"{k}-ws{w}" for k, w in TOPOLOGIES])
def test_every_source_loads_into(kind, ws, sources):
    results = run_ranks(ws, _load_all, kind, sources, timeout=300)
    assert results == [[name for name, _, _ in sources]] * ws
