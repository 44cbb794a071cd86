"""Training resume: K steps uninterrupted vs. save at step k, resume in another world size and
parallelism, continue. The losses after the resume are those of the uninterrupted run."""

from __future__ import annotations

import json
import os

import pytest
import torch

from .helpers import built_once, run_ranks

# one worker runs the whole module, so its module-scoped checkpoints are made once
pytestmark = pytest.mark.xdist_group("resume")

K, SAVE_AT = 6, 3


def _cfg():
    from examples.tiny_llama import LlamaConfig

    return LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=172, max_seq_len=32)


def _run(rank, ws, kind, steps, load_from, save_to, split):
    from examples.tiny_llama import Transformer, make_optimizer, parallelize, train

    import shardsafe

    model = parallelize(Transformer(_cfg(), seed=0 if load_from is None else 1), kind, ws)
    optim = make_optimizer(model, "adamw")
    if load_from is not None:
        shardsafe.load_model_and_optim_state(load_from, model, optim)
    losses = train(model, optim, _cfg(), range(*steps), kind, split_batch=split)
    if save_to is not None:
        shardsafe.save_model_and_optim_state(save_to, model, optim)
    return losses


def _losses(kind, ws, steps, load_from=None, save_to=None, split=True):
    per_rank = run_ranks(ws, _run, kind, steps, load_from, save_to, split)
    assert all(r == per_rank[0] for r in per_rank), per_rank  # every rank reports the global loss
    return per_rank[0]


def test_resume_in_another_parallelism_is_bit_exact(tmp_path):
    """Every rank sees the whole batch, so FSDP2, FSDP1 and DDP at ws2 compute in the same float
    order: the resumed losses are bit-identical to the uninterrupted run's."""
    full = _losses("fsdp2", 2, (0, K), split=False)
    ckpt = str(tmp_path / "step3")
    head = _losses("fsdp2", 2, (0, SAVE_AT), save_to=ckpt, split=False)
    assert head == full[:SAVE_AT]
    for kind in ("fsdp1", "ddp"):
        tail = _losses(kind, 2, (SAVE_AT, K), load_from=ckpt, split=False)
        assert tail == full[SAVE_AT:], (kind, tail, full[SAVE_AT:])
    assert full[-1] < full[0]  # it trains


def _fsdp2_run(base):
    os.makedirs(base)
    full = _losses("fsdp2", 2, (0, K))
    assert _losses("fsdp2", 2, (0, SAVE_AT), save_to=os.path.join(base, "step3")) == full[:SAVE_AT]
    with open(os.path.join(base, "losses.json"), "w") as f:
        json.dump(full, f)


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """FSDP2 on 2 ranks with real data parallelism: K uninterrupted losses, and a checkpoint at k;
    built once per test run (xdist tears module fixtures down when a worker's queue runs dry)."""
    base = built_once(tmp_path_factory, "resume-fsdp2", _fsdp2_run)
    with open(os.path.join(base, "losses.json")) as f:
        return json.load(f), os.path.join(base, "step3")


@pytest.mark.parametrize("kind,ws", [("plain", 1), ("fsdp2", 4), ("fsdp2_tp", 4)])
def test_resume_resharded_data_parallel(fsdp2_run, kind, ws):
    """Each rank trains on its slice of the batch; saved by FSDP2 on 2 ranks, resumed on another
    world size and wrapping: the same losses up to float32 reduction order."""
    full, ckpt = fsdp2_run
    tail = _losses(kind, ws, (SAVE_AT, K), load_from=ckpt)
    torch.testing.assert_close(torch.tensor(tail), torch.tensor(full[SAVE_AT:]), rtol=1e-5, atol=0)
    fresh = _losses(kind, ws, (SAVE_AT, K))  # the same steps without the checkpoint differ
    assert abs(fresh[0] - tail[0]) > 1e-3
