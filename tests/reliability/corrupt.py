"""Corruption campaign: damage one byte (or the tail) of a checkpoint, then read it every way there is.

Each trial copies one of the saved checkpoints (:func:`~tests.reliability.states.build_cases`),
and either flips one random byte of a chunk's data, of a safetensors header, of a data file's
``__shardsafe_checksums__`` entry (format v3: the digests of its chunks' blocks) or of
``metadata.json``, or truncates one of those files at a random length. Every byte of a v3
checkpoint is live (the entries are back to back, the header and the checksum entry have digests
in ``metadata.json``), so ``verify`` must find every flip. Then every read path of
the case runs in the sandbox (same-layout loads, resharding loads, ``unshard``,
``unshard_to_safetensors``, the model/optimizer functions, ``verify``) and is classified:

- ``detected``: a ``CheckpointError`` whose message names the damaged file and, when the damage
  lies in chunks' data, one of their keys; else ``error-without-file`` / ``error-without-key``.
  A truncated v3 data file always loses (part of) its checksum entry, the last one, which a
  reader reads and checks whole before it uses any chunk of the file: that is damage to the file
  as a whole, and its error need name only the file;
- ``correct``: no error and every value bit-exact (the path never returned the damaged byte);
  not allowed for ``verify``, which must find any change to any file (``verify-missed``);
- ``silent-wrong-data``: no error, and a value differs from what was saved;
- ``foreign-exception:<type>``, ``memory-bound``, ``hang``, ``worker-crash``, ``outside-access``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass

from shardsafe import Checkpointer
from shardsafe.format.file_index import SUMS_ENTRY

from .paths import PATHS, run_path
from .report import Report
from .sandbox import Result, Sandbox, campaign
from .states import Case, build_cases, truth_files

__all__ = ["Damage", "classify", "run_corrupt"]

META = "metadata.json"
KINDS = ("data", "header", "sums", "metadata", "truncate")
WEIGHTS = (35, 15, 15, 20, 15)


@dataclass(frozen=True)
class Damage:
    """What a trial did: ``file`` damaged at ``offset`` (flip) or cut to ``offset`` bytes (truncate)."""

    kind: str
    file: str
    offset: int
    keys: tuple[str, ...]  # keys whose chunk data the damage touches (the message must name one)
    xor: int = 0

    def __str__(self) -> str:
        what = f"flip byte {self.offset} ^{self.xor:#04x}" if self.kind != "truncate" else f"truncate to {self.offset} bytes"
        return f"{self.kind}: {what} of {self.file}" + (f" (keys {list(self.keys)[:3]})" if self.keys else "")


@dataclass(frozen=True)
class _Layout:
    """Where things are in one saved checkpoint: files, sizes, headers, and each chunk's bytes."""

    sizes: dict[str, int]
    data_start: dict[str, int]  # data file -> first byte after its header
    sums: dict[str, tuple[int, int]]  # data file -> absolute byte range of its checksum entry (v3; absent before)
    chunks: dict[str, list[tuple[int, int, str]]]  # data file -> (start, end, key)


def _layout(case: Case) -> _Layout:
    meta = Checkpointer().get_metadata(case.dir, no_dist=True)
    chunks: dict[str, list[tuple[int, int, str]]] = {}
    for key, t in meta.tensors.items():
        for file, spec in t.chunks():
            chunks.setdefault(file, []).append((spec.byte_range[0], spec.byte_range[1], key))
    sizes = {name: os.path.getsize(os.path.join(case.dir, name)) for name in [META, *chunks]}
    starts, sums = {}, {}
    for file in chunks:
        with open(os.path.join(case.dir, file), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        starts[file] = 8 + n
        if SUMS_ENTRY in header:
            begin, end = header[SUMS_ENTRY]["data_offsets"]
            sums[file] = (8 + n + begin, 8 + n + end)
    return _Layout(sizes, starts, sums, {f: sorted(c) for f, c in sorted(chunks.items())})


def draw_damage(rng: random.Random, lay: _Layout, kind: str | None = None) -> Damage:
    """A random damage of ``lay``'s checkpoint: of kind ``kind``, or of one drawn with ``WEIGHTS``."""
    kind = kind or rng.choices(KINDS, WEIGHTS)[0]
    xor = rng.randrange(1, 256)
    files = sorted(lay.chunks)
    if kind == "data":
        spans = [(s, e, k, f) for f in files for s, e, k in lay.chunks[f] if e > s]
        s, e, key, file = rng.choice(spans)
        return Damage(kind, file, rng.randrange(s, e), (key,), xor)
    if kind == "header":
        file = rng.choice(files)
        return Damage(kind, file, rng.randrange(0, lay.data_start[file]), (), xor)
    if kind == "sums":
        file = rng.choice([f for f in files if lay.sums.get(f, (0, 0))[1] > lay.sums.get(f, (0, 0))[0]])
        return Damage(kind, file, rng.randrange(*lay.sums[file]), (), xor)
    if kind == "metadata":
        return Damage(kind, META, rng.randrange(0, lay.sizes[META]), (), xor)
    file = rng.choice([META, *files])
    cut = rng.randrange(0, lay.sizes[file])
    # v3: the checksum entry is last, so any cut damages it and the file fails as a whole
    cut_data = file != META and cut >= lay.data_start[file] and file not in lay.sums
    keys = tuple(sorted({k for s, e, k in lay.chunks.get(file, []) if e > cut})) if cut_data else ()
    return Damage(kind, file, cut, keys)


def apply_damage(directory: str, damage: Damage) -> None:
    path = os.path.join(directory, damage.file)
    if damage.kind == "truncate":
        os.truncate(path, damage.offset)
        return
    with open(path, "r+b") as f:
        f.seek(damage.offset)
        byte = f.read(1)[0]
        f.seek(damage.offset)
        f.write(bytes([byte ^ damage.xor]))


def names(message: str, key: str) -> bool:
    """Whether an error message names ``key`` (quoted, as the library quotes keys)."""
    return f"'{key}'" in message or f'"{key}"' in message


def classify(path: str, res: Result, damage: Damage | None) -> str:
    """The outcome of read path ``path`` on a checkpoint with ``damage`` (None: undamaged)."""
    abnormal = res.abnormal()
    if abnormal is not None:
        return abnormal
    if res.kind == "raised":
        if not res.checkpoint_error:
            return res.bounded_error()
        if damage is None:
            return "error-on-intact-checkpoint"
        if damage.file not in res.message:
            return "error-without-file"
        if damage.keys and not any(names(res.message, k) for k in damage.keys):
            return "error-without-key"
        return "detected"
    if res.value:
        return "silent-wrong-data"
    if damage is not None and path == "verify":
        return "verify-missed"
    return "correct"


def run_corrupt(trials: int, seed: int, *, workdir: str | None = None, sandbox: Sandbox | None = None) -> Report:
    """Run ``trials`` damaged checkpoints through every read path; see the module docstring. The
    first ``len(cases) * len(KINDS)`` trials (15) damage every case in every way once."""
    rng = random.Random(seed)
    with campaign("corrupt", workdir, sandbox=sandbox) as (report, root, box):
        cases = build_cases(os.path.join(root, "saved"))
        layouts = {c.kind: _layout(c) for c in cases}
        out = os.path.join(root, "out")
        os.makedirs(out, exist_ok=True)
        for case in cases:  # undamaged, every path must return exactly what was saved
            for path in PATHS[case.kind]:
                res = box.call(run_path, case, path, out, roots=[case.dir, out, *truth_files(case)])
                outcome = classify(path, res, None)
                if outcome != "correct":
                    report.add(f"intact-{outcome}", f"{case.kind}: {res.error_type} {res.message or res.value}", path=path)
        pairs = len(cases) * len(KINDS)  # the first trials damage each case in each way once, then at random
        for trial in range(trials):
            case = cases[trial % len(cases)]
            damage = draw_damage(rng, layouts[case.kind], KINDS[trial // len(cases)] if trial < pairs else None)
            copy = os.path.join(root, f"trial-{trial}")
            shutil.copytree(case.dir, copy)
            apply_damage(copy, damage)
            for path in PATHS[case.kind]:
                res = box.call(run_path, case, path, out, copy, roots=[copy, out, *truth_files(case)])
                outcome = classify(path, res, damage)
                detail = res.message if res.kind != "returned" else (res.value or "returned without error")
                report.add(outcome, f"{case.kind}, {damage}: {res.error_type} {detail}".strip(), path=f"{damage.kind}/{path}")
            report.trials += 1
            shutil.rmtree(copy)
    return report
