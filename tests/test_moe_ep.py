"""Expert-parallel MoE in DTensor form, as torchtitan lays it out (issue 25): grouped expert
weights ``[experts, in, out]`` sharded over an EP mesh dimension (dim 0) and FSDP over another
(dim 1), saved at EP 4 and loaded at EP 2 x FSDP 2, at EP 1 (FSDP 2 only) and into a dense model
in one process, bit-exact, AdamW state included. The reference is the same steps taken on whole
tensors in one process: AdamW is elementwise, so every layout computes the same bits."""

from __future__ import annotations

import torch

import shardsafe

from .helpers import assert_bits, full_tensor, run_ranks

E, DIM, HIDDEN = 8, 16, 24
SHAPES = {"w1": (E, DIM, HIDDEN), "w2": (E, HIDDEN, DIM), "w3": (E, DIM, HIDDEN), "router": (E, DIM)}
STEPS = 2


class GroupedExperts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, shape in SHAPES.items():
            setattr(self, name, torch.nn.Parameter(torch.zeros(shape)))


def _grad(name: str, step: int) -> torch.Tensor:
    return full_tensor(f"grad.{name}.{step}", SHAPES[name])


def _placements(layout: str):
    from torch.distributed.tensor import Replicate, Shard

    return {
        "ep4": ((4,), {"w": [Shard(0)], "router": [Replicate()]}),
        "ep2_fsdp2": ((2, 2), {"w": [Shard(1), Shard(0)], "router": [Shard(0), Replicate()]}),  # mesh (fsdp, ep)
        "ep1_fsdp2": ((2,), {"w": [Shard(0)], "router": [Shard(0)]}),
    }[layout]


def _model(layout: str | None):
    m = GroupedExperts()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(full_tensor(f"init.{name}", SHAPES[name]))
    if layout is None:
        return m, None
    from torch.distributed.tensor import distribute_tensor, init_device_mesh

    mesh_shape, placements = _placements(layout)
    mesh = init_device_mesh("cpu", mesh_shape)
    for name, p in list(m.named_parameters()):
        kind = "router" if name == "router" else "w"
        setattr(m, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, placements[kind])))
    return m, (mesh, placements)


def _train(m, sharding) -> torch.optim.Optimizer:
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for step in range(STEPS):
        for name, p in m.named_parameters():
            g = _grad(name, step)
            if sharding is not None:
                from torch.distributed.tensor import distribute_tensor

                mesh, placements = sharding
                g = distribute_tensor(g, mesh, placements["router" if name == "router" else "w"])
            p.grad = g
        o.step()
    return o


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    m, _ = _model(None)
    o = _train(m, None)
    params = {n: p.detach().clone() for n, p in m.named_parameters()}
    state = {f"{n}.{s}": v.clone() for n, p in m.named_parameters() for s, v in o.state[p].items()}
    return params, state


def _save_ep4(rank, world, path):
    m, sharding = _model("ep4")
    o = _train(m, sharding)
    shardsafe.save_model_and_optim_state(path, m, o)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def _load(rank, world, path, layout):
    """Load into ``layout`` (None: a dense model, whole tensors, no process group) and compare
    with the whole-tensor run."""
    m, _ = _model(layout)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    shardsafe.load_model_and_optim_state(path, m, o)
    params, state = _reference()
    for name, p in m.named_parameters():
        assert_bits(_whole(p), params[name], f"{layout} {name}")
        for s, v in o.state[p].items():
            assert_bits(_whole(v), state[f"{name}.{s}"], f"{layout} {name}.{s}")
    return True


def test_moe_saved_at_ep4_loads_at_ep2_ep1_and_dense_bit_exact(tmp_path):
    path = str(tmp_path / "ep4")
    run_ranks(4, _save_ep4, path)
    assert run_ranks(4, _load, path, "ep2_fsdp2") == [True] * 4
    assert run_ranks(2, _load, path, "ep1_fsdp2") == [True] * 2
    assert _load(0, 1, path, None)  # a dense model in this process


def _load_megatron_boxes(rank, world, path):
    """The experts as Megatron lays them out: each EP rank a ShardedTensor box of whole experts."""
    per = E // world
    targets = {}
    for name in ("w1", "w2", "w3"):
        shape = SHAPES[name]
        local = torch.zeros((per, *shape[1:]))
        targets[f"model.{name}"] = shardsafe.ShardedTensor(f"model.{name}", local, shape, (rank * per, 0, 0), local.shape)
    shardsafe.Checkpointer().load(path, targets)
    params, _ = _reference()
    for name in ("w1", "w2", "w3"):
        assert_bits(targets[f"model.{name}"].data, params[name][rank * per : (rank + 1) * per], f"megatron box {name}")
    return True


def test_moe_saved_as_dtensors_loads_into_megatron_style_expert_boxes(tmp_path):
    """DTensor (torchtitan) and ShardedTensor (Megatron) experts are the same boxes of one tensor."""
    path = str(tmp_path / "ep4")
    run_ranks(4, _save_ep4, path)
    assert run_ranks(2, _load_megatron_boxes, path) == [True, True]
