"""The small Llama (``examples/tiny_llama.py``) that the API tests train, save and load under every
parallelism, and what they compare: the full state gathered with torch collectives only."""

from __future__ import annotations

import torch

__all__ = ["assert_states_match", "build", "full_state", "llama_cfg", "train_step"]


def llama_cfg():
    from examples.tiny_llama import LlamaConfig

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
    entries = [p for group in optim.param_groups for p in group["params"]]
    states = [optim.state.get(p, {}) for p in entries]
    # each state's kinds, and its scalars' values, from every rank in one collective each (FSDP1
    # ranks without a part of p hold no state for it); one gather per parameter cost a hundred
    # round trips a call
    kinds = [{n: (v.dim() == 0 and type(v) is torch.Tensor, v.dtype) for n, v in st.items()} for st in states]
    scalars = [{n: st[n].clone() for n, (scalar, _) in ks.items() if scalar} for st, ks in zip(states, kinds)]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (kinds, scalars))
        kinds = [{n: k for ks, _ in every for n, k in ks[i].items()} for i in range(len(entries))]
        scalars = [{n: v for _, sc in reversed(every) for n, v in sc[i].items()} for i in range(len(entries))]  # the lowest rank's
    i = 0
    for gi, group in enumerate(optim.param_groups):
        for p in group["params"]:
            info, st = by_id[id(p)], states[i]
            for name in sorted(kinds[i]):
                scalar, dtype = kinds[i][name]
                if scalar:
                    out[f"optim.{info.fqn}.{name}"] = scalars[i][name].clone()
                else:
                    v = st.get(name)
                    out[f"optim.{info.fqn}.{name}"] = full(info, torch.empty(0, dtype=dtype) if v is None else v)
            i += 1
        out[f"optim.group{gi}"] = {k: v for k, v in group.items() if k != "params"}
    return out


def build(kind, ws, seed):
    from examples.tiny_llama import Transformer, make_optimizer, parallelize

    torch.manual_seed(0)
    model = parallelize(Transformer(llama_cfg(), seed=seed), kind, ws)
    return model, make_optimizer(model, "adamw")


def train_step(model, optim, step):
    from examples.tiny_llama import batch, loss_fn

    x, y = batch(llama_cfg(), step)
    logits = model(x)
    loss = loss_fn(logits, y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return logits.detach()


def assert_states_match(got, want, exact, what):
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
