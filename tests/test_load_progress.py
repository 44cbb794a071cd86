"""``progress=`` on ``Checkpointer.load`` and ``load_hf_safetensors``: a callable sees the bytes
of this rank's targets filled, ``True`` draws a tqdm bar on the coordinator only (checked on a
real pseudo-terminal, and on 2 gloo ranks)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import shardsafe
from shardsafe import Checkpointer

from .cli_helpers import ENV, hf_folder, small_model
from .helpers import run_ranks
from .terminal import on_a_pty


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.arange(10), "h": torch.randn(7, generator=g).to(torch.bfloat16), "step": 3}


def _zeroed(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def test_callable_progress_counts_the_bytes_of_the_targets(tmp_path):
    state = _state()
    Checkpointer().save(tmp_path / "mine", state)
    total = 64 * 32 * 4 + 10 * 8 + 7 * 2
    seen: list[tuple[int, int]] = []
    got = _zeroed(state)
    Checkpointer().load(tmp_path / "mine", got, progress=lambda d, t: seen.append((d, t)))
    assert all(torch.equal(got[k], state[k]) for k in ("w", "b", "h"))
    assert seen[0] == (0, total) and seen[-1] == (total, total) and len(seen) == 4  # one report per tensor after the first
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and {t for _, t in seen} == {total}

    path, sd = hf_folder(tmp_path)
    seen.clear()
    model = small_model()
    shardsafe.load_hf_safetensors(path, model, prefix="net.", progress=lambda d, t: seen.append((d, t)))
    assert seen[0] == (0, 2632) and seen[-1] == (2632, 2632) and len(seen) == 5  # (16*24 + 24 + 24*10 + 10) * 4 bytes
    with pytest.raises(TypeError, match="load_hf_safetensors: argument 'progress' must be a bool, a callable or None, got str"):
        shardsafe.load_hf_safetensors(path, model, prefix="net.", progress="yes")
    with pytest.raises(TypeError, match="load: argument 'progress' must be a bool, a callable or None, got int"):
        Checkpointer().load(tmp_path / "mine", got, progress=1)


_SCRIPT = """
import sys, torch, shardsafe
from tests.cli_helpers import small_model
ck, hf = sys.argv[1:]
sd = {k: torch.zeros(64, 32) if k == "w" else v for k, v in {"w": 0, "b": torch.zeros(10, dtype=torch.int64),
      "h": torch.zeros(7, dtype=torch.bfloat16), "step": 0}.items()}
shardsafe.Checkpointer().load(ck, sd, progress=True)
shardsafe.load_hf_safetensors(hf, small_model(), prefix="net.", progress=True)
print(sd["step"])
"""


def _on_a_pty(args: list[str]) -> tuple[subprocess.CompletedProcess, bytes]:
    return on_a_pty(args, ENV)


def test_progress_bar_on_a_terminal(tmp_path):
    Checkpointer().save(tmp_path / "mine", _state())
    path, _ = hf_folder(tmp_path)
    r, err = _on_a_pty([sys.executable, "-c", _SCRIPT, str(tmp_path / "mine"), str(path)])
    assert r.returncode == 0 and r.stdout == b"3\n", err
    total = 64 * 32 * 4 + 10 * 8 + 7 * 2
    assert b"\rload:   0%|" in err and f"/{total / 1000:.2f}k [".encode() in err  # tqdm: bytes done / total, rate, ETA
    assert b"\rload_hf_safetensors:   0%|" in err and b"/2.63k [" in err


def _ranks_draw(rank, ws, ck, hf):
    import io

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.stderr = io.StringIO()  # tqdm writes to the sys.stderr of the moment it draws
    model = small_model()
    mesh = init_device_mesh("cpu", (ws,))
    fully_shard(model, mesh=mesh)
    shardsafe.load_hf_safetensors(hf, model, prefix="net.", progress=True)
    seen: list[tuple[int, int]] = []
    target = {"net." + k: v for k, v in model.state_dict().items()}
    Checkpointer().load(ck, target, progress=lambda d, t: seen.append((d, t)))
    Checkpointer().load(ck, target, progress=True)
    return sys.stderr.getvalue(), seen[-1]


def test_bar_on_the_coordinator_only_callable_on_every_rank(tmp_path):
    path, sd = hf_folder(tmp_path)
    Checkpointer().save(tmp_path / "mine", sd)
    (err0, last0), (err1, last1) = run_ranks(2, _ranks_draw, str(tmp_path / "mine"), str(path))
    assert "\rload_hf_safetensors:   0%|" in err0 and "\rload:   0%|" in err0 and "/1.32k [" in err0
    assert err1 == ""  # rank 1 draws nothing
    # each rank's half of the 2632 bytes: 12 rows of 16 and 12 of 0.bias, 5 rows of 24 and 5 of 2.bias
    assert last0 == last1 == ((12 * 16 + 12 + 5 * 24 + 5) * 4,) * 2
