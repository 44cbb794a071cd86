"""Writes a checkpoint of 2 simulated ranks into the directory given, with the writer checked out:
tests/data/v1_checkpoint was written by shardsafe 0.1 (format v1), v2_checkpoint by the last
format-v2 writer (f50ebcf). E.g.
``git worktree add /tmp/old 8c5e966 && cd /tmp/old && PYTHONPATH=/tmp/old/src:/tmp/old python
<this file> <repo>/tests/data/v1_checkpoint``. The ground truth goes beside it, as
``<directory>_truth.safetensors``.
"""
import os
import shutil
import sys

import torch
from safetensors.torch import save_file
from tests.simulate import simulate_save  # the old checkout's (on PYTHONPATH)

from shardsafe import ShardedTensor

out = sys.argv[1]
shutil.rmtree(out, ignore_errors=True)
g = torch.Generator().manual_seed(1)
w = torch.randn(6, 5, generator=g)
f = torch.randn(2, 3, 4, generator=g)   # flattened ranges that are not one box
b = torch.arange(7, dtype=torch.int64)
per_rank = []
for r in range(2):
    flat = f.reshape(-1)
    lo, hi = (0, 7) if r == 0 else (7, 24)
    per_rank.append({
        "w": ShardedTensor.from_rank_offsets("w", w.chunk(2)[r].clone(), (0, r, 2)),
        "f": ShardedTensor("f", flat[lo:hi].clone(), (2, 3, 4), (0, 0, 0), (2, 3, 4), flattened_range=slice(lo, hi)),
        "b": b.clone(),
    })
simulate_save(out, per_rank)
save_file({"w": w, "f": f, "b": b}, out.rstrip("/") + "_truth.safetensors")
print(sorted(os.listdir(out)))
