"""save/load_model_and_optim_state across every parallelism: the cross-topology matrix.

Each source wrapping trains one AdamW step on the same model and batch, records its full state
with torch collectives only (``full_state``: DTensor.full_tensor, an all-gather of FSDP1 flat
parts; nothing of shardsafe's reader), and saves. Each destination wrapping then loads every
source's checkpoint into a fresh model and a fresh optimizer (no state yet) and checks, against
an unsharded reference built from that recorded state (its step computed once, with the source):
- every parameter, buffer and optimizer state tensor, and every param group: bit-exact;
- the logits on a fixed batch and the state after one more optimizer step: bit-exact where the
  destination computes in the reference's order, and to float32 rounding where it cannot
  (tensor parallel splits matmul reductions; data parallel averages gradients over ranks).
"""

from __future__ import annotations

import os

import pytest
import torch

from .helpers import built_once, run_ranks
from .training import assert_states_match, build, full_state, train_step

# one worker runs the whole module (the sources are built once per run wherever they are used)
pytestmark = pytest.mark.xdist_group("api_matrix")

TOPOLOGIES = [("plain", 1), ("ddp", 2), ("fsdp2", 2), ("fsdp2", 4), ("hsdp", 4), ("tp", 2), ("fsdp2_tp", 4), ("fsdp1", 2)]
# destinations whose forward/backward runs in the reference's float order (logits and a
# gradient step are bit-exact there); the others split reductions and match to rounding
EXACT_COMPUTE = {("plain", 1), ("ddp", 2), ("fsdp2", 2), ("fsdp1", 2)}


def _save_sources(rank, ws, base):
    """Every source wrapping at world size ``ws``, one after another in these ranks (one spawn per
    world size, not one per source)."""
    import shardsafe

    files = {}
    for kind, kind_ws in TOPOLOGIES:
        if kind_ws != ws:
            continue
        name = f"{kind}-ws{ws}"
        model, optim = build(kind, ws, seed=0)
        train_step(model, optim, 0)
        truth = full_state(model, optim)
        written = shardsafe.save_model_and_optim_state(os.path.join(base, name), model, optim)
        # what every destination compares with after its step: the unsharded reference's logits
        # and state after one more step, computed once here (single-threaded, as in any rank)
        ref_model, ref_optim = _reference(truth)
        ref_logits = train_step(ref_model, ref_optim, 1)
        ref_after = full_state(ref_model, ref_optim)
        if rank == 0:
            torch.save(truth, os.path.join(base, f"{name}.truth.pt"))
            torch.save({"logits": ref_logits, "after": ref_after}, os.path.join(base, f"{name}.reference.pt"))
        files[name] = [os.path.basename(f) for f in written]
    return files


def _build_sources(base):
    os.makedirs(base)
    for ws in sorted({ws for _, ws in TOPOLOGIES}):
        for files in run_ranks(ws, _save_sources, base):
            assert len(files) == sum(w == ws for _, w in TOPOLOGIES)
            assert all(len(f) <= 1 for f in files.values())


def _reference(truth):
    """An unsharded model + optimizer holding ``truth``, set through torch's own APIs."""
    model, optim = build("plain", 1, seed=99)
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


def _load_all(rank, ws, kind, sources):
    import shardsafe

    exact_compute = (kind, ws) in EXACT_COMPUTE
    checked = []
    for name, path, truth_path in sources:
        truth = torch.load(truth_path, weights_only=False)
        reference = torch.load(truth_path.replace(".truth.pt", ".reference.pt"), weights_only=False)
        model, optim = build(kind, ws, seed=7)  # different values, no optimizer state
        assert not optim.state
        shardsafe.load_model_and_optim_state(path, model, optim)
        assert_states_match(full_state(model, optim), truth, True, f"{name} -> {kind} ws{ws}: loaded state")
        logits = train_step(model, optim, 1)
        ref_logits, ref_after = reference["logits"], reference["after"]
        after = full_state(model, optim)
        assert_states_match({"logits": logits}, {"logits": ref_logits}, exact_compute, f"{name} -> {kind} ws{ws}: logits")
        assert_states_match(after, ref_after, exact_compute, f"{name} -> {kind} ws{ws}: state after a step")
        checked.append(name)
    return checked


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Every source's checkpoint and recorded state, built once per test run: xdist tears module
    fixtures down when a worker's queue runs dry, and a rebuild cost a minute."""
    base = built_once(tmp_path_factory, "api-sources", _build_sources)
    return [(f"{k}-ws{w}", os.path.join(base, f"{k}-ws{w}"), os.path.join(base, f"{k}-ws{w}.truth.pt")) for k, w in TOPOLOGIES]


@pytest.mark.parametrize("kind,ws", TOPOLOGIES, ids=[f"{k}-ws{w}" for k, w in TOPOLOGIES])
def test_every_source_loads_into(kind, ws, sources):
    results = run_ranks(ws, _load_all, kind, sources, timeout=300)
    assert results == [[name for name, _, _ in sources]] * ws
