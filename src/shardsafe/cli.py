"""The ``shardsafe`` command line: look at, check, compare, export and convert checkpoints from a shell.

Thin over the library. Exit status: 0 when all is well, 1 when ``verify`` finds damage or
``diff`` finds differences, 2 on an error (the message is printed, no traceback: ``--debug``
for one). ``--json`` prints one JSON document on stdout; ``--quiet`` prints nothing but errors.
Progress bars (tqdm) go to stderr, only when it is a terminal.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main"]

EXIT_OK, EXIT_FOUND, EXIT_ERROR = 0, 1, 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a tool stopped by a closed pipe

_DTYPES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "f16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "f32": "float32", "float32": "float32", "float": "float32", "fp64": "float64", "float64": "float64",
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5_000_000_000 (KB, MB, GB, TB are powers of 10 as in ``transformers``; KiB,
    MiB, GiB, TiB powers of 2; a bare number is bytes)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (examples: 5GB, 500MB, 2GiB, 1000000)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be positive")
    return n


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"  # not reached


class _Out:
    """Where a command's results go: text lines, or one JSON document, or nothing."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.json, self.quiet = args.json, args.quiet

    def line(self, text: str = "") -> None:
        if not self.json and not self.quiet:
            print(text)

    def doc(self, value: Any) -> None:
        if self.json:
            print(json.dumps(value, indent=2, sort_keys=False))

    def progress(self, what: str) -> Callable[[int, int], None] | None:
        """A progress callback drawing a bar on stderr, or None when stderr is not a terminal."""
        if self.quiet or self.json or not sys.stderr.isatty():
            return None
        from ._progress import tqdm_bar

        return tqdm_bar(what)


def _table(rows: list[list[str]], head: list[str]) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(head), *(fmt(r) for r in rows)]


def _meta(location: str):
    from .checkpointer import Checkpointer

    return Checkpointer().get_metadata(location, no_dist=True)


def _tensor_bytes(t) -> int:
    return math.prod(t.shape) * t.torch_dtype.itemsize


# ---------------------------------------------------------------- inspect


def cmd_inspect(args: argparse.Namespace, out: _Out) -> int:
    from .adapters.subclasses import is_record

    meta = _meta(args.dir)
    tensors = {
        key: {
            "shape": list(t.shape),
            "dtype": t.dtype,
            "bytes": _tensor_bytes(t),
            "chunks": t.chunk_count(),
            "sharded": t.is_sharded,
        }
        for key, t in sorted(meta.tensors.items())
    }
    sizes = meta.file_sizes()
    files = dict(sorted(sizes.items())) if sizes is not None else {f: None for f in sorted(meta.data_files())}
    total = sum(sizes.values()) if sizes is not None else sum(t["bytes"] for t in tensors.values())
    doc = {
        "location": args.dir,
        "format_version": meta.format_version,
        "total_bytes": total,
        "files": files,
        "tensors": tensors,
        "values": dict(sorted(meta.objects.items())),
        "pickled_values": sorted(meta.pickled_objects),
    }
    out.doc(doc)
    out.line(f"checkpoint      {args.dir}")
    out.line(f"format version  {meta.format_version}")
    out.line(f"size            {_human(total)} ({total} bytes) in {len(files)} data file(s)")
    out.line(f"tensors         {len(tensors)} ({_human(sum(t['bytes'] for t in tensors.values()))})")
    records = {k: str(v.get("class")) for k, v in meta.objects.items() if is_record(v)}
    out.line(f"values          {len(meta.objects) - len(records)} JSON, {len(meta.pickled_objects)} pickled")
    if records:  # their inner tensors are among the tensors, under <key>#<inner name>
        kinds = sorted({c.rpartition(".")[2] for c in records.values()})
        out.line(f"subclasses      {len(records)} tensor subclass(es): {', '.join(kinds)} (inner tensors under <key>#<name>)")
    if files:
        out.line()
        rows = [[f, "-" if n is None else str(n), "(not recorded)" if n is None else _human(n)] for f, n in files.items()]
        for ln in _table(rows, ["file", "bytes", "size"]):
            out.line(ln)
    if tensors:
        out.line()
        rows = [
            [k, str(t["shape"]), t["dtype"], str(t["bytes"]), str(t["chunks"]), "yes" if t["sharded"] else "no"]
            for k, t in tensors.items()
        ]
        for ln in _table(rows, ["key", "shape", "dtype", "bytes", "chunks", "sharded"]):
            out.line(ln)
    if meta.objects or meta.pickled_objects:
        out.line()
        rows = [[k, f"tensor subclass {v.get('class')} {v.get('shape')}" if is_record(v) else _brief(v)] for k, v in sorted(meta.objects.items())]
        rows += [[k, "<pickled>"] for k in sorted(meta.pickled_objects)]
        for ln in _table(rows, ["value", "content"]):
            out.line(ln)
    return EXIT_OK


def _brief(v: Any, width: int = 60) -> str:
    text = v if v == "(absent)" else json.dumps(v, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 3] + "..."


# ---------------------------------------------------------------- verify


def cmd_verify(args: argparse.Namespace, out: _Out) -> int:
    from .errors import CorruptCheckpointError
    from .verify import VerifyReport, verify_report

    try:
        report = verify_report(args.dir, stop_at_first=not args.all, threads=args.threads, progress=out.progress("verify"))
    except CorruptCheckpointError as e:  # metadata.json itself is damaged: damage found, nothing else checkable
        report = VerifyReport(errors=[str(e)])
    out.doc({"location": args.dir, "ok": report.ok, "files": report.files, "chunks": report.chunks, "bytes": report.bytes, "errors": report.errors})
    for e in report.errors:
        out.line(f"BAD  {e}")
    if report.ok:
        status = "OK"
    elif args.all:
        status = f"FAILED: {len(report.errors)} problem(s)"
    else:
        status = "FAILED: stopped at the first problem (--all lists every one)"
    out.line(f"{status}: {report.files} file(s), {report.chunks} chunk(s), {report.bytes} bytes checked")
    return EXIT_OK if report.ok else EXIT_FOUND


# ---------------------------------------------------------------- diff


def cmd_diff(args: argparse.Namespace, out: _Out) -> int:
    a, b = _meta(args.a), _meta(args.b)
    only_a = sorted(set(a.tensors) - set(b.tensors))
    only_b = sorted(set(b.tensors) - set(a.tensors))
    common = sorted(set(a.tensors) & set(b.tensors))
    shape = {k: [list(a.tensors[k].shape), list(b.tensors[k].shape)] for k in common if a.tensors[k].shape != b.tensors[k].shape}
    dtype = {k: [a.tensors[k].dtype, b.tensors[k].dtype] for k in common if a.tensors[k].dtype != b.tensors[k].dtype}
    va, vb = {**a.objects, **a.pickled_objects}, {**b.objects, **b.pickled_objects}
    values = {
        k: [va.get(k), vb.get(k)]
        for k in sorted(set(va) | set(vb))
        if k not in va or k not in vb or va[k] != vb[k] or (k in a.pickled_objects) != (k in b.pickled_objects)
    }
    changed, incomparable = _digest_changes(a, b, [k for k in common if k not in shape and k not in dtype])
    maxdiff: dict[str, float | None] = {}
    if args.values:
        maxdiff = _max_diffs(args.a, args.b, a, b, [k for k in common if k not in shape], out.progress("diff"))
    over = {k: d for k, d in maxdiff.items() if d is None or d > args.atol}
    # stored digests decide without --values; with it, the values within atol do
    differs = bool(only_a or only_b or shape or dtype or values or over or (changed and not args.values))
    out.doc({
        "a": args.a, "b": args.b, "same": not differs, "only_in_a": only_a, "only_in_b": only_b,
        "shape_changed": shape, "dtype_changed": dtype, "values_changed": values,
        "contents_changed": changed, "layout_differs": incomparable,
        "max_abs_diff": maxdiff if args.values else None, "atol": args.atol,
    })
    for k in only_a:
        out.line(f"only in A      {k}  {list(a.tensors[k].shape)} {a.tensors[k].dtype}")
    for k in only_b:
        out.line(f"only in B      {k}  {list(b.tensors[k].shape)} {b.tensors[k].dtype}")
    for k, (x, y) in shape.items():
        out.line(f"shape          {k}  {x} -> {y}")
    for k, (x, y) in dtype.items():
        out.line(f"dtype          {k}  {x} -> {y}")
    for k in changed:
        out.line(f"contents       {k}  stored digests differ")
    for k in incomparable:
        out.line(f"layout         {k}  stored in other chunks or blocks: digests cannot be compared" + ("" if args.values else " (--values compares the data)"))
    for k, (x, y) in values.items():
        if k not in va or k not in vb or (k in a.pickled_objects) != (k in b.pickled_objects):
            fx = "(absent)" if k not in va else _brief(x)
            fy = "(absent)" if k not in vb else _brief(y)
            out.line(f"value          {k}  {fx} -> {fy}")
            continue
        for path, lx, ly in _leaf_diffs(x, y):
            out.line(f"value          {k}  {path + ': ' if path else ''}{_brief(lx)} -> {_brief(ly)}")
    for k, d in maxdiff.items():
        if k in over:
            out.line(f"max |A-B|      {k}  {'NaN on one side' if d is None else f'{d:.6g}'}")
    if differs:
        out.line(f"A and B differ ({len(common)} common tensors" + (f", values compared with atol {args.atol:g})" if args.values else ")"))
    elif args.values:
        out.line(f"no differences in keys, shapes, dtypes and values ({len(common)} tensors; tensor values equal within atol {args.atol:g})")
    else:
        tail = f"; {len(incomparable)} stored in other layouts not compared: pass --values" if incomparable else ""
        out.line(f"no differences in keys, shapes, dtypes, values and stored digests ({len(common)} tensors{tail})")
    return EXIT_FOUND if differs else EXIT_OK


def _digest_changes(a, b, keys: list[str]) -> tuple[list[str], list[str]]:
    """The keys whose stored per-block digests differ between ``a`` and ``b`` (contents changed,
    found without reading any tensor data), and those stored in other chunks, blocks or digest
    algorithms, whose digests cannot be compared."""
    changed, incomparable = [], []
    for k in keys:
        layout_a, sums_a = _stored_digests(a.tensors[k])
        layout_b, sums_b = _stored_digests(b.tensors[k])
        if layout_a != layout_b:
            incomparable.append(k)
        elif sums_a != sums_b:
            changed.append(k)
    return changed, incomparable


def _stored_digests(tm) -> tuple[list, list]:
    """(layout, digests) of a stored tensor: per chunk, in the order of its place in the tensor,
    (offset, shape, flattened range, algorithm, block bytes) and the block digests."""
    rows = []
    for file, spec in tm.chunks():
        sums = tm.chunk_sums(file, spec)
        rows.append(((tuple(spec.global_offset), tuple(spec.local_shape), spec.flattened_range, sums.algorithm, sums.block_bytes), sums.digests))
    rows.sort(key=lambda r: (r[0][0], r[0][1], r[0][2] or (-1, -1)))
    return [r[0] for r in rows], [r[1] for r in rows]


_ABSENT = object()


def _leaf_diffs(x: Any, y: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """Where two JSON values differ: ``(path, a, b)`` per differing leaf, the path as ``state.pos``
    or ``param_groups[0].lr`` ("" for the values themselves); a key or item on one side only is
    shown as ``(absent)`` on the other."""
    if isinstance(x, dict) and isinstance(y, dict):
        out = []
        for k in sorted(set(x) | set(y), key=str):
            sub = f"{path}.{k}" if path else str(k)
            out += _leaf_diffs(x.get(k, _ABSENT), y.get(k, _ABSENT), sub)
        return out
    if isinstance(x, list) and isinstance(y, list):
        out = []
        for i in range(max(len(x), len(y))):
            out += _leaf_diffs(x[i] if i < len(x) else _ABSENT, y[i] if i < len(y) else _ABSENT, f"{path}[{i}]")
        return out
    if x is _ABSENT or y is _ABSENT or type(x) is not type(y) or x != y:
        return [(path, "(absent)" if x is _ABSENT else x, "(absent)" if y is _ABSENT else y)]
    return []


def _max_diffs(loc_a: str, loc_b: str, a, b, keys: list[str], progress) -> dict[str, float | None]:
    """Per key, max |A - B| (in float64), one tensor of each at a time; None where an element
    is NaN on one side only."""
    import torch

    from .adapters import describe_state
    from .engine.reader import Reader
    from .knobs import KNOBS
    from .storage import open_storage

    total = sum(_tensor_bytes(a.tensors[k]) + _tensor_bytes(b.tensors[k]) for k in keys)
    done = 0
    out: dict[str, float | None] = {}
    with Reader(open_storage(loc_a), KNOBS) as ra, Reader(open_storage(loc_b), KNOBS) as rb:
        for k in keys:
            pair = []
            for reader, meta in ((ra, a), (rb, b)):
                tm = meta.tensors[k]
                full = torch.empty(tm.shape, dtype=tm.torch_dtype)
                (target,), _ = describe_state({k: full})
                reader.load_tensor(tm, target)
                pair.append(full)
            x, y = pair
            wide = torch.complex128 if x.is_complex() or y.is_complex() else torch.float64
            xw, yw = x.to(wide), y.to(wide)
            d = (xw - yw).abs().masked_fill(xw.isnan() & yw.isnan(), 0.0)  # NaN on both sides is equal
            m = float(d.max()) if d.numel() else 0.0
            out[k] = None if math.isnan(m) else m  # None: NaN on one side only
            del x, y, xw, yw, d, pair
            done += _tensor_bytes(a.tensors[k]) + _tensor_bytes(b.tensors[k])
            if progress is not None:
                progress(done, total)
    return out


# ---------------------------------------------------------------- export


MODEL_PREFIX = "model."  # what save_model_and_optim_state and the integrations store the model under


def cmd_export(args: argparse.Namespace, out: _Out) -> int:
    import warnings

    import torch

    from .api import unshard_to_safetensors

    if args.config is not None and args.max_shard_size is None:
        raise _usage_error("--config writes config.json into a folder: pass --max-shard-size as well (5GB is transformers' default)")
    prefix, left_out = args.prefix, {}
    if prefix is None:  # the model's keys when there are any (a model/optimizer checkpoint), else everything
        meta = _meta(args.dir)
        if any(k.startswith(MODEL_PREFIX) for k in meta.tensors):
            prefix = MODEL_PREFIX
            left_out = _left_out(meta, prefix)
    elif prefix == "":
        prefix = None  # --prefix '': every key, as stored
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        counts = unshard_to_safetensors(
            args.dir, args.out, prefix=prefix, overwrite=args.overwrite, max_shard_size=args.max_shard_size, dtype=dtype,
            progress=out.progress("export"), config=args.config, dequantize=args.dequantize,
        )
    for w in caught:  # the folder has no config.json: said on stderr, in the command's words
        if "no config.json" in str(w.message):
            text = (f"{args.out} holds the weights only, no config.json: transformers' from_pretrained needs it (without it, "
                    "it builds a default model of its own); pass --config PATH (the model's config.json), or copy it into the folder")
        else:
            text = str(w.message)
        if not out.quiet:
            print(f"shardsafe export: warning: {text}", file=sys.stderr)
    files = counts.get("files", 1)  # one file unless exported to a folder
    out.doc({"dir": args.dir, "out": args.out, "files": files, **counts, "config": counts.get("config", 0), "prefix": prefix, "left_out": left_out})
    out.line(
        f"exported {counts['tensors']} tensors ({_human(counts['bytes'])}) to {args.out}"
        + (f" in {files} files + index" if files > 1 else "")
        + (" and config.json" if counts.get("config") else "")
        + (f"; {counts['skipped_values']} pickled value(s) left out" if counts["skipped_values"] else "")
    )
    if left_out:
        what = ", ".join(f"{n} under {p}" if p.endswith(".") else p for p, n in left_out.items())
        out.line(f"the model's keys ({prefix}*, written without {prefix!r}); left out: {what} (--prefix '' exports every key)")
    return EXIT_OK


def _left_out(meta, prefix: str) -> dict[str, int]:
    """Keys not under ``prefix``, counted by their first part (``optim.``: 12)."""
    counts: dict[str, int] = {}
    for key in [*meta.tensors, *meta.objects, *meta.pickled_objects]:
        if not key.startswith(prefix):
            head = key.split(".", 1)[0] + ("." if "." in key else "")
            counts[head] = counts.get(head, 0) + 1
    return dict(sorted(counts.items()))


# ---------------------------------------------------------------- consolidate


def cmd_consolidate(args: argparse.Namespace, out: _Out) -> int:
    from .lightning import consolidate

    counts = consolidate(args.dir, args.out, overwrite=args.overwrite, allow_pickle=args.allow_pickle, progress=out.progress("consolidate"))
    out.doc({"dir": args.dir, "out": args.out, **counts})
    out.line(f"consolidated {counts['tensors']} tensors ({_human(counts['bytes'])}) from {args.dir} into {args.out} ({_human(counts['file_bytes'])})")
    return EXIT_OK


# ---------------------------------------------------------------- convert


def cmd_convert(args: argparse.Namespace, out: _Out) -> int:
    from .convert import convert_hf, convert_torch
    from .engine.foreign import source_format

    progress = out.progress("convert")
    detected = args.source is None
    if detected:
        args.source = source_format(args.src)
    if args.source == "dcp":
        from .dcp import convert

        meta = convert(args.src, args.dst, overwrite=args.overwrite, allow_pickle=args.allow_pickle, progress=progress or False)
        counts = {"tensors": len(meta.tensors), "values": len(meta.objects) + len(meta.pickled_objects)}
    elif args.source == "megatron":
        from .megatron.convert import convert_megatron

        meta = convert_megatron(args.src, args.dst, overwrite=args.overwrite, allow_pickle=args.allow_pickle, progress=progress or False)
        counts = {"tensors": len(meta.tensors), "values": len(meta.objects) + len(meta.pickled_objects)}
    elif args.source == "torch":
        counts = convert_torch(args.src, args.dst, overwrite=args.overwrite, allow_pickle=args.allow_pickle, progress=progress)
    else:
        counts = convert_hf(args.src, args.dst, overwrite=args.overwrite, progress=progress)
    out.doc({"src": args.src, "dst": args.dst, "from": args.source, "detected": detected, **counts})
    how = " (detected; --from overrides)" if detected else ""
    out.line(f"converted {counts['tensors']} tensors and {counts['values']} values from {args.source}{how} {args.src} to {args.dst}")
    return EXIT_OK


# ---------------------------------------------------------------- main


# what each command's --json prints (its --help epilog): one object with these keys, in this order
JSON_SCHEMAS = {
    "inspect": "location, format_version, total_bytes, files ({name: bytes}; bytes null where format v1 records none), "
    "tensors ({key: {shape, dtype, bytes, chunks, sharded}}), values ({key: JSON value}), pickled_values ([key])",
    "verify": "location, ok, files, chunks, bytes (checked, bad chunks included), errors ([message]; without --all at most one)",
    "diff": "a, b, same, only_in_a ([key]), only_in_b ([key]), shape_changed ({key: [shape in A, shape in B]}), "
    "dtype_changed ({key: [A, B]}), values_changed ({key: [A, B]}; non-tensor values), contents_changed ([key]; the "
    "stored per-block digests differ), layout_differs ([key]; stored in other chunks or blocks: digests not comparable), max_abs_diff ({key: number, or null "
    "where an element is NaN on one side only}; null without --values), atol",
    "export": "dir, out, files (data files written), tensors, bytes (tensor data), file_bytes (all files written), values "
    "(JSON values written to __metadata__), skipped_values (pickled values left out), config (with --max-shard-size: 1 if "
    "config.json was written), prefix (the prefix used; null: every key), left_out ({first part of a key: keys not exported} "
    "when the prefix was chosen for you)",
    "convert": "src, dst, from, detected (whether the format was detected rather than given with --from), tensors, values",
    "consolidate": "dir, out, tensors, bytes (tensor data), file_bytes (the file written)",
}


def _epilog(command: str) -> str:
    return f"--json prints one object: {JSON_SCHEMAS[command]}."


def _parser() -> argparse.ArgumentParser:
    def options(default: bool | str) -> argparse.ArgumentParser:
        # before or after the command; a subcommand's parser must not reset what was given before it
        parser = _Parser(add_help=False)
        parser.add_argument("--json", action="store_true", default=default, help="print one JSON document on stdout")
        parser.add_argument("--quiet", "-q", action="store_true", default=default, help="print nothing but errors (the exit status tells)")
        parser.add_argument("--debug", action="store_true", default=default, help="print a traceback on error (the exit status stays 2), and debug logging")
        return parser

    common = options(argparse.SUPPRESS)
    p = _Parser(
        prog="shardsafe",
        description="Inspect, verify, compare, export, consolidate and convert shardsafe checkpoints. Exit status: 0 ok, "
        "1 damage (verify) or differences (diff) found, 2 error.",
        parents=[options(False)],
    )
    from . import __version__

    p.add_argument("--version", action="version", version=f"shardsafe {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("inspect", parents=[common], epilog=_epilog("inspect"), help="what a checkpoint holds", description="Format version, size, files, "
                       "every tensor (key, global shape, dtype, bytes, chunks, sharded) and every non-tensor value.")
    s.add_argument("dir", help="checkpoint directory or URL")
    s.set_defaults(run=cmd_inspect)

    s = sub.add_parser("verify", parents=[common], epilog=_epilog("verify"), help="read every byte and check every checksum",
                       description="Read every chunk and check it against its checksums. Exit 0 when all is well, 1 on damage "
                       "(a BAD line per problem, naming the file and key; without --all it stops at the first), 2 on an error.")
    s.add_argument("dir", help="checkpoint directory or URL")
    s.add_argument("--all", action="store_true", help="list every bad chunk instead of stopping at the first")
    s.add_argument("--threads", type=_positive, default=1, metavar="N", help="data files checked at once (default 1)")
    s.set_defaults(run=cmd_verify)

    s = sub.add_parser("diff", parents=[common], epilog=_epilog("diff"), help="compare two checkpoints",
                       description="Keys only in A or B, shape and dtype changes, changed non-tensor values, tensors whose "
                       "stored per-block digests differ (no tensor data read; tensors stored in other layouts are named, their "
                       "digests cannot be compared); with --values the max abs difference of every common tensor, read one tensor at a time. Exit 1 when they differ.")
    s.add_argument("a", help="checkpoint A")
    s.add_argument("b", help="checkpoint B")
    s.add_argument("--values", action="store_true", help="compare tensor contents too")
    s.add_argument("--atol", type=float, default=0.0, metavar="X", help="with --values: differences up to X are equal (default 0)")
    s.set_defaults(run=cmd_diff)

    s = sub.add_parser("export", parents=[common], epilog=_epilog("export"), help="to safetensors (one file, or a Hugging Face sharded folder)",
                       description="Unshard into one safetensors file OUT, or with --max-shard-size into the folder OUT as "
                       "save_pretrained writes one (model.safetensors, or model-0000i-of-0000N.safetensors + "
                       "model.safetensors.index.json). Streamed; every chunk checked.")
    s.add_argument("dir", help="checkpoint directory or URL")
    s.add_argument("out", help="output file (or folder with --max-shard-size); a path or URL")
    s.add_argument("--prefix", help="only keys starting with it, written without it (default: model. when the checkpoint holds "
                   "model keys, else every key; '' for every key)")
    s.add_argument("--max-shard-size", type=parse_size, metavar="SIZE", help="write a sharded folder, files of at most SIZE (5GB, 500MB, 2GiB)")
    s.add_argument("--dtype", choices=sorted(_DTYPES), help="cast floating-point tensors to this dtype")
    s.add_argument("--config", metavar="PATH", help="with --max-shard-size: the model's config.json (or a folder holding one), "
                   "copied into OUT so that transformers' from_pretrained(OUT) builds the model")
    s.add_argument("--dequantize", action="store_true", help="write quantized tensor subclasses (an NF4 base weight, 8-bit "
                   "optimizer state) as their high-precision tensors; without it they are refused")
    s.add_argument("--overwrite", action="store_true", help="replace an existing output")
    s.set_defaults(run=cmd_export)

    s = sub.add_parser("consolidate", parents=[common], epilog=_epilog("consolidate"), help="to one torch.save file, as Lightning's consolidate_checkpoint",
                       description="Write the single-file checkpoint Lightning users load with torch.load(OUT)[\"state_dict\"] "
                       "(state_dict, optimizer_states and the rest of the checkpoint dict), from a checkpoint of "
                       "shardsafe.lightning or save_model_and_optim_state, or a folder Lightning's own sharded save wrote. "
                       "Replaces python -m lightning.pytorch.utilities.consolidate_checkpoint. A shardsafe checkpoint is streamed "
                       "one tensor at a time (memory: about the largest tensor), every chunk checked; OUT appears atomically.")
    s.add_argument("dir", help="checkpoint directory or URL")
    s.add_argument("out", help="the file to write (a path or URL)")
    s.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    s.add_argument("--allow-pickle", action="store_true", help="read values stored with pickle (trusted checkpoints only)")
    s.set_defaults(run=cmd_consolidate)

    s = sub.add_parser("convert", parents=[common], epilog=_epilog("convert"), help="into a shardsafe checkpoint",
                       description="Convert a torch.distributed.checkpoint folder (dcp), a megatron-core torch_dist or zarr checkpoint "
                       "(megatron), a torch.save file (torch, read with weights_only=True) or a Hugging Face safetensors "
                       "file or folder (hf) into a shardsafe checkpoint. The kind of SRC is detected; --from overrides.")
    s.add_argument("src", help="what to convert")
    s.add_argument("dst", help="the new checkpoint's directory or URL")
    s.add_argument("--from", dest="source", choices=["dcp", "megatron", "torch", "hf"],
                   help="the kind of SRC (default: detected as inspect does; give it to override)")
    s.add_argument("--overwrite", action="store_true", help="replace a checkpoint committed at DST")
    s.add_argument("--allow-pickle", action="store_true", help="store values JSON cannot hold with pickle (trusted sources only)")
    s.set_defaults(run=cmd_convert)
    return p


# the library's advice names its arguments; on the command line the same advice names the flag
_FLAG_WORDS = [
    (re.compile(r"\b(?:save_)?overwrite=True(?: to (?:the )?shardsafe\.[\w.]+(?: strategy)?)?"), "overwrite", "--overwrite"),
    (re.compile(r"\ballow_pickle=True(?: to (?:the )?shardsafe\.[\w.]+(?: strategy)?(?: \([^)]*\))?)?"), "allow_pickle", "--allow-pickle"),
]


def _flag_words(message: str, args: argparse.Namespace | None = None) -> str:
    """``message`` with each Python argument it advises replaced by the command's flag (where the
    command has that flag)."""
    for pattern, dest, flag in _FLAG_WORDS:
        if args is None or hasattr(args, dest):
            message = pattern.sub(flag, message)
    return message


def _usage_error(message: str) -> Exception:
    from .errors import CheckpointError

    return CheckpointError(message)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return n


class _UsageError(Exception):
    """Bad arguments (argparse's error), raised instead of exiting so that ``--json`` reports it."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(f"{self.prog}: {message}")


# the arguments naming locations, in the order an error's "path" is looked for
_PATH_ARGS = ("dir", "src", "a", "b", "out", "dst")


def _error_path(args: argparse.Namespace | None, message: str) -> str | None:
    """The location an error is about: the command's location argument its message names (the
    first, if it names none), or None for a command without one."""
    given = [getattr(args, n) for n in _PATH_ARGS if isinstance(getattr(args, n, None), str)]
    for path in given:
        if path and (path in message or os.path.abspath(path) in message):
            return path
    return given[0] if given else None


def _report_error(args: argparse.Namespace | None, command: str, e: BaseException, *, as_json: bool) -> None:
    """One error: a line on stderr, and with ``--json`` one object on stdout (``{"error": {type,
    message, path}}``), whatever the command."""
    from .errors import CheckpointError

    known = isinstance(e, (CheckpointError, _UsageError))
    text = _flag_words(str(e), args) if known else f"{type(e).__name__}: {e}"
    if as_json:
        kind = "UsageError" if isinstance(e, _UsageError) else type(e).__name__
        print(json.dumps({"error": {"type": kind, "message": text, "path": _error_path(args, text)}}, indent=2))
    if isinstance(e, _UsageError):
        print(text, file=sys.stderr)
        return
    hint = "" if known or (args is not None and args.debug) else " (run with --debug for a traceback)"
    print(f"shardsafe {command}: error: {text}{hint}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    Every failure exits 2 (1 is for damage or differences found): a line on stderr, and with
    ``--json`` one ``{"error": {"type", "message", "path"}}`` object on stdout."""
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv[: argv.index("--")] if "--" in argv else "--json" in argv
    try:
        args = _parser().parse_args(argv)
    except _UsageError as e:
        _report_error(None, "", e, as_json=as_json)
        return EXIT_ERROR
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
    out = _Out(args)
    try:
        return args.run(args, out)
    except KeyboardInterrupt:
        print(f"shardsafe {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly, as a Unix tool would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's last flush must not fail again
        return EXIT_BROKEN_PIPE
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - a CheckpointError; else a bug, or a BaseException a dependency raised (torch's CheckpointException)
        if args.debug:
            traceback.print_exc()
        _report_error(args, args.command, e, as_json=args.json)
    return EXIT_ERROR


def entry_point() -> None:  # the console script
    sys.exit(main())


if __name__ == "__main__":
    entry_point()

