"""Object-store throughput: shardsafe against torch.distributed.checkpoint over s3fs, same local S3 server.

Usage::

    python benchmarks/bench_object_store.py [--total-mib 512] [--reps 3] [--ranks 2] [--out benchmarks/results]

Starts moto's S3 server on 127.0.0.1 and, on ``--ranks`` gloo processes, saves and loads the same
state of Shard(0) DTensors (bf16 and fp32, ``--total-mib`` in all) with:

- shardsafe: ``Checkpointer.save`` / ``load`` on an ``s3://`` URL (obstore: multipart uploads
  and ranged GETs, several in flight);
- DCP: ``dcp.save`` / ``dcp.load`` with ``FsspecWriter`` / ``FsspecReader`` over s3fs, at its
  default ``thread_count=1`` and with ``thread_count=8``;
- the server's limit: each rank sends its bytes as one plain PUT and reads them back with one
  GET (obstore, no checkpoint format, no checksums, no multipart).

Methods are interleaved within each repetition (save all, then load all), every checkpoint
goes to a fresh prefix, the wall time of an operation is rank 0's from a barrier before to a
barrier after, and loads are checked bit for bit. Prints a table of medians with shardsafe's
ratio to the better DCP configuration, and writes ``bench_object_store.json`` and ``.png`` to
``--out``.

moto answers every ranged GET by copying the whole object (its ``FakeKey.value``); a real
store serves a range in time proportional to the range. The server started here patches that
one method so a ranged GET reads only its range; both clients get the same server.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY, SECRET, REGION, BUCKET = "AKIABENCH", "bench-secret", "us-east-1", "shardsafe-bench"

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "_moto_ranged.py"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1).read()
            break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError("moto_server did not start")
    import boto3

    boto3.client("s3", endpoint_url=url, aws_access_key_id=KEY, aws_secret_access_key=SECRET, region_name=REGION).create_bucket(Bucket=BUCKET)
    return proc, url


# --- per rank ----------------------------------------------------------------------------------


def _state(total_bytes: int, ws: int):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    sd = {}
    per = 32 << 20
    for i in range(max(1, total_bytes // per)):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        rows = per // dtype.itemsize // 1024
        g = torch.Generator().manual_seed(i)
        full = torch.randn(rows, 1024, generator=g).to(dtype)
        sd[f"layer{i}.weight"] = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    return sd


def _methods(endpoint: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from shardsafe import Checkpointer
    from shardsafe.storage import open_storage

    # no listings cache: else a rank's s3fs answers from a listing taken during the save, before
    # .metadata existed, and the load fails with FileNotFoundError
    s3fs_opts = {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint, "region_name": REGION},
                 "use_listings_cache": False, "skip_instance_cache": True}
    obj_opts = {"endpoint": endpoint, "region": REGION, "credentials": {"access_key_id": KEY, "secret_access_key": SECRET}}

    def ss_save(url, sd):
        Checkpointer().save(open_storage(url, **obj_opts), sd)

    def ss_load(url, sd):
        Checkpointer().load(open_storage(url, **obj_opts), sd)

    def dcp_saver(threads):
        def save(url, sd):
            dcp.save(sd, storage_writer=FsspecWriter(url, sync_files=False, thread_count=threads, **s3fs_opts))
        return save

    def dcp_load(url, sd):
        dcp.load(sd, storage_reader=FsspecReader(url, **s3fs_opts))

    def raw_store():
        from obstore.store import S3Store

        return S3Store(BUCKET, endpoint=endpoint, region=REGION, access_key_id=KEY, secret_access_key=SECRET,
                       client_options={"allow_http": True})

    def raw_save(url, sd):
        import obstore
        import torch.distributed as dist

        prefix = url.split(f"s3://{BUCKET}/", 1)[1]
        views = [memoryview(t.to_local().contiguous().view(torch.uint8).numpy().reshape(-1)) for t in sd.values()]
        obstore.put(raw_store(), f"{prefix}/rank{dist.get_rank()}.bin", views, use_multipart=False)

    def raw_load(url, sd):
        import obstore
        import torch.distributed as dist

        prefix = url.split(f"s3://{BUCKET}/", 1)[1]
        data = memoryview(obstore.get(raw_store(), f"{prefix}/rank{dist.get_rank()}.bin").bytes())
        pos = 0
        for t in sd.values():
            dst = t.to_local().view(torch.uint8).numpy().reshape(-1)
            dst[:] = data[pos : pos + dst.nbytes]
            pos += dst.nbytes

    import torch

    return {
        "raw-put-get": (raw_save, raw_load),
        "shardsafe": (ss_save, ss_load),
        "dcp-fsspec": (dcp_saver(1), dcp_load),
        "dcp-fsspec-t8": (dcp_saver(8), dcp_load),
    }


def _rank(rank: int, ws: int, port: int, endpoint: str, run: str, total: int, reps: int, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ws)
    try:
        src = _state(total, ws)
        nbytes = sum(t.numel() * t.element_size() for t in src.values())  # global bytes
        methods = _methods(endpoint)
        times: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": [], "save_cpu": [], "load_cpu": []} for m in methods}

        def timed(m: str, op: str, fn, *args) -> None:
            """Wall time (rank 0, barrier to barrier) and CPU time of all ranks' client processes."""
            dist.barrier()
            t, cpu = time.perf_counter(), time.process_time()
            fn(*args)
            cpu = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
            dist.barrier()
            t = time.perf_counter() - t
            dist.all_reduce(cpu)
            times[m][op].append(t)
            times[m][f"{op}_cpu"].append(cpu.item())
            if rank == 0:
                print(f"  {op} {m}: {t:.2f} s, client CPU {cpu.item():.2f} s", flush=True)

        for rep in range(reps):
            order = list(methods) if rep % 2 == 0 else list(reversed(methods))  # interleaved, alternating order
            for m in order:
                url = f"s3://{BUCKET}/{run}/{m}-{rep}"
                timed(m, "save", methods[m][0], url, src)
            for m in order:
                url = f"s3://{BUCKET}/{run}/{m}-{rep}"
                dst = {k: v.clone() for k, v in src.items()}
                for v in dst.values():
                    v.to_local().fill_(float("nan"))
                timed(m, "load", methods[m][1], url, dst)
                for k in src:
                    a, b = dst[k].to_local(), src[k].to_local()
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (m, k)
        if rank == 0:
            queue.put((nbytes, times))
    except BaseException as e:
        import traceback

        queue.put(RuntimeError(f"rank {rank}: {traceback.format_exc()}"))
        raise e
    finally:
        dist.destroy_process_group()


# --- driver ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-mib", type=int, default=512, help="size of the state, all ranks together")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(_REPO, "benchmarks", "results"))
    args = ap.parse_args(argv)
    if args.reps < 3:
        ap.error("--reps must be at least 3 (medians of fewer mean little)")

    import multiprocessing as mp

    proc, endpoint = start_server()
    try:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = _free_port()
        run = uuid.uuid4().hex[:8]  # one prefix for the run, the same on every rank
        ranks = [ctx.Process(target=_rank, args=(r, args.ranks, port, endpoint, run, args.total_mib << 20, args.reps, queue))
                 for r in range(args.ranks)]
        for p in ranks:
            p.start()
        got = queue.get(timeout=3600)
        if isinstance(got, Exception):
            raise got
        nbytes, times = got
        for p in ranks:
            p.join()
            if p.exitcode:
                raise RuntimeError(f"a rank exited with code {p.exitcode}")
    finally:
        proc.terminate()
        proc.wait()

    rows = {}
    gib = nbytes / 2**30
    for m, t in times.items():
        rows[m] = {
            op: {"median_s": statistics.median(t[op]), "runs_s": t[op], "GBps": nbytes / statistics.median(t[op]) / 1e9,
                 "cpu_s_per_GiB": statistics.median(t[f"{op}_cpu"]) / gib, "cpu_runs_s": t[f"{op}_cpu"]}
            for op in ("save", "load")
        }
    best_dcp = {op: max((r for m, r in rows.items() if m.startswith("dcp")), key=lambda r: r[op]["GBps"])[op]["GBps"]
                for op in ("save", "load")}
    print(f"\n{nbytes / 2**20:.0f} MiB of Shard(0) DTensors on {args.ranks} ranks, moto S3 on 127.0.0.1, "
          f"median of {args.reps} interleaved runs")
    print(f"{'method':<16} {'save GB/s':>10} {'load GB/s':>10} {'save x':>8} {'load x':>8} {'save CPU s/GiB':>15} {'load CPU s/GiB':>15}")
    for m, r in rows.items():
        print(f"{m:<16} {r['save']['GBps']:>10.3f} {r['load']['GBps']:>10.3f} "
              f"{r['save']['GBps'] / best_dcp['save']:>8.2f} {r['load']['GBps'] / best_dcp['load']:>8.2f} "
              f"{r['save']['cpu_s_per_GiB']:>15.2f} {r['load']['cpu_s_per_GiB']:>15.2f}")
    print("(x: throughput relative to the better DCP configuration; CPU: client processes, all ranks)")

    os.makedirs(args.out, exist_ok=True)
    result = {"bytes": nbytes, "ranks": args.ranks, "reps": args.reps, "server": "moto (ranged GETs patched)", "methods": rows}
    with open(os.path.join(args.out, "bench_object_store.json"), "w") as f:
        json.dump(result, f, indent=1)
    _plot(rows, os.path.join(args.out, "bench_object_store.png"), nbytes, args.ranks)
    return 0


def _plot(rows, path: str, nbytes: int, ranks: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(rows)
    width = 0.38
    for j, op in enumerate(("save", "load")):
        ax.bar([i + (j - 0.5) * width for i in range(len(names))], [rows[m][op]["GBps"] for m in names], width, label=op)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("GB/s (median)")
    ax.set_title(f"S3 (moto, local): {nbytes / 2**20:.0f} MiB on {ranks} ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
