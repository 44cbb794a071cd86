"""The DCP plugin and DCP import: ``dcp.save``/``dcp.load`` through ``shardsafe.dcp.StorageWriter``/
``StorageReader`` against DCP's own ``FileSystemWriter``/``FileSystemReader`` and against our
``Checkpointer``, and ``shardsafe.dcp.convert`` against reading with DCP and saving with ``Checkpointer``.

Usage::

    python benchmarks/bench_dcp.py [--mib-per-rank 256] [--reps 5] [--quick]
        [--dir /tmp/shardsafe-bench-dcp] [--out benchmarks/results] [--update-docs]

Two ranks (one process each, gloo on a free port) hold an FSDP2-style training state of about
``--mib-per-rank`` MiB per rank (``bench_async.training_spec``: a Llama-style model's fp32
parameters and AdamW state, ``DTensor``s sharded on dim 0, 0-d ``step`` tensors replicated).
Every operation runs every method, ``--reps`` times, in an order rotated each repetition; a time
is the slowest rank's, bracketed by barriers; the median is reported.

- **save** (each into a directory removed beforehand, outside the clock; every method fsyncs):
  ``plugin`` = ``dcp.save(state, storage_writer=shardsafe.dcp.StorageWriter(d))``; ``dcp`` =
  ``dcp.save`` with ``FileSystemWriter(d)`` at its defaults; ``shardsafe`` =
  ``Checkpointer().save(d, state)``. For ``plugin`` the time from the call until DCP hands our
  writer its plan (``write_data``) is reported as **planning**: DCP's planner, its collectives
  and our ``prepare_*_plan`` hooks, which ``Checkpointer.save`` does not pay; **hooks**: the
  part spent in those hooks of ours (the slowest rank's); then on rank 0 (DCP's coordinator)
  **write** (``write_data`` until DCP calls ``finish``: our writes, DCP's ``resolve_data`` per
  item and its gather of the write results) and **finish** (our commit, DCP's final barrier).
- **load** (same layout, files in the page cache) and **reshard** (saved on 2 ranks as
  ``Shard(0)``, loaded into ``Shard(1)`` DTensors of the same tensors): ``plugin`` =
  ``dcp.load`` with ``shardsafe.dcp.StorageReader`` of the plugin's checkpoint; ``dcp`` =
  ``dcp.load`` with ``FileSystemReader`` of DCP's; ``shardsafe`` = ``Checkpointer().load`` of
  ours. Every load is checked against the CRC32C of the state it should produce.
- **convert** (rank 0 alone, the other rank waiting; DCP's checkpoint from the save step, warm):
  ``convert`` = ``shardsafe.dcp.convert(src, dst)``; ``dcp-load+save`` = full tensors allocated
  from the shapes, ``dcp.load(..., no_dist=True)`` with ``FileSystemReader``, then
  ``Checkpointer().save`` on a one-rank group (``baseline_load_s``: its ``dcp.load`` part). Peak RSS beyond the
  process's RSS before the call.

Prints a markdown table and the lines::

    DCP save plugin_s=... dcp_s=... shardsafe_s=... plugin_vs_dcp=...x plugin_vs_shardsafe=...x planning_s=...
        planning_share=...% hooks_s=... write_s=... finish_s=...
    DCP load plugin_s=... dcp_s=... shardsafe_s=... plugin_vs_dcp=...x plugin_vs_shardsafe=...x
    DCP reshard plugin_s=... dcp_s=... shardsafe_s=... plugin_vs_dcp=...x plugin_vs_shardsafe=...x
    DCP convert convert_s=... convert_mib_s=... convert_rss_mib=... baseline_s=... baseline_mib_s=... baseline_load_s=...
        baseline_rss_mib=... convert_vs_baseline=...x

(a ratio below 1 means the first is faster). Writes ``dcp.json`` and ``dcp.md`` to ``--out``;
``--update-docs`` puts the table into ``docs/benchmarks.md``. ``--quick``: 4 MiB per rank, 2 repetitions.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from statistics import median

from bench_async import training_spec
from iobench.harness import PeakRSS, _rss, run_ranks_collect, trim_heap, warm_cache
from iobench.report import machine, replace_section

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MiB = 1 << 20
WORLD = 2
METHODS = ("plugin", "dcp", "shardsafe")
CONVERTS = ("convert", "dcp-load+save")
BEGIN, END = "<!-- bench-dcp:begin -->", "<!-- bench-dcp:end -->"


@dataclass(frozen=True)
class Config:
    root: str
    mib_per_rank: float
    reps: int


def _rotated(names: tuple[str, ...], rep: int) -> list[str]:
    k = rep % len(names)
    return list(names[k:] + names[:k])


def _path(cfg: Config, method: str) -> str:
    return os.path.join(cfg.root, method)


# ---------------------------------------------------------------- two ranks: save, load, reshard


def _run_rank(rank: int, world: int, port: int, cfg: Config) -> list[dict]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from iobench.states import build_state, scribble, state_crc
    from torch.distributed.device_mesh import init_device_mesh

    import shardsafe
    import shardsafe.dcp

    class TimedWriter(shardsafe.dcp.StorageWriter):
        """Our writer, noting when DCP's planning is over and the writing begins, and how long our
        own planning hooks took (``hooks``, reset before each save)."""

        planned_at = 0.0
        finish_at = 0.0
        hooks = 0.0

        def prepare_local_plan(self, plan):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return super().prepare_local_plan(plan)
            finally:
                TimedWriter.hooks += time.perf_counter() - t

        def prepare_global_plan(self, plans):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return super().prepare_global_plan(plans)
            finally:
                TimedWriter.hooks += time.perf_counter() - t

        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            TimedWriter.planned_at = time.perf_counter()
            return super().write_data(plan, planner)

        def finish(self, metadata, results):  # type: ignore[no-untyped-def]  # the coordinator only
            TimedWriter.finish_at = time.perf_counter()
            return super().finish(metadata, results)

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    records: list[dict] = []
    try:
        mesh = init_device_mesh("cpu", (world,))
        spec, _ = training_spec(int(cfg.mib_per_rank * _MiB * world))
        state = build_state(spec, mesh, 0)
        crc = state_crc(state)
        peak = PeakRSS()

        def measure(op: str, method: str, rep: int, fn, prepare, check=None) -> None:
            prepare()
            gc.collect(1)
            trim_heap()
            dist.barrier()
            with peak:
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                dt = time.perf_counter() - t0
            rec = dict(op=op, method=method, rep=rep, seconds=dt, extra_rss=peak.extra, rank=rank,
                       ok=None if check is None else check())
            if op == "save" and method == "plugin":
                rec["planning_s"], rec["hooks_s"] = TimedWriter.planned_at - t0, TimedWriter.hooks
                if rank == 0:  # the coordinator: from the end of planning to its finish(), and from there to the end
                    rec["write_s"], rec["finish_s"] = TimedWriter.finish_at - TimedWriter.planned_at, t0 + dt - TimedWriter.finish_at
            records.append(rec)
            if rank == 0:
                print(f"  {op:8} rep {rep} {method:10} {dt:7.3f} s  +{peak.extra / _MiB:7.1f} MiB"
                      + ("  WRONG DATA" if rec["ok"] is False else ""), file=sys.stderr, flush=True)

        def rm(path: str) -> None:
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)

        def plugin_save(path: str, st) -> None:  # type: ignore[no-untyped-def]
            TimedWriter.hooks = 0.0
            dcp.save(st, storage_writer=TimedWriter(path))

        saves = {
            "plugin": lambda p, st=state: plugin_save(p, st),
            "dcp": lambda p, st=state: dcp.save(st, storage_writer=dcp.FileSystemWriter(p)),
            "shardsafe": lambda p, st=state: shardsafe.Checkpointer().save(p, st),
        }
        for rep in range(cfg.reps):
            for m in _rotated(METHODS, rep):
                measure("save", m, rep, lambda m=m, f=saves: f[m](_path(cfg, m)), lambda m=m: rm(_path(cfg, m)))

        def loads(op: str, target, expect: int) -> None:
            fns = {
                "plugin": lambda: dcp.load(target, storage_reader=shardsafe.dcp.StorageReader(_path(cfg, "plugin"))),
                "dcp": lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(_path(cfg, "dcp"))),
                "shardsafe": lambda: shardsafe.Checkpointer().load(_path(cfg, "shardsafe"), target),
            }

            def prepare(m: str) -> None:
                scribble(target)
                if rank == 0:
                    warm_cache(_path(cfg, m))

            for rep in range(cfg.reps):
                for m in _rotated(METHODS, rep):
                    measure(op, m, rep, fns[m], lambda m=m: prepare(m), lambda: state_crc(target) == expect)

        loads("load", state, crc)
        del state, saves
        gc.collect()
        target = build_state(spec, mesh, 1)  # the same tensors as Shard(1)
        loads("reshard", target, state_crc(target))
        del target
        gc.collect()
        solo = dist.new_group([0])  # rank 0 converts alone (the other waits), saving on a one-rank group
        if rank == 0:
            records += _convert(cfg, solo)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return records


# ---------------------------------------------------------------- rank 0 alone: convert


def _convert(cfg: Config, group) -> list[dict]:  # type: ignore[no-untyped-def]
    """``convert`` against ``dcp.load`` (``no_dist``) + ``Checkpointer.save`` (on ``group``, this
    rank alone) of DCP's checkpoint."""
    import torch
    import torch.distributed.checkpoint as dcp
    from iobench.states import nbytes

    import shardsafe
    import shardsafe.dcp

    spec, _ = training_spec(int(cfg.mib_per_rank * _MiB * WORLD))
    src = _path(cfg, "dcp")
    total = nbytes(spec)

    loaded_at: list[float] = []

    def baseline(dst: str) -> None:
        full = {k: torch.empty(s, dtype=d) for k, s, d in spec}
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": no group, on purpose
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(full, storage_reader=dcp.FileSystemReader(src), no_dist=True)
        loaded_at.append(time.perf_counter())
        shardsafe.Checkpointer().save(dst, full, process_group=group)

    fns = {"convert": lambda dst: shardsafe.dcp.convert(src, dst, progress=False), "dcp-load+save": baseline}
    peak = PeakRSS()
    records = []
    for rep in range(cfg.reps):
        for m in _rotated(CONVERTS, rep):
            dst = os.path.join(cfg.root, "converted", m)
            shutil.rmtree(dst, ignore_errors=True)
            warm_cache(src)
            gc.collect()
            trim_heap()
            before = _rss()
            with peak:
                t0 = time.perf_counter()
                fns[m](dst)
                dt = time.perf_counter() - t0
            rec = dict(op="convert", method=m, rep=rep, seconds=dt, extra_rss=peak.extra, rank=0, ok=None, bytes=total,
                       rss_before=before)
            if m == "dcp-load+save":
                rec["load_s"] = loaded_at.pop() - t0
            records.append(rec)
            print(f"  convert  rep {rep} {m:13} {dt:7.3f} s  +{peak.extra / _MiB:7.1f} MiB", file=sys.stderr, flush=True)
            shutil.rmtree(dst, ignore_errors=True)
    return records


# ---------------------------------------------------------------- summary


def summarize(records: list[dict]) -> dict[str, dict[str, dict]]:
    """op -> method -> medians over repetitions of the slowest rank's time and the largest peak RSS."""
    merged: dict[tuple, dict] = {}
    for r in records:
        key = (r["op"], r["method"], r["rep"])
        m = merged.setdefault(key, {k: v for k, v in r.items() if k != "rank"})
        m["seconds"] = max(m["seconds"], r["seconds"])
        m["extra_rss"] = max(m["extra_rss"], r["extra_rss"])
        for f in ("planning_s", "hooks_s", "write_s", "finish_s"):
            if r.get(f) is not None:
                m[f] = max(m[f], r[f]) if m.get(f) is not None else r[f]
        if r["ok"] is not None:
            m["ok"] = bool(m["ok"]) and r["ok"]
    out: dict[str, dict[str, dict]] = {}
    for (op, method, _), r in sorted(merged.items(), key=lambda kv: kv[0][2]):
        out.setdefault(op, {}).setdefault(method, {"seconds": [], "extra_rss": [], "planning_s": [], "ok": True})
        row = out[op][method]
        row["seconds"].append(r["seconds"])
        row["extra_rss"].append(r["extra_rss"])
        if r.get("planning_s") is not None:
            row["planning_s"].append(r["planning_s"])
        for f in ("hooks_s", "write_s", "finish_s", "load_s"):
            if r.get(f) is not None:
                row.setdefault(f, []).append(r[f])
        row["ok"] = row["ok"] and r["ok"] is not False
    for rows in out.values():
        for row in rows.values():
            row["seconds"] = median(row["seconds"])
            row["extra_rss"] = median(row["extra_rss"])
            row["planning_s"] = median(row["planning_s"]) if row["planning_s"] else None
            for f in ("hooks_s", "write_s", "finish_s", "load_s"):
                if f in row:
                    row[f] = median(row[f])
    return out


def ratio_lines(summary: dict[str, dict[str, dict]], total: int) -> list[str]:
    lines = []
    for op in ("save", "load", "reshard"):
        rows = summary.get(op)
        if not rows:
            continue
        p, d, s = (rows[m]["seconds"] for m in METHODS)
        line = (f"DCP {op} plugin_s={p:.4f} dcp_s={d:.4f} shardsafe_s={s:.4f} plugin_vs_dcp={p / d:.2f}x "
                f"plugin_vs_shardsafe={p / s:.2f}x")
        if op == "save":
            plan = rows["plugin"]["planning_s"]
            line += f" planning_s={plan:.4f} planning_share={100 * plan / p:.1f}% hooks_s={rows['plugin']['hooks_s']:.4f}"
            line += f" write_s={rows['plugin']['write_s']:.4f} finish_s={rows['plugin']['finish_s']:.4f}"
        lines.append(line)
    conv = summary.get("convert")
    if conv:
        c, b = conv["convert"], conv["dcp-load+save"]
        lines.append(
            f"DCP convert convert_s={c['seconds']:.4f} convert_mib_s={total / _MiB / c['seconds']:.1f} "
            f"convert_rss_mib={c['extra_rss'] / _MiB:.1f} baseline_s={b['seconds']:.4f} "
            f"baseline_mib_s={total / _MiB / b['seconds']:.1f} baseline_load_s={b['load_s']:.4f} "
            f"baseline_rss_mib={b['extra_rss'] / _MiB:.1f} "
            f"convert_vs_baseline={c['seconds'] / b['seconds']:.2f}x"
        )
    return lines


def markdown(summary: dict[str, dict[str, dict]], info: dict, config: dict) -> str:
    total = config["state_bytes"]
    head = (
        f"{info['date']}, {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, torch {info['torch']}, "
        f"commit {info['commit']}; {WORLD} gloo ranks, {config['mib_per_rank']:g} MiB per rank ({config['state']}), "
        f"{config['reps']} repetitions interleaved (medians), {config['elapsed_s']:.0f} s in all.\n\n"
        "| op | method | s | MiB/s | planning s (our hooks) | peak extra RSS MiB | data |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    body = []
    for op, rows in summary.items():
        for m, r in rows.items():
            plan = "-" if r["planning_s"] is None else f"{r['planning_s']:.4f} ({r['hooks_s']:.4f})"
            ok = "-" if op in ("save", "convert") else ("ok" if r["ok"] else "WRONG")
            body.append(f"| {op} | {m} | {r['seconds']:.4f} | {total / _MiB / r['seconds']:.0f} | {plan} "
                        f"| {r['extra_rss'] / _MiB:.1f} | {ok} |")
    lines = ratio_lines(summary, total)
    return head + "\n".join(body) + "\n\n```\n" + "\n".join(lines) + "\n```\n"


def update_docs(doc: str, table: str) -> None:
    """Replace the generated part of the DCP section of ``doc`` (between its markers)."""
    replace_section(doc, BEGIN, END, table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib-per-rank", type=float, default=None, help="training state per rank (default 256, --quick 4)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of every method (default 5, --quick 2)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 MiB per rank, 2 repetitions")
    ap.add_argument("--dir", default="/tmp/shardsafe-bench-dcp", help="scratch directory for the checkpoints (emptied)")
    ap.add_argument("--out", default=os.path.join(_REPO, "benchmarks", "results"))
    ap.add_argument("--update-docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = ap.parse_args(argv)
    mib = args.mib_per_rank if args.mib_per_rank is not None else (4.0 if args.quick else 256.0)
    reps = args.reps if args.reps is not None else (2 if args.quick else 5)
    if reps < 1 or mib <= 0:
        ap.error(f"bad --reps {reps} or --mib-per-rank {mib}")
    cfg = Config(root=args.dir, mib_per_rank=mib, reps=reps)
    shutil.rmtree(cfg.root, ignore_errors=True)
    os.makedirs(cfg.root)
    t0 = time.time()
    try:
        records = run_ranks_collect(_run_rank, WORLD, cfg, daemon=False, join_s=60)
    finally:
        shutil.rmtree(cfg.root, ignore_errors=True)
    from iobench.states import nbytes

    spec, desc = training_spec(int(mib * _MiB * WORLD))
    config = dict(asdict(cfg), elapsed_s=round(time.time() - t0, 1), state=desc, state_bytes=nbytes(spec))
    info = machine()
    summary = summarize(records)
    table = markdown(summary, info, config)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dcp.json"), "w") as f:
        json.dump(dict(machine=info, config=config, records=records, summary=summary), f, indent=1)
    with open(os.path.join(args.out, "dcp.md"), "w") as f:
        f.write(table)
    if args.update_docs:
        update_docs(os.path.join(_REPO, "docs", "benchmarks.md"), table)
    print(table)
    print(f"\n{config['elapsed_s']:.0f} s; raw results in {args.out}/dcp.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
