"""Micro-benchmark of the pure planning code at scale, every rank simulated in one process.

Times what the coordinator and each rank do between the all-gather of descriptions and the
first byte of I/O, with no process group:

(a) ``plan_save`` for an FSDP layout: every tensor ``Shard(0)`` over all ranks (torch.chunk
    semantics, so trailing ranks may hold nothing);
(b) ``plan_save`` for a DDP layout: every tensor replicated on every rank (dedup + balancing);
(c) ``plan_save`` for FSDP x TP: ranks on a (dp, tp) mesh, 2-D tensors ``[Shard(0), Shard(1)]``,
    1-D tensors ``[Shard(0), Replicate()]``;
(d) the read side of (a): building ``StorageMetadata`` from the plan and serializing it (the
    coordinator), ``StorageMetadata.from_json`` (every rank), and, for one rank of a world of
    half the size, ``StoredIndex`` + ``plan_reads`` for every tensor.

Usage::

    python benchmarks/bench_planner.py [--ranks 4096] [--tensors 200] [--quick]
        [--only fsdp,ddp,2d,read] [--profile fsdp] [--gc-off]

The defaults (4096 ranks x 200 tensors, about 0.8 M pieces per scenario) run in about 80 s and
2.7 GiB peak RSS on two cores; ``--quick`` (512 x 200) in about 10 s. ``--tensors 1000`` at
4096 ranks (4 M pieces) takes about 8 minutes and 13 GiB: costs grow faster than linearly, much
of it the cyclic garbage collector walking the growing heap (compare ``--gc-off``).

The model is a Llama-7B-like mix (embedding, attention and MLP projections, norms, output head),
repeated layer by layer until ``--tensors`` keys exist. Descriptions are rebuilt with fresh tuples
per rank, as unpickling an all-gather would give. ``desc MiB`` is the Python memory of all
ranks' descriptions (tracemalloc over a sample of ranks, scaled to the world size).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import resource
import sys
import time
import tracemalloc
from collections.abc import Callable
from functools import partial
from math import prod

from shardsafe._gc import paused_gc
from shardsafe.engine.writer import _build_metadata
from shardsafe.format.checksum import encode_digests
from shardsafe.format.metadata import StorageMetadata
from shardsafe.knobs import KNOBS
from shardsafe.planning.geometry import Piece, chunk_bounds
from shardsafe.planning.read_plan import StoredIndex, plan_reads
from shardsafe.planning.save_plan import SavePlan, TensorDesc, plan_save

Shape = tuple[int, ...]
SPLIT_BYTES = 16 << 20
TP = 8
SCENARIOS = ("fsdp", "ddp", "2d", "read")

# (name, shape) of one transformer block, Llama-7B sizes
_HIDDEN, _FFN, _VOCAB = 4096, 11008, 32000
_BLOCK: tuple[tuple[str, Shape], ...] = (
    ("attention.wq.weight", (_HIDDEN, _HIDDEN)),
    ("attention.wk.weight", (_HIDDEN, _HIDDEN)),
    ("attention.wv.weight", (_HIDDEN, _HIDDEN)),
    ("attention.wo.weight", (_HIDDEN, _HIDDEN)),
    ("feed_forward.w1.weight", (_FFN, _HIDDEN)),
    ("feed_forward.w2.weight", (_HIDDEN, _FFN)),
    ("feed_forward.w3.weight", (_FFN, _HIDDEN)),
    ("attention_norm.weight", (_HIDDEN,)),
    ("ffn_norm.weight", (_HIDDEN,)),
)


def model_tensors(n: int) -> list[tuple[str, str, Shape]]:
    """``n`` (key, dtype, global shape) of a Llama-like model: embedding, blocks, norm, head."""
    body: list[tuple[str, str, Shape]] = []
    layer = 0
    while len(body) < n - 3:
        body += [(f"layers.{layer}.{name}", "bfloat16", shape) for name, shape in _BLOCK]
        layer += 1
    return [
        ("tok_embeddings.weight", "bfloat16", (_VOCAB, _HIDDEN)),
        *body[: n - 3],
        ("norm.weight", "bfloat16", (_HIDDEN,)),
        ("output.weight", "bfloat16", (_VOCAB, _HIDDEN)),
    ]


# --- per-rank descriptions -------------------------------------------------------------------


def _fresh(t: Shape) -> Shape:
    return (*t,)  # a new tuple object, as each rank's unpickled description has


def fsdp_rank(model: list[tuple[str, str, Shape]], world: int, rank: int) -> list[TensorDesc]:
    out = []
    for key, dtype, shape in model:
        start, size = chunk_bounds(shape[0], world, rank)
        pieces: tuple[Piece, ...] = ()
        if size:
            pieces = (((start, *(0,) * (len(shape) - 1)), (size, *shape[1:]), None),)
        out.append(TensorDesc(key, dtype, _fresh(shape), pieces))
    return out


def ddp_rank(model: list[tuple[str, str, Shape]], world: int, rank: int) -> list[TensorDesc]:
    return [
        TensorDesc(key, dtype, _fresh(shape), (((0,) * len(shape), _fresh(shape), None),))
        for key, dtype, shape in model
    ]


def grid_rank(model: list[tuple[str, str, Shape]], world: int, rank: int) -> list[TensorDesc]:
    dp = world // TP
    dp_i, tp_i = divmod(rank, TP)  # mesh (dp, tp), tp innermost
    out = []
    for key, dtype, shape in model:
        s0, n0 = chunk_bounds(shape[0], dp, dp_i)
        if len(shape) == 1:  # [Shard(0), Replicate()]
            off, lens = (s0,), (n0,)
        else:  # [Shard(0), Shard(1)]
            s1, n1 = chunk_bounds(shape[1], TP, tp_i)
            off, lens = (s0, s1, *(0,) * (len(shape) - 2)), (n0, n1, *shape[2:])
        pieces: tuple[Piece, ...] = ((off, lens, None),) if prod(lens) else ()
        out.append(TensorDesc(key, dtype, _fresh(shape), pieces))
    return out


Builder = Callable[[list[tuple[str, str, Shape]], int, int], list[TensorDesc]]


def build_all(builder: Builder, model, world: int) -> tuple[list[list[TensorDesc]], float]:
    """Every rank's descriptions, and their Python memory in MiB (a few ranks measured, scaled)."""
    sample = sorted({world * i // 8 for i in range(8)} | {world - 1})
    gc.collect()  # also empties the tuple free lists, whose reuse tracemalloc would not see
    tracemalloc.start()
    kept = [builder(model, world, r) for r in sample]
    mib = tracemalloc.get_traced_memory()[0] * world / len(sample) / (1 << 20)
    tracemalloc.stop()
    del kept
    enabled = gc.isenabled()
    gc.disable()  # building is not timed; do not let the collector walk the growing heap
    try:
        descs = [builder(model, world, r) for r in range(world)]
    finally:
        if enabled:
            gc.enable()
    return descs, mib


# --- metadata from a plan --------------------------------------------------------------------


def metadata_from_plan(plan: SavePlan) -> StorageMetadata:
    """What ``engine.writer`` commits, with every block digest 0 (no bytes are written here)."""
    block = KNOBS.checksum_block_bytes
    sums = [
        [encode_digests([0] * -(-(it.byte_range[1] - it.byte_range[0]) // block)) for it in r.items] for r in plan.ranks
    ]
    return _build_metadata(plan, sums, ({}, {}), block)


def fsdp_targets(meta: StorageMetadata, world: int, rank: int) -> dict[str, list[Piece]]:
    out = {}
    for key, t in meta.tensors.items():
        start, size = chunk_bounds(t.shape[0], world, rank)
        out[key] = [((start, *(0,) * (len(t.shape) - 1)), (size, *t.shape[1:]), None)] if size else []
    return out


# --- running ---------------------------------------------------------------------------------


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, step: str, seconds: float, size: str, note: str = "") -> None:
        row = (step, f"{seconds:9.3f}", size, note)
        self.rows.append(row)
        print(f"  {row[0]:<44} {row[1]} s  {row[2]:<26} {row[3]}", flush=True)

    def render(self) -> str:
        head = ("step", "seconds", "size", "notes")
        widths = [max(len(r[i]) for r in [head, *self.rows]) for i in range(4)]
        fmt = " | ".join(f"{{:<{w}}}" if i != 1 else f"{{:>{w}}}" for i, w in enumerate(widths))
        lines = [fmt.format(*head), "-+-".join("-" * w for w in widths)]
        lines += [fmt.format(*r) for r in self.rows]
        return "\n".join(lines)


def timed(fn, profiler: cProfile.Profile | None = None):
    """Time ``fn`` as the engine runs it: with the cyclic GC paused (``shardsafe._gc``)."""
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    try:
        with paused_gc():
            out = fn()
    finally:
        if profiler is not None:
            profiler.disable()
    return out, time.perf_counter() - t0


def _plan_stats(plan: SavePlan) -> str:
    items = sum(len(r.items) for r in plan.ranks)
    writers = sum(1 for r in plan.ranks if r.items)
    return f"{items} chunks, {writers} writers"


def run_save(name: str, builder: Builder, model, world: int, table: Table, prof) -> SavePlan:
    descs, mib = build_all(builder, model, world)
    pieces = sum(len(d.pieces) for rank in descs for d in rank)
    plan, dt = timed(lambda: plan_save(descs, save_id="x", split_bytes=SPLIT_BYTES), prof)
    table.add(f"({name}) plan_save", dt, f"{pieces} pieces", f"desc {mib:.0f} MiB; {_plan_stats(plan)}")
    return plan


def run_read(plan: SavePlan, world: int, table: Table, profs: dict[str, cProfile.Profile | None]) -> None:
    meta, dt = timed(lambda: metadata_from_plan(plan), profs.get("read"))
    chunks = sum(len(s) for t in meta.tensors.values() for s in t.shard_spec_per_file.values())
    table.add("(d) build StorageMetadata from plan (coord.)", dt, f"{chunks} chunks")
    raw, dt = timed(meta.to_json, profs.get("read"))
    table.add("(d) StorageMetadata.to_json (coordinator)", dt, f"{len(raw) / (1 << 20):.1f} MiB JSON")
    del meta
    parsed, dt = timed(partial(StorageMetadata.from_json, raw, where="bench"), profs.get("read"))
    table.add("(d) StorageMetadata.from_json (every rank)", dt, f"{len(raw) / (1 << 20):.1f} MiB JSON", "incl. _check")
    del raw

    target_world = max(1, world // 2)
    rank = target_world // 2
    targets = fsdp_targets(parsed, target_world, rank)

    def indexes():
        return {key: StoredIndex(t) for key, t in parsed.tensors.items()}

    idx, dt_idx = timed(indexes, profs.get("read"))
    segs = sum(len(i.segments) for i in idx.values())
    table.add(f"(d) StoredIndex x{len(idx)} (one rank)", dt_idx, f"{segs} segments")

    def reads():
        n = 0
        for key, pieces in targets.items():
            items, covered = plan_reads(idx[key], pieces)
            if covered != [prod(p[1]) for p in pieces]:
                raise AssertionError(f"key {key!r}: target not fully covered: {covered}")
            n += len(items)
        return n

    n_items, dt_read = timed(reads, profs.get("read"))
    table.add(f"(d) plan_reads x{len(targets)} (rank {rank} of {target_world})", dt_read, f"{n_items} read items")
    table.add("(d) per-rank read planning total", dt_idx + dt_read, "index + plan_reads", "excl. from_json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=None, help="world size (default 4096; 512 with --quick)")
    ap.add_argument("--tensors", type=int, default=None, help="tensors in the model (default 200)")
    ap.add_argument("--quick", action="store_true", help="512 ranks unless --ranks is given")
    ap.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated subset of {','.join(SCENARIOS)}")
    ap.add_argument(
        "--profile", default="", help="cProfile these scenarios (comma-separated) and print the top entries"
    )
    ap.add_argument("--top", type=int, default=30, help="profile entries to print")
    ap.add_argument(
        "--gc-off", action="store_true", help="disable the cyclic GC for the whole run (timed steps always pause it, as the engine does)"
    )
    args = ap.parse_args(argv)

    world = args.ranks if args.ranks is not None else (512 if args.quick else 4096)
    n_tensors = args.tensors if args.tensors is not None else 200
    only = [s for s in args.only.split(",") if s]
    profile = [s for s in args.profile.split(",") if s]
    for s in [*only, *profile]:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")
    if world < 1:
        ap.error(f"--ranks must be >= 1, got {world}")
    if n_tensors < 3:
        ap.error(f"--tensors must be >= 3 (embedding, final norm, output head), got {n_tensors}")
    if "2d" in only and world % TP:
        ap.error(f"scenario 2d needs --ranks divisible by tp={TP}, got {world}")
    if args.gc_off:
        gc.disable()

    model = model_tensors(n_tensors)
    nbytes = sum(prod(s) * 2 for _, _, s in model)
    print(
        f"bench_planner: {world} ranks x {n_tensors} tensors ({nbytes / 1e9:.1f} GB bf16), "
        f"split_bytes={SPLIT_BYTES >> 20} MiB, python {sys.version.split()[0]}, gc {'off' if args.gc_off else 'on'}",
        flush=True,
    )
    profs = {s: cProfile.Profile() for s in profile}
    table = Table()
    t_start = time.perf_counter()

    if "fsdp" in only or "read" in only:
        plan = run_save("a", fsdp_rank, model, world, table, profs.get("fsdp"))
        if "read" in only:
            run_read(plan, world, table, profs)
        del plan
    if "ddp" in only:
        run_save("b", ddp_rank, model, world, table, profs.get("ddp"))
    if "2d" in only:
        run_save(f"c: dp={world // TP} x tp={TP}", grid_rank, model, world, table, profs.get("2d"))

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s wall, peak RSS {peak:.0f} MiB\n")
    print(table.render())
    for name, prof in profs.items():
        for order in ("cumulative", "tottime"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(args.top)
            print(f"\n=== profile: {name}, by {order} ===\n{buf.getvalue()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
