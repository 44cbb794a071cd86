"""The memory tier from and into CUDA (issue 24's device check), beside pinned copies of the same bytes.

``python benchmarks/bench_memtier_gpu.py [--mib 256] [--steps 4] [--device cuda]`` saves a model
whose parameters live on the device into the memory tier (``CheckpointManager(memory_dir=...)``,
one process, ``replicas=0``: the copies to other nodes move tier 0's file bytes over gloo, the
same whatever device the state came from, and ``bench_memtier.py`` measures them), then restores
it into a second model on the device, and prints one line::

    MEMTIER_GPU device=cuda mib=... blocked_s=... d2h_pinned_s=... blocked_vs_d2h=... tier0_s=...
                restore_s=... h2d_pinned_s=... restore_vs_h2d=... bit_exact=1

- ``blocked_s``: how long ``save(step)`` keeps the loop (median over steps 2..), against
  ``d2h_pinned_s``, a copy of the same tensors into pinned host buffers, synchronized;
- ``tier0_s``: from ``save`` until the step is committed in the memory tier;
- ``restore_s``: ``restore()`` from the memory tier into the second model's device parameters,
  against ``h2d_pinned_s``, a copy of the same bytes from pinned host buffers to the device;
- ``bit_exact``: every restored parameter equals the saved one, byte for byte.

``--device cpu`` runs the same code without a GPU (plain copies in place of pinned ones): the
smoke test, ``tests/test_bench_memtier_gpu.py``, runs it so.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time

import torch
from bench_memtier import timed_save  # this folder: the scripts run from it

import shardsafe

_MiB = 1 << 20


def _model(mib: int, device: torch.device, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    width = 1024
    layers = max(1, mib * _MiB // (width * width * 4))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_times(params: list[torch.Tensor], device: torch.device, reps: int = 5) -> tuple[float, float]:
    """Median seconds of a device-to-host copy of ``params`` into pinned buffers, and back."""
    pinned = device.type == "cuda"
    host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pinned) for p in params]
    d2h, h2d = [], []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        for h, p in zip(host, params):
            h.copy_(p, non_blocking=pinned)
        _sync(device)
        d2h.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for h, p in zip(host, params):
            p.copy_(h, non_blocking=pinned)
        _sync(device)
        h2d.append(time.perf_counter() - t0)
    return statistics.median(d2h), statistics.median(h2d)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB of float32 parameters")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--memory-root", default="/dev/shm")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("MEMTIER_GPU error=no_cuda_device")
        return 1
    work = tempfile.mkdtemp(prefix="bench-memtier-gpu-")
    mem = tempfile.mkdtemp(prefix="shardsafe-mem-", dir=args.memory_root)
    try:
        m, m2 = _model(args.mib, device, 0), _model(args.mib, device, 1)
        params = [p.detach() for p in m.parameters()]
        d2h, h2d = _copy_times([p.detach() for p in m2.parameters()], device)
        blocked, tier0 = [], []
        with shardsafe.CheckpointManager(f"{work}/root", memory_dir=mem, node=0, replicas=0, persist_every=None) as mgr:
            for step in range(1, args.steps + 1):
                with torch.no_grad():
                    for p in params:
                        p.add_(1.0)  # the loop's update: the step saved is this one
                _sync(device)
                b, done = timed_save(mgr, step, m)
                blocked.append(b)
                tier0.append(done)
        with shardsafe.CheckpointManager(f"{work}/root", memory_dir=mem, node=0, replicas=0, persist_every=None) as mgr:
            _sync(device)
            t0 = time.perf_counter()
            restored = mgr.restore(model=m2)
            _sync(device)
            restore_s = time.perf_counter() - t0
            where = mgr.last_restore.tier if mgr.last_restore is not None else "none"
        exact = restored == args.steps and all(
            q.device == p.device and torch.equal(p.reshape(-1).view(torch.uint8), q.detach().reshape(-1).view(torch.uint8))
            for p, q in zip(params, m2.parameters())
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(mem, ignore_errors=True)
    b, s = statistics.median(blocked[1:] or blocked), statistics.median(tier0[1:] or tier0)
    fields = {
        "device": device.type, "mib": args.mib, "blocked_s": f"{b:.4f}", "d2h_pinned_s": f"{d2h:.4f}",
        "blocked_vs_d2h": f"{b / d2h:.2f}", "tier0_s": f"{s:.4f}", "restore_s": f"{restore_s:.4f}",
        "h2d_pinned_s": f"{h2d:.4f}", "restore_vs_h2d": f"{restore_s / h2d:.2f}", "restored_from": where,
        "bit_exact": int(exact),
    }
    print("MEMTIER_GPU " + " ".join(f"{k}={v}" for k, v in fields.items()))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
