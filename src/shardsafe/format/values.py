r"""Non-tensor values as JSON: the one value codec (``docs/format.md`` §13), no pickle by default.

A value JSON holds as it is stays plain JSON. The Python values training state holds that JSON
lacks become a one-member-tagged object ``{"__shardsafe__": <tag>, ...}``, a dict with the key
``__shardsafe__`` being therefore reserved in stored values:

==============  =================================================================
tag             value
==============  =================================================================
``tuple``       ``items``: the elements
``list``        never: lists are JSON arrays
``dict``        ``items``: ``[key, value]`` pairs (a dict with a key that is not a
                string, or with the key ``__shardsafe__``)
``odict``       ``items`` as for ``dict``: a ``collections.OrderedDict``
``set``         ``items``, sorted by their JSON text (also ``frozenset``)
``float``       ``v``: ``"nan"``, ``"inf"`` or ``"-inf"``
``bytes``       ``b64`` (also ``bytearray``, and ``bytesio``: an ``io.BytesIO``)
``namespace``   ``v``: the attributes, as a dict (``argparse.Namespace``)
``enum``        ``class`` (``module:qualname``) and ``name`` of the member
``dtype``       ``v``: ``"bfloat16"`` (a ``torch.dtype``)
``size``        ``items``: a ``torch.Size``
``device``      ``v``: ``"cuda:0"`` (a ``torch.device``)
``tensor``      ``dtype``, ``shape``, ``b64`` of the little-endian elements (CPU on load)
``ndarray``     ``dtype`` (numpy's name), ``shape``, ``b64``
``numpy``       ``dtype``, ``b64``: a numpy scalar
``pickle``      ``b64`` of a pickle: only with the caller's opt-in, on save and on load
==============  =================================================================

A tensor subclass's record (``tensor_subclass``, ``docs/format.md`` §14) uses the same key: it is
read by the adapters, never decoded as a value.

An enum is decoded only when its module is already imported (a checkpoint never makes the
reader import a module), except Megatron's own (``ModelType``, ``AttnBackend``, ``Rerun*``): those
are megatron-core's classes where it is importable, and stand-ins with the same member names and
values otherwise (:func:`shardsafe.format.safe_pickle.megatron_enum`). Tensors and arrays inline at most :data:`INLINE_BYTES` each: larger
ones belong in a ``ShardedTensor``.

:func:`encode_value` / :func:`decode_value` are the codec itself (``shardsafe.megatron`` stores
Megatron's common state and ShardedObjects with them, ``shardsafe.lightning`` its checkpoint dict);
:func:`encode_objects` writes a state's values for ``Checkpointer`` (a value JSON holds as it is
stays plain JSON), :func:`encode_tagged` for ``shardsafe.dcp``'s writer and ``convert``;
:func:`decode_objects` gives every reader the Python values back. Errors are
:class:`~shardsafe.errors.CheckpointError`\ s (``PickleNotAllowedError`` for a value that needs
pickle, ``CorruptCheckpointError`` for a stored value that is invalid); an integration re-wraps
them at its own boundary.
"""

from __future__ import annotations

import argparse
import base64
import enum
import io
import json
import math
import pickle
import sys
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError, CorruptCheckpointError, PickleNotAllowedError, ShardingError
from .safe_pickle import megatron_enum
from .strict_json import MAX_DEPTH, nesting_exceeds

__all__ = [
    "INLINE_BYTES",
    "TAG",
    "decode_objects",
    "decode_value",
    "encode_objects",
    "encode_tagged",
    "encode_value",
    "has_tag",
    "is_json_value",
    "merge_rank_objects",
    "plain_mappings",
]

TAG = "__shardsafe__"
"""The key that marks a tagged object inside a stored JSON value (see the module docstring)."""
INLINE_BYTES = 1 << 20
"""Largest tensor or array stored inline in the JSON (per value)."""

_SIMPLE = (type(None), bool, int, str)



def encode_value(value: Any, *, where: str, allow_pickle: bool, opt_in: str) -> Any:
    """``value`` as a JSON value (see the module docstring); ``where`` names it in errors.

    Raises ``PickleNotAllowedError`` naming the key path of a part that has no JSON form,
    unless ``allow_pickle``; ``opt_in`` ends its message (how the caller opts in to pickle).
    """
    out = _Encoder(where, allow_pickle, opt_in).encode(value, ())
    if nesting_exceeds(out, MAX_DEPTH):
        raise CheckpointError(
            f"{where}: nests lists, dicts and tuples too deep to store (at most {MAX_DEPTH} levels once encoded)"
        )
    return out



def decode_value(value: Any, *, where: str, allow_pickle: bool, opt_in: str) -> Any:
    """The Python value :func:`encode_value` encoded; ``where`` names it in errors, ``opt_in`` says
    how the caller opts in to unpickling a ``pickle`` tag."""
    return _Decoder(where, allow_pickle, opt_in).decode(value, ())


def _path(path: tuple) -> str:
    return "".join(f"[{p!r}]" for p in path) or " (the value itself)"


class _Encoder:
    def __init__(self, where: str, allow_pickle: bool, opt_in: str) -> None:
        self.where = where
        self.allow_pickle = allow_pickle
        self.opt_in = opt_in
        self.active: set[int] = set()  # containers on the path being encoded: a cycle is an error

    def encode(self, v: Any, path: tuple) -> Any:
        t = type(v)
        if t in _SIMPLE:
            return v
        if t is float:
            return v if math.isfinite(v) else {TAG: "float", "v": repr(v)}
        if isinstance(v, np.generic):
            return self._numpy_scalar(v, path)
        if isinstance(v, enum.Enum):
            return {TAG: "enum", "class": f"{t.__module__}:{t.__qualname__}", "name": v.name}
        if t in (list, tuple, dict, OrderedDict, set, frozenset, argparse.Namespace):
            if id(v) in self.active:
                raise CheckpointError(f"{self.where}: the value at key path {_path(path)} contains itself")
            self.active.add(id(v))
            try:
                return self._container(v, t, path)
            finally:
                self.active.discard(id(v))
        if t in (bytes, bytearray):
            return {TAG: "bytes", "b64": _b64(bytes(v))}
        if t is io.BytesIO:
            return {TAG: "bytesio", "b64": _b64(v.getvalue())}
        if t is torch.dtype:
            return {TAG: "dtype", "v": str(v).removeprefix("torch.")}
        if t is torch.device:
            return {TAG: "device", "v": str(v)}
        if t is torch.Size:
            return {TAG: "size", "items": list(v)}
        if t is torch.Tensor or t is torch.nn.Parameter:
            return self._tensor(v, path)
        if t is np.ndarray and not v.dtype.hasobject and v.dtype.names is None:
            return self._sized(path, v.nbytes, {TAG: "ndarray", "dtype": v.dtype.str, "shape": list(v.shape), "b64": _b64(np.ascontiguousarray(v).tobytes())})
        return self._other(v, path)

    def _container(self, v: Any, t: type, path: tuple) -> Any:
        if t is list:
            return [self.encode(x, path + (i,)) for i, x in enumerate(v)]
        if t is dict and all(type(k) is str for k in v) and TAG not in v:
            return {k: self.encode(x, path + (k,)) for k, x in v.items()}
        if t in (dict, OrderedDict):
            items = [[self.encode(k, path + ("<key>",)), self.encode(x, path + (k,))] for k, x in v.items()]
            return {TAG: "dict" if t is dict else "odict", "items": items}
        if t is tuple:
            return {TAG: "tuple", "items": [self.encode(x, path + (i,)) for i, x in enumerate(v)]}
        if t is argparse.Namespace:
            return {TAG: "namespace", "v": self._container(vars(v), dict, path)}
        items = [self.encode(x, path + ("<element>",)) for x in v]
        items.sort(key=lambda x: json.dumps(x, sort_keys=True))
        return {TAG: "set" if t is set else "frozenset", "items": items}

    def _tensor(self, v: torch.Tensor, path: tuple) -> Any:
        if v.layout != torch.strided or v.device.type == "meta":
            return self._other(v, path)
        data = v.detach().cpu().contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
        doc = {TAG: "tensor", "dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape), "b64": _b64(raw)}
        return self._sized(path, len(raw), doc)

    def _numpy_scalar(self, v: np.generic, path: tuple) -> Any:
        if v.dtype.hasobject:
            return self._other(v, path)
        return {TAG: "numpy", "dtype": v.dtype.str, "b64": _b64(v.tobytes())}

    def _sized(self, path: tuple, nbytes: int, doc: dict) -> Any:
        if nbytes > INLINE_BYTES:
            raise CheckpointError(
                f"{self.where}: the {doc[TAG]} at key path {_path(path)} holds {nbytes} bytes; at most {INLINE_BYTES} are "
                "stored inline with the common state and ShardedObjects. Wrap it in a ShardedTensor (rank 0's as the "
                "main replica, replica_id=1 elsewhere) so that it is stored, checksummed, in the data files"
            )
        return doc

    def _other(self, v: Any, path: tuple) -> Any:
        t = type(v)
        if self.allow_pickle:
            try:
                return {TAG: "pickle", "b64": _b64(pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL))}
            except Exception as e:  # noqa: BLE001 - any __reduce__ may raise anything
                raise CheckpointError(
                    f"{self.where}: the {t.__module__}.{t.__qualname__} at key path {_path(path)} cannot be pickled: {e}"
                ) from e
        raise PickleNotAllowedError(
            f"{self.where}: the value at key path {_path(path)} is a {t.__module__}.{t.__qualname__}, which shardsafe "
            "does not store without pickle (it stores None, bool, int, float, str, list, dict, tuple, set, bytes, "
            f"argparse.Namespace, enums, torch dtypes, devices and tensors, numpy scalars and arrays). Convert it, {self.opt_in}"
        )


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


class _Decoder:
    def __init__(self, where: str, allow_pickle: bool, opt_in: str) -> None:
        self.where = where
        self.allow_pickle = allow_pickle
        self.opt_in = opt_in

    def bad(self, path: tuple, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: the stored value at key path {_path(path)} is invalid: {what}")

    def decode(self, v: Any, path: tuple) -> Any:
        t = type(v)
        if t is list:
            return [self.decode(x, path + (i,)) for i, x in enumerate(v)]
        if t is not dict:
            return v
        if TAG not in v:
            return {k: self.decode(x, path + (k,)) for k, x in v.items()}
        tag = v[TAG]
        method = getattr(self, f"_tag_{tag}", None) if isinstance(tag, str) else None
        if method is None:
            raise CorruptCheckpointError(
                f"{self.where}: the stored value at key path {_path(path)} has the unknown tag {tag!r}; was it written "
                "by a newer shardsafe? Upgrade shardsafe to read it"
            )
        try:
            return method(v, path)
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise self.bad(path, f"{tag!r} value: {type(e).__name__}: {e}") from None

    def _tag_tensor_subclass(self, v: dict, path: tuple) -> Any:
        raise ShardingError(
            f"{self.where}: the stored value at key path {_path(path)} is a {v.get('class')} tensor subclass (its inner "
            "tensors are stored beside it, docs/format.md section 14), not a value: load it into a tensor of its class, or "
            "with dequantize=True into a plain tensor"
        )

    def _items(self, v: dict, path: tuple) -> list:
        items = v["items"]
        if type(items) is not list:
            raise self.bad(path, "'items' is not an array")
        return items

    def _pairs(self, v: dict, path: tuple) -> list[tuple[Any, Any]]:
        out = []
        for pair in self._items(v, path):
            if type(pair) is not list or len(pair) != 2:
                raise self.bad(path, "a dict item is not a [key, value] pair")
            key = self.decode(pair[0], path + ("<key>",))
            out.append((key, self.decode(pair[1], path + (key,))))
        return out

    def _tag_tuple(self, v: dict, path: tuple) -> tuple:
        return tuple(self.decode(x, path + (i,)) for i, x in enumerate(self._items(v, path)))

    def _tag_dict(self, v: dict, path: tuple) -> dict:
        return dict(self._pairs(v, path))

    def _tag_odict(self, v: dict, path: tuple) -> OrderedDict:
        return OrderedDict(self._pairs(v, path))

    def _tag_set(self, v: dict, path: tuple) -> set:
        return {self.decode(x, path + ("<element>",)) for x in self._items(v, path)}

    def _tag_frozenset(self, v: dict, path: tuple) -> frozenset:
        return frozenset(self._tag_set(v, path))

    def _tag_float(self, v: dict, path: tuple) -> float:
        if v["v"] not in ("nan", "inf", "-inf"):
            raise self.bad(path, f"float {v['v']!r} is not 'nan', 'inf' or '-inf'")
        return float(v["v"])

    def _tag_bytes(self, v: dict, path: tuple) -> bytes:
        return base64.b64decode(v["b64"], validate=True)

    def _tag_bytesio(self, v: dict, path: tuple) -> io.BytesIO:
        return io.BytesIO(self._tag_bytes(v, path))

    def _tag_namespace(self, v: dict, path: tuple) -> argparse.Namespace:
        attrs = self.decode(v["v"], path)
        if type(attrs) is not dict or not all(type(k) is str for k in attrs):
            raise self.bad(path, "a namespace's attributes are not a dict with string keys")
        return argparse.Namespace(**attrs)

    def _tag_enum(self, v: dict, path: tuple) -> enum.Enum:
        module, _, qualname = str(v["class"]).partition(":")
        obj: Any = megatron_enum(f"{module}.{qualname}")  # Megatron's own, or a stand-in without megatron-core
        if obj is None:
            obj = sys.modules.get(module)
            if obj is None:
                raise CheckpointError(
                    f"{self.where}: the value at key path {_path(path)} is a member of the enum {module}.{qualname}, and "
                    f"module {module!r} is not imported; import it before loading (a checkpoint never imports modules)"
                )
            for part in qualname.split("."):
                obj = getattr(obj, part, None)
        if not (isinstance(obj, type) and issubclass(obj, enum.Enum)):
            raise self.bad(path, f"{module}.{qualname} is not an enum class in this process")
        try:
            return obj[v["name"]]
        except KeyError:
            raise self.bad(path, f"enum {module}.{qualname} has no member {v['name']!r}") from None

    def _tag_dtype(self, v: dict, path: tuple) -> torch.dtype:
        dtype = getattr(torch, str(v["v"]), None)
        if not isinstance(dtype, torch.dtype):
            raise self.bad(path, f"{v['v']!r} is not a torch dtype")
        return dtype

    def _tag_size(self, v: dict, path: tuple) -> torch.Size:
        return torch.Size(self._ints(self._items(v, path), path))

    def _tag_device(self, v: dict, path: tuple) -> torch.device:
        return torch.device(str(v["v"]))

    def _tag_tensor(self, v: dict, path: tuple) -> torch.Tensor:
        dtype = self._tag_dtype({"v": v["dtype"]}, path)
        shape = self._ints(v["shape"], path)
        raw = self._tag_bytes(v, path)
        n = math.prod(shape)
        if n * dtype.itemsize != len(raw):
            raise self.bad(path, f"a tensor of shape {shape} and dtype {dtype} needs {n * dtype.itemsize} bytes, found {len(raw)}")
        if not n:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)

    def _tag_ndarray(self, v: dict, path: tuple) -> np.ndarray:
        dtype = self._np_dtype(v["dtype"], path)
        shape = self._ints(v["shape"], path)
        raw = self._tag_bytes(v, path)
        if math.prod(shape) * dtype.itemsize != len(raw):
            raise self.bad(path, f"an array of shape {shape} and dtype {dtype} does not hold {len(raw)} bytes")
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()

    def _tag_numpy(self, v: dict, path: tuple) -> np.generic:
        dtype = self._np_dtype(v["dtype"], path)
        raw = self._tag_bytes(v, path)
        if len(raw) != dtype.itemsize:
            raise self.bad(path, f"a numpy {dtype} scalar needs {dtype.itemsize} bytes, found {len(raw)}")
        return np.frombuffer(raw, dtype=dtype)[0]

    def _tag_pickle(self, v: dict, path: tuple) -> Any:
        if not self.allow_pickle:
            raise PickleNotAllowedError(
                f"{self.where}: the value at key path {_path(path)} was stored with pickle; loading it can run arbitrary "
                f"code. Opt in only if you trust this checkpoint: {self.opt_in}"
            )
        return pickle.loads(self._tag_bytes(v, path))

    def _np_dtype(self, name: Any, path: tuple) -> np.dtype:
        dtype = np.dtype(str(name))
        if dtype.hasobject:
            raise self.bad(path, f"numpy dtype {name!r} holds Python objects")
        return dtype

    def _ints(self, xs: Any, path: tuple) -> list[int]:
        if type(xs) is not list or not all(type(x) is int and x >= 0 for x in xs):
            raise self.bad(path, f"shape {xs!r} is not a list of non-negative integers")
        return xs


def is_json_value(v: Any, _depth: int = 0) -> bool:
    """True when ``v`` round-trips through JSON unchanged (no tuples, no NaN, str dict keys) and
    lists and dicts nest at most ``MAX_DEPTH`` deep (what a reader of the metadata accepts)."""
    t = type(v)
    if v is None or t in (bool, int, str):
        return True
    if t is float:
        return math.isfinite(v)
    if t in (list, dict) and _depth == MAX_DEPTH:
        return False
    if t is list:
        return all(is_json_value(x, _depth + 1) for x in v)
    if t is dict:
        return all(type(k) is str and is_json_value(x, _depth + 1) for k, x in v.items())
    return False


def _copy_json(v: Any) -> Any:
    t = type(v)
    if t is list:
        return [_copy_json(x) for x in v]
    if t is dict:
        return {k: _copy_json(x) for k, x in v.items()}
    return v  # None, bool, int, float, str: immutable


def encode_objects(objects: dict[str, Any], *, allow_pickle: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """Split values into JSON ones and (if allowed) pickled ones, base64-encoded: what
    ``Checkpointer`` stores.

    A JSON value is stored exactly as given (a copy), whatever it holds (a dict with the key
    ``TAG`` too: ``shardsafe.lightning`` and ``shardsafe.megatron`` pass values they tagged
    themselves). A value JSON cannot hold is stored as tagged JSON (tuples, ``OrderedDict``,
    NaN and infinities, NumPy scalars, sets, bytes...). A value with a part the tags cannot
    express is pickled whole if ``allow_pickle``; otherwise ``PickleNotAllowedError`` names that
    part by its path (``optim.param_groups[0].betas``), and says to put a tensor in a dict (where
    it is stored as a tensor) rather than to pickle it.
    """
    as_json: dict[str, Any] = {}
    pickled: dict[str, str] = {}
    for key, v in objects.items():
        if is_json_value(v):
            as_json[key] = _copy_json(v)  # a snapshot: the caller may change its lists and dicts once a save returns
            continue
        try:
            as_json[key] = _encode_value(key, v)
        except PickleNotAllowedError:
            if not allow_pickle:
                raise
            pickled[key] = base64.b64encode(pickle.dumps(v)).decode()
    return as_json, pickled


def _element(key: str, path: tuple) -> str:
    """``key`` and the path to an element inside its value: ``.name`` for a string dict key,
    ``[i]`` for a list or tuple index (and any other dict key, by its repr)."""
    parts = [key]
    for p in path:
        parts.append(f".{p}" if type(p) is str else f"[{p}]" if type(p) is int else f"[{p!r}]")
    return "".join(parts)


_TAGGED_KINDS = (
    "None, bool, int, float (NaN and infinities too), str, list, tuple, dict (any keys), OrderedDict, set, bytes, "
    "argparse.Namespace, enums, torch dtypes, devices and Sizes, NumPy scalars and arrays"
)


def _encode_value(key: str, v: Any) -> Any:
    """``v`` as tagged JSON, or ``PickleNotAllowedError`` naming the first part that has no
    tagged form (the caller pickles the whole value instead, when allowed)."""
    encoder = _StateValueEncoder(key)
    try:
        out = encoder.encode(v, ())
    except PickleNotAllowedError:
        raise
    except CheckpointError as e:  # contains itself
        raise PickleNotAllowedError(f"{e}; convert it, or pass allow_pickle=True to store it with pickle") from None
    if nesting_exceeds(out, MAX_DEPTH):
        raise PickleNotAllowedError(
            f"key {key!r}: values may be nested at most {MAX_DEPTH} deep (lists, dicts and tuples, once encoded as "
            "tagged JSON); flatten it, or pass allow_pickle=True to store it with pickle"
        )
    return out


class _StateValueEncoder(_Encoder):
    """The tagged-JSON encoder with ``Checkpointer``'s refusals: no tensor inside a value (a
    tensor belongs in a dict of the state, where it is stored as a tensor, sharded or not), no
    array larger than ``INLINE_BYTES``, and messages that name the element's path."""

    def __init__(self, key: str) -> None:
        super().__init__(f"key {key!r}", False, "")
        self.key = key

    def encode(self, v: Any, path: tuple) -> Any:
        if len(path) > MAX_DEPTH:  # before recursion runs out: the encoded depth is checked afterwards
            raise PickleNotAllowedError(
                f"key {self.key!r}: values may be nested at most {MAX_DEPTH} deep; flatten it, or pass allow_pickle=True "
                "to store it with pickle"
            )
        return super().encode(v, path)

    def _tensor(self, v: Any, path: tuple) -> Any:
        raise PickleNotAllowedError(
            f"{_element(self.key, path)!r} is a {type(v).__module__}.{type(v).__qualname__} inside a list, tuple or "
            "other value, which cannot be stored: a tensor is stored (sharded or not, checksummed, in the data files) when it is a "
            "value of the state dict or of a dict nested in it (nested dicts are stored under dotted keys), and lists "
            "and tuples are stored as JSON. Put the tensors in a dict, keyed by name or by str(index)"
        )

    def _other(self, v: Any, path: tuple) -> Any:
        if isinstance(v, torch.Tensor):
            return self._tensor(v, path)
        t = type(v)
        raise PickleNotAllowedError(
            f"{_element(self.key, path)!r} is a {f'{t.__module__}.{t.__qualname__}'.removeprefix('builtins.')}, which "
            f"has no JSON form (shardsafe stores {_TAGGED_KINDS}). Convert it, or pass allow_pickle=True to store "
            f"{self.key!r} with pickle"
        )

    def _sized(self, path: tuple, nbytes: int, doc: dict) -> Any:
        if nbytes > INLINE_BYTES:
            raise PickleNotAllowedError(
                f"{_element(self.key, path)!r} is a NumPy array of {nbytes} bytes inside a value; at most {INLINE_BYTES} "
                "are stored inline. Store it as a tensor (torch.from_numpy) under a key of its own"
            )
        return doc


def encode_tagged(objects: dict[str, Any], *, allow_pickle: bool, opt_in: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Like :func:`encode_objects`, but a value JSON cannot hold is stored as tagged JSON where
    the tags can express it (a tuple, an ``OrderedDict``, NaN...), not pickled. Only a value with
    a part the tags cannot express is pickled, and only if ``allow_pickle``; otherwise
    ``PickleNotAllowedError`` names the key path of that part and ends with ``opt_in``."""
    as_json: dict[str, Any] = {}
    pickled: dict[str, str] = {}
    for key, v in objects.items():
        if is_json_value(v) and not has_tag(v):
            as_json[key] = _copy_json(v)
            continue
        try:
            as_json[key] = encode_value(v, where=f"key {key!r}", allow_pickle=False, opt_in=opt_in)
        except PickleNotAllowedError:
            if not allow_pickle:
                raise
            pickled[key] = base64.b64encode(pickle.dumps(v)).decode()
        except CheckpointError as e:  # nested too deep, or contains itself
            raise PickleNotAllowedError(f"{e}; {opt_in}") from None
    return as_json, pickled


def has_tag(v: Any) -> bool:
    """True when the JSON value ``v`` holds a tagged object (a dict with the key ``TAG``)."""
    t = type(v)
    if t is list:
        return any(has_tag(x) for x in v)
    if t is dict:
        return TAG in v or any(has_tag(x) for x in v.values())
    return False


def decode_objects(
    as_json: dict[str, Any], pickled: dict[str, str], keys: list[str] | None, *, allow_pickle: bool, where: str,
    opt_in: str = "pass allow_pickle=True",
) -> dict[str, Any]:
    """The stored values for ``keys`` (all when None), tagged values decoded. Unpickles only with
    ``allow_pickle``; ``opt_in`` says how the caller opts in."""
    wanted = list(as_json) + list(pickled) if keys is None else keys
    needs_pickle = [k for k in wanted if k in pickled]
    if needs_pickle and not allow_pickle:
        raise PickleNotAllowedError(
            f"{where}: values {needs_pickle} were stored with pickle; loading them can run arbitrary code. "
            "Pass allow_pickle=True only if you trust this checkpoint"
        )
    out: dict[str, Any] = {}
    for k in wanted:
        if k in as_json:
            v = as_json[k]
            if has_tag(v):
                v = decode_value(v, where=f"{where}: key {k!r}", allow_pickle=allow_pickle, opt_in=opt_in)
            out[k] = v
        elif k in pickled:
            out[k] = pickle.loads(base64.b64decode(pickled[k]))
    return out


def merge_rank_objects(per_rank: list[tuple[dict[str, Any], dict[str, str]]]) -> tuple[dict[str, Any], dict[str, str]]:
    """One set of values from every rank's; a key whose value differs between ranks is an error."""
    merged: tuple[dict[str, Any], dict[str, str]] = ({}, {})
    first_rank: dict[str, int] = {}
    for rank, parts in enumerate(per_rank):
        for values, into in zip(parts, merged):
            for key, v in values.items():
                if key in first_rank and (key not in into or into[key] != v):
                    raise CheckpointError(
                        f"non-tensor value {key!r} differs between rank {first_rank[key]} and rank {rank}; "
                        "store per-rank values under per-rank keys"
                    )
                first_rank.setdefault(key, rank)
                into[key] = v
    return merged


def plain_mappings(value: Any) -> Any:
    """``value`` with every ``Mapping`` that is not a dict or ``OrderedDict`` (Lightning's
    ``AttributeDict`` of hyper-parameters, for one) turned into a plain dict, so that the codec
    can store it."""
    if isinstance(value, Mapping) and type(value) not in (dict, OrderedDict):
        return {k: plain_mappings(v) for k, v in value.items()}
    if type(value) in (dict, OrderedDict):
        return type(value)((k, plain_mappings(v)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(plain_mappings(v) for v in value)
    return value
