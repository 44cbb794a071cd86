"""``benchmarks/bench_hf.py --quick`` runs on real gloo ranks and prints a table row per case and
method and one parseable ``HF ...`` line per case (values checked for form, loads for bit-exact
data and bytes read; never against any speed: timings do not belong in unit tests)."""

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
CASES = ("export", "load-fsdp2-2", "load-fsdp2-4", "load-tp-2")
EXPORTS = ("shardsafe", "unshard+save_file", "raw copy (limit)")
LOADS = ("shardsafe", "safetensors+distribute_tensor", "preadv share (limit)")
FIELDS = ("shardsafe_s", "baseline_s", "limit_s", "shardsafe_gbs", "shardsafe_vs_baseline", "shardsafe_vs_limit", "shardsafe_rss_mib",
          "baseline_rss_mib", "limit_rss_mib", "shardsafe_read_mib", "limit_read_mib")


def _number(text: str) -> float:
    value = float(text.removesuffix("x"))
    assert math.isfinite(value), text
    return value


def test_quick_run_prints_hf_lines(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    args = ["--quick", "--dir", str(tmp_path / "scratch"), "--out", str(tmp_path / "out")]
    out = run_process([sys.executable, str(ROOT / "benchmarks" / "bench_hf.py"), *args],
                         capture_output=True, text=True, env=env, timeout=120, check=True).stdout

    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| case ")]
    assert [(r[0], r[1]) for r in rows] == [(c, m) for c in CASES for m in (EXPORTS if c == "export" else LOADS)]
    whole = 2 * 2**20  # --quick: 8 layers of 256 x 256 float32
    for case, method, seconds, gbs, rss, read, data in rows:
        assert _number(seconds) > 0 and _number(gbs) > 0 and _number(rss) >= 0, (case, method)
        assert data == ("-" if case == "export" else "ok"), (case, method, data)  # every load bit-exact
        ws = 1 if case == "export" else int(case[-1])
        share = {"export": whole, "load-fsdp2-2": whole / 2, "load-fsdp2-4": whole / 4, "load-tp-2": whole / 2}[case]
        if method == "safetensors+distribute_tensor":
            share = whole  # every rank reads every file
        elif method == "shardsafe" and case == "load-tp-2":
            share = whole * 3 / 4  # row-parallel layers: rows 1 KiB apart, coalesced into one read of the tensor
        assert _number(read) * 2**20 == share, (case, method, read, ws)

    lines = [line.split() for line in out.splitlines() if line.startswith("HF ")]
    assert [line[1] for line in lines] == list(CASES)
    for line in lines:
        values = dict(kv.split("=", 1) for kv in line[2:])
        assert tuple(values) == FIELDS, line
        for k, v in values.items():
            assert _number(v) > 0 or k.endswith("rss_mib") and _number(v) >= 0, (k, line)
            assert v.endswith("x") == ("_vs_" in k), (k, v)

    saved = json.loads((tmp_path / "out" / "hf.json").read_text())
    assert set(saved["records"]) == set(CASES)
    assert {(r["method"], r["rank"]) for r in saved["records"]["load-fsdp2-4"]} == {(m, k) for m in LOADS for k in range(4)}
    assert not (tmp_path / "scratch").exists()  # the scratch directory is removed
