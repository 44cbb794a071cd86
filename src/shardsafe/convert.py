"""Other formats into a shardsafe checkpoint: a ``torch.save`` file, a Hugging Face safetensors model.

(A ``torch.distributed.checkpoint`` folder converts through :func:`shardsafe.dcp.convert`.)
Both run in one process, with no process group, and write through the converters' writer
(:func:`shardsafe.engine.rewrite.write_checkpoint`): tensors streamed one at a time,
``metadata.json`` committed last, ``progress`` reported as each tensor is written.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import pickle
import time
from collections.abc import Callable
from typing import Any

import torch

from ._args import check_arg, check_bool
from ._progress import progress_callback
from .errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError, PickleNotAllowedError, StorageError
from .format import strict_json
from .storage import Location, open_storage
from .storage.local import open_nofollow

log = logging.getLogger(__name__)

__all__ = ["convert_hf", "convert_torch", "flatten_state"]


def flatten_state(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """Nested dicts joined into ``a.b.c`` keys; other values as they are. Two ways to one key raise."""
    out: dict[str, Any] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{where}: key {prefix}{k!r} is not a string; shardsafe keys are strings")
            key = prefix + k
            if isinstance(v, dict) and v and all(isinstance(x, str) for x in v):
                walk(v, key + ".")
                continue
            if key in out:
                raise CheckpointError(f"{where}: key {key!r} is reached twice once nested dicts are joined with '.'; rename one")
            out[key] = v

    walk(obj, "")
    return out


def convert_torch(
    src: str | os.PathLike[str],
    dst: Location,
    *,
    overwrite: bool = False,
    allow_pickle: bool = False,
    progress: bool | Callable[[int, int], None] | None = None,
) -> dict[str, int]:
    """Save the state dict in the ``torch.save`` file ``src`` as a shardsafe checkpoint at ``dst``.

    The file is read with ``torch.load(weights_only=True)`` (memory-mapped when its format
    allows), so nothing but tensors, containers and plain values is ever unpickled. Nested
    dicts become ``a.b`` keys; tensors are stored as tensors, other values as JSON (or, with
    ``allow_pickle``, pickled when JSON cannot hold them). A checkpoint committed at ``dst``
    raises ``CheckpointExistsError`` unless ``overwrite``. ``progress``: ``True`` draws a
    progress bar (tqdm) on stderr; a callable is called as ``progress(done, total)`` with the
    bytes of tensor data written so far. Returns ``tensors`` and ``values`` counts.
    """
    check_arg("convert_torch", "src", src, (str, os.PathLike))
    check_bool("convert_torch", "overwrite", overwrite)
    check_bool("convert_torch", "allow_pickle", allow_pickle)
    bar = progress_callback(progress, "convert_torch")
    where = os.fspath(src)
    if not os.path.isfile(where):
        raise StorageError(f"{where}: no such file")
    try:
        try:
            obj = torch.load(where, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            obj = torch.load(where, map_location="cpu", weights_only=True)  # the legacy format cannot be mapped
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PickleNotAllowedError(
            f"{where}: torch.load(weights_only=True) refuses it ({first}); only files of tensors, containers and plain "
            "values convert (load it yourself if you trust it, and save with shardsafe.Checkpointer)"
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise CorruptCheckpointError(f"{where}: not a readable torch.save file: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: holds a {type(obj).__name__}, not a state dict (a dict of names to tensors and values)")
    flat = flatten_state(obj, where)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in flat.items() if k not in tensors}
    from .adapters import describe_state

    described, _ = describe_state(tensors)  # checked as a save checks them: dense, a dtype safetensors stores, not a subclass
    facts = {t.key: (t.dtype, t.shape) for t in described}
    _write(dst, [list(tensors)], facts, lambda key: tensors[key], values, allow_pickle, overwrite, bar, where)
    return {"tensors": len(tensors), "values": len(values)}


def _write(
    dst: Location,
    files: list[list[str]],
    facts: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    load: Callable[[str], torch.Tensor],
    values: dict[str, Any],
    allow_pickle: bool,
    overwrite: bool,
    progress: Callable[[int, int], None] | None,
    where: str,
) -> None:
    """Write the tensors of ``facts`` (key: dtype and global shape; ``load(key)`` gives the whole
    tensor, called once, when it is written) in one data file per list of keys in ``files``, and
    ``values``, as a checkpoint at ``dst``, committed last."""
    from .engine.commit import committed_version
    from .engine.rewrite import Chunk, write_checkpoint
    from .format.values import encode_objects
    from .knobs import KNOBS

    started = time.monotonic()
    as_json, pickled = encode_objects(values, allow_pickle=allow_pickle)
    out = open_storage(dst)
    try:
        listed = out.list()
        seen = committed_version(out)
        if seen is not None and not overwrite:
            raise CheckpointExistsError(f"{out.url}: a checkpoint is already committed there; pass overwrite=True to replace it")
        chunks = [
            [Chunk(k, (0,) * len(facts[k][1]), facts[k][1], None, k) for k in keys if math.prod(facts[k][1])] for keys in files
        ]  # a tensor of no elements has no chunk
        total = sum(math.prod(c.lengths) * facts[c.key][0].itemsize for f in chunks for c in f)
        report: Callable[[int], None] = (lambda done: progress(done, total)) if progress is not None else (lambda done: None)
        report(0)
        meta = write_checkpoint(
            out, chunks, facts, lambda c: load(c.key), objects=as_json, pickled=pickled, listed=listed, seen=seen,
            overwrite=overwrite, knobs=KNOBS, report=report, where=where,
        )
    finally:
        out.close()
    seconds = time.monotonic() - started
    log.debug(
        "convert %s -> %s: %d tensors, %d values, %d bytes, %.2f s, %.2f GB/s",
        where, out.url, len(meta.tensors), len(values), total, seconds, total / max(seconds, 1e-9) / 1e9,
    )


def convert_hf(
    src: Location, dst: Location, *, overwrite: bool = False, progress: bool | Callable[[int, int], None] | None = None
) -> dict[str, int]:
    """Save the Hugging Face safetensors model at ``src`` (a ``.safetensors`` file, an index, or
    a folder holding them) as a shardsafe checkpoint at ``dst``, under the same tensor names,
    one data file per file of the model.

    Local files are memory-mapped (pages come from the page cache, the process holds no copy);
    from an object store each tensor is read when it is written, so memory holds about two
    tensors at a time. The files' ``__metadata__`` strings
    (but ``format``) are stored as values: decoded when they are JSON (as
    :func:`~shardsafe.unshard_to_safetensors` writes values), else as the strings. A checkpoint
    committed at ``dst`` raises ``CheckpointExistsError`` unless ``overwrite``. ``progress``:
    ``True`` draws a progress bar (tqdm) on stderr; a callable is called as
    ``progress(done, total)`` with the bytes of tensor data written so far. Returns ``tensors`` and ``values`` counts.
    """
    from .hf import open_hf_model

    check_bool("convert_hf", "overwrite", overwrite)
    bar = progress_callback(progress, "convert_hf")
    hf = open_hf_model(src)
    specs = {key: next(iter(tm.shard_spec_per_file.items())) for key, tm in hf.tensors.items()}  # (file, [its one chunk])
    files: dict[str, list[str]] = {}
    for key, (file, _) in specs.items():
        files.setdefault(file, []).append(key)
    facts = {key: (tm.torch_dtype, tuple(tm.shape)) for key, tm in hf.tensors.items()}
    values = {k: _value(v) for k, v in hf.metadata.items() if k != "format" and k not in hf.tensors}
    maps: dict[str, mmap.mmap | None] = {}
    try:
        if hf.storage.local_root is not None:

            def load(key: str) -> torch.Tensor:
                file, (spec,) = specs[key]
                if file not in maps:
                    fd = open_nofollow(os.path.join(hf.storage.local_root, file))  # type: ignore[arg-type]
                    try:
                        size = os.fstat(fd).st_size
                        maps[file] = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) if size else None
                    finally:
                        os.close(fd)
                a, b = spec.byte_range
                tm = hf.tensors[key]
                if b > _size(maps[file]):
                    raise CorruptCheckpointError(f"{hf.where}: {file} ends before tensor {key!r} (bytes [{a}, {b})); the file is truncated")
                return torch.frombuffer(maps[file], dtype=tm.torch_dtype, count=(b - a) // tm.torch_dtype.itemsize, offset=a).view(tm.shape)

            _write(dst, list(files.values()), facts, load, values, False, overwrite, bar, hf.where)
        else:
            from .adapters import describe_state
            from .engine.bounds import check_files_hold
            from .engine.reader import Reader
            from .knobs import KNOBS

            check_files_hold(hf.storage, hf.tensors.items())
            with Reader(hf.storage, KNOBS) as reader:

                def load(key: str) -> torch.Tensor:
                    tm = hf.tensors[key]
                    full = torch.empty(tm.shape, dtype=tm.torch_dtype)
                    (target,), _ = describe_state({key: full})
                    reader.load_tensor(tm, target)
                    return full

                _write(dst, list(files.values()), facts, load, values, False, overwrite, bar, hf.where)
    finally:
        for m in maps.values():
            if m is not None:
                try:
                    m.close()
                except BufferError:  # a tensor still refers to it; freed with the tensor
                    pass
    return {"tensors": len(hf.tensors), "values": len(values)}


def _value(text: str) -> Any:
    try:
        value = strict_json.loads(text.encode())
    except ValueError:  # not JSON (or nested deeper than any value may): kept as the string it is
        return text
    return text if strict_json.nesting_exceeds(value, strict_json.MAX_DEPTH) else value


def _size(m: mmap.mmap | None) -> int:
    return 0 if m is None else len(m)
