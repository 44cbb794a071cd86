"""Processes that exit right after a load, the way a training script ends (no barrier, no
``destroy_process_group``): no rank may abort (``terminate called without an active
exception``), exit nonzero or hang. Each trial is one run of 2 or 3 gloo ranks
(:mod:`tests.load_exit_runs`, which starves gloo's threads so that a race with the exit shows
nearly every time); trials alternate between the two world sizes. ``make test`` runs a few of
them (``tests/test_dist.py``); this campaign runs dozens.

Outcomes besides ``ok``: ``abort`` (a rank died of SIGABRT), ``hang`` (a rank was killed after
60 s), ``exit:<statuses>`` (any other nonzero status).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from ..load_exit_runs import make_checkpoint, runs_in_a_process
from .report import Report

__all__ = ["run_load_exit"]


def _outcome(statuses: list[int | str]) -> str:
    if all(s == 0 for s in statuses):
        return "ok"
    if -6 in statuses:
        return "abort"
    if "hung" in statuses:
        return "hang"
    return f"exit:{statuses}"


def run_load_exit(trials: int, seed: int, *, workdir: str | None = None) -> Report:
    """Run ``trials`` runs, half of them (rounded up) on 2 ranks, the rest on 3. The runs are not
    random: ``seed`` is taken for the campaigns' common signature only."""
    del seed
    report = Report("exit")
    start = time.monotonic()
    root = workdir or tempfile.mkdtemp(prefix="shardsafe-exit-")
    try:
        path = os.path.join(root, "c")
        make_checkpoint(path)
        for ws, runs in ((2, (trials + 1) // 2), (3, trials // 2)):
            if runs:
                for statuses in runs_in_a_process(path, runs, ws, timeout=300):
                    report.trials += 1
                    report.add(_outcome(statuses), str(statuses), path=f"ws{ws}")
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
        report.seconds = time.monotonic() - start
    return report
