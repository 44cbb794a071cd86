"""Demo: save a sharded model state on 2 processes, load it back resharded on 3.

Run ``python examples/reshard_demo.py`` (``make demo``). It launches ``torchrun`` twice on
free local ports: 2 ranks save a state dict of DTensors (Shard(0)), a replicated tensor and a
step counter; then 3 ranks load it into DTensors sharded on dim 1, check every element
against the source, and unshard it in a plain process. Prints what each step did.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

SHAPES = {"embed.weight": (4096, 512), "layers.0.mlp.weight": (1536, 512), "layers.0.norm.weight": (512,)}


def full(key):
    import torch

    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(SHAPES[key], generator=g)


def state(ws, dim):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    sd = {}
    for key, shape in SHAPES.items():
        place = Replicate() if len(shape) == 1 else Shard(dim)
        sd[key] = distribute_tensor(full(key), mesh, [place], src_data_rank=None)
    sd["step"] = 0
    return sd, torch


def worker(phase: str, path: str, report: str) -> None:
    import torch.distributed as dist

    import shardsafe

    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    if phase == "save":
        sd, _ = state(ws, 0)
        sd["step"] = 1000
        t0 = time.perf_counter()
        meta, files = shardsafe.Checkpointer().save(path, sd)
        took = time.perf_counter() - t0
        info = {"rank": rank, "files": [os.path.basename(f) for f in files], "bytes": sum(os.path.getsize(f) for f in files), "s": took}
    else:
        sd, torch = state(ws, 1)
        for key in SHAPES:
            sd[key].to_local().fill_(float("nan"))
        t0 = time.perf_counter()
        shardsafe.Checkpointer().load(path, sd)
        took = time.perf_counter() - t0
        exact = all(torch.equal(sd[k].full_tensor(), full(k)) for k in SHAPES)
        info = {"rank": rank, "step": sd["step"], "bit_exact": exact, "local_shapes": {k: list(sd[k].to_local().shape) for k in SHAPES}, "s": took}
    gathered = [None] * ws
    dist.all_gather_object(gathered, info)
    if rank == 0:
        with open(report, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, phase: str, path: str, report: str) -> list[dict]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        __file__, "--worker", phase, path, report,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
    subprocess.run(cmd, check=True, env=env)
    with open(report) as f:
        return json.load(f)


def main() -> None:
    import torch
    from safetensors import safe_open

    import shardsafe

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        report = os.path.join(tmp, "report.json")
        print("== save on 2 processes: DTensor Shard(0) + a replicated vector + step=1000")
        for r in launch(2, "save", path, report):
            print(f"  rank {r['rank']}: wrote {r['files']} ({r['bytes'] / 2**20:.2f} MiB) in {r['s']:.3f}s")
        meta = shardsafe.Checkpointer().get_metadata(path)
        for key, t in meta.tensors.items():
            where = {f: [list(s.global_offset) for s in specs] for f, specs in t.shard_spec_per_file.items()}
            print(f"  {key}: shape {list(t.shape)} {t.dtype}, chunks at {where}")
        for f in sorted(meta.data_files()):
            with safe_open(os.path.join(path, f), "pt") as sf:
                print(f"  safetensors.safe_open({f}): {len(list(sf.keys()))} entries")
        print("== load on 3 processes, resharded to Shard(1)")
        for r in launch(3, "load", path, report):
            print(f"  rank {r['rank']}: local shapes {r['local_shapes']}, step={r['step']}, bit-exact={r['bit_exact']}, {r['s']:.3f}s")
            if not r["bit_exact"] or r["step"] != 1000:
                sys.exit("demo failed: loaded values differ from the saved ones")
        print("== verify and unshard in a plain process (no process group)")
        rep = shardsafe.verify(path)
        print(f"  verify: {rep.files} files, {rep.chunks} chunks, {rep.bytes / 2**20:.2f} MiB, checksums ok={rep.ok}")
        out = shardsafe.Checkpointer().unshard(path)
        exact = all(torch.equal(out[k], full(k)) for k in SHAPES)
        print(f"  unshard: {len(out)} values, bit-exact={exact}, step={out['step']}")
        if not exact:
            sys.exit("demo failed: unsharded tensors differ")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=3, metavar=("PHASE", "DIR", "REPORT"))
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
    else:
        main()
