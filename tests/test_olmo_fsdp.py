"""OLMo-core's own FSDP (``olmo_core.distributed.fsdp.FSDP``): its wrapper part
``_fsdp_wrapped_module.`` is left out of the checkpoint's names, as torch's FSDP's is, so a
checkpoint of it loads into any other wrapping: OLMo FSDP -> FSDP2 -> plain, bit-exact, model and
optimizer.

ai2-olmo-core cannot be installed here (not in the package index this project installs from;
its FSDP is gone from later releases), so the wrapper is :class:`tests.olmo_flat.FSDP`: the same
class name, child name and ``ShardedFlatParameter`` parameters as OLMo-core 0.1.0's.
"""

from __future__ import annotations

import os

import torch

import shardsafe
from tests.helpers import run_ranks


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))  # 15 + 3 + 6 + 2 elements


def _trained() -> torch.nn.Module:
    """What one SGD step (lr 0.25, every gradient one) makes of ``_model(0)``."""
    model = _model(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.ones_like(p), alpha=-0.25)
    return model


def _olmo_save(rank: int, ws: int, path: str) -> list[str]:
    from tests.olmo_flat import FSDP

    model = FSDP(_model(0))
    optim = torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    shardsafe.save_model_and_optim_state(path, model, optim)
    return [name for name, _ in model.named_parameters()]


def _fsdp2_load_and_save(rank: int, ws: int, src: str, dst: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(1)
    mesh = init_device_mesh("cpu", (ws,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0)
    shardsafe.load_model_and_optim_state(src, model, optim)
    want = dict(_trained().named_parameters())
    same = all(torch.equal(p.full_tensor(), want[name].detach()) for name, p in model.named_parameters())
    same = same and all(torch.equal(optim.state[p]["momentum_buffer"].full_tensor(), torch.ones(p.shape)) for p in model.parameters())
    shardsafe.save_model_and_optim_state(dst, model, optim)
    return same


def test_olmo_fsdp_names_leave_out_its_wrapper_and_load_into_fsdp2_then_plain(tmp_path):
    olmo, fsdp2 = str(tmp_path / "olmo"), str(tmp_path / "fsdp2")
    names = run_ranks(2, _olmo_save, olmo)
    plain_names = [name for name, _ in _model(0).named_parameters()]
    assert names == [plain_names, plain_names]  # OLMo-core's named_parameters(): no wrapper part
    weights = shardsafe.unshard_model_state(olmo)
    assert sorted(weights) == sorted(plain_names)  # was "_fsdp_wrapped_module.0.weight", ...
    want = dict(_trained().named_parameters())
    for name, p in want.items():
        assert torch.equal(weights[name], p.detach()), name
    assert sorted(shardsafe.unshard_optim_state(olmo)["state"]) == sorted(plain_names)

    assert run_ranks(2, _fsdp2_load_and_save, olmo, fsdp2) == [True, True]

    plain = _model(2)
    optim = torch.optim.SGD(plain.parameters(), lr=1.0, momentum=0.0)
    shardsafe.load_model_and_optim_state(fsdp2, plain, optim)
    for (name, p), q in zip(want.items(), plain.parameters()):
        assert torch.equal(q.detach(), p.detach()), name
        assert torch.equal(optim.state[q]["momentum_buffer"], torch.ones_like(p)), name
    assert optim.param_groups[0]["lr"] == 0.25 and optim.param_groups[0]["momentum"] == 0.9
    assert os.path.exists(os.path.join(fsdp2, "metadata.json"))
