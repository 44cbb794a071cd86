"""shardsafe.megatron standing in for megatron.core.dist_checkpointing (``install()``), and the
behaviours Megatron-Core's own dist_checkpointing tests found missing (issue 21): every name
Megatron-Core 0.15.3 and Megatron-LM import from the package, a Megatron-LM-style save and resume
through the alias, fully-parallel wrappers around any strategy, errors that are
``CheckpointingException``s, Megatron's description of flattened tensors, its messages.

This module imports no Megatron code at the top: the alias must be installed before Megatron is
imported, in each process that uses it (a subprocess, or a rank that installs it first).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from shardsafe.errors import ShapeMismatchError
from shardsafe.megatron import CheckpointingException, ShardedObject, ShardedTensor, load, load_tensors_metadata, save

from .helpers import run_ranks

# find_spec, not an import: importing megatron.core would import its dist_checkpointing in every rank
# process that unpickles a function of this module, before the function could install the alias
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="the alias tests import megatron-core's own modules")

# What Megatron-Core 0.15.3 and Megatron-LM (megatron/, tools/, examples/, tests/) import from
# megatron.core.dist_checkpointing, found by walking their sources' import statements.
MEGATRON_IMPORTS = {
    "megatron.core.dist_checkpointing": [
        "ShardedTensor", "load", "load_content_metadata", "load_plain_tensors", "remove_sharded_tensors", "save",
        "load_common_state_dict", "check_is_distributed_checkpoint", "load_tensors_metadata", "ShardedObject",
        "LocalNonpersistentObject",
    ],
    "megatron.core.dist_checkpointing.core": ["CheckpointingException", "maybe_load_config"],
    "megatron.core.dist_checkpointing.dict_utils": ["dict_list_map_outplace", "diff", "map_reduce", "merge", "nested_values"],
    "megatron.core.dist_checkpointing.exchange_utils": ["_get_empty_tensor_for_exchange", "distribute_shards_to_ranks"],
    "megatron.core.dist_checkpointing.mapping": [
        "LocalNonpersistentObject", "ReplicaId", "ShardedBase", "ShardedObject", "ShardedStateDict", "ShardedTensor",
        "ShardedTensorFactory", "StateDict", "apply_factories", "apply_factory_merges", "is_main_replica",
    ],
    "megatron.core.dist_checkpointing.optimizer": [
        "KEEP_VARS_HINT", "get_param_id_to_sharded_param_map", "make_sharded_optimizer_tensor", "optim_state_to_sharding_state",
    ],
    "megatron.core.dist_checkpointing.serialization": [
        "get_default_load_sharded_strategy", "get_default_save_sharded_strategy", "load_sharded_metadata", "load_tensors_metadata",
        "CkptShardedMetadata",
    ],
    "megatron.core.dist_checkpointing.strategies.async_utils": ["AsyncCallsQueue", "AsyncRequest"],
    "megatron.core.dist_checkpointing.strategies.base": ["LoadShardedStrategy", "SaveShardedStrategy", "StrategyAction", "get_default_strategy"],
    "megatron.core.dist_checkpointing.strategies.checkpointable": ["CheckpointableShardedTensor", "LocalShardsContainer"],
    "megatron.core.dist_checkpointing.strategies.common": ["COMMON_STATE_FNAME", "register_default_common_strategies"],
    "megatron.core.dist_checkpointing.strategies.filesystem_async": ["FileSystemWriterAsync", "_results_queue"],
    "megatron.core.dist_checkpointing.strategies.fully_parallel": [
        "FullyParallelLoadStrategyWrapper", "FullyParallelSaveStrategyWrapper", "_sharded_tensor_shard_id",
    ],
    "megatron.core.dist_checkpointing.strategies.resharding": [
        "apply_nd_flattened_tensors_reformulation", "restore_nd_flattened_tensors_formulation",
    ],
    "megatron.core.dist_checkpointing.strategies.torch": [
        "MCoreLoadPlanner", "TorchDistLoadShardedStrategy", "TorchDistSaveShardedStrategy", "get_reformulation_metadata",
    ],
    "megatron.core.dist_checkpointing.tensor_aware_state_dict": ["MCoreTensorAwareStateDict"],
    "megatron.core.dist_checkpointing.utils": [
        "add_prefix_for_sharding", "apply_prefix_mapping", "extract_nonpersistent", "extract_sharded_tensors",
        "extract_sharded_tensors_and_factories", "replace_prefix_for_sharding",
    ],
    "megatron.core.dist_checkpointing.validation": [
        "StrictHandling", "determine_global_metadata", "validate_sharding_integrity", "verify_checkpoint_and_load_strategy",
    ],
}


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=900)


def test_install_makes_shardsafe_megatron_every_module_and_name_megatron_imports():
    r = _python(f"""
        import importlib, sys
        import shardsafe.megatron
        shardsafe.megatron.install()
        shardsafe.megatron.install()  # again: nothing more happens
        import megatron.core.optimizer  # Megatron-Core's own module, importing KEEP_VARS_HINT through the alias
        from megatron.core import dist_checkpointing
        assert dist_checkpointing is shardsafe.megatron, dist_checkpointing
        missing = []
        for module, names in {MEGATRON_IMPORTS!r}.items():
            m = importlib.import_module(module)
            assert m is importlib.import_module("shardsafe.megatron" + module[len("megatron.core.dist_checkpointing"):]), module
            missing += [module + "." + n for n in names if not hasattr(m, n)]
        assert not missing, missing
        from megatron.core.dist_checkpointing.strategies import fully_parallel
        assert fully_parallel is sys.modules["shardsafe.megatron.strategies.fully_parallel"]
        assert megatron.core.optimizer.distrib_optimizer.KEEP_VARS_HINT is shardsafe.megatron.optimizer.KEEP_VARS_HINT
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_install_after_megatron_imported_its_own_package_refuses_and_says_when_to_call_it():
    r = _python("""
        import megatron.core.dist_checkpointing
        import shardsafe.megatron
        try:
            shardsafe.megatron.install()
        except shardsafe.megatron.CheckpointingException as e:
            print("refused:", e)
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.strip()
    assert out.startswith("refused: megatron.core.dist_checkpointing is already imported (from ") and out.endswith(
        "call shardsafe.megatron.install() before anything imports megatron, e.g. first thing in the training script"
    ), out


def test_deliberately_unsupported_names_raise_checkpointing_exception_with_what_to_use():
    r = _python("""
        import shardsafe.megatron
        shardsafe.megatron.install()
        from megatron.core.dist_checkpointing.core import CheckpointingException
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync, _results_queue
        from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner, TorchDistSaveShardedStrategy
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
        assert _results_queue is None
        for build in (lambda: FileSystemWriterAsync("x"), lambda: MCoreLoadPlanner(), lambda: MCoreTensorAwareStateDict.from_state_dict({}, "atomic"),
                      lambda: TorchDistSaveShardedStrategy("torch_dist", 1, keep_only_main_replica=False)):
            try:
                build()
            except CheckpointingException as e:
                print(str(e).split(":")[0])
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == [
        "FileSystemWriterAsync is megatron-core's DCP writer; shardsafe.megatron writes through its own engine. For an asynchronous save call shardsafe.megatron.save(..., async_sharded_save=True) and schedule the returned AsyncRequest on an AsyncCallsQueue",
        "MCoreLoadPlanner is a PyTorch DCP planner; shardsafe.megatron does not save or load through DCP (its engine plans reads and writes itself), so there is nothing to plan with it. Use shardsafe.megatron.save/load, or megatron-core itself for DCP-level customisation",
        "MCoreTensorAwareStateDict (Megatron-LM's local, nvidia-resiliency-ext checkpoints) is not supported by shardsafe.megatron",
        "TorchDistSaveShardedStrategy(keep_only_main_replica=False) is not supported",
    ]


# --------------------------------------------------------------------------- Megatron-LM-style save and resume


def _megatron_lm_job(rank: int, world: int, path: str) -> dict:
    """What megatron/training/checkpointing.py does, through the alias: a TP2 x DP2 model and a
    distributed optimizer's flattened state, saved asynchronously with the fully-parallel wrapper
    on the DP group, then resumed at TP2 x DP2 through get_default_load_sharded_strategy."""
    import argparse

    import shardsafe.megatron

    shardsafe.megatron.install()  # first thing, before anything imports megatron
    import megatron.core.optimizer  # noqa: F401 - Megatron-Core's optimizers import from the alias
    import torch.distributed as tdist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject as MShardedObject
    from megatron.core.dist_checkpointing.mapping import ShardedTensor as MShardedTensor
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    assert dist_checkpointing is shardsafe.megatron
    tp, dp = rank % 2, rank // 2
    dp_groups = [tdist.new_group([t, t + 2]) for t in range(2)]
    g = torch.Generator().manual_seed(7)
    truth = {"w": torch.randn(8, 6, generator=g), "b": torch.randn(6, generator=g), "exp_avg": torch.randn(8, 6, generator=g)}

    def state(fill: bool, step: int) -> dict:
        def part(t: torch.Tensor) -> torch.Tensor:
            return t.clone() if fill else torch.zeros_like(t)

        flat = slice(12 * dp, 12 * dp + 12)
        return {
            "model": {
                "w": MShardedTensor.from_rank_offsets("model.w", part(truth["w"][4 * tp : 4 * tp + 4]), (0, tp, 2), replica_id=dp),
                "b": MShardedTensor.from_rank_offsets("model.b", part(truth["b"]), replica_id=rank),
            },
            "optimizer": MShardedTensor.from_rank_offsets_flat(
                "optimizer.exp_avg.w", part(truth["exp_avg"][4 * tp : 4 * tp + 4].flatten()[flat]), (4, 6), (0, tp, 2), flattened_range=flat,
            ),
            "rng_state": MShardedObject("rng_state", [rank, step] if fill else None, (world,), (rank,), replica_id=0),
            "args": argparse.Namespace(tensor_model_parallel_size=2, lr=1e-4),
            "iteration": step,
        }

    save_strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), dp_groups[tp])
    queue = AsyncCallsQueue()
    request = dist_checkpointing.save(state(True, 10), path, save_strategy, async_sharded_save=True, content_metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    assert dist_checkpointing.check_is_distributed_checkpoint(path)
    content = dist_checkpointing.load_content_metadata(path)

    load_strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(path), dp_groups[tp])
    got = dist_checkpointing.load(state(False, 0), path, load_strategy)
    want = state(True, 10)
    exact = (
        torch.equal(got["model"]["w"], want["model"]["w"].data)
        and torch.equal(got["model"]["b"], want["model"]["b"].data)
        and torch.equal(got["optimizer"], want["optimizer"].data)
    )
    return {"exact": exact, "rng": got["rng_state"], "iteration": got["iteration"], "lr": got["args"].lr, "content": content}


def test_a_megatron_lm_style_async_save_and_resume_through_install(tmp_path):
    results = run_ranks(4, _megatron_lm_job, str(tmp_path / "iter_0000010"))
    for rank, r in enumerate(results):
        assert r == {"exact": True, "rng": [rank, 10], "iteration": 10, "lr": 1e-4, "content": {"distrib_optim_sharding_type": "dp_reshardable"}}


# --------------------------------------------------------------------------- fully-parallel wrappers around any strategy


def test_distribute_shards_to_ranks_lowest_coverage_then_largest_then_id_to_the_least_loaded_rank():
    from shardsafe.megatron.exchange_utils import distribute_shards_to_ranks

    shard_to_ranks = {"a": [0, 1, 2], "b": [0, 1, 2], "c": [1], "d": [0, 2], "x": [0, 1, 2]}
    sizes = {"a": 10, "b": 30, "c": 5, "d": 20, "x": 30}
    # c (one holder) -> 1; d (two) -> 0; then three holders, largest first: b, x (30 each, by id) -> 2, 1; a -> 2? no:
    # loads after c, d: [20, 5, 0]; b -> 2 (30); x -> 1 (35); a -> 0 (30)
    assert distribute_shards_to_ranks(shard_to_ranks, sizes, 3) == {"c": 1, "d": 0, "b": 2, "x": 1, "a": 0}
    # a piece whose main replica lives in another group goes last
    assert distribute_shards_to_ranks(shard_to_ranks, sizes, 3, {"c"}) == {"d": 0, "b": 1, "x": 2, "a": 0, "c": 1}


def _mock_strategies(rank: int, world: int, path: str) -> dict:
    import torch.distributed as tdist

    from shardsafe.megatron.dict_utils import dict_list_map_outplace, nested_values
    from shardsafe.megatron.mapping import is_main_replica
    from shardsafe.megatron.strategies.base import LoadShardedStrategy, SaveShardedStrategy
    from shardsafe.megatron.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    class MockSave(SaveShardedStrategy):
        def __init__(self) -> None:
            super().__init__("mock", 1)
            self.saved: list[str] = []

        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            self.saved += sorted(v.key for v in nested_values(sharded_state_dict) if is_main_replica(v.replica_id))

    class MockLoad(LoadShardedStrategy):
        def __init__(self) -> None:
            self.loaded: list[str] = []

        def load(self, sharded_state_dict, checkpoint_dir):
            def fill(v):
                self.loaded.append(v.key)
                if isinstance(v, ShardedTensor):
                    v.init_data("cpu")
                    v.data.fill_(100 + rank)
                    return v.data
                return f"object of {v.key} from rank {rank}"

            return dict_list_map_outplace(fill, sharded_state_dict)

        def load_tensors_metadata(self, checkpoint_dir):
            return {}

        def check_backend_compatibility(self, loaded_backend) -> None:
            pass

        def check_version_compatibility(self, loaded_version) -> None:
            pass

    def state() -> dict:
        return {
            "big": ShardedTensor.from_rank_offsets("big", torch.zeros(100), replica_id=rank),  # replicated everywhere
            "small": ShardedTensor.from_rank_offsets("small", torch.zeros(10), replica_id=rank),
            "own": ShardedTensor.from_rank_offsets("own", torch.zeros(5), (0, rank, world)),  # one piece per rank
            "obj": ShardedObject("obj", None, (1,), (0,), replica_id=rank),
        }

    saver = MockSave()
    wrapper = FullyParallelSaveStrategyWrapper(saver, None, do_cache_distribution=True)
    wrapper.save(state(), path)
    save_owner = {sid[0]: r for sid, r in wrapper.cached_distribution.main_rank_for_shard.items() if sid[0] != "own"}
    loader = MockLoad()
    got = FullyParallelLoadStrategyWrapper(loader, None, exchange_algo="broadcast").load(state(), path)
    tdist.barrier()
    return {
        "saved": saver.saved, "save_owner": save_owner, "loaded": sorted(loader.loaded),
        "big": got["big"].unique().tolist(), "small": got["small"].unique().tolist(), "own": got["own"].unique().tolist(), "obj": got["obj"],
    }


def test_fully_parallel_wrappers_spread_any_strategys_work_and_exchange_what_it_loaded(tmp_path):
    results = run_ranks(3, _mock_strategies, str(tmp_path))
    # one saver per replicated piece: big (largest, 3 holders) to rank 0, small to the least loaded: rank 1
    assert [r["save_owner"] for r in results] == [{"big": 0, "small": 1}] * 3
    # ShardedObjects keep their replica ids (Megatron-Core spreads tensors only): obj is saved by rank 0
    assert [r["saved"] for r in results] == [["big", "obj", "own"], ["own", "small"], ["own"]]
    # the load: every piece read by exactly one rank, the others receive its bytes
    loaded = sorted(k for r in results for k in r["loaded"])
    assert loaded == ["big", "obj", "own", "own", "own", "small"]
    loader_of = {k: rank for rank, r in enumerate(results) for k in r["loaded"] if k != "own"}
    for rank, r in enumerate(results):
        assert r["big"] == [100 + loader_of["big"]] and r["small"] == [100 + loader_of["small"]] and r["own"] == [100 + rank]
        assert r["obj"] == f"object of obj from rank {loader_of['obj']}"


def test_the_fully_parallel_wrappers_refuse_an_object_without_the_strategy_interface():
    from shardsafe.megatron.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    with pytest.raises(CheckpointingException, match=r"^FullyParallelSaveStrategyWrapper wraps a strategy with save \(the Megatron-Core strategy interface\); object has no save$"):
        FullyParallelSaveStrategyWrapper(object())
    with pytest.raises(CheckpointingException, match=r"^FullyParallelLoadStrategyWrapper wraps a strategy with load \(the Megatron-Core strategy interface\); str has no load$"):
        FullyParallelLoadStrategyWrapper("torch_dist")


# --------------------------------------------------------------------------- errors, descriptions, messages


def test_a_shape_mismatch_is_a_checkpointing_exception_and_keeps_its_cause(tmp_path):
    path = str(tmp_path / "c")
    save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0).reshape(2, 3))}, path)
    with pytest.raises(CheckpointingException) as shape:
        load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 2))}, path)
    assert isinstance(shape.value, ShapeMismatchError) and isinstance(shape.value, ValueError)
    assert type(shape.value).__name__ == "ShapeMismatchError"
    assert str(shape.value) == f"{path}: key 'w': checkpoint has global shape [2, 3], target has [3, 2]"


def test_a_stored_dtype_is_cast_into_the_requested_one_as_megatron_does(tmp_path):
    path = str(tmp_path / "c")
    stored = torch.arange(-3, 3).reshape(2, 3) * 1000  # int64
    save({"w": ShardedTensor.from_rank_offsets("w", stored), "f": ShardedTensor.from_rank_offsets("f", torch.tensor([0.1, 1 / 3]))}, path)
    into = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3, dtype=torch.float32)),
        "f": ShardedTensor.from_rank_offsets("f", torch.zeros(2, dtype=torch.bfloat16)),
    }
    target_w, target_f = into["w"].data, into["f"].data
    got = load(into, path)
    assert got["w"] is target_w and got["w"].dtype == torch.float32 and torch.equal(got["w"], stored.float())
    assert got["f"] is target_f and torch.equal(got["f"], torch.tensor([0.1, 1 / 3]).bfloat16())


def test_load_tensors_metadata_describes_a_flattened_save_by_its_whole_range_and_loads_it_1d(tmp_path):
    path = str(tmp_path / "c")
    whole = torch.arange(24.0).reshape(4, 6)
    save({
        "a": ShardedTensor.from_rank_offsets_flat("opt.w", whole.flatten()[:10].clone(), (4, 6), flattened_range=slice(0, 10)),
        "b": ShardedTensor.from_rank_offsets_flat("opt.w", whole.flatten()[10:].clone(), (4, 6), flattened_range=slice(10, 24)),
        "c": ShardedTensor.from_rank_offsets("w", whole.clone()),
    }, path)
    meta = load_tensors_metadata(path)
    assert meta["opt.w"].flattened_range == slice(0, 24) and meta["opt.w"].global_shape == (4, 6) and meta["opt.w"].local_shape == (4, 6)
    assert meta["w"].flattened_range is None and meta["w"].global_shape == (4, 6)
    got = load(meta, path)
    assert got["opt.w"].shape == (24,) and torch.equal(got["opt.w"], whole.flatten())
    assert torch.equal(got["w"], whole)


def test_a_missing_directory_is_named_as_missing(tmp_path):
    absent = tmp_path / "absent"
    with pytest.raises(CheckpointingException, match=f"^Checkpoint directory {absent} does not exist$"):
        load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, absent)


def _common_differs(rank: int, world: int, path: str) -> list[str]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname} {record.getMessage()}")

    logging.getLogger().addHandler(Keep())
    logging.getLogger().setLevel(logging.INFO)  # as Megatron-LM sets it: a save that succeeds prints nothing
    common = {"rank": rank if rank != 1 else 0, "lr": 0.1, **({"only_here": 1} if rank == 2 else {})}
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 4), (0, rank, world)), **common}, path)
    return records


def test_each_rank_whose_common_state_differs_logs_its_key_level_diff_and_nothing_else_is_logged(tmp_path):
    results = run_ranks(3, _common_differs, str(tmp_path / "c"))
    assert results[0] == [] and results[1] == []  # rank 1's common state equals rank 0's
    assert results[2] == [
        "WARNING Rank 2 common state dict differs from rank 0 common state dict. Keys only on rank 0: [], "
        "Keys only on 2: [('only_here',)], Mismatched keys: [(('rank',), <class 'int'>, <class 'int'>)]"
    ]


def test_the_megatron_suite_runner_says_how_to_get_megatrons_sources(tmp_path):
    runner = os.path.join(os.path.dirname(__file__), "megatron_suite", "run.py")
    r = subprocess.run([sys.executable, runner, "--megatron-src", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (
        f"Megatron-LM sources not found: '{tmp_path}' has no tests/unit_tests/dist_checkpointing.\n"
        "Get them (once, with network access) and point the runner at them:\n"
        "  git clone --depth 1 --branch core_v0.15.3 https://github.com/NVIDIA/Megatron-LM /path/to/megatron-src\n"
        "  make test-megatron MEGATRON_SRC=/path/to/megatron-src\n"
    )


def test_a_cast_load_of_a_padded_tensor_keeps_zeros_outside_the_stored_shape(tmp_path):
    path = str(tmp_path / "c")
    save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(1, 7).reshape(2, 3))}, path)  # int64 (2, 3)
    into = ShardedTensor.from_rank_offsets("w", torch.full((2, 5), 7.0), allow_shape_mismatch=True)  # float32 (2, 5)
    got = load({"w": into}, path)
    assert torch.equal(got["w"], torch.tensor([[1.0, 2, 3, 0, 0], [4, 5, 6, 0, 0]]))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("cast", [False, True])
def test_a_load_fills_the_models_own_parameters_that_require_grad(tmp_path, padded, cast):
    """Megatron's models hand their parameters themselves (leaves that require grad) as the
    ShardedTensors' data: a padded (allow_shape_mismatch) or cast load fills them in place too
    (Megatron-Core's models/test_gpt_model.py reconfiguration tests)."""
    path = str(tmp_path / "p")
    stored = torch.arange(1, 7, dtype=torch.float64 if cast else torch.float32).reshape(2, 3)
    save({"w": ShardedTensor.from_rank_offsets("w", stored)}, path)
    param = torch.nn.Parameter(torch.full((2, 5) if padded else (2, 3), 7.0))
    got = load({"w": ShardedTensor.from_rank_offsets("w", param, allow_shape_mismatch=padded)}, path)
    want = torch.tensor([[1.0, 2, 3, 0, 0], [4, 5, 6, 0, 0]]) if padded else torch.arange(1.0, 7).reshape(2, 3)
    assert got["w"] is param and param.requires_grad and param.grad_fn is None
    assert torch.equal(param.detach(), want)


def test_diff_compares_tensors_by_value_across_dtypes_as_megatron_does():
    from shardsafe.megatron.dict_utils import diff

    assert diff({"t": torch.arange(3)}, {"t": torch.arange(3.0)}) == ([], [], [])
    assert diff({"t": torch.arange(3)}, {"t": torch.tensor([0.0, 1.0, 2.5])}) == ([], [], [(("t",), torch.Tensor, torch.Tensor)])
    assert diff({"t": torch.arange(3)}, {"t": torch.arange(4)}) == ([], [], [(("t",), torch.Tensor, torch.Tensor)])


def test_a_sharding_gap_is_named_in_megatrons_words_first():
    from shardsafe.megatron.validation import validate_sharding_integrity

    def flat(rank: int, start: int, stop: int) -> ShardedTensor:
        return ShardedTensor.from_rank_offsets_flat("flat", torch.ones(stop - start), (1, 6), (0, rank, 2), flattened_range=slice(start, stop))

    # rows 0 and 1 of a (2, 6) tensor, each a box split in flattened ranges; row 0 lacks [2, 4)
    with pytest.raises(CheckpointingException) as gap_in_box:
        validate_sharding_integrity([[flat(0, 0, 2), flat(0, 4, 6)], [flat(1, 0, 6)]])
    assert str(gap_in_box.value) == (
        "Flattened ranges dont cover the whole shard ShardedTensor(key='flat', global_offset=(0, 0), local_shape=(1, 6)): "
        "the main replicas (on ranks [0, 1]) cover 10 of the 12 elements of global shape [2, 6]: a gap, the first at "
        "element [0, 2]; every element needs exactly one main replica"
    )
    with pytest.raises(CheckpointingException) as missing_box:
        validate_sharding_integrity([[flat(0, 0, 6)], []])
    assert str(missing_box.value) == (
        "Invalid access pattern for key 'flat': the main replicas (on ranks [0]) cover 6 of the 12 elements of global "
        "shape [2, 6]: a gap, the first at element [1, 0]; every element needs exactly one main replica"
    )
