"""The one loader of pickles that other libraries put in checkpoints, without running foreign code.

Megatron-Core writes ``common.pt`` and its ShardedObjects with ``torch.save``; torch's DCP writes
``.metadata`` as a bare pickle and each non-tensor value as a ``torch.save`` archive. shardsafe
reads them all here: a pickle may name only the globals of an allowlist, looked up by the name the
pickle carries (``module.name``), and any other name raises
:class:`~shardsafe.errors.UnsafePickleError` naming it, before anything of it runs.

Allowlists (a mapping from name to a function giving the object):

- :data:`TENSORS`: what ``torch.save`` of tensors and plain containers needs (torch's own
  ``weights_only`` set: tensor and parameter rebuilds, storages, dtypes, ``torch.Size``,
  ``torch.device``, ``OrderedDict``, ``set``, ``bytes``).
- :data:`VALUES`: :data:`TENSORS` plus what megatron-core's ``megatron/core/safe_globals.py`` lets
  Megatron itself load: numpy arrays, dtypes and scalars (under numpy 1.x's ``numpy.core`` names
  and numpy 2's ``numpy._core``), ``argparse.Namespace``, ``types.SimpleNamespace``, ``PosixPath``
  and Megatron's enums ``ModelType``, ``AttnBackend``, ``RerunDiagnostic``, ``RerunMode``,
  ``RerunState``. An enum is Megatron's own class when megatron-core is importable, otherwise a
  stand-in of the same name whose members have the same ``.name`` and ``.value``.
- callers add their own (DCP's metadata classes, :mod:`shardsafe.dcp.distcp`).

:func:`load_archive` reads a ``torch.save`` zip archive (tensors on the CPU); a legacy
(non-zip) ``torch.save`` file or a bare pickle is refused there. :func:`load_pickle` reads a bare
pickle. Both use Python's own unpickler with its ``find_class`` and ``persistent_load`` replaced,
so the only callables a pickle can reach are the allowlisted ones.
"""

from __future__ import annotations

import collections
import enum
import importlib
import io
import pickle
import pickletools
import zipfile
import zlib
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import torch

from ..errors import CorruptCheckpointError, PickleNotAllowedError, UnsafePickleError

__all__ = [
    "DTYPES",
    "TENSORS",
    "VALUES",
    "Allowlist",
    "global_named",
    "globals_in",
    "is_archive",
    "load_archive",
    "load_pickle",
    "load_value_file",
    "Source",
    "megatron_enum",
]

Source = bytes | bytearray | memoryview | BinaryIO
"""A pickle's bytes, or a seekable binary file of them (read from its start; only what is needed)."""

Allowlist = Mapping[str, Callable[[], Any]]
"""``module.name`` as a pickle carries it -> a function giving the object to use for it."""

ZIP_MAGIC = b"PK\x03\x04"  # torch.save's archive format (torch >= 1.6)


def global_named(module: str, name: str) -> Callable[[], Any]:
    """An allowlist entry: ``module.name``, imported when a pickle names it."""
    return lambda: getattr(importlib.import_module(module), name)


def _storage(name: str) -> Callable[[], Any]:
    return lambda: torch.serialization.StorageType(name)  # carries the dtype; persistent_load builds the storage


DTYPES: Allowlist = {f"torch.{n}": global_named("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
"""Torch's dtypes (``torch.float32``...), as a pickle names them."""


def _tensor_names() -> dict[str, Callable[[], Any]]:
    out: dict[str, Callable[[], Any]] = {
        **DTYPES,
        "collections.OrderedDict": lambda: collections.OrderedDict,
        "torch.Size": lambda: torch.Size,
        "torch.device": lambda: torch.device,
        "torch.Tensor": lambda: torch.Tensor,
        "torch.nn.parameter.Parameter": lambda: torch.nn.Parameter,
        "torch.serialization._get_layout": global_named("torch.serialization", "_get_layout"),
        "torch._tensor._rebuild_from_type_v2": global_named("torch._tensor", "_rebuild_from_type_v2"),
        "_codecs.encode": global_named("_codecs", "encode"),  # bytes, in pickle protocol 2 (torch.save's)
    }
    for f in ("_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter", "_rebuild_parameter_with_state"):
        out[f"torch._utils.{f}"] = global_named("torch._utils", f)
    for builtin in ("set", "frozenset", "bytearray", "complex", "slice"):
        out[f"builtins.{builtin}"] = out[f"__builtin__.{builtin}"] = global_named("builtins", builtin)  # __builtin__: protocol 2
    for name in dir(torch):
        if name.endswith("Storage") and name not in ("TypedStorage", "UntypedStorage") and isinstance(getattr(torch, name, None), type):
            out[f"torch.{name}"] = _storage(name)
    out["torch.UntypedStorage"] = _storage("UntypedStorage")
    return out


TENSORS: Allowlist = _tensor_names()
"""What ``torch.save`` of tensors, parameters and plain Python containers names."""


# Megatron-Core's enums, for checkpoints read where megatron-core is not importable: same class
# names, members with the same ``.name`` and ``.value`` (megatron/core/enums.py,
# transformer/enums.py, rerun_state_machine.py of megatron-core 0.15).


class ModelType(enum.Enum):
    encoder_or_decoder = 1
    retro_encoder = 2
    retro_decoder = 3


class AttnBackend(enum.Enum):
    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


class RerunDiagnostic(str, enum.Enum):
    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunMode(str, enum.Enum):
    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


class RerunState(enum.Enum):
    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


_MEGATRON_ENUMS: dict[str, type[enum.Enum]] = {
    "megatron.core.enums.ModelType": ModelType,
    "megatron.core.transformer.enums.AttnBackend": AttnBackend,
    "megatron.core.rerun_state_machine.RerunDiagnostic": RerunDiagnostic,
    "megatron.core.rerun_state_machine.RerunMode": RerunMode,
    "megatron.core.rerun_state_machine.RerunState": RerunState,
}


def megatron_enum(name: str) -> type[enum.Enum] | None:
    """The class of the Megatron enum called ``name`` (``megatron.core.enums.ModelType``, or its
    stand-in's ``shardsafe.format.safe_pickle.ModelType``): megatron-core's own if it can be
    imported, its stand-in otherwise; ``None`` for any other name."""
    real = next((k for k, c in _MEGATRON_ENUMS.items() if name in (k, f"{__name__}.{c.__name__}")), None)
    if real is None:
        return None
    stand_in = _MEGATRON_ENUMS[real]
    module, _, cls = real.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), cls)
    except Exception:  # noqa: BLE001 - megatron-core missing, or failing to import: use the stand-in
        return stand_in
    return found if isinstance(found, type) and issubclass(found, enum.Enum) else stand_in


def _numpy(name: str) -> Callable[[], Any]:
    def get() -> Any:
        import numpy as np

        if name in ("_reconstruct", "scalar"):  # numpy 2 moved numpy.core to numpy._core (1.26 has both)
            try:
                return getattr(importlib.import_module("numpy._core.multiarray"), name)
            except ImportError:
                return getattr(importlib.import_module("numpy.core.multiarray"), name)
        return getattr(np, name)

    return get


def _numpy_dtype_class(name: str) -> Callable[[], Any]:
    def get() -> Any:
        import numpy as np

        cls = getattr(np.dtypes, name)
        if cls.type is np.object_ or not issubclass(cls, np.dtype):
            raise UnsafePickleError(f"numpy.dtypes.{name}")
        return cls

    return get


def _values_names() -> dict[str, Callable[[], Any]]:
    out = dict(TENSORS)
    for core in ("numpy.core.multiarray", "numpy._core.multiarray"):  # numpy 1.x and numpy 2 pickles
        out[f"{core}._reconstruct"] = _numpy("_reconstruct")
        out[f"{core}.scalar"] = _numpy("scalar")
    out["numpy.ndarray"] = _numpy("ndarray")
    out["numpy.dtype"] = _numpy("dtype")
    for dt in ("Bool", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64", "Float16", "Float32", "Float64"):
        out[f"numpy.dtypes.{dt}DType"] = _numpy_dtype_class(f"{dt}DType")
    out["argparse.Namespace"] = global_named("argparse", "Namespace")
    out["types.SimpleNamespace"] = global_named("types", "SimpleNamespace")
    for path in ("PosixPath", "PurePosixPath"):
        out[f"pathlib.{path}"] = out[f"pathlib._local.{path}"] = global_named("pathlib", path)  # pathlib._local: Python >= 3.13
    for name in _MEGATRON_ENUMS:
        out[name] = (lambda n: lambda: megatron_enum(n))(name)
    for cls in _MEGATRON_ENUMS.values():
        out[f"{__name__}.{cls.__name__}"] = (lambda c: lambda: c)(cls)  # a stand-in pickled again
    return out


VALUES: Allowlist = _values_names()
"""What megatron-core and Megatron-LM store in ``common.pt`` and ShardedObjects (see the module's docstring)."""


class _Unpickler(pickle.Unpickler):
    """Python's unpickler, reaching only the globals in ``allowed`` (by the name the pickle carries);
    persistent ids (storages) only through ``storage``, which returns an untyped storage for a key."""

    def __init__(self, file: io.BytesIO, *, where: str, allowed: Allowlist, what: str, storage: Callable[[str, torch.dtype, int], Any] | None) -> None:
        super().__init__(file, encoding="utf-8")
        self.where = where
        self.allowed = allowed
        self.what = what
        self.storage = storage

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        get = self.allowed.get(full)
        if get is None:
            raise _refused(self.where, full, self.what)
        try:
            return get()
        except UnsafePickleError:
            raise _refused(self.where, full, self.what) from None
        except (ImportError, AttributeError):
            raise CorruptCheckpointError(
                f"{self.where}: the pickle names {full}, which this process does not have (written with another version "
                "of torch or numpy?)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        if self.storage is None:
            raise UnsafePickleError(f"{self.where}: the pickle uses persistent ids, which {self.what} never holds; refusing it (nothing of it was run)")
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.serialization.StorageType)):
            raise CorruptCheckpointError(f"{self.where}: persistent id {str(pid)[:200]} is not a torch storage")
        _, kind, key, _location, numel = pid
        if not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise CorruptCheckpointError(f"{self.where}: persistent id {str(pid)[:200]} is not a torch storage")
        return torch.storage.TypedStorage(wrap_storage=self.storage(key, kind.dtype, numel), dtype=kind.dtype, _internal=True)


def _refused(where: str, full: str, what: str) -> UnsafePickleError:
    return UnsafePickleError(
        f"{where}: the pickle names {full}, which is not one of the globals {what} holds; refusing to load it (nothing "
        "of it was run). It was not written by the library it claims, or was tampered with; load it with that library "
        "only if you trust it"
    )


def _file(raw: Source) -> BinaryIO:
    """``raw`` as a binary file at its start."""
    if isinstance(raw, bytes | bytearray | memoryview):
        return io.BytesIO(raw)
    raw.seek(0)
    return raw


_SCAN_BYTES = 1 << 20  # of a refused non-archive, how much is read to name its globals


def load_pickle(raw: Source, *, where: str, allowed: Allowlist, what: str) -> Any:
    """The object a bare pickle holds, reaching only the globals in ``allowed``. ``where`` names the
    file and ``what`` the kind of file in errors (``UnsafePickleError`` for a global outside
    ``allowed``, ``CorruptCheckpointError`` for a damaged pickle)."""
    return _load(_Unpickler(_file(raw), where=where, allowed=allowed, what=what, storage=None), where)


def is_archive(raw: Source) -> bool:
    """True if ``raw`` starts as a zip archive (``torch.save``'s format since torch 1.6)."""
    if isinstance(raw, bytes | bytearray | memoryview):
        return bytes(raw[:4]) == ZIP_MAGIC
    return _file(raw).read(4) == ZIP_MAGIC


def load_archive(raw: Source, *, where: str, allowed: Allowlist = VALUES, what: str = "a torch.save file of checkpoint values") -> Any:
    """The object a ``torch.save`` archive holds, its tensors on the CPU, reaching only the
    globals in ``allowed``. A legacy (non-zip) ``torch.save`` file or a bare pickle raises
    ``UnsafePickleError`` naming the globals it holds; a damaged archive ``CorruptCheckpointError``."""
    if not is_archive(raw):
        found = globals_in(raw if isinstance(raw, bytes | bytearray | memoryview) else _file(raw).read(_SCAN_BYTES))
        named = f"; it names {', '.join(found[:8])}{' ...' if len(found) > 8 else ''}" if found else ""
        raise UnsafePickleError(
            f"{where}: not a torch.save zip archive but a legacy torch.save file or a bare pickle{named}; shardsafe "
            "reads only zip archives (what torch >= 1.6 and megatron-core write), and refused it (nothing of it was run). "
            "Load it with torch.load only if you trust it, and save it again"
        )
    try:
        archive = zipfile.ZipFile(_file(raw))
        names = archive.namelist()
    except _ARCHIVE_ERRORS as e:
        raise CorruptCheckpointError(f"{where}: not a readable torch.save archive: {type(e).__name__}: {e}") from None
    data_pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(data_pkl) != 1:
        raise CorruptCheckpointError(f"{where}: a torch.save archive holds one <name>/data.pkl; found {data_pkl or 'none'}")
    prefix = data_pkl[0][: -len("data.pkl")]
    order = f"{prefix}byteorder"
    if order in names and (found := _record(archive, order, where).strip()) not in (b"little", b""):
        raise CorruptCheckpointError(f"{where}: written on a big-endian machine ({found!r}); shardsafe reads little-endian archives")
    storages: dict[str, Any] = {}

    def storage(key: str, dtype: torch.dtype, numel: int) -> Any:
        if key not in storages:
            try:
                info = archive.getinfo(f"{prefix}data/{key}")
            except KeyError:
                raise CorruptCheckpointError(f"{where}: the archive has no record data/{key} for a stored tensor") from None
            if info.file_size != numel * dtype.itemsize:
                raise CorruptCheckpointError(
                    f"{where}: record data/{key} holds {info.file_size} bytes, not the {numel * dtype.itemsize} of {numel} {dtype} elements"
                )
            data = bytearray(info.file_size)
            try:
                with archive.open(info) as f:  # checks the record's CRC-32 as it reads
                    got = f.readinto(data)
            except _ARCHIVE_ERRORS as e:
                raise CorruptCheckpointError(f"{where}: record data/{key} cannot be read: {type(e).__name__}: {e}") from None
            if got != len(data):
                raise CorruptCheckpointError(f"{where}: record data/{key} ends after {got} of {len(data)} bytes")
            storages[key] = torch.frombuffer(data, dtype=torch.uint8).untyped_storage() if data else torch.UntypedStorage(0)
        return storages[key]

    return _load(_Unpickler(io.BytesIO(_record(archive, data_pkl[0], where)), where=where, allowed=allowed, what=what, storage=storage), where)


# what zipfile raises on a damaged archive: a bad CRC-32 or header (BadZipFile), a name that is not
# UTF-8 (UnicodeDecodeError, a ValueError), a compression method it lacks (NotImplementedError),
# a damaged deflate stream (zlib.error), a record past the end (EOFError, OSError)
_ARCHIVE_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, OSError, NotImplementedError, zlib.error)


def _record(archive: zipfile.ZipFile, name: str, where: str) -> bytes:
    """The bytes of record ``name``, its CRC-32 checked; damage raises ``CorruptCheckpointError``."""
    try:
        return archive.read(name)
    except _ARCHIVE_ERRORS as e:
        raise CorruptCheckpointError(f"{where}: record {name} cannot be read: {type(e).__name__}: {e}") from None


def load_value_file(raw: Source, *, where: str, allow_pickle: bool, opt_in: str) -> Any:
    """What ``torch.save`` wrote in ``raw`` (a checkpoint's values): read by :func:`load_archive`
    with :data:`VALUES`; what that refuses raises ``PickleNotAllowedError`` (naming the refused
    global, its message ending with ``opt_in``: how the caller opts in), or, only with
    ``allow_pickle``, is read by ``torch.load`` with the full unpickler."""
    try:
        return load_archive(raw, where=where, allowed=VALUES)
    except UnsafePickleError as e:
        if not allow_pickle:
            raise PickleNotAllowedError(f"{e}. {opt_in}") from None
    try:
        return torch.load(_file(raw), map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a damaged file
        raise CorruptCheckpointError(f"{where}: cannot be read: {type(e).__name__}: {str(e)[:300]}") from None


def _load(unpickler: _Unpickler, where: str) -> Any:
    try:
        return unpickler.load()
    except (UnsafePickleError, CorruptCheckpointError):
        raise
    except Exception as e:  # noqa: BLE001 - anything a damaged pickle makes the unpickler raise
        raise CorruptCheckpointError(f"{where}: not a readable pickle: {type(e).__name__}: {str(e)[:300]}") from None


def globals_in(raw: bytes | bytearray | memoryview) -> list[str]:
    """The globals (``module.name``) the pickles in ``raw`` name, found by reading their opcodes
    (nothing is run); for messages. Stops at the first byte that is not a pickle."""
    found: list[str] = []
    stream = io.BytesIO(bytes(raw))
    while stream.tell() < len(raw):
        pushed: list[Any] = []  # the strings pushed, in order (STACK_GLOBAL's operands are the last two)
        memo: dict[Any, Any] = {}
        last: Any = None  # the string the previous opcode pushed, if it pushed one
        try:
            for op, arg, _ in pickletools.genops(stream):
                string = None
                if op.name in ("GLOBAL", "INST"):
                    found.append(str(arg).replace(" ", "."))
                elif op.name == "STACK_GLOBAL":
                    module, name = pushed[-2:] if len(pushed) >= 2 else ("?", "?")
                    found.append(f"{module}.{name}")
                elif "UNICODE" in op.name or op.name in ("STRING", "BINSTRING", "SHORT_BINSTRING"):
                    string = arg
                elif op.name == "MEMOIZE":
                    memo[len(memo)], string = last, last
                elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                    memo[arg], string = last, last
                elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                    string = memo.get(arg)
                if string is not None and string is not last:
                    pushed.append(string)
                last = string
        except Exception:  # noqa: BLE001 - not (or no longer) a pickle: report what was found
            break
    return list(dict.fromkeys(found))
