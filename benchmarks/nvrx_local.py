"""nvidia-resiliency-ext's local checkpointing on CPU with gloo, for ``bench_memtier.py --nvrx-python``.

Run by an interpreter that has ``nvidia-resiliency-ext`` (never installed beside shardsafe's own
environment: it pins its own torch). ``--nodes`` gloo ranks, one per simulated node, each with its
own directory under ``--memory-root``, save ``--steps`` steps of ``--mib-per-rank`` MiB (4 float32
tensors, as bench_memtier's), replicated with ``CliqueReplicationStrategy`` (groups of 2
neighbouring ranks: one copy on another node, as our ``replicas=1``), then load the last step on
the same ranks. Prints one line: ``NVRX world=... save_s=... load_s=... ok=1``, or
``NVRX error=...`` naming what stood in the way.

What it takes on CPU (nvidia-resiliency-ext 0.4.1): ``BasicTensorAwareStateDict`` asserts every
tensor ``is_cuda`` and its ``restore_tensor_device`` moves every loaded tensor to ``"cuda"``, so a
subclass without both runs here; ``save(..., is_async=True)`` calls ``torch.cuda.synchronize()``
("Torch not compiled with CUDA enabled"), so only the synchronous save runs; the replication
groups need a world size divisible by ``replication_jump * replication_factor`` (2 here); a load
needs the same world size and replication settings as the save.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

_MiB = 1 << 20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, cfg: dict, out) -> None:
    import torch
    import torch.distributed as dist
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy
    from nvrx_cpu_state_dict import CpuTensorAwareStateDict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows = max(1, int(cfg["mib"] * _MiB / 4 / 1024 / 4))
        g = torch.Generator().manual_seed(rank)
        local = {f"p{i}": torch.randn((rows, 1024), generator=g) for i in range(4)}
        strategy = CliqueReplicationStrategy.from_replication_params(replication_jump=1, replication_factor=2)
        mgr = LocalCheckpointManager(os.path.join(cfg["mem"], f"node{rank}"), repl_strategy=strategy)
        saves = []
        for s in range(1, cfg["steps"] + 1):
            for t in local.values():
                t.add_(1.0)
            dist.barrier()
            t0 = time.perf_counter()
            mgr.save(CpuTensorAwareStateDict({k: v.clone() for k, v in local.items()}), s, is_async=False)
            saves.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        mgr.find_latest()
        sd, _ = mgr.load()
        load_s = time.perf_counter() - t0
        ok = all(torch.equal(sd.state_dict[k], v) for k, v in local.items())
        out.put((rank, {"save": statistics.median(saves[1:] or saves), "load": load_s, "ok": ok}))
    except Exception as e:  # noqa: BLE001 - reported, not raised: the bench prints it
        out.put((rank, {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}))
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--mib-per-rank", type=float, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--memory-root", default="/dev/shm")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    mem = tempfile.mkdtemp(prefix="shardsafe-bench-nvrx-", dir=args.memory_root)
    cfg = {"mib": args.mib_per_rank, "steps": args.steps, "mem": mem}
    try:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = _port()
        procs = [ctx.Process(target=_rank, args=(r, args.nodes, port, cfg, q)) for r in range(args.nodes)]
        for p in procs:
            p.start()
        got = dict(q.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
    finally:
        shutil.rmtree(mem, ignore_errors=True)
    errors = sorted({g["error"] for g in got.values() if "error" in g})
    if errors:
        print("NVRX error=" + " | ".join(errors).replace(" ", "_"))
        return 1
    print(
        f"NVRX world={args.nodes} save_s={max(g['save'] for g in got.values()):.4g} load_s={max(g['load'] for g in got.values()):.4g} "
        f"ok={int(all(g['ok'] for g in got.values()))}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
