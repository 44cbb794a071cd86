"""The campaigns by name, with the trial counts of a fast run and of a full one."""

from __future__ import annotations

from collections.abc import Callable

from .corrupt import run_corrupt
from .fuzz_metadata import run_fuzz
from .importers import run_importers
from .kill import run_kill
from .load_exit import run_load_exit
from .manager import run_manager
from .nodeloss import run_nodeloss
from .race import run_race
from .report import Report

__all__ = ["CAMPAIGNS", "FAST", "FULL", "SEED"]

CAMPAIGNS: dict[str, Callable[[int, int], Report]] = {
    "kill": run_kill,
    "corrupt": run_corrupt,
    "fuzz": run_fuzz,
    "race": run_race,
    "manager": run_manager,
    "importers": run_importers,
    "nodeloss": run_nodeloss,
    "exit": run_load_exit,
}
# a fast run (make test) covers every exact kill point on one rank, each kind of damage to each
# saved case once (3 cases x 5 kinds), each race mode; a full run (make reliability) takes about
# 10 minutes on 2 shared cores, and the node-loss campaign about 25 more (each trial starts two
# gloo jobs of 2-4 ranks: about 10-16 s)
FAST = {"kill": 15, "corrupt": 15, "fuzz": 40, "race": 3, "manager": 9, "importers": 12, "nodeloss": 2, "exit": 3}
FULL = {"kill": 300, "corrupt": 1500, "fuzz": 1000, "race": 90, "manager": 150, "importers": 600, "nodeloss": 120, "exit": 60}
SEED = 20240917
