"""``benchmarks/bench_planner.py --quick`` runs and ends with one parseable PLAN line per layout and point."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from .helpers import run_process

# a benchmark script run end to end in its quick mode (its own ranks, fresh imports): make test-bench
pytestmark = pytest.mark.bench_smoke

ROOT = Path(__file__).resolve().parent.parent
FIELDS = (
    "first_save_s",
    "cached_save_s",
    "load_parse_s",
    "metadata_mb",
    "rank_s",
    "dcp_first_save_s",
    "dcp_cached_save_s",
    "dcp_load_s",
    "dcp_metadata_mb",
)
LINE = re.compile(r"PLAN (fsdp|ddp|2d|hsdp) (~?)(\d+)x(\d+) (.*)")


def test_quick_run_prints_plan_lines() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = run_process(
        [sys.executable, str(ROOT / "benchmarks" / "bench_planner.py"), "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    ).stdout
    points = []
    for line in out.splitlines():
        if not line.startswith("PLAN "):
            continue
        m = LINE.fullmatch(line)
        assert m, line
        layout, approx, ranks, tensors, rest = m.groups()
        values = dict(kv.split("=") for kv in rest.split())
        assert tuple(values) == FIELDS, line
        for k, v in values.items():
            assert v.startswith("~") == bool(approx), line
            assert float(v.lstrip("~")) > 0, (k, line)
        points.append((layout, approx, int(ranks), int(tensors)))
    expected = [
        (layout, approx, ranks, tensors)
        for layout in ("fsdp", "ddp", "2d", "hsdp")
        for approx, ranks, tensors in (("", 32, 20), ("", 64, 20), ("~", 4096, 1000), ("~", 16384, 1000))
    ]
    assert points == expected
