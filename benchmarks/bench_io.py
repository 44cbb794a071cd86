"""shardsafe against every peer and against this machine's limit, in one run.

Usage::

    python benchmarks/bench_io.py [--total-gib 2] [--model-total-gib 1] [--reps 3] [--world-sizes 1,2,4] [--cases synthetic,model]
        [--quick] [--cache both|warm|cold] [--dir /tmp/shardsafe-bench] [--out benchmarks/results] [--update-docs]

For each world size (one process per rank, gloo), on each state (``synthetic``: a 4 KiB-64 MiB
mix of bf16 and fp32 tensors, 2 GiB; ``model``: the demo transformer with its AdamW state, 1 GiB),
it runs, interleaved and repeated:

- save, durable: shardsafe; DCP ``FileSystemWriter`` at its defaults and with ``thread_count=4``;
  ``torch.save`` and ``safetensors.save_file`` per rank (+fsync); the limit: a raw write of the
  same bytes with fsync, 1 and 4 threads;
- load into the same layout, in place, from a warm and from a cold page cache: shardsafe; DCP ``FileSystemReader``; ``torch.load(mmap=True)``
  and ``safetensors.load_file`` + copy; the limit: ``preadv`` into the allocated tensors, 1 and 4 threads;
- resharding loads from the world-size-2 checkpoints (warm): 2->1, 2->4, Shard(0)->Shard(1);
- unshard to one file, in one process: shardsafe's streaming ``unshard_to_safetensors``, its
  in-memory ``unshard`` + ``save_file``, DCP's ``dcp_to_torch_save``, and a raw copy;

with peak RSS beyond the state for each. Writes ``results.json`` (every measurement),
``results.md`` (the table) and ``results.png`` (the chart) to ``--out``; ``--update-docs`` also
puts the table and chart into ``docs/benchmarks.md``. ``--quick`` is a smoke run (64 MiB states,
warm loads only; about 1.5 minutes here on quiet cores, under 3 with the cores shared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from iobench import methods as M
from iobench import report
from iobench.harness import Config, run_phase, run_unshard

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-gib", type=float, default=2.0, help="bytes of each state (all ranks together)")
    ap.add_argument("--model-total-gib", type=float, default=1.0, help="size of the model case (parameters + AdamW state)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every method (at least 3 for a spread)")
    ap.add_argument("--world-sizes", default="1,2,4")
    ap.add_argument("--cases", default="synthetic,model")
    ap.add_argument("--ops", default="save,load,reshard,unshard")
    ap.add_argument("--quick", action="store_true", help="256 MiB states, for a smoke run")
    ap.add_argument("--cache", choices=("both", "warm", "cold"), default="both",
                    help="before each load, read the checkpoint into the page cache (warm), drop it (cold), or measure both")
    ap.add_argument("--dir", default="/tmp/shardsafe-bench", help="scratch directory for the checkpoints (emptied)")
    ap.add_argument("--out", default=os.path.join(_REPO, "benchmarks", "results"))
    ap.add_argument("--update-docs", action="store_true", help="write the table and chart into docs/benchmarks.md")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints under --dir")
    ap.add_argument("--from-json", metavar="PATH", help="only redo the outputs from an earlier run's results.json")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            old = json.load(f)
        return _outputs(args, old["records"], old["machine"], old["config"])

    if args.quick:  # a smoke run: small states, warm loads only
        args.cache = "warm"
    total = int((1 / 16 if args.quick else args.total_gib) * 2**30)
    model_total = total if args.quick else int(args.model_total_gib * 2**30)
    cases = {c: (total if c == "synthetic" else model_total) for c in args.cases.split(",") if c}
    worlds = tuple(int(w) for w in args.world_sizes.split(","))
    ops = set(args.ops.split(","))
    unknown = ops - {"save", "load", "reshard", "unshard"}
    if unknown or not set(cases) <= {"synthetic", "model"} or args.reps < 1:
        ap.error(f"bad --ops {sorted(unknown)} or --cases {sorted(cases)} or --reps {args.reps}")
    if ops - {"save"} and "save" not in ops:
        ap.error("loads, reshards and unshard read what the saves wrote: include 'save' in --ops")

    from iobench.states import model_spec, nbytes, synthetic_spec

    totals = {c: nbytes(synthetic_spec(t) if c == "synthetic" else model_spec(t)[0]) for c, t in cases.items()}
    cfg = Config(
        root=args.dir,
        cases=cases,
        reps=args.reps,
        world_sizes=worlds,
        cache=args.cache,
        saves=tuple(M.SAVES),
        loads=tuple(M.LOADS) if "load" in ops else (),
        reshards=M.RESHARD_LOADS if "reshard" in ops else (),
        unshards=tuple(M.UNSHARDS) if "unshard" in ops else (),
    )
    shutil.rmtree(cfg.root, ignore_errors=True)
    os.makedirs(cfg.root)
    t0 = time.time()
    records: list[dict] = []
    try:
        for world in sorted(worlds, key=lambda w: (w != 2, w)):  # world size 2 first: its checkpoints are resharded
            print(f"world size {world} ... ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
            records += run_phase(cfg, world)
            if world != 2:
                for case in cases:
                    shutil.rmtree(os.path.join(cfg.root, case, f"ws{world}"), ignore_errors=True)
        if cfg.unshards and 2 in worlds:
            print(f"unshard ... ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
            records += run_unshard(cfg)
    finally:
        if not args.keep:
            shutil.rmtree(cfg.root, ignore_errors=True)
    elapsed = time.time() - t0

    config = dict(totals=totals, reps=cfg.reps, world_sizes=worlds, cache=cfg.cache, elapsed_s=round(elapsed, 1),
                  model=model_spec(cases["model"])[1] if "model" in cases else None)
    return _outputs(args, records, report.machine(), config)


def _outputs(args: argparse.Namespace, records: list[dict], info: dict, config: dict) -> int:
    rows = report.aggregate(records, config["totals"])
    summary = report.summarize(rows)
    table = report.markdown(summary, rows, info, config)
    os.makedirs(args.out, exist_ok=True)
    report.write_json(os.path.join(args.out, "results.json"), records, rows, summary, info, config)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    report.chart(rows, os.path.join(args.out, "results.png"))
    if args.update_docs:
        shutil.copy(os.path.join(args.out, "results.png"), os.path.join(_REPO, "docs", "benchmarks.png"))
        report.update_docs(os.path.join(_REPO, "docs", "benchmarks.md"), table, "benchmarks.png")
    print(table)
    print(f"\n{config['elapsed_s']:.0f} s; raw results in {args.out}/results.json", file=sys.stderr)
    bad = [r for r in rows if r["verified"] is False]
    if bad:
        print(f"WRONG DATA after loading with: {sorted({(r['case'], r['label'], r['method']) for r in bad})}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
