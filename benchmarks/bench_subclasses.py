"""Saving and loading a model with torchao's 8-bit optimizer state against the same model with
plain AdamW state, per byte of checkpoint, in one run; torch.distributed.checkpoint measured on
both beside it (issue 25: "costs no more per byte than a plain one").

One process, a local directory (the page cache warm for every repetition, as for every
method; before each save, untimed, ``os.sync()`` writes back what the last one left dirty).
Each method saves the same model and optimizer ``--reps`` times (overwriting) and loads it back
in place three times as often, the methods interleaved (the order rotated each repetition); the
medians are reported. Prints a table and one line:

    SUBCLASS save_per_byte_x=... load_per_byte_x=... dcp_save_per_byte_x=... dcp_load_per_byte_x=... target_save<=1.0x:ok ...

``*_per_byte_x`` = (seconds per byte with 8-bit state) / (seconds per byte with plain state).
``--wide W [W ...]`` measures 2 x Linear(W, W) too (fields end in ``_wW``): larger tensors, whose
fixed costs weigh less (an 8-bit state is three tensors, each smaller, where plain state has one).
Given two widths, ``*_slope_x`` is the marginal cost of a byte, 8-bit over plain: between the two
widths the checkpoints hold the same tensors and only their bytes grow, so every fixed cost (per
load, per tensor) cancels.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # torchao's optimizer step compiles itself; eager here

import torch  # noqa: E402

import shardsafe  # noqa: E402


def _model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _optim(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "plain":
        return torch.optim.AdamW(model.parameters())
    from torchao.optim import AdamW8bit

    return AdamW8bit(model.parameters())


def _stepped(kind: str, layers: int, width: int):
    m = _model(layers, width)
    o = _optim(kind, m)
    m(torch.randn(4, width)).sum().backward()
    o.step()
    o.zero_grad()
    return m, o


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _tensors(lib: str, path: str) -> int:
    """How many tensors the checkpoint stores (an 8-bit state is three: codes, scales, table)."""
    if lib == "shardsafe":
        with open(os.path.join(path, "metadata.json"), "rb") as f:
            return len(json.load(f)["tensors"])
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(path).read_metadata().state_dict_metadata
    return sum(isinstance(v, TensorStorageMetadata) for v in md.values())


class _Method:
    """One library saving and loading one kind of optimizer state: a save and a load callable,
    and the checkpoint they write."""

    def __init__(self, lib: str, kind: str, root: str, layers: int, width: int) -> None:
        self.lib, self.name, self.path = lib, f"{lib} {kind}", os.path.join(root, f"{lib}-{kind}")
        m, o = _stepped(kind, layers, width)
        m2, o2 = _stepped(kind, layers, width)  # targets allocated once: every load fills the same memory
        if lib == "shardsafe":
            self.save = lambda: shardsafe.save_model_and_optim_state(self.path, m, o, save_overwrite=True)
            self.load = lambda: shardsafe.load_model_and_optim_state(self.path, m2, o2)
        else:
            import torch.distributed.checkpoint as dcp

            target = {"model": m2.state_dict(), "optim": o2.state_dict()}

            def save() -> None:
                shutil.rmtree(self.path, ignore_errors=True)
                dcp.save({"model": m.state_dict(), "optim": o.state_dict()}, checkpoint_id=self.path, no_dist=True)

            self.save = save
            self.load = lambda: dcp.load(target, checkpoint_id=self.path, no_dist=True)
        self.times: dict[str, list[float]] = {"save": [], "load": []}
        self.failed: str | None = None

    def run(self, op: str) -> None:
        if self.failed is not None:
            return
        if op == "save":  # untimed: the last save's dirty pages are written back before this one starts,
            os.sync()  # not while it runs (a 1.6 GB save took 1.47 s in one run and 2.56 s in the next)
        t = time.perf_counter()
        try:
            getattr(self, op)()
        except Exception as e:  # the peer's failure is a result: reported, not raised
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            return
        self.times[op].append(time.perf_counter() - t)

    def result(self) -> tuple[float, float, int, int] | str:
        if self.failed is not None:
            return self.failed
        return statistics.median(self.times["save"]), statistics.median(self.times["load"]), _size(self.path), _tensors(self.lib, self.path)


def _interleaved(methods: list[_Method], reps: int) -> None:
    """Each repetition runs every method once, the order rotated, so that a machine whose load
    drifts slows every method alike: saves first (the last one of each method is what loads read),
    then three times as many loads (a load takes a tenth of a save's time, and varies as much)."""
    for op, n in (("save", reps), ("load", 3 * reps)):
        for rep in range(n):
            k = rep % len(methods)
            for method in methods[k:] + methods[:k]:
                method.run(op)


def _measure(layers: int, width: int, reps: int) -> dict[tuple[str, str], tuple[float, float, int, int] | str]:
    root = tempfile.mkdtemp(prefix="bench-subclasses-")
    try:
        methods = [_Method(lib, kind, root, layers, width) for lib in ("shardsafe", "dcp") for kind in ("plain", "8bit")]
        _interleaved(methods, reps)
        return {tuple(m.name.split()): m.result() for m in methods}  # type: ignore[misc]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _target(name: str, value: str) -> str:
    return f"target_{name}<=1.0x:{'ok' if value != 'fails' and float(value) <= 1.0 else 'MISS'}"


def _report(rows: dict, layers: int, width: int, reps: int, suffix: str) -> tuple[dict[str, str], list[str]]:
    """Print the table for one model; its fields (names ending in ``suffix``) and targets."""
    params = layers * (width * width + width)
    print(f"model: {layers} x Linear({width}, {width}), {params * 4 / 2**20:.1f} MiB of fp32 parameters; "
          f"median of {reps} saves and {3 * reps} loads, interleaved")
    print(f"{'method':<22}{'bytes':>14}{'tensors':>9}{'save s':>10}{'load s':>10}{'save GB/s':>11}{'load GB/s':>11}")
    for (lib, kind), r in rows.items():
        if isinstance(r, str):
            print(f"{lib + ' ' + kind:<22}  fails: {r}")
            continue
        s, ld, n, count = r
        print(f"{lib + ' ' + kind:<22}{n:>14}{count:>9}{s:>10.3f}{ld:>10.3f}{n / s / 1e9:>11.2f}{n / ld / 1e9:>11.2f}")

    def per_byte(lib: str, which: int) -> str:
        a, b = rows[lib, "8bit"], rows[lib, "plain"]
        if isinstance(a, str) or isinstance(b, str):
            return "fails"
        return f"{(a[which] / a[2]) / (b[which] / b[2]):.2f}"

    fields = {
        "save_per_byte_x": per_byte("shardsafe", 0), "load_per_byte_x": per_byte("shardsafe", 1),
        "dcp_save_per_byte_x": per_byte("dcp", 0), "dcp_load_per_byte_x": per_byte("dcp", 1),
    }
    for lib in ("shardsafe", "dcp"):
        r8 = rows[lib, "8bit"]
        if not isinstance(r8, str):
            fields[f"{lib}_8bit_bytes"] = str(r8[2])
    targets = [_target(op + suffix, fields[f"{op}_per_byte_x"]) for op in ("save", "load")]
    return {k + suffix: v for k, v in fields.items()}, targets


def _slopes(small: dict, large: dict) -> tuple[dict[str, str], list[str]]:
    """The marginal cost of a byte: (seconds, bytes) of the same two-layer model at two widths,
    whose checkpoints hold the same tensors (so every fixed cost, per load and per tensor,
    cancels): (t_large - t_small) / (bytes_large - bytes_small), 8-bit over plain."""

    def slope(lib: str, kind: str, which: int) -> float | None:
        a, b = small[lib, kind], large[lib, kind]
        if isinstance(a, str) or isinstance(b, str) or b[2] <= a[2]:
            return None
        return (b[which] - a[which]) / (b[2] - a[2])

    fields = {}
    for lib, prefix in (("shardsafe", ""), ("dcp", "dcp_")):
        for op, which in (("save", 0), ("load", 1)):
            q, p = slope(lib, "8bit", which), slope(lib, "plain", which)
            fields[f"{prefix}{op}_slope_x"] = "fails" if q is None or p is None or p <= 0 else f"{q / p:.2f}"
    return fields, [_target(f"{op}_slope", fields[f"{op}_slope_x"]) for op in ("save", "load")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--wide", type=int, nargs="*", default=[], metavar="W",
                    help="also measure 2 x Linear(W, W) for each W: larger tensors, whose fixed costs (8-bit state "
                    "stores 3 tensors where plain state stores 1) weigh less (fields end in _wW)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a small model, 2 repetitions (the smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.width, args.reps, args.wide = 2, 256, 2, []
    fields, targets = _report(_measure(args.layers, args.width, args.reps), args.layers, args.width, args.reps, "")
    wide = []
    for w in args.wide:
        rows = _measure(2, w, args.reps)
        more, more_targets = _report(rows, 2, w, args.reps, f"_w{w}")
        fields.update(more)
        targets += more_targets
        wide.append(rows)
    if len(wide) >= 2:  # the first two widths: the cost of a byte with every fixed cost cancelled
        more, more_targets = _slopes(wide[0], wide[1])
        fields.update(more)
        targets += more_targets
    print("SUBCLASS " + " ".join(f"{k}={v}" for k, v in fields.items()) + " " + " ".join(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
