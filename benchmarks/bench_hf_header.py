"""Hugging Face files with huge headers: time and peak memory of reading a header that lists N
tiny tensors, against the official ``safetensors`` library on the same file, in one run.

    python benchmarks/bench_hf_header.py [N ...]        (default: 3000 30000 300000)

Prints one ``HFHEADER`` line per N: the header's bytes, seconds for ``safetensors.safe_open`` (its
keys listed), ``shardsafe.hf.open_hf_model``, ``convert_hf`` and ``load_hf_safetensors`` (into a
module holding every tensor), and the growth of peak RSS over the run so far (each step runs in a
fresh process, so the numbers are the step's own). Time and memory should grow linearly with N.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import shutil
import struct
import sys
import tempfile
import time


def write_model(path: str, n: int) -> int:
    """A ``model.safetensors`` of ``n`` float32 tensors of 4 elements; returns the header's bytes."""
    header, off = {}, 0
    for i in range(n):
        header[f"model.layers.{i}.weight"] = {"dtype": "F32", "shape": [4], "data_offsets": [off, off + 16]}
        off += 16
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)
    return len(raw)


def _step(what: str, folder: str, n: int, out) -> None:
    import torch

    import shardsafe
    from shardsafe.convert import convert_hf
    from shardsafe.hf import open_hf_model

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if what == "safetensors":
        from safetensors import safe_open

        with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
            assert len(list(f.keys())) == n
    elif what == "open_hf_model":
        assert len(open_hf_model(folder).tensors) == n
    elif what == "convert_hf":
        dst = os.path.join(folder, "..", "converted")
        shutil.rmtree(dst, ignore_errors=True)
        assert convert_hf(folder, dst)["tensors"] == n
    else:
        model = torch.nn.Module()
        layers = torch.nn.ModuleList()
        for _ in range(n):
            m = torch.nn.Module()
            m.weight = torch.nn.Parameter(torch.zeros(4))
            layers.append(m)
        model.layers = layers
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        shardsafe.load_hf_safetensors(folder, model, prefix="model.")
    out.put((time.perf_counter() - start, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024))


def main(argv: list[str]) -> None:
    ctx = mp.get_context("spawn")
    for n in [int(a) for a in argv] or [3000, 30000, 300000]:
        root = tempfile.mkdtemp(prefix="bench-hf-header-")
        folder = os.path.join(root, "hf")
        os.makedirs(folder)
        size = write_model(os.path.join(folder, "model.safetensors"), n)
        row = {"tensors": n, "header_bytes": size}
        for what in ("safetensors", "open_hf_model", "convert_hf", "load_hf_safetensors"):
            q = ctx.Queue()
            p = ctx.Process(target=_step, args=(what, folder, n, q))
            p.start()
            seconds, mib = q.get()
            p.join()
            row[what] = {"s": round(seconds, 2), "peak_rss_growth_mib": round(mib)}
        print("HFHEADER " + json.dumps(row), flush=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
