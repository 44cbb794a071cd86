"""Where one rank's ``load`` / ``reshard`` time goes in ``bench_megatron.py`` (a diagnostic, not a
benchmark): for ``shardsafe`` and ``megatron``, the slowest rank's wall time, CPU seconds per rank
and of all ranks, the collectives one call runs, and for ``shardsafe`` rank 0's wall and CPU time
per step of ``shardsafe.megatron.load`` (``--profile-dir``: rank 0's cProfile of each op, too).

Saves each method's checkpoint once, then runs every load ``--reps`` times (methods interleaved,
garbage collected and the heap trimmed before each). CPU time is the process's
(``time.process_time``: every thread), which the other processes on the machine's cores do not
inflate the way they inflate wall time; "main" is the calling thread's alone. Collectives are
counted by wrapping ``torch.distributed``'s collective functions (both libraries call them through
it) and the default store's methods (shardsafe's check-in at the start of a call).

    PYTHONPATH=$PWD/src:$PWD python benchmarks/profile_megatron_load.py [--rank-mib N] [--profile-dir DIR]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import os
import shutil
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import bench_megatron as bm  # noqa: E402
from iobench.harness import run_ranks_collect, trim_heap  # noqa: E402

_COLLECTIVES = (
    "all_gather", "all_gather_object", "all_gather_into_tensor", "gather", "gather_object", "scatter", "scatter_object_list",
    "broadcast", "broadcast_object_list", "all_reduce", "reduce", "barrier", "all_to_all", "all_to_all_single", "send", "recv",
    "isend", "irecv", "batch_isend_irecv", "monitored_barrier",
)
COUNTS: collections.Counter[str] = collections.Counter()
_DEPTH = [0]


def _wrap_collectives() -> None:
    import torch.distributed as dist

    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def wrapped(*a, _fn=fn, _name=name, **k):
            top = _DEPTH[0] == 0  # count the outermost call (an *_object collective runs others inside)
            _DEPTH[0] += 1
            try:
                if top:
                    COUNTS[_name] += 1
                return _fn(*a, **k)
            finally:
                _DEPTH[0] -= 1

        setattr(dist, name, wrapped)
        setattr(dist.distributed_c10d, name, wrapped)


def _count_store() -> None:
    import torch.distributed as dist

    for cls in {type(dist.distributed_c10d._get_default_store())}:
        for name in ("set", "get", "add", "wait", "append", "compare_set", "check", "delete_key", "multi_get", "multi_set"):
            fn = getattr(cls, name, None)
            if fn is None:
                continue

            def wrapped(self, *a, _fn=fn, _name=name, **k):
                COUNTS["store." + _name] += 1
                return _fn(self, *a, **k)

            try:
                setattr(cls, name, wrapped)
            except TypeError:
                pass


PHASES: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0, 0.0])  # wall, CPU, calls, main-thread CPU
GC = [0.0, 0.0]  # seconds in the garbage collector during the call, start of the current collection


def _gc_cb(phase: str, info: dict) -> None:
    if phase == "start":
        GC[1] = time.perf_counter()
    else:
        GC[0] += time.perf_counter() - GC[1]


def _timed_phases() -> None:
    """Wrap the steps of shardsafe.megatron.load: wall and process CPU seconds per step."""
    import shardsafe.checkpointer as ck
    import shardsafe.dist as sd
    import shardsafe.engine.loader as loader
    import shardsafe.engine.reader as rd
    import shardsafe.megatron.serialization as ser
    import shardsafe.megatron.strategies.native as ss

    def wrap(owner, name, label):
        fn = getattr(owner, name)

        def wrapped(*a, **k):
            c0, t0, m0 = time.process_time(), time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                ph = PHASES[label]
                ph[0] += time.perf_counter() - t0
                ph[1] += time.process_time() - c0
                ph[2] += 1
                ph[3] += time.thread_time() - m0

        setattr(owner, name, wrapped)

    wrap(ser, "read_metadata", "read_metadata")
    wrap(ser, "get_comm", "arrive(megatron.load)")
    wrap(ser, "load_preprocess", "load_preprocess")
    wrap(ser, "extract_sharded_base", "extract_sharded_base")
    wrap(ser, "apply_factory_merges", "apply_factory_merges")
    wrap(ser, "merge", "merge")
    wrap(ss.ShardsafeLoadShardedStrategy, "common_of", "common_of")
    wrap(ss.ShardsafeLoadShardedStrategy, "_targets", "_targets")
    wrap(ss, "describe_local", "describe_local")
    wrap(ss, "dict_list_map_inplace", "dict_list_map_inplace")
    wrap(ss.ShardsafeLoadShardedStrategy, "read_targets", "read_targets")
    wrap(ck, "load_state", "  load_state")
    wrap(rd.Reader, "load_tensors", "    Reader.load_tensors")
    wrap(loader, "load_targets", "    load_targets")
    wrap(loader, "check_targets", "    check_targets")
    wrap(sd.Comm, "arrive", "Comm.arrive")
    wrap(sd.Comm, "gather", "Comm.gather")
    wrap(sd.Comm, "broadcast", "Comm.broadcast")
    wrap(sd.Comm, "_all_gather", "Comm._all_gather(check)")
    wrap(ser.ShardsafeLoadShardedStrategy, "load_all", "load_all")


def _run_rank(rank: int, world: int, port: int, args: dict) -> list[dict]:
    import multiprocessing

    multiprocessing.current_process()._config["daemon"] = False
    import torch
    import torch.distributed as dist

    bm._cpu_megatron()
    from megatron.core.dist_checkpointing import mapping as mmapping

    from shardsafe.megatron import mapping as smapping

    cfg = args["cfg"]
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    _wrap_collectives()
    _count_store()
    _timed_phases()
    gc.callbacks.append(_gc_cb)
    records: list[dict] = []
    try:
        methods = bm.Methods(rank, world)
        tp, dp = methods.tp, methods.dp
        whole = bm.truth(cfg)
        for m in cfg.methods:
            mapping = smapping if m.startswith("shardsafe") else mmapping
            path = os.path.join(cfg.root, m)
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
                os.makedirs(path)
            dist.barrier()
            methods.save(m, bm.sharded_state(mapping, cfg, whole, tp, bm.TP, dp, empty=False), path)
            dist.barrier()
        for rep in range(cfg.reps):
            for m in bm._rotated(cfg.methods, rep):
                mapping = smapping if m.startswith("shardsafe") else mmapping
                path = os.path.join(cfg.root, m)
                for op in ("load", "reshard"):
                    if op == "load":
                        target = bm.sharded_state(mapping, cfg, whole, tp, bm.TP, dp, empty=True)
                        group, want = methods.dp_group, (tp, bm.TP)
                    else:
                        target = bm.sharded_state(mapping, cfg, whole, 0, 1, rank, empty=True)
                        group, want = methods.world_group, (0, 1)
                    gc.collect()
                    trim_heap()  # what earlier steps freed goes back to the OS now, not inside the next clock
                    prof = cProfile.Profile() if args["profile_dir"] and rank == 0 and rep == cfg.reps - 1 else None
                    dist.barrier()
                    COUNTS.clear()
                    PHASES.clear()
                    GC[0] = 0.0
                    c0, t0 = time.process_time(), time.perf_counter()
                    if prof:
                        prof.enable()
                    got = methods.load(m, target, path, group)
                    if prof:
                        prof.disable()
                    t1, c1 = time.perf_counter(), time.process_time()
                    counts = dict(COUNTS)
                    dist.barrier()
                    t2 = time.perf_counter()
                    ok = bm.matches(got, whole, cfg, *want)
                    if prof:
                        prof.dump_stats(os.path.join(args["profile_dir"], f"{m}-{op}-rank0.prof"))
                    records.append({"op": op, "method": m, "rep": rep, "rank": rank, "own_s": t1 - t0, "wall_s": t2 - t0,
                                    "cpu_s": c1 - c0, "counts": counts, "ok": ok,
                                    "phases": {k: list(v) for k, v in PHASES.items()}, "gc_s": GC[0]})
                    del target, got
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return records


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rank-mib", type=float, default=None, help="instead of --layers: about this many MiB per rank at TP2")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dp", type=int, default=2, help="data-parallel replicas (ranks: 2 x this)")
    ap.add_argument("--methods", default="shardsafe,megatron")
    ap.add_argument("--profile-dir", default="")
    ap.add_argument("--dir", default="/tmp/shardsafe-prof-megatron")
    a = ap.parse_args()
    layers = a.layers if a.rank_mib is None else bm.layers_for(a.rank_mib * 2**20, a.hidden, a.vocab)
    cfg = bm.Config(root=a.dir, hidden=a.hidden, layers=layers, vocab=a.vocab, reps=a.reps, methods=tuple(a.methods.split(",")), dp=a.dp)
    if a.profile_dir:
        os.makedirs(a.profile_dir, exist_ok=True)
    shutil.rmtree(cfg.root, ignore_errors=True)
    os.makedirs(cfg.root)
    try:
        records = run_ranks_collect(_run_rank, bm.TP * cfg.dp, {"cfg": cfg, "profile_dir": a.profile_dir}, timeout=1800, daemon=False)
    finally:
        shutil.rmtree(cfg.root, ignore_errors=True)
    print(f"hidden {cfg.hidden} layers {cfg.layers} vocab {cfg.vocab}: {bm.rank_bytes(cfg) / 2**20:.1f} MiB per rank (TP2), "
          f"{len(bm.model_shapes(cfg))} tensors per rank")
    print("op       method        wall(max rank) med   own(rank0) med   CPU/rank med   CPU all ranks med   ok   collectives per rank (rank 0)")
    for op in ("load", "reshard"):
        for m in cfg.methods:
            recs = [r for r in records if r["op"] == op and r["method"] == m]
            reps = sorted({r["rep"] for r in recs})
            wall = statistics.median(max(r["wall_s"] for r in recs if r["rep"] == k) for k in reps)
            own = statistics.median(r["own_s"] for r in recs if r["rank"] == 0)
            cpu = statistics.median(r["cpu_s"] for r in recs)
            cpu_all = statistics.median(sum(r["cpu_s"] for r in recs if r["rep"] == k) for k in reps)
            counts = next(r["counts"] for r in recs if r["rank"] == 0)
            ok = all(r["ok"] for r in recs)
            gc_ms = statistics.median(r["gc_s"] for r in recs if r["rank"] == 0) * 1e3
            gc_max = max(r["gc_s"] for r in recs if r["rank"] == 0) * 1e3
            print(f"{op:8s} {m:12s} {wall:10.4f}        {own:10.4f}     {cpu:10.4f}     {cpu_all:10.4f}       {ok}  {counts}"
                  f"  gc ms (rank 0) median {gc_ms:.2f} max {gc_max:.2f}")
    for op in ("load", "reshard"):
        recs = [r for r in records if r["op"] == op and r["method"] == "shardsafe" and r["rank"] == 0]
        if not recs:
            continue
        print(f"shardsafe {op}, rank 0, per step: wall ms median (min) / CPU ms median (min) / calls / main-thread CPU ms median")
        for label in recs[0]["phases"]:
            walls = [r["phases"].get(label, [0, 0, 0])[0] * 1e3 for r in recs]
            cpus = [r["phases"].get(label, [0, 0, 0])[1] * 1e3 for r in recs]
            mains = [r["phases"].get(label, [0, 0, 0, 0])[3] * 1e3 for r in recs]
            print(f"  {label:30s} {statistics.median(walls):8.2f} ({min(walls):6.2f}) {statistics.median(cpus):8.2f} ({min(cpus):6.2f})"
                  f"  {recs[0]['phases'][label][2]}  {statistics.median(mains):8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
