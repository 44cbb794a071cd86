"""Reading checkpoints megatron-core's ``torch_dist`` backend wrote, without megatron-core.

Such a directory holds DCP's ``.metadata`` and ``.distcp`` files (the sharded part), Megatron's
``common.pt`` (``torch.save`` of the common state, rank 0) and Megatron's own ``metadata.json``.
:class:`TorchDistLoadShardedStrategy` loads it into any layout through
:func:`shardsafe.megatron.serialization.load`, built on shardsafe's DCP importer
(:mod:`shardsafe.dcp.distcp`: ``.metadata`` through an allowlisted unpickler, each stored
chunk through shardsafe's restricted unpickler). ``common.pt`` and the ShardedObjects are read by
the same unpickler (:mod:`shardsafe.format.safe_pickle`) with what megatron-core's own
``safe_globals`` admit (numpy arrays, ``argparse.Namespace``, Megatron's enums, torch dtypes);
anything else in them needs ``allow_pickle=True``.

Megatron stores a ``flattened_range`` tensor (a distributed optimizer's state) "n-d
reformulated": the DCP tensor has shape ``axis_fragmentations + (box elements,)``, one row per
box of the regular grid, and ``.metadata`` keeps the original global shape
(``mcore_data[key]["nd_reformulated_orig_global_shape"]``). Each stored chunk is then a flat range
of one box, and loads into flattened ranges or plain boxes alike.
"""

from __future__ import annotations

from math import prod
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ... import adapters
from ...dcp import distcp
from ...dist import get_comm
from ...errors import ShardingError
from ...format.geometry import check_tiling
from ...storage import Storage, open_storage
from ..core import CheckpointingException, location, opened
from ..mapping import ShardedObject, ShardedStateDict, StateDict
from .common import is_torch_dist_checkpoint, read_common_pt, read_sharded_object
from .native import ShardsafeLoadShardedStrategy, sharded_metadata, tensors_metadata

__all__ = ["TorchDistLoadShardedStrategy", "is_torch_dist_checkpoint", "read_common_pt", "read_sharded_object", "stored_pieces"]  # the readers of
# Megatron's own files live in strategies.common and are re-exported here, where they always were

class _Stored(NamedTuple):
    shape: tuple[int, ...]  # the global shape Megatron's ShardedTensors have
    torch_dtype: torch.dtype
    grid: tuple[int, ...] | None  # n-d reformulated: the axis fragmentations (the box is shape // grid)


class _View(NamedTuple):
    """What the load flow needs of a checkpoint's metadata: stored tensors and objects by key,
    each tensor's stored chunks (:meth:`pieces`) and how to read one (:meth:`load_chunk`)."""

    tensors: dict[str, _Stored]
    objects: dict[str, distcp.DcpItem]
    ckpt: distcp.DcpCheckpoint

    @property
    def where(self) -> str:
        return self.ckpt.where

    def pieces(self, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, int] | None, Any]]:
        """Each stored chunk of ``key`` as (box offset, box shape, flat range of the box or None, item)."""
        return stored_pieces(key, self.tensors[key], self.ckpt)

    def read_object(self, storage: Storage, unique_key: str, *, allow_pickle: bool, strategy: str, opt_in: str | None = None) -> Any:
        """The value of the stored ShardedObject ``unique_key`` (see :func:`safe_torch_load`)."""
        where = f"{self.where}: ShardedObject {unique_key!r}"
        return read_sharded_object(storage, self.objects[unique_key], where, allow_pickle=allow_pickle, strategy=strategy, opt_in=opt_in)

    def check_stored(self, storage: Storage) -> None:
        """Before whole tensors are allocated: every tensor is tiled by its stored chunks and
        every data file holds the items the metadata places in it (one 1-byte read per file),
        so the shapes allocated are bounded by the bytes the files hold."""
        check_tilings(self)
        distcp.check_files_hold(storage, self.ckpt)

    def load_chunk(self, storage: Storage, key: str, item: Any) -> torch.Tensor:
        """The stored chunk ``item`` of ``key``: its elements, in a tensor of DCP's chunk shape."""
        dtype, _, entries = self.ckpt.tensors[key]
        sizes = next(le for _, le, it in entries if it == item)
        return distcp.load_tensor(distcp.read_item(storage, item), item, dtype, sizes, self.ckpt.where)


class TorchDistLoadShardedStrategy(ShardsafeLoadShardedStrategy):
    """Loads a megatron-core ``torch_dist`` checkpoint (see the module's docstring). Each rank
    reads only the stored chunks its pieces overlap, each once per load."""

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != "torch_dist":
            raise CheckpointingException(f"the checkpoint's sharded backend is {loaded_backend!r}; this strategy reads 'torch_dist' checkpoints")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != 1:
            raise CheckpointingException(f"the checkpoint's torch_dist version is {loaded_version}; this strategy reads version 1")

    def view(self, checkpoint_dir: str | Path | Storage) -> _View:
        """The checkpoint's stored tensors and objects (reads ``.metadata``)."""
        storage = open_storage(location(checkpoint_dir))
        try:
            ckpt = distcp.read_dcp_checkpoint(storage)
        finally:
            if storage is not checkpoint_dir:
                storage.close()
        mcore = getattr(ckpt.metadata, "mcore_data", None) or {}
        tensors = {}
        for key, (dtype, shape, _) in ckpt.tensors.items():
            orig = (mcore.get(key) or {}).get("nd_reformulated_orig_global_shape")
            if orig is None:
                tensors[key] = _Stored(tuple(shape), dtype, None)
                continue
            orig = tuple(int(x) for x in orig)
            grid = tuple(shape[:-1])
            if len(grid) != len(orig) or any(g == 0 or o % g for o, g in zip(orig, grid)) or shape[-1] != prod(o // g for o, g in zip(orig, grid)):
                raise CheckpointingException(
                    f"{ckpt.where}: tensor {key!r} is stored with shape {list(shape)}, which is not an n-d reformulation of its "
                    f"global shape {list(orig)}"
                )
            tensors[key] = _Stored(orig, dtype, grid)
        return _View(tensors, dict(ckpt.values), ckpt)

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        """Every stored tensor as an unsharded ShardedTensor without data, by key."""
        return tensors_metadata(self.view(checkpoint_dir))  # type: ignore[arg-type]

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> ShardedStateDict:
        """Every stored tensor (by key) and ShardedObject (by unique key), without data."""
        return sharded_metadata(self.view(checkpoint_dir))  # type: ignore[arg-type]

    def load_plain(self, checkpoint_dir: str | Path) -> StateDict:
        """Every stored tensor, whole, by key (no process group: this process reads them all)."""
        meta = self.view(checkpoint_dir)
        storage = open_storage(location(checkpoint_dir))
        try:
            meta.check_stored(storage)  # shapes from foreign metadata: proven by the files before allocating
            out = {key: torch.empty(t.shape, dtype=t.torch_dtype) for key, t in meta.tensors.items()}
            chunks: dict[tuple[str, Any], torch.Tensor] = {}
            for key, data in out.items():
                shape = tuple(data.shape)
                _fill(adapters.ShardedTensor(key, data, shape, (0,) * len(shape), shape), meta, storage, chunks)
                chunks.clear()
        finally:
            if storage is not checkpoint_dir:
                storage.close()
        return out

    def common_of(self, meta: Any, checkpoint_dir: str | Path | Storage) -> StateDict:
        """Megatron's ``common.pt`` (``{}`` if there is none)."""
        return read_common_pt(checkpoint_dir, allow_pickle=self.allow_pickle, strategy=type(self).__name__)

    def load_common(self, checkpoint_dir: str | Path) -> StateDict:
        return self.common_of(None, checkpoint_dir)

    def _object(self, v: Any, meta: Any, checkpoint_dir: Any) -> Any:
        if not isinstance(v, ShardedObject):
            return v
        if v.unique_key not in meta.objects:
            raise CheckpointingException(f"{checkpoint_dir}: ShardedObject {v.unique_key!r} is not in the checkpoint")
        with opened(location(checkpoint_dir)) as storage:
            return meta.read_object(storage, v.unique_key, allow_pickle=self.allow_pickle, strategy=type(self).__name__)

    def read_targets(self, checkpoint_dir: str | Path | Storage, targets: dict[str, adapters.ShardedTensor], meta: Any) -> None:
        storage = open_storage(location(checkpoint_dir))
        chunks: dict[tuple[str, Any], torch.Tensor] = {}  # (key, item): read once per load

        def fill_all() -> None:
            for t in targets.values():
                _fill(t, meta, storage, chunks)

        try:
            get_comm(call=None).check(fill_all)  # an error on one rank raises on every rank
        finally:
            if storage is not checkpoint_dir:
                storage.close()


def check_tilings(meta: Any) -> None:
    """``CheckpointingException`` unless the stored chunks of every tensor of ``meta`` (a
    :class:`_View` or another view with its attributes) tile its global shape exactly."""
    for key, stored in meta.tensors.items():
        try:
            check_tiling(key, stored.shape, [(off, lens, flat) for off, lens, flat, _ in meta.pieces(key)])
        except ShardingError as e:
            raise CheckpointingException(f"{meta.where}: {e}") from None


def _fill(t: adapters.ShardedTensor, meta: Any, storage: Storage, chunks: dict) -> None:
    """Fill piece ``t`` from the stored chunks it overlaps (read once each into ``chunks``); ``meta``
    is a :class:`_View` or another view with its attributes and methods."""
    stored = meta.tensors.get(t.key)
    if stored is None:
        raise CheckpointingException(f"{meta.where}: key {t.key!r} is not in the checkpoint")
    if tuple(t.global_shape) != stored.shape:
        raise CheckpointingException(
            f"{meta.where}: key {t.key!r} is stored with global shape {list(stored.shape)}, requested with {list(t.global_shape)}"
        )
    off, lens = tuple(t.global_offset), tuple(t.local_shape)
    if t.flattened_range is not None:
        box = torch.empty(lens, dtype=t.data.dtype)
    else:
        box = t.data if tuple(t.data.shape) == lens else t.data.view(lens)
    covered = 0
    for b_off, b_lens, flat, item in meta.pieces(t.key):
        inter = [(max(o, bo), min(o + n, bo + bn)) for o, n, bo, bn in zip(off, lens, b_off, b_lens)]
        if any(lo >= hi for lo, hi in inter):
            continue
        if (t.key, item) not in chunks:
            chunks[(t.key, item)] = meta.load_chunk(storage, t.key, item)
        data = chunks[(t.key, item)]
        if flat is None:
            src = data if tuple(data.shape) == b_lens else data.view(b_lens)
        else:  # a flat range of its box: the box's other elements are other chunks
            src = torch.empty(b_lens, dtype=data.dtype)
            mask = torch.zeros(b_lens, dtype=torch.bool)
            src.view(-1)[flat[0] : flat[1]] = data.view(-1)
            mask.view(-1)[flat[0] : flat[1]] = True
            s_sl = tuple(slice(lo - bo, hi - bo) for (lo, hi), bo in zip(inter, b_off))
            d_sl = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, off))
            m = mask[s_sl]
            box[d_sl][m] = src[s_sl][m].to(box.dtype)
            covered += int(m.sum())
            continue
        s_sl = tuple(slice(lo - bo, hi - bo) for (lo, hi), bo in zip(inter, b_off))
        d_sl = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, off))
        box[d_sl] = src[s_sl].to(box.dtype)
        covered += prod(hi - lo for lo, hi in inter)
    if covered != prod(lens):
        raise CheckpointingException(
            f"{meta.where}: key {t.key!r}: the stored chunks cover {covered} of the {prod(lens)} elements of the piece at "
            f"{list(off)} shape {list(lens)}"
        )
    if t.flattened_range is not None:
        t.data.copy_(box.view(-1)[t.flattened_range])


def stored_pieces(key: str, stored: _Stored, ckpt: distcp.DcpCheckpoint) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, int] | None, Any]]:
    """Each stored chunk of ``key`` as (box offset, box shape, flat range of the box or None, item)."""
    _, _, entries = ckpt.tensors[key]
    if stored.grid is None:
        return [(tuple(o), tuple(le), None, item) for o, le, item in entries if prod(le)]
    box = tuple(s // g for s, g in zip(stored.shape, stored.grid))
    out = []
    for o, le, item in entries:
        if not prod(le):
            continue
        if any(n != 1 for n in le[:-1]):
            raise CheckpointingException(f"{ckpt.where}: key {key!r}: a stored chunk of shape {list(le)} spans several boxes")
        b_off = tuple(i * n for i, n in zip(o[:-1], box))
        out.append((b_off, box, (o[-1], o[-1] + le[-1]), item))
    return out


