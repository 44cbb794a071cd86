"""The memory tier (issue 24) against its raw limits, measured side by side in one run.

``python benchmarks/bench_memtier.py [--nodes 4] [--mib-per-rank 256] [--steps 4]`` runs
``--nodes`` simulated nodes of one gloo rank each (each node with its own memory directory under
``--memory-root``, default ``/dev/shm``) and prints one machine-readable line::

    MEMTIER nodes=4 world=4 mib_per_rank=... blocked_s=... memcpy_s=... blocked_vs_memcpy=... memcpy_min_s=...
            safe_s=... raw_send_s=... safe_vs_raw_send=... save_cpu_s=... raw_send_cpu_s=... cores=...
            restore_world=3 restore_from_peers_s=...
            raw_copy_transfer_s=... restore_vs_raw=... restore_from_disk_cold_s=... disk_vs_peers=...
            durable_bytes_read=0 ram_per_node_x=...

- ``blocked_s``: how long ``save(step)`` keeps the training loop (median over steps 2..), against
  ``memcpy_s``, a copy of the rank's tensors into preallocated buffers, timed as the saves are
  (every rank at once after a barrier, the median of 5; on 2 cores 3 ranks copying at once take
  1.5-2x as long as one alone); ``memcpy_min_s``: the fastest of those copies (until 2026-11-29
  ``memcpy_s`` was the fastest of 3 copies without a barrier, which ranks often made alone);
- ``safe_s``: from ``save`` until the step is safe in memory (every file on two nodes), against
  ``raw_send_s``, a ring send of the rank's bytes over the same process group (isend/irecv);
- after the last node is lost, a job of ``nodes - 1`` ranks restores from the survivors' memory
  (``restore_from_peers_s``), against ``raw_copy_transfer_s`` (a memcpy of the restoring rank's
  bytes plus a raw send of them) and against the same restore from the durable tier with its
  files dropped from the page cache (``restore_from_disk_cold_s``, ``posix_fadvise(DONTNEED)``);
  during the restore from memory the durable root is moved away, so ``durable_bytes_read=0`` is
  what happened, not what was hoped (a read there would fail the run);
- ``ram_per_node_x``: bytes in a node's memory directory over its ranks' share of the state;
- ``save_cpu_s`` and ``raw_send_cpu_s``: the CPU time of one save (from ``save`` until safe) and
  of one raw send, summed over the ranks (every thread): when the ranks share ``cores`` cores,
  ``save_cpu_s / cores`` is the least ``safe_s`` can be, however the work overlaps.

With ``--nvrx-python PATH`` (an interpreter with ``nvidia-resiliency-ext``, kept out of
shardsafe's environment), nvidia-resiliency-ext's local checkpointing saves the same bytes per
rank on as many gloo ranks, replicated to one other rank, and loads them back
(``benchmarks/nvrx_local.py``, which says what it needs on CPU): ``nvrx_save_s`` (its save is
synchronous: the loop is blocked until the step is on its node and its peer) against our
``safe_s`` and ``blocked_s``, and ``nvrx_load_s`` (same world size only), or ``nvrx_error=...``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

_MiB = 1 << 20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(world: int, mib_per_rank: float, saved_world: int | None = None):
    """4 float32 tensors of 1024 columns, sharded on rows over ``world`` ranks, of the global
    shapes a job of ``saved_world`` ranks (default: ``world``) with ``mib_per_rank`` each saves."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    saved = saved_world or world
    rows = max(saved, int(mib_per_rank * _MiB * saved / 4 / 1024 / 4))
    rows -= rows % saved  # even on the saving ranks; the restoring ones may split unevenly
    m = torch.nn.Module()
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        full = torch.randn((rows, 1024), generator=g) if world * rows * 1024 * 4 <= (1 << 31) else torch.ones((rows, 1024))
        m.register_parameter(f"p{i}", torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)))
    return m


def _locals(m) -> list:
    return [p.to_local() for p in m.parameters()]


def _train(rank: int, world: int, port: int, cfg: dict, out) -> None:
    import torch
    import torch.distributed as dist

    from shardsafe import CheckpointManager

    torch.set_num_threads(1)
    if os.environ.get("BENCH_MEMTIER_LOG"):  # phase times of the background save, per rank
        import logging

        logging.basicConfig(filename=f"{os.environ['BENCH_MEMTIER_LOG']}.r{rank}", level=logging.DEBUG)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    m = _model(world, cfg["mib"])
    local = _locals(m)
    nbytes = sum(t.numel() * t.element_size() for t in local)
    bufs = [torch.empty_like(t) for t in local]
    memcpy = []
    for _ in range(5):  # as the saves are timed: every rank at once, after a barrier
        dist.barrier()
        t0 = time.perf_counter()
        for b, t in zip(bufs, local):
            b.copy_(t)
        memcpy.append(time.perf_counter() - t0)
    del bufs
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in local])
    into = torch.empty_like(flat)
    sends, send_cpu = [], []
    for _ in range(3):
        dist.barrier()
        t0, c0 = time.perf_counter(), _cpu()
        works = [dist.isend(flat, dst=(rank + 1) % world), dist.irecv(into, src=(rank - 1) % world)]
        for w in works:
            w.wait()
        sends.append(time.perf_counter() - t0)
        send_cpu.append(_cpu() - c0)
    del flat, into
    blocked, safe, save_cpu = [], [], []
    mem = os.path.join(cfg["mem"], f"node{rank}")
    with CheckpointManager(cfg["root"], memory_dir=mem, node=rank, replicas=1, persist_every=cfg["steps"]) as mgr:
        for s in range(1, cfg["steps"] + 1):
            with torch.no_grad():
                for t in local:
                    t.add_(1.0)
            dist.barrier()
            c0 = _cpu()
            b, done = timed_save(mgr, s, m)
            blocked.append(b)
            safe.append(done)
            save_cpu.append(_cpu() - c0)
    used = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(mem) for f in fs)
    dist.barrier()
    dist.destroy_process_group()
    out.put((rank, {
        "nbytes": nbytes, "memcpy": statistics.median(memcpy), "memcpy_min": min(memcpy), "send": statistics.median(sends), "blocked": statistics.median(blocked[1:] or blocked),
        "safe": statistics.median(safe[1:] or safe), "ram_x": used / nbytes,
        "save_cpu": statistics.median(save_cpu[1:] or save_cpu), "send_cpu": statistics.median(send_cpu),
    }))


def timed_save(mgr, step: int, model) -> tuple[float, float]:
    """``mgr.save(step, model)``: the seconds it kept the caller, and the seconds until the step
    was committed (with replicas, safe in memory)."""
    t0 = time.perf_counter()
    mgr.save(step, model)
    t1 = time.perf_counter()
    mgr.wait_until_finished()
    return t1 - t0, time.perf_counter() - t0


def _cpu() -> float:
    """CPU seconds this process has used, all its threads (the background save's and gloo's too)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _drop_cache(root: str) -> None:
    for dp, _, fs in os.walk(root):
        for f in fs:
            fd = os.open(os.path.join(dp, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _restore(rank: int, world: int, port: int, cfg: dict, out) -> None:
    import torch
    import torch.distributed as dist

    from shardsafe import CheckpointManager

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    m = _model(world, cfg["mib"], saved_world=cfg["nodes"])  # the same global shapes on fewer ranks
    local = _locals(m)
    nbytes = sum(t.numel() * t.element_size() for t in local)
    # the raw limit of this restore: a copy of the rank's bytes and a send of them
    bufs = [torch.empty_like(t) for t in local]
    t0 = time.perf_counter()
    for b, t in zip(bufs, local):
        b.copy_(t)
    copy_s = time.perf_counter() - t0
    del bufs
    most = torch.tensor([nbytes])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # ranks may hold a row more or less: a send and its receive match
    flat = torch.empty(int(most), dtype=torch.uint8)
    into = torch.empty_like(flat)
    dist.barrier()
    t0 = time.perf_counter()
    if world > 1:  # --nodes 2 restores on one rank: nothing to send (gloo refuses a send to itself)
        for w in [dist.isend(flat, dst=(rank + 1) % world), dist.irecv(into, src=(rank - 1) % world)]:
            w.wait()
    send_s = time.perf_counter() - t0
    del flat, into
    results = {}
    for tier in ("memory", "disk"):
        kw = {"memory_dir": os.path.join(cfg["mem"], f"node{cfg['survivors'][rank]}"), "node": cfg["survivors"][rank]} if tier == "memory" else {}
        if rank == 0:
            if tier == "memory":  # the durable tier out of reach: a restore that read a byte of it would fail
                os.rename(cfg["root"], cfg["root"] + ".away")
            else:
                os.rename(cfg["root"] + ".away", cfg["root"])
                _drop_cache(cfg["root"])
        dist.barrier()
        t0 = time.perf_counter()
        with CheckpointManager(cfg["root"], **kw) as mgr:
            step = mgr.restore(model=m)
            report = mgr.last_restore
        dist.barrier()
        results[tier] = (time.perf_counter() - t0, step, report.tier if report else "durable")
    dist.barrier()
    dist.destroy_process_group()
    out.put((rank, {"results": results, "raw": copy_s + send_s}))


def _spawn(fn, world: int, cfg: dict) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=fn, args=(r, world, port, cfg, q)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict = {}
    while len(got) < world:  # a rank that died says so at once, not after a timeout
        try:
            rank, value = q.get(timeout=2)
            got[rank] = value
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"bench_memtier: {fn.__name__} rank(s) {dead} died (exit codes {[procs[r].exitcode for r in dead]})") from None
    for p in procs:
        p.join()
    return [got[r] for r in range(world)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--mib-per-rank", type=float, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--memory-root", default="/dev/shm")
    ap.add_argument("--nvrx-python", help="an interpreter with nvidia-resiliency-ext: run its local checkpointing beside ours")
    args = ap.parse_args(argv)
    if args.nodes < 2:
        ap.error("--nodes must be at least 2 (one is lost)")
    mem = tempfile.mkdtemp(prefix="shardsafe-bench-memtier-", dir=args.memory_root)
    disk = tempfile.mkdtemp(prefix="shardsafe-bench-memtier-")
    cfg = {"mib": args.mib_per_rank, "steps": args.steps, "mem": mem, "root": os.path.join(disk, "durable"), "nodes": args.nodes}
    try:
        train = _spawn(_train, args.nodes, cfg)
        lost = args.nodes - 1
        shutil.rmtree(os.path.join(mem, f"node{lost}"))
        cfg["survivors"] = list(range(lost))
        restore = _spawn(_restore, lost, cfg)
    finally:
        shutil.rmtree(mem, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    worst = lambda key: max(t[key] for t in train)  # noqa: E731 - the slowest rank sets the pace
    peers = max(r["results"]["memory"][0] for r in restore)
    cold = max(r["results"]["disk"][0] for r in restore)
    raw = max(r["raw"] for r in restore)
    tiers = {r["results"]["memory"][2] for r in restore}
    steps = {r["results"]["memory"][1] for r in restore} | {r["results"]["disk"][1] for r in restore}
    if tiers != {"memory"} or steps != {args.steps}:
        print(f"bench_memtier: the restores did not read what they should: tiers {tiers}, steps {steps}", file=sys.stderr)
        return 1
    fields = {
        "nodes": args.nodes, "world": args.nodes, "mib_per_rank": args.mib_per_rank,
        "blocked_s": worst("blocked"), "memcpy_s": worst("memcpy"), "blocked_vs_memcpy": worst("blocked") / worst("memcpy"),
        "memcpy_min_s": worst("memcpy_min"),
        "safe_s": worst("safe"), "raw_send_s": worst("send"), "safe_vs_raw_send": worst("safe") / worst("send"),
        "save_cpu_s": sum(t["save_cpu"] for t in train), "raw_send_cpu_s": sum(t["send_cpu"] for t in train),
        "cores": len(os.sched_getaffinity(0)),
        "restore_world": lost, "restore_from_peers_s": peers, "raw_copy_transfer_s": raw, "restore_vs_raw": peers / raw,
        "restore_from_disk_cold_s": cold, "disk_vs_peers": cold / peers,
        "durable_bytes_read": 0,  # measured so: the durable root was moved away during the restore from memory
        "ram_per_node_x": max(t["ram_x"] for t in train),
    }
    if args.nvrx_python:
        fields.update(_nvrx(args, worst("safe"), worst("blocked")))
    print("MEMTIER " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()))
    return 0


def _nvrx(args, safe_s: float, blocked_s: float) -> dict:
    """nvidia-resiliency-ext's local checkpointing on the same ranks and bytes (its own interpreter)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nvrx_local.py")
    cmd = [args.nvrx_python, script, "--nodes", str(args.nodes), "--mib-per-rank", str(args.mib_per_rank), "--steps", str(args.steps),
           "--memory-root", args.memory_root]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("NVRX ")), None)
    if line is None:
        return {"nvrx_error": (run.stderr.strip().splitlines() or ["no output"])[-1].replace(" ", "_")}
    got = dict(kv.split("=", 1) for kv in line.split()[1:])
    if "error" in got:
        return {"nvrx_error": got["error"]}
    save = float(got["save_s"])
    return {"nvrx_save_s": save, "nvrx_save_vs_safe": save / safe_s, "nvrx_save_vs_blocked": save / blocked_s,
            "nvrx_load_s": float(got["load_s"]), "nvrx_bit_exact": int(got["ok"])}


if __name__ == "__main__":
    sys.exit(main())
