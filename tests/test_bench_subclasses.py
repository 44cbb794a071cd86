"""``benchmarks/bench_subclasses.py --quick`` saves and loads plain and 8-bit optimizer state with
shardsafe and DCP and prints a table and one parseable ``SUBCLASS`` line (values checked for form
and for the bytes each checkpoint holds, never against a speed: timings do not belong in unit
tests)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

from .helpers import run_process

pytestmark = pytest.mark.bench_smoke

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("save_per_byte_x", "load_per_byte_x", "dcp_save_per_byte_x", "dcp_load_per_byte_x", "shardsafe_8bit_bytes", "dcp_8bit_bytes")


def test_quick_run_prints_a_subclass_line() -> None:
    pytest.importorskip("torchao")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = run_process([sys.executable, str(ROOT / "benchmarks" / "bench_subclasses.py"), "--quick"],
                      capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    rows = {line[:22].strip(): line[22:].split() for line in out.splitlines()[2:] if not line.startswith("SUBCLASS")}
    assert list(rows) == ["shardsafe plain", "shardsafe 8bit", "dcp plain", "dcp 8bit"], out
    sizes = {name: int(cols[0]) for name, cols in rows.items()}
    # 2 x Linear(256, 256): 8-bit state is a byte a weight element (+ scales, tables), the plain state 8
    assert sizes["shardsafe 8bit"] < sizes["shardsafe plain"] * 0.6, sizes
    (line,) = [x for x in out.splitlines() if x.startswith("SUBCLASS ")]
    values = dict(kv.split("=", 1) for kv in line.split()[1:] if "<=" not in kv)
    assert tuple(values) == FIELDS, line
    for k in FIELDS[:4]:
        assert math.isfinite(float(values[k])) and float(values[k]) > 0, (k, values[k])
    assert int(values["shardsafe_8bit_bytes"]) == sizes["shardsafe 8bit"]
    targets = [kv for kv in line.split() if "<=" in kv]
    assert [t.rsplit(":", 1)[0] for t in targets] == ["target_save<=1.0x", "target_load<=1.0x"], line
    assert all(t.rsplit(":", 1)[1] in ("ok", "MISS") for t in targets), line
