"""The tests' shared helpers: bit-exact comparison, the rank spawner, hang detection that a busy
machine does not trip, a per-run cache of expensive checkpoints, and the Megatron-Core save.

Test modules import from here (or from the other helper modules: ``servers``, ``simulate``,
``sealing``, ``spec_reader``, ``training``...), never from another ``test_*`` module.

Rank spawning: ``run_ranks(world_size, fn, *args)`` returns each rank's return value, in rank
order. If any rank raises, the first failing rank's exception is re-raised here with every
rank's traceback attached. Processes come from a forkserver that has already imported torch, so
a rank starts in well under a second. ``fn`` must be a module-level function (it is pickled by
reference), and should return plain values: tensors sent back through the queue outlive their
process badly.

Hangs: a rank "hangs" when it has not finished and, for ``timeout`` seconds of wall time, every
thread of every unfinished rank slept without using CPU (waiting for a peer or a lock that never
comes), or when the ranks used ``timeout`` seconds of CPU each without finishing. Ranks that
wait for a core or the disk on a loaded machine are runnable or in disk wait, not asleep, so a
busy neighbour slows a test down but does not fail it (see :class:`Watchdog`).
"""

from __future__ import annotations

import fcntl
import math
import multiprocessing as mp
import os
import queue as queue_mod
import random
import shutil
import socket
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CTX", "Watchdog", "assert_bits", "assert_same", "bits", "built_once", "dcp_failure", "device_mesh", "dtensor", "flip_byte", "free_port", "full_tensor",
    "placements", "run_process",
    "megatron_cuts", "megatron_reshard", "megatron_torch_dist_save", "megatron_truth", "run_ranks",
]


# ------------------------------------------------------------------ bit-exact comparison


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (on the CPU, in row-major order): equal bytes, equal tensor, NaN
    payloads and the sign of zero included, which ``torch.equal`` would not tell apart."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_bits(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """``got`` is ``want`` bit for bit: same dtype, same shape, same bytes."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(bits(got), bits(want)), f"{what}: bytes differ"


def assert_same(got: Any, want: Any, where: str = "value") -> None:
    """Equal, with the same types all the way down (tuple is not list, np.float64 is not float,
    OrderedDict is not dict, dict order included), NaN equal to NaN, tensors bit-exact."""
    assert type(got) is type(want), (where, got, want)
    if isinstance(want, torch.Tensor):
        assert_bits(got, want, where)
    elif isinstance(want, (float, np.floating)) and math.isnan(want):
        assert math.isnan(got), where
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    else:
        assert got == want, (where, got, want)


def flip_byte(location: str, name: str, pos: int, mask: int = 0x5A) -> None:
    """XOR the byte at ``pos`` of file ``name`` under ``location`` (a local directory or a URL)
    with ``mask``, replacing the file atomically."""
    from shardsafe.storage import open_storage

    storage = open_storage(location)
    raw = bytearray(storage.read(name))
    raw[pos] ^= mask
    storage.put_atomic(name, bytes(raw), overwrite=True)


def dcp_failure(e: BaseException) -> BaseException:
    """The one rank's error inside DCP's ``CheckpointException``."""
    from torch.distributed.checkpoint.api import CheckpointException

    assert isinstance(e, CheckpointException), repr(e)
    (failure,) = e.failures.values()
    return failure[0] if isinstance(failure, tuple) else failure  # (exception, traceback summary)


# ------------------------------------------------------------------ deterministic tensors, DTensors


def full_tensor(key: str, shape, dtype=torch.float32) -> torch.Tensor:
    """The same deterministic global tensor in every process."""
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randn(shape, generator=g).to(dtype)


def device_mesh(ws, mesh_shape):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", mesh_shape)


def placements(spec):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for p in spec:
        if p == "R":
            out.append(Replicate())
        elif p.startswith("SS"):  # SS<dim>/<split_factor>
            d, sf = p[2:].split("/")
            out.append(_StridedShard(int(d), split_factor=int(sf)))
        else:
            out.append(Shard(int(p[1:])))
    return out


def dtensor(key, shape, mesh_shape, spec, dtype=torch.float32):
    from torch.distributed.tensor import distribute_tensor

    mesh = device_mesh(None, mesh_shape)
    # every rank holds the full tensor: split locally (also allows uneven _StridedShard)
    return distribute_tensor(full_tensor(key, shape, dtype), mesh, placements(spec), src_data_rank=None)


# ------------------------------------------------------------------ hang detection

_TICKS = os.sysconf("SC_CLK_TCK")


def _progress(pid: int) -> tuple[float, bool]:
    """CPU seconds process ``pid`` has used (every thread), and whether any of its threads is
    runnable, in disk wait or stopped (``R``, ``D``, ``T``); (0, False) once it is gone."""
    cpu, active = 0.0, False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return cpu, active
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        active = active or fields[0] in ("R", "D", "T", "t")
        cpu += (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
    return cpu, active


def _with_descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process below them (a rank's own workers count as its progress)."""
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except OSError:
                continue
    return out


class Watchdog:
    """Tells a hang from a slow machine, for processes ``pids`` and their descendants (call
    :meth:`check` now and then).

    A hang is ``idle_s`` seconds of wall time during which every thread of every process slept
    without using CPU, or more than ``cpu_s`` seconds of CPU used since the watch began. Time
    spent waiting for a core or for the disk does not count: such a thread is runnable or in
    disk wait, not asleep.
    """

    def __init__(self, pids: list[int], *, idle_s: float, cpu_s: float) -> None:
        self.pids, self.idle_s, self.cpu_s = list(pids), idle_s, cpu_s
        self.cpu0 = self.last = self._cpu_and_active()[0]
        self.idle_since = time.monotonic()

    def _cpu_and_active(self) -> tuple[float, bool]:
        got = [_progress(p) for p in _with_descendants(self.pids)]
        return sum(c for c, _ in got), any(a for _, a in got)

    def check(self) -> str | None:
        """Why the processes are hung (None: they are not, so far)."""
        (cpu, active), now = self._cpu_and_active(), time.monotonic()
        if cpu > self.last or active:
            self.last, self.idle_since = cpu, now
        if cpu - self.cpu0 > self.cpu_s:
            return f"they used {cpu - self.cpu0:.1f} s of CPU without finishing"
        if now - self.idle_since > self.idle_s:
            return f"every thread slept without using CPU for {self.idle_s} s"
        return None


def run_process(args: list[str], *, timeout: float = 120.0, check: bool = False, capture_output: bool = False,
                **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` whose ``timeout`` bounds a hang (the :class:`Watchdog`'s rules: the process
    and its children slept without CPU for ``timeout`` s, or used 4 x ``timeout`` s of CPU),
    not the wall time a loaded machine makes it take. Raises ``subprocess.TimeoutExpired`` on a hang."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with subprocess.Popen(args, **kwargs) as proc:
        watch = Watchdog([proc.pid], idle_s=timeout, cpu_s=4 * timeout)
        while True:
            try:
                out, err = proc.communicate(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                why = watch.check()
                if why is not None:
                    proc.kill()
                    out, err = proc.communicate()
                    raise subprocess.TimeoutExpired(args, timeout, output=out, stderr=f"{err or ''}\n(hung: {why})") from None
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


# ------------------------------------------------------------------ rank spawning

CTX = mp.get_context("forkserver")
# shardsafe imports its parts on first use; torch.distributed.tensor, fsdp and _dynamo (which FSDP2
# and DTensor ops import) cost about 1.5 s of CPU in every rank that would import them itself, and
# lightning 1.9 s in each rank of the Lightning tests (the forkserver skips a module that is not
# installed). Not megatron.core: the alias tests import it after shardsafe.megatron.install().
# A process has one forkserver and one preload list: every test module uses this context.
PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp", "torch._dynamo",
    "lightning", "shardsafe.api", "shardsafe.manager", "shardsafe.hf", "shardsafe.verify",
]
CTX.set_forkserver_preload(PRELOAD)


_PORTS = (20000, 32000)  # below the kernel's ephemeral range (32768-60999 here), which client sockets take ports from


def free_port() -> int:
    """A port free now, outside the ephemeral range: a port the kernel hands out for port 0 can be
    taken by any client connection before our server binds it (seen in CI: EADDRINUSE)."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(*_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the range is crowded: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue, backend: str = "gloo") -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        try:
            dist.init_process_group(
                backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            )
        except Exception as e:
            if "EADDRINUSE" in str(e):  # another process took the port after free_port: run_ranks tries another
                queue.put((rank, False, _PortTaken(port), traceback.format_exc()))
                return
            raise
        try:
            result = fn(rank, world_size, *args)
        except BaseException as e:  # noqa: BLE001 - reported before the group goes: the others' collectives then
            _report(queue, rank, e)  # fail with "connection reset", and the parent takes the first report it gets
            dist.destroy_process_group()
            return
        try:
            dist.barrier()  # gloo aborts at exit without it, now and then
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, result, ""))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        _report(queue, rank, e)


def _report(queue, rank: int, e: BaseException) -> None:
    try:
        queue.put((rank, False, e, traceback.format_exc()))
    except Exception:  # unpicklable exception: send its text
        queue.put((rank, False, RuntimeError(repr(e)), traceback.format_exc()))


class _PortTaken(Exception):
    """Rank 0 could not listen on the port free_port gave: another process took it meanwhile."""


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, backend: str = "gloo") -> list[Any]:
    """``backend`` is ``init_process_group``'s (e.g. ``"cpu:gloo,cuda:nccl"`` for CUDA tests);
    ``timeout`` bounds a hang (see the module docstring), not how long the ranks may take.
    A port taken by another process before rank 0 listens on it is retried with another (3 tries)."""
    for attempt in range(3):
        try:
            return _run_ranks(world_size, fn, args, timeout, backend)
        except _PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _run_ranks(world_size: int, fn: Callable[..., Any], args: tuple, timeout: float, backend: str) -> list[Any]:
    queue = CTX.Queue()
    port = free_port()
    procs = [CTX.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any, str]] = {}
    hung = False
    try:
        watch = Watchdog([p.pid for p in procs], idle_s=timeout, cpu_s=timeout * world_size)
        for _ in range(world_size):
            while True:
                try:
                    rank, ok, value, tb = queue.get(timeout=0.2)
                    break
                except queue_mod.Empty:
                    why = watch.check()
                    if why is not None:
                        hung = True
                        missing = sorted(set(range(world_size)) - set(results))
                        raise TimeoutError(f"ranks {missing} of {world_size} hang: {why}") from None
            results[rank] = (ok, value, tb)
            if not ok:  # the others may be blocked in a collective; give them a moment, then stop
                break
    finally:
        # one grace period for all ranks (not one each); none for ranks found hung: they sleep for ever
        deadline = time.monotonic() + (0 if hung else 5 if len(results) == world_size else 10)
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    failed = sorted(r for r, (ok, _, _) in results.items() if not ok)
    if failed:
        err = results[failed[0]][1]
        detail = "\n".join(f"--- rank {r} ---\n{results[r][2]}" for r in failed)
        err.add_note(f"failing rank(s) {failed}:\n{detail}")
        raise err
    return [results[r][1] for r in range(world_size)]


# ------------------------------------------------------------------ a per-run cache of checkpoints


def built_once(tmp_path_factory: Any, name: str, build: Callable[[str], None]) -> str:
    """The directory ``name`` built by ``build(path)`` once per test run, shared by every xdist
    worker (the first to get the lock builds it; the others wait and reuse it). Users must not
    change it: copy it first."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # basetemp is <run>/popen-gwN: the run's folder is above
        root = root.parent
    shared = Path(root) / "built-once"
    shared.mkdir(exist_ok=True)
    path, done = shared / name, shared / f"{name}.done"
    path.parent.mkdir(parents=True, exist_ok=True)  # a name may hold folders ("megatron/iter_0000007")
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)  # a build that failed part way
            build(str(path))
            done.touch()
    return str(path)


# ------------------------------------------------------------------ Megatron-Core's own save

megatron_cuts = (0, 5, 12)  # the distributed optimizer's flattened ranges of "opt", per rank


def megatron_truth() -> dict[str, torch.Tensor]:
    """The global tensors :func:`megatron_torch_dist_save` splits up."""
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(4, 6, generator=g),  # TP: split along dim 0
        "layers": torch.randn(2, 3, 4, generator=g),  # PP: one layer per rank, prepend_axis_num=1
        "b": torch.randn(5, generator=g).bfloat16(),  # replicated
        "opt": torch.randn(3, 4, generator=g),  # distributed optimizer: flattened ranges [0, 5) and [5, 12)
    }


def megatron_torch_dist_save(rank: int, world: int, path: str) -> None:
    """One rank (of 2) of a real megatron-core ``dist_checkpointing.save`` (torch_dist) at TP2 x PP2,
    a distributed optimizer's flattened state included, to ``path``."""
    import argparse

    multiprocessing = mp
    multiprocessing.current_process()._config["daemon"] = False  # torch_dist's writer forks workers
    torch.cuda.synchronize = lambda *a, **k: None  # megatron-core's torch_dist save on CPU
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import ShardedObject as MShardedObject
    from megatron.core.dist_checkpointing import ShardedTensor as MShardedTensor

    t = megatron_truth()
    flat = slice(megatron_cuts[rank], megatron_cuts[rank + 1])
    sd = {
        "w": MShardedTensor.from_rank_offsets("w", t["w"][2 * rank : 2 * rank + 2].clone(), (0, rank, world)),
        "layers": MShardedTensor.from_rank_offsets("layers", t["layers"][rank].clone(), (0, rank, world), prepend_axis_num=1),
        "b": MShardedTensor.from_rank_offsets("b", t["b"].clone(), replica_id=rank),
        "opt": MShardedTensor.from_rank_offsets_flat("opt", t["opt"].flatten()[flat].clone(), (3, 4), flattened_range=flat),
        "rng": MShardedObject("rng", {"seed": rank, "state": torch.arange(3) + rank}, (world,), (rank,)),
        "iteration": 7,
        "args": argparse.Namespace(lr=0.25, tensor_model_parallel_size=world, dtype=torch.bfloat16),
    }
    os.makedirs(path, exist_ok=True)
    mdc.save(sd, path)


def megatron_reshard(rank: int, world: int, path: str) -> dict:
    """One rank (of 2) of a load of :func:`megatron_torch_dist_save`'s checkpoint at ``path`` through
    ``shardsafe.megatron`` into another layout; what matched the truth."""
    from shardsafe.megatron import ShardedObject, ShardedTensor, load

    t = megatron_truth()
    flat = slice(0, 8) if rank == 0 else slice(8, 12)  # other cuts than the save's
    request = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3), (1, rank, world)),  # now split along dim 1
        "layers": ShardedTensor.from_rank_offsets("layers", torch.zeros(2, 3, 2), (2, rank, world)),  # every layer, half of each
        "b": ShardedTensor.from_rank_offsets("b", torch.zeros(5, dtype=torch.bfloat16), replica_id=rank),
        "opt": ShardedTensor.from_rank_offsets_flat("opt", torch.zeros(flat.stop - flat.start), (3, 4), flattened_range=flat),
        "rng": ShardedObject("rng", None, (world,), (1 - rank,)),  # the other rank's cell
    }
    got = load(request, path)
    return {
        "w": torch.equal(got["w"], t["w"][:, 3 * rank : 3 * rank + 3]),
        "layers": torch.equal(got["layers"], t["layers"][:, :, 2 * rank : 2 * rank + 2]),
        "b": torch.equal(got["b"], t["b"]),
        "opt": torch.equal(got["opt"], t["opt"].flatten()[flat]),
        "rng": got["rng"]["seed"],
        "iteration": got["iteration"],
    }
