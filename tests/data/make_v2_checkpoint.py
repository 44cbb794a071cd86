"""Writes tests/data/v2_checkpoint with the last format-v2 writer: 2 simulated ranks.

Run with the last v2 writer checked out, e.g.
``git worktree add /tmp/v1src f50ebcf && cd /tmp/v1src && PYTHONPATH=/tmp/v1src/src python
<this file> <repo>/tests/data/v2_checkpoint``. The ground truth goes beside it as a safetensors file.
"""
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.getcwd())  # the v2 checkout, for its tests.simulate
from tests.simulate import simulate_save  # noqa: E402

from shardsafe import ShardedTensor  # noqa: E402

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
save_file({"w": w, "f": f, "b": b}, os.path.join(os.path.dirname(out), "v2_checkpoint_truth.safetensors"))
print(sorted(os.listdir(out)))
