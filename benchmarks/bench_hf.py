"""Hugging Face out and in: ``export`` (``unshard_to_safetensors`` with ``max_shard_size``) and
``load_hf_safetensors`` into FSDP2, against what users do today and against the raw read limit.

Usage::

    python benchmarks/bench_hf.py [--mib 256] [--ranks 2] [--reps 3] [--dir /tmp/shardsafe-bench-hf]

- export, one process: ``unshard_to_safetensors(max_shard_size=mib/4)``; ``unshard_model_state``
  + ``safetensors.torch.save_file`` per shard (in memory); the limit: a raw copy (read + write + fsync)
  of the same bytes.
- load into an FSDP2 model of ``--ranks`` gloo ranks, warm page cache: ``load_hf_safetensors``;
  ``safetensors.torch.load_file`` on every rank + ``distribute_tensor`` + copy into the
  parameters; the limit: each rank ``preadv``s its share of the bytes.

Each case runs in fresh processes; peak RSS is ``ru_maxrss`` less the RSS after setup (model built).
Prints a markdown table. Measured on the development machine (2 CPU cores shared with other
jobs, load average about 10, so noisy; 256 MiB, 2 ranks, median of 3, RSS growth includes each
rank touching its own 128 MiB parameter shard)::

    | what | how | seconds | GB/s | peak RSS per process | bytes read per rank |
    | export | shardsafe | 0.720 | 0.37 | 52 MiB | 256 MiB |
    | export | unshard+save_file | 1.098 | 0.24 | 271 MiB | 256 MiB |
    | export | raw copy (limit) | 0.656 | 0.41 | -0 MiB | 256 MiB |
    | load 2 ranks | shardsafe | 0.217 | 1.24 | 132 MiB | 128 MiB |
    | load 2 ranks | safetensors+distribute_tensor | 0.605 | 0.44 | 258 MiB | 256 MiB |
    | load 2 ranks | preadv share (limit) | 0.541 | 0.50 | 131 MiB | 128 MiB |

(the single-threaded ``preadv`` "limit" loses to shardsafe's reader threads on these busy cores.)
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.distributed import run_ranks  # noqa: E402

WIDTH = 2048  # one layer: WIDTH x WIDTH float32 = 16 MiB


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _model(layers: int):
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])


def _fsdp(layers: int, ws: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = _model(layers)
    mesh = init_device_mesh("cpu", (ws,))
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return model, mesh


def load_rank(rank, ws, how, layers, folder):
    import torch.distributed as dist

    model, mesh = _fsdp(layers, ws)
    base = _rss()
    dist.barrier()
    t0 = time.perf_counter()
    nread = 0
    if how == "shardsafe":
        import shardsafe

        nread = shardsafe.load_hf_safetensors(folder, model)
    elif how == "safetensors+distribute_tensor":
        import json

        from safetensors.torch import load_file
        from torch.distributed.tensor import distribute_tensor

        index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
        params = dict(model.named_parameters())
        for file in sorted(set(index["weight_map"].values())):
            full = load_file(os.path.join(folder, file))
            nread += os.path.getsize(os.path.join(folder, file))
            for k, t in full.items():
                p = params[k]
                d = distribute_tensor(t, mesh, p.placements, src_data_rank=None)
                with torch.no_grad():
                    p.to_local().copy_(d.to_local())
            del full
    else:  # the limit: this rank's share of every file's tensor bytes, preadv into the parameters
        import json

        from safetensors import safe_open

        index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
        params = dict(model.named_parameters())
        for file in sorted(set(index["weight_map"].values())):
            path = os.path.join(folder, file)
            with safe_open(path, "pt") as f:
                names = list(f.keys())
            n = int.from_bytes(open(path, "rb").read(8), "little")
            header = json.loads(open(path, "rb").read(8 + n)[8:])
            fd = os.open(path, os.O_RDONLY)
            try:
                for k in names:
                    local = params[k].to_local()
                    rows = local.shape[0]
                    start = 8 + n + header[k]["data_offsets"][0] + rank * rows * WIDTH * 4
                    buf = memoryview(local.view(torch.uint8).numpy()).cast("B")
                    os.preadv(fd, [buf], start)
                    nread += buf.nbytes
            finally:
                os.close(fd)
    dist.barrier()
    return time.perf_counter() - t0, nread, _peak() - base


def export_case(how, ckpt, out, layers):
    import shardsafe

    if os.path.exists(out):
        shutil.rmtree(out) if os.path.isdir(out) else os.unlink(out)
    base = _rss()
    t0 = time.perf_counter()
    limit = layers * WIDTH * WIDTH * 4 // 4
    if how == "shardsafe":
        shardsafe.unshard_to_safetensors(ckpt, out, prefix="model.", max_shard_size=limit)
    elif how == "unshard+save_file":
        from safetensors.torch import save_file

        full = shardsafe.unshard_model_state(ckpt)
        os.makedirs(out)
        names = sorted(full)
        per = max(1, len(names) // 4)
        for i in range(0, len(names), per):
            p = os.path.join(out, f"part{i}.safetensors")
            save_file({k: full[k] for k in names[i : i + per]}, p)
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    else:  # raw copy of the data files, fsynced
        os.makedirs(out)
        for f in os.listdir(ckpt):
            if f.endswith(".safetensors"):
                shutil.copyfile(os.path.join(ckpt, f), os.path.join(out, f))
                fd = os.open(os.path.join(out, f), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
    return time.perf_counter() - t0, _peak() - base


def _export_in_child(how, ckpt, out, layers, q):
    q.put(export_case(how, ckpt, out, layers))


def save_rank(rank, ws, layers, ckpt):
    import shardsafe

    model, _ = _fsdp(layers, ws)
    torch.manual_seed(1 + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_()
    shardsafe.save_model_and_optim_state(ckpt, model, save_overwrite=True)


def main() -> None:
    import multiprocessing as mp

    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/shardsafe-bench-hf")
    a = ap.parse_args()
    layers = max(1, a.mib // 16)
    nbytes = layers * WIDTH * WIDTH * 4
    os.makedirs(a.dir, exist_ok=True)
    ckpt, hf = os.path.join(a.dir, "ckpt"), os.path.join(a.dir, "hf")
    run_ranks(a.ranks, save_rank, layers, ckpt)
    import shardsafe

    shardsafe.unshard_to_safetensors(ckpt, hf, prefix="model.", max_shard_size=nbytes // 4, overwrite=True)
    ctx = mp.get_context("forkserver")
    rows = []
    for how in ("shardsafe", "unshard+save_file", "raw copy (limit)"):
        times, peaks = [], []
        for _ in range(a.reps):
            q = ctx.Queue()
            p = ctx.Process(target=_export_in_child, args=(how, ckpt, os.path.join(a.dir, "out"), layers, q))
            p.start()
            t, peak = q.get()
            p.join()
            times.append(t)
            peaks.append(peak)
        t = statistics.median(times)
        rows.append(("export", how, t, nbytes / t / 1e9, max(peaks), nbytes))
    for how in ("shardsafe", "safetensors+distribute_tensor", "preadv share (limit)"):
        res = [run_ranks(a.ranks, load_rank, how, layers, hf) for _ in range(a.reps)]
        t = statistics.median(max(r[0] for r in rr) for rr in res)
        rows.append((f"load {a.ranks} ranks", how, t, nbytes / t / 1e9, max(r[2] for rr in res for r in rr), max(r[1] for r in res[0])))
    print(f"\n{nbytes / 2**20:.0f} MiB of float32 weights, {layers} layers, {a.ranks} ranks, median of {a.reps}, warm page cache\n")
    print("| what | how | seconds | GB/s | peak RSS per process | bytes read per rank |")
    print("|---|---|---|---|---|---|")
    for what, how, t, gbs, peak, nread in rows:
        print(f"| {what} | {how} | {t:.3f} | {gbs:.2f} | {peak / 2**20:.0f} MiB | {nread / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
