"""Node-loss campaign: jobs with the memory tier lose one or two simulated nodes at random
moments, and restart on the survivors with another world size.

A trial: ``N`` simulated nodes (2-4, one or two gloo ranks each, each node with its own memory
directory) run a ``CheckpointManager(memory_dir=..., replicas=1 or 2, persist_every=3)`` that
saves steps 1-6 of a model sharded over every rank (DTensor, dim 0; known values per step). At a
random moment (before the first save, during a staging copy, a replication, a persist, between
steps, or after the end) every process of the job is SIGKILLed (a lost node breaks the process
group, so the job dies whole), and one node's memory directory (or two) is deleted. Then a job
on the surviving nodes, with one or two ranks per node, restores.

Checks, against the known values of every step:
- the restore is bit-exact on every rank, and every rank restored the same step (no mixed step);
- the step is never older than the newest step that was safe in memory before the loss (its
  ``memtier.json`` on every node: every rank's file on two nodes) when the loss could not take
  every copy (fewer nodes lost than ``replicas + 1``), nor older than the newest durable step;
- every durable step committed before the loss is still counted (nothing lost from tier 2);
- no rank hangs past the trial's timeout.

Bad outcomes: ``silent-wrong-data``, ``mixed-step``, ``older-than-safe``, ``older-than-durable``,
``lost-durable``, ``restore-raised:<type>``, ``hang``, ``child-error``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from typing import Any

from .jobs import kill_all
from .kill_child import report_errors
from .report import Report
from .sandbox import CONTEXT, campaign

__all__ = ["run_nodeloss"]

STEPS = 6
PERSIST = 3
SHAPES = {"w": (12, 5), "b": (9,)}
TIMEOUT = 180.0  # wall time of one job; a loaded 2-core machine takes up to a minute for what needs seconds


def _value(key: str, step: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, key)))
    return torch.randn(SHAPES[key], generator=g)


class _Model:
    """Parameters sharded on dim 0 over every rank."""

    def __init__(self, ws: int) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (ws,))
        self.module = torch.nn.Module()
        for k, shape in SHAPES.items():
            self.module.register_parameter(k, torch.nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, [Shard(0)], src_data_rank=None)))

    def set_step(self, step: int) -> None:
        import torch

        with torch.no_grad():
            for k in SHAPES:
                p = getattr(self.module, k)
                full, ws = _value(k, step), p.device_mesh.size()
                lo = p.device_mesh.get_local_rank() * ((full.shape[0] + ws - 1) // ws)
                local = p.to_local()
                local.copy_(full[lo : lo + local.shape[0]])

    def exact(self, step: int) -> bool:
        import torch

        return all(torch.equal(getattr(self.module, k).full_tensor(), _value(k, step)) for k in SHAPES)


def job(rank: int, world: int, port: int, work: str, plan: dict[str, Any]) -> None:
    report_errors(os.path.join(work, f"error-{plan['phase']}-r{rank}.txt"), lambda: _job(rank, world, port, work, plan))


def _job(rank: int, world: int, port: int, work: str, plan: dict[str, Any]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from shardsafe import CheckpointManager

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    node = plan["nodes"][rank]
    model = _Model(world)
    open(os.path.join(work, f"ready-{plan['phase']}-r{rank}"), "w").close()
    mgr = CheckpointManager(
        os.path.join(work, "durable"), memory_dir=os.path.join(work, f"node{node}"), node=node, replicas=plan["replicas"],
        persist_every=PERSIST,
    )
    if plan["phase"] == "restore":
        step = mgr.restore(model=model.module)
        out = {
            "step": step, "tier": mgr.last_restore.tier, "exact": step is None or model.exact(step),
            "durable": mgr.all_steps(), "damaged": sorted(mgr.damaged_steps()),
        }
        with open(os.path.join(work, f"result-r{rank}.json"), "w") as f:
            json.dump(out, f)
    else:
        for s in range(1, STEPS + 1):
            model.set_step(s)
            mgr.save(s, model.module)
    mgr.close()
    dist.barrier()
    dist.destroy_process_group()


def _run(work: str, plan: dict[str, Any], delay: float | None, spans: list[float] | None = None) -> str:
    """Run one job to its end, or SIGKILL every rank after ``delay`` seconds: "finished",
    "killed", "hang" or "child-error" (why: in ``work``/``why-<phase>.txt``). A job that
    finished appends to ``spans`` how long it ran once its ranks were ready."""
    out, span = _run_job(work, plan, delay)
    if out.startswith("child-error"):
        with open(os.path.join(work, f"why-{plan['phase']}.txt"), "w") as f:
            f.write(out)
        return "child-error"
    if out == "finished" and spans is not None:
        spans.append(span)
    return out


def _run_job(work: str, plan: dict[str, Any], delay: float | None) -> tuple[str, float]:
    from ..helpers import free_port

    world = len(plan["nodes"])
    port = free_port()
    procs = [CONTEXT.Process(target=job, args=(r, world, port, work, plan), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while not all(os.path.exists(os.path.join(work, f"ready-{plan['phase']}-r{r}")) for r in range(world)):
            if any(p.exitcode is not None for p in procs) or time.monotonic() > deadline:
                late = time.monotonic() > deadline
                return f"child-error: {'not ready after the timeout' if late else 'a rank exited before it was ready'} (exit codes {[p.exitcode for p in procs]})", 0.0
            time.sleep(0.005)
        ready = time.monotonic()
        end = ready + (delay if delay is not None else TIMEOUT)
        while any(p.exitcode is None for p in procs) and time.monotonic() < end:
            time.sleep(0.005)
        span = time.monotonic() - ready
        if delay is None and any(p.exitcode is None for p in procs):
            return "hang", span
    finally:
        kill_all(procs)
    codes = [p.exitcode for p in procs]
    if -signal.SIGKILL in codes:
        return "killed", span
    return (f"child-error: exit codes {codes}", span) if any(codes) else ("finished", span)


def _safe_before(work: str, nodes: int) -> int | None:
    """The newest step whose safe record every node holds."""
    from shardsafe.memtier import SAFE_FILENAME

    per_node = []
    for n in range(nodes):
        d = os.path.join(work, f"node{n}")
        steps = set()
        for name in os.listdir(d) if os.path.isdir(d) else ():
            try:
                with open(os.path.join(d, name, SAFE_FILENAME)) as f:
                    if json.load(f).get("safe"):
                        steps.add(int(name[5:]))
            except (OSError, ValueError):
                pass
        per_node.append(steps)
    common = set.intersection(*per_node) if per_node else set()
    return max(common) if common else None


def _phase(work: str, nodes: int) -> str:
    """What the kill interrupted, as the directories show it: a step being persisted (a durable
    step directory without metadata.json), a copy being received (a ``.part`` file), a tier-0
    write (a memory step directory without metadata.json), or none of them (between steps)."""
    root = os.path.join(work, "durable")
    for name in os.listdir(root) if os.path.isdir(root) else ():
        if not os.path.exists(os.path.join(root, name, "metadata.json")):
            return "persist"
    found, steps = set(), 0
    for n in range(nodes):
        d = os.path.join(work, f"node{n}")
        for name in os.listdir(d) if os.path.isdir(d) else ():
            steps += 1
            files = os.listdir(os.path.join(d, name))
            if any(f.endswith(".part") for f in files):
                found.add("replication")
            elif "metadata.json" not in files:
                found.add("tier-0 write")
            elif "memtier.json" not in files:
                found.add("replication")
    for phase in ("replication", "tier-0 write"):
        if phase in found:
            return phase
    return "between steps" if steps else "before the first save"


def _durable_before(work: str) -> list[int]:
    root = os.path.join(work, "durable")
    if not os.path.isdir(root):
        return []
    return sorted(int(n[5:]) for n in os.listdir(root) if os.path.exists(os.path.join(root, n, "metadata.json")))


def _trial(work: str, rng: random.Random, notes: Any, spans: list[float]) -> tuple[str, str, str]:
    n_nodes = rng.choice([2, 3, 4])
    per = rng.choice([1, 2]) if n_nodes == 2 else 1
    replicas = 2 if n_nodes >= 3 and rng.random() < 0.5 else 1
    lose = 2 if n_nodes >= 3 and rng.random() < 0.4 else 1
    nodes = [n for n in range(n_nodes) for _ in range(per)]
    # a kill at a random moment of the job's run (before the first save ... after the last): the
    # window is as long as the jobs that finished took (1.5 s until one has), so that a machine
    # that runs them faster or slower still kills most jobs mid-run, not after their end
    kill, at = rng.random() < 0.85, rng.random()
    delay = at * (sorted(spans)[len(spans) // 2] if spans else 1.5) if kill else None
    path = f"{n_nodes}x{per} r{replicas} lose{lose}"
    first = _run(work, {"phase": "train", "nodes": nodes, "replicas": replicas}, delay, spans)
    notes[f"job:{first}"] += 1
    if first in ("hang", "child-error"):
        return first, path, _errors(work, "train")
    notes[f"killed-during:{_phase(work, n_nodes) if first == 'killed' else 'nothing (the job finished)'}"] += 1
    safe = _safe_before(work, n_nodes) if lose <= replicas else None
    durable = _durable_before(work)
    lost = rng.sample(range(n_nodes), lose)
    for n in lost:
        shutil.rmtree(os.path.join(work, f"node{n}"), ignore_errors=True)
    survivors = [n for n in range(n_nodes) if n not in lost]
    new_per = rng.choice([1, 2])
    new_nodes = [n for n in survivors for _ in range(new_per)]
    second = _run(work, {"phase": "restore", "nodes": new_nodes, "replicas": replicas}, None)
    what = f"{path}, killed after {delay if delay is None else round(delay, 2)} s ({first}), lost {lost}, restart on {new_nodes}"
    if second == "hang":
        return "hang", path, what
    if second != "finished":
        err = _errors(work, "restore")
        if err.startswith("child-error"):  # no rank raised: it did not start, or died
            return "restore-child-error", path, f"{what}: {err}"
        kind = err.splitlines()[0] if err else "unknown"
        return f"restore-raised:{kind.rsplit('.', 1)[-1]}", path, f"{what}: {err[-600:]}"
    results = []
    for r in range(len(new_nodes)):
        with open(os.path.join(work, f"result-r{r}.json")) as f:
            results.append(json.load(f))
    steps = {r["step"] for r in results}
    step = results[0]["step"]
    notes[f"tier:{results[0]['tier']}"] += 1
    notes["safe-before-loss" if safe is not None else "nothing-safe-before-loss"] += 1
    what += f": restored {step} from {results[0]['tier']} (safe before: {safe}, durable: {durable})"
    if len(steps) > 1:
        return "mixed-step", path, what
    if not all(r["exact"] for r in results):
        return "silent-wrong-data", path, what
    if safe is not None and (step is None or step < safe):
        return "older-than-safe", path, what
    if durable and (step is None or step < durable[-1]):
        return "older-than-durable", path, what
    if any(s not in results[0]["durable"] for s in durable) or results[0]["damaged"]:
        return "lost-durable", path, what
    return "ok", path, what


def _errors(work: str, phase: str) -> str:
    """The first failing rank's error, or why the job failed without one."""
    for name in sorted(os.listdir(work)):
        if name.startswith(f"error-{phase}-") and name.endswith(".txt"):
            with open(os.path.join(work, name)) as f:
                return f.read()
    why = os.path.join(work, f"why-{phase}.txt")
    if os.path.exists(why):
        with open(why) as f:
            return f.read()
    return ""


def run_nodeloss(trials: int, seed: int, *, workdir: str | None = None) -> Report:
    rng = random.Random(seed)
    spans: list[float] = []  # how long the jobs that were not killed ran, once ready
    with campaign("nodeloss", workdir) as (report, root, _box):
        for i in range(trials):
            work = os.path.join(root, f"t{i}")
            os.makedirs(work)
            outcome, path, example = _trial(work, rng, report.notes, spans)
            report.trials += 1
            report.add(outcome, example, path=path)
            report.notes[f"lose{path.split('lose')[1]}"] += 1
            shutil.rmtree(work, ignore_errors=True)
    return report
