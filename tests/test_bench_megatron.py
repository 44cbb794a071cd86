"""``benchmarks/bench_megatron.py --quick`` runs shardsafe.megatron and megatron-core's torch_dist
on real gloo ranks (here 2, TP2 x DP1, one layer: the smallest run that saves, loads and reshards
through every method; ``make bench-megatron`` runs the 4-rank TP2 x DP2 case) and prints a table
row per (operation, method), every load bit-exact, and a parseable ``MEGATRON`` / ``TARGETS`` pair
(checked for shape, not against the targets: timings do not belong in unit tests)."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest

from .helpers import run_process

pytest.importorskip("megatron.core.dist_checkpointing")

# a benchmark script run end to end in its quick mode (its own ranks, fresh imports): make test-bench
pytestmark = pytest.mark.bench_smoke

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("shardsafe", "megatron")  # the fully parallel wrappers double the test's time; `make bench-megatron` runs them
TARGET = re.compile(r"(save>=1\.3x|load>=2x|reshard>=2x):(ok|MISS)")


def _number(text: str, unit: str = "") -> float:
    assert text.endswith(unit), (text, unit)
    value = float(text[: len(text) - len(unit)] if unit else text)
    assert math.isfinite(value) and value > 0, text
    return value


def test_quick_run_prints_megatron_lines(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    args = ["--quick", "--dp", "1", "--layers", "1", "--methods", ",".join(METHODS), "--dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]
    out = run_process([sys.executable, str(ROOT / "benchmarks" / "bench_megatron.py"), *args],
                         capture_output=True, text=True, env=env, timeout=240, check=True).stdout

    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ") and not line.startswith("| operation")]
    assert [(r[0], r[1]) for r in rows] == [(op, m) for op in ("save", "load", "reshard") for m in METHODS]
    for r in rows:
        low, high = (_number(v) for v in r[3].split("–"))
        assert low <= _number(r[2]) <= high, r
        _number(r[4]), _number(r[5], "x")
        assert r[6] == "yes", r  # every loaded tensor equals the saved one
    assert {r[5] for r in rows if r[1] == "shardsafe"} == {"1.00x"}

    lines = [line for line in out.splitlines() if line.startswith(("MEGATRON ", "TARGETS "))]
    assert [line.split()[0] for line in lines] == ["MEGATRON", "TARGETS"]
    values = dict(kv.split("=", 1) for kv in lines[0].split()[1:])
    assert tuple(values) == ("save", "load", "reshard", "save_best", "load_best", "reshard_best"), lines[0]
    for op in ("save", "load", "reshard"):
        _number(values[op], "x")
        assert values[f"{op}_best"] == "megatron"
    assert len(lines[1].split()[1:]) == 3 and all(TARGET.fullmatch(t) for t in lines[1].split()[1:]), lines[1]

    saved = json.loads((tmp_path / "out" / "megatron.json").read_text())
    assert {(r["op"], r["method"], r["rank"]) for r in saved["records"]} == {
        (op, m, rank) for op in ("save", "load", "reshard") for m in METHODS for rank in range(2)
    }
    assert not (tmp_path / "ckpt").exists()  # the scratch checkpoints are removed
