"""What the command-line tests share: the environment a ``shardsafe`` subprocess runs this checkout
with, a small model, an exported Hugging Face folder, a checkpoint's one data file."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from shardsafe import Checkpointer
from shardsafe.cli import main

__all__ = ["ENV", "ROOT", "data_file", "hf_folder", "small_model"]

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}


def data_file(d: Path) -> Path:
    (f,) = [p for p in d.iterdir() if p.suffix == ".safetensors"]
    return f

def small_model():
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 10))

def hf_folder(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A two-shard HF folder of ``small_model()``'s weights, under ``net.`` (as a wrapping model's names)."""
    sd = {f"net.{k}": v.detach().clone() * 3 for k, v in small_model().state_dict().items()}
    d = tmp_path / "ck"
    Checkpointer().save(d, sd)
    assert main(["export", str(d), str(tmp_path / "hf"), "--max-shard-size", "1KB", "-q"]) == 0
    return tmp_path / "hf", sd
