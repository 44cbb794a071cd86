"""Manager campaign: ``CheckpointManager`` roots with hand-made, damaged and half-deleted steps, and
jobs killed with SIGKILL during retention and during an async save's commit.

Two kinds of trial:

- **damage** (one process): a manager saves steps 1-5; then one to three of: a byte of a step's
  ``metadata.json`` or of a data file flipped, a data file deleted or cut short, a
  ``metadata.json`` deleted (the step is then uncommitted), a hand-made step directory (an
  empty one, or one whose ``metadata.json`` is ``{}``, random bytes, or another step's document
  without its data files). A new manager must then restore the newest step left intact,
  bit-exact (falling back past damaged ones), count no damaged step, and, saving a newer step
  with ``keep_last=2``, keep the newest intact step rather than a damaged one.
- **kill** (1 or 2 gloo ranks, :func:`job`): a manager with ``keep_last=2`` saves steps 1-6,
  synchronously or asynchronously, and every rank is SIGKILLed at a random moment or when one
  rank reaches the ``n``-th ``unlink``/``rmdir`` (retention), ``replace``/``link``/``fsync``
  (the commit of ``metadata.json``), or ``write`` (half written) that shardsafe makes. Then a
  new manager must list every committed step that retention had no reason to delete (the
  newest two), no damaged step, and restore the newest committed step (or the one in flight,
  if it committed) bit-exact; a save after the crash must succeed and restore bit-exact.

Every check runs in the sandbox (bounded time and memory, file accesses audited). Bad
outcomes: ``lost-checkpoint``, ``silent-wrong-data``, ``damaged-counted``, ``damage-left``
(a killed manager left a step that does not check out), ``kept-damaged-over-intact``,
``next-save-failed``, ``foreign-exception:<type>``, ``check-raised:<type>``, ``hang``,
``outside-access``, ``child-error``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections import Counter
from typing import Any

from .jobs import rank_errors, read_counts, run_job
from .kill_child import install, report_errors
from .report import Report
from .sandbox import Result, Sandbox, campaign

__all__ = ["job", "run_manager"]

STEPS = [1, 2, 3, 4, 5, 6]
KEEP_LAST = 2
NEXT = 99  # the step saved after the crash
# (function, when, ranks it may be injected on): retention and commits happen on rank 0
POINTS = [
    ("unlink", "before", (0,)),
    ("unlink", "after", (0,)),
    ("rmdir", "before", (0,)),
    ("rmdir", "after", (0,)),
    ("replace", "before", (0,)),
    ("replace", "after", (0,)),
    ("link", "before", (0,)),
    ("link", "after", (0,)),
    ("fsync", "after", (0, 1)),
    ("write", "mid", (0, 1)),
]
PATCHED = tuple(sorted({fn for fn, _, _ in POINTS}))
DAMAGES = ["meta-flip", "data-flip", "data-delete", "data-truncate", "meta-delete", "empty-dir", "made-empty",
           "made-bytes", "made-copy"]


# --- the state each step holds, the same in every process ----------------------------------------


def _model(step: int | None = None) -> Any:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    if step is not None:
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.copy_(torch.arange(p.numel(), dtype=p.dtype).view(p.shape) * step + i - 0.5)
    return model


def _exact(model: Any, step: int) -> bool:
    import torch

    want = _model(step).state_dict()
    return all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


# --- the job that is killed ----------------------------------------------------------------------


def job(rank: int, world: int, port: int, root: str, plan: dict[str, Any]) -> None:
    """Rank ``rank`` of ``world`` saves ``STEPS`` with a manager (``plan``: ``async``, ``point``,
    ``count``). Rank 0 logs ``saved <step>`` when a save returned and ``closed`` at the end; a
    rank that raises writes ``error-r<rank>.txt`` and exits 1."""
    report_errors(os.path.join(root, f"error-r{rank}.txt"), lambda: _job(rank, world, port, root, plan))


def _job(rank: int, world: int, port: int, root: str, plan: dict[str, Any]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    from shardsafe import CheckpointManager


    torch.set_num_threads(1)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    models = {s: _model(s) for s in STEPS}
    counts: Counter = Counter()
    log = open(os.path.join(root, "log"), "ab", buffering=0) if rank == 0 else None
    open(os.path.join(root, f"ready-r{rank}"), "w").close()
    install(plan.get("point"), rank, counts, PATCHED)
    mgr = CheckpointManager(os.path.join(root, "ckpt"), keep_last=KEEP_LAST, async_save=plan["async"])
    for step in STEPS:
        mgr.save(step, models[step], force=True)
        if log:
            log.write(f"saved {step}\n".encode())
    mgr.close()
    if log:
        log.write(b"closed\n")
    if plan.get("count"):
        with open(os.path.join(root, f"counts-r{rank}.json"), "w") as f:
            json.dump(dict(counts), f)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def _committed(root: str, asynchronous: bool) -> tuple[list[int], int | None]:
    """The steps known committed from rank 0's log, and the one that may have committed."""
    saved, closed = [], False
    path = os.path.join(root, "log")
    if os.path.exists(path):
        with open(path) as f:
            for line in f.read().splitlines():
                if line == "closed":
                    closed = True
                else:
                    saved.append(int(line.split()[1]))
    if not asynchronous:
        done = saved
    else:  # a save returns once the previous one committed; close once the last did
        done = saved[:-1] if not closed else saved
    left = [s for s in STEPS if s not in done]
    return done, (left[0] if left else None)


# --- checks, run in the sandbox ------------------------------------------------------------------


def check_root(ckpt: str, next_step: int) -> dict[str, Any]:
    """What a new job finds under ``ckpt``: the counted and damaged steps, the step ``restore()``
    loads and whether it is bit-exact; then, with ``keep_last``, a save of ``next_step`` and what
    is left (steps, directories), and whether a restore of it is bit-exact."""
    from shardsafe import CheckpointError, CheckpointManager

    out: dict[str, Any] = {}
    mgr = CheckpointManager(ckpt, keep_last=KEEP_LAST, async_save=False)
    out["steps"], out["damaged"] = mgr.all_steps(), sorted(mgr.damaged_steps())
    model = _model()
    try:
        got = mgr.restore(model=model)
        out["restored"], out["exact"] = got, (got is None or _exact(model, got))
    except CheckpointError as e:  # nothing intact: refused, by name
        out["restored"], out["refused"] = None, f"{type(e).__name__}: {str(e)[:300]}"
    out["after_restore"] = mgr.all_steps()
    mgr.save(next_step, _model(next_step), force=True)
    out["after_save"] = mgr.all_steps()
    mgr.close()
    out["dirs"] = sorted(os.listdir(ckpt))
    again = CheckpointManager(ckpt)
    model = _model()
    out["next_restored"] = again.restore(model=model)
    out["next_exact"] = _exact(model, next_step)
    again.close()
    return out


def save_steps(ckpt: str, steps: list[int]) -> None:
    from shardsafe import CheckpointManager

    with CheckpointManager(ckpt, async_save=False) as mgr:
        for s in steps:
            mgr.save(s, _model(s), force=True)


def _failure(res: Result) -> str | None:
    abnormal = res.abnormal()
    if abnormal is not None:
        return abnormal
    if res.kind == "raised":
        return f"check-raised:{res.error_type}" if res.checkpoint_error else f"foreign-exception:{res.error_type}"
    return None


# --- damage trials -------------------------------------------------------------------------------


def _damage(rng: random.Random, ckpt: str, real: list[int], kind: str) -> tuple[int | None, str]:
    """Apply one damage; returns the real step it spoiled (None for a hand-made one) and a label."""
    def step_dir(s: int) -> str:
        return os.path.join(ckpt, f"step_{s:08d}")

    if kind.startswith("made") or kind == "empty-dir":
        s = rng.choice([max(real) + rng.randint(1, 3), rng.randint(0, max(real)) * 10 + 7])
        d = step_dir(s)
        if os.path.exists(d):
            return None, f"{kind}: step {s} exists"
        os.makedirs(d)
        if kind == "made-empty":
            open(os.path.join(d, "metadata.json"), "w").write("{}")
        elif kind == "made-bytes":
            open(os.path.join(d, "metadata.json"), "wb").write(rng.randbytes(rng.randint(0, 300)))
        elif kind == "made-copy":  # a real document, without its data files
            shutil.copy(os.path.join(step_dir(rng.choice(real)), "metadata.json"), os.path.join(d, "metadata.json"))
        return None, f"{kind} step {s}"
    s = rng.choice(real)
    d = step_dir(s)
    if not os.path.exists(os.path.join(d, "metadata.json")):
        return s, f"{kind}: step {s} already lost its metadata.json"
    data = sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))
    if kind.startswith("meta"):
        path = os.path.join(d, "metadata.json")
    else:
        path = os.path.join(d, rng.choice(data))
    if kind == "meta-delete" or kind == "data-delete":
        os.unlink(path)
    elif kind == "data-truncate":
        os.truncate(path, rng.randrange(os.path.getsize(path)))
    else:
        raw = bytearray(open(path, "rb").read())
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        open(path, "wb").write(bytes(raw))
    return s, f"{kind} step {s}"


def _damage_trial(box: Sandbox, rng: random.Random, trial: str, base: str, report: Report) -> None:
    ckpt = os.path.join(trial, "ckpt")
    shutil.copytree(base, ckpt)
    real = [1, 2, 3, 4, 5]
    spoiled, seen, labels = set(), set(), []  # seen: damage the manager's cheap check finds without reading data
    for kind in rng.sample(DAMAGES, rng.randint(1, 3)):
        s, label = _damage(rng, ckpt, real, kind)
        labels.append(label)
        if s is not None:
            spoiled.add(s)
            if kind in ("meta-flip", "meta-delete", "data-delete"):
                seen.add(s)
    intact = [s for s in real if s not in spoiled]
    label = "damage/" + ("all-spoiled" if not intact else "newest-spoiled" if max(real) in spoiled else "older-spoiled")
    detail = f"{'; '.join(labels)} (intact {intact})"
    res = box.call(check_root, ckpt, 100, roots=[trial], timeout=120)
    bad = _failure(res)
    if bad is not None:
        report.add(bad, f"{detail}: {res.error_type} {res.message[:300]}", path=label)
        return
    out = res.value
    found = []
    if not intact:
        if out["restored"] is not None:
            found.append(("silent-wrong-data", f"restored {out['restored']} although every real step was damaged"))
    elif out["restored"] != max(intact):
        found.append(("lost-checkpoint", f"restored {out['restored']}, the newest intact step is {max(intact)}"))
    if out["restored"] is not None and not out["exact"]:
        found.append(("silent-wrong-data", f"step {out['restored']} restored with other values"))
    if set(out["steps"]) & seen:
        found.append(("damaged-counted", f"counted {out['steps']}, damaged {sorted(seen)} (metadata or files)"))
    if intact and max(intact) not in out["after_save"]:
        found.append(("kept-damaged-over-intact", f"after saving 100 with keep_last=2: {out['after_save']}"))
    if out["next_restored"] != 100 or not out["next_exact"]:
        found.append(("next-save-failed", f"restore after the save: {out['next_restored']}, exact {out['next_exact']}"))
    for outcome, d in dict(found).items():
        report.add(outcome, f"{detail}: {d} ({out})", path=label)
    if not found:
        report.add("ok", path=label)


# --- kill trials ---------------------------------------------------------------------------------


def _count(world: int, asynchronous: bool, root: str, timeout: float) -> tuple[dict[int, dict[str, int]], float]:
    os.makedirs(root)
    start = time.monotonic()
    status, _ = run_job(job, world, root, {"async": asynchronous, "point": None, "count": True}, None, timeout)
    if status != "finished":
        raise RuntimeError(f"the counting run (world {world}, async {asynchronous}) ended {status}: {rank_errors(root)}")
    counts = read_counts(root, world)
    return counts, time.monotonic() - start


def _kill_trial(box: Sandbox, trial: str, sc: dict[str, Any], report: Report, timeout: float) -> None:
    pt = sc["point"]
    label = f"kill/ws{sc['world']}/{'async' if sc['async'] else 'sync'}/" + ("random" if pt is None else f"{pt['fn']}:{pt['when']}")
    status, _ = run_job(job, sc["world"], trial, {"async": sc["async"], "point": pt}, sc["delay"], timeout)
    if status in ("hang", "child-error"):
        report.add(status, f"{label} {pt}: {rank_errors(trial)}", path=label)
        return
    for r in range(sc["world"]):  # a rank that outlived its killed peer and raised: what, and from where?
        path = os.path.join(trial, f"error-r{r}.txt")
        if os.path.exists(path):
            with open(path) as f:
                kind, _, tb = f.read().partition("\n")
            frames = [line for line in tb.splitlines() if line.strip().startswith("File ")]
            inside = any("/shardsafe/" in line for line in frames)
            if inside and not kind.startswith("shardsafe."):
                report.add(f"foreign-exception:{kind}", f"{label} rank {r}: {tb[-1500:]}", path=label)
            where = "shardsafe" if inside else frames[-1].split(",")[0].strip() if frames else "?"
            report.notes[f"survivor-raised:{kind} in {where}"] += 1
    done, flight = _committed(trial, sc["async"])
    ckpt = os.path.join(trial, "ckpt")
    detail = f"{label} n={pt and pt['n']} {status}: committed {done}, in flight {flight}"
    if not os.path.isdir(ckpt):
        if done:
            report.add("lost-checkpoint", f"{detail}: no root", path=label)
        else:
            report.add("ok", path=label)
        return
    res = box.call(check_root, ckpt, NEXT, roots=[trial], timeout=120)
    bad = _failure(res)
    if bad is not None:
        report.add(bad, f"{detail}: {res.error_type} {res.message[:300]}", path=label)
        return
    out = res.value
    found = []
    newest = max(done) if done else None
    allowed = {s for s in (newest, flight) if s is not None and (newest is None or s >= newest)}
    if newest is not None and out["restored"] not in allowed:
        found.append(("lost-checkpoint", f"restored {out['restored']}, expected one of {sorted(allowed)}"))
    if out["restored"] is not None and not out["exact"]:
        found.append(("silent-wrong-data", f"step {out['restored']} restored with other values"))
    kept = sorted(done)[-KEEP_LAST:]
    if any(s not in out["steps"] for s in kept) and not (flight is not None and flight in out["steps"]
                                                         and all(s in out["steps"] for s in kept[1:])):
        found.append(("lost-checkpoint", f"found {out['steps']}, the newest committed {kept} must be there"))
    if out["damaged"]:
        found.append(("damage-left", f"damaged steps {out['damaged']}"))
    if out["next_restored"] != NEXT or not out["next_exact"]:
        found.append(("next-save-failed", f"restore after the save: {out['next_restored']}, exact {out['next_exact']}"))
    for outcome, d in dict(found).items():
        report.add(outcome, f"{detail}: {d} ({out})", path=label)
    if not found:
        report.add("ok", path=label)


def _scenarios(rng: random.Random, trials: int, counts: dict, took: dict) -> list[dict[str, Any]]:
    """A third of the trials damage, the rest kill (a quarter of those at random moments);
    the first kill trials take each point once, on world size 1, sync and async alternately."""
    plans: list[dict[str, Any]] = []
    fixed = [(1, i % 2 == 1, fn, when, 0) for i, (fn, when, _) in enumerate(POINTS)]
    for i in range(trials):
        if i % 3 == 2:
            plans.append({"kind": "damage"})
            continue
        if i % 4 == 3:
            world, asynchronous = rng.choice([1, 2]), rng.random() < 0.5
            plans.append({"kind": "kill", "world": world, "async": asynchronous, "point": None,
                          "delay": rng.uniform(0, took[(world, asynchronous)])})
            continue
        if fixed:
            world, asynchronous, fn, when, rank = fixed.pop(0)
        else:
            world, asynchronous = rng.choice([1, 2]), rng.random() < 0.5
            fn, when, ranks = rng.choice(POINTS)
            rank = rng.choice([r for r in ranks if r < world])
        total = counts[(world, asynchronous)][rank].get(fn, 0)
        if total == 0:
            plans.append({"kind": "damage"})
            continue
        plans.append({"kind": "kill", "world": world, "async": asynchronous, "delay": None,
                      "point": {"fn": fn, "when": when, "rank": rank, "n": rng.randint(1, total)}})
    return plans


def run_manager(trials: int, seed: int, *, workdir: str | None = None, timeout: float = 120.0) -> Report:
    """Run ``trials`` manager trials; see the module docstring."""
    rng = random.Random(seed)
    with campaign("manager", workdir) as (report, root, box):
        base = os.path.join(root, "base")
        res = box.call(save_steps, base, [1, 2, 3, 4, 5], roots=[root], timeout=300)
        if res.kind != "returned":
            raise RuntimeError(f"could not save the base steps: {res.error_type} {res.message}")
        counts, took = {}, {}
        for world in (1, 2):
            for asynchronous in (False, True):
                key = (world, asynchronous)
                counts[key], took[key] = _count(world, asynchronous, os.path.join(root, f"count-{world}-{asynchronous}"), timeout)
        for i, sc in enumerate(_scenarios(rng, trials, counts, took)):
            trial = os.path.join(root, f"trial-{i}")
            os.makedirs(trial)
            report.trials += 1
            if sc["kind"] == "damage":
                _damage_trial(box, rng, trial, base, report)
            else:
                _kill_trial(box, trial, sc, report, timeout)
            shutil.rmtree(trial, ignore_errors=True)
    return report
