"""Racing jobs: two 2-rank jobs save different states into one directory at the same moment.

Each job is its own gloo process group on its own port (``run_ranks`` in a thread each); the
four ranks meet at a file barrier, then save together. Three modes:

- ``fresh``: an empty directory, ``save_overwrite=False``: exactly one job commits, the other
  gets a ``CheckpointError`` on every rank;
- ``overwrite``: a committed checkpoint is there, ``save_overwrite=True``: exactly one wins,
  unless the later one read the committed version after the earlier one's commit had begun
  (then it legally replaced it and is there): each job's coordinator records when it read the
  version and when it committed (:func:`_clocked`);
- ``existing``: a committed checkpoint is there, ``save_overwrite=False``: both are refused.

Then the directory must load bit-exact as the winner's state (or the previous one if nobody
won), pass ``verify`` (no file it names is missing), and hold no litter. Outcomes besides
``ok``: ``both-won``, ``none-won``, ``split-job`` (ranks of one job disagree), ``not-refused``,
``lost-checkpoint``, ``silent-wrong-data``, ``verify-failed``, ``litter``,
``foreign-exception:<type>``, ``hang`` (a job, or the check of the directory, did not finish),
``worker-crash`` (the check's worker died).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Any

from .kill import litter
from .paths import run_path
from .report import Report
from .sandbox import Sandbox, campaign
from .states import Case, save_case, truth_files, write_state_truth

__all__ = ["MODES", "racer", "run_race"]

MODES = ("fresh", "overwrite", "existing")
PREVIOUS = 10  # version of the checkpoint already there in the overwrite and existing modes


def racer(rank: int, world: int, job: int, directory: str, version: int, overwrite: bool, barrier: str) -> dict[str, Any]:
    """One rank of job ``job``: build the state, wait for all four ranks, save; report what happened."""
    from shardsafe import Checkpointer
    from shardsafe.errors import CheckpointError

    from .states import sharded_rank_state

    state = sharded_rank_state(rank, version, large=True, dtensor=False)
    clock = _clocked()
    open(os.path.join(barrier, f"{job}-{rank}"), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(barrier)) < 2 * world and time.monotonic() < deadline:
        time.sleep(0.0005)
    t0 = time.monotonic()  # CLOCK_MONOTONIC: comparable between processes of one machine
    try:
        Checkpointer().save(directory, state, save_overwrite=overwrite)
        out = {"status": "won", "type": "", "message": ""}
    except CheckpointError as e:
        out = {"status": "refused", "type": type(e).__name__, "message": str(e)[:2000]}
    except Exception as e:  # noqa: BLE001 - classified by the campaign
        out = {"status": "foreign", "type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e)[:2000]}
    out.update(t0=t0, t1=time.monotonic(), **clock)
    return out


def _clocked() -> dict[str, float]:
    """Record, on the coordinator, when the save read the committed version (``read``) and when
    its commit began (``commit``): CLOCK_MONOTONIC, like ``t0``/``t1``."""
    from shardsafe.engine import writer

    clock: dict[str, float] = {}
    read, put = writer.committed_version, writer.put_metadata

    def timed_read(storage: Any) -> Any:
        clock.setdefault("read", time.monotonic())
        return read(storage)

    def timed_put(*args: Any, **kwargs: Any) -> Any:
        clock["commit"] = time.monotonic()
        return put(*args, **kwargs)

    writer.committed_version, writer.put_metadata = timed_read, timed_put  # type: ignore[assignment]
    return clock


def _job_outcome(ranks: list[dict[str, Any]] | str) -> str:
    if isinstance(ranks, str):
        return ranks
    statuses = {r["status"] for r in ranks}
    foreign = [r for r in ranks if r["status"] == "foreign"]
    if foreign:
        return f"foreign-exception:{foreign[0]['type']}"
    return statuses.pop() if len(statuses) == 1 else "split-job"


def _run_jobs(trial: str, directory: str, mode: str, versions: tuple[int, int], timeout: float) -> tuple[list[Any], list[str]]:
    from ..helpers import run_ranks

    barrier = os.path.join(trial, "barrier")
    os.makedirs(barrier)
    results: list[Any] = [None, None]
    errors: list[str] = []

    def job(j: int) -> None:
        try:
            results[j] = run_ranks(2, racer, j, directory, versions[j], mode == "overwrite", barrier, timeout=timeout)
        except TimeoutError:
            results[j] = "hang"
        except BaseException as e:  # noqa: BLE001 - a rank died outside the save
            results[j] = f"job-error:{type(e).__name__}"
            errors.append(f"job {j}: {type(e).__name__}: {e}"[:2000])

    threads = [threading.Thread(target=job, args=(j,)) for j in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def _expected(mode: str, outcomes: list[str], results: list[Any], versions: tuple[int, int]) -> tuple[list[str], list[int]]:
    """Bad outcomes of the jobs themselves, and the versions the directory may hold (the first
    is the one it should)."""
    previous = [PREVIOUS] if mode != "fresh" else []
    won = [j for j in range(2) if outcomes[j] == "won"]
    bad = [o for o in outcomes if o not in ("won", "refused")]
    if bad:  # a job failed oddly: whatever was committed last must still be whole
        return bad, [*(versions[j] for j in range(2) if outcomes[j] != "refused"), *previous]
    if mode == "existing":
        return ([] if not won else ["not-refused"]), previous
    if not won:
        return ["none-won"], previous
    if len(won) == 1:
        return [], [versions[won[0]]]
    reads = [min(r.get("read", float("inf")) for r in res) for res in results]
    commits = [min(r.get("commit", float("inf")) for r in res) for res in results]
    first, second = (0, 1) if commits[0] <= commits[1] else (1, 0)
    if mode == "overwrite" and reads[second] >= commits[first]:  # it saw the first's commit (or raced only its rename): it replaced it
        return [], [versions[second]]
    return ["both-won"], [versions[second], versions[first]]


def _check_dir(box: Sandbox, directory: str, accept: list[int], truths: dict[int, str], out: str) -> list[str]:
    """The directory loads bit-exact as one of ``accept``, verifies, and holds no litter."""
    from shardsafe import Checkpointer

    for v in accept:
        case = Case("single" if v == PREVIOUS else "sharded", directory, v, True, truths[v])
        roots = [directory, out, *truth_files(case)]
        res = box.call(run_path, case, "unshard", out, roots=roots)
        if res.kind != "returned":
            return [f"{res.failure('lost-checkpoint')} ({res.error_type}: {res.message[:300]})"]
        if not res.value:
            res = box.call(run_path, case, "verify", out, roots=roots)
            if res.kind != "returned":
                return [f"{res.failure('verify-failed')} ({res.error_type}: {res.message[:300]})"]
            extra = litter(directory, Checkpointer().get_metadata(directory, no_dist=True).data_files())
            return [f"litter ({extra})"] if extra else []
    return [f"silent-wrong-data ({res.value})"]


def run_race(trials: int, seed: int, *, workdir: str | None = None, timeout: float = 120.0) -> Report:
    """Run ``trials`` races, the modes in turn; see the module docstring. ``seed`` picks the versions."""
    with campaign("race", workdir) as (report, root, box):
        truths = {}
        for kind, v in [("sharded", seed % 7 + 1), ("sharded", seed % 7 + 2), ("single", PREVIOUS)]:
            truths[v] = os.path.join(root, f"truth-{kind}-{v}")
            write_state_truth(Case(kind, "", v, True, truths[v]))
        versions = (seed % 7 + 1, seed % 7 + 2)
        out = os.path.join(root, "out")
        os.makedirs(out)
        for i in range(trials):
            mode = MODES[i % len(MODES)]
            trial = os.path.join(root, f"trial-{i}")
            directory = os.path.join(trial, "ckpt")
            os.makedirs(trial)
            if mode != "fresh":
                save_case(Case("single", directory, PREVIOUS, True))
            results, errors = _run_jobs(trial, directory, mode, versions, timeout)
            outcomes = [_job_outcome(r) for r in results]
            found, accept = _expected(mode, outcomes, results, versions)
            detail = f"{mode}: jobs {outcomes}: " + "; ".join(errors + [
                f"{r[0]['type']}: {r[0]['message']}" for r in results if isinstance(r, list) and r[0]["status"] != "won"
            ])
            if accept:
                found += _check_dir(box, directory, accept, truths, out)
            report.trials += 1
            if not found:
                report.add("ok", path=mode)
            for outcome in dict.fromkeys(found):
                name, _, why = outcome.partition(" (")
                report.add(name, f"{detail} | {why.rstrip(')')}" if why else detail, path=mode)
            shutil.rmtree(trial, ignore_errors=True)
    return report
