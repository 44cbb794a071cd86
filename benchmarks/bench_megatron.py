"""Megatron-style checkpoints: ``shardsafe.megatron`` against ``megatron.core.dist_checkpointing``.

Four gloo ranks hold a GPT-like model at TP2 x DP2 (rank ``r``: ``tp = r % 2``, ``dp = r // 2``):
an embedding split over the vocabulary, per layer the column-parallel QKV and FC1 (split along
dim 0, QKV's bias too), the row-parallel projection and FC2 (split along dim 1), replicated
layer norms; every tensor a ``ShardedTensor`` whose ``replica_id`` is the DP rank (the layer
norms: ``dp * 2 + tp``), plus a little common state. The same tensors go through each method:

- ``shardsafe``: ``shardsafe.megatron.save`` / ``load`` with their default strategies;
- ``shardsafe-fp``: the same inside ``shardsafe.megatron``'s ``FullyParallel{Save,Load}StrategyWrapper``;
- ``megatron``: megatron-core's ``dist_checkpointing.save`` / ``load`` with its default ``torch_dist``
  backend (PyTorch DCP underneath);
- ``megatron-fp``: the same inside Megatron's ``FullyParallelSaveStrategyWrapper`` /
  ``FullyParallelLoadStrategyWrapper`` (the DP group; for the resharding load the whole job), as
  Megatron-LM runs it with ``--ckpt-fully-parallel-save/load``.

Operations, each bracketed by barriers (a rank's time includes waiting for the slowest): ``save``;
``load`` into the same layout; ``reshard``: load into TP1 x DP4 (every rank the whole model). Before
each, the ranks collect garbage and give freed heap memory back to the OS (glibc ``malloc_trim``), so
what the previous step freed is not paid for inside the next one's clock. The
methods are interleaved in an order rotated each repetition; the table shows medians. Loads read
what the save just wrote (warm page cache), and every loaded tensor is compared bit for bit with
what was saved. megatron-core's ``torch_dist`` code calls ``torch.cuda.synchronize`` /
``current_device`` and its fully parallel load exchanges through CUDA tensors: on this CPU machine
the ranks make the former no-ops and keep the exchange buffers on the CPU (nothing else changes).

Prints a table and ``MEGATRON save=..x load=..x reshard=..x`` (Megatron's best method's median
time over ``shardsafe``'s, per operation) and ``TARGETS`` (save >= 1.3x, loads >= 2x). The table's
CPU column is the median over repetitions of the CPU seconds of the four rank processes together
(every thread, from the opening barrier to the end of the call; not forked helper processes, such as
the workers megatron-core's torch_dist save writes from), and ``CPU load=..x reshard=..x`` is
Megatron's best method's over ``shardsafe``'s: on a machine with fewer cores than ranks the wall
times depend on what else runs, the CPU seconds much less.

The default model is small (64 MiB per rank at TP2): every library's fixed cost per call (its
collectives, planning) is a large part of a load there. ``--rank-mib N`` sets the number of layers
so that each rank holds about N MiB at TP2 (the whole model, twice that, is loaded by every rank
in the resharding load: mind the memory, four ranks times about three times the model).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
sys.path.insert(0, _HERE)

from iobench.harness import run_ranks_collect, trim_heap  # noqa: E402
from iobench.report import replace_section  # noqa: E402

METHODS = ("shardsafe", "shardsafe-fp", "megatron", "megatron-fp")
OPS = ("save", "load", "reshard")
TARGETS = {"save": 1.3, "load": 2.0, "reshard": 2.0}
BEGIN, END = "<!-- bench-megatron:begin -->", "<!-- bench-megatron:end -->"
TP = 2


@dataclass(frozen=True)
class Config:
    root: str
    hidden: int
    layers: int
    vocab: int
    reps: int
    methods: tuple[str, ...]
    dp: int = 2  # data-parallel replicas: TP * dp ranks


# ---------------------------------------------------------------- the model's tensors


def model_shapes(cfg: Config) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """Every tensor's global shape and the axis TP splits (None: replicated)."""
    h = cfg.hidden
    shapes: dict[str, tuple[tuple[int, ...], int | None]] = {"embedding.word_embeddings.weight": ((cfg.vocab, h), 0)}
    for i in range(cfg.layers):
        p = f"decoder.layers.{i}."
        shapes[p + "input_layernorm.weight"] = ((h,), None)
        shapes[p + "self_attention.linear_qkv.weight"] = ((3 * h, h), 0)
        shapes[p + "self_attention.linear_qkv.bias"] = ((3 * h,), 0)
        shapes[p + "self_attention.linear_proj.weight"] = ((h, h), 1)
        shapes[p + "pre_mlp_layernorm.weight"] = ((h,), None)
        shapes[p + "mlp.linear_fc1.weight"] = ((4 * h, h), 0)
        shapes[p + "mlp.linear_fc2.weight"] = ((h, 4 * h), 1)
    shapes["decoder.final_layernorm.weight"] = ((h,), None)
    return shapes


def truth(cfg: Config) -> dict[str, Any]:
    """The whole model, the same on every rank (one seeded generator per tensor)."""
    import torch

    out = {}
    for n, (key, (shape, _axis)) in enumerate(model_shapes(cfg).items()):
        out[key] = torch.randn(shape, generator=torch.Generator().manual_seed(n))
    return out


def local_part(t: Any, axis: int | None, tp: int, tp_size: int) -> Any:
    return t if axis is None or tp_size == 1 else t.chunk(tp_size, axis)[tp]


def sharded_state(mapping: Any, cfg: Config, whole: dict[str, Any], tp: int, tp_size: int, dp: int, empty: bool) -> dict:
    """The rank's sharded state dict with ``mapping.ShardedTensor`` (Megatron's or ours): its parts
    of ``whole`` (copied), or zeros of their shapes to load into (``empty``)."""
    import torch

    sd: dict[str, Any] = {}
    for key, (_shape, axis) in model_shapes(cfg).items():
        part = local_part(whole[key], axis, tp, tp_size)
        data = torch.zeros_like(part) if empty else part.clone()
        if axis is None or tp_size == 1:
            sd[key] = mapping.ShardedTensor.from_rank_offsets(key, data, replica_id=dp * tp_size + tp)
        else:
            sd[key] = mapping.ShardedTensor.from_rank_offsets(key, data, (axis, tp, tp_size), replica_id=dp)
    sd["iteration"] = 1000
    sd["checkpoint_version"] = 3.0
    return sd


def matches(got: dict, whole: dict[str, Any], cfg: Config, tp: int, tp_size: int) -> bool:
    import torch

    return all(torch.equal(got[k], local_part(whole[k], axis, tp, tp_size)) for k, (_s, axis) in model_shapes(cfg).items()) and got["iteration"] == 1000


# ---------------------------------------------------------------- megatron-core on the CPU


def _cpu_megatron() -> None:
    """megatron-core's torch_dist save calls ``torch.cuda.synchronize`` / ``current_device``, and
    its fully parallel load's exchange puts its buffers on ``"cuda"``: keep all of it on the CPU."""
    import torch

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self  # nothing on the CPU path of these ranks needs a GPU
    from megatron.core.dist_checkpointing import exchange_utils as ex

    def empty_for_exchange(shard_id, needed_shards, unneeded_shards, loaded_tensors):
        needed = needed_shards.get(shard_id)
        if needed is None:
            sh = unneeded_shards[shard_id]
            if sh.data is None:
                sh.init_data("cpu")
                tensor, sh.data = sh.data, None
            else:
                tensor = torch.empty_like(sh.data)
            return tensor, None
        needed.init_data("cpu")
        loaded_tensors[shard_id] = needed.data
        return needed.data, needed.data.device

    ex._get_empty_tensor_for_exchange = empty_for_exchange


# ---------------------------------------------------------------- the methods


class Methods:
    """One rank's save / load functions per method (strategies built once, outside the clock)."""

    def __init__(self, rank: int, world: int) -> None:
        import torch.distributed as dist

        self.tp, self.dp = rank % TP, rank // TP
        # every rank creates every group, in the same order
        self.dp_group = [dist.new_group([t + TP * d for d in range(world // TP)]) for t in range(TP)][self.tp]
        self.world_group = dist.group.WORLD

    def save(self, method: str, sd: dict, path: str) -> None:
        if method.startswith("shardsafe"):
            from shardsafe.megatron import save
            from shardsafe.megatron.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
            from shardsafe.megatron.strategies.native import ShardsafeSaveShardedStrategy

            strategy = FullyParallelSaveStrategyWrapper(ShardsafeSaveShardedStrategy(), self.dp_group) if method.endswith("-fp") else None
            save(sd, path, sharded_strategy=strategy)
        else:
            from megatron.core import dist_checkpointing as mdc
            from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
            from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

            strategy = None
            if method.endswith("-fp"):
                strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), self.dp_group)
            mdc.save(sd, path, sharded_strategy=strategy)

    def load(self, method: str, sd: dict, path: str, group: Any) -> dict:
        if method.startswith("shardsafe"):
            from shardsafe.megatron import load
            from shardsafe.megatron.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
            from shardsafe.megatron.strategies.native import ShardsafeLoadShardedStrategy

            strategy = FullyParallelLoadStrategyWrapper(ShardsafeLoadShardedStrategy(), group) if method.endswith("-fp") else None
            return load(sd, path, sharded_strategy=strategy)
        from megatron.core import dist_checkpointing as mdc
        from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

        strategy = None
        if method.endswith("-fp"):
            strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(path), group)
        return mdc.load(sd, path, sharded_strategy=strategy)


def _rotated(names: tuple[str, ...], k: int) -> list[str]:
    k %= len(names)
    return list(names[k:] + names[:k])


def _run_rank(rank: int, world: int, port: int, cfg: Config) -> list[dict]:
    import multiprocessing

    multiprocessing.current_process()._config["daemon"] = False  # torch_dist's writer forks workers
    import torch
    import torch.distributed as dist

    _cpu_megatron()
    from megatron.core.dist_checkpointing import mapping as mmapping

    from shardsafe.megatron import mapping as smapping

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    records: list[dict] = []
    try:
        methods = Methods(rank, world)
        tp, dp = methods.tp, methods.dp
        whole = truth(cfg)
        local_bytes = sum(local_part(t, a, tp, TP).nbytes for (k, (_s, a)), t in zip(model_shapes(cfg).items(), whole.values()))

        def timed(op: str, method: str, rep: int, fn) -> Any:
            gc.collect()
            trim_heap()  # what the previous step freed goes back to the OS now, not inside this clock
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            out = fn()
            cpu = time.process_time() - c0
            dist.barrier()
            records.append({
                "op": op, "method": method, "rep": rep, "rank": rank, "seconds": time.perf_counter() - t0, "cpu_s": cpu,
                "local_bytes": local_bytes,
            })
            return out

        for rep in range(cfg.reps):
            for m in _rotated(cfg.methods, rep):
                mapping = smapping if m.startswith("shardsafe") else mmapping
                path = os.path.join(cfg.root, m)
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                    os.makedirs(path)
                sd = sharded_state(mapping, cfg, whole, tp, TP, dp, empty=False)
                timed("save", m, rep, lambda m=m, sd=sd, path=path: methods.save(m, sd, path))
                del sd

                target = sharded_state(mapping, cfg, whole, tp, TP, dp, empty=True)
                got = timed("load", m, rep, lambda m=m, t=target, path=path: methods.load(m, t, path, methods.dp_group))
                records[-1]["ok"] = matches(got, whole, cfg, tp, TP)
                del target, got

                target = sharded_state(mapping, cfg, whole, 0, 1, rank, empty=True)  # TP1 x DP(world)
                got = timed("reshard", m, rep, lambda m=m, t=target, path=path: methods.load(m, t, path, methods.world_group))
                records[-1]["ok"] = matches(got, whole, cfg, 0, 1)
                del target, got
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return records


# ---------------------------------------------------------------- summary


def summarize(records: list[dict], methods: tuple[str, ...]) -> dict[str, dict[str, dict]]:
    """Per operation and method: median over repetitions of the slowest rank's time and of the
    ranks' CPU seconds together, and whether every rank's load was bit-exact."""
    out: dict[str, dict[str, dict]] = {}
    for op in OPS:
        out[op] = {}
        for m in methods:
            recs = [r for r in records if r["op"] == op and r["method"] == m]
            reps = sorted({r["rep"] for r in recs})
            per_rep = [max(r["seconds"] for r in recs if r["rep"] == k) for k in reps]
            cpu = [sum(r["cpu_s"] for r in recs if r["rep"] == k) for k in reps]
            ok = all(r.get("ok", True) for r in recs)
            out[op][m] = {"median_s": statistics.median(per_rep), "reps_s": per_rep, "cpu_s": statistics.median(cpu), "ok": ok}
    return out


def ratio_lines(summary: dict[str, dict[str, dict]]) -> list[str]:
    values, best, targets, cpu = [], [], [], []
    for op in OPS:
        peers = {m: v for m, v in summary[op].items() if m.startswith("megatron")}
        if "shardsafe" not in summary[op] or not peers:
            continue
        name = min(peers, key=lambda m: peers[m]["median_s"])
        ratio = peers[name]["median_s"] / summary[op]["shardsafe"]["median_s"]
        values.append(f"{op}={ratio:.2f}x")
        best.append(f"{op}_best={name}")
        targets.append(f"{op}>={TARGETS[op]:g}x:{'ok' if ratio >= TARGETS[op] else 'MISS'}")
        if op != "save":  # a torch_dist save writes from forked processes, whose CPU is not counted
            lean = min(peers, key=lambda m: peers[m]["cpu_s"])
            cpu.append(f"{op}={peers[lean]['cpu_s'] / summary[op]['shardsafe']['cpu_s']:.2f}x")
    return [f"MEGATRON {' '.join(values + best)}", f"TARGETS {' '.join(targets)}", f"CPU {' '.join(cpu)}"]


def table(summary: dict[str, dict[str, dict]], cfg: Config, total_bytes: int) -> str:
    lines = [
        f"| operation | method | median s | spread s | GB/s (model) | vs shardsafe | bit-exact | CPU s ({TP * cfg.dp} ranks) |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for op in OPS:
        base = summary[op].get("shardsafe", {}).get("median_s")
        for m, v in summary[op].items():
            rel = f"{v['median_s'] / base:.2f}x" if base else "-"
            spread = f"{min(v['reps_s']):.3f}–{max(v['reps_s']):.3f}"
            lines.append(
                f"| {op} | {m} | {v['median_s']:.3f} | {spread} | {total_bytes / v['median_s'] / 1e9:.3g} | {rel} | "
                f"{'yes' if v['ok'] else 'NO'} | {v['cpu_s']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def update_docs(doc: str, table: str) -> None:
    """Replace the generated part of the Megatron section of ``doc`` (between its markers)."""
    replace_section(doc, BEGIN, END, table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default 1024, --quick 64)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rank-mib", type=float, default=None, help="instead of --layers: as many layers as make about this many MiB per rank at TP2")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 8192, --quick 256)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions of every method (default 5, --quick 1)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of: " + ", ".join(METHODS))
    ap.add_argument("--dp", type=int, default=2, help="data-parallel replicas (ranks: 2 x this; default 2, the 4-rank TP2 x DP2 case)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: a tiny model, one repetition")
    ap.add_argument("--dir", default="/tmp/shardsafe-bench-megatron", help="scratch directory for the checkpoints (emptied)")
    ap.add_argument("--out", default=os.path.join(_REPO, "benchmarks", "results"))
    ap.add_argument("--update-docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = ap.parse_args(argv)
    methods = tuple(m for m in args.methods.split(",") if m)
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    hidden = args.hidden or (64 if args.quick else 1024)
    vocab = args.vocab or (256 if args.quick else 8192)
    layers = args.layers if args.rank_mib is None else layers_for(args.rank_mib * 2**20, hidden, vocab)
    cfg = Config(
        root=args.dir,
        hidden=hidden,
        layers=layers,
        vocab=vocab,
        reps=args.reps or (1 if args.quick else 5),
        methods=methods,
        dp=args.dp,
    )
    total = sum(4 * _numel(s) for s, _a in model_shapes(cfg).values())
    shutil.rmtree(cfg.root, ignore_errors=True)
    os.makedirs(cfg.root)
    try:
        records = run_ranks_collect(_run_rank, TP * cfg.dp, cfg, timeout=1800, daemon=False, join_s=60)
    finally:
        shutil.rmtree(cfg.root, ignore_errors=True)
    summary = summarize(records, methods)
    head = (
        f"{TP * cfg.dp} ranks, TP{TP} x DP{cfg.dp} -> reshard to TP1 x DP{TP * cfg.dp}; GPT-like: hidden {cfg.hidden}, {cfg.layers} layers, "
        f"vocabulary {cfg.vocab}; model {total / 2**20:.1f} MiB fp32, {rank_bytes(cfg) / 2**20:.1f} MiB per rank; "
        f"median of {cfg.reps} interleaved repetitions, warm page cache\n\n"
    )
    text = head + table(summary, cfg, total)
    lines = ratio_lines(summary)
    print(text)
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "megatron.json"), "w") as f:
        json.dump({"config": asdict(cfg), "summary": summary, "lines": lines, "records": records}, f, indent=1)
    if args.update_docs:
        update_docs(os.path.join(_REPO, "docs", "benchmarks.md"), text + "\n```\n" + "\n".join(lines) + "\n```\n")
    return 0


def rank_bytes(cfg: Config) -> int:
    """The bytes one rank holds at TP2 (fp32)."""
    return sum(4 * _numel(s) // (TP if a is not None else 1) for s, a in model_shapes(cfg).values())


def layers_for(target: float, hidden: int, vocab: int) -> int:
    """The number of layers (at least 1) whose model puts closest to ``target`` bytes on each rank at TP2."""
    def at(n: int) -> int:
        return rank_bytes(Config("", hidden, n, vocab, 1, ()))

    per_layer = at(2) - at(1)
    return max(1, round(1 + (target - at(1)) / per_layer))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


if __name__ == "__main__":
    sys.exit(main())
