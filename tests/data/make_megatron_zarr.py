"""Writes tests/data/megatron_zarr: a checkpoint megatron-core 0.15.3 wrote with its deprecated
``zarr`` backend, on 2 gloo ranks, of the state ``tests/test_megatron_torch_dist.py`` saves with
``torch_dist`` (TP-split, a PP layer stack, a replicated bfloat16 vector, a distributed
optimizer's flattened ranges, a ShardedObject per rank, a common state with an
``argparse.Namespace``).

megatron-core's zarr writer needs ``zarr<3`` (zarr 3 refuses its ``compressor=None``) and
tensorstore for bfloat16; neither is a dependency of shardsafe. Run from the repository root with
them on the path, e.g. ``pip install --target /tmp/z "zarr<3" "numcodecs<0.16" tensorstore
ml_dtypes deprecated asciitree fasteners`` then
``PYTHONPATH=/tmp/z:src:. python tests/data/make_megatron_zarr.py tests/data/megatron_zarr``.
"""

import os
import shutil
import sys


def _save(rank: int, world: int, path: str) -> None:
    import argparse

    import torch

    torch.cuda.synchronize = lambda *a, **k: None  # megatron-core's save on CPU
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from tests.test_megatron_zarr import _CUTS, _truth

    t = _truth()
    flat = slice(_CUTS[rank], _CUTS[rank + 1])
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", t["w"][2 * rank : 2 * rank + 2].clone(), (0, rank, world)),
        "layers": ShardedTensor.from_rank_offsets("layers", t["layers"][rank].clone(), (0, rank, world), prepend_axis_num=1),
        "b": ShardedTensor.from_rank_offsets("b", t["b"].clone(), replica_id=rank),
        "opt": ShardedTensor.from_rank_offsets_flat("opt", t["opt"].flatten()[flat].clone(), (3, 4), flattened_range=flat),
        "rng": ShardedObject("rng", {"seed": rank, "state": torch.arange(3) + rank}, (world,), (rank,)),
        "iteration": 7,
        "args": argparse.Namespace(lr=0.25, tensor_model_parallel_size=world, dtype=torch.bfloat16),
    }
    mdc.save(sd, path, sharded_strategy=("zarr", 1))


if __name__ == "__main__":
    from tests.helpers import run_ranks

    out = os.path.abspath(sys.argv[1])
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    run_ranks(2, _save, out, timeout=240)
    for root, dirs, _files in os.walk(out):  # the writer's lock files are not part of the checkpoint
        for d in [d for d in dirs if d.endswith(".sync")]:
            shutil.rmtree(os.path.join(root, d))
            dirs.remove(d)
    print(sorted(os.path.relpath(os.path.join(r, f), out) for r, _, fs in os.walk(out) for f in fs))
