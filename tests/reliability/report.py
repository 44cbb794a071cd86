"""What a campaign found: how many times each outcome happened, and a few examples of each.

An outcome is a short name. The good ones are listed in :data:`GOOD`; every other name is a
failure of a promise (``silent-wrong-data``, ``foreign-exception:<type>``, ``outside-access``,
``hang``, ``lost-checkpoint``, ...), and a campaign passes only when none happened.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["GOOD", "Report", "is_bad"]

GOOD = frozenset(
    {
        "detected",  # refused with a CheckpointError that names what it must
        "correct",  # no error and every value bit-exact: the damage was in bytes this path never returns
        "accepted",  # fuzzer: no error, and every value returned bit-exact
        "accepted-declared",  # fuzzer: no error; values differ where the mutation changed what metadata.json declares
        "ok",  # kill and race trials: every check passed
    }
)

_EXAMPLES = 3  # kept per outcome


def is_bad(outcome: str) -> bool:
    return outcome not in GOOD


@dataclass
class Report:
    """Counts of outcomes over a campaign's trials (one trial may check several read paths)."""

    campaign: str
    trials: int = 0
    seconds: float = 0.0
    counts: Counter = field(default_factory=Counter)
    by_path: dict[str, Counter] = field(default_factory=dict)  # read path (or phase) -> outcome counts
    examples: dict[str, list[str]] = field(default_factory=dict)
    notes: Counter = field(default_factory=Counter)  # observations that are no outcome (not good, not bad)

    def add(self, outcome: str, example: str = "", *, path: str = "") -> None:
        self.counts[outcome] += 1
        if path:
            self.by_path.setdefault(path, Counter())[outcome] += 1
        if is_bad(outcome) and example:
            kept = self.examples.setdefault(outcome, [])
            if len(kept) < _EXAMPLES:
                kept.append(f"{path}: {example}" if path else example)

    @property
    def bad(self) -> dict[str, int]:
        return {k: v for k, v in sorted(self.counts.items()) if is_bad(k)}

    @property
    def ok(self) -> bool:
        return not self.bad

    def table(self) -> str:
        """A readable table: outcomes per read path, then examples of every bad outcome."""
        outcomes = sorted(self.counts, key=lambda o: (is_bad(o), o))
        paths = sorted(self.by_path) or [""]
        width = max([len(p) for p in paths] + [10])
        head = f"{'path':<{width}} | " + " | ".join(outcomes)
        lines = [f"== {self.campaign}: {self.trials} trials, {self.seconds:.0f} s", head, "-" * len(head)]
        for p in paths:
            row = self.by_path.get(p, self.counts)
            lines.append(f"{p:<{width}} | " + " | ".join(f"{row.get(o, 0):>{len(o)}}" for o in outcomes))
        if self.notes:
            lines.append(f"  notes: {dict(sorted(self.notes.items()))}")
        for outcome, kept in sorted(self.examples.items()):
            lines.append(f"  {outcome}:")
            lines += [f"    - {e[:400]}" for e in kept]
        return "\n".join(lines)

    def line(self) -> str:
        """One machine-readable line: ``RELIABILITY {json}``."""
        doc = {
            "campaign": self.campaign,
            "trials": self.trials,
            "seconds": round(self.seconds, 1),
            "ok": self.ok,
            "bad": self.bad,
            "counts": dict(sorted(self.counts.items())),
            "notes": dict(sorted(self.notes.items())),
        }
        return "RELIABILITY " + json.dumps(doc, sort_keys=True)

    def failure_message(self) -> str:
        return f"{self.campaign}: bad outcomes {self.bad}\n{self.table()}"
