"""Load a checkpoint on N gloo ranks, RUNS times for each N given (3 if none), each rank a
process that ends the normal way (interpreter finalization) right after the load, with no
barrier and no ``destroy_process_group``, the way a training script ends. Prints a JSON list:
for each run, in order, each rank's exit status (0, a nonzero exit code, or minus the signal: -6
is an abort, ``terminate called without an active exception``).

    python -m tests.load_exit_runs CKPT_DIR RUNS [WORLD_SIZE ...]

``CKPT_DIR`` holds the checkpoint of :func:`make_checkpoint`. Ranks are forked from this
process after it has imported torch (a run takes about a second, not three interpreter
starts), and each runs on one CPU with its gloo threads at the lowest priority, so that a
backend thread still busy after the load has returned loses the race to the exit nearly every
time instead of now and then.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import shardsafe  # noqa: E402

from .helpers import free_port  # noqa: E402

KEYS = 8


def make_checkpoint(path: str) -> None:
    """The checkpoint the runs load: ``t0``..``t7`` (float32, 64 x 32) and ``step`` = 11."""
    g = torch.Generator().manual_seed(0)
    state: dict = {f"t{i}": torch.randn(64, 32, generator=g) for i in range(KEYS)}
    state["step"] = 11
    shardsafe.Checkpointer().save(path, state)


def _starve_backend_threads() -> None:
    """This process on one CPU, its gloo threads at the lowest priority (``SCHED_IDLE``): they
    run only while the main thread waits."""
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        if name.startswith(("pt_gloo", "gloo")):
            os.sched_setaffinity(int(tid), {cpu})
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))


def _rank(path: str, rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    _starve_backend_threads()
    target: dict = {f"t{i}": torch.zeros(64, 32) for i in range(KEYS)}
    target["step"] = 0
    shardsafe.Checkpointer().load(path, target)
    if target["step"] != 11:
        os._exit(3)


def _wait(pids: list[int], timeout: float) -> list[int | str]:
    status: dict[int, int | str] = {}
    deadline = time.monotonic() + timeout
    while len(status) < len(pids):
        for r, pid in enumerate(pids):
            if r not in status:
                done, st = os.waitpid(pid, os.WNOHANG)
                if done:
                    status[r] = -os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)
                elif time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    status[r] = "hung"
        time.sleep(0.005)
    return [status[r] for r in range(len(pids))]


def runs_in_a_process(path: str, runs: int, *world_sizes: int, timeout: float = 120.0) -> list[list[int | str]]:
    """``runs`` runs of each of ``world_sizes`` ranks on the checkpoint at ``path``, in one fresh
    interpreter (``python -m tests.load_exit_runs``): each run's exit statuses, in rank order."""
    from .helpers import run_process

    src = os.path.dirname(os.path.dirname(shardsafe.__file__))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, root])}
    out = run_process(
        [sys.executable, "-m", "tests.load_exit_runs", path, str(runs), *map(str, world_sizes)],
        cwd=root, env=env, capture_output=True, text=True, timeout=timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(f"tests.load_exit_runs exited {out.returncode}:\n{out.stderr[-3000:]}")
    statuses = json.loads(out.stdout.strip().splitlines()[-1])
    if [len(st) for st in statuses] != [ws for ws in world_sizes for _ in range(runs)]:
        raise RuntimeError(f"runs of {[len(st) for st in statuses]} ranks reported, not {runs} of each of {world_sizes}:\n{out.stderr[-2000:]}")
    return statuses


def main() -> None:
    path, runs = sys.argv[1], int(sys.argv[2])
    world_sizes = [int(a) for a in sys.argv[3:]] or [3]
    out = []
    for world_size in (ws for ws in world_sizes for _ in range(runs)):
        port = free_port()
        pids = []
        for r in range(world_size):
            pid = os.fork()
            if pid == 0:
                _rank(path, r, world_size, port)
                return  # this rank's interpreter now exits the normal way
            pids.append(pid)
        out.append(_wait(pids, timeout=60))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
