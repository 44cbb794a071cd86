"""One loading rank's control plane, in a process of its own: parse ``metadata.json``, find the
chunks its targets overlap, read the headers of the files that hold them, plan the reads.

``bench_planner.py`` measures the same steps in the process that simulated every rank's save;
at 4096 ranks x 1000 tensors that process holds millions of plan objects, and the collector's
passes over them dominate what it times. Here the first stage builds the metadata and the data
files' headers (fsdp layout, ``bench_planner``'s model) and stores them; the second stage, a
fresh process, times the steps for rank W/4 of a W/2-rank fsdp target, three times.

Usage::

    python benchmarks/bench_load_parse.py [--ranks 4096] [--tensors 1000]
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def build(ranks: int, tensors: int, out: str) -> None:
    from bench_planner import build_all, fsdp_rank, metadata_from_plan, model_tensors

    from shardsafe.knobs import KNOBS
    from shardsafe.planning.save_plan import plan_save

    descs, _ = build_all(fsdp_rank, model_tensors(tensors), ranks)
    gc.disable()
    plan = plan_save(descs, save_id="x", split_bytes=KNOBS.replica_split_bytes, block_bytes=KNOBS.checksum_block_bytes)
    raw = metadata_from_plan(plan).to_json()
    headers = {r.file: r.header for r in plan.ranks if r.file is not None}
    with open(out, "wb") as f:
        pickle.dump((ranks, raw, headers), f)


def run(path: str) -> None:
    from bench_planner import fsdp_targets

    from shardsafe._gc import paused_gc
    from shardsafe.engine.file_index import bind_files
    from shardsafe.format.metadata import StorageMetadata
    from shardsafe.planning.read_plan import StoredIndex, plan_reads

    with open(path, "rb") as f:
        ranks, raw, headers = pickle.load(f)

    class Headers:
        """A file's header at offset 0; zeros for its checksum entry (as metadata_from_plan digests it)."""

        url = "bench://"
        local_root = None
        coalesce_gap_bytes = None

        def read_into(self, name: str, offset: int, buffers: list) -> None:
            (buf,) = buffers
            buf[:] = headers[name][: len(buf)] if offset == 0 else bytes(len(buf))

    for rep in range(3):
        t0 = time.perf_counter()
        with paused_gc():  # as Checkpointer's metadata read does
            meta = bind_files(StorageMetadata.from_json(raw, where="metadata.json"), Headers())
        t1 = time.perf_counter()
        targets = fsdp_targets(meta, ranks // 2, ranks // 4)
        t2 = time.perf_counter()
        index = {key: StoredIndex(t, targets[key]) for key, t in meta.tensors.items()}
        items = sum(len(plan_reads(index[key], pieces)[0]) for key, pieces in targets.items())
        t3 = time.perf_counter()
        read = len(meta.resolver._files) if meta.resolver is not None else 0
        print(
            f"rep {rep}: from_json {t1 - t0:.3f} s, index + plan_reads {t3 - t2:.3f} s, load parse {t1 - t0 + t3 - t2:.3f} s "
            f"({len(raw) / 1e6:.2f} MB metadata, {items} read items, {read} file headers read)"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--run", help=argparse.SUPPRESS)  # the second stage, in its own process
    args = p.parse_args()
    if args.run:
        run(args.run)
        return
    with tempfile.TemporaryDirectory() as d:
        stored = os.path.join(d, "metadata.pkl")
        t0 = time.perf_counter()
        build(args.ranks, args.tensors, stored)
        print(f"fsdp {args.ranks}x{args.tensors}: metadata and headers built in {time.perf_counter() - t0:.1f} s")
        subprocess.run([sys.executable, __file__, "--run", stored], check=True)


if __name__ == "__main__":
    main()
