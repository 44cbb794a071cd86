"""Hugging Face safetensors models in: one ``.safetensors`` file, or a folder as ``transformers``'
``save_pretrained`` writes one (``model.safetensors``, or ``model-0000i-of-0000N.safetensors``
shards and ``model.safetensors.index.json``), local or in an object store.

The files' headers are read once (by the coordinator, and broadcast) and described as a checkpoint
whose every tensor is one unsharded chunk at its byte range; the same read planning as a shardsafe
load then has each rank read only the byte ranges of its own shards, straight into its tensors.
A Hugging Face file carries no checksums: its bytes are not verified (only its header's structure
and sizes are checked).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from ._args import check_arg, check_bool
from ._gc import paused_gc
from ._progress import rank_progress, targets_done
from .adapters import describe_state
from .adapters.modules import model_state
from .dist import Comm, get_comm
from .engine.bounds import check_files_hold, read_header_prefix, read_limited
from .engine.outputs import INDEX_FILE, SINGLE_FILE
from .engine.reader import Reader
from .errors import CorruptCheckpointError, IncompleteCheckpointError, StorageError
from .format import strict_json
from .format.checksum import ChunkSums
from .format.dtypes import SAFETENSORS_CODE
from .format.metadata import MAX_NDIM, MAX_SIZE, TensorShardSpec, TensorStorageMetadata, built
from .format.safetensors_file import parse_header
from .knobs import KNOBS, Knobs
from .storage import Location, Storage, open_storage
from .storage.base import url_scheme

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["HFModel", "load_hf_safetensors", "open_hf_model"]

log = logging.getLogger(__name__)

_BY_CODE = {code: dtype for dtype, code in SAFETENSORS_CODE.items()}
_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in SAFETENSORS_CODE}


class _UncheckedTensor(TensorStorageMetadata):
    """A tensor of a Hugging Face file: its bytes carry no checksums."""

    def chunk_sums(self, file: str, spec: TensorShardSpec) -> ChunkSums:
        return ChunkSums.unchecked(nbytes=spec.byte_range[1] - spec.byte_range[0], where=f"{file}:{spec.name}")


class HFModel:
    """The tensors of a Hugging Face safetensors model: ``tensors`` (name -> metadata, one chunk
    each, at its byte range in its file of ``storage``), ``metadata`` (each file's
    ``__metadata__``, merged) and ``where`` (for messages)."""

    def __init__(self, storage: Storage, where: str, tensors: dict[str, TensorStorageMetadata], metadata: dict[str, str]) -> None:
        self.storage, self.where, self.tensors, self.metadata = storage, where, tensors, metadata


@paused_gc()  # a few objects per tensor, none cyclic; a header may list 300k tensors
def open_hf_model(location: Location, comm: Comm | None = None) -> HFModel:
    """Read the headers of the Hugging Face model at ``location``: a ``.safetensors`` file, an
    ``.index.json`` file, or a folder holding ``model.safetensors.index.json``,
    ``model.safetensors`` or exactly one ``.safetensors`` file. With ``comm``, its coordinator
    reads and every rank gets the result."""
    loc = os.fspath(location) if isinstance(location, (str, os.PathLike)) else None
    if loc is None:
        raise TypeError(f"load_hf_safetensors: argument 'path_or_url' must be a path or a URL, got {type(location).__name__}")
    parent, name = _split(loc)
    storage = open_storage(parent)
    where = f"{storage.url.rstrip('/')}/{name}" if name else storage.url

    def read() -> tuple[dict[str, bytes], dict[str, str] | None]:
        files, weight_map = _files(storage, name, where)
        return {f: _read_header(storage, f, where) for f in files}, weight_map

    headers, weight_map = comm.broadcast(read) if comm is not None else read()
    tensors: dict[str, TensorStorageMetadata] = {}
    metadata: dict[str, str] = {}
    ranges: list[tuple[int, int, str]] = []
    for file, raw in headers.items():
        fwhere = f"{storage.url.rstrip('/')}/{file}"
        try:
            start, header = parse_header(raw)
        except ValueError as e:
            raise CorruptCheckpointError(f"{fwhere}: not a valid safetensors file: {e}") from None
        for key, entry in header.items():
            if key == "__metadata__":
                if isinstance(entry, dict):
                    metadata.update({str(k): str(v) for k, v in entry.items()})
                continue
            if key in tensors:
                raise CorruptCheckpointError(f"{where}: tensor {key!r} is in two files ({file} and another); each tensor is in one")
            if weight_map is not None and weight_map.get(key) != file:
                raise CorruptCheckpointError(
                    f"{where}: tensor {key!r} is in {file}, the index maps it to {weight_map.get(key)!r}; the index does not match the files"
                )
            tensors[key] = tm = _tensor(key, entry, start, file, fwhere)
            ranges.append((*tm.shard_spec_per_file[file][0].byte_range, key))
        _check_disjoint(ranges, fwhere)
        ranges.clear()
    if weight_map is not None:
        lost = sorted(set(weight_map) - set(tensors))
        if lost:
            raise CorruptCheckpointError(f"{where}: the index names {len(lost)} tensor(s) no file holds: {lost[:5]}")
    return HFModel(storage, where, tensors, metadata)


def _check_disjoint(ranges: list[tuple[int, int, str]], where: str) -> None:
    """No two tensors of one file share bytes (``ranges``: start, end, key), as the official
    ``safetensors`` library requires: two tensors aliasing one another's bytes are refused."""
    last = (0, 0, "")  # the range reaching furthest so far
    for b0, b1, kb in sorted(r for r in ranges if r[1] > r[0]):
        a0, a1, ka = last
        if b0 < a1:
            raise CorruptCheckpointError(
                f"{where}: not a valid safetensors file: tensors {ka!r} (bytes [{a0}, {a1})) and {kb!r} (bytes [{b0}, {b1})) "
                "overlap; each tensor has bytes of its own"
            )
        last = (b0, b1, kb)


def _split(loc: str) -> tuple[str, str]:
    """(folder, file name or "") of a location naming a file or a folder."""
    if not (loc.endswith(".safetensors") or loc.endswith(".json")):
        return loc, ""
    if url_scheme(loc) not in (None, "file"):
        parent, _, name = loc.rpartition("/")
        return parent, name
    path = loc[len("file://") :] if loc.startswith("file://") else loc
    return os.path.dirname(path) or ".", os.path.basename(path)


def _files(storage: Storage, name: str, where: str) -> tuple[list[str], dict[str, str] | None]:
    """The data files to read, and the index's weight map if there is an index."""
    if name.endswith(".safetensors"):
        return [name], None
    if not name:
        try:
            listed = storage.list()
        except (FileNotFoundError, StorageError):
            listed = []
        if INDEX_FILE in listed:
            name = INDEX_FILE
        elif SINGLE_FILE in listed:
            return [SINGLE_FILE], None
        else:
            found = sorted(f for f in listed if f.endswith(".safetensors"))
            if len(found) == 1:
                return found, None
            what = f"{len(found)} .safetensors files and no {INDEX_FILE}" if found else "no .safetensors file"
            raise IncompleteCheckpointError(
                f"{where}: not a Hugging Face safetensors model: {what} there"
                + ("" if listed else " (the folder is empty or missing)")
                + "; name the model file or the folder that holds it"
            )
    try:
        doc = strict_json.loads(read_limited(storage, name))
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{where}: no such index file") from None
    except ValueError as e:
        raise CorruptCheckpointError(f"{where}/{name}: the index is not valid JSON: {e}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CorruptCheckpointError(f"{where}/{name}: the index has no weight_map of tensor names to file names")
    files = sorted(set(weight_map.values()))
    for f in files:
        if "/" in f or "\\" in f or f in (".", "..") or not f.endswith(".safetensors"):
            raise CorruptCheckpointError(f"{where}/{name}: the index names file {f!r}, not a .safetensors file beside it; refusing to read it")
    return files, weight_map


def _read_header(storage: Storage, file: str, where: str) -> bytes:
    fwhere = f"{storage.url.rstrip('/')}/{file}"
    try:
        raw = read_header_prefix(storage, file)  # a length the file does not hold is refused before allocating
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{fwhere}: no such file (named by {where})") from None
    except (ValueError, CorruptCheckpointError) as e:
        raise CorruptCheckpointError(f"{fwhere}: not a valid safetensors file: {e}") from None
    return bytes(raw)


def _tensor(key: str, entry: Any, start: int, file: str, where: str) -> TensorStorageMetadata:
    bad = f"{where}: not a valid safetensors file: tensor {key!r}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise CorruptCheckpointError(f"{bad}: entry {str(entry)[:80]} is not {{dtype, shape, data_offsets}}")
    dtype = _BY_CODE.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise CorruptCheckpointError(f"{bad}: dtype {entry['dtype']!r} is not one shardsafe reads ({', '.join(sorted(_BY_CODE))})")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if (
        not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(type(n) is int and 0 <= n < MAX_SIZE for n in shape)
        or not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int and 0 <= n < MAX_SIZE for n in offsets)
    ):
        raise CorruptCheckpointError(f"{bad}: shape {str(shape)[:60]} or data_offsets {str(offsets)[:60]} are not non-negative integers")
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
        if nbytes >= MAX_SIZE:
            raise CorruptCheckpointError(f"{bad}: shape {shape} would hold 2**62 bytes or more")
    if offsets[1] - offsets[0] != nbytes:
        raise CorruptCheckpointError(f"{bad}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, shape {shape} of {dtype} needs {nbytes}")
    # every field checked above: built without pydantic's validation (a header may list 300k tensors)
    spec = built(TensorShardSpec, {
        "global_offset": (0,) * len(shape), "local_shape": tuple(shape), "name": key, "byte_range": (start + offsets[0], start + offsets[1]),
    })
    fields = {"shape": tuple(shape), "dtype": _NAMES[dtype], "is_sharded": False, "shard_spec_per_file": {file: [spec]}}
    return built(_UncheckedTensor, fields, {"_checksum": None, "_table": None, "_doc": None, "_key": ""})


def load_hf_safetensors(
    path_or_url: Location,
    model: nn.Module,
    *,
    prefix: str | None = None,
    strict: bool = True,
    knobs: Knobs | None = None,
    process_group: ProcessGroup | None = None,
    progress: bool | Callable[[int, int], None] | None = None,
) -> int:
    """Load a Hugging Face safetensors model into ``model`` (plain, DDP, FSDP2, HSDP, tensor
    parallel, FSDP2 + TP, FSDP1 with ``use_orig_params=True``) in place; returns the bytes this
    rank read.

    ``path_or_url``: a ``.safetensors`` file, a ``model.safetensors.index.json`` file, or a
    folder holding either (as ``save_pretrained`` writes them), local or an object-store URL.
    Each rank reads only the byte ranges its own shards need, straight into its parameters: no
    rank ever holds the full weights. Every rank of ``process_group`` (default: all) calls this
    together; a failure on any rank raises on every rank.

    Names: a parameter or persistent buffer ``fqn`` of the model (wrapper parts such as
    ``module.`` dropped, as :func:`load_model_and_optim_state` names them) is read from the
    file's tensor ``prefix + fqn``; file tensors not under ``prefix`` are ignored. Every
    parameter and buffer must be in the file (``MissingKeyError``); shapes and dtypes must
    match (``ShapeMismatchError``, ``DtypeMismatchError``: no silent casts). With ``strict``,
    tensors under ``prefix`` that the model lacks are refused too.

    A Hugging Face file carries no checksums, so, unlike a shardsafe checkpoint, its bytes are
    not verified: only the header's structure and sizes, and that each file holds the bytes its
    header names.

    ``progress``: ``True`` draws a progress bar (tqdm, on stderr) on the coordinator only; a
    callable is called on every rank as ``progress(done, total)`` with the bytes of this rank's
    parameters and buffers filled so far.
    """
    from .adapters.keys import MODEL_PREFIX
    from .api import check_model_keys
    from .engine.loader import check_targets

    check_arg("load_hf_safetensors", "model", model, nn.Module)
    check_arg("load_hf_safetensors", "prefix", prefix, str, optional=True)
    check_bool("load_hf_safetensors", "strict", strict)
    check_arg("load_hf_safetensors", "knobs", knobs, Knobs, optional=True)
    knobs = knobs or KNOBS
    started = time.monotonic()
    comm = get_comm(process_group=process_group, call="shardsafe.load_hf_safetensors", timeout_s=knobs.collective_timeout_s)
    bar = rank_progress(progress, "load_hf_safetensors", comm.is_coordinator)
    hf = open_hf_model(path_or_url, comm)
    log.debug("load_hf_safetensors %s: %d tensors in %d file(s)", hf.where, len(hf.tensors), len({f for t in hf.tensors.values() for f in t.shard_spec_per_file}))
    pre = prefix or ""
    stored = {k: t for k, t in hf.tensors.items() if k.startswith(pre)}  # errors name the file's tensors

    def run() -> int:
        params, buffers = model_state(model)
        as_model = {MODEL_PREFIX + k[len(pre) :]: t for k, t in stored.items()}
        check_model_keys(as_model, [i.fqn for i in [*params, *buffers]], hf.where, strict=strict, flag="strict")
        values = {pre + i.fqn: i.sharded(pre + i.fqn, i.tensor) for i in [*params, *buffers] if not i.holds_nothing}
        tensors, _ = describe_state(values, targets=True)
        check_targets(_Tensors(stored), tensors, [], hf.where)
        check_files_hold(hf.storage, ((t.key, stored[t.key]) for t in tensors))
        with Reader(hf.storage, knobs) as reader:
            reader.load_tensors(((stored[t.key], t) for t in tensors), targets_done(bar, tensors))
            return reader.bytes_read

    nread = comm.check(run)
    if comm.is_coordinator:
        seconds = time.monotonic() - started
        log.debug(
            "load_hf_safetensors %s: %d tensors, %d bytes read on rank 0, %.2f s, %.2f GB/s",
            hf.where, len(stored), nread, seconds, nread / max(seconds, 1e-9) / 1e9,
        )
    return nread


class _Tensors:
    """What :func:`~shardsafe.engine.loader.check_targets` reads of a checkpoint's metadata: its tensors."""

    def __init__(self, tensors: dict[str, TensorStorageMetadata]) -> None:
        self.tensors = tensors
        self.objects: dict[str, Any] = {}
        self.pickled_objects: dict[str, str] = {}
