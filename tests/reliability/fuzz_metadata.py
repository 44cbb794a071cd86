"""Metadata and header fuzzer: hostile ``metadata.json`` and safetensors headers, and symlinks.

Hypothesis draws mutations of a valid checkpoint (the ``sharded`` and ``single`` cases):

- any JSON value of ``metadata.json`` replaced by a hostile one: huge, negative, ``2**63``,
  float, NaN, string numbers, wrong types, containers, nesting 100000 deep;
- numbers where numbers go (shapes, offsets, byte ranges, flat ranges, versions, checksums);
- bad dtypes; overlapping chunks (a chunk repeated, or moved by one, a flattened range moved);
- format v3 chunk tables: a run's ``first``, ``step`` or ``count`` changed by a little or a
  lot, in any column (file indices, offsets, lengths, flattened starts and stops), a wrong
  ``count``, a tensor's shape changed by one in a dimension, every column one run of a huge
  count (a few bytes of JSON that would decode to billions of chunks);
- the v3 file table: two entries swapped (so chunks name the wrong file), digests or sizes of
  another entry, an entry dropped or repeated, ``size`` or ``header_bytes`` off by a little;
- data file names that leave the directory (``../x``, ``/etc/passwd``, ``a/b``, ...), with the
  file really moved there when it can be;
- a data file or ``metadata.json`` replaced by a symlink to a valid copy outside the directory;
- safetensors headers: length bombs (``2**60``, ``2**64-1``, ...), entries changed, nesting
  100000 deep, a header that is not an object.

Every public read path then runs in the sandbox (:mod:`tests.reliability.sandbox`): the
metadata read, a same-layout load, ``unshard``, ``unshard_to_safetensors`` and ``verify``. The
only acceptable outcomes are ``detected`` (a ``CheckpointError``), ``accepted`` (no error, and
every value the path returned bit-exact) and ``accepted-declared`` (no error, and the values
differ only because the mutation changed what ``metadata.json`` declares: a stored value, a
dtype, the shape of a tensor with no elements (no chunk holds anything to contradict it), or a
whole top-level member such as the set of tensors); anything else is
``silent-wrong-data`` (a load that returned other or fewer values without an error),
``foreign-exception:<type>``, ``memory-bound`` (more than the sandbox's memory), ``hang``,
``worker-crash`` or ``outside-access`` (a path outside the checkpoint, symlinks resolved, was
opened or listed).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Any

import xxhash
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from ..sealing import reseal as _reseal
from .paths import run_path
from .report import Report
from .sandbox import Result, campaign
from .states import Case, build_cases, truth_files

__all__ = ["mutations", "run_fuzz"]

META = "metadata.json"
PATHS = ("metadata", "same", "unshard", "export", "verify")
DEEP = "@@deep@@"

NUMBERS = [-1, 0, 1, 7, -(2**63), 2**31, 2**32 + 1, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 10**30, 10**400,
           1.5, -0.0, 1e308, float("nan"), float("inf")]
STRINGS = ["", "../x", "/etc/passwd", "a/b", "\x00", "1", "1e3", "float33", "torch.float32", "F32", "object",
           "é" * 3, "x" * 100_000]
NAMES = ["../x.safetensors", "/etc/passwd", "a/b.safetensors", "..", ".", "", META, "x\x00.safetensors",
         "C:\\x.safetensors", "~/x.safetensors", "%2e%2e/x.safetensors", " .safetensors", ".hidden.safetensors",
         "shard.safetensors/.", "OUTSIDE"]  # OUTSIDE: ../outside/<the file>, a valid copy out there
DTYPES = ["float33", "", "torch.float32", "F32", "float", "object", "uint1", "complex128", "qint8", "bool ", None, 4]
BOMBS = [2**60, 2**64 - 1, 2**63, 2**32, 100_000_001, 0, 1, 7]
DELTAS = [1, -1, 2, -2, 7, -7, 2**31, -(2**31), 2**62, -(2**62), 2**63]  # added to a table's integer
TABLE_OPS = ["swap", "swap-digests", "drop", "repeat", "reverse", "size", "header_bytes"]


def reseal(raw: bytes) -> bytes:
    """Make mutated ``metadata.json`` bytes pass the format's own integrity check (its
    metadata_checksum, docs/format.md §3.5), so the fuzz reaches the parser behind it."""
    return _reseal(raw)


def _match_files_table(doc: dict[str, Any], directory: str, file: str) -> None:
    """Record a rewritten data file's size, header length and header digest in the metadata's
    file table, as a crafted checkpoint would, so that the header itself (not its digest) is
    what a reader must refuse."""
    entry = next((e for e in doc["file_table"] if e["name"] == file), None)
    if entry is None:
        return
    with open(os.path.join(directory, file), "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    entry["size"] = len(data)
    if 8 + n <= len(data):
        entry["header_bytes"] = 8 + n
        entry["header"] = f"{xxhash.xxh3_64_intdigest(data[: 8 + n]):016x}"


def _columns(table: dict[str, Any]) -> list[tuple]:
    """The paths, inside a v3 chunk table, of its columns of runs."""
    cols: list[tuple] = [("file",)]
    cols += [("offset", d) for d in range(len(table["offset"]))]
    cols += [("length", d) for d in range(len(table["length"]))]
    cols += [("flat", j) for j in range(2)] if "flat" in table else []
    return cols


def _first_values(table: dict[str, Any]) -> list[tuple[tuple, int]]:
    """Each column's path and its first value (chunk 0's)."""
    return [(col, _get(table, col)[0][0]) for col in _columns(table)]


def declares(mutation: tuple, doc: dict[str, Any]) -> bool:
    """Whether ``mutation`` (of ``doc``) changes what the checkpoint declares, rather than how
    it is stored: a stored value, a dtype, the shape of a tensor with no elements, or a whole
    top-level member (the set of tensors, of values...). Then a load may return other values
    than were saved, without an error."""
    kind, args = mutation[1], mutation[2:]
    if kind == "dtype":
        return True
    if kind == "shape":
        return 0 in doc["tensors"][args[0]]["shape"]
    if kind in ("value", "number"):
        path = args[0]
        if len(path) >= 3 and path[0] == "tensors" and path[2] == "shape":
            return 0 in doc["tensors"][path[1]]["shape"]
        return len(path) <= 1 or path[0] in ("objects", "pickled_objects") or path[-1] in ("dtype", "is_sharded")
    return False


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _set(doc: Any, path: tuple, value: Any) -> None:
    _get(doc, path[:-1])[path[-1]] = value


def _split_first(runs: list[list[int]]) -> list[int]:
    """Chunk 0's value alone as the first run of ``runs`` (split off a longer run), to change it."""
    first, step, count = runs[0]
    if count > 1:
        runs[0:1] = [[first, 0, 1], [first + step, step, count - 1]]
    return runs[0]


def _dump(doc: Any, depth: int = 100_000) -> bytes:
    raw = json.dumps(doc, separators=(",", ":"), allow_nan=True)
    return raw.replace(json.dumps(DEEP), "[" * depth + "]" * depth).encode()


def _hostile() -> st.SearchStrategy:
    return st.one_of(
        st.sampled_from(NUMBERS), st.sampled_from(STRINGS), st.none(), st.booleans(), st.just(DEEP),
        st.integers(), st.floats(), st.lists(st.integers(-(2**65), 2**65), max_size=4), st.just({}),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    )


def mutations(docs: list[dict[str, Any]], headers: list[dict[str, Any]]) -> st.SearchStrategy:
    """Mutations of case ``i`` (whose metadata is ``docs[i]`` and data-file headers
    ``headers[i]``: name -> header dict), as plain tuples ``(i, kind, *arguments)``."""

    @st.composite
    def one(draw):
        i = draw(st.integers(0, len(docs) - 1))
        doc, files = docs[i], sorted(headers[i])
        paths = _paths(doc)
        kind = draw(st.sampled_from(["value", "number", "dtype", "overlap", "name", "symlink", "header", "bomb",
                                     "run", "count", "runs-bomb", "shape", "file_table"]))
        if kind == "value":
            return (i, kind, draw(st.sampled_from(paths)), draw(_hostile()))
        if kind == "number":
            ints = [p for p in paths if type(_get(doc, p)) is int]
            return (i, kind, draw(st.sampled_from(ints)), draw(st.sampled_from(NUMBERS) | st.integers()))
        if kind == "dtype":
            return (i, kind, draw(st.sampled_from(sorted(doc["tensors"]))), draw(st.sampled_from(DTYPES)))
        tables = sorted(k for k, t in doc["tensors"].items() if t["table"]["count"])
        if kind == "overlap":
            key = draw(st.sampled_from(tables))
            return (i, kind, key, draw(st.sampled_from(["repeat", "shift", "flat"])), draw(st.integers(-2, 2)))
        if kind == "run":  # one number of one run of one column: first, step or count
            key = draw(st.sampled_from(tables))
            table = doc["tensors"][key]["table"]
            col = draw(st.sampled_from(_columns(table)))
            run = draw(st.integers(0, len(_get(table, col)) - 1))
            return (i, kind, key, col, run, draw(st.integers(0, 2)), draw(st.sampled_from(DELTAS)))
        if kind == "count":
            return (i, kind, draw(st.sampled_from(sorted(doc["tensors"]))), draw(st.sampled_from(DELTAS)))
        if kind == "runs-bomb":
            return (i, kind, draw(st.sampled_from(tables)), draw(st.sampled_from([2**20, 2**36, 2**61])))
        if kind == "shape":
            key = draw(st.sampled_from(sorted(k for k, t in doc["tensors"].items() if t["shape"])))
            dim = draw(st.integers(0, len(doc["tensors"][key]["shape"]) - 1))
            return (i, kind, key, dim, draw(st.sampled_from([1, -1, 2, -2])))
        if kind == "file_table":
            return (i, kind, draw(st.sampled_from(TABLE_OPS)), draw(st.integers(0, len(doc["file_table"]) - 1)),
                    draw(st.sampled_from([1, -1, 8, -8, 2**40])))
        if kind == "name":
            return (i, kind, draw(st.sampled_from(files)), draw(st.sampled_from(NAMES)))
        if kind == "symlink":
            return (i, kind, draw(st.sampled_from([META, *files])))
        if kind == "header":
            file = draw(st.sampled_from(files))
            hp = _paths(headers[i][file])
            return (i, kind, file, draw(st.sampled_from(hp)), draw(_hostile()))
        file = draw(st.sampled_from(files))
        return (i, kind, file, draw(st.sampled_from(BOMBS + ["deep", "list", "null"])))

    return one()


def _read_header(path: str) -> tuple[int, dict[str, Any]]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


def _write_header(path: str, n: int, body: bytes) -> None:
    """Replace the header by ``body``: padded in place when it fits, else the data moves."""
    with open(path, "rb") as f:
        data = f.read()[8 + n :]
    if len(body) <= n:
        body += b" " * (n - len(body))
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + data)


def apply(mutation: tuple, doc: dict[str, Any], directory: str, outside: str) -> None:
    """Apply ``mutation`` to the copy at ``directory``; ``outside`` is a folder beside it."""
    _, kind, *args = mutation
    doc = json.loads(json.dumps(doc))
    meta_path = os.path.join(directory, META)
    if kind in ("value", "number"):
        _set(doc, args[0], args[1])
    elif kind == "dtype":
        doc["tensors"][args[0]]["dtype"] = args[1]
    elif kind == "overlap":  # chunk 0 stored twice, moved in dimension 0, or its flattened range moved
        key, how, delta = args
        table = doc["tensors"][key]["table"]
        if how == "repeat":
            for col, value in _first_values(table):
                _get(table, col).append([value, 0, 1])
            table["count"] += 1
        elif how == "shift" and table["offset"]:
            _split_first(table["offset"][0])[0] += delta or 1
        elif "flat" in table:
            _split_first(table["flat"][0])[0] += delta
            _split_first(table["flat"][1])[0] += delta
        else:
            n = table["count"]
            table["flat"] = [[[max(delta, 0), 0, n]], [[max(delta, 0) + 1, 0, n]]]
    elif kind == "run":
        key, col, run, field, delta = args
        _get(doc["tensors"][key]["table"], col)[run][field] += delta
    elif kind == "count":
        key, delta = args
        doc["tensors"][key]["table"]["count"] += delta
    elif kind == "runs-bomb":
        key, count = args
        table = doc["tensors"][key]["table"]
        for col, value in _first_values(table):
            _get(table, col)[:] = [[value, 0, count]]
        table["count"] = count
    elif kind == "shape":
        key, dim, delta = args
        doc["tensors"][key]["shape"][dim] += delta
    elif kind == "file_table":
        op, at, delta = args
        ft = doc["file_table"]
        other = (at + 1) % len(ft)
        if op == "swap":
            ft[at], ft[other] = ft[other], ft[at]
        elif op == "swap-digests":
            for f in ("header", "sums"):
                ft[at][f], ft[other][f] = ft[other][f], ft[at][f]
        elif op == "drop":
            del ft[at]
        elif op == "repeat":
            ft.append(dict(ft[at]))
        elif op == "reverse":
            ft.reverse()
        else:
            ft[at][op] += delta
    elif kind == "name":
        file, name = args
        if name == "OUTSIDE":
            shutil.copy(os.path.join(directory, file), os.path.join(outside, file))
            name = f"../{os.path.basename(outside)}/{file}"
        for entry in doc["file_table"]:
            if entry["name"] == file:
                entry["name"] = name
        target = os.path.normpath(os.path.join(directory, name)) if name and "\x00" not in name else ""
        if target.startswith(directory + os.sep) and not os.path.exists(target):  # move the file where it now says
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(os.path.join(directory, file), target)
    elif kind == "symlink":
        (file,) = args
        shutil.copy(os.path.join(directory, file), os.path.join(outside, file))
        os.unlink(os.path.join(directory, file))
        os.symlink(os.path.join(outside, file), os.path.join(directory, file))
        return
    elif kind == "header":
        file, path, value = args
        n, header = _read_header(os.path.join(directory, file))
        _set(header, path, value)
        _write_header(os.path.join(directory, file), n, _dump(header))
        _match_files_table(doc, directory, file)
    elif kind == "bomb":
        file, what = args
        full = os.path.join(directory, file)
        n, _ = _read_header(full)
        if isinstance(what, int):
            with open(full, "r+b") as f:
                f.write(struct.pack("<Q", what))
        else:
            _write_header(full, n, {"deep": _dump(DEEP), "list": b"[]", "null": b"null"}[what])
        _match_files_table(doc, directory, file)
    with open(meta_path, "wb") as f:
        f.write(reseal(_dump(doc)))


def outcome(res: Result, mutation: tuple, doc: dict[str, Any]) -> str:
    abnormal = res.abnormal()
    if abnormal is not None:
        return abnormal
    if res.kind == "raised":
        return res.bounded_error()
    if res.value:  # the path returned values that differ from those saved
        return "accepted-declared" if declares(mutation, doc) else "silent-wrong-data"
    return "accepted"


def _short(mutation: tuple) -> str:
    text = repr(mutation)
    return text if len(text) < 300 else text[:150] + " ... " + text[-100:]


def run_fuzz(trials: int, seed_: int, *, workdir: str | None = None, timeout: float = 10.0) -> Report:
    """Run ``trials`` hypothesis examples; see the module docstring."""
    with campaign("fuzz", workdir, timeout=timeout) as (report, root, box):
        cases = [c for c in build_cases(os.path.join(root, "saved")) if c.kind in ("sharded", "single")]
        docs, headers = [], []
        for c in cases:
            with open(os.path.join(c.dir, META)) as f:
                docs.append(json.load(f))
            headers.append({n: _read_header(os.path.join(c.dir, n))[1] for n in os.listdir(c.dir) if n != META})
        out = os.path.join(root, "out")
        os.makedirs(out)
        counter = [0]

        @seed(seed_)
        @settings(max_examples=trials, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(mutation=mutations(docs, headers))
        def trial(mutation: tuple) -> None:
            case: Case = cases[mutation[0]]
            counter[0] += 1
            base = os.path.join(root, f"t{counter[0]}")
            directory, outside = os.path.join(base, "ckpt"), os.path.join(base, "outside")
            shutil.copytree(case.dir, directory)
            os.makedirs(outside)
            apply(mutation, docs[mutation[0]], directory, outside)
            for path in PATHS:
                res = box.call(run_path, case, path, out, directory, roots=[directory, out, *truth_files(case)])
                got = outcome(res, mutation, docs[mutation[0]])
                why = ", ".join(res.outside) if res.outside else f"{res.error_type}: {(res.message or res.value or '')[:300]}"
                report.add(got, f"{_short(mutation)} -> {why}", path=f"{mutation[1]}/{path}")
            report.trials += 1
            shutil.rmtree(base, ignore_errors=True)

        trial()
    return report
