"""``benchmarks/bench_dcp.py --quick`` runs on real gloo ranks and prints a table row per operation
and method and four parseable ``DCP ...`` lines (values checked for shape and bit-exact loads,
not against any speed: timings do not belong in unit tests)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from .helpers import run_process

# a benchmark script run end to end in its quick mode (its own ranks, fresh imports): make test-bench
pytestmark = pytest.mark.bench_smoke

ROOT = Path(__file__).resolve().parent.parent
ROWS = [(op, m) for op in ("save", "load", "reshard") for m in ("plugin", "dcp", "shardsafe")] + [
    ("convert", "convert"), ("convert", "dcp-load+save")]
FIELDS = {
    "save": ("plugin_s", "dcp_s", "shardsafe_s", "plugin_vs_dcp", "plugin_vs_shardsafe", "planning_s", "planning_share",
             "hooks_s", "write_s", "finish_s"),
    "load": ("plugin_s", "dcp_s", "shardsafe_s", "plugin_vs_dcp", "plugin_vs_shardsafe"),
    "reshard": ("plugin_s", "dcp_s", "shardsafe_s", "plugin_vs_dcp", "plugin_vs_shardsafe"),
    "convert": ("convert_s", "convert_mib_s", "convert_rss_mib", "baseline_s", "baseline_mib_s", "baseline_load_s", "baseline_rss_mib",
                "convert_vs_baseline"),
}


def _number(text: str) -> float:
    value = float(text.removesuffix("x").removesuffix("%"))
    assert math.isfinite(value), text
    return value


def test_quick_run_prints_dcp_lines(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    args = ["--quick", "--reps", "1", "--mib-per-rank", "1", "--dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]
    out = run_process([sys.executable, str(ROOT / "benchmarks" / "bench_dcp.py"), *args],
                         capture_output=True, text=True, env=env, timeout=120, check=True).stdout

    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| op ")]
    assert [(r[0], r[1]) for r in rows] == ROWS
    for op, method, seconds, mib_s, planning, rss, data in rows:
        assert _number(seconds) > 0 and _number(mib_s) > 0 and _number(rss) >= 0, (op, method)
        assert (planning != "-") == ((op, method) == ("save", "plugin")), (op, method, planning)
        if planning != "-":
            total, hooks = planning.split()
            assert 0 < _number(hooks.strip("()")) < _number(total) < _number(seconds), planning
        assert data == ("ok" if op in ("load", "reshard") else "-"), (op, method, data)  # loads bit-exact

    lines = [line.split() for line in out.splitlines() if line.startswith("DCP ")]
    assert [line[1] for line in lines] == list(FIELDS)
    for line in lines:
        values = dict(kv.split("=", 1) for kv in line[2:])
        assert tuple(values) == FIELDS[line[1]], line
        for k, v in values.items():
            assert _number(v) > 0 or k.endswith("rss_mib") and _number(v) >= 0, (k, line)
            assert v.endswith("x") == ("_vs_" in k) and v.endswith("%") == k.endswith("share"), (k, v)

    saved = json.loads((tmp_path / "out" / "dcp.json").read_text())
    assert {(r["op"], r["method"], r["rank"]) for r in saved["records"]} == {
        (op, m, rank) for op, m in ROWS for rank in ((0,) if op == "convert" else (0, 1))}
    assert not (tmp_path / "ckpt").exists()  # the scratch checkpoints are removed
