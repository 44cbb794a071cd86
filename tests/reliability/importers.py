"""Importer campaign: other projects' checkpoints, damaged as an attacker would, through every
importer and every command-line subcommand.

Six real folders are written first (each importer's input, as its library writes it): a DCP
folder (``dcp.save``: tensors and a non-tensor value), a Lightning sharded folder (DCP and
``meta.pt``), a megatron-core ``torch_dist`` folder (DCP, ``common.pt``,
Megatron's ``metadata.json``), megatron-core's ``zarr`` fixture (``.zarray`` arrays, chunk files,
``shard_*.pt`` ShardedObjects), a Hugging Face ``model.safetensors`` and a sharded Hugging Face
folder with its ``model.safetensors.index.json``. Hypothesis then draws structure-aware
mutations of one of them:

- ``.metadata`` (unpickled, edited, pickled again): an item's offset, length (up to ``2**50``)
  or data file name (``../x``, ``/etc/passwd``, ``.metadata``...), a tensor's size, a chunk's
  offsets or sizes, its dtype; the whole file replaced by a pickle payload; a stored value
  (a DCP value, a ShardedObject) pointed at a ``torch.save`` of a payload appended to its file;
- JSON (Megatron's ``metadata.json``, each ``.zarray``, the HF index): any value replaced by a
  hostile one (huge numbers, wrong types, nesting 100000 deep, ``zarr`` as the backend, names
  that leave the folder);
- safetensors headers: any value replaced, two tensors made to overlap, length bombs;
- any file: truncated, a byte flipped, grown sparse to 1 TiB, deleted, replaced by a link to a
  copy outside the folder; ``.pt`` files (``common.pt``, ``meta.pt``, ``shard_*.pt``) replaced by
  a pickle payload.

A payload, when run, creates a marker file. Every path runs in the sandbox
(:mod:`tests.reliability.sandbox`: bounded memory and time, every ``open`` audited): the kind's
importers (``shardsafe.dcp.convert``, ``shardsafe.lightning.consolidate``,
``convert_megatron``, ``load_plain_tensors``, ``load_common_state_dict``,
``load_sharded_metadata``, ``convert_hf``, ``load_hf_safetensors``) and each CLI subcommand
(``inspect``, ``verify``, ``diff``, ``export``, ``consolidate``, ``convert --from <kind>``) with
``--json``. Good outcomes: ``detected`` (a ``CheckpointError``; for the CLI exit 2 and one JSON
error object), ``accepted`` (no error; foreign formats carry no checksums, so damaged data
bytes may load). Bad: ``foreign-exception:<type>``, ``memory-bound``, ``hang``,
``worker-crash``, ``outside-access``, ``pickle-ran`` and ``cli-contract:<why>`` (stdout not
one JSON document, an exit code outside 0/1/2, an error object without type, message, path).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import shutil
import struct

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from .fuzz_metadata import DEEP, NUMBERS, STRINGS, _dump, _paths, _read_header, _set, _write_header
from .report import Report
from .sandbox import Result, campaign

__all__ = ["KINDS", "build_foreign", "run_importers"]

KINDS = ("dcp", "lightning", "torch_dist", "zarr", "hf", "hf_sharded")
ZARR_FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "megatron_zarr")
CLI = ("inspect", "verify", "diff", "export", "consolidate", "convert")
API = {
    "dcp": ("dcp-convert",),
    "lightning": ("dcp-convert", "consolidate"),
    "torch_dist": ("megatron-convert", "plain", "common", "sharded-metadata"),
    "zarr": ("megatron-convert", "plain", "common", "sharded-metadata"),
    "hf": ("hf-convert", "hf-load"),
    "hf_sharded": ("hf-convert", "hf-load"),
}
FROM = {"dcp": "dcp", "lightning": "dcp", "torch_dist": "megatron", "zarr": "megatron", "hf": "hf", "hf_sharded": "hf"}
MARKER = "PAYLOAD-RAN"
LENGTHS = [0, 1, 7, 2**31, 2**40, 2**50, 2**62 - 1, -1]
FILE_NAMES = ["../x.distcp", "/etc/passwd", "a/b", ".metadata", "..", "", "x\x00", "OUTSIDE"]
HOSTILE_JSON = [*NUMBERS, *STRINGS[:9], None, True, [], {}, DEEP, [10**12], [1], "zarr", "torch_dist", "../outside.safetensors"]


class Payload:
    """Unpickling it creates ``marker`` (nothing in a checkpoint may ever be unpickled that way)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


# ------------------------------------------------------------------ the folders


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 6, generator=g), "b": torch.randn(5, generator=g).bfloat16()}


def build_foreign(root: str) -> dict[str, str]:
    """Write one folder of every kind under ``root``; kind -> its location."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from shardsafe.megatron import CheckpointingConfig
    from shardsafe.megatron.core import save_config

    out = {k: os.path.join(root, k) for k in KINDS}
    writer = dcp.FileSystemWriter
    dcp.save({**_state(), "step": 3}, storage_writer=writer(out["dcp"]), no_dist=True)
    dcp.save({**_state(), "step": 3}, storage_writer=writer(out["lightning"]), no_dist=True)
    torch.save({"epoch": 1, "global_step": 4}, os.path.join(out["lightning"], "meta.pt"))
    dcp.save(_state(), storage_writer=writer(out["torch_dist"]), no_dist=True)  # (ShardedObjects: the zarr fixture's shard_*.pt)
    torch.save({"iteration": 7}, os.path.join(out["torch_dist"], "common.pt"))
    save_config(CheckpointingConfig("torch_dist"), out["torch_dist"])
    shutil.copytree(ZARR_FIXTURE, out["zarr"])
    os.makedirs(out["hf"])
    save_file(_state(), os.path.join(out["hf"], "model.safetensors"))
    os.makedirs(out["hf_sharded"])
    s = _state()
    save_file({"w": s["w"]}, os.path.join(out["hf_sharded"], "model-00001-of-00002.safetensors"))
    save_file({"b": s["b"]}, os.path.join(out["hf_sharded"], "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    with open(os.path.join(out["hf_sharded"], "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return out


def _files(directory: str) -> list[str]:
    """Every file under ``directory``, relative, sorted."""
    found = []
    for path, _dirs, files in os.walk(directory):
        found += [os.path.relpath(os.path.join(path, f), directory) for f in files]
    return sorted(found)


# ------------------------------------------------------------------ mutations


def mutations(folders: dict[str, str]) -> st.SearchStrategy:
    files = {k: _files(d) for k, d in folders.items()}
    metas = {}
    for k in ("dcp", "lightning", "torch_dist"):
        with open(os.path.join(folders[k], ".metadata"), "rb") as f:
            metas[k] = pickle.load(f)  # our own file, just written
    jsons = {k: [f for f in files[k] if f.endswith((".json", ".zarray"))] for k in KINDS}
    headers = {k: [f for f in files[k] if f.endswith(".safetensors")] for k in KINDS}

    @st.composite
    def one(draw):
        kind = draw(st.sampled_from(KINDS))
        ops = ["truncate", "flip", "sparse", "symlink", "delete"]
        ops += ["payload"] if any(f.endswith((".pt", ".metadata")) for f in files[kind]) else []
        ops += ["dcp-item", "dcp-tensor"] if kind in metas else []
        ops += ["payload-item"] if kind in ("dcp", "lightning") else []  # the ones holding a stored value
        ops += ["json"] * 2 if jsons[kind] else []
        ops += ["header", "overlap", "bomb"] if headers[kind] else []
        op = draw(st.sampled_from(ops))
        if op in ("truncate", "flip", "sparse", "symlink", "delete"):
            return (kind, op, draw(st.sampled_from(files[kind])), draw(st.floats(0, 1)), draw(st.integers(1, 255)))
        if op == "payload":
            return (kind, op, draw(st.sampled_from([f for f in files[kind] if f.endswith((".pt", ".metadata"))])))
        if op == "dcp-item":
            n = len(metas[kind].storage_data)
            field = draw(st.sampled_from(["offset", "length", "relative_path"]))
            value = draw(st.sampled_from(FILE_NAMES if field == "relative_path" else LENGTHS) | (st.integers(-1, 5000) if field != "relative_path" else st.nothing()))
            return (kind, op, draw(st.integers(0, n - 1)), field, value)
        if op == "dcp-tensor":
            key = draw(st.sampled_from(sorted(k for k, v in metas[kind].state_dict_metadata.items() if hasattr(v, "chunks"))))
            field = draw(st.sampled_from(["size", "chunk_offsets", "chunk_sizes", "dtype"]))
            return (kind, op, key, field, draw(st.integers(0, 1)), draw(st.sampled_from([0, 1, 2, 7, 2**20, 2**40, 2**61])))
        if op == "payload-item":
            return (kind, op)
        if op == "json":
            file = draw(st.sampled_from(jsons[kind]))
            with open(os.path.join(folders[kind], file), "rb") as f:
                doc = json.load(f)
            paths = _paths(doc) or [()]
            return (kind, op, file, draw(st.sampled_from(paths)), draw(st.sampled_from(HOSTILE_JSON) | st.integers()))
        file = draw(st.sampled_from(headers[kind]))
        if op == "header":
            _, header = _read_header(os.path.join(folders[kind], file))
            return (kind, op, file, draw(st.sampled_from(_paths(header))), draw(st.sampled_from(HOSTILE_JSON) | st.integers()))
        if op == "overlap":
            return (kind, op, file, draw(st.integers(-8, 8)))
        return (kind, op, file, draw(st.sampled_from([2**60, 2**64 - 1, 100_000_001, 0, 1, 7])))

    return one()


def apply(mutation: tuple, directory: str, outside: str, marker: str) -> None:
    """Apply ``mutation`` to the copy at ``directory``; ``outside`` is a folder beside it."""
    kind, op, *args = mutation
    if op in ("truncate", "flip", "sparse", "symlink", "delete"):
        rel, where, xor = args
        path = os.path.join(directory, rel)
        size = os.path.getsize(path)
        if op == "truncate":
            os.truncate(path, int(size * where))
        elif op == "flip" and size:
            with open(path, "r+b") as f:
                f.seek(min(int(size * where), size - 1))
                b = f.read(1)[0]
                f.seek(-1, 1)
                f.write(bytes([b ^ xor]))
        elif op == "sparse":
            os.truncate(path, 2**40)
        elif op == "symlink":
            copy = os.path.join(outside, rel.replace("/", "_"))
            shutil.copy(path, copy)
            os.unlink(path)
            os.symlink(copy, path)
        elif op == "delete":
            os.unlink(path)
    elif op == "payload":
        (rel,) = args
        path = os.path.join(directory, rel)
        if rel.endswith(".metadata"):
            with open(path, "wb") as f:
                pickle.dump(Payload(marker), f)
        else:
            torch.save({"x": Payload(marker)}, path)
    elif op in ("dcp-item", "dcp-tensor", "payload-item"):
        _edit_dcp(directory, op, args, outside, marker)
    elif op == "json":
        rel, at, value = args
        path = os.path.join(directory, rel)
        with open(path, "rb") as f:
            doc = json.load(f)
        if at:
            _set(doc, at, value)
        else:
            doc = value
        with open(path, "wb") as f:
            f.write(_dump(doc))
    elif op == "header":
        rel, at, value = args
        path = os.path.join(directory, rel)
        n, header = _read_header(path)
        _set(header, at, value)
        _write_header(path, n, _dump(header))
    elif op == "overlap":
        rel, delta = args
        path = os.path.join(directory, rel)
        n, header = _read_header(path)
        entries = [k for k in header if k != "__metadata__"]
        if entries:
            first = header[entries[0]]["data_offsets"]
            header[entries[-1]]["data_offsets"] = [max(first[0] + delta, 0), max(first[0] + delta, 0) + first[1] - first[0]]
            _write_header(path, n, _dump(header))
    else:  # bomb
        rel, value = args
        with open(os.path.join(directory, rel), "r+b") as f:
            f.write(struct.pack("<Q", value))


def _edit_dcp(directory: str, op: str, args: list, outside: str, marker: str) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = os.path.join(directory, ".metadata")
    with open(path, "rb") as f:
        meta = pickle.load(f)  # the copy of our own file, before any mutation
    if op == "dcp-item":
        i, field, value = args
        index = sorted(meta.storage_data, key=lambda x: (x.fqn, tuple(x.offset or ())))[i]
        if value == "OUTSIDE":
            info = meta.storage_data[index]
            shutil.copy(os.path.join(directory, info.relative_path), os.path.join(outside, info.relative_path))
            value = f"../{os.path.basename(outside)}/{info.relative_path}"
        meta.storage_data[index] = dataclasses.replace(meta.storage_data[index], **{field: value})
    elif op == "dcp-tensor":
        key, field, dim, value = args
        md = meta.state_dict_metadata[key]
        if field == "dtype":
            md.properties.dtype = [torch.complex128, torch.quint8, torch.bool, torch.float64][value % 4]
        elif field == "size":
            size = list(md.size)
            size[dim % len(size)] = value
            md.size = torch.Size(size)
        else:
            chunk = md.chunks[0]
            name = "offsets" if field == "chunk_offsets" else "sizes"
            v = list(getattr(chunk, name))
            v[dim % len(v)] = value
            object.__setattr__(chunk, name, torch.Size(v))
    else:  # payload-item: a stored value pointed at a torch.save of a payload appended to its file
        key = next(k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
        index = next(i for i in meta.storage_data if i.fqn == key)
        info = meta.storage_data[index]
        buf = io.BytesIO()
        torch.save(Payload(marker), buf)
        data_path = os.path.join(directory, info.relative_path)
        start = os.path.getsize(data_path)
        with open(data_path, "ab") as f:
            f.write(buf.getvalue())
        meta.storage_data[index] = dataclasses.replace(info, offset=start, length=len(buf.getvalue()))
    with open(path, "wb") as f:
        pickle.dump(meta, f)


# ------------------------------------------------------------------ what runs in the sandbox


def run_api(kind: str, path: str, directory: str, out: str) -> str:
    """Run importer ``path`` on ``directory`` (holding a ``kind`` folder); returns a summary."""
    target = os.path.join(out, "converted")
    if path == "dcp-convert":
        import shardsafe.dcp

        meta = shardsafe.dcp.convert(directory, target)
        return f"{len(meta.tensors)} tensors"
    if path == "consolidate":
        import shardsafe.lightning

        counts = shardsafe.lightning.consolidate(directory, os.path.join(out, "out.ckpt"))
        return f"{counts['tensors']} tensors"
    if path == "megatron-convert":
        from shardsafe.megatron import convert_megatron

        return f"{len(convert_megatron(directory, target).tensors)} tensors"
    if path == "plain":
        from shardsafe.megatron import load_plain_tensors

        return f"{len(load_plain_tensors(directory))} tensors"
    if path == "common":
        from shardsafe.megatron import load_common_state_dict

        return f"{len(load_common_state_dict(directory))} values"
    if path == "sharded-metadata":
        from shardsafe.megatron import load_sharded_metadata

        return f"{len(load_sharded_metadata(directory))} entries"
    if path == "hf-convert":
        from shardsafe.convert import convert_hf

        return f"{convert_hf(directory, target)['tensors']} tensors"
    if path == "hf-load":
        import shardsafe

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = torch.nn.Parameter(torch.zeros(4, 6))
                self.b = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))

        return f"{shardsafe.load_hf_safetensors(directory, Model())} bytes"
    raise ValueError(path)


def run_cli(command: str, kind: str, directory: str, out: str) -> tuple[int, str]:
    """The CLI's exit code and stdout for ``command`` with ``--json`` on ``directory``."""
    from shardsafe.cli import main

    argv = {
        "inspect": ["inspect", directory],
        "verify": ["verify", directory, "--all"],
        "diff": ["diff", directory, directory],
        "export": ["export", directory, os.path.join(out, "x.safetensors")],
        "consolidate": ["consolidate", directory, os.path.join(out, "x.ckpt")],
        "convert": ["convert", directory, os.path.join(out, "cli-converted"), "--from", FROM[kind]],
    }[command]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["--json", *argv])
    return code, stdout.getvalue()


def cli_outcome(code: int, stdout: str) -> str:
    """``detected`` / ``accepted`` when the CLI kept its contract, else ``cli-contract:<why>``."""
    if code not in (0, 1, 2):
        return f"cli-contract:exit-{code}"
    try:
        doc = json.loads(stdout)
    except ValueError:
        return "cli-contract:stdout-not-one-json-document"
    if code == 2:
        err = doc.get("error") if isinstance(doc, dict) else None
        if list(doc) != ["error"] or not isinstance(err, dict) or sorted(err) != ["message", "path", "type"]:
            return "cli-contract:bad-error-object"
        return "detected"
    return "cli-contract:error-object-on-success" if isinstance(doc, dict) and "error" in doc else "accepted"


def outcome(res: Result, ran: bool, *, cli: bool) -> str:
    if ran:
        return "pickle-ran"
    abnormal = res.abnormal()
    if abnormal is not None:
        return abnormal
    if res.kind == "raised":
        return res.bounded_error()
    return cli_outcome(*res.value) if cli else "accepted"


def _short(mutation: tuple) -> str:
    text = repr(mutation)
    return text if len(text) < 300 else text[:150] + " ... " + text[-100:]


def run_importers(trials: int, seed_: int, *, workdir: str | None = None, timeout: float = 30.0) -> Report:
    """Run ``trials`` hypothesis examples; see the module docstring."""
    with campaign("importers", workdir, timeout=timeout) as (report, root, box):
        folders = build_foreign(os.path.join(root, "base"))
        counter = [0]

        @seed(seed_)
        @settings(max_examples=trials, database=None, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(mutation=mutations(folders))
        def trial(mutation: tuple) -> None:
            kind = mutation[0]
            counter[0] += 1
            base = os.path.join(root, f"t{counter[0]}")
            directory, outside, out = (os.path.join(base, n) for n in ("ckpt", "outside", "out"))
            marker = os.path.join(base, MARKER)
            shutil.copytree(folders[kind], directory)
            os.makedirs(outside)
            apply(mutation, directory, outside, marker)
            calls = [(p, False) for p in API[kind]] + [(c, True) for c in CLI]
            for path, cli in calls:
                os.makedirs(out, exist_ok=True)
                if cli:
                    res = box.call(run_cli, path, kind, directory, out, roots=[directory, out])
                else:
                    res = box.call(run_api, kind, path, directory, out, roots=[directory, out])
                ran = os.path.exists(marker)
                got = outcome(res, ran, cli=cli)
                why = ", ".join(res.outside) if res.outside else f"{res.error_type}: {str(res.message or res.value or '')[:300]}"
                report.add(got, f"{_short(mutation)} -> {why}", path=f"{kind}/{'cli-' if cli else ''}{path}")
                if ran:
                    os.unlink(marker)
                shutil.rmtree(out, ignore_errors=True)
            report.trials += 1
            report.notes[f"trials:{kind}"] += 1
            shutil.rmtree(base, ignore_errors=True)

        trial()
    return report
