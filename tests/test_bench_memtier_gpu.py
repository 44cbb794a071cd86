"""``benchmarks/bench_memtier_gpu.py``: the memory tier saved from device parameters and restored
into them, beside pinned copies of the same bytes (issue 24's device check). On CPU the smoke run
checks the line's form and that the restore came from memory bit-exact; on a CUDA machine (marker
``gpu``) the same run on ``cuda``. Values are checked for form, never against a speed."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from .helpers import run_process

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("device", "mib", "blocked_s", "d2h_pinned_s", "blocked_vs_d2h", "tier0_s", "restore_s", "h2d_pinned_s",
          "restore_vs_h2d", "restored_from", "bit_exact")


def _run(device: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = run_process([sys.executable, str(ROOT / "benchmarks" / "bench_memtier_gpu.py"), "--device", device, "--mib", "8", "--steps", "2"],
                      capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    (line,) = [x for x in out.splitlines() if x.startswith("MEMTIER_GPU ")]
    values = dict(kv.split("=", 1) for kv in line.split()[1:])
    assert tuple(values) == FIELDS, line
    assert values["device"] == device and values["mib"] == "8" and values["restored_from"] == "memory", line
    assert values["bit_exact"] == "1", line
    for k in FIELDS[2:9]:
        assert math.isfinite(float(values[k])) and float(values[k]) > 0, (k, line)
    return values


@pytest.mark.bench_smoke
def test_cpu_run_prints_a_memtier_gpu_line_restored_from_memory_bit_exact() -> None:
    _run("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_run_stages_from_and_restores_into_device_parameters() -> None:
    _run("cuda")
