"""``python -m tests.reliability [--full] [--seed N] [--only kill,corrupt,fuzz,race,manager,importers,nodeloss,exit] [--trials N]``

Runs the campaigns, prints a table per campaign and one ``RELIABILITY {json}`` line each, and
exits 1 if any campaign had a bad outcome (2 on bad arguments).
"""

from __future__ import annotations

import argparse
import sys

from .campaigns import CAMPAIGNS, FAST, FULL, SEED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.reliability", description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="hundreds of trials per campaign (make reliability)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--only", default=",".join(CAMPAIGNS), help="comma-separated campaigns to run")
    parser.add_argument("--trials", type=int, default=None, help="trials per campaign (overrides --full)")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(CAMPAIGNS))
    if unknown:
        parser.error(f"unknown campaign(s) {unknown}; choose from {sorted(CAMPAIGNS)}")
    counts = FULL if args.full else FAST
    reports = []
    for name in names:
        trials = args.trials if args.trials is not None else counts[name]
        print(f"running {name}: {trials} trials, seed {args.seed}", flush=True)
        report = CAMPAIGNS[name](trials, args.seed)
        print(report.table(), flush=True)
        reports.append(report)
    for report in reports:
        print(report.line())
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
