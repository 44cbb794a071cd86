"""kill -9 campaign: SIGKILL a saving job at random moments and at exact points, then check what is left.

A job (:mod:`tests.reliability.kill_child`, world size 1, or 2 on gloo) saves a sequence of
checkpoints: fresh directories, and overwrites of one directory. It is killed either at a random
moment (every rank at once, as a node failure would) or when one rank reaches an exact point:
the ``n``-th ``open``, ``write`` (half written), ``fsync``, ``replace``/``link`` (the commit's
rename), or ``unlink`` (cleanup) that shardsafe makes; the other ranks are then killed too, as
a launcher would. Then, for every directory the job touched:

- the last committed checkpoint loads bit-exact and passes ``verify`` (a save in flight may
  have committed: then it must load bit-exact as that one) -- else ``lost-checkpoint``,
  ``silent-wrong-data`` or ``verify-failed``;
- a directory never committed is refused with ``IncompleteCheckpointError`` -- else
  ``partial-accepted`` or ``partial-wrong-error``;
- a new save into it (``save_overwrite`` if it holds a checkpoint) succeeds, loads bit-exact,
  verifies, and leaves no litter: only ``metadata.json`` and the files it names
  (``ALLOWED_EXTRA`` lists any other file the library documents; none yet) -- else
  ``next-save-failed:<type>``, ``litter``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections import Counter

from .corrupt import classify
from .jobs import rank_errors, read_counts, run_job
from .kill_child import child
from .paths import run_path
from .report import Report
from .sandbox import Result, Sandbox, campaign
from .states import Case, single_state, truth_files, write_state_truth

__all__ = ["ALLOWED_EXTRA", "EXACT_POINTS", "litter", "resave", "run_kill"]

META = "metadata.json"
ALLOWED_EXTRA: frozenset[str] = frozenset()  # files beside metadata.json and its data files a checkpoint may hold
SEQUENCE = [("over", 1, False), ("fresh-a", 2, False), ("over", 3, True), ("fresh-b", 4, False), ("over", 5, True)]
NEXT_VERSION = 99
# (function, when, ranks it may be injected on): commit and cleanup happen on rank 0
EXACT_POINTS = [
    ("open", "after", (0, 1)),
    ("write", "mid", (0, 1)),
    ("fsync", "before", (0, 1)),
    ("fsync", "after", (0, 1)),
    ("link", "before", (0,)),
    ("link", "after", (0,)),
    ("replace", "before", (0,)),
    ("replace", "after", (0,)),
    ("unlink", "before", (0,)),
    ("unlink", "after", (0,)),
]


def _log(root: str) -> tuple[list[int], int | None]:
    """Saves that returned, and the one in flight, from rank 0's log."""
    done, started = [], []
    path = os.path.join(root, "log")
    if os.path.exists(path):
        with open(path) as f:
            for line in f.read().splitlines():
                what, i = line.split()
                (done if what == "done" else started).append(int(i))
    flight = [i for i in started if i not in done]
    return done, (flight[0] if flight else None)


def resave(directory: str, version: int, overwrite: bool) -> list[str]:
    """The save after a crash (one process); returns the litter it left: files that are neither
    ``metadata.json`` nor named by it."""
    from shardsafe import Checkpointer

    meta, _ = Checkpointer().save(directory, single_state(version, large=True), save_overwrite=overwrite)
    return litter(directory, meta.data_files())


def litter(directory: str, data_files: set[str]) -> list[str]:
    """Entries of ``directory`` that are neither ``metadata.json``, nor named by it, nor documented."""
    return sorted(set(os.listdir(directory)) - {META, *data_files, *ALLOWED_EXTRA})


def _check_dir(box: Sandbox, root: str, kind: str, name: str, committed: int | None, flight: int | None,
               truths: dict[tuple[str, int], str], out: str, notes: Counter) -> list[tuple[str, str]]:
    """Outcomes (and details) of the checks of one directory after the kill; the kinds of litter
    found go to ``notes``."""
    d = os.path.join(root, name)
    found: list[tuple[str, str]] = []
    candidates = [v for v in (committed, flight) if v is not None]
    loaded = None
    res: Result | None = None
    for v in candidates:
        case = Case(kind, d, v, True, truths[(kind, v)])
        res = box.call(run_path, case, "unshard", out, roots=[d, out, *truth_files(case)])
        if res.kind == "returned" and not res.value:
            loaded = v
            break
        if res.kind != "returned":
            break
    if loaded is None:
        if res is None or res.kind == "returned":
            found.append(("partial-accepted" if committed is None else "silent-wrong-data",
                          res.value if res else "nothing to load"))
        elif res.kind == "raised" and res.error_type.endswith("IncompleteCheckpointError") and committed is None:
            pass  # never committed, and refused as such
        elif res.kind == "raised" and res.checkpoint_error:
            found.append(("lost-checkpoint" if committed is not None else "partial-wrong-error", f"{res.error_type}: {res.message}"))
        else:
            found.append((classify("unshard", res, None), f"{res.error_type}: {res.message}"))
    else:
        case = Case(kind, d, loaded, True, truths[(kind, loaded)])
        res = box.call(run_path, case, "verify", out, roots=[d, out, *truth_files(case)])
        if res.kind != "returned":
            found.append((res.failure("verify-failed"), f"{res.error_type}: {res.message}"))
    # the save after the crash, into the same directory
    res = box.call(resave, d, NEXT_VERSION, loaded is not None, roots=[d])
    if res.kind != "returned":
        found.append((f"next-save-failed:{res.error_type or res.kind}", res.message))
        return found
    if res.value:
        found.append(("litter", f"{name}: {res.value}"))
        notes.update(f"litter:{re.sub(r'[0-9a-f]{8,}', '*', n)}" for n in res.value)
    case = Case("single", d, NEXT_VERSION, True, truths[("single", NEXT_VERSION)])
    for path in ("unshard", "verify"):
        res = box.call(run_path, case, path, out, roots=[d, out, *truth_files(case)])
        outcome = classify(path, res, None)
        if outcome != "correct":
            found.append((f"next-save-{outcome}", f"{res.error_type}: {res.message or res.value}"))
    return found


def _count(world: int, root: str, timeout: float) -> tuple[dict[int, dict[str, int]], float]:
    """Calls per rank and function in the whole sequence, and how long the sequence takes."""
    os.makedirs(root)
    status, took = run_job(child, world, root, {"saves": SEQUENCE, "point": None, "count": True}, None, timeout)
    if status != "finished":
        raise RuntimeError(f"the counting run of world size {world} ended {status}: {rank_errors(root)}")
    counts = read_counts(root, world)
    return counts, took


def scenarios(trials: int, seed: int, counts: dict[int, dict[int, dict[str, int]]], took: dict[int, float]) -> list[dict]:
    """The trials: a third killed at random moments, the rest at exact points, a third of each on 2 ranks.

    The first trials cover every exact point once (on world size 1, then 2), so even a short
    run exercises each; later ones draw the point, the rank and the call number at random.
    """
    rng = random.Random(seed)
    plans = []
    fixed = [(1, fn, when, 0) for fn, when, _ in EXACT_POINTS] + [(2, fn, when, ranks[-1]) for fn, when, ranks in EXACT_POINTS]
    for i in range(trials):
        if i % 3 == 0:
            world = 2 if i % 9 == 6 else 1
            plans.append({"world": world, "delay": rng.uniform(0, took[world]), "point": None})
            continue
        if fixed:
            world, fn, when, rank = fixed.pop(0)
        else:
            world = 2 if rng.random() < 1 / 3 else 1
            fn, when, ranks = rng.choice(EXACT_POINTS)
            rank = rng.choice([r for r in ranks if r < world])
        total = counts[world][rank].get(fn, 0)
        if total == 0:
            continue
        plans.append({"world": world, "delay": None, "point": {"fn": fn, "when": when, "rank": rank, "n": rng.randint(1, total)}})
    return plans


def run_kill(trials: int, seed: int, *, workdir: str | None = None, timeout: float = 60.0) -> Report:
    """Run ``trials`` killed jobs; see the module docstring."""
    with campaign("kill", workdir) as (report, root, box):
        truths: dict[tuple[str, int], str] = {}
        for kind, versions in (("single", [*range(1, 6), NEXT_VERSION]), ("sharded", range(1, 6))):
            for v in versions:
                truths[(kind, v)] = os.path.join(root, f"truth-{kind}-{v}")
                write_state_truth(Case(kind, "", v, True, truths[(kind, v)]))
        out = os.path.join(root, "out")
        os.makedirs(out)
        counts, took = {}, {}
        for world in (1, 2):
            counts[world], took[world] = _count(world, os.path.join(root, f"count-{world}"), timeout)
        for i, sc in enumerate(scenarios(trials, seed, counts, took)):
            trial = os.path.join(root, f"trial-{i}")
            os.makedirs(trial)
            pt = sc["point"]
            label = f"ws{sc['world']}/" + ("random" if pt is None else f"{pt['fn']}:{pt['when']}")
            plan = {"saves": SEQUENCE, "point": pt}
            status, _ = run_job(child, sc["world"], trial, plan, sc["delay"], timeout)
            report.trials += 1
            if status in ("hang", "child-error"):
                report.add(status, f"{label} {pt}: {rank_errors(trial)}", path=label)
                shutil.rmtree(trial, ignore_errors=True)
                continue
            for r in range(sc["world"]):  # a rank that outlived its killed peer and raised: which error?
                path = os.path.join(trial, f"error-r{r}.txt")
                if os.path.exists(path):
                    with open(path) as f:
                        report.notes[f"survivor-raised:{f.readline().strip().removeprefix('builtins.')}"] += 1
            done, flight = _log(trial)
            kind = "sharded" if sc["world"] > 1 else "single"
            found = []
            for name in sorted({n for n, _, _ in SEQUENCE}):
                saves = [i for i, (n, _, _) in enumerate(SEQUENCE) if n == name]
                committed = max((SEQUENCE[i][1] for i in saves if i in done), default=None)
                inflight = SEQUENCE[flight][1] if flight is not None and flight in saves else None
                if committed is None and inflight is None:
                    continue
                found += [(o, f"{label} n={pt and pt['n']} {status}, dir {name} (committed v{committed}, "
                              f"in flight v{inflight}): {d}") for o, d in
                          _check_dir(box, trial, kind, name, committed, inflight, truths, out, report.notes)]
            if not found:
                report.add("ok", path=label)
            for outcome, detail in dict(found).items():
                report.add(outcome, detail, path=label)
            shutil.rmtree(trial, ignore_errors=True)
    return report
