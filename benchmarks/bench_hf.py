"""Hugging Face out and in: ``export`` (``unshard_to_safetensors`` with ``max_shard_size``) and
``load_hf_safetensors`` into FSDP2 (2 and 4 ranks) and tensor parallelism (2 ranks), against what
users do today and against the raw read limit.

Usage::

    python benchmarks/bench_hf.py [--mib 256] [--reps 3] [--quick] [--dir /tmp/shardsafe-bench-hf]
        [--out benchmarks/results] [--update-docs]

The model: ``--mib`` MiB of float32 weights, ``nn.Sequential`` of bias-free ``Linear(W, W)``
layers (W = 2048: 16 MiB a layer; ``--quick``: W = 256, 2 MiB in all, 1 repetition). It is saved
by FSDP2 on 2 gloo ranks, then exported once as a Hugging Face folder of 4 files, which every
load case reads (warm page cache: the files are read once before each case).

- **export**, one process, fresh for each repetition: ``shardsafe`` =
  ``unshard_to_safetensors(ckpt, out, prefix="model.", max_shard_size=mib/4)``;
  ``unshard+save_file`` = ``unshard_model_state`` then ``safetensors.torch.save_file`` per quarter
  of the tensors, each file fsynced (what users do today); ``raw copy (limit)`` = the
  checkpoint's data files copied and fsynced (read + write of the same bytes, nothing else).
- **load** into a model of ``ws`` ranks built on the meta device and materialised
  (``to_empty``, then zeroed, so its pages are resident before the clock): ``fsdp2`` =
  ``fully_shard`` per layer and at the root (every weight ``Shard(0)``); ``tp`` =
  ``parallelize_module`` with layers alternately ``ColwiseParallel`` (``Shard(0)``) and
  ``RowwiseParallel`` (``Shard(1)``), as a Megatron MLP pairs them. ``shardsafe`` =
  ``load_hf_safetensors(folder, model)``; ``safetensors+distribute_tensor`` = on every rank
  ``safetensors.torch.load_file`` of each file, ``distribute_tensor(t, mesh, placements,
  src_data_rank=None)`` and a copy into the parameter (what users do today);
  ``preadv share (limit)`` = each rank ``os.preadv``s exactly the bytes of its own shard of
  every tensor straight into the parameter (one call per run of bytes: one per ``Shard(0)``
  tensor, one per row of a ``Shard(1)`` one), single-threaded.

A time is the slowest rank's, between barriers; the median of ``--reps`` is reported (methods
interleaved, the order rotated each repetition). **Peak RSS** is the largest, over ranks and
repetitions, growth of a process's resident memory during the call beyond what it held before
(the model's own memory excluded: ``/proc/self/clear_refs`` resets the high-water mark).
**read/rank** is the bytes a rank read (``load_hf_safetensors``'s return; the whole files for
``load_file``). Prints a markdown table and parseable lines::

    HF <case> shardsafe_s=... baseline_s=... limit_s=... shardsafe_gbs=... shardsafe_vs_baseline=...x shardsafe_vs_limit=...x
        shardsafe_rss_mib=... baseline_rss_mib=... limit_rss_mib=... shardsafe_read_mib=... limit_read_mib=...

for the cases ``export``, ``load-fsdp2-2``, ``load-fsdp2-4`` and ``load-tp-2`` (a ratio below 1:
shardsafe is faster). Writes ``hf.json`` and ``hf.md`` to ``--out``; ``--update-docs`` puts the
table into ``docs/benchmarks.md``. The scratch directory is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
sys.path.insert(0, _HERE)
sys.path.insert(0, _REPO)

from iobench.harness import PeakRSS, trim_heap, warm_cache  # noqa: E402
from iobench.report import machine, replace_section  # noqa: E402
from tests.helpers import CTX as _CTX  # noqa: E402  (a forkserver with torch imported)
from tests.helpers import run_ranks  # noqa: E402

_MiB = 1 << 20
BEGIN, END = "<!-- bench-hf:begin -->", "<!-- bench-hf:end -->"
EXPORTS = ("shardsafe", "unshard+save_file", "raw copy (limit)")
LOADS = ("shardsafe", "safetensors+distribute_tensor", "preadv share (limit)")
CASES = (("load-fsdp2-2", "fsdp2", 2), ("load-fsdp2-4", "fsdp2", 4), ("load-tp-2", "tp", 2))


def _rotated(names: tuple[str, ...], rep: int) -> list[str]:
    k = rep % len(names)
    return list(names[k:] + names[:k])


def _model(layers: int, width: int):
    from torch import nn

    with torch.device("meta"):
        return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])


def _sharded(kind: str, layers: int, width: int, ws: int):
    from torch.distributed.device_mesh import init_device_mesh

    model = _model(layers, width)
    mesh = init_device_mesh("cpu", (ws,))
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for m in model:
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(layers)}
        parallelize_module(model, mesh, plan)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()  # resident before the clock: RSS growth is the loader's own
    return model, mesh


# ---------------------------------------------------------------- load, on every rank


def _files(folder: str) -> list[str]:
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def _load_shardsafe(model, mesh, folder: str) -> int:
    import shardsafe

    return shardsafe.load_hf_safetensors(folder, model)


def _load_baseline(model, mesh, folder: str) -> int:
    from safetensors.torch import load_file
    from torch.distributed.tensor import distribute_tensor

    params = dict(model.named_parameters())
    nread = 0
    for file in _files(folder):
        path = os.path.join(folder, file)
        full = load_file(path)
        nread += os.path.getsize(path)
        for k, t in full.items():
            p = params[k]
            d = distribute_tensor(t, mesh, p.placements, src_data_rank=None)
            with torch.no_grad():
                p.to_local().copy_(d.to_local())
        del full
    return nread


def _load_limit(model, mesh, folder: str) -> int:
    """Exactly this rank's bytes of every tensor, ``preadv`` into the parameter."""
    from torch.distributed.tensor import Shard

    rank = mesh.get_local_rank()
    params = dict(model.named_parameters())
    nread = 0
    for file in _files(folder):
        path = os.path.join(folder, file)
        fd = os.open(path, os.O_RDONLY)
        try:
            n = int.from_bytes(os.pread(fd, 8, 0), "little")
            header = json.loads(os.pread(fd, n, 8))
            for k, entry in header.items():
                if k == "__metadata__":
                    continue
                p = params[k]
                local = p.to_local()
                start = 8 + n + entry["data_offsets"][0]
                width = p.shape[1]
                buf = memoryview(local.view(torch.uint8).numpy()).cast("B")
                (placement,) = p.placements
                if placement == Shard(0):  # rows: one run
                    nread += os.preadv(fd, [buf], start + rank * local.shape[0] * width * 4)
                else:  # Shard(1): a run per row
                    cols = local.shape[1]
                    for r in range(local.shape[0]):
                        nread += os.preadv(fd, [buf[r * cols * 4 : (r + 1) * cols * 4]], start + (r * width + rank * cols) * 4)
        finally:
            os.close(fd)
    return nread


_LOADERS = {"shardsafe": _load_shardsafe, "safetensors+distribute_tensor": _load_baseline, "preadv share (limit)": _load_limit}


def load_rank(rank: int, ws: int, kind: str, layers: int, width: int, folder: str, reps: int) -> list[dict]:
    import torch.distributed as dist

    records = []
    model, mesh = _sharded(kind, layers, width, ws)
    truth = [_truth_part(p, i) for i, p in enumerate(model.parameters())]  # this rank's part of every weight
    for rep in range(reps):
        for how in _rotated(LOADS, rep):
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().zero_()
            trim_heap()
            dist.barrier()
            with PeakRSS() as peak:
                t0 = time.perf_counter()
                nread = _LOADERS[how](model, mesh, folder)
                dist.barrier()
                seconds = time.perf_counter() - t0
            ok = all(torch.equal(p.to_local(), t) for p, t in zip(model.parameters(), truth))  # bit-exact
            records.append(dict(method=how, rep=rep, rank=rank, s=seconds, read=nread, rss=peak.extra, ok=ok))
    return records


def _truth_part(p, i: int) -> torch.Tensor:
    """This rank's part of layer ``i``'s weight as saved (seeded: every rank builds the same)."""
    from torch.distributed.tensor import distribute_tensor

    full = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 + i))
    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()


# ---------------------------------------------------------------- save and export


def save_rank(rank: int, ws: int, layers: int, width: int, ckpt: str) -> None:
    import shardsafe

    model, _ = _sharded("fsdp2", layers, width, ws)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.to_local().copy_(_truth_part(p, i))
    shardsafe.save_model_and_optim_state(ckpt, model, save_overwrite=True)


def export_case(how: str, ckpt: str, out: str, nbytes: int) -> dict:
    import shardsafe

    if os.path.exists(out):
        shutil.rmtree(out) if os.path.isdir(out) else os.unlink(out)
    trim_heap()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        if how == "shardsafe":
            shardsafe.unshard_to_safetensors(ckpt, out, prefix="model.", max_shard_size=nbytes // 4)
        elif how == "unshard+save_file":
            from safetensors.torch import save_file

            full = shardsafe.unshard_model_state(ckpt)
            os.makedirs(out)
            names = sorted(full)
            per = max(1, len(names) // 4)
            for i in range(0, len(names), per):
                p = os.path.join(out, f"part{i}.safetensors")
                save_file({k: full[k] for k in names[i : i + per]}, p)
                _fsync(p)
            del full
        else:  # the limit: the data files copied, fsynced
            os.makedirs(out)
            for f in os.listdir(ckpt):
                if f.endswith(".safetensors"):
                    shutil.copyfile(os.path.join(ckpt, f), os.path.join(out, f))
                    _fsync(os.path.join(out, f))
        seconds = time.perf_counter() - t0
    return dict(method=how, s=seconds, read=nbytes, rss=peak.extra)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _export_in_child(how: str, ckpt: str, out: str, nbytes: int, q) -> None:
    q.put(export_case(how, ckpt, out, nbytes))


def _export(how: str, ckpt: str, out: str, nbytes: int) -> dict:
    q = _CTX.Queue()
    p = _CTX.Process(target=_export_in_child, args=(how, ckpt, out, nbytes, q))
    p.start()
    try:
        return q.get(timeout=600)
    finally:
        p.join()


# ---------------------------------------------------------------- summary and outputs


def summarize(records: dict[str, list[dict]], nbytes: int) -> list[dict]:
    """Per case and method: the median over repetitions of the slowest rank's time, the largest
    RSS growth, the bytes one rank read (the most of any rank)."""
    rows = []
    for case, recs in records.items():
        for how in EXPORTS if case == "export" else LOADS:
            mine = [r for r in recs if r["method"] == how]
            per_rep: dict[int, float] = {}
            for r in mine:
                per_rep[r.get("rep", 0)] = max(per_rep.get(r.get("rep", 0), 0.0), r["s"])
            s = statistics.median(per_rep.values())
            rows.append(dict(
                case=case, method=how, s=s, gbs=nbytes / s / 1e9, rss_mib=max(r["rss"] for r in mine) / _MiB,
                read_mib=max(r["read"] for r in mine) / _MiB, ok=all(r.get("ok", True) for r in mine),
            ))
    return rows


def lines(rows: list[dict]) -> list[str]:
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        mine, base, limit = (r for r in rows if r["case"] == case)
        out.append(
            f"HF {case} shardsafe_s={mine['s']:.4f} baseline_s={base['s']:.4f} limit_s={limit['s']:.4f} "
            f"shardsafe_gbs={mine['gbs']:.2f} shardsafe_vs_baseline={mine['s'] / base['s']:.2f}x "
            f"shardsafe_vs_limit={mine['s'] / limit['s']:.2f}x shardsafe_rss_mib={mine['rss_mib']:.1f} "
            f"baseline_rss_mib={base['rss_mib']:.1f} limit_rss_mib={limit['rss_mib']:.1f} "
            f"shardsafe_read_mib={mine['read_mib']:.1f} limit_read_mib={limit['read_mib']:.1f}"
        )
    return out


def markdown(rows: list[dict], info: dict, config: dict) -> str:
    head = (
        f"{info['date']}, {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, torch {info['torch']}, "
        f"safetensors {info['safetensors']}, commit {info['commit'] or '?'}; {config['mib']:.0f} MiB of float32 weights "
        f"({config['layers']} layers {config['width']}x{config['width']}), median of {config['reps']}, warm page cache, "
        f"{config['elapsed_s']:.0f} s in all.\n\n"
        "| case | method | s | GB/s | peak extra RSS per process MiB | read per rank MiB | data |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['case']} | {r['method']} | {r['s']:.3f} | {r['gbs']:.2f} | {r['rss_mib']:.1f} | {r['read_mib']:.1f} | "
        f"{('ok' if r['ok'] else 'WRONG') if r['case'] != 'export' else '-'} |\n"
        for r in rows
    )
    return head + body + "\n```\n" + "\n".join(lines(rows)) + "\n```\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=None, help="MiB of weights (default 256, --quick 2)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of every method (default 3, --quick 1)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 MiB of 256x256 layers, 1 repetition")
    ap.add_argument("--dir", default="/tmp/shardsafe-bench-hf", help="scratch directory (emptied, removed at the end)")
    ap.add_argument("--out", default=os.path.join(_REPO, "benchmarks", "results"))
    ap.add_argument("--update-docs", action="store_true", help="write the table into docs/benchmarks.md")
    a = ap.parse_args(argv)
    width = 256 if a.quick else 2048
    mib = a.mib if a.mib is not None else (2.0 if a.quick else 256.0)
    reps = a.reps if a.reps is not None else (1 if a.quick else 3)
    layers = max(2, round(mib * _MiB / (width * width * 4)))
    nbytes = layers * width * width * 4
    if reps < 1:
        ap.error(f"bad --reps {reps}")
    t0 = time.time()
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    ckpt, hf = os.path.join(a.dir, "ckpt"), os.path.join(a.dir, "hf")
    records: dict[str, list[dict]] = {"export": []}
    try:
        run_ranks(2, save_rank, layers, width, ckpt)
        for rep in range(reps):
            for how in _rotated(EXPORTS, rep):
                warm_cache(ckpt)
                records["export"].append(dict(_export(how, ckpt, os.path.join(a.dir, "out"), nbytes), rep=rep))
        import shardsafe

        shardsafe.unshard_to_safetensors(ckpt, hf, prefix="model.", max_shard_size=nbytes // 4, overwrite=True)
        for case, kind, ws in CASES:
            warm_cache(hf)
            records[case] = [r for rank in run_ranks(ws, load_rank, kind, layers, width, hf, reps, timeout=1200) for r in rank]
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)
    rows = summarize(records, nbytes)
    config = dict(mib=nbytes / _MiB, layers=layers, width=width, reps=reps, elapsed_s=round(time.time() - t0, 1))
    info = machine()
    table = markdown(rows, info, config)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "hf.json"), "w") as f:
        json.dump(dict(machine=info, config=config, records=records, summary=rows), f, indent=1)
    with open(os.path.join(a.out, "hf.md"), "w") as f:
        f.write(table)
    if a.update_docs:
        replace_section(os.path.join(_REPO, "docs", "benchmarks.md"), BEGIN, END, table)
    print(table)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
