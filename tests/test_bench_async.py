"""``benchmarks/bench_async.py --quick`` runs its methods on real gloo ranks and prints a table
row per method and a parseable ``ASYNC`` / ``TARGETS`` pair (values checked for shape, not against
the targets: timings do not belong in unit tests)."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest

from .helpers import run_process

# a benchmark script run end to end in its quick mode (its own ranks, fresh imports): make test-bench
pytestmark = pytest.mark.bench_smoke

ROOT = Path(__file__).resolve().parent.parent
# every method that runs on CPU but dcp-process, whose checkpoint process (another torch import per
# rank) doubles the test's time; `make bench-async-quick` runs it
METHODS = ("memcpy", "shardsafe-async", "shardsafe-sync", "dcp-sync", "dcp-thread", "dcp-stager", "dcp-stager-async")
DCP_ASYNC = ("dcp-thread", "dcp-thread-cached", "dcp-stager", "dcp-stager-async", "dcp-process")
FIELDS = (
    "blocked_s", "memcpy_s", "dcp_best", "dcp_best_blocked_s", "blocked_vs_memcpy", "blocked_vs_dcp_best", "step_ms",
    "step_slowdown", "overlapped_steps", "dcp_step_slowdown", "durable_s", "sync_s", "durable_vs_sync", "lost_s",
    "dcp_min_lost", "dcp_min_lost_s",
)
TARGET = re.compile(r"(blocked_vs_memcpy<=1\.2x|blocked_vs_dcp_best<=0\.5x|step_slowdown<=10%|durable_vs_sync<=1\.2x):(ok|MISS)")


def _number(text: str, unit: str = "") -> float:
    assert text.endswith(unit), (text, unit)
    value = float(text[: len(text) - len(unit)] if unit else text)
    assert math.isfinite(value), text
    return value


def test_quick_run_prints_async_lines(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    args = ["--quick", "--world-sizes", "2", "--reps", "1", "--mib-per-rank", "2", "--mlp", "128,512,32",
            "--methods", ",".join(METHODS), "--dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]
    out = run_process([sys.executable, str(ROOT / "benchmarks" / "bench_async.py"), *args],
                         capture_output=True, text=True, env=env, timeout=180, check=True).stdout

    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 2 |")]
    assert [r[1].strip() for r in rows] == [*METHODS, "no-save"]
    for r in rows:
        method, blocked, durable, lost = r[1].strip(), r[2].split()[0], r[4].strip(), r[9].strip()
        if method != "no-save":
            assert _number(blocked) > 0, r
            value = _number(lost)  # finite; for an async save, noise in its steps' excess may make it negative
            if method in ("memcpy", "shardsafe-sync", "dcp-sync"):
                assert value > 0, r
        if method not in ("memcpy", "no-save"):
            assert _number(durable) >= _number(blocked) > 0, r

    lines = [line for line in out.splitlines() if line.startswith(("ASYNC ", "TARGETS "))]
    assert [line.split()[:2] for line in lines] == [["ASYNC", "ws2"], ["TARGETS", "ws2"]]
    values = dict(kv.split("=", 1) for kv in lines[0].split()[2:])
    assert tuple(values) == FIELDS, lines[0]
    assert values["dcp_best"] in DCP_ASYNC
    assert values["dcp_min_lost"] in ("dcp-sync", *DCP_ASYNC)
    for k in ("blocked_s", "memcpy_s", "dcp_best_blocked_s", "step_ms", "durable_s", "sync_s"):
        assert _number(values[k]) > 0, (k, lines[0])
    _number(values["lost_s"]), _number(values["dcp_min_lost_s"])  # finite
    for k in ("blocked_vs_memcpy", "blocked_vs_dcp_best", "durable_vs_sync"):
        assert _number(values[k], "x") > 0, (k, lines[0])
    _number(values["step_slowdown"], "%")  # may be negative: noise, when a save barely slows a step
    _number(values["dcp_step_slowdown"], "%")
    assert int(values["overlapped_steps"]) >= 0
    assert len(lines[1].split()[2:]) == 4 and all(TARGET.fullmatch(t) for t in lines[1].split()[2:]), lines[1]

    saved = json.loads((tmp_path / "out" / "async.json").read_text())
    ranks = {(r["method"], r["rank"]) for r in saved["records"] if r["rep"] == 0}
    assert ranks == {(m, rank) for m in (*METHODS, "no-save") for rank in (0, 1)}
    assert not (tmp_path / "ckpt").exists()  # the scratch checkpoints are removed
