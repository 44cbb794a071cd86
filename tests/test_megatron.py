"""shardsafe.megatron: Megatron-Core's dist_checkpointing API on shardsafe's engine.

The state is what a Megatron user writes: a small GPT with TP column/row splits, a stack of
layers along a PP axis (``prepend_axis_num=1``), DP replicas by ``replica_id``, a distributed
optimizer's flattened state, a GLU ``ShardedTensorFactory``, ShardedObjects per rank and a common
state holding an ``argparse.Namespace``. Saved at TP2 x PP2 on 4 real gloo ranks, it loads at
TP1 x PP2 x DP2, TP2 x PP1, TP1 x PP1 and back, bit-exact against plain-torch ground truth.
"""

from __future__ import annotations

import argparse
import enum
import io
import json
import logging
import os
from collections import OrderedDict
from math import prod

import numpy as np
import pytest
import torch

import shardsafe
from shardsafe import Checkpointer, ForeignCheckpointError, MissingKeyError, PickleNotAllowedError, ShapeMismatchError
from shardsafe.megatron import (
    CheckpointingConfig,
    CheckpointingException,
    LocalNonpersistentObject,
    LocalNonpersitentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    StrictHandling,
    dict_utils,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    mapping,
    remove_sharded_tensors,
    save,
    serialization,
    utils,
    validation,
)
from shardsafe.megatron.core import (
    NotADistributedCheckpointError,
    check_is_distributed_checkpoint,
    maybe_load_config,
    save_config,
)
from shardsafe.megatron.strategies import (
    AsyncRequest,
    ShardsafeLoadShardedStrategy,
    ShardsafeSaveShardedStrategy,
)
from tests.helpers import built_once, run_ranks

V, H, F, L = 16, 8, 12, 4  # vocabulary, hidden, GLU half width, layers
SAVE_LAYOUT = (2, 2, 1)  # (tp, pp, dp)


class ModelType(enum.Enum):
    encoder_or_decoder = 1
    retro = 2


# --- ground truth and the state a Megatron user builds -------------------------------------------


def ground_truth() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)

    def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "embedding.word_embeddings.weight": r(V, H),
        "decoder.layers.mlp.linear_fc1.weight": r(L, 2 * F, H, dtype=torch.bfloat16),  # rows [0, F): gate, [F, 2F): up
        "decoder.layers.mlp.linear_fc2.weight": r(L, H, F, dtype=torch.bfloat16),
        "decoder.layers.input_layernorm.weight": r(L, H),
        "decoder.final_layernorm.weight": r(H),
        "output_layer.weight": r(V, H),
        "optimizer.exp_avg.decoder.layers.mlp.linear_fc2.weight": r(L, H, F),
        "optimizer.exp_avg.embedding.word_embeddings.weight": r(V, H),
    }


def coords(layout: tuple[int, int, int], rank: int) -> tuple[int, int, int]:
    """(tp_rank, pp_rank, dp_rank), TP fastest, then DP, then PP (Megatron's order)."""
    tp, pp, dp = layout
    return rank % tp, rank // (tp * dp), (rank // tp) % dp


def dp_range(n: int, dp: int, d: int) -> tuple[int, int]:
    """A distributed optimizer's uneven cut of ``n`` elements over ``dp`` ranks (not on row boundaries)."""
    cut = [0] + [n * k // dp + 5 for k in range(1, dp)] + [n]
    return cut[d], cut[d + 1]


def common_state(layout: tuple[int, int, int], rank: int) -> dict:
    tp, pp, dp = layout
    args = argparse.Namespace(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, lr=3e-4, params_dtype=torch.bfloat16,
        seq_lengths=(128, 256), model_type=ModelType.encoder_or_decoder, rank=rank, weight_decay=float("inf"),
    )
    return {
        "args": args,
        "iteration": 7,
        "checkpoint_version": 3.0,
        "num_floating_point_operations_so_far": np.float64(1.5e12),
        "opt_param_scheduler": {"max_lr": 3e-4, "num_steps": 7, 3: "int key"},
    }


def glu_factory(key: str, data: torch.Tensor, layer: int, tp: int, tp_rank: int, replica_id: tuple) -> ShardedTensorFactory:
    """Megatron's SwiGLU factory: this TP rank's [gate part; up part] is two pieces of one key."""

    def build(key: str, t: torch.Tensor, replica_id, flattened_range) -> dict:
        w, v = t.chunk(2)
        return {
            "w": ShardedTensor.from_rank_offsets(key, w, (0, layer, L), (1, tp_rank, 2 * tp), replica_id=replica_id, prepend_axis_num=1),
            "v": ShardedTensor.from_rank_offsets(key, v, (0, layer, L), (1, tp_rank + tp, 2 * tp), replica_id=replica_id, prepend_axis_num=1),
        }

    def merge(sd: dict) -> torch.Tensor:
        return torch.cat([sd["w"], sd["v"]])

    return ShardedTensorFactory(key, data, build, merge, replica_id)


def sharded_state(layout: tuple[int, int, int], rank: int, full: dict[str, torch.Tensor] | None, *, rng: bool = True) -> dict:
    """This rank's sharded state dict; ``full`` None gives zeroed targets of the same layout."""
    tp, pp, dp = layout
    tp_rank, pp_rank, dp_rank = coords(layout, rank)
    truth = ground_truth()

    def part(key: str, *index) -> torch.Tensor:
        t = truth[key][index]
        return t.clone() if full is not None else torch.zeros_like(t)

    def rows(n: int, k: int, parts: int) -> slice:
        return slice(n // parts * k, n // parts * (k + 1))

    split = (0, 0, dp_rank)  # TP-split tensors: one main replica per DP group
    shared = (0, tp_rank, dp_rank)  # TP-replicated tensors
    model: dict = {}
    optim: dict = {}
    per_stage = L // pp
    for j in range(per_stage):
        layer = pp_rank * per_stage + j
        fc1 = "decoder.layers.mlp.linear_fc1.weight"
        gate, up = rows(F, tp_rank, tp), slice(F + F // tp * tp_rank, F + F // tp * (tp_rank + 1))
        local_fc1 = torch.cat([part(fc1, layer, gate), part(fc1, layer, up)])
        model[f"decoder.layers.{j}.mlp.linear_fc1.weight"] = glu_factory(fc1, local_fc1, layer, tp, tp_rank, split)
        fc2 = "decoder.layers.mlp.linear_fc2.weight"
        model[f"decoder.layers.{j}.mlp.linear_fc2.weight"] = ShardedTensor.from_rank_offsets(
            fc2, part(fc2, layer, slice(None), rows(F, tp_rank, tp)), (0, layer, L), (2, tp_rank, tp), replica_id=split, prepend_axis_num=1
        )
        ln = "decoder.layers.input_layernorm.weight"
        model[f"decoder.layers.{j}.input_layernorm.weight"] = ShardedTensor.from_rank_offsets(
            ln, part(ln, layer), (0, layer, L), replica_id=shared, prepend_axis_num=1
        )
        ex = f"optimizer.exp_avg.{fc2}"
        box = truth[ex][layer][:, rows(F, tp_rank, tp)]
        a, b = dp_range(box.numel(), dp, dp_rank)
        flat = box.flatten()[a:b].clone() if full is not None else torch.zeros(b - a)
        optim[f"exp_avg.{j}.fc2"] = ShardedTensor.from_rank_offsets_flat(
            ex, flat, tuple(box.shape), (0, layer, L), (2, tp_rank, tp), prepend_axis_num=1, flattened_range=slice(a, b)
        )
        model[f"decoder.layers.{j}.self_attention._extra_state"] = ShardedObject(
            "decoder.layers.self_attention._extra_state",
            {"layer": layer, "amax": torch.full((2,), float(layer)), "recipe": ("e4m3", layer), "blob": io.BytesIO(bytes([layer] * 3))}
            if full is not None else None,
            (L,), (layer,), replica_id=(tp_rank, dp_rank),
        )
    if pp_rank == 0:
        emb = "embedding.word_embeddings.weight"
        model["embedding.word_embeddings.weight"] = ShardedTensor.from_rank_offsets(
            emb, part(emb, rows(V, tp_rank, tp)), (0, tp_rank, tp), replica_id=split
        )
        ex = f"optimizer.exp_avg.{emb}"
        box = truth[ex][rows(V, tp_rank, tp)]
        a, b = dp_range(box.numel(), dp, dp_rank)
        flat = box.flatten()[a:b].clone() if full is not None else torch.zeros(b - a)
        optim["exp_avg.embedding"] = ShardedTensor.from_rank_offsets_flat(
            ex, flat, tuple(box.shape), (0, tp_rank, tp), flattened_range=slice(a, b)
        )
    if pp_rank == pp - 1:
        out = "output_layer.weight"
        model["output_layer.weight"] = ShardedTensor.from_rank_offsets(out, part(out, rows(V, tp_rank, tp)), (0, tp_rank, tp), replica_id=split)
        fl = "decoder.final_layernorm.weight"
        model["decoder.final_layernorm.weight"] = ShardedTensor.from_rank_offsets(fl, part(fl), replica_id=shared)
    state: dict = {"model": model, "optimizer": {"state": optim}, "local": LocalNonpersistentObject({"rank": rank})}
    if rng:
        rng_value = {"random": (3, [1, 2, rank], None), "torch": torch.Generator().manual_seed(rank).get_state(), "np": np.arange(3) + rank}
        state["rng_state"] = ShardedObject("rng_state", rng_value if full is not None else None, (pp, tp), (pp_rank, tp_rank), replica_id=dp_rank)
    if full is not None:
        state.update(common_state(layout, rank))
    return state


# --- comparing a loaded state with what was expected --------------------------------------------------


def expected_values(state: dict) -> list[tuple[tuple, object]]:
    """(key path, value) of every leaf a load returns for ``state`` (built from ground truth)."""
    out = []

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, path + (k,))
        elif isinstance(x, (ShardedTensor, ShardedTensorFactory, ShardedObject)):
            out.append((path, x.data))
        elif isinstance(x, LocalNonpersistentObject):
            out.append((path, x.unwrap()))
        else:
            out.append((path, x))
    walk(state, ())
    return out


def same(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, io.BytesIO):
        return a.getvalue() == b.getvalue()
    if isinstance(a, argparse.Namespace):
        return same(vars(a), vars(b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


def mismatches(loaded: dict, layout: tuple[int, int, int], rank: int, *, rng: bool) -> list[str]:
    """Every leaf of ``loaded`` that differs from ground truth at ``layout`` (common state: rank 0's at the save layout)."""
    want = sharded_state(layout, rank, ground_truth(), rng=rng)
    saved_common = common_state(SAVE_LAYOUT, 0)
    for k in saved_common:
        want[k] = saved_common[k]
    bad = []
    for path, value in expected_values(want):
        got = loaded
        try:
            for p in path:
                got = got[p]
        except (KeyError, TypeError):
            bad.append(f"rank {rank}: {path} missing")
            continue
        if not same(got, value):
            bad.append(f"rank {rank}: {path} differs: {got!r} vs {value!r}")
    return bad


def drop_rank(common: dict) -> dict:
    out = dict(common)
    if "args" in out:
        out["args"] = argparse.Namespace(**{k: v for k, v in vars(out["args"]).items() if k != "rank"})
    return out


# --- rank functions --------------------------------------------------------------------------------


def _save_and_reshard(rank: int, ws: int, path: str, back: str) -> list[str]:
    assert ws == 4
    bad = []
    save(sharded_state(SAVE_LAYOUT, rank, ground_truth()), path, preprocess_common_before_consistancy_check=drop_rank)
    # the same layout, ShardedObjects per rank included
    bad += mismatches(load(sharded_state(SAVE_LAYOUT, rank, None), path), SAVE_LAYOUT, rank, rng=True)
    # TP1 x PP2 x DP2: DP replicas, optimizer ranges cut for two DP ranks
    other = (1, 2, 2)
    bad += mismatches(load(sharded_state(other, rank, None, rng=False), path), other, rank, rng=False)
    # and back: save at TP1 x PP2 x DP2 (replicas written once), load at TP2 x PP2
    save(sharded_state(other, rank, ground_truth(), rng=False) | common_state(SAVE_LAYOUT, 0), back)
    bad += mismatches(load(sharded_state(SAVE_LAYOUT, rank, None, rng=False), back), SAVE_LAYOUT, rank, rng=False)
    return bad


def _load_tp2_pp1(rank: int, ws: int, path: str) -> list[str]:
    layout = (2, 1, 1)
    return mismatches(load(sharded_state(layout, rank, None, rng=False), path), layout, rank, rng=False)


def _refusals(rank: int, ws: int, root: str) -> list[tuple[str, str, bool]]:
    """Each bad sharding: the error's class, its message, and whether a metadata.json was written."""
    full = torch.arange(48.0).reshape(12, 4)
    cases = {
        "same-piece": {"w": ShardedTensor.from_rank_offsets("w", full[:6].clone(), (0, 0, 2))},
        "partial-overlap": {"w": ShardedTensor("w", full[rank * 5 : rank * 5 + 7].clone(), torch.float32, (7, 4), (12, 4), (rank * 5, 0), None)},
        "gap": {"w": ShardedTensor.from_rank_offsets("w", full[rank * 4 : rank * 4 + 4].clone(), (0, rank, 3))},
        "shapes-differ": {"w": ShardedTensor.from_rank_offsets("w", full[: 6 + rank].clone(), (0, rank, 2))},
        "object-cell-twice": {"o": ShardedObject("o", rank, (2,), (0,))},
        "object-cell-missing": {"o": ShardedObject("o", rank, (3,), (rank,))},
        "tensor-and-object": {"w": ShardedTensor.from_rank_offsets("w", full.clone(), replica_id=rank) if rank else ShardedObject("w", 1, (1,), (0,))},
    }
    from shardsafe.megatron.strategies.native import _STATS

    # a valid save, checked; the same structure again is not checked again; then rank 1 changes
    # its sharding, and the check (rank 0's part from the cache) refuses it
    before = dict(_STATS)
    good = {"w": ShardedTensor.from_rank_offsets("w", full[rank * 6 : rank * 6 + 6].clone(), (0, rank, 2))}
    save(good, os.path.join(root, "good-1"))
    save(good, os.path.join(root, "good-2"))
    stats = {k: _STATS[k] - before.get(k, 0) for k in ("hit", "miss", "resend")}
    out: list = [("stats", stats if rank == 0 else {}, False)]
    for name, state in cases.items():
        path = os.path.join(root, name)
        try:
            save(state, path)
            out.append((name, "saved", False))
        except CheckpointingException as e:
            out.append((type(e).__name__, str(e), os.path.exists(os.path.join(path, "metadata.json"))))
    # an error one rank alone raises while preparing (a factory's build_fn here) fails every rank at once
    def build(key, t, replica_id, flattened_range):
        if rank == 1:
            raise ValueError("build_fn failed on rank 1")
        return {"x": ShardedTensor.from_rank_offsets(key, t, (0, 0, 2))}

    for step in (save, load):
        try:
            step({"f": ShardedTensorFactory("f", torch.zeros(2), build, lambda sd: sd["x"])}, os.path.join(root, "good-1"))
            out.append((step.__name__, "no error", False))
        except Exception as e:  # noqa: BLE001 - the class is what is tested
            out.append((type(e).__name__, str(e), False))
    # without validation, a cell held twice with different values is still refused (by the engine)
    try:
        save({"o": ShardedObject("o", rank, (1,), (0,))}, os.path.join(root, "differ"), validate_access_integrity=False)
        out.append(("differ", "saved", False))
    except shardsafe.CheckpointError as e:
        out.append((type(e).__name__, str(e), False))
    return out


# --- the checkpoint of the 4-rank job, shared by the tests that read it -----------------------------


def _build_saved(root):
    os.makedirs(root)
    results = run_ranks(4, _save_and_reshard, os.path.join(root, "tp2pp2"), os.path.join(root, "tp1pp2dp2"))
    with open(os.path.join(root, "mismatches.json"), "w") as f:
        json.dump([m for r in results for m in r], f)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Built once per test run for every xdist worker (this module's tests spread over both): read it, never change it."""
    root = built_once(tmp_path_factory, "megatron-tp2pp2", _build_saved)
    with open(os.path.join(root, "mismatches.json")) as f:
        bad = json.load(f)
    return os.path.join(root, "tp2pp2"), os.path.join(root, "tp1pp2dp2"), bad


def test_save_tp2pp2_and_load_same_layout_tp1pp2dp2_and_back_bit_exact(saved):
    _, _, bad = saved
    assert bad == []


def test_load_at_tp2pp1_on_two_ranks(saved):
    path, _, _ = saved
    results = run_ranks(2, _load_tp2_pp1, path)
    assert [m for r in results for m in r] == []


def test_load_at_tp1pp1_in_a_plain_process_flat_ranges_into_boxes(saved):
    path, _, _ = saved
    layout = (1, 1, 1)
    assert mismatches(load(sharded_state(layout, 0, None, rng=False), path), layout, 0, rng=False) == []
    # a distributed optimizer's flattened ranges load into a regular n-d box (Megatron itself cannot)
    key = "optimizer.exp_avg.decoder.layers.mlp.linear_fc2.weight"
    target = torch.zeros(L, H, F)
    out = load({"x": ShardedTensor.from_rank_offsets(key, target)}, path)
    assert out["x"] is target and torch.equal(target, ground_truth()[key])
    # and a regular box loads into flattened ranges
    emb = "embedding.word_embeddings.weight"
    part = torch.zeros(37)
    load({"x": ShardedTensor.from_rank_offsets_flat(emb, part, (V, H), flattened_range=slice(50, 87))}, path, validate_access_integrity=False)
    assert torch.equal(part, ground_truth()[emb].flatten()[50:87])


def test_checkpoint_is_a_shardsafe_checkpoint(saved):
    path, back, _ = saved
    truth = ground_truth()
    for where in (path, back):
        full = Checkpointer().unshard(where)
        for key, value in truth.items():
            assert torch.equal(full[key], value), key
        report = shardsafe.verify(where)
        assert report.ok and report.chunks > 0
    assert {k for k in full if "/shard_" in k} == {f"decoder.layers.self_attention._extra_state/shard_{i}_{L}" for i in range(L)}
    assert full["megatron:config"] == {"sharded_backend": "shardsafe", "sharded_backend_version": 1, "common_backend": "shardsafe", "common_backend_version": 1}
    stored = load_common_state_dict(path)
    assert same(stored, common_state(SAVE_LAYOUT, 0))
    assert maybe_load_config(path) == CheckpointingConfig("shardsafe", 1, "shardsafe", 1)
    meta = load_sharded_metadata(path)
    assert meta["rng_state/shard_1.0_2.2"] == ShardedObject("rng_state", None, (2, 2), (1, 0))
    assert meta["output_layer.weight"].global_shape == (V, H) and meta["output_layer.weight"].dtype == torch.float32
    plain = load_plain_tensors(path)
    assert set(plain) == set(truth) and all(torch.equal(plain[k], truth[k]) for k in truth)


def test_refusals_name_key_ranks_and_problem(tmp_path):
    results = run_ranks(2, _refusals, str(tmp_path))
    assert results[0][0] == ("stats", {"hit": 1, "miss": 1, "resend": 0}, False)
    results = [r[1:] for r in results]
    got = dict(enumerate(results[0]))
    msgs = [m for _, m, _ in results[0]]
    assert all(cls == "CheckpointingException" and not written for cls, _, written in results[0][:7])
    assert "key 'w': main replicas overlap: ranks [0, 1] each hold the piece at offset [0, 0] shape [6, 4]" in msgs[0]
    assert "key 'w': main replicas overlap: rank 0's piece at offset [0, 0] shape [7, 4] and rank 1's piece at offset [5, 0] shape [7, 4] share elements" in msgs[1]
    assert "key 'w': the main replicas (on ranks [0, 1]) cover 32 of the 48 elements of global shape [12, 4]: a gap, the first at element [8, 0]" in msgs[2]
    assert "key 'w': rank 0 has global shape [12, 4], rank 1 has [14, 4]" in msgs[3]
    assert "ShardedObject 'o': main replicas overlap: ranks [0, 1] each hold 'o/shard_0_2'" in msgs[4]
    assert "ShardedObject 'o': 1 of the 3 cells of global shape [3] have no main replica: no rank holds the cells at offsets [[2]]" in msgs[5]
    assert "key 'w' is a ShardedTensor on rank 1 and a ShardedObject on rank 0" in msgs[6]
    for i in (7, 8):  # save, load
        assert got[i] == ("CheckpointError", "1 rank(s) failed: rank 1: ValueError: build_fn failed on rank 1", False)
        assert results[1][i] == ("ValueError", "build_fn failed on rank 1", False)
    assert got[9][0] == "CheckpointError" and "non-tensor value 'o/shard_0_1' differs between rank 0 and rank 1" in got[9][1]
    # every rank raises the same class, naming the coordinator's finding
    assert [r[0] for r in results[1][:7]] == [r[0] for r in results[0][:7]]
    assert all(m0 in m1 for (_, m0, _), (_, m1, _) in zip(results[0][:7], results[1][:7]))


# --- in a plain process ------------------------------------------------------------------------------------


def _small(value: float = 1.0) -> dict:
    return {
        "a": ShardedTensor.from_rank_offsets("a", torch.full((4, 3), value)),
        "b": ShardedTensor.from_rank_offsets("b", torch.arange(6.0) * value),
        "o": ShardedObject("o", {"v": value}, (1,), (0,)),
        "step": 3,
    }


def test_strict_modes(tmp_path, caplog):
    path = str(tmp_path / "c")
    save(_small(), path)
    # requested: 'a' (stored), 'zz' (not stored); stored and not requested: 'b', 'o'
    def request() -> dict:
        return {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(4, 3)), "zz": ShardedTensor.from_rank_offsets("zz", torch.zeros(2))}

    with pytest.raises(MissingKeyError, match=r"key 'zz' is not in the checkpoint"):
        load(request(), path)
    with pytest.raises(CheckpointingException, match=r"Unexpected keys: rank 0: \['zz'\]\.$"):
        load(request(), path, strict=StrictHandling.RAISE_UNEXPECTED)
    with pytest.raises(CheckpointingException, match=r"Missing keys \(for all ranks\): \['b', 'o'\]\. .*Unexpected keys: rank 0: \['zz'\]"):
        load(request(), path, strict="raise_all")
    sd, missing, unexpected = load(request(), path, strict=StrictHandling.RETURN_ALL)
    assert (missing, unexpected) == ({"b", "o"}, {"zz"}) and torch.equal(sd["a"], torch.ones(4, 3)) and "zz" not in sd
    sd, missing, unexpected = load(request(), path, strict=StrictHandling.RETURN_UNEXPECTED)
    assert (missing, unexpected) == (set(), {"zz"})
    sd = load(request(), path, strict=StrictHandling.IGNORE_ALL)
    assert set(sd) == {"a", "step"}
    caplog.set_level(logging.WARNING, logger="shardsafe.megatron")
    caplog.clear()
    load(request(), path, strict=StrictHandling.LOG_UNEXPECTED)
    assert "Unexpected keys: rank 0: ['zz']" in caplog.text and "Missing keys" not in caplog.text
    caplog.clear()
    load(request(), path, strict=StrictHandling.LOG_ALL)
    assert "Missing keys (for all ranks): ['b', 'o']" in caplog.text and "Unexpected keys: rank 0: ['zz']" in caplog.text
    with pytest.raises(CheckpointingException, match=r"invalid strict flag 'sometimes'"):
        load(request(), path, strict="sometimes")


def test_load_refusals_and_padded_shapes(tmp_path):
    path = str(tmp_path / "c")
    save(_small(2.0), path)
    with pytest.raises(ShapeMismatchError, match=r"key 'a': checkpoint has global shape \[4, 3\], target has \[5, 3\]"):
        load({"a": ShardedTensor.from_rank_offsets("a", torch.zeros(5, 3))}, path)
    # allow_shape_mismatch (a padded vocabulary): the stored part is read, the rest is zero
    padded = ShardedTensor.from_rank_offsets("a", torch.full((3, 3), 7.0), (0, 1, 2), allow_shape_mismatch=True)
    out = load({"a": padded}, path, validate_access_integrity=False)
    assert torch.equal(out["a"], torch.tensor([[2.0] * 3, [0.0] * 3, [0.0] * 3]))
    with pytest.raises(CheckpointingException, match=r"ShardedObject 'o/shard_0_2' is not in the checkpoint \(it holds \['o/shard_0_1'\] of key 'o'"):
        load({"o": ShardedObject("o", None, (2,), (0,)), "o2": ShardedObject("o", None, (2,), (1,))}, path)
    with pytest.raises(NotADistributedCheckpointError, match=f"^Checkpoint directory {tmp_path / 'nothing'} does not exist$"):
        load({}, str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotADistributedCheckpointError, match=r"empty\S* is not a distributed checkpoint"):
        load({}, str(tmp_path / "empty"))


def test_common_state_round_trips_without_pickle(tmp_path):
    path = str(tmp_path / "c")
    common = {
        "args": argparse.Namespace(dtype=torch.float16, shape=torch.Size([2, 3]), device=torch.device("cpu"), kind=ModelType.retro),
        "tuple": (1, (2.5, "x"), None),
        "int_keys": {0: "a", 1: [float("nan"), float("-inf")]},
        "odict": (OrderedDict(b=1, a=2),),  # inside a tuple: nested dicts become dicts, as in Megatron-Core
        "sets": ({3, 1, 2}, frozenset({"x"})),
        "numpy": (np.int32(-5), np.float16(0.5), np.arange(6, dtype=np.int16).reshape(2, 3)),
        "bytes": b"\x00\xff",
        "tensors": (torch.arange(5, dtype=torch.bfloat16), torch.empty(0, 2), torch.tensor(3.5)),
        "__shardsafe__": "a plain key that looks like the tag",
    }
    save(dict(common), path)
    back = load_common_state_dict(path)
    assert same(back, common)
    assert same(back["sets"][0], {1, 2, 3}) and type(back["odict"][0]) is OrderedDict
    with open(os.path.join(path, "metadata.json"), "rb") as f:
        assert b'"__shardsafe__":"pickle"' not in f.read()


class Opaque:
    """A value with no JSON form."""


def test_values_without_a_json_form_need_the_opt_in(tmp_path):
    path = str(tmp_path / "c")
    with pytest.raises(PickleNotAllowedError, match=r"the common state: the value at key path \['sched'\]\[0\] is a tests.test_megatron.Opaque"):
        save({"sched": [Opaque()]}, path)
    with pytest.raises(CheckpointingException, match=r"ShardedObject 'o/shard_0_1': the tensor at key path \['big'\] holds 4194304 bytes"):
        save({"o": ShardedObject("o", {"big": torch.zeros(1 << 20)}, (1,), (0,))}, path)
    assert not os.path.exists(os.path.join(path, "metadata.json"))
    save({"sched": [np.float64(2.0)], "fn": len}, path, sharded_strategy=ShardsafeSaveShardedStrategy(allow_pickle=True))
    with pytest.raises(PickleNotAllowedError, match=r"the common state: the value at key path \['fn'\] was stored with pickle"):
        load_common_state_dict(path)
    back = ShardsafeLoadShardedStrategy(allow_pickle=True).load_common(path)
    assert back["fn"] is len and same(back["sched"], [np.float64(2.0)])
    out = load({}, path, sharded_strategy=ShardsafeLoadShardedStrategy(allow_pickle=True))
    assert out["fn"] is len


def test_megatron_metadata_json_is_recognised_by_both_sides(tmp_path):
    theirs = tmp_path / "megatron"
    theirs.mkdir()
    save_config(CheckpointingConfig("torch_dist"), str(theirs))
    assert json.loads((theirs / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1,
    }
    assert maybe_load_config(str(theirs)) == CheckpointingConfig("torch_dist")
    with pytest.raises(ForeignCheckpointError, match=r"this is Megatron-Core's dist_checkpointing config \(sharded_backend 'torch_dist'\)"):
        Checkpointer().load(str(theirs), {})
    with pytest.raises(CheckpointingException, match=r"holds a checkpoint Megatron-Core wrote \(sharded_backend 'torch_dist'\)"):
        load({}, str(theirs))
    ours = str(tmp_path / "ours")
    save(_small(), ours)
    assert check_is_distributed_checkpoint(ours) and not check_is_distributed_checkpoint(str(tmp_path / "none"))
    with pytest.raises(CheckpointingException, match=r"is the commit record of a shardsafe checkpoint"):
        save_config(CheckpointingConfig("torch_dist"), ours)
    assert serialization.get_default_load_sharded_strategy(ours).can_handle_sharded_objects
    plain = str(tmp_path / "plain")  # saved by Checkpointer: loads through shardsafe.megatron too
    Checkpointer().save(plain, {"w": torch.ones(3)})
    assert maybe_load_config(plain) == CheckpointingConfig("shardsafe", 1, "shardsafe", 1)
    assert torch.equal(load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3))}, plain)["w"], torch.ones(3))


def test_async_save_returns_a_request_that_completes_it(tmp_path):
    path = str(tmp_path / "c")
    request = save(_small(5.0), path, async_sharded_save=True, content_metadata={"format": "te", "v": 2})
    assert isinstance(request, AsyncRequest)
    done = []
    request.add_finalize_fn(lambda: done.append(True))
    request.freeze().execute_sync()
    assert done == [True]
    assert torch.equal(load({"a": ShardedTensor.from_rank_offsets("a", torch.zeros(4, 3))}, path)["a"], torch.full((4, 3), 5.0))
    assert load_content_metadata(path) == {"format": "te", "v": 2}
    with pytest.raises(CheckpointingException, match="frozen"):
        request.freeze().add_finalize_fn(print)


def test_metadata_readers_and_remove_sharded_tensors(tmp_path):
    path = str(tmp_path / "c")
    save(_small(), path)
    meta = load_tensors_metadata(path)
    assert set(meta) == {"a", "b"} and meta["a"].global_shape == (4, 3) and meta["a"].data is None
    objs = serialization.load_sharded_objects({"x": [ShardedObject("o", None, (1,), (0,))]}, path)
    assert objs == {"x": [{"v": 1.0}]}
    files_before = set(os.listdir(path))
    remove_sharded_tensors(path, "a")
    assert set(load_tensors_metadata(path)) == {"b"}
    assert set(os.listdir(path)) == files_before  # 'b' still lives in the one data file
    assert shardsafe.verify(path).chunks == 1
    remove_sharded_tensors(path, "b")
    assert not [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert load_common_state_dict(path) == {"step": 3}


def test_several_pieces_of_one_key_on_one_rank_through_the_engine(tmp_path):
    full = torch.arange(24.0).reshape(6, 4)
    pieces = {
        "top": shardsafe.ShardedTensor.from_rank_offsets("w", full[:2].clone(), (0, 0, 3)),
        "rest": shardsafe.ShardedTensor("w", full.flatten()[8:].clone(), (6, 4), (0, 0), (6, 4), flattened_range=slice(8, 24)),
    }
    Checkpointer().save(str(tmp_path / "c"), pieces)
    assert torch.equal(Checkpointer().unshard(str(tmp_path / "c"))["w"], full)
    with pytest.raises(shardsafe.DtypeMismatchError, match=r"key 'w': the ShardedTensor under 'b' has dtype float64, the one under 'a' has float32"):
        Checkpointer().save(str(tmp_path / "d"), {
            "a": shardsafe.ShardedTensor.from_rank_offsets("w", full[:3].clone(), (0, 0, 2)),
            "b": shardsafe.ShardedTensor.from_rank_offsets("w", full[3:].double(), (0, 1, 2)),
        })
    with pytest.raises(shardsafe.ShardingError, match=r"key 'w': pieces at \[0, 0\] shape \[4, 4\] and at \[2, 0\] shape \[4, 4\] overlap"):
        Checkpointer().save(str(tmp_path / "e"), {
            "a": shardsafe.ShardedTensor("w", full[:4].clone(), (6, 4), (0, 0), (4, 4)),
            "b": shardsafe.ShardedTensor("w", full[2:].clone(), (6, 4), (2, 0), (4, 4)),
        })
    with pytest.raises(shardsafe.CheckpointError, match=r"key 'w' appears twice in the state dict"):
        Checkpointer().save(str(tmp_path / "f"), {"w": full, "x": shardsafe.ShardedTensor.from_rank_offsets("w", full)})


# --- mapping, dict_utils, utils ---------------------------------------------------------------------------


def test_sharded_tensor_methods():
    data = torch.arange(12.0).reshape(3, 4)
    st = ShardedTensor.from_rank_offsets("k", data, (0, 2, 5), (2, 1, 2), prepend_axis_num=1)
    assert (st.global_shape, st.global_offset, st.axis_fragmentations) == ((5, 3, 8), (2, 0, 4), (5, 1, 2))
    assert st.global_slice() == (2, slice(0, 3), slice(4, 8))
    assert st.local_chunk_offset_in_global() == (2, 0, 1)
    assert st.max_allowed_chunks() == (1, 3, 4)
    assert st.without_data().data is None and st.data is data
    narrowed = st.narrow(1, 1, 2)[0]
    assert (narrowed.local_shape, narrowed.global_shape, narrowed.global_offset) == ((3, 2), (5, 3, 4), (2, 0, 2))
    assert torch.equal(narrowed.data, data[:, 1:3])
    flat = ShardedTensor.from_rank_offsets_flat("k", torch.arange(5.0), (3, 4), (0, 1, 2), flattened_range=slice(3, 8))
    assert [t.flattened_range for t in flat.narrow(0, 1, 1)] == [slice(0, 4)]
    assert torch.equal(flat.narrow(0, 1, 1)[0].data, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert flat.narrow(0, 2, 1) == []
    assert [c.tolist() for c in flat.global_coordinates()] == [[3, 4, 4, 4, 4], [3, 0, 1, 2, 3]]
    empty = ShardedTensor.from_rank_offsets_flat("k", torch.zeros(2), (2, 2), flattened_range=slice(1, 3)).without_data()
    empty.init_data("cpu", torch.ones)
    assert torch.equal(empty.data, torch.ones(2))
    with pytest.raises(CheckpointingException, match=r"ShardedTensor 'k': invalid rank offsets \(\(0, 2, 2\),\)"):
        ShardedTensor.from_rank_offsets("k", data, (0, 2, 2))
    with pytest.raises(CheckpointingException, match=r"ShardedTensor 'k': data has shape \(3, 4\), local_shape is \(4, 3\)"):
        ShardedTensor("k", data, torch.float32, (4, 3), (4, 3), (0, 0), None)
    with pytest.raises(CheckpointingException, match="from_rank_offsets does not take a flattened_range"):
        ShardedTensor.from_rank_offsets("k", data, flattened_range=slice(0, 1))
    assert mapping.is_main_replica(0) and mapping.is_main_replica((0, 0)) and not mapping.is_main_replica((0, 1))
    assert LocalNonpersitentObject is LocalNonpersistentObject


def test_sharded_object_and_factories():
    obj = ShardedObject("rng", {"s": 1}, (2, 4), (1, 3))
    assert obj.unique_key == "rng/shard_1.3_2.4"
    assert ShardedObject.empty_from_unique_key("a/b/shard_1.3_2.4") == ShardedObject("a/b", None, (2, 4), (1, 3))
    assert ShardedObject.empty_from_unique_key("x/shard_1.3_2").global_shape == (2, -1)
    with pytest.raises(CheckpointingException, match=r"'x' is not a ShardedObject unique key"):
        ShardedObject.empty_from_unique_key("x")
    f = glu_factory("k", torch.arange(8.0).reshape(4, 2), 0, 1, 0, 0)
    sd = {"m": [f]}
    mapping.apply_factories(sd)
    assert set(sd["m"][0]) == {"w", "v"} and sd["m"][0]["v"].global_offset == (0, 2, 0)
    merged = mapping.apply_factory_merges({"m": [{"w": torch.zeros(2, 2), "v": torch.ones(2, 2)}]}, {"m": [f]})
    assert torch.equal(merged["m"][0], torch.cat([torch.zeros(2, 2), torch.ones(2, 2)]))
    with pytest.raises(CheckpointingException, match=r"apply_factory_merges: key 'x' at key path \(\) of the factories is not in the loaded state dict"):
        mapping.apply_factory_merges({}, {"x": f})


def test_dict_utils_and_utils():
    st = ShardedTensor.from_rank_offsets("model.w", torch.zeros(2))
    sd = {"a": {"b": st, "c": 1}, "l": [LocalNonpersistentObject(2), 3], "e": {}}
    tensors, rest = utils.extract_sharded_tensors(sd)
    assert tensors == {"a": {"b": st}} and rest == {"a": {"c": 1}, "l": [sd["l"][0], 3], "e": {}}
    nonp, _ = utils.extract_nonpersistent(sd)
    assert nonp == {"l": [sd["l"][0]]}
    assert dict_utils.extract_matching_values(sd, lambda v: v == 3, return_lists_as_dicts=True)[0] == {"l": {1: 3}}
    assert dict_utils.diff({"a": 1, "b": [1, 2], "t": torch.ones(2)}, {"a": 2, "b": [1], "c": 0, "t": torch.ones(2)}) == (
        [("b", 1)], [("c",)], [(("a",), int, int)]
    )
    assert list(dict_utils.nested_values({"x": [1, {"y": 2}]})) == [1, 2]
    assert dict_utils.map_reduce([1, 2, 3, 4], lambda x: x % 2, reduce_fn=sum) == {1: 4, 0: 6}
    merged = dict_utils.merge({"a": {"b": 1}, "l": [{"x": 1}]}, {"a": {"c": 2}, "l": [{"y": 2}]})
    assert merged == {"a": {"b": 1, "c": 2}, "l": [{"x": 1, "y": 2}]}
    with pytest.raises(CheckpointingException, match=r"cannot merge two values at key path \('a', 'b'\): int and int"):
        dict_utils.merge({"a": {"b": 1}}, {"a": {"b": 2}})
    d = {"a": [1, {"b": 2}]}
    dict_utils.dict_map_with_key(lambda k, v: f"{k}={v}", d)
    assert d == {"a": ["0=1", {"b": "b=2"}]}
    assert dict_utils.dict_list_map_outplace(lambda v: v * 2, {"a": [1, 2]}) == {"a": [2, 4]}
    utils.add_prefix_for_sharding(sd, "pre.")
    assert st.key == "pre.model.w"
    utils.apply_prefix_mapping(sd, {"nomatch.": "x.", "pre.model.": "m."})
    assert st.key == "m.w"
    utils.replace_prefix_for_sharding(sd, "m.", "model.")
    assert st.key == "model.w"
    with pytest.raises(CheckpointingException, match=r"key 'model.w' does not start with the prefix 'x.'"):
        utils.replace_prefix_for_sharding(sd, "x.", "y.")
    local, global_ = validation.determine_global_metadata(sd)
    assert local == [st.without_data()] and global_ == [local]
    validation.validate_sharding_integrity(global_)
    with pytest.raises(CheckpointingException, match="main replicas overlap: ranks \\[0, 1\\]"):
        validation.validate_sharding_integrity([local, local])
    assert prod(st.global_shape) == 2


def test_torch_optimizer_state_sharded_like_the_model(tmp_path):
    from shardsafe.megatron import optimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 6)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    params = model.state_dict(keep_vars=True)
    # a TP-style split of the weight's rows over 2 (this process holds both halves as one piece each)
    sharded_model = {
        "weight": ShardedTensor.from_rank_offsets("layer.weight", params["weight"], (0, 0, 1)),
        "bias": ShardedTensor.from_rank_offsets("layer.bias", params["bias"]),
    }
    id_map = optimizer.get_param_id_to_sharded_param_map(sharded_model, model.parameters())
    assert {i: t.key for i, t in id_map.items()} == {0: "layer.weight", 1: "layer.bias"}
    state = opt.state_dict()
    optimizer.optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    assert state["state"][0]["exp_avg"].key == "optimizer.state.exp_avg.layer.weight"
    save({"model": sharded_model, "optimizer": state}, str(tmp_path / "c"))
    stored = Checkpointer().unshard(str(tmp_path / "c"))
    assert torch.equal(stored["optimizer.state.exp_avg_sq.layer.bias"], opt.state[model.bias]["exp_avg_sq"])
    # load into a fresh optimizer's structure: tensors come back, param_groups (tuples included) too
    fresh = {i: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)} for i, p in enumerate(model.parameters())}
    target = {"state": fresh, "param_groups": [dict(g, params=[0, 1]) for g in opt.state_dict()["param_groups"]]}
    optimizer.optim_state_to_sharding_state(target, id_map)
    out = load({"optimizer": target}, str(tmp_path / "c"))
    assert torch.equal(out["optimizer"]["state"][0]["exp_avg"], opt.state[model.weight]["exp_avg"])
    assert out["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.9) and out["optimizer"]["param_groups"][0]["params"] == [0, 1]
    with pytest.raises(CheckpointingException, match=r"optimizer state optimizer.state.x.layer.bias: shape \(2,\) differs"):
        optimizer.make_sharded_optimizer_tensor(id_map[1], torch.zeros(2), "optimizer.state.x")


def _save_tp2pp2dp2(rank: int, ws: int, path: str) -> None:
    assert ws == 8
    save(sharded_state((2, 2, 2), rank, ground_truth()), path, preprocess_common_before_consistancy_check=drop_rank)


def test_eight_ranks_tp2pp2dp2_save_loads_at_tp1pp1_in_a_plain_process_bit_exact(tmp_path):
    path = str(tmp_path / "tp2pp2dp2")
    run_ranks(8, _save_tp2pp2dp2, path, timeout=120)
    layout = (1, 1, 1)  # distributed-optimizer ranges cut for two DP ranks load into whole boxes
    assert mismatches(load(sharded_state(layout, 0, None, rng=False), path), layout, 0, rng=False) == []
    assert sorted(load_plain_tensors(path)) == sorted(ground_truth())
    # every DP replica's ShardedObject cell is stored once: (pp, tp) cells of rng_state
    meta = load_sharded_metadata(path)
    assert sorted(k for k in meta if k.startswith("rng_state/")) == [f"rng_state/shard_{p}.{t}_2.2" for p in range(2) for t in range(2)]
