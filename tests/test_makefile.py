"""What `make demo` and `make test` install and run (``make -n``: the commands, nothing run)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from .helpers import run_process

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _commands(target: str, tmp_path: Path) -> list[str]:
    """The commands ``make TARGET`` runs on a fresh clone (a virtual environment not made yet).

    Run under ``make test`` (CI), the outer make's MAKEFLAGS/MAKELEVEL would make this one a sub-make that
    prints "Entering/Leaving directory" lines between the commands: both are dropped from its environment.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    r = run_process(
        ["make", "--no-print-directory", "-n", "-B", target, f"VENV={tmp_path / 'venv'}"],
        cwd=ROOT, capture_output=True, text=True, check=True, env=env,
    )
    return [ln.strip() for ln in r.stdout.splitlines() if ln.strip()]


def test_make_demo_installs_only_the_runtime_and_keeps_its_result(tmp_path):
    cmds = _commands("demo", tmp_path)
    installs = [c for c in cmds if "pip install" in c and "--upgrade pip" not in c]
    assert installs == [f"{tmp_path / 'venv'}/bin/python -m pip install -q -c constraints.txt -e ."]  # no extras
    assert not any("npm" in c for c in cmds)  # no Azure emulator for a demo
    assert cmds[-2:] == ["rm -rf demo-output", f"{tmp_path / 'venv'}/bin/python examples/train_demo.py --workdir demo-output"]


def test_make_test_installs_the_test_and_dev_extras_on_top(tmp_path):
    cmds = _commands("test", tmp_path)
    installs = [c for c in cmds if "pip install" in c and "--upgrade pip" not in c]
    assert [c.split("install -q ", 1)[1] for c in installs] == ["-c constraints.txt -e .", '-c constraints.txt -e ".[test,dev]"']
    assert cmds[-1].startswith(f"{tmp_path / 'venv'}/bin/python -m pytest ")
    assert (ROOT / ".ci" / "run").read_text().splitlines()[-1] == "make test"


def test_the_benchmark_smoke_runs_are_in_make_reliability_not_make_test(tmp_path):
    py = f"{tmp_path / 'venv'}/bin/python"
    assert _commands("test", tmp_path)[-1] == f'{py} -m pytest -n 2 --dist loadgroup -m "not bench_smoke" tests'
    assert _commands("reliability", tmp_path)[-2:] == [f"{py} -m tests.reliability --full", f"{py} -m pytest -n 2 -m bench_smoke tests"]
    assert _commands("test-bench", tmp_path)[-1] == f"{py} -m pytest -n 2 -m bench_smoke tests"
